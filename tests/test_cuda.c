/* The CUDA backend against the CPU backend (built only with KVFOLD_HAVE_CUDA).
 *
 *   test_cuda                 every operation on fresh random inputs, outputs poisoned (NaN) first,
 *                             then the hf-qwen3-tiny and hf-llama3-tiny-random goldens end to end
 *   test_cuda bench-attention [--history 32768,131072] [--chunk 4096] [--repeat 5]
 *                             one chunk of attention, dense and QUOKA, Qwen3-4B head shapes
 *
 * Exits 77 (ctest SKIP_RETURN_CODE) with "no CUDA device" where there is none, so that machines
 * without a GPU compile it and skip it.
 *
 * Tolerances follow FlashAttention's rule (docs/design.md): where the GPU rounds to bf16 (the GEMM
 * operands, the weights), its error against an fp64/fp32 reference must be at most twice the error
 * of a same-precision reference (the same computation with bf16-rounded operands, done on the CPU)
 * plus a small floor. Where the GPU computes in fp32 like the CPU (norms, RoPE, attention, QUOKA
 * scores), it must match the CPU backend given the same bf16-rounded weights to fp32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compactor/model.h"
#include "compactor/quoka.h"
#include "formats/safetensors.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/backend_cuda.h"
#include "test_util.h"

#define SKIP_CODE 77

static int n_fail, n_pass;
static kf_backend *gpu, *cpu;
static uint64_t seed_counter = 1000;

static void check(int ok, const char *what, double err, double tol) {
    printf("  %-58s err %.3e  tol %.3e  %s\n", what, err, tol, ok ? "ok" : "FAIL");
    if (ok)
        n_pass++;
    else
        n_fail++;
}

/* max |a - b| / max |ref| over n values; +inf when a is not finite anywhere (unwritten output) */
static double rel_err(const float *a, const float *ref, size_t n) {
    double m = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        const double d = fabs((double)a[i] - ref[i]);
        m = d > m ? d : m;
        r = fabs(ref[i]) > r ? fabs(ref[i]) : r;
    }
    return r > 0 ? m / r : m;
}

static float *rnd(size_t n, float lo, float hi) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    kf_test_fill_uniform(x, n, seed_counter++, lo, hi);
    return x;
}

static float bf16r(float x) { return kf_bf16_to_f32(kf_f32_to_bf16(x)); }

static float *bf16_copy(const float *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        y[i] = bf16r(x[i]);
    return y;
}

/* device buffers */
static void *dput(const void *host, size_t bytes) {
    void *d = gpu->alloc(gpu, bytes);
    if (!d) {
        fprintf(stderr, "test_cuda: device allocation of %zu bytes failed\n", bytes);
        exit(1);
    }
    if (host)
        gpu->upload(gpu, d, host, bytes);
    return d;
}

static float *dpoison(size_t n) { /* a fresh device buffer of n NaNs */
    float *h = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        h[i] = NAN;
    float *d = dput(h, sizeof(float) * n);
    free(h);
    return d;
}

static float *dget(const void *d, size_t n) {
    float *h = malloc(sizeof(float) * n);
    gpu->download(gpu, h, d, sizeof(float) * n);
    return h;
}

static int gpu_ok(const char *what) {
    if (gpu->take_error(gpu)) {
        printf("  %-58s CUDA error: %s  FAIL\n", what, kf_backend_cuda_message(gpu));
        n_fail++;
        return 0;
    }
    return 1;
}

/* ---- GEMM ---------------------------------------------------------------------------------- */

static void test_matmul(int M, int N, int K, int acc) {
    const size_t ldx = (size_t)K + 3, ldy = (size_t)N + 5;
    float *x = rnd((size_t)M * ldx, -1, 1), *w = rnd((size_t)N * K, -1, 1), *y0 = rnd((size_t)M * ldy, -1, 1);
    double *ref = malloc(sizeof(double) * (size_t)M * N), *sp = malloc(sizeof(double) * (size_t)M * N);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = acc ? y0[(size_t)i * ldy + j] : 0, t = s;
            for (int k = 0; k < K; k++) {
                s += (double)x[(size_t)i * ldx + k] * w[(size_t)j * K + k];
                t += (double)bf16r(x[(size_t)i * ldx + k]) * bf16r(w[(size_t)j * K + k]);
            }
            ref[(size_t)i * N + j] = s;
            sp[(size_t)i * N + j] = t;
        }
    void *dw = dput(NULL, 2 * (size_t)N * K);
    gpu->upload_weight(gpu, dw, w, KF_DTYPE_F32, (size_t)N * K);
    float *dx = dput(x, sizeof(float) * (size_t)M * ldx);
    float *dy = acc ? dput(y0, sizeof(float) * (size_t)M * ldy) : dpoison((size_t)M * ldy);
    gpu->matmul(gpu, dy, ldy, dx, ldx, dw, M, N, K, acc);
    char what[96];
    snprintf(what, sizeof what, "matmul M=%d N=%d K=%d%s", M, N, K, acc ? " accumulate" : "");
    if (gpu_ok(what)) {
        float *y = dget(dy, (size_t)M * ldy);
        double e = 0, es = 0, r = 0;
        int finite = 1;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                const double g = y[(size_t)i * ldy + j], f = ref[(size_t)i * N + j];
                finite &= isfinite(g);
                e = fmax(e, fabs(g - f));
                es = fmax(es, fabs(sp[(size_t)i * N + j] - f));
                r = fmax(r, fabs(f));
            }
        /* the row padding (ldy > N) must be untouched */
        int pad_ok = 1;
        for (int i = 0; i < M; i++)
            for (size_t j = (size_t)N; j < ldy; j++)
                pad_ok &= acc ? y[(size_t)i * ldy + j] == y0[(size_t)i * ldy + j] : isnan(y[(size_t)i * ldy + j]);
        const double tol = 2 * es / r + 1e-6;
        check(finite && pad_ok && e / r <= tol, what, finite ? e / r : INFINITY, tol);
        free(y);
    }
    gpu->free(gpu, dw);
    gpu->free(gpu, dx);
    gpu->free(gpu, dy);
    free(x);
    free(w);
    free(y0);
    free(ref);
    free(sp);
}

