/* engine.h — the small paged engine behind `kvfold ask`, `kvfold verify` and the tests: a context
 * (a compacted cache, or a whole document for the full-context reference) in a paged arena, and
 * prompts run on top of it and rewound afterwards (the context is never recomputed).
 *
 * With a compacted cache in the compacted frame, a prompt's token i sits at position C + i, what a
 * paged serving engine does after a prefix of C tokens; in AM's frame it sits at D + i. For am the
 * per-key bias goes to every forward pass.
 *
 * The engine owns a forward plan (compactor/model.h), made for its first prefill and grown at most
 * once more for more logit rows: a greedy answer runs one token per step with no allocation.
 */
#ifndef KF_ENGINE_H
#define KF_ENGINE_H

#include <stdint.h>

#include "compactor/compact.h"

typedef struct {
    kf_arena arena;
    kf_seq seq;               /* the context's pages */
    int64_t len;              /* context length: C, or D for a document */
    int64_t pos_offset;       /* added to every prompt position (AM's frame: D - C) */
    const float **bias_l;     /* [n_layers] bias pointers for am, else unused */
    const float *const *bias; /* NULL or bias_l */
    int vocab;
    kf_forward_plan *plan;    /* scratch of every forward this engine runs */
} kf_engine;

/* room: the longest prompt plus answer that will run on top of the context. The engine keeps
 * pointers into c (am's bias): c must outlive it. */
kf_status kf_engine_from_compacted(kf_engine *e, kf_model *m, const kf_compacted *c, int64_t room, kf_error *err);
/* The full context: the document prefilled densely. */
kf_status kf_engine_from_document(kf_engine *e, kf_model *m, const kf_prompt *doc, int64_t room, kf_error *err);
void kf_engine_free(kf_engine *e);

/* Greedy decoding after prompt: up to max_new tokens into out ([max_new]), stopping before a token
 * of stop_ids ([n_stop], e.g. EOS) or after a token for which stop(ctx, out, n) returns nonzero.
 * *n_out tokens; the context is rewound afterwards. */
kf_status kf_engine_greedy(kf_engine *e, kf_model *m, const kf_prompt *prompt, int max_new, const int32_t *stop_ids,
                           int n_stop, int (*stop)(void *ctx, const int32_t *ids, int n), void *stop_ctx, int32_t *out,
                           int *n_out, kf_error *err);

/* Teacher-forced log-probabilities of the rows that predict answer's tokens after prompt:
 * logp [answer->n, vocab] (answer->n >= 1); the context is rewound afterwards. */
kf_status kf_engine_logprobs(kf_engine *e, kf_model *m, const kf_prompt *prompt, const kf_prompt *answer, float *logp,
                             kf_error *err);

/* Mean KL(p || q) over rows of log-probabilities [rows, vocab]. */
double kf_mean_kl(const float *logp, const float *logq, int rows, int vocab);

#endif
