/* RoPE: one block per token. The token's angles are computed once in fp64 (as the CPU reference
 * does: pos * inv_freq, then cos/sin rounded to fp32) into shared memory, then applied to every head.
 * The three rope types differ only in inv_freq, which the host computes (kernels/rope_freq.c). */
#include "kernels/cuda/rope.cuh"

__global__ void kf_rope_kernel(float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                               const int64_t *pos, const double *inv_freq) {
    extern __shared__ float cs[]; /* [cos | sin], head_dim floats */
    const int half = head_dim / 2;
    for (int t = blockIdx.x; t < n_tok; t += gridDim.x) {
        const double p = (double)pos[t];
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            double s, co;
            sincos(p * inv_freq[i], &s, &co);
            cs[i] = (float)co;
            cs[half + i] = (float)s;
        }
        __syncthreads();
        float *xt = x + (size_t)t * tok_stride;
        for (int e = threadIdx.x; e < n_heads * half; e += blockDim.x) {
            const int h = e / half, i = e % half;
            float *v = xt + (size_t)h * head_dim;
            const float a = v[i], b = v[i + half];
            v[i] = a * cs[i] - b * cs[half + i];
            v[i + half] = b * cs[i] + a * cs[half + i];
        }
        __syncthreads();
    }
}

void kf_cuda_rope(kf_cuda_ctx *c, float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                  const int64_t *positions, const double *inv_freq) {
    if (n_tok <= 0 || n_heads <= 0 || head_dim < 2)
        return;
    const int64_t *dpos = (const int64_t *)kf_cuda_stage(c, KF_CUDA_SCR_IDX1, positions, sizeof(int64_t) * n_tok);
    const double *dfreq =
        (const double *)kf_cuda_stage(c, KF_CUDA_SCR_IDX2, inv_freq, sizeof(double) * (size_t)(head_dim / 2));
    if (!dpos || !dfreq)
        return;
    const int grid = n_tok < 65535 * 8 ? n_tok : 65535 * 8;
    kf_rope_kernel<<<grid, 128, sizeof(float) * (size_t)head_dim, c->stream>>>(x, tok_stride, n_tok, n_heads, head_dim,
                                                                              dpos, dfreq);
    KF_CUDA_LAUNCHED(c);
}
