/* The bf16 KV arena (kf_arena_init with KF_DTYPE_BF16, the CPU backend only):
 *   - store and read back round fp32 to bf16 to nearest even, against a reference that picks the
 *     nearer of the two bf16 neighbours in fp64 (ties to the even one), not the kernels' bit trick;
 *   - copy-on-write of a partly filled page copies the bf16 page whole;
 *   - a backend without kv_bf16 (CUDA) refuses a bf16 arena with a status naming it;
 *   - the CPU attention (also with AM's targets fused), QUOKA's selection and the sparse attention
 *     over a bf16 pool equal the same kernels over an fp32 pool holding the reference-rounded
 *     values (independent: that pool never goes through the bf16 code);
 *   - the memory formula's arena term halves;
 *   - a whole compaction with a bf16 arena measured against the full context (fp32) is, by the
 *     FlashAttention rule (docs/design.md), at most about twice as far from it as the fp32 arena's. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/arena.h"
#include "compactor/compact.h"
#include "compactor/evaluate.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/pool.h"
#include "test_util.h"

/* ---- the reference rounding ---- */

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* x rounded to bf16 (a finite x whose rounding is finite): of the two bf16 values around x (its
 * bits truncated to 16, and the next one away from zero), the nearer in exact fp64 arithmetic;
 * at a tie the one with an even last bit. */
static float ref_bf16(float x) {
    const uint32_t lo = to_bits(x) & 0xffff0000u, hi = lo + 0x10000u;
    const double dlo = fabs((double)x - (double)from_bits(lo)), dhi = fabs((double)from_bits(hi) - (double)x);
    if (dlo < dhi || (dlo == dhi && ((lo >> 16) & 1u) == 0))
        return from_bits(lo);
    return from_bits(hi);
}

/* ---- the arena itself ---- */

enum { LAYERS = 2, KVH = 2, HD = 8 };
#define ROW (KVH * HD)

static kf_backend *g_b;

static int init(void) {
    g_b = kf_backend_cpu_create();
    return g_b ? 0 : -1;
}
static int clean(void) {
    g_b->destroy(g_b);
    return 0;
}

/* Values with every rounding case: exact, below and above half, ties to even both ways (the even
 * neighbour below and above), negatives of each, subnormals, a carry into the exponent, zeros. */
static void special_values(float *x, int n) {
    static const uint32_t bits[] = {
        0x3f800000u, 0x3f807fffu, 0x3f808001u, 0x3f808000u, 0x3f818000u, 0xbf808000u, 0xbf818000u, 0xbf807fffu,
        0xbf808001u, 0x00008000u, 0x00018000u, 0x80018000u, 0x3fffffffu, 0xbfffffffu, 0x00000000u, 0x80000000u,
        0x7f7f7fffu, 0x42c98000u, 0xc2c88000u, 0x3e99999au, 0x0000ffffu, 0x807f8000u, 0x447a1234u, 0xc47a8000u,
    };
    const int nb = (int)(sizeof bits / sizeof bits[0]);
    for (int i = 0; i < n; i++)
        x[i] = i < nb ? from_bits(bits[i]) : (float)sin(i * 0.7) * (float)(1 << (i % 9));
}

/* The pool's bits of layer l, token t (page table pages) as floats, straight from the storage. */
static void raw_row(const kf_arena *a, const int32_t *pages, int l, int t, float *k, float *v) {
    const kf_paged_kv kv = kf_arena_layer(a, l);
    const size_t off = (size_t)pages[t / 16] * kv.page_stride + (size_t)(t % 16) * ROW;
    for (int e = 0; e < ROW; e++) {
        k[e] = from_bits((uint32_t)((const uint16_t *)kv.k)[off + e] << 16);
        v[e] = from_bits((uint32_t)((const uint16_t *)kv.v)[off + e] << 16);
    }
}

