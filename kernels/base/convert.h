/* convert.h — fp32 to and from the 16-bit floats of checkpoints, the bf16 arena and cache files:
 * bfloat16 (the top half of an fp32) and IEEE binary16. The one definition of each; the scalar
 * conversions static inline, because the loops that call them per element (row kernels, file
 * conversions) must inline them (a call per value across a shared library costs 30 times the
 * loop); the array conversions in convert.c.
 *
 * Narrowing rounds to nearest, ties to even; a NaN stays a quiet NaN of the same sign, the top bits
 * of its payload kept; binary16 overflows (|x| >= 65520) to infinity and underflows to subnormals
 * and zero. Widening is exact.
 */
#ifndef KF_CONVERT_H
#define KF_CONVERT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/base/dtype.h"

/* n values of BF16, F16 or F32 (src or dst may be unaligned) to and from fp32, each element as
 * below; any other dtype: nothing is written (callers refuse such data first). */
void kf_convert_to_f32(float *dst, const void *src, kf_dtype src_dtype, size_t n);
void kf_convert_from_f32(void *dst, kf_dtype dst_dtype, const float *src, size_t n);

static inline float kf_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t kf_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a (quiet) NaN */
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float kf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in fp32 */
        float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112) << 23) | (m << 13); /* rebias the exponent from 15 to 127 */
    }
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline uint16_t kf_f32_to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {   /* below 2^-14: a subnormal half (or zero) */
        if (a < 0x33000000u) /* at most 2^-25: rounds to zero */
            return (uint16_t)sign;
        const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14..24 */
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1)))
            r++;
        return (uint16_t)(sign | r);
    }
    const uint32_t v = a - 0x38000000u; /* rebias the exponent from 127 to 15 */
    uint32_t r = v >> 13;
    const uint32_t rem = v & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1)))
        r++;
    return (uint16_t)(sign | r);
}

#endif
