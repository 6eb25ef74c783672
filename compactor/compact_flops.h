/* compact_flops.h — the matmul FLOPs of a compaction's forward passes (the floor).
 *
 * The forwards are what no solve can avoid: the document's prefill and the reference queries'
 * sources (the repeat's spans, the probes) run on top of it. Counted as compactor/model.c runs
 * them, 2 FLOPs per multiply-add:
 *   projections  per token and layer 2 H (QD + 2 KD) for q, k, v; when the layer's output is read
 *                (every layer but the last of a pass that returns no logits) also 2 QD H for o and
 *                6 H I for the MLP (gate, up, down);
 *   attention    4 head_dim n_heads per query-key pair and layer (q.k and p.v), the pairs causal:
 *                n n_before + n (n + 1) / 2 for n tokens after n_before cached keys; the last
 *                layer of a pass without logits has it only when it fuses AM's targets;
 *   lm-head      2 H V per logit row (none in a compaction).
 * Norms, RoPE, SiLU and the softmax's exp are not counted (O(n H), not matmuls). QUOKA's sparse
 * attention is counted as dense (an upper bound). The floor's use: docs/performance.md. */
#ifndef KF_COMPACT_FLOPS_H
#define KF_COMPACT_FLOPS_H

#include <stdint.h>

#include "compactor/compact.h"

typedef struct {
    double proj, attn, head; /* FLOPs: projections + MLP, attention, lm-head */
} kf_flops;

/* What a pass's last layer runs: q, k, v only (its output unread, no targets), the attention too
 * (AM's targets fused into it), or the whole layer (a later read: hidden capture, logits). */
typedef enum { KF_LAST_QKV = 0, KF_LAST_ATTN = 1, KF_LAST_FULL = 2 } kf_last_layer;

double kf_flops_total(const kf_flops *f);

/* Adds to *f one forward pass of n tokens after n_before cached keys, its last layer as `last`,
 * with logit_rows rows through the lm-head. */
void kf_forward_flops(const kf_hfconfig *c, int64_t n, int64_t n_before, kf_last_layer last, int64_t logit_rows,
                      kf_flops *f);

typedef struct {
    kf_flops prefill; /* the context [prefix | document | suffix], no logits, no targets */
    kf_flops repeat;  /* every source past it: the repeat's spans (instruction + span) and the probes,
                         each on the whole context; the context's own queries cost nothing more */
} kf_compact_flops;

/* The forwards of kf_compact on a context of n_pre + n_doc + n_suf tokens under p; attn_targets:
 * 1 when the backend fuses AM's targets into the attention (kf_model_targets_supported; the CPU
 * backend does), so the sources' last layer runs its attention (not for a QUOKA repeat). Every
 * source is assumed to hold sampled rows (true unless max_queries samples a short one out). */
void kf_compact_flops_count(const kf_hfconfig *c, const kf_compact_params *p, int64_t n_pre, int64_t n_doc,
                            int64_t n_suf, int attn_targets, kf_compact_flops *out);

#endif
