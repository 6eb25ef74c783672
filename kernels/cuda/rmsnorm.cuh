/* rmsnorm.cuh — y[r, :] = x[r, :] / rms(x[r, :]) * w (w bf16; y may be x). */
#ifndef KF_CUDA_RMSNORM_CUH
#define KF_CUDA_RMSNORM_CUH
#include <cuda_bf16.h>
#include "kernels/cuda/common.cuh"
void kf_cuda_rmsnorm(kf_cuda_ctx *c, float *y, size_t ldy, const float *x, size_t ldx, const __nv_bfloat16 *w,
                     int rows, int n, float eps);
#endif