/* ---- row kernels --------------------------------------------------------------------------- */

static void test_embed(void) {
    const int rows = 300, width = 96, n = 50;
    float *table = rnd((size_t)rows * width, -2, 2);
    int32_t ids[50];
    for (int i = 0; i < n; i++)
        ids[i] = (i * 37 + 11) % rows;
    void *dt = dput(NULL, 2 * (size_t)rows * width);
    gpu->upload_weight(gpu, dt, table, KF_DTYPE_F32, (size_t)rows * width);
    float *dout = dpoison((size_t)n * width);
    gpu->embed(gpu, dout, dt, ids, n, width);
    if (gpu_ok("embed")) {
        float *out = dget(dout, (size_t)n * width), *ref = malloc(sizeof(float) * (size_t)n * width);
        for (int r = 0; r < n; r++)
            for (int i = 0; i < width; i++)
                ref[(size_t)r * width + i] = bf16r(table[(size_t)ids[r] * width + i]);
        const double e = rel_err(out, ref, (size_t)n * width);
        check(e == 0, "embed (bf16 table, exact)", e, 0);
        free(out);
        free(ref);
    }
    gpu->free(gpu, dt);
    gpu->free(gpu, dout);
    free(table);
}

static void test_rmsnorm(int rows, int n, size_t ld, int in_place) {
    float *x = rnd((size_t)rows * ld, -3, 3), *w = rnd((size_t)n, 0.5f, 1.5f);
    float *wb = bf16_copy(w, (size_t)n), *ref = malloc(sizeof(float) * (size_t)rows * ld);
    memcpy(ref, x, sizeof(float) * (size_t)rows * ld);
    kf_cpu_rmsnorm(ref, ld, x, ld, wb, rows, n, 1e-6f);
    void *dw = dput(NULL, 2 * (size_t)n);
    gpu->upload_weight(gpu, dw, w, KF_DTYPE_F32, (size_t)n);
    float *dx = dput(x, sizeof(float) * (size_t)rows * ld);
    float *dy = in_place ? dx : dpoison((size_t)rows * ld);
    gpu->rmsnorm(gpu, dy, ld, dx, ld, dw, rows, n, 1e-6f);
    char what[96];
    snprintf(what, sizeof what, "rmsnorm rows=%d n=%d ld=%zu%s", rows, n, ld, in_place ? " in place" : "");
    if (gpu_ok(what)) {
        float *y = dget(dy, (size_t)rows * ld);
        /* compare the rows' first n values only (the padding of a poisoned y stays NaN) */
        float *yc = malloc(sizeof(float) * (size_t)rows * n), *rc = malloc(sizeof(float) * (size_t)rows * n);
        for (int r = 0; r < rows; r++) {
            memcpy(yc + (size_t)r * n, y + (size_t)r * ld, sizeof(float) * n);
            memcpy(rc + (size_t)r * n, ref + (size_t)r * ld, sizeof(float) * n);
        }
        const double e = rel_err(yc, rc, (size_t)rows * n);
        check(e < 1e-6, what, e, 1e-6);
        free(y);
        free(yc);
        free(rc);
    }
    gpu->free(gpu, dw);
    gpu->free(gpu, dx);
    if (!in_place)
        gpu->free(gpu, dy);
    free(x);
    free(w);
    free(wb);
    free(ref);
}

