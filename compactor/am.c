#include "compactor/am.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/sort.h"

#define Q_TILE 256

static float *design(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                     size_t key_stride, const float *beta, int t);

void kf_am_targets_free(kf_am_targets *t) {
    free(t->m);
    free(t->y);
    free(t->Y);
    free(t->score);
    memset(t, 0, sizeof *t);
}

int64_t kf_am_targets_bytes(int R, int T, int d) {
    return 2 * kf_ws_bytes(R, sizeof(float)) + kf_ws_bytes((int64_t)R * d, sizeof(float)) +
           kf_ws_bytes(T, sizeof(float));
}

/* The targets' scratch: the fp64 score sums [T] and one tile's logits [Q_TILE, T]. */
static int64_t targets_scratch_bytes(int T) {
    return kf_ws_bytes(T, sizeof(double)) + kf_ws_bytes((int64_t)Q_TILE * T, sizeof(float));
}

int64_t kf_am_targets_ws_bytes(int R, int T, int d) {
    return kf_am_targets_bytes(R, T, d) + targets_scratch_bytes(T);
}

static void targets_tiles(const kf_am_head *h, kf_score_method method, kf_am_targets *out, double *score, float *Z);

kf_status kf_am_targets_compute(const kf_am_head *h, kf_score_method method, kf_am_targets *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    const int T = h->T, R = h->R, d = h->d;
    out->m = malloc(sizeof(float) * (size_t)R);
    out->y = malloc(sizeof(float) * (size_t)R);
    out->Y = malloc(sizeof(float) * (size_t)R * d);
    out->score = malloc(sizeof(float) * (size_t)T);
    kf_ws own, *w = kf_ws_or_own(NULL, &own, targets_scratch_bytes(T));
    double *score = w ? kf_ws_zalloc(w, T, sizeof(double)) : NULL; /* [T] */
    float *Z = w ? kf_ws_alloc(w, (int64_t)Q_TILE * T, sizeof(float)) : NULL; /* [tile, T] */
    if (!out->m || !out->y || !out->Y || !score || !Z || !out->score) {
        kf_ws_free(&own);
        kf_am_targets_free(out);
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for targets (R %d, T %d)", R, T);
    }
    targets_tiles(h, method, out, score, Z);
    kf_ws_free(&own);
    return KF_OK;
}

kf_status kf_am_targets_compute_ws(const kf_am_head *h, kf_score_method method, kf_am_targets *out, kf_ws *ws,
                                   kf_error *err) {
    memset(out, 0, sizeof *out);
    const int T = h->T, R = h->R, d = h->d;
    out->m = kf_ws_alloc(ws, R, sizeof(float));
    out->y = kf_ws_alloc(ws, R, sizeof(float));
    out->Y = kf_ws_alloc(ws, (int64_t)R * d, sizeof(float));
    out->score = kf_ws_alloc(ws, T, sizeof(float));
    const size_t mark = kf_ws_mark(ws);
    double *score = kf_ws_zalloc(ws, T, sizeof(double));          /* [T] */
    float *Z = kf_ws_alloc(ws, (int64_t)Q_TILE * T, sizeof(float)); /* [tile, T] */
    if (!out->m || !out->y || !out->Y || !score || !Z || !out->score)
        return kf_fail(err, KF_ERR_NOMEM, "AM: the workspace is too small for targets (R %d, T %d)", R, T);
    targets_tiles(h, method, out, score, Z);
    kf_ws_reset(ws, mark);
    return KF_OK;
}

/* The targets in tiles of Q_TILE rows; score [T] zeroed, Z [Q_TILE, T] scratch. */
static void targets_tiles(const kf_am_head *h, kf_score_method method, kf_am_targets *out, double *score, float *Z) {
    const int T = h->T, R = h->R, d = h->d;
    float *acc = out->score; /* per-tile column sums in fp32, flushed into fp64 score[] */
    for (int i0 = 0; i0 < R; i0 += Q_TILE) {
        const int n = R - i0 < Q_TILE ? R - i0 : Q_TILE;
        double sum[Q_TILE];
        kf_solve_sgemm(h->be, KF_NO_TRANS, KF_TRANS, n, T, d, h->scale, h->q + (size_t)i0 * d, d, h->k, h->k_stride,
                       0.0f, Z, T);
        kf_solve_softmax_rows(h->be, &(kf_softmax_rows_args){.x = Z, .ldx = T, .rows = n, .n = T,
                                                             .max_out = out->m + i0, .sum_out = sum});
        memset(acc, 0, sizeof(float) * (size_t)T);
        for (int i = 0; i < n; i++) {
            float *z = Z + (size_t)i * T;
            out->y[i0 + i] = (float)sum[i];
            if (method == KF_SCORE_RMS) {
#pragma omp simd
                for (int j = 0; j < T; j++)
                    acc[j] += z[j] * z[j];
            } else {
#pragma omp simd
                for (int j = 0; j < T; j++)
                    acc[j] += z[j];
            }
        }
        for (int j = 0; j < T; j++)
            score[j] += acc[j];
        kf_solve_sgemm(h->be, KF_NO_TRANS, KF_NO_TRANS, n, d, T, 1.0f, Z, T, h->v, h->v_stride, 0.0f,
                       out->Y + (size_t)i0 * d, d);
    }
    for (int j = 0; j < T; j++)
        out->score[j] = (float)(method == KF_SCORE_RMS ? sqrt(score[j] / R) : score[j] / R);
}

