/* add.cuh — y += x over rows * n contiguous values. */
#ifndef KF_CUDA_ADD_CUH
#define KF_CUDA_ADD_CUH
#include "kernels/cuda/common.cuh"
void kf_cuda_add(kf_cuda_ctx *c, float *y, const float *x, int rows, int n);
#endif