static void test_rope(kf_rope_kind kind) {
    const int n_tok = 70, nh = 6, hd = 128;
    const size_t ts = (size_t)nh * hd + 64; /* token stride wider than the heads, as for q inside qkv */
    kf_rope_spec spec = {.kind = kind, .theta = 1e6, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                         .original_max_pos = 8192};
    double inv[64];
    kf_rope_inv_freq(&spec, hd, inv);
    int64_t pos[70];
    for (int t = 0; t < n_tok; t++)
        pos[t] = t < 35 ? t : 40000 + 13 * t; /* small and large angles */
    float *x = rnd((size_t)n_tok * ts, -2, 2), *ref = malloc(sizeof(float) * (size_t)n_tok * ts);
    memcpy(ref, x, sizeof(float) * (size_t)n_tok * ts);
    kf_cpu_rope(ref, ts, n_tok, nh, hd, pos, inv);
    float *dx = dput(x, sizeof(float) * (size_t)n_tok * ts);
    gpu->rope(gpu, dx, ts, n_tok, nh, hd, pos, inv);
    char what[64];
    snprintf(what, sizeof what, "rope (kind %d)", (int)kind);
    if (gpu_ok(what)) {
        float *y = dget(dx, (size_t)n_tok * ts);
        const double e = rel_err(y, ref, (size_t)n_tok * ts);
        check(e < 1e-6, what, e, 1e-6);
        free(y);
    }
    gpu->free(gpu, dx);
    free(x);
    free(ref);
}

static void test_elementwise(void) {
    const int rows = 33, n = 1000;
    const size_t N = (size_t)rows * n;
    float *g = rnd(N, -8, 8), *u = rnd(N, -2, 2), *ref = malloc(sizeof(float) * N);
    memcpy(ref, g, sizeof(float) * N);
    kf_cpu_silu_mul(ref, u, rows, n);
    float *dg = dput(g, sizeof(float) * N), *du = dput(u, sizeof(float) * N);
    gpu->silu_mul(gpu, dg, du, rows, n);
    if (gpu_ok("silu_mul")) {
        float *y = dget(dg, N);
        const double e = rel_err(y, ref, N);
        check(e < 1e-6, "silu_mul", e, 1e-6);
        free(y);
    }
    memcpy(ref, g, sizeof(float) * N);
    kf_cpu_add(ref, u, rows, n);
    gpu->upload(gpu, dg, g, sizeof(float) * N);
    gpu->add(gpu, dg, du, rows, n);
    if (gpu_ok("add")) {
        float *y = dget(dg, N);
        const double e = rel_err(y, ref, N);
        check(e == 0, "add (exact)", e, 0);
        free(y);
    }
    gpu->free(gpu, dg);
    gpu->free(gpu, du);
    free(g);
    free(u);
    free(ref);
}

/* ---- the paged pool ------------------------------------------------------------------------- */

typedef struct {
    int kvh, hd, n_pages;
    size_t block, page_stride; /* floats */
    float *host;               /* [n_pages, K|V, 16, kvh, hd] */
    float *dev;
    int32_t *pages;            /* a permutation: logical page -> pool page */
} pool;