typedef struct {
    float score;
    int32_t index;
} scored;

static int by_score_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score)
        return x->score > y->score ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static int by_index(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int64_t kf_am_select_bytes(int T) {
    return 2 * kf_ws_bytes(T, sizeof(scored)); /* the scores, the sort's scratch */
}

kf_status kf_am_select(const float *score, int T, int t, int32_t *sel, kf_ws *ws, kf_error *err) {
    if (t < 0 || t > T)
        return kf_fail(err, KF_ERR_INVALID, "AM: cannot keep %d of %d keys", t, T);
    kf_ws own, *w = kf_ws_or_own(ws, &own, kf_am_select_bytes(T));
    const size_t mark = w ? kf_ws_mark(w) : 0;
    scored *s = w ? kf_ws_alloc(w, T, sizeof *s) : NULL;   /* [T] */
    scored *tmp = w ? kf_ws_alloc(w, T, sizeof *s) : NULL; /* [T] the sorts' scratch */
    if (!s || !tmp) {
        kf_ws_free(&own);
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for selection");
    }
    for (int j = 0; j < T; j++)
        s[j] = (scored){isnan(score[j]) ? -INFINITY : score[j], j};
    kf_sort(s, (size_t)T, sizeof *s, by_score_desc, tmp);
    for (int j = 0; j < t; j++)
        sel[j] = s[j].index;
    kf_sort(sel, (size_t)t, sizeof *sel, by_index, tmp);
    kf_ws_reset(w, mark);
    kf_ws_free(&own);
    return KF_OK;
}

/* Gather the kept keys into a contiguous [t, d] buffer taken from ws. */
static float *gather_rows(const float *x, size_t stride, const int32_t *sel, int t, int d, kf_ws *ws) {
    float *out = kf_ws_alloc(ws, (int64_t)t * d, sizeof(float));
    if (out)
        for (int j = 0; j < t; j++)
            memcpy(out + (size_t)j * d, x + (size_t)sel[j] * stride, sizeof(float) * d);
    return out;
}

static void count_path(int path, int *fallbacks, kf_am_stats *stats) {
    if (!stats)
        return;
    if (path == KF_LSTSQ_RIDGE)
        (*fallbacks)++;
    else if (path == KF_LSTSQ_FAILED)
        stats->failures++;
}

int kf_box_lsq(const double *G, const double *b, int t, double lo, double hi, double tol, int max_sweeps, double *w) {
    double scale = 0;
    for (int j = 0; j < t; j++) {
        w[j] = w[j] < lo ? lo : (w[j] > hi ? hi : w[j]);
        scale = fabs(b[j]) > scale ? fabs(b[j]) : scale;
    }
    for (int sweep = 0; sweep < max_sweeps; sweep++) {
        double worst = 0, gw_max = 0;
        for (int j = 0; j < t; j++) {
            const double *row = G + (size_t)j * t;
            double gw = 0;
            for (int c = 0; c < t; c++)
                gw += row[c] * w[c];
            gw_max = fabs(gw) > gw_max ? fabs(gw) : gw_max;
            const double grad = gw - b[j];
            /* projected gradient: zero at a bound the gradient pushes against */
            const double pg = (w[j] <= lo && grad > 0) || (w[j] >= hi && grad < 0) ? 0 : fabs(grad);
            worst = pg > worst ? pg : worst;
            if (row[j] > 0) { /* exact minimisation along coordinate j, then projection */
                double x = w[j] - grad / row[j];
                w[j] = x < lo ? lo : (x > hi ? hi : x);
            }
        }
        if (worst <= tol * (scale > gw_max ? scale : gw_max) || worst == 0)
            return sweep + 1;
    }
    return max_sweeps + 1;
}

/* The beta fit's normal equations over the kept keys kc [t, d]: G = M^T M [t, t] (full),
 * b = M^T y [t] and yy = y^T y in fp64, M_ij = exp(s q_i.k_j - m_i), accumulated over row tiles
 * (kf_gram_tiles: M is never held whole). 0, or -1 when out of memory. */
static int64_t beta_tiles_bytes(int t) {
    return kf_gram_tiles_bytes(t, 0, 0);
}

static void beta_tile_rhs(const float *M, const float *y, int n, int t, double *b, double *yy);

static int beta_normal(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t, double *G, double *b,
                       double *yy, kf_ws *ws) {
    const int R = h->R, d = h->d;
    const size_t mark = kf_ws_mark(ws);
    kf_gram_tiles w; /* w.X: a tile of M [KF_GRAM_TILE, t] */
    if (kf_gram_tiles_alloc(&w, t, 0, 0, ws) != 0) {
        kf_ws_reset(ws, mark);
        return -1;
    }
    memset(G, 0, sizeof(double) * (size_t)t * t);
    memset(b, 0, sizeof(double) * (size_t)t);
    *yy = 0;
    for (int i0 = 0; i0 < R; i0 += KF_GRAM_TILE) {
        const int n = R - i0 < KF_GRAM_TILE ? R - i0 : KF_GRAM_TILE;
        kf_solve_sgemm(h->be, KF_NO_TRANS, KF_TRANS, n, t, d, h->scale, h->q + (size_t)i0 * d, d, kc, d, 0.0f, w.X,
                       t);
        kf_solve_exp_rows(h->be, w.X, t, n, t, tg->m + i0);
        beta_tile_rhs(w.X, tg->y + i0, n, t, b, yy);
        kf_gram_tile_add(h->be, w.X, NULL, n, t, 0, &w, G, NULL, 0);
    }
    for (int r = 0; r < t; r++)
        for (int c = 0; c < r; c++)
            G[(size_t)r * t + c] = G[(size_t)c * t + r];
    kf_ws_reset(ws, mark);
    return 0;
}

/* ||M w - y||^2 = w^T G w - 2 b^T w + y^T y (w NULL: all ones). */
static double residual_sq(const double *G, const double *b, double yy, int t, const float *w) {
    double s = yy;
    for (int j = 0; j < t; j++) {
        const double wj = w ? w[j] : 1.0;
        double gw = 0;
        for (int k = 0; k < t; k++)
            gw += G[(size_t)j * t + k] * (w ? w[k] : 1.0);
        s += wj * (gw - 2 * b[j]);
    }
    return s;
}

/* w = argmin ||M w - y||^2 + rho ||w - 1||^2 with rho = rel * tr(M^T M) / t, from the normal
 * equations (Cholesky in fp64); x [t] scratch, the rest from ws (ridge_bytes). */
static int64_t ridge_bytes(int t) {
    return kf_ws_bytes(t, sizeof(double)) + kf_solve_spd_bytes(t);
}

static int ridge_to_one(const kf_backend *be, const double *G, const double *b, int t, double rel, double *x,
                        float *w, kf_ws *ws) {
    double tr = 0;
    for (int j = 0; j < t; j++)
        tr += G[(size_t)j * t + j];
    const double rho = rel * (tr > 0 ? tr / t : 1.0) + 1e-30;
    const size_t mark = kf_ws_mark(ws);
    double *br = kf_ws_alloc(ws, t, sizeof(double)); /* [t] */
    if (!br)
        return -1;
    for (int j = 0; j < t; j++)
        br[j] = b[j] + rho;
    const int spd = kf_solve_spd(be, G, t, rho, br, x, ws);
    kf_ws_reset(ws, mark);
    if (spd < 0)
        return -1;
    const int rc = spd == 0 ? KF_LSTSQ_QR : KF_LSTSQ_FAILED;
    for (int j = 0; j < t; j++)
        w[j] = rc == KF_LSTSQ_QR ? (float)x[j] : 1.0f;
    return rc;
}

/* ||M||_2^2 by power iteration on G = M^T M from kf_spectral_norm_sq's seeded start; v [t] scratch. */
static double gram_spectral_sq(const kf_backend *be, const double *G, int t, int iters, uint64_t seed, double *v,
                               double *gv) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
    for (int j = 0; j < t; j++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        v[j] = 0.5 + (double)(s >> 11) / 9007199254740992.0;
    }
    double sigma2 = 0;
    for (int it = 0; it < iters; it++) {
        double nv = 0;
        for (int j = 0; j < t; j++)
            nv += v[j] * v[j];
        nv = sqrt(nv);
        if (nv == 0)
            break;
        for (int j = 0; j < t; j++)
            v[j] /= nv;
        kf_solve_dsymv(be, t, 1.0, G, t, v, 0.0, gv); /* G v */
        sigma2 = 0;
        for (int j = 0; j < t; j++)
            sigma2 += v[j] * gv[j]; /* ||M v||^2 */
        memcpy(v, gv, sizeof(double) * t);
    }
    return sigma2;
}

