/* Causal GQA attention over the paged KV pool (CPU reference, fp32).
 *
 * The keys and values of the visible pages are first gathered into contiguous
 * [n_keys, kv_heads, head_dim] buffers (a copy of O(n_keys * kv_heads * head_dim), small next
 * to the O(n_q * n_keys * n_heads * head_dim) of the attention itself), so that each query head
 * and tile of TILE_Q queries becomes two sgemm calls around a row softmax:
 *   S = scale * Q_tile K_g^T   [tile, keys visible to the tile's last query]
 *   S += bias; causal mask; P = softmax(S)
 *   O_tile = P V_g
 * Keys past the last visible one are never touched, so a causal chunk costs about half of a
 * square one.
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

#define TILE_Q 128

/* Grows a scratch buffer to hold n elements of elem bytes; 0, or -1 when out of memory (the
 * buffer is then unchanged). Shared by the kernels that keep scratch between calls. */
int kf_cpu_grow(void **buf, size_t *cap, size_t n, size_t elem) {
    if (n <= *cap)
        return 0;
    void *nb = realloc(*buf, n * elem);
    if (!nb)
        return -1;
    *buf = nb;
    *cap = n;
    return 0;
}

void kf_cpu_attn_scratch_free(kf_cpu_attn_scratch *s) {
    free(s->kbuf);
    free(s->vbuf);
    free(s->scores);
    memset(s, 0, sizeof *s);
}

int kf_cpu_attention(kf_cpu_attn_scratch *s, const kf_attn_args *a) {
    const int kvh = a->kv.kv_heads, hd = a->kv.head_dim;
    const int nk = a->n_keys, nq = a->n_q;
    const int rep = a->n_heads / kvh;
    const int n_past = nk - nq;
    const size_t row = (size_t)kvh * hd;
    if (nq <= 0)
        return 0;

    size_t kv_need = (size_t)nk * row;
    if (s->kv_cap < kv_need) {
        free(s->kbuf);
        free(s->vbuf);
        s->kbuf = malloc(kv_need * sizeof(float));
        s->vbuf = malloc(kv_need * sizeof(float));
        s->kv_cap = (s->kbuf && s->vbuf) ? kv_need : 0;
        if (!s->kv_cap)
            return -1;
    }
    if (kf_cpu_grow((void **)&s->scores, &s->scores_cap, (size_t)TILE_Q * nk, sizeof(float)) != 0)
        return -1;

    const int n_pages = (nk + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
    for (int p = 0; p < n_pages; p++) {
        const int ntok = (p + 1) * KF_PAGE_TOKENS <= nk ? KF_PAGE_TOKENS : nk - p * KF_PAGE_TOKENS;
        const size_t src = (size_t)a->pages[p] * a->kv.page_stride;
        memcpy(s->kbuf + (size_t)p * KF_PAGE_TOKENS * row, a->kv.k + src, (size_t)ntok * row * sizeof(float));
        memcpy(s->vbuf + (size_t)p * KF_PAGE_TOKENS * row, a->kv.v + src, (size_t)ntok * row * sizeof(float));
    }

    for (int h = 0; h < a->n_heads; h++) {
        const int g = h / rep;
        const float *kg = s->kbuf + (size_t)g * hd;
        const float *vg = s->vbuf + (size_t)g * hd;
        const float *bias = a->bias ? a->bias + (size_t)g * a->bias_stride : NULL;
        for (int q0 = 0; q0 < nq; q0 += TILE_Q) {
            const int tq = nq - q0 < TILE_Q ? nq - q0 : TILE_Q;
            const int kmax = n_past + q0 + tq; /* keys visible to the tile's last query */
            float *S = s->scores;              /* [tq, kmax] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tq, kmax, hd, a->scale,
                        a->q + (size_t)q0 * a->q_stride + (size_t)h * hd, (int)a->q_stride, kg, (int)row, 0.0f, S,
                        kmax);
            for (int i = 0; i < tq; i++) {
                float *sr = S + (size_t)i * kmax;
                const int valid = n_past + q0 + i + 1;
                if (bias) {
                    const int nb = valid < a->bias_len ? valid : a->bias_len;
                    for (int j = 0; j < nb; j++)
                        sr[j] += bias[j];
                }
                kf_cpu_softmax_row(sr, valid, NULL, NULL);
                for (int j = valid; j < kmax; j++)
                    sr[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, tq, hd, kmax, 1.0f, S, kmax, vg, (int)row, 0.0f,
                        a->out + (size_t)q0 * a->out_stride + (size_t)h * hd, (int)a->out_stride);
        }
    }
    return 0;
}
