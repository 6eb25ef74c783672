/* gemm.cuh — y[M, N] = x[M, K] . w[N, K]^T (+ y): bf16 operands, fp32 accumulation, cuBLASLt. */
#ifndef KF_CUDA_GEMM_CUH
#define KF_CUDA_GEMM_CUH
#include <cuda_bf16.h>
#include "kernels/cuda/common.cuh"

/* x is fp32 with row stride ldx; it is rounded to bf16 into scratch first (one pass over M*K). */
void kf_cuda_gemm(kf_cuda_ctx *c, float *y, size_t ldy, const float *x, size_t ldx, const __nv_bfloat16 *w, int M,
                  int N, int K, int accumulate);
#endif
