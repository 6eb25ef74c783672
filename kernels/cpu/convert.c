/* dtype conversions between the storage formats of checkpoints and fp32. */
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

/* bf16 bits to fp32 (exact): the one definition, inlined where loops need it (an exported
 * function is not inlined in a position-independent build, and a call per value is 30 times
 * slower than the vector loop) */
static inline float bf16_widen(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float kf_bf16_to_f32(uint16_t h) {
    return bf16_widen(h);
}

uint16_t kf_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a (quiet) NaN */
        return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Rows of the bf16 KV pool: one loop per row (vectorized, on the clones' widest vectors), each
 * element exactly kf_bf16_to_f32 / kf_f32_to_bf16 above. */
KF_ROW_CLONES void kf_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = bf16_widen(src[i]);
}

KF_ROW_CLONES void kf_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) { /* kf_f32_to_bf16 without its branch, so that it vectorizes */
        uint32_t bits;
        memcpy(&bits, src + i, sizeof bits);
        const uint32_t nan = (bits >> 16) | 0x40u, even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        dst[i] = (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : even);
    }
}

float kf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t kf_f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t absb = bits & 0x7fffffffu;
    if (absb > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (absb >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (absb < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (absb < 0x33000000u)
            return (uint16_t)sign;
        uint32_t exp = absb >> 23;
        uint32_t man = (absb & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - exp; /* 14 + (112 - exp) ... = 113 - exp + 13 */
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = absb + 0xfffu + ((absb >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
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
    }
}
