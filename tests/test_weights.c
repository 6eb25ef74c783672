/* bf16 weights on the CPU backend: the bundled models (bf16 checkpoints) loaded with bf16
 * storage give the logits of fp32 storage, and hold half the backend memory. The reference is
 * the fp32 path, whose logits the golden tests check against transformers. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "compactor/model.h"
#include "formats/safetensors.h"
#include "kernels/cpu/cpu_kernels.h"
#include "test_util.h"

/* Backend memory allocated through a backend (its alloc wrapped): bytes and count. */
static struct {
    void *(*alloc)(kf_backend *b, size_t bytes);
    long long bytes;
} g_count;

static void *counted_alloc(kf_backend *b, size_t bytes) {
    g_count.bytes += (long long)bytes;
    return g_count.alloc(b, bytes);
}

typedef struct {
    kf_backend *b;
    kf_model *m;
    long long load_bytes; /* backend memory allocated by the load: the weights */
} loaded;

static void load(loaded *l, const char *name, kf_weights w) {
    kf_error err = {0};
    l->b = kf_backend_cpu_create();
    CU_ASSERT_PTR_NOT_NULL_FATAL(l->b);
    g_count.alloc = l->b->alloc;
    g_count.bytes = 0;
    l->b->alloc = counted_alloc;
    const kf_model_opts o = {.weights = w};
    const kf_status st = kf_model_load_opts(&l->m, kf_test_data(name), l->b, &o, &err);
    if (st != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    l->load_bytes = g_count.bytes;
    l->b->alloc = g_count.alloc;
}

static void unload(loaded *l) {
    kf_model_free(l->m);
    l->b->destroy(l->b);
}

/* Logits of every one of ids[T] (chunks of 64), [T, vocab]. */
static float *logits_of(kf_model *m, const int32_t *ids, int T) {
    const int V = kf_model_config(m)->vocab_size;
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(m, &a, T, &err), KF_OK);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)T);    /* [T] */
    float *logits = malloc(sizeof(float) * (size_t)T * V); /* [T, V] */
    for (int i = 0; i < T; i++)
        rows[i] = i;
    kf_forward_args fa = {.ids = ids, .n_tokens = T, .chunk = 64, .logit_rows = rows, .n_logit_rows = T,
                          .logits = logits};
    CU_ASSERT_EQUAL(kf_model_forward(m, &a, &seq, &fa, &err), KF_OK);
    free(rows);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    return logits;
}

/* The model on bf16 and on fp32 storage over 300 tokens of records documents: the weights' backend
 * memory exactly half, and every logit equal bit for bit. The checkpoint's values are bf16, so
 * the widened tile holds the very floats the fp32 path holds, and the bundled models' matrices
 * each fit one tile: the same cblas_sgemm call as the fp32 path's. (Matrices of several tiles:
 * test_tiles below.) */
static void check_model(const char *name) {
    int32_t ids[300]; /* records documents 1, 2, ... up to 300 tokens: five chunks of 64 */
    int T = 0;
    for (int line = 1; T < 300; line++) {
        const int got = kf_test_records_ids(line, ids + T, 300 - T);
        CU_ASSERT_FATAL(got > 0);
        T += got;
    }
    loaded b16, f32;
    load(&b16, name, KF_WEIGHTS_AUTO);
    load(&f32, name, KF_WEIGHTS_F32);
    CU_ASSERT_EQUAL(kf_model_weight_dtype(b16.m), KF_DTYPE_BF16); /* AUTO on a bf16 checkpoint */
    CU_ASSERT_EQUAL(kf_model_weight_dtype(f32.m), KF_DTYPE_F32);
    const int64_t P = kf_model_n_params(f32.m);
    CU_ASSERT_EQUAL(f32.load_bytes, 4 * P);
    CU_ASSERT_EQUAL(b16.load_bytes, 2 * P);
    CU_ASSERT_EQUAL(kf_model_weight_bytes(b16.m), b16.load_bytes);
    CU_ASSERT_EQUAL(kf_model_weight_bytes(f32.m), f32.load_bytes);
    /* the memory formula's weights term (compact.h) is what the backend holds */
    const kf_compact_params p = kf_compact_params_default();
    kf_mem_shape sh;
    kf_mem_peak t32, t16;
    kf_compact_mem_shape(kf_model_config(f32.m), &p, 0, 200, 0, 2, &sh);
    kf_compact_peak_bytes(kf_model_config(f32.m), &sh, &t32);
    sh.weights_bf16 = 1;
    kf_compact_peak_bytes(kf_model_config(f32.m), &sh, &t16);
    CU_ASSERT_EQUAL(t32.weights, f32.load_bytes);
    CU_ASSERT_EQUAL(t16.weights, b16.load_bytes);
    CU_ASSERT(t16.forward > t32.forward); /* the widened tile */

    const int V = kf_model_config(f32.m)->vocab_size;
    float *x = logits_of(b16.m, ids, T), *y = logits_of(f32.m, ids, T);
    const size_t n = (size_t)T * V;
    size_t differ = 0;
    for (size_t i = 0; i < n; i++)
        differ += memcmp(&x[i], &y[i], sizeof(float)) != 0;
    printf("\n    %s: %d tokens, weights %lld bytes bf16 / %lld fp32; logits differing %zu of %zu "
           "(max abs %.2e, max |logit| %.1f)\n",
           name, T, b16.load_bytes, f32.load_bytes, differ, n, kf_max_abs_diff(x, y, n), kf_max_abs(y, n));
    CU_ASSERT_EQUAL(differ, 0);
    free(x);
    free(y);
    unload(&b16);
    unload(&f32);
}

