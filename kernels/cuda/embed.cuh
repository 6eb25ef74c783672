/* embed.cuh — out[r, :] = table[ids[r], :] (table bf16 [rows, width]; ids a host array). */
#ifndef KF_CUDA_EMBED_CUH
#define KF_CUDA_EMBED_CUH
#include <cuda_bf16.h>
#include "kernels/cuda/common.cuh"
void kf_cuda_embed(kf_cuda_ctx *c, float *out, const __nv_bfloat16 *table, const int32_t *ids, int n, int width);
#endif