static void pool_make(pool *p, int kvh, int hd, int n_keys, int poison) {
    p->kvh = kvh;
    p->hd = hd;
    p->n_pages = (n_keys + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS + 3;
    if (p->n_pages % 7 == 0)
        p->n_pages++; /* i -> (7 i + 2) mod n_pages below must be a permutation */
    p->block = (size_t)KF_PAGE_TOKENS * kvh * hd;
    p->page_stride = 2 * p->block;
    const size_t n = (size_t)p->n_pages * p->page_stride;
    p->host = poison ? malloc(sizeof(float) * n) : rnd(n, -1, 1);
    if (poison)
        for (size_t i = 0; i < n; i++)
            p->host[i] = NAN;
    p->dev = dput(p->host, sizeof(float) * n);
    p->pages = malloc(sizeof(int32_t) * (size_t)p->n_pages);
    for (int i = 0; i < p->n_pages; i++)
        p->pages[i] = (int32_t)((i * 7 + 2) % p->n_pages);
}

static kf_paged_kv pool_kv(const pool *p, int on_gpu) {
    float *base = on_gpu ? p->dev : p->host;
    kf_paged_kv kv = {.k = base, .v = base + p->block, .page_stride = p->page_stride, .kv_heads = p->kvh,
                      .head_dim = p->hd};
    return kv;
}

static void pool_free(pool *p) {
    gpu->free(gpu, p->dev);
    free(p->host);
    free(p->pages);
}

static void test_kv_store(void) {
    pool p;
    pool_make(&p, 2, 64, 100, 1);
    const int n = 40, first = 5, row = 2 * 64;
    float *k = rnd((size_t)n * row, -1, 1), *v = rnd((size_t)n * row, -1, 1);
    float *dk = dput(k, sizeof(float) * (size_t)n * row), *dv = dput(v, sizeof(float) * (size_t)n * row);
    kf_paged_kv hkv = pool_kv(&p, 0), dkv = pool_kv(&p, 1);
    kf_cpu_kv_store(&hkv, p.pages, first, n, k, v);
    gpu->kv_store(gpu, &dkv, p.pages, first, n, dk, dv);
    if (gpu_ok("kv_store")) {
        const size_t total = (size_t)p.n_pages * p.page_stride;
        float *got = dget(p.dev, total);
        check(memcmp(got, p.host, sizeof(float) * total) == 0, "kv_store (pages permuted, slot 5, bit-exact)", 0, 0);
        free(got);
    }
    gpu->free(gpu, dk);
    gpu->free(gpu, dv);
    free(k);
    free(v);
    pool_free(&p);
}

/* ---- attention ------------------------------------------------------------------------------ */

static void test_attention(int nh, int kvh, int hd, int n_keys, int n_q, int with_bias) {
    pool p;
    pool_make(&p, kvh, hd, n_keys, 0);
    const size_t qs = (size_t)nh * hd;
    const int bias_len = n_keys - 17;
    float *q = rnd((size_t)n_q * qs, -1, 1), *bias = rnd((size_t)kvh * n_keys, -2, 0.5f);
    float *ref = malloc(sizeof(float) * (size_t)n_q * qs);
    kf_attn_args a = {.q = q, .q_stride = qs, .out = ref, .out_stride = qs, .n_q = n_q, .n_heads = nh,
                      .n_keys = n_keys, .pages = p.pages, .kv = pool_kv(&p, 0), .scale = 1.0f / sqrtf((float)hd),
                      .bias = with_bias ? bias : NULL, .bias_stride = (size_t)n_keys, .bias_len = bias_len};
    cpu->attention(cpu, &a);
    float *dq = dput(q, sizeof(float) * (size_t)n_q * qs), *dout = dpoison((size_t)n_q * qs);
    float *dbias = dput(bias, sizeof(float) * (size_t)kvh * n_keys);
    kf_attn_args g = a;
    g.q = dq;
    g.out = dout;
    g.kv = pool_kv(&p, 1);
    g.bias = with_bias ? dbias : NULL;
    gpu->attention(gpu, &g);
    char what[128];
    snprintf(what, sizeof what, "attention heads %d/%d d=%d keys=%d q=%d%s", nh, kvh, hd, n_keys, n_q,
             with_bias ? " bias" : "");
    float *dense = NULL;
    if (gpu_ok(what)) {
        dense = dget(dout, (size_t)n_q * qs);
        const double e = rel_err(dense, ref, (size_t)n_q * qs);
        check(e < 2e-5, what, e, 2e-5);
    }

    /* sparse: a random ascending subset per KV head, then the full history (must equal dense) */
    const int n_hist = n_keys - n_q;
    if (n_hist > 0 && dense) {
        const int n_sel = n_hist / 2 + 1;
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)kvh * n_hist);
        for (int gi = 0; gi < kvh; gi++) {
            int c = 0; /* choose n_sel of n_hist, ascending (selection sampling) */
            for (int t = 0; t < n_hist && c < n_sel; t++) {
                const uint64_t r = (uint64_t)(t * 2654435761u + gi * 40503u + seed_counter) % (uint64_t)(n_hist - t);
                if ((int)r < n_sel - c)
                    idx[(size_t)gi * n_hist + c++] = t;
            }
        }
        int32_t *didx = dput(idx, sizeof(int32_t) * (size_t)kvh * n_hist);
        kf_sparse_attn_args sa = {.attn = a, .hist_idx = idx, .idx_stride = (size_t)n_hist, .n_sel = n_sel};
        cpu->sparse_attention(cpu, &sa);
        kf_sparse_attn_args sg = {.attn = g, .hist_idx = didx, .idx_stride = (size_t)n_hist, .n_sel = n_sel};
        float *dout2 = dpoison((size_t)n_q * qs);
        sg.attn.out = dout2;
        gpu->sparse_attention(gpu, &sg);
        snprintf(what, sizeof what, "sparse attention %d of %d history keys%s", n_sel, n_hist, with_bias ? " bias" : "");
        if (gpu_ok(what)) {
            float *o = dget(dout2, (size_t)n_q * qs);
            const double e = rel_err(o, ref, (size_t)n_q * qs);
            check(e < 2e-5, what, e, 2e-5);
            free(o);
        }
        for (int gi = 0; gi < kvh; gi++)
            for (int t = 0; t < n_hist; t++)
                idx[(size_t)gi * n_hist + t] = t;
        gpu->upload(gpu, didx, idx, sizeof(int32_t) * (size_t)kvh * n_hist);
        sg.n_sel = n_hist;
        float *dout3 = dpoison((size_t)n_q * qs);
        sg.attn.out = dout3;
        gpu->sparse_attention(gpu, &sg);
        if (gpu_ok("sparse attention, full selection")) {
            float *o = dget(dout3, (size_t)n_q * qs);
            check(memcmp(o, dense, sizeof(float) * (size_t)n_q * qs) == 0,
                  "sparse attention, full selection == dense (bit for bit)", 0, 0);
            free(o);
        }
        gpu->free(gpu, dout2);
        gpu->free(gpu, dout3);
        gpu->free(gpu, didx);
        free(idx);
    }
    free(dense);
    gpu->free(gpu, dq);
    gpu->free(gpu, dout);
    gpu->free(gpu, dbias);
    free(q);
    free(bias);
    free(ref);
    pool_free(&p);
}

/* ---- QUOKA selection ------------------------------------------------------------------------ */

/* The selection step 4 (window + sinks + top budget, ascending) recomputed on the host from
 * given scores: the GPU's choice must be exactly this one for its own scores. */