static int bits_equal(const float *a, const float *b, int n) {
    for (int i = 0; i < n; i++)
        if (to_bits(a[i]) != to_bits(b[i]))
            return 0;
    return 1;
}

/* kf_seq_write_kv (layer 0) and the backend's kv_store (layer 1) both store the reference rounding;
 * kf_seq_read_kv reads it back exactly; the pool is half the bytes of an fp32 one. */
static void test_round_trip(void) {
    enum { T = 40 };
    kf_error err = {0};
    kf_arena a, f;
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 4, KF_DTYPE_BF16, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&f, g_b, LAYERS, KVH, HD, 4, KF_DTYPE_F32, &err), KF_OK);
    CU_ASSERT(a.dtype == KF_DTYPE_BF16 && a.elem == 2 && f.elem == 4);
    CU_ASSERT_EQUAL(a.page_stride * a.elem * 2, f.page_stride * f.elem);
    CU_ASSERT_EQUAL(kf_arena_layer(&a, 1).dtype, KF_DTYPE_BF16);
    CU_ASSERT_EQUAL((char *)kf_arena_layer(&a, 1).k - (char *)a.storage, 2 * (ptrdiff_t)a.block * 2);
    kf_seq s;
    kf_seq_init(&s);
    CU_ASSERT_EQUAL_FATAL(kf_seq_reserve(&a, &s, T, &err), KF_OK);
    static float k[T * ROW], v[T * ROW], rk[T * ROW], rv[T * ROW], ek[T * ROW], ev[T * ROW];
    special_values(k, T * ROW);
    for (int i = 0; i < T * ROW; i++) {
        v[i] = -k[(i * 7) % (T * ROW)] * 0.5f;
        ek[i] = ref_bf16(k[i]);
        ev[i] = ref_bf16(v[i]);
    }
    CU_ASSERT_EQUAL(kf_seq_write_kv(&a, &s, 0, 3, T - 3, k + 3 * ROW, v + 3 * ROW, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_seq_write_kv(&a, &s, 0, 0, 3, k, v, &err), KF_OK);
    const kf_paged_kv kv1 = kf_arena_layer(&a, 1);
    g_b->kv_store(g_b, &kv1, s.pages, 0, 17, k, v);
    g_b->kv_store(g_b, &kv1, s.pages, 17, T - 17, k + 17 * ROW, v + 17 * ROW);
    s.len = T;
    for (int l = 0; l < LAYERS; l++) {
        memset(rk, 0xff, sizeof rk), memset(rv, 0xff, sizeof rv);
        CU_ASSERT_EQUAL(kf_seq_read_kv(&a, &s, l, 0, T, rk, rv, &err), KF_OK);
        CU_ASSERT(bits_equal(rk, ek, T * ROW) && bits_equal(rv, ev, T * ROW));
        for (int t = 0; t < T; t++) { /* the storage itself holds the rounded bits */
            float pk[ROW], pv[ROW];
            raw_row(&a, s.pages, l, t, pk, pv);
            CU_ASSERT(bits_equal(pk, ek + t * ROW, ROW) && bits_equal(pv, ev + t * ROW, ROW));
        }
        /* a read across a page boundary, from the middle */
        CU_ASSERT_EQUAL(kf_seq_read_kv(&a, &s, l, 13, 9, rk, rv, &err), KF_OK);
        CU_ASSERT(bits_equal(rk, ek + 13 * ROW, 9 * ROW) && bits_equal(rv, ev + 13 * ROW, 9 * ROW));
    }
    /* NaN stays NaN, infinities stay */
    float nk[ROW] = {NAN, INFINITY, -INFINITY}, nv[ROW] = {-NAN};
    CU_ASSERT_EQUAL(kf_seq_write_kv(&a, &s, 1, 5, 1, nk, nv, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_seq_read_kv(&a, &s, 1, 5, 1, rk, rv, &err), KF_OK);
    CU_ASSERT(isnan(rk[0]) && rk[1] == INFINITY && rk[2] == -INFINITY && isnan(rv[0]));
    kf_seq_release(&a, &s);
    kf_arena_free(&a);
    kf_arena_free(&f);
}

/* A fork of a document ending inside a page, appended to: the shared page is copied whole (bf16
 * bytes) before the fork writes; each document reads its own values. */
static void test_copy_on_write(void) {
    enum { N = 20, M = 9 };
    kf_error err = {0};
    kf_arena a;
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 8, KF_DTYPE_BF16, &err), KF_OK);
    static float k[(N + M) * ROW], v[(N + M) * ROW], k2[M * ROW], v2[M * ROW];
    static float rk[(N + M) * ROW], rv[(N + M) * ROW];
    kf_test_fill_uniform(k, sizeof k / sizeof *k, 1, -3, 3);
    kf_test_fill_uniform(v, sizeof v / sizeof *v, 2, -3, 3);
    kf_test_fill_uniform(k2, sizeof k2 / sizeof *k2, 3, -3, 3);
    kf_test_fill_uniform(v2, sizeof v2 / sizeof *v2, 4, -3, 3);
    kf_seq doc, fork;
    kf_seq_init(&doc);
    CU_ASSERT_EQUAL_FATAL(kf_seq_reserve(&a, &doc, N + M, &err), KF_OK);
    for (int l = 0; l < LAYERS; l++)
        CU_ASSERT_EQUAL(kf_seq_write_kv(&a, &doc, l, 0, N + M, k, v, &err), KF_OK);
    doc.len = N + M;
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &doc, N, &fork, &err), KF_OK);
    CU_ASSERT_EQUAL(fork.pages[1], doc.pages[1]);
    CU_ASSERT_EQUAL_FATAL(kf_seq_reserve(&a, &fork, M, &err), KF_OK);
    CU_ASSERT_NOT_EQUAL(fork.pages[1], doc.pages[1]); /* copied on write */
    for (int l = 0; l < LAYERS; l++)
        CU_ASSERT_EQUAL(kf_seq_write_kv(&a, &fork, l, N, M, k2, v2, &err), KF_OK);
    fork.len = N + M;
    for (int l = 0; l < LAYERS; l++) {
        CU_ASSERT_EQUAL(kf_seq_read_kv(&a, &doc, l, 0, N + M, rk, rv, &err), KF_OK);
        int ok = 1;
        for (int i = 0; i < (N + M) * ROW; i++)
            ok &= rk[i] == ref_bf16(k[i]) && rv[i] == ref_bf16(v[i]);
        CU_ASSERT(ok);
        CU_ASSERT_EQUAL(kf_seq_read_kv(&a, &fork, l, 0, N + M, rk, rv, &err), KF_OK);
        ok = 1;
        for (int i = 0; i < (N + M) * ROW; i++) {
            const float ek = i < N * ROW ? k[i] : k2[i - N * ROW], ev = i < N * ROW ? v[i] : v2[i - N * ROW];
            ok &= rk[i] == ref_bf16(ek) && rv[i] == ref_bf16(ev);
        }
        CU_ASSERT(ok);
    }
    kf_seq_release(&a, &fork);
    kf_seq_release(&a, &doc);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
}

