/* linalg.h — dense least squares for Attention Matching (CPU; the lstsq op, kernels/backend.h).
 *
 * Row-major matrices, LAPACKE underneath. Every solver reports which path it took so that the
 * callers can count fallbacks.
 */
#ifndef KF_LINALG_H
#define KF_LINALG_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* kf_lstsq_path (KF_LSTSQ_QR, _RIDGE, _FAILED) is in kernels/backend.h: kf_lstsq is the CPU's lstsq op. */

/* X[n, nrhs] = argmin ||A X - B||_F for A [m, n], B [m, nrhs] (row-major, not modified).
 * Underdetermined problems (m < n) give the minimum-norm solution; rank-deficient ones get the
 * ridge path, close to the minimum-norm solution. The fallback solves (A^T A + delta I) X = A^T B in fp64
 * (or its dual when m < n) with delta = 1e-6 * trace / size. Returns the path, or -1 when out of
 * memory. */
int kf_lstsq(const float *A, int m, int n, const float *B, int nrhs, float *X);

/* ||A||_2^2 for A [m, n] by `iters` power iterations on A^T A from a fixed start (seeded). */
double kf_spectral_norm_sq(const float *A, int m, int n, int iters, uint64_t seed);

#endif
