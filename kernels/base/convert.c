#include "kernels/base/convert.h"

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
    default: /* not a float of 2 or 4 bytes: callers refuse such data first */
        break;
    }
}

void kf_convert_from_f32(void *dst, kf_dtype dst_dtype, const float *src, size_t n) {
    unsigned char *d = dst;
    switch (dst_dtype) {
    case KF_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        break;
    case KF_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            const uint16_t h = kf_f32_to_bf16(src[i]);
            memcpy(d + 2 * i, &h, 2);
        }
        break;
    case KF_DTYPE_F16:
        for (size_t i = 0; i < n; i++) {
            const uint16_t h = kf_f32_to_f16(src[i]);
            memcpy(d + 2 * i, &h, 2);
        }
        break;
    default:
        break;
    }
}
