/* solve_ops.h — the CPU implementations of the solve's backend operations (kernels/backend.h,
 * "The solve's operations"): host memory, stateless, callable from any thread. Each makes the
 * BLAS/LAPACK call its operation is named after, so that results equal a direct call bit for bit.
 *   blas_ops.c     sgemm, dgemm, dgemv, dsyrk, ssyrk, dsymv (OpenBLAS)
 *   cholesky.c     dpotrf, dpotrs, spotrf, spotrs (LAPACKE, OpenBLAS's trsm)
 *   linalg.c       lstsq (kf_lstsq)
 *   softmax.c      softmax_rows, exp_rows
 *   gram_bf16.c    gram_bf16 (AVX-512 BF16 where the CPU has it)
 *   solve_backend.c  the table of them (kf_backend_cpu_solve) */
#ifndef KF_CPU_SOLVE_OPS_H
#define KF_CPU_SOLVE_OPS_H

#include "kernels/backend.h"

void kf_cpu_sgemm(const kf_backend *b, kf_trans ta, kf_trans tb, int M, int N, int K, float alpha, const float *A,
                  size_t lda, const float *B, size_t ldb, float beta, float *C, size_t ldc);
void kf_cpu_dgemm(const kf_backend *b, kf_trans ta, kf_trans tb, int M, int N, int K, double alpha, const double *A,
                  size_t lda, const double *B, size_t ldb, double beta, double *C, size_t ldc);
void kf_cpu_dgemv(const kf_backend *b, kf_trans ta, int rows, int cols, double alpha, const double *A, size_t lda,
                  const double *x, double beta, double *y);
void kf_cpu_dsyrk(const kf_backend *b, kf_trans ta, int N, int K, double alpha, const double *A, size_t lda,
                  double beta, double *C, size_t ldc);
void kf_cpu_ssyrk(const kf_backend *b, kf_trans ta, int N, int K, float alpha, const float *A, size_t lda,
                  float beta, float *C, size_t ldc);
void kf_cpu_dsymv(const kf_backend *b, int n, double alpha, const double *S, size_t lds, const double *x, double beta,
                  double *y);
int kf_cpu_dpotrf(const kf_backend *b, double *A, size_t lda, int n);
int kf_cpu_dpotrs(const kf_backend *b, const double *F, size_t ldf, int n, double *B, size_t ldb, int nrhs);
int kf_cpu_spotrf(const kf_backend *b, float *A, size_t lda, int n);
int kf_cpu_spotrs(const kf_backend *b, const float *F, size_t ldf, int n, float *B, size_t ldb, int nrhs);
int kf_cpu_lstsq_op(const kf_backend *b, const float *A, int m, int n, const float *B, int nrhs, float *X);
void kf_cpu_softmax_rows(const kf_backend *b, const kf_softmax_rows_args *a);
void kf_cpu_gram_bf16(const kf_backend *b, float *X, int n, int t, const float *Y, int d, float *work, double *G,
                      size_t ldg, double *B, size_t ldb, int first);
/* Whether kf_cpu_gram_bf16 runs its AVX-512 BF16 path; tests force the portable one. */
int kf_cpu_gram_bf16_fast(void);
void kf_cpu_gram_bf16_force_portable(int on);
void kf_cpu_exp_rows(const kf_backend *b, float *x, size_t ldx, int rows, int n, const float *shift);

/* Sets b's solve operations to these (the CPU backend's). */
void kf_cpu_solve_ops_install(kf_backend *b);

#endif