/* A matrix of several tiles (and a last partial one) against kf_cpu_matmul on the same values,
 * strided x and y, with and without accumulation: bit for bit, since the tiles begin at multiples
 * of the fp32 GEMM's column group and its rows' bits depend on no call's shape (matmul.c); a
 * misplaced or mis-widened tile is off by the outputs' own size. */
static void test_tiles(void) {
    const int M = 7, K = 1000, N = 3 * kf_cpu_widen_rows(M, 1 << 30, K) + 37;
    const size_t ldx = K + 3, ldy = N + 5;
    float *x = malloc(sizeof(float) * M * ldx), *wf = malloc(sizeof(float) * (size_t)N * K); /* [M, ldx], [N, K] */
    uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)N * K);                               /* [N, K] */
    float *y = malloc(sizeof(float) * M * ldy), *z = malloc(sizeof(float) * M * ldy);       /* [M, ldy] each */
    kf_test_fill_uniform(x, (size_t)M * ldx, 1, -1, 1);
    kf_test_fill_uniform(wf, (size_t)N * K, 2, -1, 1);
    kf_f32_to_bf16_n(wb, wf, (size_t)N * K);
    kf_bf16_to_f32_n(wf, wb, (size_t)N * K); /* the same values in both storages */
    kf_cpu_widen s = {0};
    kf_cpu_mm_scratch mm = {0};
    for (int acc = 0; acc < 2; acc++) {
        kf_test_fill_uniform(y, (size_t)M * ldy, 3, -1, 1);
        memcpy(z, y, sizeof(float) * M * ldy);
        kf_cpu_matmul(y, ldy, x, ldx, wf, M, N, K, acc);
        CU_ASSERT_EQUAL_FATAL(kf_cpu_matmul_bf16(&s, &mm, z, ldy, x, ldx, wb, M, N, K, acc), 0);
        double d = 0, big = 0;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < (int)ldy; j++) {
                const size_t at = (size_t)i * ldy + j;
                if (j >= N) /* the padding is left alone */
                    CU_ASSERT(memcmp(&y[at], &z[at], sizeof(float)) == 0);
                d = fmax(d, fabs((double)y[at] - z[at]));
                big = fmax(big, fabs((double)y[at]));
            }
        printf("\n    %d x %d x %d in tiles of %d rows%s: max abs diff %.2e of %.1f", M, N, K,
               kf_cpu_widen_rows(M, N, K), acc ? ", accumulating" : "", d, big);
        CU_ASSERT(d == 0);
    }
    kf_cpu_mm_scratch_free(&mm);
    printf("\n");
    kf_cpu_widen_free(&s);
    free(x);
    free(wf);
    free(wb);
    free(y);
    free(z);
}

static void test_qwen_tiny(void) { check_model("hf-qwen3-tiny"); }
static void test_llama_tiny(void) { check_model("hf-llama3-tiny-random"); }
static void test_records_qwen(void) { check_model("records-qwen3"); }
static void test_records_llama(void) { check_model("records-llama3-induct"); }

/* --weights fp32 on a backend whose weights are fixed in another dtype is refused; AUTO keeps the
 * backend's own. */
