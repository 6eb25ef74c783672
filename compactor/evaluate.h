/* evaluate.h — how well a compacted cache preserves what the model reads (docs/quality.md).
 *
 * A reference is built once per document from the full context:
 *   - the repeat continuation: [instruction | document] teacher-forced on top of the document;
 *     next-token log-probabilities at every position that predicts a document token;
 *   - each question: [question | answer] teacher-forced; log-probabilities at the positions that
 *     predict the answer tokens; the queries and keys/values of these tokens (held-out queries,
 *     never used for fitting, and the uncompacted block appended in the diagnostics);
 *   - the document's own keys and values (the original block).
 * A compacted cache is then measured against it:
 *   kl_repeat  mean KL(full || compacted) over the repeat continuation
 *   kl_answer  mean KL over the answer tokens
 *   copy_acc   teacher-forced argmax accuracy of the repeat continuation
 *   qa_em      exact match of greedy answers (as many tokens as the gold answer)
 *   fact_acc   teacher-forced argmax accuracy of the recalled fact: the answer token right after
 *              the name (the first answer token that also occurs in the question); questions
 *              without such a token have no fact
 *   lse_err, out_err  per-head diagnostics (compactor/diag.h), averaged over layers and heads
 */
#ifndef KF_EVALUATE_H
#define KF_EVALUATE_H

#include "compactor/compact.h"

typedef struct {
    kf_prompt question;
    kf_prompt answer;
} kf_qa;

typedef struct {
    double kl_repeat, kl_answer, copy_acc, qa_em, lse_err, out_err, fact_acc;
    int64_t n_repeat, n_answer, n_questions, n_heads, n_facts;
    int64_t n_fact_docs; /* sums only: documents with at least one fact (fact_acc's denominator) */
} kf_quality;

typedef struct kf_reference kf_reference;

kf_status kf_reference_build(kf_model *m, const kf_prompt *doc, const kf_prompt *instruction, const kf_qa *qa,
                             int n_qa, kf_reference **out, kf_error *err);
/* The same for a context whose first n_prefix tokens precede the document (a chat template's
 * beginning, kept verbatim by kf_compact's prefix): the repeat copies doc's tokens after them. */
kf_status kf_reference_build_ex(kf_model *m, const kf_prompt *doc, int n_prefix, const kf_prompt *instruction,
                                const kf_qa *qa, int n_qa, kf_reference **out, kf_error *err);
void kf_reference_free(kf_reference *r);

/* c must come from kf_compact on the same context (no suffix; a prefix only of the reference's
 * n_prefix tokens); its frame is restored.
 * head_lse_err and head_out_err ([n_layers * kv_heads], may be NULL) receive the per-head
 * diagnostics that out averages. */
kf_status kf_quality_measure(kf_model *m, const kf_reference *r, kf_compacted *c, kf_quality *out,
                             double *head_lse_err, double *head_out_err, kf_error *err);

/* The uncompacted document as a kf_compacted (method keep, C = D, every position kept, beta and
 * u zero): measured through kf_quality_measure it is the sanity row of a quality table (KL 0,
 * errors 0). out is freed with kf_compacted_free. */
kf_status kf_reference_full_cache(const kf_reference *r, kf_compacted *out, kf_error *err);

/* Heads per kf_method of a compacted cache ([4], indexed by kf_method): stats.heads_by_method
 * when the compaction filled it, else head_method, else `method` for every head with fold's
 * fallbacks counted as drop. */
void kf_compacted_head_counts(const kf_compacted *c, int counts[4]);

/* The answer row that predicts the fact (see fact_acc above), or -1 when there is none. */
int kf_qa_fact_row(const kf_qa *qa);

/* Accumulate (sum) and average helpers for tables over documents: kf_quality_mean divides by
 * n_docs, except fact_acc, averaged over the documents that had facts. */
void kf_quality_add(kf_quality *sum, const kf_quality *x);
void kf_quality_mean(kf_quality *sum, int n_docs);

#endif
