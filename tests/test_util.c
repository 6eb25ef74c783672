#define _XOPEN_SOURCE 700 /* nftw */
#include "test_util.h"

#include <CUnit/Basic.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int kf_test_main(CU_SuiteInfo *suites) {
    if (CU_initialize_registry() != CUE_SUCCESS)
        return 2;
    if (CU_register_suites(suites) != CUE_SUCCESS) {
        fprintf(stderr, "cannot register suites: %s\n", CU_get_error_msg());
        CU_cleanup_registry();
        return 2;
    }
    CU_basic_set_mode(CU_BRM_VERBOSE);
    CU_basic_run_tests();
    unsigned failed = CU_get_number_of_failures() + CU_get_number_of_suites_failed();
    unsigned ran = CU_get_number_of_tests_run();
    CU_cleanup_registry();
    if (ran == 0) {
        fprintf(stderr, "no test ran\n");
        return 1;
    }
    return failed ? 1 : 0;
}

const char *kf_test_data(const char *rel) {
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", KF_TEST_DATA, rel);
    return path;
}

static char temp_root_path[256];
static pid_t temp_root_owner; /* forked children exit too: only the creator removes it */

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

/* The suite's scratch directory goes when the process ends (set KF_TEST_KEEP=1 to keep it). */
static void remove_temp_root(void) {
    const char *keep = getenv("KF_TEST_KEEP");
    if (temp_root_path[0] && getpid() == temp_root_owner && !(keep && *keep == '1'))
        nftw(temp_root_path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static const char *temp_root(void) {
    char *root = temp_root_path;
    if (!root[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(root, sizeof temp_root_path, "%s/kvfold-test-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(root)) {
            perror("mkdtemp");
            abort();
        }
        temp_root_owner = getpid();
        atexit(remove_temp_root);
    }
    return root;
}

const char *kf_test_write_file(const char *name, const void *bytes, size_t n) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", temp_root(), name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n) {
        perror(path);
        abort();
    }
    fclose(f);
    return path;
}

const char *kf_test_make_dir(const char *name) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", temp_root(), name);
    mkdir(path, 0755);
    return path;
}

int kf_test_records_ids(int line, int32_t *ids, int cap) {
    FILE *f = fopen(kf_test_data("records-dev.jsonl"), "r");
    if (!f)
        return -1;
    static char text[1 << 20];
    int ok = 1;
    for (int i = 0; i < line && ok; i++)
        ok = fgets(text, sizeof text, f) != NULL;
    fclose(f);
    char *p = ok ? strstr(text, "\"ids\": [") : NULL;
    if (!p)
        return -1;
    p += 8;
    int n = 0;
    while (*p && *p != ']' && n < cap) {
        ids[n++] = (int32_t)strtol(p, &p, 10);
        while (*p == ',' || *p == ' ')
            p++;
    }
    return n;
}

double kf_max_abs_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > m || isnan(d))
            m = isnan(d) ? INFINITY : d;
    }
    return m;
}

double kf_max_abs(const float *a, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fabs(a[i]) > m ? fabs(a[i]) : m;
    return m;
}

void kf_test_fill_uniform(float *x, size_t n, uint64_t seed, float lo, float hi) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = lo + (hi - lo) * (float)((s >> 40) / 16777216.0);
    }
}
