/* QUOKA prefill driver: budget, forced keys, and the dense/sparse decision per chunk and layer.
 *
 * Choices where the paper leaves room:
 *   - The selection pool is the history only; the chunk's own keys are always attended densely
 *     under the causal mask (variant (a)): a chunk must see its own diagonal and local window.
 *   - Pre-aggregation averages the kept queries rank by rank: the j-th most dissimilar query of
 *     each head of a KV group are averaged together (Algorithm 1 reshapes the top-k output,
 *     which torch returns sorted). The heads keep different positions, so "the same token" is
 *     not an option; rank alignment is what the reference computes, and unit-normalizing before
 *     the mean makes qbar . k the mean of the heads' cosine scores.
 *   - qbar is not renormalized after the mean (the paper scores with the mean of unit vectors).
 *   - A fractional budget is of the history before the chunk.
 *   - Sinks take part of the budget (score +inf); the aligned window is added on top of it.
 */
#include "compactor/quoka.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

kf_quoka_params kf_quoka_params_default(void) {
    kf_quoka_params p;
    memset(&p, 0, sizeof p);
    p.mode = KF_PREFILL_QUOKA;
    p.n_q = 16;
    p.budget = 1024;
    return p;
}

kf_status kf_quoka_params_check(const kf_quoka_params *p, kf_error *err) {
    if (p->mode != KF_PREFILL_DENSE && p->mode != KF_PREFILL_QUOKA)
        return kf_fail(err, KF_ERR_INVALID, "quoka: unknown prefill mode %d", (int)p->mode);
    if (p->mode == KF_PREFILL_DENSE)
        return KF_OK;
    if (p->n_q < 1)
        return kf_fail(err, KF_ERR_INVALID, "quoka: n_q (queries kept per head) must be at least 1, not %d", p->n_q);
    if (!(p->budget_frac >= 0.0 && p->budget_frac <= 1.0))
        return kf_fail(err, KF_ERR_INVALID, "quoka: the budget fraction must lie in (0, 1], not %g", p->budget_frac);
    if (p->budget_frac == 0.0 && p->budget < 1)
        return kf_fail(err, KF_ERR_INVALID, "quoka: the key budget must be at least 1 key, not %d", p->budget);
    if (p->budget_min < 0)
        return kf_fail(err, KF_ERR_INVALID, "quoka: negative minimum budget %d", p->budget_min);
    if (p->n_sink < 0)
        return kf_fail(err, KF_ERR_INVALID, "quoka: negative number of sink tokens %d", p->n_sink);
    if (p->align_shift > 0 && (p->align_start < p->align_shift || p->align_margin < 0))
        return kf_fail(err, KF_ERR_INVALID,
                       "quoka: aligned window needs align_start >= align_shift > 0 and a margin >= 0 "
                       "(got start %lld, shift %lld, margin %d)",
                       (long long)p->align_start, (long long)p->align_shift, p->align_margin);
    return KF_OK;
}

const char *kf_quoka_describe(const kf_quoka_params *p, char *buf, size_t len) {
    if (!p || p->mode == KF_PREFILL_DENSE) {
        snprintf(buf, len, "dense");
        return buf;
    }
    int n = p->budget_frac > 0 ? snprintf(buf, len, "quoka n_q=%d budget=%g", p->n_q, p->budget_frac)
                               : snprintf(buf, len, "quoka n_q=%d budget=%d", p->n_q, p->budget);
    if (n >= 0 && (size_t)n < len && p->budget_frac > 0 && p->budget_min > 0)
        n += snprintf(buf + n, len - (size_t)n, " min=%d", p->budget_min);
    if (n >= 0 && (size_t)n < len)
        n += snprintf(buf + n, len - (size_t)n, " sinks=%d", p->n_sink);
    if (n >= 0 && (size_t)n < len && p->align_shift > 0)
        snprintf(buf + n, len - (size_t)n, " window(shift=%lld,margin=%d)", (long long)p->align_shift,
                 p->align_margin);
    return buf;
}

