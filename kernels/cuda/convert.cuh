/* convert.cuh — n host values of f32/f16/bf16 into bf16 device storage. */
#ifndef KF_CUDA_CONVERT_CUH
#define KF_CUDA_CONVERT_CUH
#include <cuda_bf16.h>
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
void kf_cuda_upload_bf16(kf_cuda_ctx *c, __nv_bfloat16 *dst, const void *host_src, kf_dtype src_dtype, size_t n);
#endif
