/* SiLU gating, elementwise with a grid-stride loop (memory-bound: 12 bytes per value). */
#include "kernels/cuda/silu_mul.cuh"

__global__ void kf_silu_mul_kernel(float *g, const float *u, size_t total) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const float a = g[i];
        g[i] = a / (1.0f + expf(-a)) * u[i];
    }
}

void kf_cuda_silu_mul(kf_cuda_ctx *c, float *g, const float *u, int rows, int n) {
    const size_t total = (size_t)rows * (size_t)n;
    if (rows <= 0 || n <= 0)
        return;
    kf_silu_mul_kernel<<<kf_cuda_blocks(total, 256), 256, 0, c->stream>>>(g, u, total);
    KF_CUDA_LAUNCHED(c);
}
