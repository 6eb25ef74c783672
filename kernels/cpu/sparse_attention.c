/* Attention over a per-KV-head subset of the history plus the chunk's own keys (CPU, fp32; a bf16
 * pool is widened as it is gathered).
 *
 * The selected keys/values are gathered into contiguous 16-token "pages"
 *   slot j < n_sel:   history key hist_idx[g, j] in KV head g's lane (heads may differ per slot)
 *   slot n_sel + i:   the chunk's key i (all heads)
 * and handed to kf_cpu_attention with n_keys = n_sel + n_q: its bottom-right causal mask (query i
 * sees keys 0 .. n_sel + i) is exactly "all selected history + chunk keys up to i". Reusing the
 * dense kernel keeps one softmax, one scale and one tiling for both paths, and makes a full
 * ascending selection reproduce dense attention bit for bit. The gather costs
 * O((n_sel + n_q) * kv_heads * head_dim), small next to the attention itself.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

void kf_cpu_sparse_scratch_free(kf_cpu_sparse_scratch *s) {
    free(s->k);
    free(s->v);
    free(s->bias);
    free(s->pages);
    kf_cpu_attn_scratch_free(&s->attn);
    memset(s, 0, sizeof *s);
}

/* n elements at src of a pool (K or V base) into dst fp32: copied, or a bf16 pool's widened. */
static void gather(float *dst, const void *base, kf_dtype dt, size_t src, size_t n) {
    if (dt == KF_DTYPE_BF16)
        kf_bf16_to_f32_n(dst, (const uint16_t *)base + src, n);
    else
        memcpy(dst, (const float *)base + src, sizeof(float) * n);
}

int kf_cpu_sparse_attention(kf_cpu_sparse_scratch *s, const kf_sparse_attn_args *sa) {
    const kf_attn_args *a = &sa->attn;
    const int kvh = a->kv.kv_heads, hd = a->kv.head_dim, nq = a->n_q, ns = sa->n_sel;
    const int n_hist = a->n_keys - nq, nk = ns + nq;
    const size_t row = (size_t)kvh * hd;
    if (nq <= 0)
        return 0;
    if (ns < 0 || n_hist < 0)
        return -1;
    const int n_pages = (nk + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
    size_t kv_cap = s->kv_cap;
    if (kf_cpu_grow((void **)&s->k, &kv_cap, (size_t)n_pages * KF_PAGE_TOKENS * row, sizeof(float)) ||
        kf_cpu_grow((void **)&s->v, &s->kv_cap, (size_t)n_pages * KF_PAGE_TOKENS * row, sizeof(float)) ||
        kf_cpu_grow((void **)&s->pages, &s->pages_cap, (size_t)n_pages, sizeof(int32_t)) ||
        (a->bias && kf_cpu_grow((void **)&s->bias, &s->bias_cap, (size_t)kvh * nk, sizeof(float))))
        return -1;
    for (int p = 0; p < n_pages; p++)
        s->pages[p] = p;

    /* selected history, one KV head's lane at a time */
#pragma omp parallel for schedule(static) if ((long)ns * kvh > 16384)
    for (int j = 0; j < ns; j++)
        for (int g = 0; g < kvh; g++) {
            const int t = sa->hist_idx[(size_t)g * sa->idx_stride + j];
            const size_t src = (size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride +
                               (size_t)(t % KF_PAGE_TOKENS) * row + (size_t)g * hd;
            gather(s->k + (size_t)j * row + (size_t)g * hd, a->kv.k, a->kv.dtype, src, (size_t)hd);
            gather(s->v + (size_t)j * row + (size_t)g * hd, a->kv.v, a->kv.dtype, src, (size_t)hd);
        }
    /* the chunk's own keys, whole rows */
    for (int i = 0; i < nq; i++) {
        const int t = n_hist + i;
        const size_t src = (size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride + (size_t)(t % KF_PAGE_TOKENS) * row;
        gather(s->k + (size_t)(ns + i) * row, a->kv.k, a->kv.dtype, src, row);
        gather(s->v + (size_t)(ns + i) * row, a->kv.v, a->kv.dtype, src, row);
    }
    if (a->bias)
        for (int g = 0; g < kvh; g++)
            for (int j = 0; j < nk; j++) {
                const int t = j < ns ? sa->hist_idx[(size_t)g * sa->idx_stride + j] : n_hist + (j - ns);
                s->bias[(size_t)g * nk + j] = t < a->bias_len ? a->bias[(size_t)g * a->bias_stride + t] : 0.0f;
            }

    kf_attn_args d = *a;
    d.n_keys = nk;
    d.pages = s->pages;
    d.kv.k = s->k;
    d.kv.v = s->v;
    d.kv.page_stride = (size_t)KF_PAGE_TOKENS * row;
    d.kv.dtype = KF_DTYPE_F32; /* gathered (a bf16 pool widened) */
    d.targets = NULL; /* sparse attention emits no AM targets (backend.h): the caller computes them */
    if (a->bias) {
        d.bias = s->bias;
        d.bias_stride = (size_t)nk;
        d.bias_len = nk;
    }
    return kf_cpu_attention(&s->attn, &d);
}