/* A backend without kv_bf16 (the CUDA backend's flag, on a copy of the CPU backend) refuses a bf16
 * arena with a status naming the backend, and still makes an fp32 one; unknown dtypes and names
 * are refused. */
static void test_refused_without_kv_bf16(void) {
    kf_error err = {0};
    kf_backend stub = *g_b;
    stub.kv_bf16 = 0;
    stub.name = "stubcuda";
    kf_arena a;
    CU_ASSERT_EQUAL(kf_arena_init(&a, &stub, LAYERS, KVH, HD, 4, KF_DTYPE_BF16, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT(strstr(err.msg, "stubcuda") && strstr(err.msg, "bf16"));
    CU_ASSERT_PTR_NULL(a.storage);
    CU_ASSERT_EQUAL(kf_arena_init_held(&a, &stub, LAYERS, 1, KVH, HD, 4, KF_DTYPE_BF16, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_EQUAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 4, KF_DTYPE_F16, &err), KF_ERR_INVALID);
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, &stub, LAYERS, KVH, HD, 4, KF_DTYPE_F32, &err), KF_OK);
    kf_arena_free(&a);
    kf_dtype dt = KF_DTYPE_F16;
    CU_ASSERT(kf_arena_dtype_parse("bf16", &dt) == 0 && dt == KF_DTYPE_BF16);
    CU_ASSERT(kf_arena_dtype_parse("f32", &dt) == 0 && dt == KF_DTYPE_F32);
    CU_ASSERT_EQUAL(kf_arena_dtype_parse("fp16", &dt), -1);
    CU_ASSERT_EQUAL(kf_arena_dtype_parse("BF16", &dt), -1);
    CU_ASSERT_STRING_EQUAL(kf_arena_dtype_name(KF_DTYPE_BF16), "bf16");
}

