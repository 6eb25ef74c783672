/* linalg.h — dense least squares and SPD solves for Attention Matching and the fold (CPU).
 *
 * Row-major matrices, LAPACKE underneath. Every solver reports which path it took so that the
 * callers can count fallbacks.
 */
#ifndef KF_LINALG_H
#define KF_LINALG_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KF_LSTSQ_QR = 0,     /* Householder QR (LAPACK gels): the normal path */
    KF_LSTSQ_RIDGE = 1,  /* QR failed, or gave non-finite or absurd (|x| > 1e4 max|b|) values:
                            fp64 normal equations + tiny ridge */
    KF_LSTSQ_FAILED = 2, /* even the ridge solve failed (X is left zero) */
} kf_lstsq_path;

/* X[n, nrhs] = argmin ||A X - B||_F for A [m, n], B [m, nrhs] (row-major, not modified).
 * Underdetermined problems (m < n) give the minimum-norm solution; rank-deficient ones get the
 * ridge path, close to the minimum-norm solution. The fallback solves (A^T A + delta I) X = A^T B in fp64
 * (or its dual when m < n) with delta = 1e-6 * trace / size. Returns the path, or -1 when out of
 * memory. */
int kf_lstsq(const float *A, int m, int n, const float *B, int nrhs, float *X);

/* x = (S + lambda I)^-1 b for a symmetric positive semi-definite S [d, d] (fp64, not modified).
 * Returns 0, 1 when the Cholesky factorization failed, -1 when out of memory. */
int kf_spd_solve(const double *S, int d, double lambda, const double *b, double *x);

/* ||A||_2^2 for A [m, n] by `iters` power iterations on A^T A from a fixed start (seeded). */
double kf_spectral_norm_sq(const float *A, int m, int n, int iters, uint64_t seed);

#endif