int kf_quoka_budget(const kf_quoka_params *p, int64_t n_hist) {
    int64_t b = p->budget;
    if (p->budget_frac > 0) {
        b = (int64_t)ceil(p->budget_frac * (double)n_hist);
        if (b < p->budget_min)
            b = p->budget_min;
        if (b < 1)
            b = 1;
    }
    return b > n_hist ? (int)n_hist : (int)b;
}

kf_status kf_quoka_ws_init(kf_quoka_ws *ws, kf_backend *b, const kf_quoka_params *p, int kv_heads, int64_t max_keys,
                           kf_error *err) {
    memset(ws, 0, sizeof *ws);
    ws->b = b;
    ws->p = p;
    ws->kv_heads = kv_heads;
    if (!p || p->mode != KF_PREFILL_QUOKA)
        return KF_OK;
    KF_TRY(kf_quoka_params_check(p, err));
    if (!b->quoka_select || !b->sparse_attention)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "quoka: the %s backend has no QUOKA kernels (use dense prefill)",
                       b->name);
    ws->cap = (size_t)(max_keys > 0 ? max_keys : 1);
    ws->idx = b->alloc(b, sizeof(int32_t) * ws->cap * (size_t)kv_heads);
    if (!ws->idx)
        return kf_fail(err, KF_ERR_NOMEM, "quoka: out of memory for the selection of %lld keys", (long long)max_keys);
    return KF_OK;
}

void kf_quoka_ws_free(kf_quoka_ws *ws) {
    if (ws->idx)
        ws->b->free(ws->b, ws->idx);
    memset(ws, 0, sizeof *ws);
}

void kf_quoka_attention(kf_quoka_ws *ws, const kf_attn_args *at) {
    kf_backend *b = ws->b;
    const kf_quoka_params *p = ws->p;
    const int n_hist = at->n_keys - at->n_q;
    if (!p || p->mode != KF_PREFILL_QUOKA || n_hist <= 0) {
        b->attention(b, at);
        return;
    }
    const int budget = kf_quoka_budget(p, n_hist);
    int win_lo = 0, win_hi = 0;
    if (p->align_shift > 0) {
        /* copy tokens of this chunk: sequence indices [max(P, align_start), P + n_q) */
        const int64_t first = n_hist > p->align_start ? n_hist : p->align_start, end = (int64_t)n_hist + at->n_q;
        if (first < end) {
            int64_t lo = first - p->align_shift - p->align_margin, hi = end - p->align_shift + p->align_margin;
            lo = lo < 0 ? 0 : lo;
            hi = hi > n_hist ? n_hist : hi;
            if (lo < hi) {
                win_lo = (int)lo;
                win_hi = (int)hi;
            }
        }
    }
    const int n_sel = kf_quoka_n_selected(n_hist, budget, win_lo, win_hi);
    if (n_sel >= n_hist || (size_t)n_sel > ws->cap) { /* the history fits: dense, unchanged */
        ws->n_dense++;
        b->attention(b, at);
        return;
    }
    ws->n_sparse++;
    kf_quoka_select_args sel = {
        .q = at->q, .q_stride = at->q_stride, .n_q = at->n_q, .n_heads = at->n_heads,
        .n_hist = n_hist, .pages = at->pages, .kv = at->kv,
        .n_keep = p->n_q, .budget = budget, .n_sink = p->n_sink, .win_lo = win_lo, .win_hi = win_hi,
        .out_idx = ws->idx, .idx_stride = ws->cap, .scores = NULL,
    };
    b->quoka_select(b, &sel);
    kf_sparse_attn_args sp = {.attn = *at, .hist_idx = ws->idx, .idx_stride = ws->cap, .n_sel = n_sel};
    b->sparse_attention(b, &sp);
}