/* The memory formula's arena term (compact.h) by dtype, on test_compact_job's hand-computed case
 * (L 2, KD 32, D 40, N 78, P 7, one probe): fp32 128 * 2 * 32 * pg 40 + 128 * 32 * (3 + 5 - 2 + 1 + 2)
 * = 24,576 + 36,864 = 61,440; bf16 64 per page and KD: 12,288 + 18,432 = 30,720, nothing else moved;
 * kf_compact_mem_shape takes it from arena_dtype. */
static void test_memory_formula(void) {
    kf_hfconfig c = {0};
    c.n_layers = 2, c.hidden_size = 64, c.intermediate_size = 128, c.vocab_size = 100, c.n_heads = 4;
    c.n_kv_heads = 2, c.head_dim = 16, c.tie_word_embeddings = 1, c.has_qk_norm = 1;
    kf_mem_shape sh = {.D = 40, .T = 32, .S = 38, .P = 7, .n_p = 1, .R = 100, .Rv = 20, .Rc = 20, .t = 8,
                       .choice = 1, .chunk = 16, .attn_threads = 2, .solve_threads = 2, .solve_heads = 2,
                       .head_ws = 50000};
    kf_mem_peak m32, m16;
    const int64_t t32 = kf_compact_peak_bytes(&c, &sh, &m32);
    sh.arena_bf16 = 1;
    const int64_t t16 = kf_compact_peak_bytes(&c, &sh, &m16);
    CU_ASSERT_EQUAL(m32.arena, 61440);
    CU_ASSERT_EQUAL(m16.arena, 30720);
    CU_ASSERT_EQUAL(t32 - t16, 30720);
    kf_compact_params p = kf_compact_params_default();
    kf_compact_mem_shape(&c, &p, 0, 100, 0, 2, &sh);
    CU_ASSERT_EQUAL(sh.arena_bf16, 0);
    p.run.arena_dtype = KF_DTYPE_BF16;
    kf_compact_mem_shape(&c, &p, 0, 100, 0, 2, &sh);
    CU_ASSERT_EQUAL(sh.arena_bf16, 1);
}

/* ---- kernels over a bf16 pool against an fp32 pool of the rounded values ---- */

enum { KKVH = 2, REP = 3, KNH = KKVH * REP, KHD = 32, N_PAST = 600, N_Q = 150, POOL_PAGES = 64 };
#define KROW (KKVH * KHD)

typedef struct {
    float *keys, *vals, *q;         /* [n_keys, KROW] raw fp32, q [N_Q, KNH, KHD] */
    float *pool32;                  /* the rounded values, fp32 */
    uint16_t *pool16;               /* the raw values through kf_cpu_kv_store into bf16 */
    int32_t pages[POOL_PAGES];
    kf_paged_kv kv32, kv16;
} kpools;

static kf_pool *g_pool;

