/* progress.h — what a compaction reports while it runs, for a caller to render (the library never
 * prints).
 *
 * kf_compact_params.progress, when set, is called on the thread that called kf_compact_prepare /
 * kf_compact_solve (never on a solve worker), at the end of each unit of work:
 *   prefill  after each chunk of the context's forward (done / total: its tokens computed);
 *   repeat   after each chunk of a reference source (the repeat's spans, the probes) through
 *            layer `layer` (done / total: the sources' tokens through that layer);
 *   solve    when layer `layer` starts (done 0), as KV heads finish (done / total: heads solved),
 *            and when all are (done == total).
 * The sources run layer by layer and each layer is solved as soon as they have passed it, so the
 * stages go prefill, repeat layer 0, solve layer 0, repeat layer 1, ... A step is complete when
 * done == total (each prefill call is a chunk's end). A call costs a few arithmetic operations;
 * the callback should be as cheap (throttle any drawing there). */
#ifndef KF_PROGRESS_H
#define KF_PROGRESS_H

#include <stdint.h>

#include "formats/hfconfig.h"

typedef enum { KF_STAGE_PREFILL = 0, KF_STAGE_REPEAT = 1, KF_STAGE_SOLVE = 2 } kf_stage;

const char *kf_stage_name(kf_stage s); /* "prefill", "repeat", "solve" */

typedef struct {
    kf_stage stage;
    int layer, n_layers;        /* repeat, solve: the layer (0-based) of the model's n_layers; prefill: -1 */
    int64_t done, total;        /* the step's units done and in all (tokens; heads for solve) */
    double fwd_done, fwd_total; /* the document's forward FLOPs (prefill and sources, compact_flops.h) done
                                   and in all: how far the forwards are, for an estimate of the time left */
    double fwd_sources;         /* the sources' share of fwd_total (every layer) */
} kf_progress;

typedef void (*kf_progress_fn)(void *user, const kf_progress *p);

/* The library's side (compactor/compact.c, sources.c and solve_pool.c): one compaction's totals,
 * and its calls. fn NULL: every call does nothing. */
typedef struct {
    kf_progress_fn fn;
    void *user;
    const kf_hfconfig *cfg;
    int64_t computed, shared; /* the context's tokens the prefill computes, after `shared` taken */
    int64_t src_tokens;       /* the sources' tokens (one layer) */
    double fl_prefill, fl_sources; /* forward FLOPs of the prefill and of the sources (every layer) */
} kf_progress_sink;

/* The totals of a compaction under p (kf_compact_params) of n_pre + n_doc + n_suf context tokens, the
 * first `shared` of them taken from a parent, with src_tokens tokens of sources (attn_targets: their
 * forwards fuse AM's targets). */
struct kf_compact_params;
void kf_progress_sink_init(kf_progress_sink *s, const struct kf_compact_params *p, const kf_hfconfig *c,
                           int64_t n_pre, int64_t n_doc, int64_t n_suf, int64_t shared, int64_t src_tokens,
                           int attn_targets);

/* A forward pass's share of the sources (kf_forward_args.progress's context): the sink, and the
 * sources' tokens before this pass in a layer. */
typedef struct {
    const kf_progress_sink *s;
    int64_t before;
} kf_progress_pass;

/* kf_forward_args.progress of the context's prefill (ctx: the sink) and of a source's pass (ctx: a
 * kf_progress_pass; its done counts n_tokens per layer before this one). */
void kf_progress_on_prefill(void *ctx, int64_t done, int64_t total);
void kf_progress_on_source(void *ctx, int64_t done, int64_t total);
/* Layer `layer`'s solve: `done` of `total` KV heads solved. */
void kf_progress_solve(const kf_progress_sink *s, int layer, int done, int total);

#endif
