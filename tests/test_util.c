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

int kf_test_model_open(const char *name, kf_backend **b, kf_model **m) {
    kf_error err = {0};
    *m = NULL;
    *b = kf_backend_cpu_create();
    if (!*b) {
        fprintf(stderr, "%s: cannot create the CPU backend\n", name);
        return -1;
    }
    if (kf_model_load(m, kf_test_data(name), *b, &err) != KF_OK) {
        fprintf(stderr, "%s\n", err.msg);
        (*b)->destroy(*b);
        *b = NULL;
        return -1;
    }
    return 0;
}

int kf_test_model_close(kf_backend *b, kf_model *m) {
    kf_model_free(m);
    if (b)
        b->destroy(b);
    return 0;
}

void kf_planted_init(kf_planted_head *ph, int dup, float val_sign, kf_ridge_target to, int rtr) {
    enum { T = KF_PLANT_T, t = KF_PLANT_KEPT, d = KF_PLANT_D, Rv = KF_PLANT_RV, NA = KF_PLANT_NA };
    CU_ASSERT_FATAL(rtr > 0 && rtr <= KF_PLANT_RTR_MAX);
    float mu[d] = {0};
    kf_test_fill_uniform(ph->K, t * d, 431, -1, 1);
    kf_test_fill_uniform(ph->V, T * d, 432, -1, 1);
    kf_test_fill_uniform(ph->Qtr, (size_t)rtr * d, 433, -0.3f, 0.3f);
    kf_test_fill_uniform(ph->Qv, Rv * d, 434, -0.3f, 0.3f);
    kf_test_fill_uniform(ph->KA, NA * d, 435, -1, 1);
    kf_test_fill_uniform(ph->VA, NA * d, 436, -1, 1);
    mu[0] = 2.0f, mu[1] = 1.0f;
    for (int j = t; j < T; j++) /* the dropped keys: copies of the kept (mass to restore) or far away */
        for (int c = 0; c < d; c++)
            ph->K[j * d + c] = dup ? ph->K[(j % t) * d + c] : -6.0f * mu[c];
    for (int i = 0; i < rtr; i++)
        for (int c = 0; c < d; c++)
            ph->Qtr[i * d + c] += mu[c];
    for (int i = 0; i < Rv; i++)
        for (int c = 0; c < d; c++)
            ph->Qv[i * d + c] += val_sign * mu[c];
    ph->h = (kf_am_head){ph->K, d, ph->V, d, T, ph->Qtr, rtr, d, 1.0f, NULL};
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&ph->h, KF_SCORE_RMS, &ph->tg, &err), KF_OK);
    for (int j = 0; j < t; j++)
        ph->sel[j] = j;
    ph->orig = (kf_kv_block){ph->K, ph->V, d, NULL, T};
    ph->app = (kf_kv_block){ph->KA, ph->VA, d, NULL, NA};
    for (int i = 0; i < Rv; i++)
        ph->apps[i] = &ph->app;
    CU_ASSERT_EQUAL_FATAL(kf_val_head_init(&ph->vh, NULL, ph->Qv, Rv, d, 1.0f, NULL, &ph->orig, ph->apps, NULL, &err),
                          KF_OK);
    ph->p = kf_compact_params_default();
    ph->p.method = KF_METHOD_FOLD;
    ph->p.solver.ridge_to = to;
}

void kf_planted_free(kf_planted_head *ph) {
    kf_val_head_free(&ph->vh);
    kf_am_targets_free(&ph->tg);
}
