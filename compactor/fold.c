#include "compactor/fold.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ROW_TILE 1024

void kf_fold_cov_free(kf_fold_cov *c) {
    free(c->mu);
    free(c->S);
    memset(c, 0, sizeof *c);
}

kf_status kf_fold_cov_compute(const kf_backend *be, const float *q, int R, int d, kf_fold_cov *c, kf_error *err) {
    memset(c, 0, sizeof *c);
    c->R = R, c->d = d, c->be = be;
    if (R <= 0)
        return KF_OK;
    c->mu = calloc((size_t)d, sizeof(double));
    c->S = calloc((size_t)d * d, sizeof(double));
    double *tile = malloc(sizeof(double) * ROW_TILE * (size_t)d); /* [ROW_TILE, d] */
    if (!c->mu || !c->S || !tile) {
        free(tile);
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
    free(tile);
    return KF_OK;
}

kf_status kf_fold_direction_cov(const kf_fold_cov *c, double lambda_rel, float *u, kf_fold_info *info,
                                kf_error *err) {
    const int d = c->d;
    memset(info, 0, sizeof *info);
    memset(u, 0, sizeof(float) * d);
    if (c->R <= 0)
        return KF_OK;
    const double *mu = c->mu, *S = c->S;
    double *a = malloc(sizeof(double) * (size_t)d);
    if (!a)
        return kf_fail(err, KF_ERR_NOMEM, "fold: out of memory (d %d)", d);
    double tr = 0;
    for (int k = 0; k < d; k++)
        tr += S[(size_t)k * d + k];
    const double lambda = lambda_rel * tr / d + 1e-12;
    double mta = 0;
    if (kf_solve_spd(c->be, S, d, lambda, mu, a) == 0)
        for (int k = 0; k < d; k++)
            mta += mu[k] * a[k];
    info->mu_dot_a = mta;
    if (!(mta > 1e-12)) { /* no direction (or the solve failed) */
        free(a);
        return KF_OK;
    }
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
    free(a);
    return KF_OK;
}

kf_status kf_fold_direction(const kf_backend *be, const float *q, int R, int d, double lambda_rel, float *u,
                            kf_fold_info *info, kf_error *err) {
    kf_fold_cov c;
    memset(info, 0, sizeof *info);
    memset(u, 0, sizeof(float) * d);
    KF_TRY(kf_fold_cov_compute(be, q, R, d, &c, err));
    const kf_status rc = kf_fold_direction_cov(&c, lambda_rel, u, info, err);
    kf_fold_cov_free(&c);
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
