/* rope.cuh — NeoX rotate-half RoPE in place; positions (int64) and inv_freq (fp64) are host arrays. */
#ifndef KF_CUDA_ROPE_CUH
#define KF_CUDA_ROPE_CUH
#include "kernels/cuda/common.cuh"
void kf_cuda_rope(kf_cuda_ctx *c, float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                  const int64_t *positions, const double *inv_freq);
#endif
