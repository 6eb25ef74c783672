/* fast_exp.h — a vectorizable expf for softmax and SiLU.
 *
 * libm's expf is a scalar call and took ~15% of a prefill in softmax alone. This one is inline,
 * branch-free arithmetic, so `#pragma omp simd` loops vectorize it: exp(x) = 2^n * e^r with
 * n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for accuracy), e^r by a degree-7
 * Taylor/Horner polynomial on |r| <= ln2/2. Relative error below 4e-7 over the whole range
 * (checked against exp() in tests/test_kernels.c); inputs below -87.3 give 0 (so a -inf bias
 * gets exactly no weight), above 88.4 they are clamped, and NaN is not handled (callers pass
 * scores that are finite or -inf).
 */
#ifndef KF_FAST_EXP_H
#define KF_FAST_EXP_H

#include <stdint.h>

/* The step kf_expf and kf_expf_nonpos share, on xc already clamped: n = round(xc / ln 2) and
 * p = e^r on r = xc - n ln 2 by Horner, with the 1/5040 term (degree 7) when deg7, else degree 6
 * (deg7 is a constant at each call, so the choice folds away). */
typedef struct {
    float p, n;
} kf_exp_reduced_;

static inline kf_exp_reduced_ kf_exp_reduce_(float xc, int deg7) {
    /* round to nearest with the 1.5 * 2^23 trick: vectorizes without SSE4.1's roundps */
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693145751953125f;  /* ln 2, high part (exact product) */
    r = r - n * 1.42860682030941723212e-6f; /* ln 2, low part */
    float p = deg7 ? (1.0f / 5040.0f) * r + 1.0f / 720.0f : 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (kf_exp_reduced_){p, n};
}

/* 2^k for -126 <= k <= 127, from its exponent bits */
static inline float kf_exp2i_(int32_t k) {
    union {
        uint32_t u;
        float f;
    } s = {.u = (uint32_t)(k + 127) << 23};
    return s.f;
}

static inline float kf_expf(float x) {
    const float xc = x > 88.3762626647949f ? 88.3762626647949f : (x < -87.3365478515625f ? -87.3365478515625f : x);
    const kf_exp_reduced_ e = kf_exp_reduce_(xc, 1);
    /* 2^n as two factors so that n = 128 and n = -126 stay representable. ni / 2, not ni >> 1:
     * with the shift GCC 12 cannot if-convert the loop at -O2/-O3 ("control flow in loop") and
     * every caller ran scalar; p * 2^n1 is exact either way, so the result is the same bits
     * (checked for every non-NaN float) */
    const int32_t ni = (int32_t)e.n;
    const int32_t n1 = ni / 2, n2 = ni - n1;
    const float y = e.p * kf_exp2i_(n1) * kf_exp2i_(n2);
    return x < -87.3365478515625f ? 0.0f : y; /* exp(-inf) = 0: a -inf bias gets no weight */
}

/* kf_expf for x <= 0 only (or -inf), as softmax's exp(s - max) needs: no upper clamp, 2^n as one
 * factor (n >= -126 here) and one term less in the polynomial (degree 6: its truncation is below
 * 1.2e-7 on |r| <= ln2/2); relative error below 3e-7 on [-87.3, 0] (tests/test_kernels.c), 0
 * below -87.3 and for -inf. Positive x is not clamped: the caller guarantees x <= 0. */
static inline float kf_expf_nonpos(float x) {
    const float xc = x < -87.3365478515625f ? -87.3365478515625f : x;
    const kf_exp_reduced_ e = kf_exp_reduce_(xc, 0);
    const float y = e.p * kf_exp2i_((int32_t)e.n);
    return x < -87.3365478515625f ? 0.0f : y;
}

#endif
