/* compact_internal.h — what the compaction's stages share (private to compactor/).
 *
 * kf_compact (compact.h) runs as a pipeline split over these files:
 *   compact.c     orchestration: parameters, kf_compact_prepare / kf_compact_solve / kf_compact_ex,
 *                 the variants (their budgets and outputs), the compacted cache's frame;
 *   sources.c     the reference sources: repeat spans, probes, the context's own rows, the context
 *                 prefill, the sources' one-layer arena and its layer hooks, fused targets;
 *   choice.c      the per-head choice: the validation split, the training rows' order, the
 *                 candidates' fits and kf_choose_head;
 *   head_solve.c  one (layer, KV head): its targets, its split, every variant's selection and
 *                 fits, the output's checks and its slots in the cache;
 *   solve_pool.c  a layer's KV heads on the backend's parallel_for: per-thread buffers, the job,
 *                 the stats merged in head order.
 */
#ifndef KF_COMPACT_INTERNAL_H
#define KF_COMPACT_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "compactor/compact.h"
#include "compactor/diag.h"
#include "compactor/progress.h"
#include "compactor/refq.h"
#include "compactor/refq_targets.h"

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline uint64_t span_mix(uint64_t z) { /* splitmix64's finalizer */
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The sources of reference queries, in the order their candidate rows are numbered. */
typedef struct {
    const int32_t *ids;
    int n;
    uint8_t kind;
    int32_t *ids_owned; /* repeat prompt = instruction + document (or a span of it) */
    int64_t pos_offset; /* a repeat span's RoPE shift: the positions it has in the whole repeat */
    int doc_off;        /* a repeat span's first document token */
} source;

/* The appended prompts of the validation rows: a source i >= 1 holding validation rows has its
 * tokens on its fork of the context, fork[i] (the context's D tokens shared, then the source's),
 * while the sources run layer by layer; k[i], v[i] [n[i], kv_heads * d] hold layer l of its first
 * n[i] tokens (kf_appended_load, in the layer's hook, before the layer's heads). */
typedef struct {
    const kf_seq *fork; /* [n_src] the prep's forks (x->forks), not owned */
    float **k, **v;     /* [n_src] -> [n[i], kv_heads * d], NULL where n[i] = 0 */
    int64_t *n;         /* [n_src] */
    int n_src;
} appended_kv;

/* Split one head's rows into training and validation: training q/targets gathered into tr_q,
 * tr (m, y, Y), validation queries into val_q with weights, appended blocks and visible counts. */
typedef struct {
    float *tr_q, *tr_m, *tr_y, *tr_Y; /* [n_tr, d], [n_tr], [n_tr], [n_tr, d] */
    float *val_q;                     /* [n_val, d] */
    float *val_m, *val_y, *val_Y;     /* [n_val], [n_val], [n_val, d]: the validation rows' targets
                                         (the refit adds their part) */
    double *val_w;                    /* [n_val] */
    const kf_kv_block **val_app;      /* [n_val] each row's appended block (into blocks); NULL: its attention
                                         over it is given in val_lse_a, val_oa (the source forward's) */
    double *val_lse_a;                /* [n_val] */
    float *val_oa;                    /* [n_val, d] */
    int *val_vis;                     /* [n_val] the appended tokens each row sees */
    kf_kv_block *blocks;              /* [n_src] for the current head */
    int64_t n_tr, n_val;
    int64_t n_score; /* the first n_score validation rows are the ones the choice scores (kf_val_score_rows) */
} head_split;

/* ---- stage 1: plan and context prefill (kf_compact_prepare) ---- */

struct kf_compact_prep {
    kf_model *m;
    kf_compact_params p;       /* the caller's; method and budget come from each variant */
    int L, kvh, d, G, nh, n_pre, n_doc, n_suf, n_sources;
    int n_rep;                 /* repeat sources src[1 .. n_rep] (at least one slot, empty without a repeat) */
    int64_t D;
    float scale;
    kf_arena own_arena;
    kf_arena *ar;              /* own_arena or the caller's */
    kf_seq seq;                /* the context's pages (D tokens) */
    source *src;               /* [n_sources] the reference sources: the context's rows, the repeat's spans
                                  (src[1 .. n_rep], ids owned), the probes */
    int32_t *rows;             /* [n_pos] each sampled position's row in its source's forward (source 0: in
                                  the context's) */
    int64_t *first;            /* [n_sources + 1] source i's sampled positions are first[i] .. first[i + 1] - 1 */
    kf_arena src_ar;           /* while the sources run: one layer of the context (src_ctx) and of their forks */
    kf_seq src_ctx;            /* the context's pages in src_ar (D tokens, the layer being run) */
    kf_seq *forks;             /* [n_sources] source i >= 1's fork of src_ctx in src_ar while the sources run */
    kf_refq rq;                /* reference queries, one layer at a time: [kvh][R, d] */
    kf_refq ctxq;              /* the context's own rows (use_context_queries), every layer: [L][kvh][G n_ctx, d] */
    kf_refq_targets tg;        /* AM's targets of the rows the source forwards fused, one layer at a time like
                                  rq (m NULL: none) */
    kf_refq_targets_dst *tdst; /* [n_sources] source i's per-layer destinations of them (NULL: no pool) */
    uint8_t *pos_kind, *is_val; /* validation plan, [n_pos] each (NULL: no variant needs it) */
    int64_t *tr_order;          /* [G n_pos] the training rows in the order kf_split_head gathers them */
    int *pos_src;               /* [n_pos] each sampled position's source */
    int64_t *pos_local;         /* [n_pos] its index inside that source */
    int64_t n_val_pos;          /* held-out positions (is_val) */
    appended_kv ap;
    double prefill_s, refq_s;
    kf_progress_sink pg;       /* the caller's progress calls (p.progress) and this document's totals */
};

/* One variant's state in kf_compact_solve, or one thread's view of it. kf_compact_solve keeps
 * one per variant (its budgets, its output, folded and var_sum merged so far); every thread holds
 * a view per variant for the head it solves: the same p, choice, t and budgets, the thread's head
 * buffers, `out` a copy of the output's header (the variant's arrays, written at the head's own
 * slots only; stats of this head alone) and folded / var_sum of this head alone, merged in head
 * order after the layer (solve_pool.c). */
typedef struct {
    kf_compact_params p;           /* the prep's, with this variant's method and budget */
    int choice, t;                 /* per-head choice on; kept keys per head (the largest) */
    int *budgets;                  /* [L * kvh] kept keys of each head (the variant's) */
    int32_t *sel;                  /* [t] (views only: the thread's buffers) */
    float *beta;                   /* [t] */
    float *kfold, *vals, *kc, *vo; /* [t, d] each */
    int folded;
    double var_sum;
    kf_compacted *out;
} variant_ws;

/* What one (layer, KV head) shares between the variants: its block and reference rows, AM's
 * targets over them and, when a variant chooses per head, the validation split. */
typedef struct {
    int l, g;
    const float *q;      /* [R, d] the head's reference queries */
    float *q_own;        /* [R, d] q converted from a bf16 pool, or NULL */
    kf_am_head h;        /* the document block's K, V [T, d] (the layer's row stride) and q */
    kf_am_targets tg;    /* m [R], y [R], Y [R, d], score [T]; m, y, Y point into the prep's pool of fused targets when tg_view */
    int tg_view;
    const head_split *sp; /* NULL: no variant chooses per head */
    kf_val_head vh;      /* the validation rows' queries, targets and appended blocks (with sp) */
    double targets_s, split_s;
} head_shared;

/* ---- choice.c: the per-head choice's validation split ---- */

/* The per-head choice's validation plan: every sampled position's source, index inside it and
 * kind; the held-out positions (is_val); and, for the sources that hold validation rows, how many
 * of their tokens their rows see (ap->n; the caller zeroes it for the sources that fuse them,
 * kf_source_fused, before kf_appended_alloc). */
kf_status kf_plan_validation(const source *src, int n_sources, const int64_t *sample, int64_t n_pos,
                             const kf_compact_params *p, uint8_t **kind, int **pos_src, int64_t **pos_local,
                             uint8_t **is_val, int64_t *n_val, appended_kv *ap, kf_error *err);
/* One layer's buffers [ap->n[i], row] for the prompts the solve attends itself (n[i] > 0). */
kf_status kf_appended_alloc(appended_kv *ap, size_t row, kf_error *err);
void kf_appended_free(appended_kv *ap);
/* Layer l's keys and values of every kept validation prompt into k, v (the layer's prologue). */
kf_status kf_appended_load(const kf_arena *a, int64_t D, appended_kv *ap, int l, kf_error *err);
void kf_split_free(head_split *s);
/* 0, or -1 when out of memory. */
int kf_split_alloc(head_split *s, int64_t R, int64_t n_val, int d, int n_src);
/* One head's held-out rows' attention over their own prompts, made by the source forwards
 * (refq_targets.h): row j * n_own + slot[p] for query head j of the group at position p, where
 * done[p]. */
typedef struct {
    const float *m, *y, *Y; /* [group * n_own], [same], [same, d] */
    const int32_t *slot;    /* [n_pos] */
    const uint8_t *done;    /* [n_pos] */
    int64_t n_own;
} own_rows;

/* pos_src/pos_local [n_pos]: source and index inside it of every sampled position; ap holds the
 * layer of this head (kf_appended_load); own (NULL: none) the rows whose appended block's
 * attention is given. */
void kf_split_head(head_split *s, const kf_refq *rq, const float *q, const kf_am_targets *tg, const uint8_t *is_val,
                   const int64_t *tr_order, const int *pos_src, const int64_t *pos_local, const appended_kv *ap,
                   const own_rows *own, int g);

/* ---- sources.c: the reference sources and the context ---- */

/* 1 when source i's forward fuses AM's targets of its rows (and the held-out rows' own prompts):
 * the pool exists, the source has rows, and it is not a repeat that QUOKA runs (the sources'
 * forwards are otherwise dense and unbiased: what kf_model_targets_supported asks). source_targets
 * and the prepare's drop of those prompts' K/V both decide by it: every held-out row of such a
 * source is then given (own_done), none attends a prompt the solve did not keep. */
int kf_source_fused(const kf_compact_prep *x, int i);
/* src [n_sources]: the document's own rows, the repeat's spans, the probes; *n_cand their length. */
kf_status kf_sources_plan(const kf_compact_prep *x, const kf_prompt *doc, source *src, int64_t *n_cand,
                          kf_error *err);
/* Every source's capture rows (x->rows, x->first) from the sorted sample [n_pos]. */
void kf_sources_rows(kf_compact_prep *x, const int64_t *sample, int64_t n_pos);
/* The pool of fused targets (x->tg) when a source past the context can have them. */
kf_status kf_sources_targets_init(kf_compact_prep *x, kf_error *err);
/* The context's prefill (from `shared` on), capturing the document's own sampled rows into x->ctxq. */
kf_status kf_context_prefill(kf_compact_prep *x, const kf_compact_reuse *reuse, int64_t shared,
                             const int32_t *ctx_ids, kf_error *err);
/* Layer l of the context's own rows into the pool (before the layer is solved). */
void kf_context_rows_load(kf_compact_prep *x, int l);
/* Every source, layer by layer, on its fork of the context; hook's on_layer after each layer. */
kf_status kf_sources_run(kf_compact_prep *x, const kf_layer_hook *hook, kf_error *err);
void kf_sources_arena_free(kf_compact_prep *x);

/* ---- head_solve.c: one (layer, KV head) ---- */

/* Head g of layer l's shared work (K, V [D, kvh * d] the layer's): its rows, AM's targets and, with
 * sp (the thread's buffers; NULL: no variant chooses per head), its validation split. Every buffer
 * the head holds comes from ws (kf_compact_head_ws_bytes; the caller resets it after the head);
 * t_max: the most keys a variant keeps (the validation head's candidates). */
kf_status kf_head_prepare(kf_compact_prep *x, int l, int g, const float *K, const float *V, head_split *sp,
                          head_shared *hs, kf_ws *ws, int t_max, kf_error *err);
void kf_head_release(head_shared *hs);
/* One variant on the head: its selection, the per-head choice when on, the fits, the slots written
 * (qsub [R, d]: the thread's probe-row buffer, or NULL); its scratch from ws, given back after it. */
kf_status kf_head_variant(const kf_compact_prep *x, variant_ws *w, head_shared *hs, float *qsub, kf_ws *ws,
                          kf_error *err);

/* ---- solve_pool.c: a layer's KV heads in parallel ---- */

typedef struct thread_ws thread_ws; /* one thread's buffers for the heads it solves */
typedef struct head_add head_add;   /* what one (head, variant) adds to the variant */

/* One layer's heads as a parallel_for job: item g solves head g on thread ws tw[thread]. */
typedef struct {
    kf_compact_prep *x;
    int n, l, any_choice;
    int fold_choice;     /* a variant runs the choice with fold (its candidate reuses the kept logits) */
    const float *K, *V;  /* [D, kvh * d] the layer's keys and values */
    thread_ws *tw;       /* [threads] */
    kf_status *rc;       /* [kvh] each head's status */
    kf_error *err;       /* [kvh] its cause */
    head_add *add;       /* [kvh, n] */
    atomic_int *heads_done; /* the layer's heads finished so far (progress) */
    int threads;         /* tw's count */
    kf_ws *ws;           /* [n_ws] the heads' workspaces (kf_compact_head_ws_bytes each), one per head in flight */
    atomic_int *ws_busy; /* [n_ws] 1 while a head holds it */
    int n_ws;            /* min(threads, kvh): never more heads at once */
    int64_t ws_bytes;    /* each workspace's bytes (0: not allocated yet) */
} layer_job;

/* What the per-layer hook of the sources' forward solves with. */
typedef struct {
    kf_compact_prep *x;
    variant_ws *w;
    int n;
    float *K, *V; /* [D, kvh * d] */
    layer_job *j;
} solve_hook;

/* The job's per-head results and every thread's buffers (j zeroed by the caller) for the n
 * variants w. */
kf_status kf_pool_init(kf_compact_prep *x, const variant_ws *w, int n, int any_choice, int threads, layer_job *j,
                       kf_error *err);
void kf_pool_free(layer_job *j, int threads);
/* kf_model_forward_layers' on_layer (ctx: a solve_hook): solve layer l's heads for every variant. */
kf_status kf_pool_on_layer(void *ctx, int l, kf_error *err);

#endif
