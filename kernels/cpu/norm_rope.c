/* Row-wise CPU kernels: RMSNorm, RoPE, SiLU gating, residual add, paged KV store. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"

KF_ROW_CLONES void kf_cpu_rmsnorm(float *y, size_t ldy, const float *x, size_t ldx, const float *w, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * ldx;
        float *yr = y + (size_t)r * ldy;
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++)
            ss += (double)xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt(ss / n + eps));
#pragma omp simd
        for (int i = 0; i < n; i++)
            yr[i] = xr[i] * inv * w[i];
    }
}

void kf_cpu_rope(float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim, const int64_t *positions,
                 const double *inv_freq) {
    const int half = head_dim / 2;
        for (int t = 0; t < n_tok; t++) {
            float cs[KF_MAX_HEAD_DIM]; /* [cos | sin] of this token's angles */
            const double pos = (double)positions[t];
            for (int i = 0; i < half; i++) {
                const double ang = pos * inv_freq[i];
                cs[i] = (float)cos(ang);
                cs[half + i] = (float)sin(ang);
            }
            for (int h = 0; h < n_heads; h++) {
                float *v = x + (size_t)t * tok_stride + (size_t)h * head_dim;
                for (int i = 0; i < half; i++) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * cs[i] - b * cs[half + i];
                    v[i + half] = b * cs[i] + a * cs[half + i];
                }
            }
        }
}

KF_ROW_CLONES void kf_cpu_silu_mul(float *g, const float *u, int rows, int n) {
    const size_t total = (size_t)rows * n;
#pragma omp simd
    for (size_t i = 0; i < total; i++) {
        const float a = g[i];
        g[i] = a / (1.0f + kf_expf(-a)) * u[i];
    }
}

KF_ROW_CLONES void kf_cpu_add(float *y, const float *x, int rows, int n) {
    const size_t total = (size_t)rows * n;
    for (size_t i = 0; i < total; i++)
        y[i] += x[i];
}

void kf_cpu_kv_store(const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n, const float *k,
                     const float *v) {
    const size_t row = (size_t)kv->kv_heads * kv->head_dim;
    for (int i = 0; i < n; i++) {
        const int64_t slot = first_slot + i;
        const size_t off = (size_t)pages[slot / KF_PAGE_TOKENS] * kv->page_stride + (size_t)(slot % KF_PAGE_TOKENS) * row;
        if (kv->dtype == KF_DTYPE_BF16) { /* rounded to nearest even as they are stored */
            kf_f32_to_bf16_n((uint16_t *)kv->k + off, k + (size_t)i * row, row);
            kf_f32_to_bf16_n((uint16_t *)kv->v + off, v + (size_t)i * row, row);
        } else {
            memcpy((float *)kv->k + off, k + (size_t)i * row, row * sizeof(float));
            memcpy((float *)kv->v + off, v + (size_t)i * row, row * sizeof(float));
        }
    }
}
