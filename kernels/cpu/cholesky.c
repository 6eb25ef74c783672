/* The solve's Cholesky operations on the CPU (kernels/backend.h: dpotrf, dpotrs, spotrf, spotrs).
 *
 * The matrix is symmetric and given whole, so its row-major storage is also its column-major
 * storage: LAPACK factors it in place, column-major, as A = L L^T (L lower in column-major order,
 * the row-major upper triangle), without the transposed copies LAPACKE makes for row-major input.
 * Lower, not upper: OpenBLAS's lower factorization took 0.75 of the upper's time at the choice's
 * sizes (n = 819 on a Zen 4 core, fp64 and fp32 alike), and its triangular solves as long. */
#include <cblas.h>
#include <lapacke.h>

#include "kernels/cpu/solve_ops.h"

/* LAPACKE's high-level call: it scans the (column-major lower) triangle for NaN first. */
int kf_cpu_dpotrf(const kf_backend *b, double *A, size_t lda, int n) {
    (void)b;
    return LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'L', n, A, (lapack_int)lda) != 0;
}

/* One right-hand side (B [n, 1] contiguous is the same column in either layout): LAPACK's potrs,
 * which also refuses NaN. Several: B [n, nrhs] row-major is B^T [nrhs, n] column-major, so
 * X^T L L^T = B^T is two triangular solves from the right, in place. */
int kf_cpu_dpotrs(const kf_backend *b, const double *F, size_t ldf, int n, double *B, size_t ldb, int nrhs) {
    (void)b;
    if (nrhs == 1 && ldb == 1)
        return LAPACKE_dpotrs(LAPACK_COL_MAJOR, 'L', n, 1, F, (lapack_int)ldf, B, n > 1 ? n : 1) != 0;
    cblas_dtrsm(CblasColMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit, nrhs, n, 1.0, F, (int)ldf, B,
                (int)ldb);
    cblas_dtrsm(CblasColMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit, nrhs, n, 1.0, F, (int)ldf, B,
                (int)ldb);
    return 0;
}

int kf_cpu_spotrf(const kf_backend *b, float *A, size_t lda, int n) {
    (void)b;
    return LAPACKE_spotrf(LAPACK_COL_MAJOR, 'L', n, A, (lapack_int)lda) != 0;
}

int kf_cpu_spotrs(const kf_backend *b, const float *F, size_t ldf, int n, float *B, size_t ldb, int nrhs) {
    (void)b;
    if (nrhs == 1 && ldb == 1)
        return LAPACKE_spotrs(LAPACK_COL_MAJOR, 'L', n, 1, F, (lapack_int)ldf, B, n > 1 ? n : 1) != 0;
    cblas_strsm(CblasColMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit, nrhs, n, 1.0f, F, (int)ldf, B,
                (int)ldb);
    cblas_strsm(CblasColMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit, nrhs, n, 1.0f, F, (int)ldf, B,
                (int)ldb);
    return 0;
}