kf_status kf_am_fit_beta(const kf_am_head *h, const kf_am_targets *tg, const int32_t *sel, int t, uint64_t seed,
                         float *beta, kf_am_stats *stats, kf_error *err) {
    return kf_am_fit_beta_ex(h, tg, sel, t, seed, KF_BETA_AM, beta, stats, NULL, err);
}

/* The converged box fit from the start w (in and out); wd [t] scratch. */
static void box_refine(const double *G, const double *b, int t, float lo, float hi, double *wd, float *w) {
    for (int j = 0; j < t; j++)
        wd[j] = w[j];
    kf_box_lsq(G, b, t, lo, hi, 1e-9, KF_BOX_MAX_SWEEPS, wd);
    for (int j = 0; j < t; j++)
        w[j] = (float)wd[j];
}

/* AM's two projected-gradient steps on ||M w - y||^2 with step 1/L: the gradient M^T (M w - y) =
 * G w - b; v, g [t] scratch. */
static void pg_steps(const kf_backend *be, const double *G, const double *b, int t, uint64_t seed, float lo, float hi,
                     double *v, double *g, float *w) {
    double L = gram_spectral_sq(be, G, t, 3, seed, v, g);
    if (!(L > 1e-6))
        L = 1e-6;
    for (int it = 0; it < 2; it++) {
        for (int j = 0; j < t; j++)
            v[j] = w[j];
        memcpy(g, b, sizeof(double) * t);
        kf_solve_dsymv(be, t, 1.0, G, t, v, -1.0, g); /* g = G w - b */
        for (int j = 0; j < t; j++) {
            float x = w[j] - (float)(g[j] / L);
            w[j] = x < lo ? lo : (x > hi ? hi : x);
        }
    }
}

