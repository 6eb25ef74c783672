/* CPU kernels against naive double-precision references on random inputs, outputs poisoned
 * (NaN) first so that an element the kernel forgets to write fails the comparison. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/cpu/pool.h"
#include "test_util.h"

static kf_pool *g_pool; /* 3 threads, for the threaded paths */

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

/* The largest relative error of f against exp() on 2,000,001 even steps over [lo, lo + span]. */
static double exp_rel_err(float (*f)(float), float lo, float span) {
    double worst = 0;
    for (int i = 0; i <= 2000000; i++) {
        const float x = lo + span * (float)i / 2000000.0f;
        const double want = exp((double)x);
        worst = fmax(worst, fabs(f(x) - want) / want);
    }
    return worst;
}

static void test_fast_exp(void) {
    double worst = exp_rel_err(kf_expf, -87.0f, 175.0f);
    printf("\n    kf_expf max relative error %.2e\n", worst);
    CU_ASSERT(worst < 4e-7);
    CU_ASSERT_EQUAL(kf_expf(0.0f), 1.0f);
    CU_ASSERT_EQUAL(kf_expf(-1000.0f), 0.0f);
    CU_ASSERT_EQUAL(kf_expf(-INFINITY), 0.0f);
    worst = exp_rel_err(kf_expf_nonpos, 0.0f, -87.3f); /* the softmax's exp of x <= 0, down to its lower limit */
    printf("    kf_expf_nonpos max relative error %.2e\n", worst);
    CU_ASSERT(worst < 3e-7);
    CU_ASSERT_EQUAL(kf_expf_nonpos(0.0f), 1.0f);
    CU_ASSERT_EQUAL(kf_expf_nonpos(-87.4f), 0.0f);
    CU_ASSERT_EQUAL(kf_expf_nonpos(-INFINITY), 0.0f);
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

/* A row's matmul result has the same bits in any call: alone, in pieces of 1 to 21 rows at any
 * offset, whole, on the calling thread or on a pool of 3 (the column parts), accumulating or not.
 * With N 131 and K 64 the calls are small enough for OpenBLAS's AVX-512 small-matrix kernel. */
static void check_matmul_rows_same_bits(int N, int K) {
    const int M = 37; /* the pool splits the columns */
    float *x = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N);
    kf_test_fill_uniform(x, (size_t)M * K, 31, -1, 1);
    kf_test_fill_uniform(w, (size_t)N * K, 32, -1, 1);
    kf_cpu_mm_scratch one = {0}, pooled = {.pool = g_pool};
    CU_ASSERT_EQUAL_FATAL(kf_cpu_matmul_pool(&one, y0, N, x, K, w, M, N, K, 0), 0);
    static const int pieces[][5] = {{37}, {1, 6, 9, 21}, {8, 8, 8, 8, 5}, {13, 24}};
    for (int acc = 0; acc < 2; acc++)
        for (int v = 0; v < 4; v++) {
            for (int i = 0; i < M * N; i++)
                y[i] = acc ? 0.0f : NAN;
            for (int p = 0, r0 = 0; p < 5 && pieces[v][p]; r0 += pieces[v][p++])
                CU_ASSERT_EQUAL(kf_cpu_matmul_pool(v % 2 ? &pooled : &one, y + (size_t)r0 * N, N, x + (size_t)r0 * K,
                                                   K, w, pieces[v][p], N, K, acc), 0);
            CU_ASSERT_EQUAL(memcmp(y, y0, sizeof(float) * M * N), 0);
        }
    CU_ASSERT_EQUAL(kf_cpu_matmul(y, N, x + 5 * K, K, w, 1, N, K, 0), 0); /* one row, on its own */
    CU_ASSERT_EQUAL(memcmp(y, y0 + 5 * N, sizeof(float) * N), 0);
    kf_cpu_mm_scratch_free(&one);
    kf_cpu_mm_scratch_free(&pooled);
    free(x);
    free(w);
    free(y0);
    free(y);
}

