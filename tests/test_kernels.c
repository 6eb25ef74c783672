/* CPU kernels against naive double-precision references on random inputs, outputs poisoned
 * (NaN) first so that an element the kernel forgets to write fails the comparison. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"
#include "test_util.h"

static float *poisoned(size_t n) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        x[i] = NAN;
    return x;
}

static void test_bf16_f16_conversions(void) {
    /* every bf16 and f16 bit pattern survives a round trip through fp32 (NaNs stay NaN) */
    int bad_bf16 = 0, bad_f16 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kf_bf16_to_f32((uint16_t)h);
        uint16_t back = kf_f32_to_bf16(f);
        bad_bf16 += isnan(f) ? !isnan(kf_bf16_to_f32(back)) : back != h;
        float g = kf_f16_to_f32((uint16_t)h);
        uint16_t back16 = kf_f32_to_f16(g);
        bad_f16 += isnan(g) ? !isnan(kf_f16_to_f32(back16)) : back16 != h;
    }
    CU_ASSERT_EQUAL(bad_bf16, 0);
    CU_ASSERT_EQUAL(bad_f16, 0);
    /* known values */
    CU_ASSERT_EQUAL(kf_f16_to_f32(0x3c00), 1.0f);
    CU_ASSERT_EQUAL(kf_f16_to_f32(0xc000), -2.0f);
    CU_ASSERT_EQUAL(kf_f16_to_f32(0x0001), ldexpf(1.0f, -24)); /* smallest subnormal */
    CU_ASSERT_EQUAL(kf_f16_to_f32(0x7bff), 65504.0f);
    CU_ASSERT(isinf(kf_f16_to_f32(0x7c00)));
    CU_ASSERT_EQUAL(kf_bf16_to_f32(0x3f80), 1.0f);
    /* rounding to nearest even */
    CU_ASSERT_EQUAL(kf_f32_to_bf16(1.0f + ldexpf(1.0f, -8)), 0x3f80);      /* tie -> even */
    CU_ASSERT_EQUAL(kf_f32_to_bf16(1.0f + ldexpf(3.0f, -8)), 0x3f82);      /* tie -> even (up) */
    CU_ASSERT_EQUAL(kf_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00);      /* tie -> even */
    CU_ASSERT_EQUAL(kf_f32_to_f16(65520.0f), 0x7c00);                     /* overflows to inf */
    CU_ASSERT_EQUAL(kf_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);            /* tie -> even zero */
    CU_ASSERT_EQUAL(kf_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);
    /* unaligned bulk conversion */
    unsigned char raw[2 * 5 + 1];
    uint16_t vals[5] = {0x3f80, 0xc000, 0x0000, 0x4049, 0xbf80};
    memcpy(raw + 1, vals, sizeof vals);
    float out[5];
    kf_convert_to_f32(out, raw + 1, KF_DTYPE_BF16, 5);
    CU_ASSERT_EQUAL(out[0], 1.0f);
    CU_ASSERT_EQUAL(out[1], -2.0f);
    CU_ASSERT_EQUAL(out[4], -1.0f);
}

static void test_fast_exp(void) {
    double worst = 0;
    for (int i = 0; i <= 2000000; i++) {
        const float x = -87.0f + 175.0f * (float)i / 2000000.0f;
        const double want = exp((double)x);
        worst = fmax(worst, fabs(kf_expf(x) - want) / want);
    }
    printf("\n    kf_expf max relative error %.2e\n", worst);
    CU_ASSERT(worst < 4e-7);
    CU_ASSERT_EQUAL(kf_expf(0.0f), 1.0f);
    CU_ASSERT_EQUAL(kf_expf(-1000.0f), 0.0f);
    CU_ASSERT_EQUAL(kf_expf(-INFINITY), 0.0f);
}

