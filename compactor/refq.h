/* refq.h — pooled reference queries for Attention Matching.
 *
 * Queries are post-q_norm, post-RoPE, unscaled (as the forward pass captures them). For KV head
 * g the G = n_heads / kv_heads query heads g*G .. g*G+G-1 are pooled head-major:
 *
 *   q[layer][g][j * n_pos + p][:] = query head g*G + j at sampled position p
 *
 * so every KV head has R = G * n_pos rows, and the sampled positions are the same for every layer
 * and head (one subsample, fixed seed). source[p] says where position p came from.
 *
 * A pool holds n_held layers: all of them (kf_refq_init), or fewer (kf_refq_init_held; the
 * compaction holds one: its sources run layer by layer and each layer is solved before
 * the next is captured): layer l lives in slot l % n_held, so a capture of layer l overwrites the
 * layer n_held before it, and every accessor below takes the model's layer index.
 * Why: docs/decisions/layer-by-layer-sources.md.
 */
#ifndef KF_REFQ_H
#define KF_REFQ_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/base/error.h"

enum { KF_REFQ_CONTEXT = 0, KF_REFQ_REPEAT = 1, KF_REFQ_PROBE = 2 };

typedef struct {
    int n_layers, kv_heads, head_dim, group;
    int n_held;       /* layers the pool holds: layer l in slot l % n_held */
    int64_t n_pos;    /* sampled positions */
    int64_t R;        /* rows per KV head: group * n_pos */
    float *q;         /* [n_held, kv_heads, R, head_dim] fp32, or NULL when stored in bf16 */
    uint16_t *qh;     /* [n_held, kv_heads, R, head_dim] bf16 bits, or NULL when stored in fp32 */
    uint8_t *source;  /* [n_pos] */
} kf_refq;

/* bf16: store the queries as bf16 (rounded to nearest even; half the memory), else fp32. Every
 * layer held. */
kf_status kf_refq_init(kf_refq *r, int n_layers, int kv_heads, int head_dim, int group, int64_t n_pos, int bf16,
                       kf_error *err);
/* The same with room for n_held (1 .. n_layers) layers at a time. */
kf_status kf_refq_init_held(kf_refq *r, int n_layers, int n_held, int kv_heads, int head_dim, int group, int64_t n_pos,
                            int bf16, kf_error *err);
void kf_refq_free(kf_refq *r);

/* Rows of KV head g of a layer: [R, head_dim] (an fp32 pool only). */
static inline float *kf_refq_rows(const kf_refq *r, int layer, int g) {
    return r->q + ((size_t)(layer % r->n_held) * r->kv_heads + g) * (size_t)r->R * r->head_dim;
}

/* The same rows in fp32 from either pool: the pool's own (fp32), or scratch [R, head_dim] filled
 * from the bf16 bits. */
const float *kf_refq_head(const kf_refq *r, int layer, int g, float *scratch);

/* The pool is also [n_held, n_heads, n_pos, head_dim] (query head h = g * group + j), so the
 * forward pass captures straight into it: kf_forward_args.queries[l] = kf_refq_capture_dst(r, l,
 * first_pos) with queries_row_stride = head_dim and queries_head_stride = n_pos * head_dim puts the
 * captured rows 0, 1, ... at sampled positions first_pos, first_pos + 1, ... (no second copy). */
static inline size_t kf_refq_offset(const kf_refq *r, int layer, int64_t first_pos) {
    return ((size_t)(layer % r->n_held) * r->kv_heads * r->group * r->n_pos + (size_t)first_pos) * r->head_dim;
}
static inline float *kf_refq_capture_dst(const kf_refq *r, int layer, int64_t first_pos) {
    return r->q + kf_refq_offset(r, layer, first_pos);
}
/* The bf16 pool's destination (kf_forward_args.queries_bf16), at the same strides. */
static inline uint16_t *kf_refq_capture_dst_bf16(const kf_refq *r, int layer, int64_t first_pos) {
    return r->qh + kf_refq_offset(r, layer, first_pos);
}
static inline size_t kf_refq_head_stride(const kf_refq *r) {
    return (size_t)r->n_pos * r->head_dim;
}

/* n_keep sorted distinct indices drawn uniformly from [0, n_total) (all of them when
 * n_keep >= n_total). Deterministic for a seed. Returns 0 or -1 (out of memory). */
int kf_sample_indices(int64_t n_total, int64_t n_keep, uint64_t seed, int64_t *out);

#endif
