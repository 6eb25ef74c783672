/* refq_targets.h — AM's targets of the pooled reference queries, made by the source forwards.
 *
 * The source forwards (repeat prompt, probes) attend to the whole context, the document block
 * included, so their attention gives AM's targets of the captured rows for free
 * (kf_forward_targets, compactor/model.h): per row the block's logit max m, its partition sum y,
 * its normalized output Y, and per key the sum over rows of the probabilities (or their squares)
 * that AM's score is made of. They are stored in the queries' row layout (refq.h), n_held layers
 * at a time like the queries' pool (layer l in slot l % n_held; the compaction holds one, the
 * sources running layer-major): for KV head g of a layer, row j * n_pos + p = query head
 * g * group + j at sampled position p, so that
 *
 *   m[slot][g][R], y[slot][g][R], Y[slot][g][R, head_dim]  (R = group * n_pos)
 *   score[slot][g][n_doc]   fp64 sums over the fused rows only; the attention adds into them, so
 *                           a slot is zeroed (kf_refq_targets_layer_reset) before its next layer
 *   fused[p]                1: position p's rows (all heads, all layers) have their targets here
 *
 * Rows of positions that are not fused (the context's own queries, which see the block only
 * causally; a QUOKA repeat, whose attention is sparse; a backend without fused targets) hold
 * nothing; the solve computes theirs with kf_am_targets_compute. With bf16 queries the fused
 * targets still come from the fp32 queries of the forward (the fallback's from the bf16 ones).
 *
 * Memory (kf_refq_targets_bytes): 4 (d + 2) bytes per row, held layer and KV head (the fp32
 * queries' size again and a little), and 8 n_doc bytes per (held layer, KV head) for the score.
 *
 * The held-out rows' own prompts (kf_refq_targets_own_init, where the per-head choice runs): the
 * source forwards also give each held-out row's attention over its own source's tokens (the
 * validation's appended block, compactor/diag.h), which the solve would otherwise attend again.
 * Each held-out position p has a slot own_slot[p] (in position order), and for KV head g
 *
 *   am[slot][g][group * n_own], ay[same], aY[slot][g][group * n_own, head_dim]
 *                              row j * n_own + own_slot[p] = query head g * group + j at p
 *   own_done[p]                1: position p's rows have theirs here
 *
 * 4 (d + 2) bytes per held-out row, held layer and KV head, and 5 bytes per position
 * (kf_refq_targets_own_bytes).
 */
#ifndef KF_REFQ_TARGETS_H
#define KF_REFQ_TARGETS_H

#include <stddef.h>
#include <stdint.h>

#include "compactor/model.h"
#include "compactor/refq.h"
#include "kernels/base/error.h"

typedef struct {
    int n_layers, n_held, kv_heads, head_dim, group, n_doc;
    int64_t n_pos, R;
    float *m, *y;      /* [n_held, kv_heads, R] */
    float *Y;          /* [n_held, kv_heads, R, head_dim] */
    double *score;     /* [n_held, kv_heads, n_doc], zeroed */
    uint8_t *fused;    /* [n_pos], zeroed */
    int score_rms;     /* the score's kind: sums of p^2 (RMS) or of p (mean) */
    int64_t n_own;     /* held-out positions (am NULL: no own prompts kept) */
    int32_t *own_slot; /* [n_pos] a held-out position's slot, else -1 */
    uint8_t *own_done; /* [n_pos], zeroed */
    float *am, *ay;    /* [n_held, kv_heads, group * n_own] */
    float *aY;         /* [n_held, kv_heads, group * n_own, head_dim] */
} kf_refq_targets;

/* Storage for rq's rows over a block of n_doc keys, as many layers held as rq holds. */
kf_status kf_refq_targets_init(kf_refq_targets *t, const kf_refq *rq, int n_doc, int score_rms, kf_error *err);
void kf_refq_targets_free(kf_refq_targets *t);

/* Storage for the held-out rows' own prompts: is_val [n_pos] marks the held-out positions. */
kf_status kf_refq_targets_own_init(kf_refq_targets *t, const uint8_t *is_val, kf_error *err);
int64_t kf_refq_targets_own_bytes(int64_t n_held, int64_t kv_heads, int64_t n_own_rows, int head_dim,
                                  int64_t n_pos);

/* Zero the score sums of layer's slot (before the forwards' layer `layer` adds into them). */
void kf_refq_targets_layer_reset(kf_refq_targets *t, int layer);

/* Bytes kf_refq_targets_init takes for n_held layers of these sizes (the memory formula's targets
 * term). */
int64_t kf_refq_targets_bytes(int64_t n_held, int64_t kv_heads, int64_t R, int head_dim, int64_t n_doc);

/* A forward's per-layer destinations (kf_forward_targets' arrays), [n_layers] each. */
typedef struct {
    float **m, **y, **Y;
    double **score;
    float **am, **ay, **aY;
} kf_refq_targets_dst;

kf_status kf_refq_targets_dst_init(kf_refq_targets_dst *d, int n_layers, kf_error *err);
void kf_refq_targets_dst_free(kf_refq_targets_dst *d);

/* A forward's targets capture for the rows at sampled positions first, first + 1, ... over the
 * block [blk0, blk0 + n_doc) of the sequence, in *fa (which points into dst: valid while t and
 * dst live; every layer's destination is its slot, so with n_held < n_layers layer l must be read
 * before layer l + n_held runs), and with own prompts kept, the held-out rows' over the keys from
 * app0 on (the source's own tokens; the forward attends those keys first either way, so that its
 * output does not depend on whether rows are held out). One dst per forward in flight. */
void kf_refq_targets_capture(const kf_refq_targets *t, int64_t first, int blk0, int app0,
                             const kf_refq_targets_dst *dst, kf_forward_targets *fa);

/* Head (layer, g)'s rows: m [R], y [R], Y [R, head_dim] and score [n_doc] (pointers into t). */
static inline size_t kf_refq_targets_row0(const kf_refq_targets *t, int layer, int g) {
    return ((size_t)(layer % t->n_held) * t->kv_heads + g) * (size_t)t->R;
}
/* Head (layer, g)'s own-prompt rows: am [group * n_own], ay likewise, aY [group * n_own, head_dim]. */
static inline size_t kf_refq_targets_own_row0(const kf_refq_targets *t, int layer, int g) {
    return ((size_t)(layer % t->n_held) * t->kv_heads + g) * (size_t)t->group * (size_t)t->n_own;
}
static inline double *kf_refq_targets_score(const kf_refq_targets *t, int layer, int g) {
    return t->score + ((size_t)(layer % t->n_held) * t->kv_heads + g) * (size_t)t->n_doc;
}

#endif
