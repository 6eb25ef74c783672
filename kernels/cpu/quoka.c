/* QUOKA key selection (CPU reference, fp32 with fp64 query means; a bf16 pool's keys widened one
 * key at a time, once for all the kept queries).
 *
 * Per chunk and layer (see kf_quoka_select_args in kernels/backend.h):
 *   query side   O(n_q * n_heads * head_dim): means, cosines, a radix select of n_keep per head;
 *   key side     O(n_hist * kv_heads * n_keep * head_dim): one pass over the paged keys, each key
 *                normalized on the fly (the arena holds raw keys; they are never rewritten);
 *   selection    O(n_hist) per KV head: a 3-pass radix select (11/11/10 bits) on order-preserving
 *                keys of the scores, then one ascending scan that emits the chosen indices, so
 *                the history is never sorted and ties go to the lower index.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

#define QK_EPS 1e-6f /* floor on norms: a zero vector gets cosine 0, never NaN */

void kf_cpu_quoka_scratch_free(kf_cpu_quoka_scratch *s) {
    free(s->mean);
    free(s->keys);
    free(s->kept);
    free(s->qbar);
    free(s->score);
    memset(s, 0, sizeof *s);
}

uint32_t kf_cpu_order_key(float f) {
    if (f != f)
        return 0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

uint32_t kf_cpu_radix_select(const uint32_t *keys, int n, int k, int *take_eq) {
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    int hist[1 << 11];
    uint32_t prefix = 0, mask = 0;
    for (int pass = 0; pass < 3; pass++) {
        const int sh = shift[pass], nb = 1 << width[pass];
        memset(hist, 0, sizeof(int) * (size_t)nb);
        for (int i = 0; i < n; i++)
            if ((keys[i] & mask) == prefix)
                hist[(keys[i] >> sh) & (uint32_t)(nb - 1)]++;
        int d = nb - 1;
        for (; d > 0 && hist[d] < k; d--)
            k -= hist[d];
        prefix |= (uint32_t)d << sh;
        mask |= (uint32_t)(nb - 1) << sh;
    }
    *take_eq = k;
    return prefix;
}

/* Sorts kept positions by rank: larger key (more dissimilar) first, then lower position.
 * Insertion sort of the n_keep kept entries only (never the history). */
static void sort_by_rank(int32_t *kept, int n, const uint32_t *keys) {
    for (int i = 1; i < n; i++) {
        const int32_t x = kept[i];
        int j = i - 1;
        while (j >= 0 && (keys[kept[j]] < keys[x] || (keys[kept[j]] == keys[x] && kept[j] > x))) {
            kept[j + 1] = kept[j];
            j--;
        }
        kept[j + 1] = x;
    }
}

/* Positions of the n_keep queries of head h least similar to the head's mean, by rank. */
static void keep_queries(kf_cpu_quoka_scratch *s, const kf_quoka_select_args *a, int h, int n_keep,
                         int32_t *kept) {
    const int hd = a->kv.head_dim, nq = a->n_q;
    double *m = s->mean;
    for (int d = 0; d < hd; d++)
        m[d] = 0;
    for (int i = 0; i < nq; i++) {
        const float *q = a->q + (size_t)i * a->q_stride + (size_t)h * hd;
        for (int d = 0; d < hd; d++)
            m[d] += q[d];
    }
    double mn = 0;
    for (int d = 0; d < hd; d++) {
        m[d] /= nq;
        mn += m[d] * m[d];
    }
    mn = fmax(sqrt(mn), QK_EPS);
    for (int i = 0; i < nq; i++) {
        const float *q = a->q + (size_t)i * a->q_stride + (size_t)h * hd;
        double dot = 0, qn = 0;
        for (int d = 0; d < hd; d++) {
            dot += q[d] * m[d];
            qn += (double)q[d] * q[d];
        }
        /* key of the dissimilarity -cos: the largest keys are the queries to keep */
        s->keys[i] = kf_cpu_order_key((float)(-dot / (fmax(sqrt(qn), QK_EPS) * mn)));
    }
    int take_eq;
    const uint32_t thr = kf_cpu_radix_select(s->keys, nq, n_keep, &take_eq);
    int n = 0;
    for (int i = 0; i < nq; i++)
        if (s->keys[i] > thr || (s->keys[i] == thr && take_eq-- > 0))
            kept[n++] = i;
    sort_by_rank(kept, n, s->keys);
}

/* Step 3 for one key k [hd]: max over the kept queries qb [n_keep, hd] of qb_j . k / |k| (the loop
 * for both pools: the same sums). */
static float key_score(const float *k, const float *qb, int n_keep, int hd) {
    float kn = 0;
#pragma omp simd reduction(+ : kn)
    for (int d = 0; d < hd; d++)
        kn += k[d] * k[d];
    float best = -INFINITY;
    for (int j = 0; j < n_keep; j++) {
        const float *qj = qb + (size_t)j * hd;
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < hd; d++)
            dot += qj[d] * k[d];
        best = dot > best ? dot : best;
    }
    /* dividing the max by |k| > 0 equals the max of the cosines */
    return best / fmaxf(sqrtf(kn), QK_EPS);
}