static void test_matmul_rows_same_bits(void) {
    check_matmul_rows_same_bits(515, 256);
    check_matmul_rows_same_bits(131, 64);
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

/* with_bias 2: as 1, and KV head 0's first 256 keys (a whole key block of the kernel) get bias
 * -inf, so that its first block has no weight at all for every query */
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
        for (int j = 0; with_bias == 2 && j < 256 && j < bias_len; j++)
            bias[j] = -INFINITY;
    }
    float *out = poisoned((size_t)n_q * n_heads * hd);
    kf_attn_args a = {.q = q, .q_stride = q_stride, .out = out, .out_stride = (size_t)n_heads * hd, .n_q = n_q,
                      .n_heads = n_heads, .n_keys = n_keys, .pages = pages, .kv = kv, .scale = 1.0f / sqrtf(hd),
                      .bias = bias, .bias_stride = (size_t)bias_len + 1, .bias_len = bias_len};
    double *ref = malloc(sizeof(double) * n_q * n_heads * hd);
    naive_attention(&a, keys, vals, ref);
    for (int threaded = 0; threaded < 2; threaded++) { /* on the calling thread, then on a pool */
        kf_cpu_attn_scratch scratch = {.pool = threaded ? g_pool : NULL};
        for (size_t i = 0; i < (size_t)n_q * n_heads * hd; i++)
            out[i] = NAN;
        CU_ASSERT_EQUAL(kf_cpu_attention(&scratch, &a), 0);
        double worst = 0;
        for (size_t i = 0; i < (size_t)n_q * n_heads * hd; i++)
            worst = isnan(out[i]) ? INFINITY : fmax(worst, fabs(out[i] - ref[i]));
        CU_ASSERT(worst < 1e-5);
        if (!(worst < 1e-5))
            printf("\n    n_q %d n_keys %d heads %d/%d hd %d bias %d threaded %d: max error %.3e\n", n_q, n_keys,
                   n_heads, kvh, hd, with_bias, threaded, worst);
        kf_cpu_attn_scratch_free(&scratch);
    }
    free(pool);
    free(pages);
    free(keys);
    free(vals);
    free(q);
    free(bias);
    free(out);
    free(ref);
}

/* A query row's attention output has the same bits whatever chunk it comes in and whatever the
 * threads: n_q queries on top of a context, in one call on one thread, then in chunks of other
 * sizes (starting at positions that are not multiples of a page or a block), on a pool of 3.
 * GQA 3:1 (odd row counts), bias on part of the keys. */
static void check_attention_rows_same_bits(int hd) {
    const int ctx = 203, n_q = 330, n_keys = ctx + n_q, nh = 6, kvh = 2, pages = (n_keys + 15) / 16;
    const size_t row = (size_t)kvh * hd, qs = (size_t)nh * hd, n_out = (size_t)n_q * qs;
    float *pool = poisoned((size_t)pages * 2 * 16 * row), *keys = malloc(sizeof(float) * n_keys * row);
    float *vals = malloc(sizeof(float) * n_keys * row), *q = malloc(sizeof(float) * n_out);
    float *bias = malloc(sizeof(float) * kvh * 300), *out0 = malloc(sizeof(float) * n_out);
    float *out = malloc(sizeof(float) * n_out);
    int32_t *pg = malloc(sizeof(int32_t) * pages);
    for (int p = 0; p < pages; p++)
        pg[p] = pages - 1 - p;
    kf_test_fill_uniform(keys, (size_t)n_keys * row, 41, -2, 2);
    kf_test_fill_uniform(vals, (size_t)n_keys * row, 42, -1, 1);
    kf_test_fill_uniform(q, n_out, 43, -2, 2);
    kf_test_fill_uniform(bias, (size_t)kvh * 300, 44, -3, 3);
    const kf_paged_kv kv = {.k = pool, .v = pool + 16 * row, .page_stride = 2 * 16 * row, .kv_heads = kvh,
                            .head_dim = hd};
    kf_cpu_kv_store(&kv, pg, 0, n_keys, keys, vals);
    kf_attn_args a = {.q_stride = qs, .out_stride = qs, .n_heads = nh, .pages = pg, .kv = kv,
                      .scale = 1.0f / sqrtf(hd), .bias = bias, .bias_stride = 300, .bias_len = 300};
    static const int chunks[][4] = {{330}, {100, 100, 100, 30}, {37, 256, 37}, {1, 177, 152}};
    for (int v = 0; v < 4; v++) {
        kf_cpu_attn_scratch scratch = {.pool = v ? g_pool : NULL};
        for (int c = 0, q0 = 0; c < 4 && chunks[v][c]; q0 += chunks[v][c++]) {
            a.q = q + q0 * qs, a.out = (v ? out : out0) + q0 * qs;
            a.n_q = chunks[v][c], a.n_keys = ctx + q0 + chunks[v][c];
            CU_ASSERT_EQUAL(kf_cpu_attention(&scratch, &a), 0);
        }
        CU_ASSERT(v == 0 || memcmp(out, out0, sizeof(float) * n_out) == 0);
        kf_cpu_attn_scratch_free(&scratch);
    }
    free(pool);
    free(keys);
    free(vals);
    free(q);
    free(bias);
    free(out0);
    free(out);
    free(pg);
}