static void kpools_init(kpools *p) {
    const int n_keys = N_PAST + N_Q, n_pages = (n_keys + 15) / 16;
    const size_t stride = 2 * 16 * KROW + 8; /* padded, K and V interleaved by page */
    p->keys = malloc(sizeof(float) * n_keys * KROW);
    p->vals = malloc(sizeof(float) * n_keys * KROW);
    p->q = malloc(sizeof(float) * N_Q * KNH * KHD);
    p->pool32 = calloc((size_t)POOL_PAGES * stride, sizeof(float));
    p->pool16 = calloc((size_t)POOL_PAGES * stride, sizeof(uint16_t));
    kf_test_fill_uniform(p->keys, (size_t)n_keys * KROW, 31, -2, 2);
    kf_test_fill_uniform(p->vals, (size_t)n_keys * KROW, 32, -1, 1);
    kf_test_fill_uniform(p->q, (size_t)N_Q * KNH * KHD, 33, -2, 2);
    for (int i = 0; i < n_pages; i++)
        p->pages[i] = (i * 29 + 3) % POOL_PAGES;
    p->kv32 = (kf_paged_kv){.k = p->pool32, .v = p->pool32 + 16 * KROW, .page_stride = stride, .kv_heads = KKVH,
                            .head_dim = KHD};
    p->kv16 = (kf_paged_kv){.k = p->pool16, .v = p->pool16 + 16 * KROW, .page_stride = stride, .kv_heads = KKVH,
                            .head_dim = KHD, .dtype = KF_DTYPE_BF16};
    for (int t = 0; t < n_keys; t++) { /* the fp32 pool by hand, with the reference rounding */
        const size_t off = (size_t)p->pages[t / 16] * stride + (size_t)(t % 16) * KROW;
        for (int e = 0; e < KROW; e++) {
            p->pool32[off + e] = ref_bf16(p->keys[(size_t)t * KROW + e]);
            p->pool32[off + 16 * KROW + e] = ref_bf16(p->vals[(size_t)t * KROW + e]);
        }
    }
    kf_cpu_kv_store(&p->kv16, p->pages, 0, 100, p->keys, p->vals); /* in two calls */
    kf_cpu_kv_store(&p->kv16, p->pages, 100, n_keys - 100, p->keys + 100 * KROW, p->vals + 100 * KROW);
}

static void kpools_free(kpools *p) {
    free(p->keys), free(p->vals), free(p->q), free(p->pool32), free(p->pool16);
}

static double rel_diff(const float *a, const float *b, size_t n) {
    const double m = kf_max_abs(b, n);
    return kf_max_abs_diff(a, b, n) / (m > 0 ? m : 1);
}

/* out [N_Q, KNH, KHD] of the queries in two chunks over kv (with a bias on the first 100 keys of
 * KV head 1 when bias), and with targets (tg_* not NULL) AM's over keys [40, 560). */
static int run_attention(const kpools *p, kf_paged_kv kv, int bias, float *out, float *tm, float *ty, float *tY,
                         double *score) {
    static float b[KKVH * 100];
    for (int i = 0; i < KKVH * 100; i++)
        b[i] = i >= 100 ? -0.5f + 0.01f * (i % 100) : 0.0f;
    static int32_t rows[N_Q];
    for (int i = 0; i < N_Q; i++)
        rows[i] = i;
    kf_cpu_attn_scratch s = {.pool = g_pool};
    int rc = 0;
    for (int c0 = 0; c0 < N_Q && rc == 0; c0 += 100) {
        const int n = N_Q - c0 < 100 ? N_Q - c0 : 100;
        kf_attn_targets t = {.blk0 = 40, .blk1 = 560, .rows = rows + c0, .n_rows = n, .row_base = c0,
                             .m = tm + c0, .y = ty + c0, .Y = tY + (size_t)c0 * KHD, .row_stride = 1,
                             .head_stride = N_Q, .score = score, .score_stride = 520, .score_rms = 1};
        kf_attn_args a = {.q = p->q + (size_t)c0 * KNH * KHD, .q_stride = KNH * KHD,
                          .out = out + (size_t)c0 * KNH * KHD, .out_stride = KNH * KHD, .n_q = n, .n_heads = KNH,
                          .n_keys = N_PAST + c0 + n, .pages = p->pages, .kv = kv, .scale = 1.0f / sqrtf(KHD),
                          .bias = bias ? b : NULL, .bias_stride = 100, .bias_len = 100, .targets = tm ? &t : NULL};
        rc = kf_cpu_attention(&s, &a);
    }
    kf_cpu_attn_scratch_free(&s);
    return rc;
}