void kf_beta_normal_free(kf_beta_normal *ne) {
    if (!ne->in_ws) {
        free(ne->G);
        free(ne->b);
    }
    memset(ne, 0, sizeof *ne);
}

int64_t kf_beta_normal_bytes(int t) {
    const int64_t t1 = t ? t : 1;
    return kf_ws_bytes(t1 * t1, sizeof(double)) + kf_ws_bytes(t1, sizeof(double));
}

int64_t kf_beta_normal_build_bytes(int t) {
    return kf_beta_normal_bytes(t) + beta_tiles_bytes(t);
}

/* G [t1, t1] and b [t1] (t1 = max(t, 1)) from ws (in_ws), or the heap when ws is NULL. */
static int beta_normal_alloc(kf_beta_normal *ne, int t, int zero, kf_ws *ws) {
    const int64_t t1 = t ? t : 1;
    if (ws) {
        ne->G = zero ? kf_ws_zalloc(ws, t1 * t1, sizeof(double)) : kf_ws_alloc(ws, t1 * t1, sizeof(double));
        ne->b = zero ? kf_ws_zalloc(ws, t1, sizeof(double)) : kf_ws_alloc(ws, t1, sizeof(double));
        ne->in_ws = 1;
    } else {
        ne->G = zero ? calloc((size_t)(t1 * t1), sizeof(double)) : malloc(sizeof(double) * (size_t)(t1 * t1));
        ne->b = zero ? calloc((size_t)t1, sizeof(double)) : malloc(sizeof(double) * (size_t)t1);
    }
    return ne->G && ne->b ? 0 : -1;
}

kf_status kf_beta_normal_build(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t,
                               kf_beta_normal *out, kf_ws *ws, kf_error *err) {
    memset(out, 0, sizeof *out);
    out->t = t, out->be = h->be;
    int ok = beta_normal_alloc(out, t, 0, ws) == 0;
    kf_ws own, *w = ok ? kf_ws_or_own(ws, &own, beta_tiles_bytes(t)) : NULL;
    ok = w && (t == 0 || beta_normal(h, tg, kc, t, out->G, out->b, &out->yy, w) == 0);
    if (w)
        kf_ws_free(&own);
    if (!ok) {
        kf_beta_normal_free(out);
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for the beta fit (R %d, t %d)", h->R, t);
    }
    return KF_OK;
}

void kf_beta_normal_add(kf_beta_normal *acc, const kf_beta_normal *part) {
    const int t = acc->t;
    for (size_t k = 0; k < (size_t)t * t; k++)
        acc->G[k] += part->G[k];
    for (int j = 0; j < t; j++)
        acc->b[j] += part->b[j];
    acc->yy += part->yy;
}

int64_t kf_am_fit_beta_normal_bytes(int t) {
    return 2 * kf_ws_bytes(t, sizeof(double)) + kf_ws_bytes(t, sizeof(float)) + ridge_bytes(t);
}

kf_status kf_am_fit_beta_normal(const kf_beta_normal *ne, uint64_t seed, kf_beta_fit fit, float *beta,
                                kf_am_stats *stats, kf_ws *ws, kf_error *err) {
    const int t = ne->t;
    if (t == 0)
        return KF_OK;
    const float lo = expf(-3.0f), hi = expf(3.0f);
    const double *G = ne->G, *b = ne->b;
    kf_ws own, *ww = kf_ws_or_own(ws, &own, kf_am_fit_beta_normal_bytes(t));
    const size_t mark = ww ? kf_ws_mark(ww) : 0;
    double *x = ww ? kf_ws_zalloc(ww, t, sizeof(double)) : NULL, *g = ww ? kf_ws_zalloc(ww, t, sizeof(double)) : NULL;
    float *w = ww ? kf_ws_zalloc(ww, t, sizeof(float)) : NULL; /* x, g, w [t] */
    kf_status rc = KF_OK;
    int path = x && g && w ? ridge_to_one(ne->be, G, b, t, 1e-6, x, w, ww) : -1;
    /* Least squares on the partition function in fp64 normal equations, with a tiny ridge that
     * pulls towards w = 1 (beta = 0):
     *   min ||M w - y||^2 + rho ||w - 1||^2,   rho = 1e-6 * tr(M^T M) / t.
     * M's columns span e^-20 .. 1. The fp32 least-squares solution (pivoted QR) was wild there:
     * clamped to the box it fitted worse than w = 1 (plain drop) on the training queries for most
     * heads of the records model at budget 0.5 (relative residual 0.35-0.97 against 0.13 here,
     * measured); the fp64 Gram solve with the pull keeps undetermined weights near 1. Everything
     * after M's exponentials works on G = M^T M and b = M^T y (M is never held whole:
     * docs/decisions/normal-equations-in-tiles.md). */
    if (path < 0) {
        rc = kf_fail(err, KF_ERR_NOMEM, "AM: out of memory in least squares");
        goto out;
    }
    count_path(path, stats ? &stats->beta_fallbacks : NULL, stats);
    for (int j = 0; j < t; j++)
        w[j] = isnan(w[j]) ? 1.0f : (w[j] < lo ? lo : (w[j] > hi ? hi : w[j]));
    /* keep the clamped start only if it beats w = 1 (counted: docs/decisions/beta-fit.md) */
    if (residual_sq(G, b, ne->yy, t, w) > residual_sq(G, b, ne->yy, t, NULL)) {
        for (int j = 0; j < t; j++)
            w[j] = 1.0f;
        if (stats)
            stats->beta_restarts++;
    }
    if (fit == KF_BETA_BOX)
        box_refine(G, b, t, lo, hi, x, w);
    else
        pg_steps(ne->be, G, b, t, seed, lo, hi, x, g, w);
    for (int j = 0; j < t; j++)
        beta[j] = logf(w[j]);
out:
    if (ww)
        kf_ws_reset(ww, mark);
    kf_ws_free(&own);
    return rc;
}

