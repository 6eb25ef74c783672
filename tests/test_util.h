/* test_util.h — shared helpers for the CUnit suites. */
#ifndef KF_TEST_UTIL_H
#define KF_TEST_UTIL_H

#include <CUnit/CUnit.h>
#include <stddef.h>
#include <stdint.h>

#include "compactor/compact.h"

/* Registers the suites, runs them verbosely (CUnit prints its run summary), and returns the
 * process exit status: 0 when every assertion passed. */
int kf_test_main(CU_SuiteInfo *suites);

/* Path under tests/data (static buffer, valid until the next call). */
const char *kf_test_data(const char *rel);

/* Writes bytes to a fresh file in a per-process temp directory; returns its path (static until
 * the next call). */
const char *kf_test_write_file(const char *name, const void *bytes, size_t n);
/* A fresh empty directory under the temp directory. */
const char *kf_test_make_dir(const char *name);

/* The "ids" of line `line` (1-based) of tests/data/records-dev.jsonl into ids[cap]; returns the
 * count, or -1 when the file or the field is missing. */
int kf_test_records_ids(int line, int32_t *ids, int cap);

/* max |a - b| and max |b| over n values */
double kf_max_abs_diff(const float *a, const float *b, size_t n);
double kf_max_abs(const float *a, size_t n);

/* Deterministic uniform floats in [lo, hi). */
void kf_test_fill_uniform(float *x, size_t n, uint64_t seed, float lo, float hi);

/* A suite's model: a CPU backend and tests/data/<name> on it. 0, or -1 with the cause on stderr
 * (nothing left open). */
int kf_test_model_open(const char *name, kf_backend **b, kf_model **m);
/* Frees what kf_test_model_open made; returns 0 (a suite's clean-up). */
int kf_test_model_close(kf_backend *b, kf_model *m);

/* A planted head for the per-head choice (test_choice): T keys of which the first t are
 * kept; `dup`: the others copy the kept keys (mass the kept keys must carry) with different
 * values, else they point away from the queries (no mass). rtr training queries mu + noise;
 * validation queries val_sign * mu + noise; an appended block of comparable mass. Points into
 * itself: initialise it where it stays (kf_planted_init) and free it there (kf_planted_free). */
enum { KF_PLANT_T = 48, KF_PLANT_KEPT = 16, KF_PLANT_D = 8, KF_PLANT_RTR_MAX = 1000, KF_PLANT_RV = 100, KF_PLANT_NA = 16 };
typedef struct {
    float K[KF_PLANT_T * KF_PLANT_D], V[KF_PLANT_T * KF_PLANT_D]; /* [T, d] the head's keys and values */
    float Qtr[KF_PLANT_RTR_MAX * KF_PLANT_D];                     /* [rtr, d] training queries */
    float Qv[KF_PLANT_RV * KF_PLANT_D];                           /* [Rv, d] validation queries */
    float KA[KF_PLANT_NA * KF_PLANT_D], VA[KF_PLANT_NA * KF_PLANT_D]; /* [NA, d] the appended block */
    int32_t sel[KF_PLANT_KEPT];                                   /* [t] the kept keys: 0 .. t-1 */
    kf_kv_block orig, app;
    const kf_kv_block *apps[KF_PLANT_RV];                         /* [Rv] &app */
    kf_am_head h;                                                 /* over K, V, Qtr */
    kf_am_targets tg;                                             /* AM's targets of h (RMS scores) */
    kf_val_head vh;                                               /* validation over Qv */
    kf_compact_params p;                                          /* defaults, method fold, ridge_to */
} kf_planted_head;

/* Fills and sets up *ph (rtr <= KF_PLANT_RTR_MAX training rows); asserts (fatally) that the
 * targets and the validation head build. */
void kf_planted_init(kf_planted_head *ph, int dup, float val_sign, kf_ridge_target to, int rtr);
void kf_planted_free(kf_planted_head *ph);

#endif