/* Attention over the bf16 pool = attention over the fp32 pool of the same values (the blocks are
 * widened exactly, so only the order of fp32 sums could differ: 1e-6 of the largest output). */
static void test_attention(void) {
    kpools p;
    kpools_init(&p);
    const size_t n = (size_t)N_Q * KNH * KHD;
    float *o16 = malloc(sizeof(float) * n), *o32 = malloc(sizeof(float) * n);
    for (int bias = 0; bias < 2; bias++) {
        for (size_t i = 0; i < n; i++)
            o16[i] = o32[i] = NAN;
        CU_ASSERT_EQUAL(run_attention(&p, p.kv16, bias, o16, NULL, NULL, NULL, NULL), 0);
        CU_ASSERT_EQUAL(run_attention(&p, p.kv32, bias, o32, NULL, NULL, NULL, NULL), 0);
        const double d = rel_diff(o16, o32, n);
        CU_ASSERT(d <= 1e-6);
        printf("\n    bias %d: bf16 pool vs fp32 pool of its values %.2e (relative)", bias, d);
    }
    free(o16), free(o32);
    kpools_free(&p);
}

/* AM's targets fused into the attention over a bf16 pool: m, y, Y and the score as over the fp32
 * pool of the same values. */
static void test_fused_targets(void) {
    kpools p;
    kpools_init(&p);
    const size_t n = (size_t)N_Q * KNH * KHD, nr = (size_t)N_Q * KNH;
    float *o[2], *m[2], *y[2], *Y[2];
    double *sc[2];
    for (int i = 0; i < 2; i++) {
        o[i] = malloc(sizeof(float) * n), Y[i] = malloc(sizeof(float) * n);
        m[i] = malloc(sizeof(float) * nr), y[i] = malloc(sizeof(float) * nr);
        sc[i] = calloc(KKVH * 520, sizeof(double));
        for (size_t j = 0; j < nr; j++)
            m[i][j] = y[i][j] = NAN;
        CU_ASSERT_EQUAL(run_attention(&p, i ? p.kv32 : p.kv16, 0, o[i], m[i], y[i], Y[i], sc[i]), 0);
    }
    double ds = 0, ms = 0;
    for (int j = 0; j < KKVH * 520; j++) {
        ds = fmax(ds, fabs(sc[0][j] - sc[1][j]));
        ms = fmax(ms, fabs(sc[1][j]));
    }
    CU_ASSERT(rel_diff(o[0], o[1], n) <= 1e-6);
    CU_ASSERT(rel_diff(m[0], m[1], nr) <= 1e-6);
    CU_ASSERT(rel_diff(y[0], y[1], nr) <= 1e-5);
    CU_ASSERT(rel_diff(Y[0], Y[1], n) <= 1e-6);
    CU_ASSERT(ms > 0 && ds / ms <= 1e-6);
    for (int i = 0; i < 2; i++)
        free(o[i]), free(Y[i]), free(m[i]), free(y[i]), free(sc[i]);
    kpools_free(&p);
}

/* QUOKA's selection over a bf16 pool: the same keys and cosine scores as over the fp32 pool of its
 * values; the sparse attention over the selection likewise. */