static int host_pick(const float *sc, int nt, int w_lo, int w_hi, int n_sink, int budget_in, int32_t *out) {
    w_lo = w_lo < 0 ? 0 : (w_lo > nt ? nt : w_lo);
    w_hi = w_hi > nt ? nt : (w_hi < w_lo ? w_lo : w_hi);
    const int n_cand = nt - (w_hi - w_lo), budget = budget_in < n_cand ? budget_in : n_cand;
    int n = 0;
    if (budget == n_cand) {
        for (int t = 0; t < nt; t++)
            out[n++] = t;
        return n;
    }
    uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)nt);
    int c = 0;
    for (int t = 0; t < nt; t++)
        if (t < w_lo || t >= w_hi)
            keys[c++] = t < n_sink ? UINT32_MAX : kf_cpu_order_key(sc[t]);
    int take_eq;
    const uint32_t thr = kf_cpu_radix_select(keys, n_cand, budget, &take_eq);
    c = 0;
    for (int t = 0; t < nt; t++) {
        if (t >= w_lo && t < w_hi) {
            out[n++] = t;
            continue;
        }
        const uint32_t k = keys[c++];
        if (k > thr || (k == thr && take_eq-- > 0))
            out[n++] = t;
    }
    free(keys);
    return n;
}

static void test_quoka(int nh, int kvh, int hd, int n_q, int n_hist, int n_keep, int budget, int n_sink, int w_lo,
                       int w_hi) {
    pool p;
    pool_make(&p, kvh, hd, n_hist, 0);
    const size_t qs = (size_t)nh * hd;
    const int n_sel = kf_quoka_n_selected(n_hist, budget, w_lo, w_hi);
    float *q = rnd((size_t)n_q * qs, -1, 1), *sc_ref = malloc(sizeof(float) * (size_t)kvh * n_hist);
    int32_t *idx_ref = malloc(sizeof(int32_t) * (size_t)kvh * n_sel);
    kf_quoka_select_args a = {.q = q, .q_stride = qs, .n_q = n_q, .n_heads = nh, .n_hist = n_hist, .pages = p.pages,
                              .kv = pool_kv(&p, 0), .n_keep = n_keep, .budget = budget, .n_sink = n_sink,
                              .win_lo = w_lo, .win_hi = w_hi, .out_idx = idx_ref, .idx_stride = (size_t)n_sel,
                              .scores = sc_ref};
    cpu->quoka_select(cpu, &a);
    float *dq = dput(q, sizeof(float) * (size_t)n_q * qs), *dsc = dpoison((size_t)kvh * n_hist);
    int32_t *didx = dput(NULL, sizeof(int32_t) * (size_t)kvh * n_sel);
    kf_quoka_select_args g = a;
    g.q = dq;
    g.kv = pool_kv(&p, 1);
    g.out_idx = didx;
    g.scores = dsc;
    gpu->quoka_select(gpu, &g);
    char what[128];
    snprintf(what, sizeof what, "quoka scores q=%d hist=%d keep=%d budget=%d sinks=%d win=[%d,%d)", n_q, n_hist,
             n_keep, budget, n_sink, w_lo, w_hi);
    if (gpu_ok(what)) {
        float *sc = dget(dsc, (size_t)kvh * n_hist);
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)kvh * n_sel), *want = malloc(sizeof(int32_t) * (size_t)n_hist);
        gpu->download(gpu, idx, didx, sizeof(int32_t) * (size_t)kvh * n_sel);
        const double e = rel_err(sc, sc_ref, (size_t)kvh * n_hist);
        check(e < 1e-5, what, e, 1e-5);
        int same = 1, agree = 0;
        for (int gi = 0; gi < kvh; gi++) {
            const int n = host_pick(sc + (size_t)gi * n_hist, n_hist, w_lo, w_hi, n_sink, budget, want);
            same &= n == n_sel && memcmp(want, idx + (size_t)gi * n_sel, sizeof(int32_t) * (size_t)n_sel) == 0;
            for (int j = 0; j < n_sel; j++)
                agree += idx[(size_t)gi * n_sel + j] == idx_ref[(size_t)gi * n_sel + j];
        }
        check(same, "  top-k by radix select == host selection on the GPU's scores", 0, 0);
        printf("  %-58s %d of %d indices equal to the CPU backend's\n", "", agree, kvh * n_sel);
        free(sc);
        free(idx);
        free(want);
    }
    gpu->free(gpu, dq);
    gpu->free(gpu, dsc);
    gpu->free(gpu, didx);
    free(q);
    free(sc_ref);
    free(idx_ref);
    pool_free(&p);
}

/* ---- end to end: goldens ---------------------------------------------------------------------- */

/* The same-precision reference: the CPU backend with bf16-rounded weights and GEMM inputs. */
static void bf16ref_upload_weight(kf_backend *b, void *dst, const void *src, kf_dtype dt, size_t n) {
    (void)b;
    float *d = dst;
    kf_convert_to_f32(d, src, dt, n);
    for (size_t i = 0; i < n; i++)
        d[i] = bf16r(d[i]);
}

static void bf16ref_matmul(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M, int N,
                           int K, int accumulate) {
    (void)b;
    float *xb = malloc(sizeof(float) * (size_t)M * K);
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++)
            xb[(size_t)i * K + k] = bf16r(x[(size_t)i * ldx + k]);
    kf_cpu_matmul(y, ldy, xb, (size_t)K, w, M, N, K, accumulate);
    free(xb);
}

