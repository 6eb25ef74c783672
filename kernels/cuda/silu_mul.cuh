/* silu_mul.cuh — g = silu(g) * u over rows * n contiguous values. */
#ifndef KF_CUDA_SILU_MUL_CUH
#define KF_CUDA_SILU_MUL_CUH
#include "kernels/cuda/common.cuh"
void kf_cuda_silu_mul(kf_cuda_ctx *c, float *g, const float *u, int rows, int n);
#endif
