/* kvfold bench prefill --compare-weights — the same prefill on bf16 and on fp32 weights in one
 * process: the model loaded twice (each on its own CPU backend), the runs alternated (bf16, fp32,
 * fp32, bf16, ...) so that both see the same load, and the ratios taken pair by pair. Also the GEMMs
 * alone at one layer's shapes (the backend's matmul on each storage) and the largest difference
 * of the last position's logits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/bench_weights.h"
#include "tools/cli.h"

static double (*g_clock)(void) = cli_now;

typedef struct {
    kf_backend *b;
    kf_model *m;
    kf_arena arena;
    kf_seq seq;
    int have_arena;
} side;

static void side_free(side *s) {
    if (s->have_arena) {
        kf_seq_release(&s->arena, &s->seq);
        kf_arena_free(&s->arena);
    }
    kf_model_free(s->m);
    if (s->b)
        s->b->destroy(s->b);
}

static int side_load(side *s, const char *dir, kf_weights w, long long n, kf_error *err) {
    memset(s, 0, sizeof *s);
    if (!(s->b = kf_backend_cpu_create()))
        return kf_fail(err, KF_ERR_NOMEM, "out of memory"), -1;
    const kf_model_opts o = {.weights = w};
    if (kf_model_load_opts(&s->m, dir, s->b, &o, err) != KF_OK || kf_model_arena(s->m, &s->arena, n, err) != KF_OK)
        return -1;
    s->have_arena = 1;
    kf_seq_init(&s->seq);
    return 0;
}

/* One prefill of ids (the last row's logits) from an empty document: seconds, or -1. */
static double side_prefill(side *s, const int32_t *ids, long long n, long long chunk, float *logits, kf_error *err) {
    const int32_t last = (int32_t)n - 1;
    kf_forward_args fa = {.ids = ids, .n_tokens = (int)n, .chunk = (int)chunk, .logit_rows = &last,
                          .n_logit_rows = 1, .logits = logits};
    const double t0 = g_clock();
    if (kf_model_forward(s->m, &s->arena, &s->seq, &fa, err) != KF_OK)
        return -1;
    const double t = g_clock() - t0;
    return kf_seq_truncate(&s->arena, &s->seq, 0, err) == KF_OK ? t : -1;
}

/* The backend's matmul over one layer's seven projections (M = chunk), weights random in
 * [-1, 1) as bf16 values (exact in both storages), for at least min_s seconds: GFLOP/s. */
static double gemm_rate(kf_backend *b, const kf_hfconfig *c, int M, double min_s) {
    const int H = c->hidden_size, I = c->intermediate_size, QD = c->n_heads * c->head_dim,
              KD = c->n_kv_heads * c->head_dim;
    const int N[7] = {QD, KD, KD, H, I, I, H}, K[7] = {H, H, H, QD, H, H, I};
    size_t maxw = 0, maxk = 0, maxn = 0;
    for (int i = 0; i < 7; i++) {
        maxw = (size_t)N[i] * K[i] > maxw ? (size_t)N[i] * K[i] : maxw;
        maxk = (size_t)K[i] > maxk ? (size_t)K[i] : maxk;
        maxn = (size_t)N[i] > maxn ? (size_t)N[i] : maxn;
    }
    const size_t nh = maxw > maxk * M ? maxw : maxk * M;
    float *host = malloc(sizeof(float) * nh);                              /* [max(N K, M K)] */
    void *w[7] = {0};
    float *x = b->alloc(b, sizeof(float) * maxk * M), *y = b->alloc(b, sizeof(float) * maxn * M);
    double rate = -1;
    int ok = host && x && y;
    for (size_t i = 0; ok && i < nh; i++)
        host[i] = 0.0078125f * (float)((i * 2654435761u) % 256) - 1.0f;
    for (int i = 0; ok && i < 7; i++)
        if ((ok = (w[i] = b->alloc(b, (size_t)N[i] * K[i] * kf_dtype_size(b->weight_dtype))) != NULL))
            b->upload_weight(b, w[i], host, KF_DTYPE_F32, (size_t)N[i] * K[i]);
    if (ok) {
        memcpy(x, host, sizeof(float) * maxk * M);
        double flops = 0, t0 = 0;
        for (int pass = 0; rate < 0; pass++) {
            if (pass == 1)
                t0 = g_clock();
            for (int i = 0; i < 7; i++) {
                b->matmul(b, y, (size_t)N[i], x, (size_t)K[i], w[i], M, N[i], K[i], 0);
                flops += pass ? 2.0 * M * N[i] * K[i] : 0;
            }
            if (pass >= 1 && g_clock() - t0 >= min_s)
                rate = flops / (g_clock() - t0) * 1e-9;
        }
    }
    for (int i = 0; i < 7; i++)
        if (w[i])
            b->free(b, w[i]);
    if (x)
        b->free(b, x);
    if (y)
        b->free(b, y);
    free(host);
    return rate;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* median, min and max of v[n] (sorted in place) */
static void stats(double *v, int n, double *med, double *lo, double *hi) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    *med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    *lo = v[0];
    *hi = v[n - 1];
}