typedef struct {
    float **hidden; /* [L + 1][T, H] */
    float *logits;  /* [T, V] */
} run_out;

static int run_model(kf_backend *b, const char *dir, const int32_t *ids, int T, const kf_quoka_params *qp, int chunk,
                     run_out *o, const kf_hfconfig **cfg_out, kf_model **keep) {
    kf_error err = {0};
    kf_model *m = NULL;
    if (kf_model_load(&m, dir, b, &err) != KF_OK) {
        printf("  cannot load %s: %s\n", dir, err.msg);
        return -1;
    }
    const kf_hfconfig *c = kf_model_config(m);
    const int L = c->n_layers, H = c->hidden_size, V = c->vocab_size;
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)T);
    for (int i = 0; i < T; i++)
        rows[i] = i;
    o->hidden = calloc((size_t)L + 1, sizeof *o->hidden);
    for (int l = 0; l <= L; l++) {
        o->hidden[l] = malloc(sizeof(float) * (size_t)T * H);
        for (size_t i = 0; i < (size_t)T * H; i++)
            o->hidden[l][i] = NAN;
    }
    o->logits = malloc(sizeof(float) * (size_t)T * V);
    for (size_t i = 0; i < (size_t)T * V; i++)
        o->logits[i] = NAN;
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    int rc = -1;
    if (kf_model_arena(m, &a, T, &err) == KF_OK) {
        kf_forward_args fa = {.ids = ids, .n_tokens = T, .chunk = chunk, .logit_rows = rows, .n_logit_rows = T,
                              .logits = o->logits, .capture_rows = rows, .n_capture_rows = T, .hidden = o->hidden,
                              .quoka = qp};
        if (kf_model_forward(m, &a, &seq, &fa, &err) == KF_OK)
            rc = 0;
        else
            printf("  forward on %s: %s\n", b->name, err.msg);
        kf_seq_release(&a, &seq);
        kf_arena_free(&a);
    } else
        printf("  arena: %s\n", err.msg);
    free(rows);
    *cfg_out = c;
    *keep = m;
    return rc;
}

static void run_free(run_out *o, int L) {
    for (int l = 0; l <= L && o->hidden; l++)
        free(o->hidden[l]);
    free(o->hidden);
    free(o->logits);
}

static void test_golden(const char *name) {
    char path[4096];
    /* $KF_TEST_DATA overrides the compiled-in path: a build carried to another machine */
    const char *env = getenv("KF_TEST_DATA");
    if (env && *env)
        snprintf(path, sizeof path, "%s/%s", env, name);
    else
        snprintf(path, sizeof path, "%s", kf_test_data(name));
    char gpath[4200];
    snprintf(gpath, sizeof gpath, "%s/golden.safetensors", path);
    kf_st_set golden;
    kf_error err = {0};
    if (kf_st_open_file(&golden, gpath, &err) != KF_OK) {
        check(0, gpath, INFINITY, 0);
        return;
    }
    const kf_st_tensor *ti = kf_st_find(&golden, "input_ids");
    const int T = (int)ti->numel;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int i = 0; i < T; i++) {
        int64_t v;
        memcpy(&v, (const char *)ti->data + 8 * i, 8);
        ids[i] = (int32_t)v;
    }
    kf_backend *ref = kf_backend_cpu_create();
    ref->name = "cpu-bf16";
    ref->upload_weight = bf16ref_upload_weight;
    ref->matmul = bf16ref_matmul;
    ref->set_weight_dtype = NULL; /* its own fp32 storage: the functions above read fp32 weights */
    printf("%s (%d tokens)\n", name, T);

    /* dense, then QUOKA (chunk 16, budget 16: sparse from the third chunk on) */
    kf_quoka_params qp = kf_quoka_params_default();
    qp.n_q = 4;
    qp.budget = 16;
    qp.n_sink = 2;
    for (int mode = 0; mode < 2; mode++) {
        const kf_quoka_params *q = mode ? &qp : NULL;
        const int chunk = mode ? 16 : 64;
        run_out og = {0}, os = {0}, of = {0};
        const kf_hfconfig *c = NULL;
        kf_model *mg = NULL, *ms = NULL, *mf = NULL;
        const int okg = run_model(gpu, path, ids, T, q, chunk, &og, &c, &mg) == 0 && gpu_ok("forward");
        const int oks = run_model(ref, path, ids, T, q, chunk, &os, &c, &ms) == 0;
        const int okf = run_model(cpu, path, ids, T, q, chunk, &of, &c, &mf) == 0; /* fp32 reference */
        char what[128];
        if (okg && oks && okf) {
            const int L = c->n_layers, H = c->hidden_size, V = c->vocab_size;
            for (int l = 0; l <= L; l++) {
                float *gref = NULL;
                size_t n = (size_t)T * H;
                const float *want = of.hidden[l];
                if (!mode) { /* dense: the golden file is the fp32 reference */
                    snprintf(what, sizeof what, "hidden.%d", l);
                    const kf_st_tensor *t = kf_st_find(&golden, what);
                    gref = malloc(t->nbytes);
                    memcpy(gref, t->data, t->nbytes);
                    want = gref;
                }
                const double eg = rel_err(og.hidden[l], want, n), es = rel_err(os.hidden[l], want, n);
                snprintf(what, sizeof what, "%s hidden.%d vs %s", mode ? "quoka" : "dense", l,
                         mode ? "cpu fp32" : "golden");
                check(eg <= 2 * es + 1e-5, what, eg, 2 * es + 1e-5);
                free(gref);
            }
            const float *lwant = of.logits;
            float *lref = NULL;
            size_t n = (size_t)T * V, off = 0;
            if (!mode) {
                const kf_st_tensor *t = kf_st_find(&golden, "logits_last16");
                lref = malloc(t->nbytes);
                memcpy(lref, t->data, t->nbytes);
                lwant = lref;
                n = (size_t)16 * V;
                off = (size_t)(T - 16) * V;
            }
            const double eg = rel_err(og.logits + off, lwant, n), es = rel_err(os.logits + off, lwant, n);
            snprintf(what, sizeof what, "%s logits%s", mode ? "quoka" : "dense", mode ? " vs cpu fp32" : "_last16 vs golden");
            check(eg <= 2 * es + 1e-5, what, eg, 2 * es + 1e-5);
            int flips_g = 0, flips_s = 0;
            for (int t = 0; t < T; t++) {
                int ag = 0, as = 0, af = 0;
                for (int i = 1; i < V; i++) {
                    ag = og.logits[(size_t)t * V + i] > og.logits[(size_t)t * V + ag] ? i : ag;
                    as = os.logits[(size_t)t * V + i] > os.logits[(size_t)t * V + as] ? i : as;
                    af = of.logits[(size_t)t * V + i] > of.logits[(size_t)t * V + af] ? i : af;
                }
                flips_g += ag != af;
                flips_s += as != af;
            }
            printf("  %-58s gpu %d, bf16 cpu reference %d (of %d)\n", "argmax differing from fp32 cpu:", flips_g,
                   flips_s, T);
            free(lref);
            run_free(&og, L);
            run_free(&os, L);
            run_free(&of, L);
        } else {
            check(0, mode ? "quoka forward" : "dense forward", INFINITY, 0);
        }
        kf_model_free(mg);
        kf_model_free(ms);
        kf_model_free(mf);
    }
    ref->destroy(ref);
    free(ids);
    kf_st_close(&golden);
}

