/* Residual add, elementwise with a grid-stride loop. */
#include "kernels/cuda/add.cuh"

__global__ void kf_add_kernel(float *y, const float *x, size_t total) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

void kf_cuda_add(kf_cuda_ctx *c, float *y, const float *x, int rows, int n) {
    const size_t total = (size_t)rows * (size_t)n;
    if (rows <= 0 || n <= 0)
        return;
    kf_add_kernel<<<kf_cuda_blocks(total, 256), 256, 0, c->stream>>>(y, x, total);
    KF_CUDA_LAUNCHED(c);
}