/* Step 3 over a bf16 pool: each key widened once for all the kept queries, then key_score (the
 * fp32 pool's loop below is kept apart, as it was, so that its bits do not move). */
static void bf16_scores(kf_cpu_quoka_scratch *s, const kf_quoka_select_args *a, int n_keep) {
    const int hd = a->kv.head_dim, kvh = a->kv.kv_heads, nt = a->n_hist;
    const size_t row = (size_t)kvh * hd;
    for (int t = 0; t < nt; t++) {
        const size_t at = (size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride + (size_t)(t % KF_PAGE_TOKENS) * row;
        for (int g = 0; g < kvh; g++) {
            float wide[KF_MAX_HEAD_DIM];
            kf_bf16_to_f32_n(wide, (const uint16_t *)a->kv.k + at + (size_t)g * hd, (size_t)hd);
            s->score[(size_t)g * nt + t] = key_score(wide, s->qbar + (size_t)g * n_keep * hd, n_keep, hd);
        }
    }
}

/* Steps 1-2: each head's kept queries, normalized, averaged rank by rank over its group into
 * s->qbar [kvh, n_keep, hd]; s->kept [nh, n_keep]. */
static void mean_queries(kf_cpu_quoka_scratch *s, const kf_quoka_select_args *a, int n_keep) {
    const int hd = a->kv.head_dim, kvh = a->kv.kv_heads, nh = a->n_heads, nq = a->n_q, rep = nh / kvh;
    memset(s->qbar, 0, sizeof(float) * (size_t)kvh * n_keep * hd);
    for (int h = 0; h < nh; h++) {
        int32_t *kept = s->kept + (size_t)h * n_keep;
        if (nq > n_keep)
            keep_queries(s, a, h, n_keep, kept);
        else
            for (int j = 0; j < n_keep; j++)
                kept[j] = j;
        float *qb = s->qbar + (size_t)(h / rep) * n_keep * hd;
        for (int j = 0; j < n_keep; j++) {
            const float *q = a->q + (size_t)kept[j] * a->q_stride + (size_t)h * hd;
            double qn = 0;
            for (int d = 0; d < hd; d++)
                qn += (double)q[d] * q[d];
            const float w = (float)(1.0 / (fmax(sqrt(qn), QK_EPS) * rep));
            for (int d = 0; d < hd; d++)
                qb[(size_t)j * hd + d] += q[d] * w;
        }
    }
}

/* Step 3 on an fp32 pool: cosine scores of every history key, max over the kept queries, into
 * s->score [kvh, nt]. */
static void f32_scores(kf_cpu_quoka_scratch *s, const kf_quoka_select_args *a, int n_keep) {
    const int hd = a->kv.head_dim, kvh = a->kv.kv_heads, nt = a->n_hist;
    const size_t row = (size_t)kvh * hd;
    const int n_pages = (nt + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
#pragma omp parallel for schedule(static) if (nt > 2048)
    for (int p = 0; p < n_pages; p++) {
        const int ntok = (p + 1) * KF_PAGE_TOKENS <= nt ? KF_PAGE_TOKENS : nt - p * KF_PAGE_TOKENS;
        const float *page = (const float *)a->kv.k + (size_t)a->pages[p] * a->kv.page_stride;
        for (int slot = 0; slot < ntok; slot++) {
            const int t = p * KF_PAGE_TOKENS + slot;
            for (int g = 0; g < kvh; g++) {
                const float *k = page + (size_t)slot * row + (size_t)g * hd;
                s->score[(size_t)g * nt + t] = key_score(k, s->qbar + (size_t)g * n_keep * hd, n_keep, hd);
            }
        }
    }
}

/* Step 4 for group g: the window [w_lo, w_hi) and the top budget of the other keys (sinks first),
 * emitted in ascending order into out; the count. */
static int select_group(kf_cpu_quoka_scratch *s, const kf_quoka_select_args *a, int g, int w_lo, int w_hi,
                        int budget, int32_t *out) {
    const int nt = a->n_hist, n_cand = nt - (w_hi - w_lo);
    const float *sc = s->score + (size_t)g * nt;
    int n = 0;
    if (budget == n_cand) { /* everything fits: the whole history */
        for (int t = 0; t < nt; t++)
            out[n++] = t;
        return n;
    }
    int c = 0; /* candidates are the keys outside the window, compacted in key order */
    for (int t = 0; t < nt; t++) {
        if (t >= w_lo && t < w_hi)
            continue;
        s->keys[c++] = t < a->n_sink ? UINT32_MAX : kf_cpu_order_key(sc[t]);
    }
    int take_eq = 0;
    const uint32_t thr = budget > 0 ? kf_cpu_radix_select(s->keys, n_cand, budget, &take_eq) : UINT32_MAX;
    c = 0;
    for (int t = 0; t < nt; t++) {
        if (t >= w_lo && t < w_hi) {
            out[n++] = t;
            continue;
        }
        const uint32_t k = s->keys[c++];
        if (budget > 0 && (k > thr || (k == thr && take_eq-- > 0)))
            out[n++] = t;
    }
    return n;
}

int kf_cpu_quoka_select(kf_cpu_quoka_scratch *s, const kf_quoka_select_args *a) {
    const int hd = a->kv.head_dim, kvh = a->kv.kv_heads, nh = a->n_heads, nq = a->n_q, nt = a->n_hist;
    if (nq <= 0 || nt <= 0 || a->budget < 1 || a->n_keep < 1 || kvh <= 0 || nh % kvh != 0 ||
        (a->kv.dtype == KF_DTYPE_BF16 && hd > KF_MAX_HEAD_DIM))
        return -1;
    /* a chunk no longer than N_Q keeps every query, in position order (Algorithm 1, step 1) */
    const int n_keep = nq > a->n_keep ? a->n_keep : nq;
    if (kf_cpu_grow((void **)&s->mean, &s->mean_cap, (size_t)hd, sizeof(double)) ||
        kf_cpu_grow((void **)&s->keys, &s->keys_cap, (size_t)(nq > nt ? nq : nt), sizeof(uint32_t)) ||
        kf_cpu_grow((void **)&s->kept, &s->kept_cap, (size_t)nh * n_keep, sizeof(int32_t)) ||
        kf_cpu_grow((void **)&s->qbar, &s->qbar_cap, (size_t)kvh * n_keep * hd, sizeof(float)) ||
        kf_cpu_grow((void **)&s->score, &s->score_cap, (size_t)kvh * nt, sizeof(float)))
        return -1;
    mean_queries(s, a, n_keep);
    if (a->kv.dtype == KF_DTYPE_BF16)
        bf16_scores(s, a, n_keep);
    else
        f32_scores(s, a, n_keep);
    if (a->scores)
        memcpy(a->scores, s->score, sizeof(float) * (size_t)kvh * nt);
    const int w_lo = a->win_lo < 0 ? 0 : (a->win_lo > nt ? nt : a->win_lo);
    const int w_hi = a->win_hi > nt ? nt : (a->win_hi < w_lo ? w_lo : a->win_hi);
    const int n_cand = nt - (w_hi - w_lo);
    const int budget = a->budget < n_cand ? a->budget : n_cand;
    for (int g = 0; g < kvh; g++)
        select_group(s, a, g, w_lo, w_hi, budget, a->out_idx + (size_t)g * a->idx_stride);
    return 0;
}