static void test_fixed_backend(void) {
    kf_backend *b = kf_backend_cpu_create();
    b->set_weight_dtype = NULL; /* as CUDA: fixed (here fp32) */
    kf_model *m = NULL;
    kf_error err = {0};
    const kf_model_opts bf = {.weights = KF_WEIGHTS_BF16};
    CU_ASSERT_EQUAL(kf_model_load_opts(&m, kf_test_data("hf-qwen3-tiny"), b, &bf, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_PTR_NULL(m);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "cannot store weights in bf16"));
    CU_ASSERT_EQUAL(kf_model_load(&m, kf_test_data("hf-qwen3-tiny"), b, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_model_weight_dtype(m), KF_DTYPE_F32);
    kf_model_free(m);
    b->destroy(b);
    /* the CPU backend's dtype is fixed once it holds weights: a second model follows the first */
    b = kf_backend_cpu_create();
    kf_model *m2 = NULL;
    const kf_model_opts f32 = {.weights = KF_WEIGHTS_F32};
    CU_ASSERT_EQUAL(kf_model_load_opts(&m, kf_test_data("hf-qwen3-tiny"), b, &f32, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_model_load_opts(&m2, kf_test_data("hf-qwen3-tiny"), b, &bf, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_EQUAL(kf_model_load(&m2, kf_test_data("hf-llama3-tiny-random"), b, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_model_weight_dtype(m2), KF_DTYPE_F32);
    kf_model_free(m2);
    kf_model_free(m);
    b->destroy(b);
}

static void test_parse(void) {
    kf_weights w;
    CU_ASSERT(kf_weights_parse("auto", &w) == 0 && w == KF_WEIGHTS_AUTO);
    CU_ASSERT(kf_weights_parse("fp32", &w) == 0 && w == KF_WEIGHTS_F32);
    CU_ASSERT(kf_weights_parse("f32", &w) == 0 && w == KF_WEIGHTS_F32);
    CU_ASSERT(kf_weights_parse("bf16", &w) == 0 && w == KF_WEIGHTS_BF16);
    CU_ASSERT(kf_weights_parse("fp16", &w) != 0);
    kf_dtype dt;
    kf_error err = {0};
    kf_hfconfig c; /* a bf16 checkpoint's config, and the same claiming float32 */
    CU_ASSERT_EQUAL_FATAL(kf_hfconfig_load(&c, kf_test_data("hf-qwen3-tiny/config.json"), &err), KF_OK);
    CU_ASSERT(kf_weights_resolve(kf_test_data("hf-qwen3-tiny"), &c, KF_WEIGHTS_AUTO, &dt, &err) == KF_OK &&
              dt == KF_DTYPE_BF16);
    CU_ASSERT(kf_weights_resolve(kf_test_data("hf-qwen3-tiny"), &c, KF_WEIGHTS_F32, &dt, &err) == KF_OK &&
              dt == KF_DTYPE_F32);
    /* no checkpoint (a config alone): config.json's dtype stands for it */
    CU_ASSERT(kf_weights_resolve(kf_test_data("qwen3-0.6b-shape"), &c, KF_WEIGHTS_AUTO, &dt, &err) == KF_OK &&
              dt == KF_DTYPE_BF16);
    snprintf(c.dtype, sizeof c.dtype, "float32");
    CU_ASSERT(kf_weights_resolve(kf_test_data("qwen3-0.6b-shape"), &c, KF_WEIGHTS_AUTO, &dt, &err) == KF_OK &&
              dt == KF_DTYPE_F32);
    CU_ASSERT(kf_weights_resolve(kf_test_data("qwen3-0.6b-shape"), &c, KF_WEIGHTS_BF16, &dt, &err) == KF_OK &&
              dt == KF_DTYPE_BF16);
}

static CU_TestInfo tests[] = {
    {"a matrix of several tiles: kf_cpu_matmul's products", test_tiles},
    {"hf-qwen3-tiny: bf16 logits equal fp32's, half the memory", test_qwen_tiny},
    {"hf-llama3-tiny-random: the same", test_llama_tiny},
    {"records-qwen3: the same", test_records_qwen},
    {"records-llama3-induct: the same", test_records_llama},
    {"fixed weights (no setter, or weights already held): bf16 refused, auto keeps fp32", test_fixed_backend},
    {"--weights values; auto resolved from the checkpoint's dtypes", test_parse},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"weights", NULL, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