int64_t kf_am_fit_beta_bytes(int t, int d) {
    return kf_ws_bytes((int64_t)t * d, sizeof(float)) + kf_beta_normal_bytes(t) +
           kf_ws_max(beta_tiles_bytes(t), kf_am_fit_beta_normal_bytes(t));
}

kf_status kf_am_fit_beta_ex(const kf_am_head *h, const kf_am_targets *tg, const int32_t *sel, int t, uint64_t seed,
                            kf_beta_fit fit, float *beta, kf_am_stats *stats, kf_ws *ws, kf_error *err) {
    if (t == 0)
        return KF_OK;
    kf_ws own, *w = kf_ws_or_own(ws, &own, kf_am_fit_beta_bytes(t, h->d));
    const size_t mark = w ? kf_ws_mark(w) : 0;
    float *kc = w ? gather_rows(h->k, h->k_stride, sel, t, h->d, w) : NULL; /* [t, d] */
    if (!kc) {
        kf_ws_free(&own);
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for the beta fit (R %d, t %d)", h->R, t);
    }
    kf_beta_normal ne;
    kf_status rc = kf_beta_normal_build(h, tg, kc, t, &ne, w, err);
    if (rc == KF_OK)
        rc = kf_am_fit_beta_normal(&ne, seed, fit, beta, stats, w, err);
    kf_beta_normal_free(&ne);
    kf_ws_reset(w, mark);
    kf_ws_free(&own);
    return rc;
}

kf_status kf_am_fit_values(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                           size_t key_stride, const float *beta, int t, const float *Y, float *values,
                           kf_am_stats *stats, kf_error *err) {
    if (t == 0)
        return KF_OK;
    float *X = design(be, q, R, d, scale, keys, key_stride, beta, t); /* [R, t] */
    if (!X)
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for the value fit (R %d, t %d)", R, t);
    int path = kf_solve_lstsq(be, X, R, t, Y, d, values);
    free(X);
    if (path < 0)
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory in least squares");
    count_path(path, stats ? &stats->value_fallbacks : NULL, stats);
    return KF_OK;
}

/* X = softmax_j(s q_i.k_j + beta_j) [R, t]; NULL when out of memory. */
static float *design(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                     size_t key_stride, const float *beta, int t) {
    float *X = malloc(sizeof(float) * (size_t)R * t);
    if (!X)
        return NULL;
    kf_solve_sgemm(be, KF_NO_TRANS, KF_TRANS, R, t, d, scale, q, d, keys, key_stride, 0.0f, X, t);
    kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = X, .ldx = t, .rows = R, .n = t, .bias = beta});
    return X;
}

void kf_value_gram_free(kf_value_gram *g) {
    if (!g->in_ws) {
        free(g->G);
        free(g->B);
        free(g->A);
        free(g->Bs);
    }
    memset(g, 0, sizeof *g);
}

/* b += M^T y [t] and yy += y^T y in fp64 for one tile M [n, t] (n t: cheap beside the Gram's). */
static void beta_tile_rhs(const float *M, const float *y, int n, int t, double *b, double *yy) {
    for (int i = 0; i < n; i++) {
        const double yi = y[i];
        const float *z = M + (size_t)i * t;
        *yy += yi * yi;
        for (int j = 0; j < t; j++)
            b[j] += z[j] * yi;
    }
}

/* w->X [n, t] = the logits of rows q [n, d] (row i0 of the build) over the keys kc folded along u:
 * the kept keys' logits (w->L's rows, else the GEMM that filled them) plus beta_j (q_r . u)
 * (docs/decisions/fold-logits-from-drop.md). */