/* head_dim 64: Qp Kb^T calls small enough for OpenBLAS's AVX-512 small-matrix kernel */
static void test_attention_rows_same_bits(void) {
    check_attention_rows_same_bits(16);
    check_attention_rows_same_bits(64);
}

static void test_attention(void) {
    check_attention(1, 1, 2, 1, 8, 0);      /* one token */
    check_attention(5, 5, 4, 2, 16, 0);     /* first chunk, partial page */
    check_attention(7, 50, 4, 2, 16, 1);    /* history + chunk, bias on part of the history */
    check_attention(200, 333, 8, 2, 32, 0); /* tiles of 128 queries, GQA 4:1 */
    check_attention(130, 130, 4, 4, 64, 1); /* MHA, bias */
    /* several key blocks of 256 and query tiles; rows of late tiles skip no block, rows of the
     * first tile skip the last one */
    check_attention(300, 1100, 8, 2, 32, 1);
    check_attention(600, 600, 4, 4, 16, 0); /* a causal chunk from empty: tiles see fewer blocks */
    check_attention(90, 700, 4, 2, 16, 2);  /* a first key block all -inf: the running max stays -inf */
    check_attention(1, 40, 128, 1, 8, 0);   /* one query, 128 heads on one KV head: tiles cannot shrink */
    /* GQA 3:1, a history that ends mid-page: on one thread a tile's 150 diagonal keys go by blocks
     * of 64, 64 and 22 (the last partial), rows skipping the blocks past their query; on the pool
     * the tiles shrink to 38 queries, within one such block */
    check_attention(150, 397, 6, 2, 16, 1);
}

typedef struct {
    int *count;   /* [n] times each item ran */
    int bad_thread;
} pool_check;

static void pool_item(void *ctx, int item, int thread) {
    pool_check *c = ctx;
    c->count[item]++;
    if (thread < 0 || thread >= 3)
        c->bad_thread = 1;
}

/* Every item runs exactly once, job after job, with fewer and more items than threads. */
static void test_pool_runs_every_item_once(void) {
    CU_ASSERT_EQUAL_FATAL(kf_pool_threads(g_pool), 3);
    const int sizes[] = {1, 2, 3, 7, 1000};
    for (int rep = 0; rep < 200; rep++) {
        const int n = sizes[rep % 5];
        pool_check c = {.count = calloc((size_t)n, sizeof(int))};
        kf_pool_run(g_pool, n, pool_item, &c);
        int wrong = 0;
        for (int i = 0; i < n; i++)
            wrong += c.count[i] != 1;
        CU_ASSERT_EQUAL(wrong, 0);
        CU_ASSERT_EQUAL(c.bad_thread, 0);
        free(c.count);
    }
    kf_pool_run(g_pool, 0, pool_item, NULL); /* nothing to do */
    CU_ASSERT_EQUAL(kf_pool_threads(NULL), 1);
}