static void test_matmul(void) {
    const int M = 37, N = 29, K = 53;
    float *x = malloc(sizeof(float) * M * (K + 3)), *w = malloc(sizeof(float) * N * K);
    kf_test_fill_uniform(x, (size_t)M * (K + 3), 1, -1, 1);
    kf_test_fill_uniform(w, (size_t)N * K, 2, -1, 1);
    float *y = poisoned((size_t)M * (N + 5));
    kf_cpu_matmul(y, N + 5, x, K + 3, w, M, N, K, 0);
    double worst = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double ref = 0;
            for (int k = 0; k < K; k++)
                ref += (double)x[i * (K + 3) + k] * w[j * K + k];
            worst = fmax(worst, fabs(ref - y[i * (N + 5) + j]));
        }
    CU_ASSERT(worst < 1e-4);
    /* accumulate adds */
    float *y2 = malloc(sizeof(float) * M * N);
    for (int i = 0; i < M * N; i++)
        y2[i] = 1.0f;
    kf_cpu_matmul(y2, N, x, K + 3, w, M, N, K, 1);
    CU_ASSERT(fabs(y2[5 * N + 7] - 1.0f - y[5 * (N + 5) + 7]) < 1e-5);
    free(x);
    free(w);
    free(y);
    free(y2);
}

static void test_rmsnorm(void) {
    const int rows = 7, n = 96;
    float *x = malloc(sizeof(float) * rows * n), *w = malloc(sizeof(float) * n);
    kf_test_fill_uniform(x, (size_t)rows * n, 3, -50, 50);
    kf_test_fill_uniform(w, n, 4, 0.5f, 1.5f);
    float *y = poisoned((size_t)rows * n);
    kf_cpu_rmsnorm(y, n, x, n, w, rows, n, 1e-6f);
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int i = 0; i < n; i++)
            ss += (double)x[r * n + i] * x[r * n + i];
        double inv = 1.0 / sqrt(ss / n + 1e-6);
        for (int i = 0; i < n; i++)
            worst = fmax(worst, fabs(x[r * n + i] * inv * w[i] - y[r * n + i]));
    }
    CU_ASSERT(worst < 1e-5);
    /* in place (used for q_norm/k_norm) */
    kf_cpu_rmsnorm(x, n, x, n, w, rows, n, 1e-6f);
    CU_ASSERT(kf_max_abs_diff(x, y, (size_t)rows * n) == 0);
    free(x);
    free(w);
    free(y);
}

static void test_rope_matches_explicit_rotation(void) {
    const int T = 9, heads = 3, hd = 16, stride = heads * hd + 4;
    kf_rope_spec spec = {.kind = KF_ROPE_DEFAULT, .theta = 10000.0};
    double inv[8];
    kf_rope_inv_freq(&spec, hd, inv);
    float *x = malloc(sizeof(float) * T * stride), *orig = malloc(sizeof(float) * T * stride);
    kf_test_fill_uniform(x, (size_t)T * stride, 5, -1, 1);
    memcpy(orig, x, sizeof(float) * T * stride);
    int64_t pos[9] = {0, 1, 2, 7, 100, 1000, 4095, 65536, 3};
    kf_cpu_rope(x, stride, T, heads, hd, pos, inv);
    double worst = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < hd / 2; i++) {
                const double ang = (double)pos[t] * pow(10000.0, -2.0 * i / hd);
                const float *o = orig + t * stride + h * hd;
                const float *r = x + t * stride + h * hd;
                worst = fmax(worst, fabs(o[i] * cos(ang) - o[i + hd / 2] * sin(ang) - r[i]));
                worst = fmax(worst, fabs(o[i + hd / 2] * cos(ang) + o[i] * sin(ang) - r[i + hd / 2]));
            }
    CU_ASSERT(worst < 1e-6);
    /* padding between tokens is untouched */
    CU_ASSERT_EQUAL(x[stride - 1], orig[stride - 1]);
    /* a rotation by p then by -p is the identity (what the compacted frame relies on) */
    int64_t neg[9];
    for (int t = 0; t < T; t++)
        neg[t] = -pos[t];
    kf_cpu_rope(x, stride, T, heads, hd, neg, inv);
    CU_ASSERT(kf_max_abs_diff(x, orig, (size_t)T * stride) < 1e-5);
    free(x);
    free(orig);
}

