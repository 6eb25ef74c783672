/* Weight upload: bf16 sources are copied as they are; f32 and f16 go to the device raw, in pieces
 * of at most 64 Mi values (bounded staging), and are rounded there to nearest even. */
#include <cuda_fp16.h>

#include "kernels/cuda/convert.cuh"

#define CONVERT_PIECE ((size_t)64 << 20)

__global__ void kf_f32_to_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void kf_f16_to_bf16_kernel(__nv_bfloat16 *dst, const __half *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(__half2float(src[i]));
}

void kf_cuda_upload_bf16(kf_cuda_ctx *c, __nv_bfloat16 *dst, const void *host_src, kf_dtype dt, size_t n) {
    if (n == 0)
        return;
    if (dt == KF_DTYPE_BF16) {
        KF_CUDA_CHECK(c, cudaMemcpyAsync(dst, host_src, n * 2, cudaMemcpyHostToDevice, c->stream));
        return;
    }
    if (dt != KF_DTYPE_F32 && dt != KF_DTYPE_F16) {
        kf_cuda_fail(c, __FILE__, __LINE__, "upload_weight: unknown dtype %d", (int)dt);
        return;
    }
    const size_t esz = dt == KF_DTYPE_F32 ? 4 : 2;
    for (size_t off = 0; off < n; off += CONVERT_PIECE) {
        const size_t m = n - off < CONVERT_PIECE ? n - off : CONVERT_PIECE;
        const void *raw = kf_cuda_stage(c, KF_CUDA_SCR_RAW, (const char *)host_src + off * esz, m * esz);
        if (!raw)
            return;
        if (dt == KF_DTYPE_F32)
            kf_f32_to_bf16_kernel<<<kf_cuda_blocks(m, 256), 256, 0, c->stream>>>(dst + off, (const float *)raw, m);
        else
            kf_f16_to_bf16_kernel<<<kf_cuda_blocks(m, 256), 256, 0, c->stream>>>(dst + off, (const __half *)raw, m);
        KF_CUDA_LAUNCHED(c);
    }
}
