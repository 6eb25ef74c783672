#include "compactor/fold.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/linalg.h"

#define ROW_TILE 1024

kf_status kf_fold_direction(const float *q, int R, int d, double lambda_rel, float *u, kf_fold_info *info,
                            kf_error *err) {
    memset(info, 0, sizeof *info);
    memset(u, 0, sizeof(float) * d);
    if (R <= 0)
        return KF_OK;
    double *mu = calloc((size_t)d, sizeof(double));
    double *S = calloc((size_t)d * d, sizeof(double));
    double *tile = malloc(sizeof(double) * ROW_TILE * (size_t)d);
    double *a = malloc(sizeof(double) * (size_t)d);
    kf_status rc = KF_OK;
    if (!mu || !S || !tile || !a) {
        rc = kf_fail(err, KF_ERR_NOMEM, "fold: out of memory (d %d)", d);
        goto out;
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < d; c++)
            mu[c] += q[(size_t)i * d + c];
    for (int c = 0; c < d; c++)
        mu[c] /= R;
    /* Sigma = (1/R) sum (q - mu)(q - mu)^T, accumulated in fp64 tiles */
    for (int i0 = 0; i0 < R; i0 += ROW_TILE) {
        const int n = R - i0 < ROW_TILE ? R - i0 : ROW_TILE;
        for (int i = 0; i < n; i++)
            for (int c = 0; c < d; c++)
                tile[(size_t)i * d + c] = q[(size_t)(i0 + i) * d + c] - mu[c];
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, n, 1.0 / R, tile, d, 1.0, S, d);
    }
    for (int r = 0; r < d; r++) /* mirror the upper triangle */
        for (int c = 0; c < r; c++)
            S[(size_t)r * d + c] = S[(size_t)c * d + r];
    double tr = 0;
    for (int c = 0; c < d; c++)
        tr += S[(size_t)c * d + c];
    const double lambda = lambda_rel * tr / d + 1e-12;
    if (kf_spd_solve(S, d, lambda, mu, a) != 0) {
        info->ok = 0;
        goto out;
    }
    double mta = 0;
    for (int c = 0; c < d; c++)
        mta += mu[c] * a[c];
    info->mu_dot_a = mta;
    if (!(mta > 1e-12)) {
        info->ok = 0;
        goto out;
    }
    double un = 0, var = 0;
    for (int c = 0; c < d; c++) {
        a[c] /= mta;
        u[c] = (float)a[c];
        un += a[c] * a[c];
    }
    for (int r = 0; r < d; r++)
        for (int c = 0; c < d; c++)
            var += a[r] * S[(size_t)r * d + c] * a[c];
    info->u_norm = sqrt(un);
    info->var_gain = var;
    info->ok = 1;
out:
    free(mu);
    free(S);
    free(tile);
    free(a);
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
