/* Embedding lookup: one block per token, bf16 -> fp32. */
#include "kernels/cuda/embed.cuh"

__global__ void kf_embed_kernel(float *out, const __nv_bfloat16 *table, const int32_t *ids, int n, int width) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const __nv_bfloat16 *src = table + (size_t)ids[r] * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x)
            out[(size_t)r * width + i] = __bfloat162float(src[i]);
    }
}

void kf_cuda_embed(kf_cuda_ctx *c, float *out, const __nv_bfloat16 *table, const int32_t *ids, int n, int width) {
    if (n <= 0 || width <= 0)
        return;
    const int32_t *d = (const int32_t *)kf_cuda_stage(c, KF_CUDA_SCR_IDX0, ids, sizeof(int32_t) * (size_t)n);
    if (!d)
        return;
    kf_embed_kernel<<<n < 65535 * 8 ? n : 65535 * 8, 256, 0, c->stream>>>(out, table, d, n, width);
    KF_CUDA_LAUNCHED(c);
}