static void test_rope_frequencies(void) {
    const int hd = 16;
    double def[8], lin[8];
    kf_rope_spec d = {.kind = KF_ROPE_DEFAULT, .theta = 500000.0};
    kf_rope_spec l = {.kind = KF_ROPE_LINEAR, .theta = 500000.0, .factor = 4.0};
    kf_rope_inv_freq(&d, hd, def);
    kf_rope_inv_freq(&l, hd, lin);
    for (int i = 0; i < 8; i++) {
        CU_ASSERT_DOUBLE_EQUAL(def[i], pow(500000.0, -2.0 * i / hd), 1e-15);
        CU_ASSERT_DOUBLE_EQUAL(lin[i], def[i] / 4.0, 1e-15);
    }
}

static void test_silu_mul_and_add(void) {
    float g[6] = {-3, -0.5f, 0, 0.5f, 2, 10}, u[6] = {1, 2, 3, 4, 5, 6}, y[6] = {1, 1, 1, 1, 1, 1};
    float want[6];
    for (int i = 0; i < 6; i++)
        want[i] = (float)(g[i] / (1.0 + exp(-(double)g[i])) * u[i]);
    kf_cpu_silu_mul(g, u, 2, 3);
    CU_ASSERT(kf_max_abs_diff(g, want, 6) < 1e-5);
    kf_cpu_add(y, u, 3, 2);
    CU_ASSERT_EQUAL(y[5], 7.0f);
}

/* Naive attention in double over the token-ordered keys, with GQA, causal mask and bias. */
static void naive_attention(const kf_attn_args *a, const float *keys, const float *vals, double *out) {
    const int kvh = a->kv.kv_heads, hd = a->kv.head_dim, rep = a->n_heads / kvh;
    const int n_past = a->n_keys - a->n_q;
    double *s = malloc(sizeof(double) * a->n_keys);
    for (int i = 0; i < a->n_q; i++)
        for (int h = 0; h < a->n_heads; h++) {
            const int g = h / rep, valid = n_past + i + 1;
            double mx = -INFINITY;
            for (int j = 0; j < valid; j++) {
                double dot = 0;
                for (int d = 0; d < hd; d++)
                    dot += (double)a->q[i * a->q_stride + h * hd + d] * keys[((size_t)j * kvh + g) * hd + d];
                s[j] = dot * a->scale + (a->bias && j < a->bias_len ? a->bias[g * a->bias_stride + j] : 0.0);
                mx = fmax(mx, s[j]);
            }
            double sum = 0;
            for (int j = 0; j < valid; j++)
                sum += (s[j] = exp(s[j] - mx));
            for (int d = 0; d < hd; d++) {
                double o = 0;
                for (int j = 0; j < valid; j++)
                    o += s[j] / sum * vals[((size_t)j * kvh + g) * hd + d];
                out[((size_t)i * a->n_heads + h) * hd + d] = o;
            }
        }
    free(s);
}

