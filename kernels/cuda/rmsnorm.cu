/* RMSNorm: one block per row. The sum of squares is accumulated in fp64, as the CPU reference
 * does, so that both agree to fp32 rounding of the products. */
#include "kernels/cuda/rmsnorm.cuh"

#define RMS_THREADS 256

__global__ void kf_rmsnorm_kernel(float *y, size_t ldy, const float *x, size_t ldx, const __nv_bfloat16 *w, int rows,
                                  int n, float eps) {
    __shared__ double part[RMS_THREADS / 32];
    __shared__ float inv_s;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = x + (size_t)r * ldx;
        float *yr = y + (size_t)r * ldy;
        double ss = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            ss += (double)xr[i] * xr[i];
        for (int o = 16; o > 0; o >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if ((threadIdx.x & 31) == 0)
            part[threadIdx.x >> 5] = ss;
        __syncthreads();
        if (threadIdx.x == 0) {
            double t = 0.0;
            for (int i = 0; i < (int)(blockDim.x >> 5); i++)
                t += part[i];
            inv_s = (float)(1.0 / sqrt(t / n + eps));
        }
        __syncthreads();
        const float inv = inv_s;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            yr[i] = xr[i] * inv * __bfloat162float(w[i]);
        __syncthreads(); /* part/inv_s are reused by the next row */
    }
}

void kf_cuda_rmsnorm(kf_cuda_ctx *c, float *y, size_t ldy, const float *x, size_t ldx, const __nv_bfloat16 *w,
                     int rows, int n, float eps) {
    if (rows <= 0 || n <= 0)
        return;
    const int grid = rows < 65535 * 8 ? rows : 65535 * 8;
    kf_rmsnorm_kernel<<<grid, RMS_THREADS, 0, c->stream>>>(y, ldy, x, ldx, w, rows, n, eps);
    KF_CUDA_LAUNCHED(c);
}