static void test_quoka(void) {
    kpools p;
    kpools_init(&p);
    enum { BUDGET = 90 };
    const int nsel = kf_quoka_n_selected(N_PAST, BUDGET, 500, 540);
    int32_t *idx[2];
    float *sc[2], *out[2];
    const size_t n = (size_t)N_Q * KNH * KHD;
    kf_cpu_quoka_scratch qs = {0};
    kf_cpu_sparse_scratch ss = {.attn = {.pool = g_pool}};
    for (int i = 0; i < 2; i++) {
        const kf_paged_kv kv = i ? p.kv32 : p.kv16;
        idx[i] = malloc(sizeof(int32_t) * KKVH * nsel);
        sc[i] = malloc(sizeof(float) * KKVH * N_PAST);
        out[i] = malloc(sizeof(float) * n);
        kf_quoka_select_args qa = {.q = p.q, .q_stride = KNH * KHD, .n_q = N_Q, .n_heads = KNH, .n_hist = N_PAST,
                                   .pages = p.pages, .kv = kv, .n_keep = 16, .budget = BUDGET, .n_sink = 4,
                                   .win_lo = 500, .win_hi = 540, .out_idx = idx[i], .idx_stride = (size_t)nsel,
                                   .scores = sc[i]};
        CU_ASSERT_EQUAL(kf_cpu_quoka_select(&qs, &qa), 0);
        kf_sparse_attn_args sa = {.attn = {.q = p.q, .q_stride = KNH * KHD, .out = out[i], .out_stride = KNH * KHD,
                                           .n_q = N_Q, .n_heads = KNH, .n_keys = N_PAST + N_Q, .pages = p.pages,
                                           .kv = kv, .scale = 1.0f / sqrtf(KHD)},
                                  .hist_idx = idx[i], .idx_stride = (size_t)nsel, .n_sel = nsel};
        CU_ASSERT_EQUAL(kf_cpu_sparse_attention(&ss, &sa), 0);
    }
    CU_ASSERT(memcmp(idx[0], idx[1], sizeof(int32_t) * KKVH * nsel) == 0);
    CU_ASSERT(rel_diff(sc[0], sc[1], (size_t)KKVH * N_PAST) <= 1e-6);
    CU_ASSERT(rel_diff(out[0], out[1], n) <= 1e-6);
    for (int i = 0; i < 2; i++)
        free(idx[i]), free(sc[i]), free(out[i]);
    kf_cpu_quoka_scratch_free(&qs);
    kf_cpu_sparse_scratch_free(&ss);
    kpools_free(&p);
}

static int kinit(void) {
    g_pool = kf_pool_create(3);
    return g_pool ? 0 : -1;
}
static int kclean(void) {
    kf_pool_destroy(g_pool);
    return 0;
}

/* ---- a whole compaction, records-llama3-induct ---- */

static kf_model *g_m;
static kf_backend *g_mb;
static int32_t g_doc[4096];
static int g_doc_n;

static int init_model(void) {
    if (kf_test_model_open("records-llama3-induct", &g_mb, &g_m))
        return -1;
    g_doc_n = kf_test_records_ids(2, g_doc, 4096);
    return g_doc_n >= 300 ? 0 : -1;
}

static int clean_model(void) {
    return kf_test_model_close(g_mb, g_m);
}

/* fold at 0.25 of a 300-token document, with a bf16 and an fp32 arena, each measured against the
 * full context (fp32): the bf16 arena's KL and output error at most twice the fp32 arena's (with a
 * floor of bf16's own rounding, 2^-8, on the output error); the two compactions differ (the bf16
 * arena ran) but keep mostly (3/4) the same positions. A caller's arena of the other dtype is refused. */