static void folded_logits(const kf_backend *be, const float *q, int i0, int n, int d, float scale, const float *kc,
                          size_t key_stride, const float *beta, const float *u, int t, const kf_gram_tiles *w) {
    const float *L = i0 + n <= w->L_rows ? w->L + (size_t)i0 * t : w->X; /* [n, t] the kept keys' logits */
    if (L == w->X) /* not kept: computed as they were (then read and written in the same pass) */
        kf_solve_sgemm(be, KF_NO_TRANS, KF_TRANS, n, t, d, scale, q, d, kc, key_stride, 0.0f, w->X, (size_t)t);
    for (int r = 0; r < n; r++) {
        float qu = 0;
        for (int c = 0; c < d; c++)
            qu += q[(size_t)r * d + c] * u[c];
        float *x = w->X + (size_t)r * t;
        for (int j = 0; j < t; j++)
            x[j] = L[(size_t)r * t + j] + beta[j] * qu;
    }
}

/* The keys' normal equations over R rows into G, B, a tile at a time (u: folded_logits). */
static void gram_accumulate(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                            size_t key_stride, const float *bias, const float *fold_beta, const float *u, int t,
                            const float *Y, const kf_gram_tiles *w, double *G, double *B) {
    for (int i0 = 0; i0 < R; i0 += KF_GRAM_TILE) {
        const int n = R - i0 < KF_GRAM_TILE ? R - i0 : KF_GRAM_TILE;
        if (u)
            folded_logits(be, q + (size_t)i0 * d, i0, n, d, scale, keys, key_stride, fold_beta, u, t, w);
        else
            kf_solve_sgemm(be, KF_NO_TRANS, KF_TRANS, n, t, d, scale, q + (size_t)i0 * d, d, keys, key_stride, 0.0f,
                           w->X, t);
        kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = w->X, .ldx = t, .rows = n, .n = t, .bias = bias});
        kf_gram_tile_add(be, w->X, Y + (size_t)i0 * d, n, t, d, w, G, B, i0 == 0);
    }
}

static void gram_finish(kf_value_gram *g);

static void gram_rebuild(const float *q, int R, float scale, const float *keys, size_t key_stride, const float *bias,
                         const float *fold_beta, const float *u, const float *Y, kf_gram_tiles *w, kf_value_gram *g) {
    const int t = g->t, d = g->d;
    if (t > 0 && R > 0)
        gram_accumulate(g->be, q, R, d, scale, keys, key_stride, bias, fold_beta, u, t, Y, w, g->G, g->B);
    else { /* no rows: the zero normal equations a fresh build has */
        memset(g->G, 0, sizeof(double) * (size_t)t * t);
        memset(g->B, 0, sizeof(double) * (size_t)t * d);
    }
    gram_finish(g);
}

void kf_value_gram_rebuild(const float *q, int R, float scale, const float *keys, size_t key_stride, const float *beta,
                           const float *Y, kf_gram_tiles *w, kf_value_gram *g) {
    gram_rebuild(q, R, scale, keys, key_stride, beta, NULL, NULL, Y, w, g);
}

void kf_value_gram_rebuild_folded(const float *q, int R, float scale, const float *kc, size_t key_stride,
                                  const float *beta, const float *u, const float *Y, kf_gram_tiles *w,
                                  kf_value_gram *g) {
    gram_rebuild(q, R, scale, kc, key_stride, NULL, beta, u, Y, w, g);
}

int64_t kf_value_gram_build_bytes(int t, int d) {
    return kf_value_gram_bytes(t, d) + kf_gram_tiles_bytes(t, d, 0);
}

kf_status kf_value_gram_build(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                              size_t key_stride, const float *beta, int t, const float *Y, kf_value_gram *out,
                              kf_ws *ws, kf_error *err) {
    kf_gram_tiles w = {0};
    const int ok0 = kf_value_gram_alloc(out, be, t, d, ws) == 0;
    const size_t mark = ws ? kf_ws_mark(ws) : 0; /* the tiles: scratch */
    const int ok = ok0 && kf_gram_tiles_alloc(&w, t, d, 0, ws) == 0;
    if (ok)
        kf_value_gram_rebuild(q, R, scale, keys, key_stride, beta, Y, &w, out);
    kf_gram_tiles_free(&w);
    if (ws)
        kf_ws_reset(ws, mark);
    if (ok)
        return KF_OK;
    kf_value_gram_free(out);
    return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for the value refit's normal equations (R %d, t %d)", R, t);
}

/* (G + mu I) X = B + mu V0 into g's scratch (X in g->Bs); 0, or nonzero when the Cholesky failed. */
static int ridge_solve(const kf_value_gram *g, double mu, const float *v0, size_t v0_stride) {
    const int t = g->t, d = g->d;
    double *A = g->A, *B = g->Bs; /* the gram's own scratch: one solve at a time */
    memcpy(A, g->G, sizeof(double) * (size_t)t * t);
    memcpy(B, g->B, sizeof(double) * (size_t)t * d);
    for (int j = 0; j < t; j++) {
        A[(size_t)j * t + j] += mu;
        if (v0)
            for (int c = 0; c < d; c++)
                B[(size_t)j * d + c] += mu * v0[(size_t)j * v0_stride + c];
    }
    /* Cholesky of the (whole, symmetric) A in place, then A X = B for B [t, d] in place */
    return kf_solve_dpotrf(g->be, A, t, t) != 0 || kf_solve_dpotrs(g->be, A, t, t, B, d, d) != 0;
}