/* ---- bench-attention ---------------------------------------------------------------------- */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int bench_attention(int argc, char **argv) {
    const char *hist_text = "32768,131072";
    int chunk = 4096, repeat = 5, nh = 32, kvh = 8, hd = 128, budget = 1024, nq = 16;
    for (int i = 0; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--history"))
            hist_text = argv[i + 1];
        else if (!strcmp(argv[i], "--chunk"))
            chunk = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--repeat"))
            repeat = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--quoka-budget"))
            budget = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench-attention: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (chunk < 1 || repeat < 1 || repeat > 100)
        return 2;
    printf("attention chunk: %d queries, heads %d/%d, head_dim %d, QUOKA budget %d, N_Q %d, median of %d\n", chunk, nh,
           kvh, hd, budget, nq, repeat);
    printf("%9s %10s %10s %10s %10s %10s %9s\n", "keys", "dense ms", "TFLOP/s", "quoka ms", "select ms", "TFLOP/s*",
           "speedup");
    kf_quoka_params qp = kf_quoka_params_default();
    qp.budget = budget;
    qp.n_q = nq;
    for (const char *s = hist_text; *s;) {
        const int nk = atoi(s); /* total keys, the chunk's own last */
        while (*s && *s != ',')
            s++;
        if (*s)
            s++;
        const int P = nk - chunk;
        if (P < 0)
            continue;
        pool p;
        pool_make(&p, kvh, hd, nk, 0);
        for (int i = 0; i < p.n_pages; i++)
            p.pages[i] = i;
        const size_t qs = (size_t)nh * hd;
        float *q = rnd((size_t)chunk * qs, -1, 1);
        float *dq = dput(q, sizeof(float) * (size_t)chunk * qs), *dout = dpoison((size_t)chunk * qs);
        kf_attn_args at = {.q = dq, .q_stride = qs, .out = dout, .out_stride = qs, .n_q = chunk, .n_heads = nh,
                           .n_keys = nk, .pages = p.pages, .kv = pool_kv(&p, 1), .scale = 1.0f / sqrtf((float)hd)};
        kf_quoka_ws ws;
        kf_error err = {0};
        if (kf_quoka_ws_init(&ws, gpu, &qp, kvh, nk, &err) != KF_OK) {
            printf("quoka: %s\n", err.msg);
            return 1;
        }
        kf_quoka_select_args sel = {.q = dq, .q_stride = qs, .n_q = chunk, .n_heads = nh, .n_hist = P,
                                    .pages = p.pages, .kv = at.kv, .n_keep = nq, .budget = budget,
                                    .out_idx = ws.idx, .idx_stride = ws.cap};
        double td[101], tq[101], ts[101];
        for (int r = 0; r <= repeat; r++) { /* run 0 warms up */
            double t0 = now();
            gpu->attention(gpu, &at);
            gpu->take_error(gpu);
            td[r] = now() - t0;
            t0 = now();
            kf_quoka_attention(&ws, &at);
            gpu->take_error(gpu);
            tq[r] = now() - t0;
            t0 = now();
            if (P > 0)
                gpu->quoka_select(gpu, &sel);
            if (gpu->take_error(gpu)) {
                printf("CUDA error: %s\n", kf_backend_cuda_message(gpu));
                return 1;
            }
            ts[r] = now() - t0;
        }
        qsort(td + 1, (size_t)repeat, sizeof(double), cmp_d);
        qsort(tq + 1, (size_t)repeat, sizeof(double), cmp_d);
        qsort(ts + 1, (size_t)repeat, sizeof(double), cmp_d);
        const double d = td[1 + repeat / 2], qk = tq[1 + repeat / 2], sl = ts[1 + repeat / 2];
        /* 4 * heads * d per (query, visible key): QK^T and PV */
        const double keys_dense = (double)chunk * P + (double)chunk * (chunk + 1) / 2;
        const int sel_n = P > budget ? budget : P;
        const double keys_sparse = (double)chunk * sel_n + (double)chunk * (chunk + 1) / 2;
        const double fd = 4.0 * nh * hd * keys_dense, fs = 4.0 * nh * hd * keys_sparse;
        printf("%9d %10.3f %10.1f %10.3f %10.3f %10.1f %8.2fx\n", nk, d * 1e3, fd / d * 1e-12, qk * 1e3, sl * 1e3,
               fs / qk * 1e-12, d / qk);
        printf("attn %d dense_ms %.4f quoka_ms %.4f select_ms %.4f\n", nk, d * 1e3, qk * 1e3, sl * 1e3);
        fflush(stdout);
        kf_quoka_ws_free(&ws);
        gpu->free(gpu, dq);
        gpu->free(gpu, dout);
        free(q);
        pool_free(&p);
    }
    printf("(TFLOP/s* counts the sparse FLOPs only; selection time is inside quoka ms)\n");
    return 0;
}

int main(int argc, char **argv) {
    if (kf_cuda_device_count() == 0) {
        printf("test_cuda: no CUDA device, skipped\n");
        return SKIP_CODE;
    }
    kf_error err = {0};
    gpu = kf_backend_cuda_create(0, &err);
    if (!gpu) {
        printf("test_cuda: %s%s\n", err.msg, err.code == KF_ERR_NOTFOUND ? ", skipped" : "");
        return err.code == KF_ERR_NOTFOUND ? SKIP_CODE : 1;
    }
    if (argc > 1 && !strcmp(argv[1], "bench-attention")) {
        const int rc = bench_attention(argc - 2, argv + 2);
        gpu->destroy(gpu);
        return rc;
    }
    cpu = kf_backend_cpu_create();
    seed_counter = (uint64_t)time(NULL); /* fresh inputs every run; the seed is printed to replay one */
    if (argc > 2 && !strcmp(argv[1], "--seed"))
        seed_counter = strtoull(argv[2], NULL, 10);
    printf("test_cuda: seed %llu\n", (unsigned long long)seed_counter);

    printf("operations\n");
    test_matmul(37, 300, 256, 0);
    test_matmul(37, 300, 256, 1);
    test_matmul(1, 2560, 2560, 0);
    test_matmul(513, 1024, 2560, 1);
    test_embed();
    test_rmsnorm(40, 2560, 2560, 0);
    test_rmsnorm(33, 128, 130, 0);
    test_rmsnorm(64 * 8, 128, 128, 1); /* q/k norm: per head, in place */
    test_rope(KF_ROPE_DEFAULT);
    test_rope(KF_ROPE_LINEAR);
    test_rope(KF_ROPE_LLAMA3);
    test_elementwise();
    test_kv_store();
    test_attention(4, 2, 64, 300, 70, 0);
    test_attention(4, 2, 64, 300, 70, 1);
    test_attention(32, 8, 128, 1000, 130, 0);
    test_attention(32, 8, 128, 1000, 130, 1);
    test_attention(6, 3, 96, 77, 77, 0); /* no history; head_dim not a multiple of 32 */
    test_attention(8, 8, 256, 200, 1, 1); /* MHA, one query, the largest head_dim */
    test_quoka(4, 2, 64, 100, 700, 8, 50, 4, 600, 650);
    test_quoka(32, 8, 128, 512, 4000, 16, 1024, 0, 0, 0);
    test_quoka(4, 2, 64, 5, 300, 16, 40, 2, 0, 0);       /* chunk shorter than N_Q */
    test_quoka(4, 2, 64, 50, 100, 8, 500, 0, 10, 20);    /* the budget holds every key */
    printf("end to end\n");
    test_golden("hf-qwen3-tiny");
    test_golden("hf-llama3-tiny-random");

    printf("test_cuda: %d passed, %d failed\n", n_pass, n_fail);
    cpu->destroy(cpu);
    gpu->destroy(gpu);
    return n_fail ? 1 : 0;
}
