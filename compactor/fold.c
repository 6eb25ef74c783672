#include "compactor/fold.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ROW_TILE 1024

void kf_fold_cov_free(kf_fold_cov *c) {
    if (!c->in_ws) {
        free(c->mu);
        free(c->S);
    }
    memset(c, 0, sizeof *c);
}

int64_t kf_fold_cov_bytes(int d) {
    return kf_ws_bytes(d, sizeof(double)) + kf_ws_bytes((int64_t)d * d, sizeof(double));
}

static int64_t cov_tile_bytes(int d) {
    return kf_ws_bytes((int64_t)ROW_TILE * d, sizeof(double));
}

int64_t kf_fold_cov_compute_bytes(int d) {
    return kf_fold_cov_bytes(d) + cov_tile_bytes(d);
}

kf_status kf_fold_cov_compute(const kf_backend *be, const float *q, int R, int d, kf_fold_cov *c, kf_ws *ws,
                              kf_error *err) {
    memset(c, 0, sizeof *c);
    c->R = R, c->d = d, c->be = be;
    if (R <= 0)
        return KF_OK;
    if (ws) {
        c->in_ws = 1;
        c->mu = kf_ws_zalloc(ws, d, sizeof(double));
        c->S = kf_ws_zalloc(ws, (int64_t)d * d, sizeof(double));
    } else {
        c->mu = calloc((size_t)d, sizeof(double));
        c->S = calloc((size_t)d * d, sizeof(double));
    }
    kf_ws own, *w = kf_ws_or_own(ws, &own, cov_tile_bytes(d));
    const size_t mark = w ? kf_ws_mark(w) : 0;
    double *tile = w ? kf_ws_alloc(w, (int64_t)ROW_TILE * d, sizeof(double)) : NULL; /* [ROW_TILE, d] */
    if (!c->mu || !c->S || !tile) {
        kf_ws_free(&own);
        kf_fold_cov_free(c);
        return kf_fail(err, KF_ERR_NOMEM, "fold: out of memory (d %d)", d);
    }
    double *mu = c->mu, *S = c->S;
    for (int i = 0; i < R; i++)
        for (int k = 0; k < d; k++)
            mu[k] += q[(size_t)i * d + k];
    for (int k = 0; k < d; k++)
        mu[k] /= R;
    /* Sigma = (1/R) sum (q - mu)(q - mu)^T, accumulated in fp64 tiles */
    for (int i0 = 0; i0 < R; i0 += ROW_TILE) {
        const int n = R - i0 < ROW_TILE ? R - i0 : ROW_TILE;
        for (int i = 0; i < n; i++)
            for (int k = 0; k < d; k++)
                tile[(size_t)i * d + k] = q[(size_t)(i0 + i) * d + k] - mu[k];
        kf_solve_dsyrk(be, KF_TRANS, d, n, 1.0 / R, tile, d, 1.0, S, d);
    }
    for (int r = 0; r < d; r++) /* mirror the upper triangle */
        for (int k = 0; k < r; k++)
            S[(size_t)r * d + k] = S[(size_t)k * d + r];
    kf_ws_reset(w, mark);
    kf_ws_free(&own);
    return KF_OK;
}

int64_t kf_fold_direction_cov_bytes(int d) {
    return kf_ws_bytes(d, sizeof(double)) + kf_solve_spd_bytes(d);
}

static kf_status direction(const kf_fold_cov *c, double lambda_rel, float *u, kf_fold_info *info, double *a,
                           kf_ws *ws, kf_error *err);

kf_status kf_fold_direction_cov(const kf_fold_cov *c, double lambda_rel, float *u, kf_fold_info *info, kf_ws *ws,
                                kf_error *err) {
    const int d = c->d;
    memset(info, 0, sizeof *info);
    memset(u, 0, sizeof(float) * d);
    if (c->R <= 0)
        return KF_OK;
    kf_ws own, *w = kf_ws_or_own(ws, &own, kf_fold_direction_cov_bytes(d));
    const size_t mark = w ? kf_ws_mark(w) : 0;
    double *a = w ? kf_ws_alloc(w, d, sizeof(double)) : NULL; /* [d] */
    const kf_status rc = a ? direction(c, lambda_rel, u, info, a, w, err)
                           : kf_fail(err, KF_ERR_NOMEM, "fold: out of memory (d %d)", d);
    if (w)
        kf_ws_reset(w, mark);
    kf_ws_free(&own);
    return rc;
}

/* u from a = (Sigma + lambda I)^-1 mu (a [d] scratch; the solve's copy from ws). */
static kf_status direction(const kf_fold_cov *c, double lambda_rel, float *u, kf_fold_info *info, double *a,
                           kf_ws *ws, kf_error *err) {
    const int d = c->d;
    const double *mu = c->mu, *S = c->S;
    double tr = 0;
    for (int k = 0; k < d; k++)
        tr += S[(size_t)k * d + k];
    const double lambda = lambda_rel * tr / d + 1e-12;
    double mta = 0;
    const int spd = kf_solve_spd(c->be, S, d, lambda, mu, a, ws);
    if (spd < 0)
        return kf_fail(err, KF_ERR_NOMEM, "fold: out of memory (d %d)", d);
    if (spd == 0)
        for (int k = 0; k < d; k++)
            mta += mu[k] * a[k];
    info->mu_dot_a = mta;
    if (!(mta > 1e-12)) /* no direction (or the solve failed) */
        return KF_OK;
    double un = 0, var = 0;
    for (int k = 0; k < d; k++) {
        a[k] /= mta;
        u[k] = (float)a[k];
        un += a[k] * a[k];
    }
    for (int r = 0; r < d; r++)
        for (int k = 0; k < d; k++)
            var += a[r] * S[(size_t)r * d + k] * a[k];
    info->u_norm = sqrt(un);
    info->var_gain = var;
    info->ok = 1;
    return KF_OK;
}

int64_t kf_fold_direction_bytes(int d) {
    return kf_fold_cov_bytes(d) + kf_ws_max(cov_tile_bytes(d), kf_fold_direction_cov_bytes(d));
}

kf_status kf_fold_direction(const kf_backend *be, const float *q, int R, int d, double lambda_rel, float *u,
                            kf_fold_info *info, kf_ws *ws, kf_error *err) {
    kf_fold_cov c;
    memset(info, 0, sizeof *info);
    memset(u, 0, sizeof(float) * d);
    const size_t mark = ws ? kf_ws_mark(ws) : 0;
    KF_TRY(kf_fold_cov_compute(be, q, R, d, &c, ws, err));
    const kf_status rc = kf_fold_direction_cov(&c, lambda_rel, u, info, ws, err);
    kf_fold_cov_free(&c);
    if (ws)
        kf_ws_reset(ws, mark);
    return rc;
}

void kf_fold_keys(const float *keys, size_t key_stride, const float *beta, int t, int d, float scale, const float *u,
                  float *out, size_t out_stride) {
    for (int j = 0; j < t; j++) {
        const float f = beta[j] / scale;
        for (int c = 0; c < d; c++)
            out[(size_t)j * out_stride + c] = keys[(size_t)j * key_stride + c] + f * u[c];
    }
}
