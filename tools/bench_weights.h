/* bench_weights.h — `kvfold bench prefill --compare-weights` (tools/cmd_bench_weights.c). */
#ifndef KF_BENCH_WEIGHTS_H
#define KF_BENCH_WEIGHTS_H

#include <stdint.h>

/* The prefill of ids[n] (chunks of `chunk`) on the model in dir with bf16 and with fp32 weights,
 * `repeat` pairs alternated after a warm-up of each, timed by now() (seconds: wall, or the
 * process's CPU time); prints the report. Returns the exit status. */
int bench_weights_compare(const char *dir, const int32_t *ids, long long n, long long chunk, int repeat,
                          double (*now)(void));

#endif
