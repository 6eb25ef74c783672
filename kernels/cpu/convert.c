/* The bf16 arena's rows to and from fp32, vectorized (the scalar and unaligned conversions are
 * kernels/base/convert.h's). */
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