kf_status kf_value_gram_solve(const kf_value_gram *g, double alpha, const float *v0, size_t v0_stride, float *values,
                              kf_am_stats *stats, kf_error *err) {
    (void)err;
    const int t = g->t, d = g->d;
    if (t == 0)
        return KF_OK;
    const double unit = g->tr > 0 ? g->tr / t : 1.0;
    double mu = (alpha > 1e-6 ? alpha : 1e-6) * unit;
    int failed = ridge_solve(g, mu, v0, v0_stride);
    /* G from fp32 tile products may be indefinite by about 1e-6 of its scale: a factorization that
     * fails below 1e-4 tr / t is retried with the ridge ten times larger (docs/decisions/fp32-tile-products.md) */
    for (; failed && mu * 10 <= 1.0001e-4 * unit; failed = ridge_solve(g, mu, v0, v0_stride)) {
        mu *= 10;
        if (stats)
            stats->value_fallbacks++;
    }
    if (!failed) {
        for (size_t i = 0; i < (size_t)t * d; i++)
            values[i] = (float)g->Bs[i];
    } else {
        memset(values, 0, sizeof(float) * (size_t)t * d);
        if (stats)
            stats->failures++;
    }
    return KF_OK;
}

/* the least alpha ranked in fp32: its ridge bounds the condition number by 1 + t / alpha
 * (docs/decisions/fp32-ranking-solves.md) */
static const double kRankF32MinAlpha = 1e-3;

kf_status kf_value_gram_rank_solve(const kf_value_gram *g, double alpha, const float *v0, size_t v0_stride,
                                   float *values, kf_error *err) {
    const int t = g->t, d = g->d;
    if (t == 0 || alpha < kRankF32MinAlpha)
        return kf_value_gram_solve(g, alpha, v0, v0_stride, values, NULL, err);
    const double mu = alpha * (g->tr > 0 ? g->tr / t : 1.0);
    float *A = (float *)g->A; /* [t, t] fp32 in the fp64 scratch's first half */
    for (size_t k = 0; k < (size_t)t * t; k++)
        A[k] = (float)g->G[k];
    for (int j = 0; j < t; j++) {
        A[(size_t)j * t + j] = (float)(g->G[(size_t)j * t + j] + mu);
        for (int c = 0; c < d; c++)
            values[(size_t)j * d + c] =
                (float)(g->B[(size_t)j * d + c] + (v0 ? mu * v0[(size_t)j * v0_stride + c] : 0.0));
    }
    if (kf_solve_spotrf(g->be, A, t, t) == 0 && kf_solve_spotrs(g->be, A, t, t, values, d, d) == 0)
        return KF_OK;
    return kf_value_gram_solve(g, alpha, v0, v0_stride, values, NULL, err); /* fp32 too coarse: fp64 */
}

int64_t kf_value_gram_bytes(int t, int d) {
    const int64_t t1 = t ? t : 1;
    return 2 * kf_ws_bytes(t1 * t1, sizeof(double)) + 2 * kf_ws_bytes(t1 * d, sizeof(double));
}

int kf_value_gram_alloc(kf_value_gram *g, const kf_backend *be, int t, int d, kf_ws *ws) {
    memset(g, 0, sizeof *g);
    g->t = t, g->d = d, g->be = be;
    const size_t t1 = (size_t)(t ? t : 1);
    if (ws) {
        g->in_ws = 1;
        g->G = kf_ws_zalloc(ws, (int64_t)(t1 * t1), sizeof(double));
        g->B = kf_ws_zalloc(ws, (int64_t)(t1 * d), sizeof(double));
        g->A = kf_ws_alloc(ws, (int64_t)(t1 * t1), sizeof(double));
        g->Bs = kf_ws_alloc(ws, (int64_t)(t1 * d), sizeof(double));
        return g->G && g->B && g->A && g->Bs ? 0 : -1;
    }
    g->G = calloc(t1 * t1, sizeof(double));
    g->B = calloc(t1 * d, sizeof(double));
    g->A = malloc(sizeof(double) * t1 * t1);
    g->Bs = malloc(sizeof(double) * t1 * d);
    if (g->G && g->B && g->A && g->Bs)
        return 0;
    kf_value_gram_free(g);
    return -1;
}

/* Mirror G's upper triangle and take its trace. */
static void gram_finish(kf_value_gram *g) {
    const int t = g->t;
    for (int r = 0; r < t; r++)
        for (int c = 0; c < r; c++)
            g->G[(size_t)r * t + c] = g->G[(size_t)c * t + r];
    g->tr = 0;
    for (int j = 0; j < t; j++)
        g->tr += g->G[(size_t)j * t + j];
}