/* The alternated runs: t[0][r] bf16, t[1][r] fp32, after one warm-up each; g[0|1][r] the GEMMs'
 * rates measured beside them. Odd pairs run fp32 first (A B B A ...), so that neither side always
 * follows the other. 0, or -1 with err set. */
static int alternate(side s[2], const kf_hfconfig *c, const int32_t *ids, long long n, long long chunk, int repeat,
                     float *logits[2], double *t[2], double *g[2], kf_error *err) {
    for (int r = -1; r < repeat; r++)
        for (int i = 0; i < 2; i++) {
            const int k = r & 1 ? 1 - i : i;
            const double sec = side_prefill(&s[k], ids, n, chunk, logits[k], err);
            if (sec < 0)
                return -1;
            if (r < 0)
                continue;
            t[k][r] = sec;
            if ((g[k][r] = gemm_rate(s[k].b, c, (int)(chunk < n ? chunk : n), 0.2)) < 0)
                return kf_fail(err, KF_ERR_NOMEM, "out of memory for the GEMM buffers"), -1;
        }
    return 0;
}

static void report(const kf_hfconfig *c, side s[2], long long n, long long chunk, int repeat, float *logits[2],
                   double *t[2], double *g[2]) {
    double speed[repeat], gspeed[repeat], med[2], lo, hi, gm[2];
    for (int r = 0; r < repeat; r++) {
        speed[r] = t[1][r] / t[0][r];
        gspeed[r] = g[0][r] / g[1][r];
    }
    for (int k = 0; k < 2; k++) {
        stats(t[k], repeat, &med[k], &lo, &hi);
        stats(g[k], repeat, &gm[k], &lo, &hi);
    }
    double dmax = 0, lmax = 0;
    for (int v = 0; v < c->vocab_size; v++) {
        dmax = fmax(dmax, fabs((double)logits[0][v] - logits[1][v]));
        lmax = fmax(lmax, fabs((double)logits[1][v]));
    }
    const double wb = (double)kf_model_weight_bytes(s[0].m), wf = (double)kf_model_weight_bytes(s[1].m);
    printf("weights in memory: bf16 %.3f GB, fp32 %.3f GB (bf16 / fp32 = %.3f)\n", wb / 1e9, wf / 1e9, wb / wf);
    printf("prefill %lld tokens (chunk %lld), runs alternated (%d pairs): median bf16 %.4f s, fp32 %.4f s\n",
           n, chunk, repeat, med[0], med[1]);
    stats(gspeed, repeat, &gm[0], &lo, &hi);
    printf("gemm-only (backend matmul, one layer's shapes, M = %lld): speed bf16 / fp32 median %.3f (pairs %.3f-%.3f)\n",
           chunk < n ? chunk : n, gm[0], lo, hi);
    printf("last position's logits: max |bf16 - fp32| = %.3g (max |logit| %.3g)\n", dmax, lmax);
    stats(speed, repeat, &med[0], &lo, &hi);
    printf("prefill speed bf16 / fp32 weights: median %.3f (pairs %.3f-%.3f)\n", med[0], lo, hi);
    printf("weights_speed_ratio %.3f\n", med[0]);
}

int bench_weights_compare(const char *dir, const int32_t *ids, long long n, long long chunk, int repeat,
                          double (*now)(void)) {
    g_clock = now;
    side s[2];
    memset(s, 0, sizeof s);
    kf_error err = {0};
    float *logits[2] = {NULL, NULL};
    double *t[2] = {NULL, NULL}, *g[2] = {NULL, NULL};
    int rc = KF_EXIT_FAIL;
    if (side_load(&s[0], dir, KF_WEIGHTS_BF16, n, &err) || side_load(&s[1], dir, KF_WEIGHTS_F32, n, &err)) {
        cli_error("bench prefill", "%s", err.msg);
        goto out;
    }
    const kf_hfconfig *c = kf_model_config(s[0].m);
    for (int k = 0; k < 2; k++) {
        logits[k] = malloc(sizeof(float) * (size_t)c->vocab_size); /* [vocab] */
        t[k] = malloc(sizeof(double) * (size_t)repeat);            /* [repeat] */
        g[k] = malloc(sizeof(double) * (size_t)repeat);            /* [repeat] */
        if (!logits[k] || !t[k] || !g[k]) {
            cli_error("bench prefill", "out of memory");
            goto out;
        }
    }
    if (alternate(s, c, ids, n, chunk, repeat, logits, t, g, &err) != 0) {
        cli_error("bench prefill", "%s", err.msg);
        goto out;
    }
    report(c, s, n, chunk, repeat, logits, t, g);
    rc = KF_EXIT_OK;
out:
    for (int k = 0; k < 2; k++) {
        free(logits[k]);
        free(t[k]);
        free(g[k]);
    }
    side_free(&s[1]);
    side_free(&s[0]);
    return rc;
}
