/* test_util.h — shared helpers for the CUnit suites. */
#ifndef KF_TEST_UTIL_H
#define KF_TEST_UTIL_H

#include <CUnit/CUnit.h>
#include <stddef.h>
#include <stdint.h>

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

#endif
