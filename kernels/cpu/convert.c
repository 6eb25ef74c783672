/* dtype conversions between the storage formats of checkpoints and fp32: rows of them (the
 * scalar conversions are kernels/base/convert.h's, inlined here). */
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

/* Rows of the bf16 KV pool: one loop per row (vectorized, on the clones' widest vectors), each
 * element exactly kf_bf16_to_f32 / kf_f32_to_bf16 (kernels/base/convert.h). */
KF_ROW_CLONES void kf_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = kf_bf16_to_f32(src[i]);
}

KF_ROW_CLONES void kf_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) { /* kf_f32_to_bf16 without its branch, so that it vectorizes */
        uint32_t bits;
        memcpy(&bits, src + i, sizeof bits);
        const uint32_t nan = (bits >> 16) | 0x40u, even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        dst[i] = (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : even);
    }
}

void kf_convert_to_f32(float *dst, const void *src, kf_dtype src_dtype, size_t n) {
    const unsigned char *s = src;
    switch (src_dtype) {
    case KF_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        break;
    case KF_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kf_bf16_to_f32(h);
        }
        break;
    case KF_DTYPE_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kf_f16_to_f32(h);
        }
        break;
    default: /* not a float of 2 or 4 bytes: the model's loader refuses such a tensor first */
        break;
    }
}