/* The CPU backend's threaded row kernels give exactly the single-threaded kernels' results. */
static void test_threaded_row_kernels_match(void) {
    kf_backend *b = kf_backend_cpu_create_threads(3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    const int rows = 301, n = 96, heads = 3, hd = 32; /* 301 x 96 values: above the inline threshold */
    const size_t N = (size_t)rows * n;
    float *x = malloc(sizeof(float) * N), *w = malloc(sizeof(float) * n), *u = malloc(sizeof(float) * N);
    float *y1 = poisoned(N), *y2 = poisoned(N);
    kf_test_fill_uniform(x, N, 21, -5, 5);
    kf_test_fill_uniform(u, N, 22, -5, 5);
    kf_test_fill_uniform(w, n, 23, 0.5f, 1.5f);
    kf_cpu_rmsnorm(y1, n, x, n, w, rows, n, 1e-6f);
    b->rmsnorm(b, y2, n, x, n, w, rows, n, 1e-6f);
    CU_ASSERT_EQUAL(memcmp(y1, y2, sizeof(float) * N), 0);

    int64_t *pos = malloc(sizeof(int64_t) * rows);
    for (int t = 0; t < rows; t++)
        pos[t] = 3 * t + 1;
    kf_rope_spec spec = {.kind = KF_ROPE_DEFAULT, .theta = 10000.0};
    double inv_freq[16];
    kf_rope_inv_freq(&spec, hd, inv_freq);
    memcpy(y1, x, sizeof(float) * N);
    memcpy(y2, x, sizeof(float) * N);
    kf_cpu_rope(y1, n, rows, heads, hd, pos, inv_freq);
    b->rope(b, y2, n, rows, heads, hd, pos, inv_freq);
    CU_ASSERT_EQUAL(memcmp(y1, y2, sizeof(float) * N), 0);

    memcpy(y1, x, sizeof(float) * N);
    memcpy(y2, x, sizeof(float) * N);
    kf_cpu_silu_mul(y1, u, rows, n);
    b->silu_mul(b, y2, u, rows, n);
    CU_ASSERT_EQUAL(memcmp(y1, y2, sizeof(float) * N), 0);
    kf_cpu_add(y1, u, rows, n);
    b->add(b, y2, u, rows, n);
    CU_ASSERT_EQUAL(memcmp(y1, y2, sizeof(float) * N), 0);
    free(x);
    free(w);
    free(u);
    free(y1);
    free(y2);
    free(pos);
    b->destroy(b);
}

static int suite_init(void) {
    g_pool = kf_pool_create(3);
    return g_pool ? 0 : -1;
}

static int suite_clean(void) {
    kf_pool_destroy(g_pool);
    return 0;
}

static CU_TestInfo tests[] = {
    {"bf16/f16 conversions", test_bf16_f16_conversions},
    {"fast exp against exp()", test_fast_exp},
    {"matmul (strided, accumulate)", test_matmul},
    {"matmul: a row's bits do not depend on its call or the threads", test_matmul_rows_same_bits},
    {"rmsnorm", test_rmsnorm},
    {"rope = explicit rotation; -p undoes p", test_rope_matches_explicit_rotation},
    {"rope frequencies (default, linear)", test_rope_frequencies},
    {"silu gate and add", test_silu_mul_and_add},
    {"paged causal GQA attention with bias (one thread and a pool)", test_attention},
    {"attention: a row's bits do not depend on its chunk or the threads", test_attention_rows_same_bits},
    {"pool runs every item once", test_pool_runs_every_item_once},
    {"threaded row kernels = single-threaded ones", test_threaded_row_kernels_match},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"cpu kernels", suite_init, suite_clean, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
