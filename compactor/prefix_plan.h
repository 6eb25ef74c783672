/* prefix_plan.h — prefix sharing in batch jobs (Quail's sharing plan, docs/design.md "Reuse").
 *
 * Before any prefill, a job knows every document it will compact. Sorting the documents by
 * their token sequences puts documents with a common beginning next to each other; each one then
 * takes the whole pages of its common prefix with its predecessor from the arena instead of
 * computing them again (kf_seq_fork), and prefills only the rest.
 *
 *   order[k]   the k-th document in sorted order (lexicographic on token ids, a prefix before its
 *              extensions, ties by index: deterministic)
 *   shared[i]  tokens document i takes from its predecessor: the longest common prefix with the
 *              predecessor, capped at len - 1 (the last token is always computed, so the document
 *              produces its own outputs), rounded down to whole granules (16-token pages, or a
 *              multiple: QUOKA prefill shares whole chunks so its chunk boundaries stay the same)
 *   parent[i]  the document that computed those pages itself: from the predecessor, follow parents
 *              while they also took at least shared[i] tokens (all siblings of one prefix name the
 *              same parent); -1 when nothing is shared
 *   pred[i]    the predecessor in order: its document holds every page of the shared prefix (its
 *              page table includes the pages it took itself), so an executor that keeps only the
 *              previous document alive can always fork from it
 *
 * Quail's example: rows with the first 1,000, 1,400 and 1,900 tokens of one trace give order
 * [0, 1, 2], parent [-1, 0, 1], shared [0, 992, 1392]: 1,916 document tokens computed instead
 * of 4,300.
 *
 * Sharing is enabled only when it pays (Quail's prefix_sharing rule): the compute saved,
 * shared tokens x flops_per_token / flops_per_s, must exceed the cost of the extra KV kept,
 * shared tokens x kv_bytes_per_token / bytes_per_s (the parent's pages stay in the arena until the
 * child has forked and are read instead of written), plus, for a job that would not otherwise
 * write KV, every token's KV write. With sharing disabled every shared[i] is 0.
 */
#ifndef KF_PREFIX_PLAN_H
#define KF_PREFIX_PLAN_H

#include <stdint.h>

#include "kernels/base/error.h"

typedef struct {
    double flops_per_token;     /* forward FLOPs per token, ~2 x parameters */
    double flops_per_s;         /* compute throughput of the device */
    double kv_bytes_per_token;  /* K and V of one token over all layers, as the arena stores them */
    double bytes_per_s;         /* memory bandwidth for KV */
    int writes_kv;              /* 1: the job writes every token's KV anyway (the compactor does) */
} kf_prefix_cost;

typedef struct {
    int n;
    int32_t *order;     /* [n] document indices in sorted order */
    int32_t *parent;    /* [n] by document index: the document that computed the shared pages, or -1 */
    int32_t *pred;      /* [n] by document index: the previous document in order, or -1 */
    int64_t *shared;    /* [n] by document index: tokens taken from pred (multiple of the granule) */
    int64_t tokens_total;    /* sum of lengths: tokens computed without sharing */
    int64_t tokens_computed; /* sum of (length - shared) */
    int enabled;             /* 0: sharing did not pay (or nothing to share); shared[] is all 0 */
    double saved_s, added_s; /* the cost model's estimates (0 without a cost) */
} kf_prefix_plan;

/* docs[i] holds lens[i] token ids. granule: tokens per shared unit (a positive multiple of 16).
 * cost NULL: enable whenever at least one granule is shared. */
kf_status kf_prefix_plan_build(const int32_t *const *docs, const int64_t *lens, int n, int granule,
                               const kf_prefix_cost *cost, kf_prefix_plan *out, kf_error *err);
void kf_prefix_plan_free(kf_prefix_plan *p);

#endif
