/* am.h — Attention Matching (AM) for one (layer, KV head): select keys, fit biases, refit values.
 *
 * Notation (research note am-fold.md §9): the document block's keys K [T, d] and values V [T, d]
 * (post-RoPE, as cached), reference queries Q [R, d] (post-q_norm, post-RoPE, pooled over the
 * query heads of this KV head), scale s = 1/sqrt(d).
 *
 *   targets   z_ij = s q_i.k_j; m_i = max_j z_ij; y_i = sum_j exp(z_ij - m_i) (the block's
 *             partition function up to e^{m_i}); A = softmax rows; Y = A V; score_j = RMS or mean
 *             of A[:, j]. Computed in tiles of queries: the R x T matrix is never held.
 *   select    the top-t keys by score (ties: lower position first), returned in position order.
 *   beta      w = argmin ||M w - y|| with M_ij = exp(z_ij - m_i) over the kept keys (fp64 normal
 *             equations, tiny ridge towards w = 1; see am.c for why not fp32 QR), clamped to
 *             [e^-3, e^3] (w = 1 instead if that fits better), then two projected-gradient steps
 *             with step 1/L, L = ||M||_2^2 from power iteration (fixed seed); beta = ln w.
 *   values    C_v = argmin ||X C_v - Y||_F with X = softmax_j(s q_i.c_j + beta_j) over the kept keys.
 *
 * Softmax domains (a classic source of silent errors): targets and selection use the document
 * block only without bias; M uses unnormalised exponentials shifted by the block's row max; X uses
 * the kept keys with bias.
 */
#ifndef KF_AM_H
#define KF_AM_H

#include <stdint.h>

#include "formats/error.h"

typedef enum { KF_SCORE_RMS = 0, KF_SCORE_MEAN = 1 } kf_score_method;

typedef struct {
    const float *k;   /* [T, d], row stride k_stride */
    size_t k_stride;
    const float *v;   /* [T, d], row stride v_stride */
    size_t v_stride;
    int T;
    const float *q;   /* [R, d] contiguous */
    int R;
    int d;
    float scale;
} kf_am_head;

typedef struct {
    float *m;     /* [R] row max of the scaled logits over the block */
    float *y;     /* [R] sum_j exp(z_ij - m_i) over the block */
    float *Y;     /* [R, d] block-local attention output */
    float *score; /* [T] per-key score */
} kf_am_targets;

typedef struct {
    int beta_fallbacks;  /* least-squares solves that needed the ridge path */
    int value_fallbacks;
    int failures;        /* solves that failed outright (result zero) */
    int beta_restarts;   /* beta fits whose clamped least-squares start fitted worse than w = 1 */
} kf_am_stats;

kf_status kf_am_targets_compute(const kf_am_head *h, kf_score_method method, kf_am_targets *out, kf_error *err);
void kf_am_targets_free(kf_am_targets *t);

/* sel[t]: indices of the t highest scores, ascending. */
kf_status kf_am_select(const float *score, int T, int t, int32_t *sel, kf_error *err);

/* beta[t] for the kept keys sel (AM's mass matching). */
kf_status kf_am_fit_beta(const kf_am_head *h, const kf_am_targets *tg, const int32_t *sel, int t, uint64_t seed,
                         float *beta, kf_am_stats *stats, kf_error *err);

/* values[t, d] = argmin ||X values - Y|| for keys[t, d] (row stride key_stride) and an optional
 * bias beta[t] (NULL: no bias). */
kf_status kf_am_fit_values(const float *q, int R, int d, float scale, const float *keys, size_t key_stride,
                           const float *beta, int t, const float *Y, float *values, kf_am_stats *stats,
                           kf_error *err);

#endif