static void check_attention(int n_q, int n_keys, int n_heads, int kvh, int hd, int with_bias) {
    const int n_pages_doc = (n_keys + 15) / 16, pool_pages = n_pages_doc + 5;
    const size_t row = (size_t)kvh * hd, page_stride = 2 * 16 * row + 8; /* a padded, interleaved pool */
    float *pool = poisoned((size_t)pool_pages * page_stride);
    /* pages in scrambled order */
    int32_t *pages = malloc(sizeof(int32_t) * n_pages_doc);
    for (int p = 0; p < n_pages_doc; p++)
        pages[p] = (p * 7 + 3) % pool_pages;
    for (int p = 0; p < n_pages_doc; p++)
        for (int q = 0; q < p; q++)
            if (pages[q] == pages[p])
                pages[p] = (pages[p] + 1) % pool_pages, q = -1;
    float *keys = malloc(sizeof(float) * n_keys * row), *vals = malloc(sizeof(float) * n_keys * row);
    kf_test_fill_uniform(keys, (size_t)n_keys * row, 11, -2, 2);
    kf_test_fill_uniform(vals, (size_t)n_keys * row, 12, -1, 1);
    kf_paged_kv kv = {.k = pool, .v = pool + 16 * row, .page_stride = page_stride, .kv_heads = kvh, .head_dim = hd};
    kf_cpu_kv_store(&kv, pages, 0, n_keys, keys, vals);
    const size_t q_stride = (size_t)n_heads * hd + 2;
    float *q = malloc(sizeof(float) * n_q * q_stride);
    kf_test_fill_uniform(q, (size_t)n_q * q_stride, 13, -2, 2);
    float *bias = NULL;
    const int bias_len = n_keys / 2;
    if (with_bias) {
        bias = malloc(sizeof(float) * kvh * (bias_len + 1));
        kf_test_fill_uniform(bias, (size_t)kvh * (bias_len + 1), 14, -3, 3);
    }
    float *out = poisoned((size_t)n_q * n_heads * hd);
    kf_attn_args a = {.q = q, .q_stride = q_stride, .out = out, .out_stride = (size_t)n_heads * hd, .n_q = n_q,
                      .n_heads = n_heads, .n_keys = n_keys, .pages = pages, .kv = kv, .scale = 1.0f / sqrtf(hd),
                      .bias = bias, .bias_stride = (size_t)bias_len + 1, .bias_len = bias_len};
    kf_cpu_attn_scratch scratch = {0};
    CU_ASSERT_EQUAL(kf_cpu_attention(&scratch, &a), 0);
    double *ref = malloc(sizeof(double) * n_q * n_heads * hd);
    naive_attention(&a, keys, vals, ref);
    double worst = 0;
    for (size_t i = 0; i < (size_t)n_q * n_heads * hd; i++)
        worst = isnan(out[i]) ? INFINITY : fmax(worst, fabs(out[i] - ref[i]));
    CU_ASSERT(worst < 1e-5);
    if (!(worst < 1e-5))
        printf("\n    n_q %d n_keys %d heads %d/%d hd %d bias %d: max error %.3e\n", n_q, n_keys, n_heads, kvh, hd,
               with_bias, worst);
    kf_cpu_attn_scratch_free(&scratch);
    free(pool);
    free(pages);
    free(keys);
    free(vals);
    free(q);
    free(bias);
    free(out);
    free(ref);
}

static void test_attention(void) {
    check_attention(1, 1, 2, 1, 8, 0);      /* one token */
    check_attention(5, 5, 4, 2, 16, 0);     /* first chunk, partial page */
    check_attention(7, 50, 4, 2, 16, 1);    /* history + chunk, bias on part of the history */
    check_attention(200, 333, 8, 2, 32, 0); /* tiles of 128 queries, GQA 4:1 */
    check_attention(130, 130, 4, 4, 64, 1); /* MHA, bias */
}

static CU_TestInfo tests[] = {
    {"bf16/f16 conversions", test_bf16_f16_conversions},
    {"fast exp against exp()", test_fast_exp},
    {"matmul (strided, accumulate)", test_matmul},
    {"rmsnorm", test_rmsnorm},
    {"rope = explicit rotation; -p undoes p", test_rope_matches_explicit_rotation},
    {"rope frequencies (default, linear)", test_rope_frequencies},
    {"silu gate and add", test_silu_mul_and_add},
    {"paged causal GQA attention with bias", test_attention},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"cpu kernels", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
