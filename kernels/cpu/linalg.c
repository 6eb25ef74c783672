#include "kernels/cpu/linalg.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static int all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

/* fp64 normal equations with a relative ridge; the dual form when m < n. */
static int ridge_solve(const float *A, int m, int n, const float *B, int nrhs, float *X) {
    const int primal = m >= n;
    const int k = primal ? n : m; /* size of the Gram matrix */
    double *Ad = malloc(sizeof(double) * (size_t)m * n);
    double *Bd = malloc(sizeof(double) * (size_t)m * nrhs);
    double *G = calloc((size_t)k * k, sizeof(double));
    double *R = malloc(sizeof(double) * (size_t)k * nrhs);
    int rc = -1;
    if (!Ad || !Bd || !G || !R)
        goto out;
    for (size_t i = 0; i < (size_t)m * n; i++)
        Ad[i] = A[i];
    for (size_t i = 0; i < (size_t)m * nrhs; i++)
        Bd[i] = B[i];
    if (primal) { /* G = A^T A, R = A^T B */
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, n, m, 1.0, Ad, n, 0.0, G, n);
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, nrhs, m, 1.0, Ad, n, Bd, nrhs, 0.0, R, nrhs);
    } else { /* G = A A^T, R = B */
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, n, 1.0, Ad, n, 0.0, G, m);
        memcpy(R, Bd, sizeof(double) * (size_t)m * nrhs);
    }
    double tr = 0;
    for (int i = 0; i < k; i++)
        tr += G[(size_t)i * k + i];
    const double delta = 1e-6 * (tr > 0 ? tr / k : 1.0);
    for (int i = 0; i < k; i++)
        G[(size_t)i * k + i] += delta;
    if (LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', k, G, k) != 0 ||
        LAPACKE_dpotrs(LAPACK_ROW_MAJOR, 'U', k, nrhs, G, k, R, nrhs) != 0) {
        memset(X, 0, sizeof(float) * (size_t)n * nrhs);
        rc = KF_LSTSQ_FAILED;
        goto out;
    }
    if (primal) {
        for (size_t i = 0; i < (size_t)n * nrhs; i++)
            X[i] = (float)R[i];
    } else { /* X = A^T (A A^T + delta)^-1 B */
        double *Xd = malloc(sizeof(double) * (size_t)n * nrhs);
        if (!Xd)
            goto out;
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, nrhs, m, 1.0, Ad, n, R, nrhs, 0.0, Xd, nrhs);
        for (size_t i = 0; i < (size_t)n * nrhs; i++)
            X[i] = (float)Xd[i];
        free(Xd);
    }
    rc = all_finite(X, (size_t)n * nrhs) ? KF_LSTSQ_RIDGE : KF_LSTSQ_FAILED;
out:
    free(Ad);
    free(Bd);
    free(G);
    free(R);
    return rc;
}

int kf_lstsq(const float *A, int m, int n, const float *B, int nrhs, float *X) {
    const int rows = m > n ? m : n;
    float *a = malloc(sizeof(float) * (size_t)m * n);
    float *b = calloc((size_t)rows * nrhs, sizeof(float));
    if (!a || !b) {
        free(a);
        free(b);
        return -1;
    }
    memcpy(a, A, sizeof(float) * (size_t)m * n);
    memcpy(b, B, sizeof(float) * (size_t)m * nrhs);
    /* Householder QR (gels, blocked: level-3 BLAS). It does not reveal rank: a (nearly) singular
     * A gives huge cancelling coefficients without an error, so such solutions are sent to the
     * fp64 ridge path below, as are failures and non-finite values. */
    lapack_int info = LAPACKE_sgels(LAPACK_ROW_MAJOR, 'N', m, n, nrhs, a, n, b, nrhs);
    if (info == 0) {
        float bmax = 0, xmax = 0;
        for (size_t i = 0; i < (size_t)m * nrhs; i++)
            bmax = fabsf(B[i]) > bmax ? fabsf(B[i]) : bmax;
        for (size_t i = 0; i < (size_t)n * nrhs; i++)
            xmax = fabsf(b[i]) > xmax ? fabsf(b[i]) : xmax;
        if (!(xmax <= 1e4f * (bmax > 0 ? bmax : 1.0f)))
            info = -1;
    }
    int rc;
    if (info == 0 && all_finite(b, (size_t)n * nrhs)) {
        memcpy(X, b, sizeof(float) * (size_t)n * nrhs);
        rc = KF_LSTSQ_QR;
    } else {
        rc = ridge_solve(A, m, n, B, nrhs, X);
    }
    free(a);
    free(b);
    return rc;
}

double kf_spectral_norm_sq(const float *A, int m, int n, int iters, uint64_t seed) {
    double *v = malloc(sizeof(double) * n), *w = malloc(sizeof(double) * m);
    if (!v || !w) {
        free(v);
        free(w);
        return NAN;
    }
    uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
    for (int j = 0; j < n; j++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        v[j] = 0.5 + (double)(s >> 11) / 9007199254740992.0; /* positive start: no cancellation */
    }
    double sigma2 = 0;
    for (int it = 0; it < iters; it++) {
        double nv = 0;
        for (int j = 0; j < n; j++)
            nv += v[j] * v[j];
        nv = sqrt(nv);
        if (nv == 0)
            break;
        for (int j = 0; j < n; j++)
            v[j] /= nv;
        for (int i = 0; i < m; i++) { /* w = A v */
            double acc = 0;
            const float *row = A + (size_t)i * n;
            for (int j = 0; j < n; j++)
                acc += row[j] * v[j];
            w[i] = acc;
        }
        sigma2 = 0;
        for (int i = 0; i < m; i++)
            sigma2 += w[i] * w[i];
        memset(v, 0, sizeof(double) * n); /* v = A^T w */
        for (int i = 0; i < m; i++) {
            const float *row = A + (size_t)i * n;
            for (int j = 0; j < n; j++)
                v[j] += row[j] * w[i];
        }
    }
    free(v);
    free(w);
    return sigma2;
}
