/* The solve's BLAS operations on the CPU: one CBLAS call each, row-major (kernels/backend.h). */
#include <cblas.h>

#include "kernels/cpu/solve_ops.h"

static enum CBLAS_TRANSPOSE tr(kf_trans t) {
    return t == KF_TRANS ? CblasTrans : CblasNoTrans;
}

void kf_cpu_sgemm(const kf_backend *b, kf_trans ta, kf_trans tb, int M, int N, int K, float alpha, const float *A,
                  size_t lda, const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    (void)b;
    cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), M, N, K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

void kf_cpu_dgemm(const kf_backend *b, kf_trans ta, kf_trans tb, int M, int N, int K, double alpha, const double *A,
                  size_t lda, const double *B, size_t ldb, double beta, double *C, size_t ldc) {
    (void)b;
    cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), M, N, K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

void kf_cpu_dgemv(const kf_backend *b, kf_trans ta, int rows, int cols, double alpha, const double *A, size_t lda,
                  const double *x, double beta, double *y) {
    (void)b;
    cblas_dgemv(CblasRowMajor, tr(ta), rows, cols, alpha, A, (int)lda, x, 1, beta, y, 1);
}

void kf_cpu_dsyrk(const kf_backend *b, kf_trans ta, int N, int K, double alpha, const double *A, size_t lda,
                  double beta, double *C, size_t ldc) {
    (void)b;
    cblas_dsyrk(CblasRowMajor, CblasUpper, tr(ta), N, K, alpha, A, (int)lda, beta, C, (int)ldc);
}

void kf_cpu_ssyrk(const kf_backend *b, kf_trans ta, int N, int K, float alpha, const float *A, size_t lda,
                  float beta, float *C, size_t ldc) {
    (void)b;
    cblas_ssyrk(CblasRowMajor, CblasUpper, tr(ta), N, K, alpha, A, (int)lda, beta, C, (int)ldc);
}

void kf_cpu_dsymv(const kf_backend *b, int n, double alpha, const double *S, size_t lds, const double *x, double beta,
                  double *y) {
    (void)b;
    cblas_dsymv(CblasRowMajor, CblasUpper, n, alpha, S, (int)lds, x, 1, beta, y, 1);
}