/* One row tile of kf_kept_normal_build: w->Z [n, t] the tile's logits over the kept keys. */
static void kept_tile(const float *m, const float *y, const float *Y, int n, int t, int d, const kf_gram_tiles *w,
                      kf_beta_normal *bn, kf_value_gram *drop, int first) {
    const kf_backend *be = bn->be;
    float *Z = w->Z, *X = w->X;
    memcpy(X, Z, sizeof(float) * (size_t)n * t);
    kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = X, .ldx = t, .rows = n, .n = t}); /* drop's design */
    kf_solve_exp_rows(be, Z, t, n, t, m);                                                    /* beta's M */
    beta_tile_rhs(Z, y, n, t, bn->b, &bn->yy);
    kf_gram_tile_add(be, Z, NULL, n, t, 0, w, bn->G, NULL, 0); /* bn zeroed by its alloc */
    kf_gram_tile_add(be, X, Y, n, t, d, w, drop->G, drop->B, first);
}

int64_t kf_kept_normal_build_bytes(int t, int d, int own_tiles) {
    return kf_beta_normal_bytes(t) + kf_value_gram_bytes(t, d) + (own_tiles ? kf_gram_tiles_bytes(t, d, 1) : 0);
}

int kf_kept_normal_alloc(kf_beta_normal *bn, kf_value_gram *drop, const kf_backend *be, int t, int d, kf_ws *ws) {
    memset(bn, 0, sizeof *bn);
    bn->t = t, bn->be = be;
    const int ok0 = beta_normal_alloc(bn, t, 1, ws) == 0;
    if (kf_value_gram_alloc(drop, be, t, d, ws) == 0 && ok0)
        return 0;
    kf_beta_normal_free(bn);
    kf_value_gram_free(drop);
    return -1;
}

kf_status kf_kept_normal_fill(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t,
                              kf_gram_tiles *tiles, kf_beta_normal *bn, kf_value_gram *drop, kf_ws *ws, kf_error *err) {
    const int R = h->R, d = h->d;
    kf_gram_tiles own = {0}, *w = tiles ? tiles : &own; /* tiles [KF_GRAM_TILE, t] */
    const size_t mark = ws ? kf_ws_mark(ws) : 0;        /* own tiles: scratch */
    const int ok = tiles || kf_gram_tiles_alloc(&own, t, d, 1, ws) == 0;
    for (int i0 = 0; ok && t > 0 && i0 < R; i0 += KF_GRAM_TILE) {
        const int n = R - i0 < KF_GRAM_TILE ? R - i0 : KF_GRAM_TILE;
        kf_solve_sgemm(h->be, KF_NO_TRANS, KF_TRANS, n, t, d, h->scale, h->q + (size_t)i0 * d, d, kc, d, 0.0f, w->Z,
                       t);
        if (i0 + n <= w->L_rows) /* for the fold candidate (kf_value_gram_rebuild_folded) */
            memcpy(w->L + (size_t)i0 * t, w->Z, sizeof(float) * (size_t)n * t);
        kept_tile(tg->m + i0, tg->y + i0, tg->Y + (size_t)i0 * d, n, t, d, w, bn, drop, i0 == 0);
    }
    kf_gram_tiles_free(&own);
    if (ws)
        kf_ws_reset(ws, mark);
    if (!ok)
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for the kept keys' normal equations (R %d, t %d)", R, t);
    for (int r = 0; r < t; r++)
        for (int c = 0; c < r; c++)
            bn->G[(size_t)r * t + c] = bn->G[(size_t)c * t + r];
    gram_finish(drop);
    return KF_OK;
}

kf_status kf_kept_normal_build(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t,
                               kf_gram_tiles *tiles, kf_beta_normal *bn, kf_value_gram *drop, kf_ws *ws,
                               kf_error *err) {
    if (kf_kept_normal_alloc(bn, drop, h->be, t, h->d, ws) != 0)
        return kf_fail(err, KF_ERR_NOMEM, "AM: out of memory for the kept keys' normal equations (R %d, t %d)", h->R,
                       t);
    const kf_status rc = kf_kept_normal_fill(h, tg, kc, t, tiles, bn, drop, ws, err);
    if (rc != KF_OK) {
        kf_beta_normal_free(bn);
        kf_value_gram_free(drop);
    }
    return rc;
}

void kf_value_gram_add(kf_value_gram *acc, const kf_value_gram *part) {
    const int t = acc->t, d = acc->d;
    for (size_t k = 0; k < (size_t)t * t; k++)
        acc->G[k] += part->G[k];
    for (size_t k = 0; k < (size_t)t * d; k++)
        acc->B[k] += part->B[k];
    acc->tr = 0;
    for (int j = 0; j < t; j++)
        acc->tr += acc->G[(size_t)j * t + j];
}

kf_status kf_am_fit_values_ridge(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                                 size_t key_stride, const float *beta, int t, const float *Y, double alpha,
                                 const float *v0, size_t v0_stride, float *values, kf_am_stats *stats, kf_ws *ws,
                                 kf_error *err) {
    kf_value_gram g;
    const size_t mark = ws ? kf_ws_mark(ws) : 0;
    KF_TRY(kf_value_gram_build(be, q, R, d, scale, keys, key_stride, beta, t, Y, &g, ws, err));
    kf_status rc = kf_value_gram_solve(&g, alpha, v0, v0_stride, values, stats, err);
    kf_value_gram_free(&g);
    if (ws)
        kf_ws_reset(ws, mark);
    return rc;
}
