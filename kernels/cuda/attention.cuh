/* attention.cuh — causal GQA attention over the paged pool, dense or over a per-KV-head selection
 * of the history (QUOKA's sparse attention). Page tables are host arrays; hist_idx is device memory.
 * head_dim up to KF_CUDA_ATTN_MAX_HD. */
#ifndef KF_CUDA_ATTENTION_CUH
#define KF_CUDA_ATTENTION_CUH
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"

#define KF_CUDA_ATTN_MAX_HD 256

void kf_cuda_attention(kf_cuda_ctx *c, const kf_attn_args *a);
void kf_cuda_sparse_attention(kf_cuda_ctx *c, const kf_sparse_attn_args *a);
#endif