static void test_compaction(void) {
    static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10}; /* "Repeat the records above.\n" */
    static const int32_t kQ[] = {81, 58, 1541, 63, 10, 65, 58};    /* "Q: rake?\nA:" */
    kf_error err = {0};
    const kf_prompt doc = {g_doc, 300}, instr = {kInstr, 6};
    const kf_qa qa = {{kQ, 7}, {g_doc + 1, 2}};
    kf_compact_params p = kf_compact_params_default();
    p.method = KF_METHOD_FOLD, p.budget = 0.25, p.solver.max_queries = 3000;
    p.repeat_instruction = instr;
    kf_reference *ref = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_reference_build(g_m, &doc, &instr, &qa, 1, &ref, &err), KF_OK);
    kf_compacted c[2];
    kf_quality q[2];
    for (int i = 0; i < 2; i++) {
        p.run.arena_dtype = i ? KF_DTYPE_F32 : KF_DTYPE_BF16;
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c[i], &err), KF_OK);
        CU_ASSERT_EQUAL_FATAL(kf_quality_measure(g_m, ref, &c[i], &q[i], NULL, NULL, &err), KF_OK);
    }
    CU_ASSERT_FATAL(c[0].C == c[1].C);
    const size_t n = (size_t)c[0].n_layers * c[0].C * c[0].kv_heads * c[0].head_dim;
    const size_t np = (size_t)c[0].n_layers * c[0].kv_heads * c[0].C;
    size_t same = 0;
    for (size_t i = 0; i < np; i++)
        same += c[0].positions[i] == c[1].positions[i];
    CU_ASSERT(memcmp(c[0].keys, c[1].keys, sizeof(float) * n) != 0);
    CU_ASSERT(same >= np * 3 / 4); /* bf16 rounding moves some scores across the top-t line */
    CU_ASSERT(q[0].kl_repeat <= 2 * q[1].kl_repeat + 1e-4);
    CU_ASSERT(q[0].out_err <= fmax(2 * q[1].out_err, 1.0 / 256));
    CU_ASSERT(q[0].copy_acc >= q[1].copy_acc - 0.02);
    printf("\n    bf16 arena: kl_repeat %.3e out_err %.3e copy_acc %.3f; f32: %.3e %.3e %.3f; %zu of %zu positions "
           "equal\n",
           q[0].kl_repeat, q[0].out_err, q[0].copy_acc, q[1].kl_repeat, q[1].out_err, q[1].copy_acc, same, np);
    kf_compacted_free(&c[0]);
    kf_compacted_free(&c[1]);
    kf_reference_free(ref);

    /* a caller's fp32 arena with parameters asking for bf16 */
    kf_arena a;
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, 400, &err), KF_OK);
    const kf_compact_reuse r = {.arena = &a};
    p.run.arena_dtype = KF_DTYPE_BF16;
    kf_compacted x;
    CU_ASSERT_EQUAL(kf_compact_ex(g_m, &r, NULL, &doc, NULL, &p, &x, &err), KF_ERR_MISMATCH);
    CU_ASSERT(strstr(err.msg, "bf16") != NULL);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
}

static CU_TestInfo arena_tests[] = {
    {"store and read round to nearest even (ties, negatives, subnormals)", test_round_trip},
    {"copy-on-write copies the bf16 page", test_copy_on_write},
    {"a backend without kv_bf16 refuses a bf16 arena", test_refused_without_kv_bf16},
    {"the memory formula's arena term by dtype", test_memory_formula},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo kernel_tests[] = {
    {"attention over bf16 = over fp32 of the rounded values", test_attention},
    {"fused AM targets over bf16 = over fp32 of the rounded values", test_fused_targets},
    {"QUOKA select and sparse attention over bf16 = over fp32", test_quoka},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo model_tests[] = {
    {"kf_compact with a bf16 arena: within twice the fp32 arena's error", test_compaction},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"bf16 arena", init, clean, NULL, NULL, arena_tests},
                                {"kernels over a bf16 pool", kinit, kclean, NULL, NULL, kernel_tests},
                                {"compaction, records-llama3-induct", init_model, clean_model, NULL, NULL, model_tests},
                                CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
