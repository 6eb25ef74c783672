/* quoka.h — QUOKA sparse attention for the chunked prefill (arXiv 2602.08722).
 *
 * For each chunk and layer whose history (the keys before the chunk) is longer than what the
 * budget keeps, every KV head attends to a query-chosen subset of the history plus the chunk's
 * own keys under the causal mask (kernels/backend.h: quoka_select, sparse_attention). Nothing is
 * evicted: the whole history stays in the arena and the next chunk chooses again. Chunks whose
 * history fits the budget run the dense kernel unchanged.
 *
 * Budget: `budget` keys per KV head (default 1024), or, when budget_frac > 0, ceil(budget_frac *
 * history) keys, at least budget_min. The fraction is of the history before the chunk, not of
 * history + chunk (the chunk's own keys are always attended).
 *
 * Forced keys:
 *   - sinks: the first n_sink tokens of the document always win the ranking (they use up part
 *     of the budget, so sinks on/off compare at equal cost). Off by default, as in the paper.
 *   - aligned window (repeat prefill): when the prompt copies an earlier span, the token at
 *     sequence index p >= align_start reads the source at p - align_shift. For a chunk
 *     [P, P + C) the source span of its copy tokens, widened by align_margin on both sides and
 *     clipped to the history, is kept on top of the budget. Off when align_shift <= 0.
 * Indices here are sequence indices (key positions in the document), not RoPE positions.
 */
#ifndef KF_QUOKA_H
#define KF_QUOKA_H

#include <stdint.h>

#include "kernels/base/error.h"
#include "kernels/backend.h"

typedef enum { KF_PREFILL_DENSE = 0, KF_PREFILL_QUOKA = 1 } kf_prefill_mode;

typedef struct {
    kf_prefill_mode mode;  /* KF_PREFILL_DENSE ignores everything below */
    int n_q;               /* N_Q: queries kept per query head (default 16) */
    int budget;            /* B_KV: history keys kept per KV head (default 1024); used when budget_frac == 0 */
    double budget_frac;    /* 0 < f <= 1: B_KV = ceil(f * history), at least budget_min */
    int budget_min;        /* floor of the fractional budget (default 0) */
    int n_sink;            /* first tokens always kept (default 0) */
    int64_t align_start;   /* first sequence index of the copy */
    int64_t align_shift;   /* copy token p reads p - align_shift; <= 0: no aligned window */
    int align_margin;      /* tokens added on both sides of the source span */
} kf_quoka_params;

/* mode QUOKA, n_q 16, budget 1024, no fraction, no sinks, no aligned window. */
kf_quoka_params kf_quoka_params_default(void);

/* KF_ERR_INVALID with a message naming the bad field. */
kf_status kf_quoka_params_check(const kf_quoka_params *p, kf_error *err);

/* Short description, e.g. "quoka n_q=16 budget=1024 sinks=0" or "dense" (p may be NULL). */
const char *kf_quoka_describe(const kf_quoka_params *p, char *buf, size_t len);

/* Keys per KV head the budget allows for a history of n_hist keys (before any window). */
int kf_quoka_budget(const kf_quoka_params *p, int64_t n_hist);

/* Per-forward state: the index buffer (backend memory) and counters. */
typedef struct {
    kf_backend *b;
    const kf_quoka_params *p;
    int32_t *idx;          /* [kv_heads, cap] */
    size_t cap;
    int kv_heads;
    int64_t n_sparse;      /* layer-chunks that ran sparse */
    int64_t n_dense;       /* layer-chunks whose history fit the budget */
} kf_quoka_ws;

/* Prepares for histories up to max_keys keys. */
kf_status kf_quoka_ws_init(kf_quoka_ws *ws, kf_backend *b, const kf_quoka_params *p, int kv_heads, int64_t max_keys,
                           kf_error *err);
void kf_quoka_ws_free(kf_quoka_ws *ws);

/* One chunk of one layer. `at` is exactly what the dense path passes to b->attention (the
 * chunk's keys already stored, n_keys = history + n_q). Runs dense when the history fits the
 * budget, else selection + sparse attention. Failures surface through b->take_error. */
void kf_quoka_attention(kf_quoka_ws *ws, const kf_attn_args *at);

#endif
