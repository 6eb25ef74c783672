/* compact.h — from a model and a document's token ids to a compacted KV cache in memory.
 *
 * Pipeline (docs/design.md, "Data flow"):
 *   1. prefill [prefix | document | suffix] into the paged arena (the context);
 *   2. reference queries (compactor/refq): the repeat prompt (instruction + document again),
 *      optionally the document's own queries and probe prompts, each run on top of the context's
 *      pages and rewound afterwards (the document is prefilled once), layer by layer: each layer
 *      of step 3 runs as soon as the sources have passed it;
 *   3. per layer and KV head: AM targets and key selection over the document block, then by method
 *        keep  top-t keys, original values, no bias
 *        drop  top-t keys, values refit without bias
 *        am    top-t keys, beta, values refit with beta (needs a bias-capable kernel)
 *        fold  keys shifted by beta * sqrt(d) * u, values refit without bias (plain K/V)
 *      prefix and suffix tokens are kept verbatim with beta = 0;
 *   4. every key is rotated by -(D - C) positions (rope_frame "compacted"), so that a question at
 *      positions C, C+1, ... sees exactly what it would see at D, D+1, ... in AM's frame.
 *
 * Cache layout per layer: [prefix (n_prefix) | compacted block (t) | suffix (n_suffix)],
 * C = n_prefix + t + n_suffix, the same C for every layer and head (vLLM has one block table).
 * With per-head budgets (AM's JSON shares, formats/budgets.h) t is the largest head's count; a
 * head with t_h < t keys is padded: for am with a zero key and value and beta = -inf
 * (exp(-inf) = 0, so the slot gets exactly no weight); the bias-free methods have no such key,
 * so their heads keep their next-best real keys instead (t keys in all) and the value refit
 * covers them.
 */
#ifndef KF_COMPACT_H
#define KF_COMPACT_H

#include <stdint.h>

#include "compactor/am.h"
#include "compactor/diag.h"
#include "compactor/model.h"
#include "compactor/progress.h"
#include "kernels/base/error.h"
#include "kernels/base/method.h"

typedef enum { KF_FOLD_ON_ALL = 0, KF_FOLD_ON_PROBES = 1 } kf_fold_queries;
/* What the Tikhonov term of a value refit pulls towards: zero, or the kept keys' original values. */
typedef enum { KF_RIDGE_TO_ZERO = 0, KF_RIDGE_TO_ORIG = 1 } kf_ridge_target;
/* Per-head choice: hold out a validation split of the reference positions (probe
 * positions first), then for every (layer, KV head) fit each candidate on the rest (on a
 * stratified random subsample of it, choice_rows rows per kept key: kf_choice_rows) — the method
 * itself (am or fold; fold for lambda = lambda_rel), drop and keep, each value
 * refit for alpha in {0, 1e-2, 1e-1} — and keep the one with the lowest output error on the
 * validation queries (a subsample of them, val_rows per document token: kf_val_score_rows;
 * appended block: the tokens before each query in its own prompt; probe rows weigh half when there
 * are any), am/fold only when they beat drop and keep by the factor
 * 1 + choice_margin. The winner's values are refitted on all the queries, its beta and fold
 * direction kept as validated (refit_all: KF_REFIT_VALUES; KF_REFIT_ALL refits those too).
 * Why: docs/decisions/per-head-choice.md. */
typedef enum { KF_CHOICE_DEFAULT = -1, KF_CHOICE_OFF = 0, KF_CHOICE_ON = 1 } kf_head_choice;
/* kf_choice_params.refit_all: what of the winner is refitted on all the queries (the numbers are
 * the recipe digest's). */
enum { KF_REFIT_TRAIN = 0, KF_REFIT_ALL = 1, KF_REFIT_VALUES = 2 };

typedef struct {
    const int32_t *ids;
    int n;
} kf_prompt;

/* The solve's settings: how each KV head's keys are scored and kept, and how beta, the fold and
 * the values are fitted. The defaults are the measured ones; a user rarely sets these. */
typedef struct {
    kf_score_method score;          /* default RMS */
    double lambda_rel;              /* fold ridge, relative to tr(Sigma)/d (default 1e-2) */
    kf_fold_queries fold_queries;   /* which pooled queries fit u (default all) */
    int64_t max_queries;            /* cap of pooled queries per KV head (default 50,000) */
    kf_beta_fit beta_fit;           /* AM's reference fit or the converged box fit (default AM's) */
    double value_ridge;             /* Tikhonov alpha of every value refit without per-head choice:
                                       mu = alpha * tr(X^T X) / t (default 0) */
    kf_ridge_target ridge_to;       /* default towards the original values */
    uint64_t seed;                  /* subsampling and power iteration (default 0) */
    const float *head_budgets;      /* NULL (uniform) or [n_layers, kv_heads] shares summing to 1 */
    double max_head_ratio;          /* cap of a head's budget as a fraction of the block (0.75) */
} kf_solver_params;

/* The per-head choice (kf_head_choice above): whether it runs and how it validates. */
typedef struct {
    kf_head_choice head_choice;     /* default: on for am and fold, off for keep and drop */
    double val_frac;                /* validation share of the reference positions (default 0.2) */
    double choice_margin;           /* am/fold must beat drop and keep by this relative margin on
                                       the validation error to be chosen (default 0.5) */
    int refit_all;                  /* KF_REFIT_VALUES: keep the chosen candidate's beta and fold
                                       direction, refit its values on all the queries (default);
                                       KF_REFIT_ALL: refit all of it on all the queries;
                                       KF_REFIT_TRAIN: keep the fit on the training rows that was
                                       validated */
    double choice_rows;             /* the per-head choice fits its candidates (beta, fold
                                       directions, values) on a stratified random subsample of the
                                       training rows, choice_rows rows per kept key (kf_choice_rows;
                                       default 6); 0: on all of them */
    double val_rows;                /* the choice scores its candidates on a subsample of the
                                       held-out rows, val_rows rows per document token
                                       (kf_val_score_rows; default 0.2): probe rows first, the
                                       others evenly spaced; 0: on all of them. The refit still
                                       takes every held-out row */
    double refit_rows;              /* the winner's values refit (KF_REFIT_VALUES) takes the first
                                       refit_rows training rows per kept key (at least the
                                       choice's) and every held-out row (kf_refit_rows; default 8);
                                       0: all the training rows */
} kf_choice_params;

/* How the prefills run: chunking, the QUOKA approximation, and the dtypes that trade memory for
 * rounding. None changes what is compacted, only how exactly and at what cost. */
typedef struct {
    int chunk;                      /* prefill chunk size (0: default) */
    const kf_quoka_params *quoka;   /* NULL: dense prefill; else QUOKA for the context prefill */
    int quoka_repeat;               /* also QUOKA for the repeat prefill, with the aligned window: the
                                       copy's source span +- quoka_margin tokens (-1: no window) */
    int quoka_margin;               /* default 16 */
    int refq_bf16;                  /* 1: reference queries stored in bf16 (half the memory; each head's
                                       rows widened to fp32 for its solve); default 0: fp32 */
    kf_dtype arena_dtype;           /* the KV arena's (the context's and the sources'): KF_DTYPE_F32
                                       (default) or KF_DTYPE_BF16 (half the bytes; the CPU backend only) */
} kf_run_params;

/* A compaction: what a user sets (the method, the budget, the reference sources, the chat
 * template and the progress callback) at the top, the rest in three groups with their defaults. */
typedef struct kf_compact_params {
    kf_method method;
    double budget;                  /* kept fraction of the document block (default 0.1) */
    kf_prompt repeat_instruction;   /* ids between the context and the repeated document; n = 0
                                       disables the repeat source */
    int use_context_queries;        /* pool the document's own queries (default 0) */
    int no_repeat;                  /* 1: no repeat source whatever the instruction (the context's
                                       queries and the probes alone); default 0 */
    double repeat_fraction;         /* share of the document the repeat covers, in [0, 1]; 0 or 1
                                       (default): the whole document once; below 1: repeat_spans
                                       spans (kf_repeat_spans), each a source of its own */
    int repeat_spans;               /* spans of a partial repeat (0: KF_REPEAT_SPANS_DEFAULT), at
                                       most KF_REPEAT_SPANS_MAX */
    const kf_prompt *probes;        /* question-like prompts run on top of the document */
    int n_probes;
    const char *chat_template;      /* NULL, or the chat template's digest (32 hex digits) that built the
                                       context, instruction and probes: a chat cache's recipe (unused
                                       by the compaction itself) */
    kf_progress_fn progress;        /* NULL, or called as the work goes (compactor/progress.h) */
    void *progress_user;
    kf_solver_params solver;        /* kf_solver_params_default() */
    kf_choice_params choice;        /* kf_choice_params_default() */
    kf_run_params run;              /* kf_run_params_default() */
} kf_compact_params;

kf_solver_params kf_solver_params_default(void);
kf_choice_params kf_choice_params_default(void);
kf_run_params kf_run_params_default(void);

kf_compact_params kf_compact_params_default(void);

enum { KF_REPEAT_SPANS_DEFAULT = 4, KF_REPEAT_SPANS_MAX = 64 };
/* The repeat's spans over a document of n_doc tokens under p: how many (0: no repeat source:
 * no instruction or no_repeat), span k being document tokens off[k] .. off[k] + len[k] - 1 (off,
 * len: [KF_REPEAT_SPANS_MAX]). The whole document is one span; a fraction F < 1 splits the
 * document into K = min(repeat_spans, n_doc) equal strata and takes from stratum k a run of
 * round(F * its length) tokens (at least 1) at an offset drawn from p->solver.seed. Each span is a
 * source forked on the context: the instruction, then the span, placed at the RoPE positions it
 * has in the whole repeat. Values outside their ranges are clamped (kf_compact_prepare rejects them). */
int kf_repeat_spans(const kf_compact_params *p, int n_doc, int *off, int *len);
/* 1 when p compacts with the per-head choice (KF_CHOICE_DEFAULT resolved by method). */
int kf_head_choice_active(const kf_compact_params *p);

typedef struct {
    double prefill_s, refq_s, select_s, beta_s, values_s, fold_s, choice_s; /* wall time per stage; the
                                   solve's (select_s .. choice_s) summed over the heads, which run on
                                   the backend's parallel_for: thread-seconds with several threads */
    int64_t n_queries;          /* pooled queries per KV head */
    int fold_fallback_heads;    /* heads where mu^T a <= 0: compacted as `drop` */
    double mean_var_gain;       /* var(q.u) averaged over folded heads */
    int heads_by_method[4];     /* (layer, KV head) pairs compacted with each kf_method */
    int heads_ridged;           /* heads whose value refit has a Tikhonov term (alpha > 0) */
    int64_t n_val_queries;      /* validation rows per KV head held out for the per-head choice */
    int64_t ws_bytes, ws_peak;  /* each head workspace's bytes (the memory formula's ws; one per head in
                                   flight) and the most any head used of one */
    kf_am_stats solver;
} kf_compact_stats;

typedef struct {
    int n_layers, kv_heads, head_dim;
    int64_t D;            /* original context length (prefix + document + suffix) */
    int64_t C;            /* compacted length */
    int64_t n_prefix, n_suffix, t;
    kf_method method;
    double budget, lambda_rel;
    int rotated;          /* 1: keys in the compacted frame (rotated by -(D - C)) */
    float *keys;          /* [n_layers, C, kv_heads, head_dim] */
    float *values;        /* [n_layers, C, kv_heads, head_dim] */
    float *beta;          /* [n_layers, kv_heads, C]; zeros except for am */
    float *u;             /* [n_layers, kv_heads, head_dim]; zeros except for fold */
    int32_t *positions;   /* [n_layers, kv_heads, C] original positions, -1 for padding */
    float *var_gain;      /* [n_layers, kv_heads] var(q.u) over the fold's queries; 0 unless folded */
    float *head_alpha;    /* [n_layers, kv_heads] the Tikhonov alpha of each head's value refit */
    uint8_t *head_method; /* [n_layers, kv_heads] the kf_method each head was compacted with, or NULL:
                             every head used `method` (per-head choice fills it) */
    kf_compact_stats stats;
} kf_compacted;

/* One head's choice (what kf_compact does per head when the choice is on): candidates fitted on
 * the training rows train / train_tg (targets m, y, Y of those rows), scored by kf_val_err on val;
 * kc, vo [t, d]: the kept keys and their original values (contiguous; sel, their positions, is
 * not read: train->k may be any block). Ties keep the earlier candidate: the method itself, then
 * drop, then keep; grids in ascending order. */
typedef struct {
    kf_method method;
    double lambda, alpha, err; /* the fold's lambda_rel, the refit's alpha, the validation error */
} kf_head_pick;

/* The training rows the choice fits its candidates on (beta, fold directions, values): the first
 * min(R, max(ceil(choice_rows * t), KF_CHOICE_MIN_ROWS)) of the R it is given (all R when
 * choice_rows is 0). The caller orders the rows so that every prefix is a random subsample
 * (kf_compact: stratified by source kind, seeded). The candidates only need ranking, and their
 * fp64 normal equations cost R t^2; the winner's values are refitted on more of them
 * (kf_refit_rows) and every held-out row (docs/decisions/subsampled-choice.md). */
enum { KF_CHOICE_MIN_ROWS = 512 };
int kf_choice_rows(const kf_compact_params *p, int R, int t);
/* The training rows the winner's refit takes, of the R the choice was given: the first
 * min(R, max(ceil(refit_rows * t), KF_REFIT_MIN_ROWS)), never fewer than kf_choice_rows (all R
 * when refit_rows is 0, or refit_all is not KF_REFIT_VALUES); every held-out row besides
 * (docs/decisions/refit-rows.md). */
enum { KF_REFIT_MIN_ROWS = 2048 };
int kf_refit_rows(const kf_compact_params *p, int R, int t);
/* The held-out rows the choice scores its candidates on, of the n_val held out, for a document of
 * T tokens: min(n_val, max(ceil(val_rows * T), KF_VAL_MIN_ROWS)) (all n_val when val_rows is 0).
 * Not of the budget: the variants of one solve share the scored rows, so that each is the file a
 * job with that variant alone writes. Why a subsample: docs/decisions/per-head-choice.md. */
enum { KF_VAL_MIN_ROWS = 512 };
int64_t kf_val_score_rows(const kf_compact_params *p, int64_t n_val, int64_t T);
/* The training rows (r = j n_pos + k over the group's G members, position k not held out:
 * is_val[k] = 0) in the order kf_compact gathers them for the choice: shuffled (seeded) within each
 * source kind (kind [n_pos], KF_REFQ_*), the kinds interleaved in proportion (row i of a kind of n
 * rows at (i + 1/2) / n), so that every prefix is a stratified random subsample. order [G n_pos];
 * returns the count, or -1 when out of memory. */
int64_t kf_choice_training_order(int64_t n_pos, int G, const uint8_t *kind, const uint8_t *is_val, uint64_t seed,
                                 int64_t *order);

/* What kf_choose_head keeps for the refit when asked (shared, not rebuilt): the normal
 * equations over the kept keys of the training rows the candidates were fitted on (the first
 * `rows`, kf_choice_rows), beta's (am, fold; beta.G NULL: none) and drop's value refit (drop.G
 * NULL: none); the refit adds the part of the training rows after them up to kf_refit_rows and
 * the validation rows'. */
typedef struct {
    kf_beta_normal beta;
    kf_value_gram drop;
    int rows;
    /* the method's best candidate (am, or fold at its best lambda): its value normal equations on
     * the same rows (win.G NULL: none kept), its beta [t] and fold direction u [d] (fold) and the
     * direction's var_gain; win_method KF_METHOD_KEEP until a candidate of the method was scored */
    kf_value_gram win;
    float *win_beta, *win_u;
    kf_method win_method;
    double win_var_gain;
    kf_am_stats win_beta_stats; /* the fit of that beta (fallbacks, restarts) */
} kf_choice_fits;
void kf_choice_fits_free(kf_choice_fits *f);
/* The bytes kf_choose_head keeps in its workspace for the refit, for t keys (refit_values:
 * KF_REFIT_VALUES, the method's best candidate too). */
int64_t kf_choice_kept_bytes(int t, int d, int refit_values);
/* Which kept normal equations kf_choice_refit_add adds to. */
typedef enum { KF_REFIT_ADD_DROP = 0, KF_REFIT_ADD_BETA = 1, KF_REFIT_ADD_WIN = 2 } kf_refit_add_to;
/* The winner's refit on its rows (kf_refit_rows and the held-out ones): adds to the kept normal
 * equations (beta's, drop's or the method's best candidate's values) the n_parts row sets parts /
 * tgs (heads and targets over the rows beyond the first f->rows training rows: the other training
 * rows it takes, the validation rows; R = 0 adds nothing) over the keys kc [t, d] (contiguous: the
 * kept keys, or for a folded winner the kept keys folded along f->win_u; the values' design takes
 * am's f->win_beta as its bias); the caller then fits from them (kf_am_fit_beta_normal,
 * kf_value_gram_solve). KF_ERR_INVALID when those normal equations were not kept. */
kf_status kf_choice_refit_add(kf_choice_fits *f, kf_refit_add_to to, const kf_am_head *parts, const kf_am_targets *tgs,
                              int n_parts, const float *kc, int t, kf_ws *ws, kf_error *err);

/* keep: NULL, or receives what the refit can reuse (freed by the caller, also on failure).
 * ws: every buffer from it (val's too: kf_val_head_init_targets with a workspace sized for t keys);
 * given back on return, except with keep, whose fits stay in it (above the choice's own buffers)
 * until the caller resets it. NULL: the heap (kf_choice_refit_add likewise). */
kf_status kf_choose_head(const kf_compact_params *p, const kf_am_head *train, const kf_am_targets *train_tg,
                         const int32_t *sel, int t, const float *kc, const float *vo, kf_val_head *val, uint64_t seed,
                         kf_head_pick *best, kf_choice_fits *keep, kf_ws *ws, kf_error *err);

/* The full context is prefix + doc + suffix (prefix/suffix may be empty: n = 0). */
kf_status kf_compact(kf_model *m, const kf_prompt *prefix, const kf_prompt *doc, const kf_prompt *suffix,
                     const kf_compact_params *p, kf_compacted *out, kf_error *err);
void kf_compacted_free(kf_compacted *c);

/* Prefix sharing in batch jobs (compactor/prefix_plan.h): kf_compact on a caller's arena, taking
 * the first `shared` context tokens from a document already there instead of prefilling them. */
typedef struct {
    kf_arena *arena;       /* NULL: an arena of kf_compact's own, sized for this document; else the
                              caller's, with kf_compact_arena_pages() free pages besides the parent's */
    const kf_seq *parent;  /* NULL, or a document in arena whose first `shared` tokens are this
                              context's first `shared` tokens (the caller guarantees it) */
    int64_t shared;        /* 0 <= shared < D, <= parent->len; the prefill runs on the rest */
    kf_seq *keep;          /* NULL, or receives the context's pages (D tokens) to be a later
                              document's parent; the caller releases it */
} kf_compact_reuse;

/* Pages kf_compact_prepare may take from a caller's arena for a context of n_ctx tokens (n_doc of
 * them the document) with p's repeat instruction and probes: the context's alone (the reference
 * sources run in an arena of their own that holds one layer, see kf_compact_solve). */
int64_t kf_compact_arena_pages(const kf_compact_params *p, int64_t n_ctx, int n_doc);

/* kf_compact with reuse (NULL: exactly kf_compact). Context queries (use_context_queries) need
 * the whole context computed and are refused with shared > 0. */
kf_status kf_compact_ex(kf_model *m, const kf_compact_reuse *reuse, const kf_prompt *prefix, const kf_prompt *doc,
                        const kf_prompt *suffix, const kf_compact_params *p, kf_compacted *out, kf_error *err);

/* The stages of kf_compact_ex, for work shared between several (method, budget)
 * variants of one document: kf_compact_prepare plans the reference-query sources and their
 * subsample and prefills the context (step 1 above, with kf_compact_ex's reuse rules; the
 * document's own rows, use_context_queries, captured for every layer); kf_compact_solve runs the
 * sources (step 2) layer by layer, all of them together, each on a fork of the context in an arena
 * of its own that holds one layer (the context's layer copied in before the sources run it;
 * kf_model_forward_layers: the chunks of a plain forward, the same bytes), and as soon as they have
 * passed layer l it solves layer l (steps 3-4): reads its K/V once, computes each KV head's AM
 * targets (and the per-head choice's validation split, the validation prompts' keys read from the
 * sources' forks) once, and runs every variant's selection and fits on them, the KV heads in
 * parallel on the model's backend (parallel_for; the same bytes for any thread count); so one
 * layer of reference queries exists at a time. Each outs[i] is bit-identical to kf_compact_ex
 * with p's method and budget replaced by v[i]'s; every kf_compact_solve runs the sources again. */
typedef struct {
    kf_method method;
    double budget;
} kf_compact_variant;
typedef struct kf_compact_prep kf_compact_prep;

/* p's method and budget are unused: v [n] are the variants the solve will be asked for (the
 * validation split is planned when one of them chooses per head). p and what it points to
 * (probes, head budgets, quoka) must outlive *out. */
kf_status kf_compact_prepare(kf_model *m, const kf_compact_reuse *reuse, const kf_prompt *prefix,
                             const kf_prompt *doc, const kf_prompt *suffix, const kf_compact_params *p,
                             const kf_compact_variant *v, int n, kf_compact_prep **out, kf_error *err);
/* outs [n], in the compacted frame; on failure every outs[i] is freed (zeroed). The shared work's
 * times (prefill, reference queries: the sources' forwards summed over the layers, the targets
 * inside select_s, the validation split inside choice_s) appear in every output's stats. */
kf_status kf_compact_solve(kf_compact_prep *prep, const kf_compact_variant *v, int n, kf_compacted *outs,
                           kf_error *err);
/* keep: NULL (the context's pages are released), or receives them (reuse->keep). */
void kf_compact_prep_free(kf_compact_prep *prep, kf_seq *keep);

/* Rotate the keys into the compacted frame (compacted = 1: by -(D - C), questions at C, C+1, ...)
 * or back into AM's frame (0: the kept keys at their original positions, questions at D, ...).
 * kf_compact returns the compacted frame. */
void kf_compacted_set_frame(kf_compacted *c, const kf_model *m, int compacted);

/* Attach a compacted cache to the arena as a fresh document seq of C tokens. For am, the caller
 * passes kf_compacted_bias() to the forward pass; questions then run at pos_offset
 * kf_compacted_pos_offset() (D - C in AM's frame, 0 in the compacted frame). */
kf_status kf_compacted_attach(const kf_compacted *c, kf_arena *a, kf_seq *seq, kf_error *err);
/* Per-layer bias pointers ([kv_heads, C] each) for am, or NULL for the bias-free methods; the
 * array must hold n_layers entries. */
const float *const *kf_compacted_bias(const kf_compacted *c, const float **per_layer);
int64_t kf_compacted_pos_offset(const kf_compacted *c);

/* ---- memory: the peak of one compaction (docs/decisions/memory-formula.md) ----
 *
 * Resident bytes at the peak of kf_compact (its own arena, one variant; the CPU backend: fp32 or
 * bf16 weights, an fp32 or bf16 arena, dense prefill), with
 *   L layers, H hidden, I intermediate, V vocab, d head_dim, kvh KV heads, QD = n_heads d,
 *   KD = kvh d, pg(n) = ceil(n / 16) (16-token pages);
 *   D context tokens, T of them the document (the compacted block), S the longest reference
 *   source run on top of the context (the repeat prompt: instruction + document, or the longest
 *   span of a partial repeat: instruction + span), N = D + S;
 *   P, p: the tokens and count of the other sources (probes, the partial repeat's other spans); R reference queries per KV head,
 *   Rv of them held out for the choice (Rs of those scored: kf_val_score_rows), Rc of them the
 *   context's own (use_context_queries), Ru
 *   of them (fused targets) the rows whose targets the solve still computes (Rc, plus a QUOKA
 *   repeat's);
 *   t kept keys per head, C = D - T + t; c the prefill chunk; A the attention pool's threads;
 *   n the solve's threads (the backend's parallel_for; the CPU backend's pool, n = A), each with
 *   its own buffers; h = min(n, kvh) the KV heads solved at once; ws one head's fitting workspace.
 *   The sources run layer by layer, all of them together (kf_compact_solve), each layer solved
 *   before the next runs:
 *
 *   peak    = weights + arena + queries + targets + forward + solve + output + base
 *   weights = w (V H (2 - tied) + H + L (2 H QD + 2 H KD + 3 H I + 2 H + 2 d qk_norm))
 *               w = 4 bytes per parameter, or 2 with bf16 weights (weights_bf16)
 *   arena   = a L KD pg(D) + a KD (pg(D) + pg(N) - floor(D / 16) + pg(P) + 2 p)
 *               K and V pages, a = 32 e bytes per page and KD (e = 4, or 2 with arena_dtype bf16:
 *               a = 128 or 64): the context, every layer; the sources' own arena of one
 *               layer: the context's layer being run and each source on its fork of it (the
 *               context's partly filled last page copied), all of them at once
 *   queries = e kvh R d + e L kvh Rc d            the pool, one layer [kvh, R, d], reused layer after
 *                                                 layer; the context's own rows, every layer (captured
 *                                                 by the prefill): e = 4 (fp32) or 2 (refq_bf16)
 *   targets = [fused] kvh (4 R (d + 2) + 8 T)     AM's targets the source forwards fuse
 *                                                 (compactor/refq_targets.h): m, y, Y and the
 *                                                 score sums, one layer [kvh] like the queries' pool
 *             + 4 A ((r + 8) T' + max(0, r - r') (2 d + 259))  the attention's kept block logits
 *               + 8 kvh T (ceil(c' / (r / G))     per thread (T' = T rounded up to a multiple of 16,
 *                 + ceil(c' / 256))               8 padding rows), its wider tiles' buffers, the score
 *                                                 parts per item (tiles also cut at every multiple of
 *                                                 256 positions), with c' = min(c, max(D, S)),
 *                                                 G = n_heads / kvh, r = G min(floor(r_max / G), c'),
 *                                                 r_max = min(512, max(64, floor(2^21 / T))), r' the
 *                                                 rows of a tile without targets: G q', q' halved
 *                                                 from min(floor(512 / G), c') while kvh ceil(c' / q')
 *                                                 < 2 A, q' G > 64 and q' > 1
 *             + 4 A (r~ d + 3 r~)               the tiles' own-key state kept aside (r~: r rounded
 *                                                 up to a multiple of 16)
 *               + [choice] kvh 4 Rv (d + 2)       the held-out rows' attention over their own prompts
 *                 + 5 R / G                       (refq_targets.h: their pool and slots)
 *             [fused]: a source past the context runs dense on the CPU backend (the repeat
 *             without QUOKA, or a probe); else 0 and the solve computes all the targets
 *   forward = kf_forward_plan_bytes(min(c, max(D, S)), 0) + 4 A W(G q', d, 0) + 4 H (S + P)
 *             + [bf16 weights] 4 max over the layers' GEMMs (N, K) of kf_cpu_widen_rows(64, N, K) K + 4 H
 *               the plan's scratch; the attention's work, one tile per thread whatever the
 *               context's length (W: kf_cpu_attn_tile_floats, q' below); the sources' residual
 *               streams between layers; the GEMMs' tile of widened weight rows
 *               (kernels/cpu/cpu_kernels.h) and a norm's widened weight
 *   solve   = 8 D KD + 8 Sv KD [choice]           one layer's K/V, and of the validation prompts that the
 *                                                 solve attends itself (Sv: the sources without fused
 *                                                 targets, S + P without the targets term, a QUOKA
 *                                                 repeat's tokens beside fused probes, else 0)
 *           + 8 R [choice]                        the training rows' order (kf_choice_training_order)
 *           + n (8 t + 16 t d                      per thread (thread_init): the kept keys' buffers
 *                + [probes] 4 R d                 the probe rows (fold_queries on probes)
 *                + [choice] 8 R (d + 1)            the training/validation split (with the given
 *                  + Rv (4 d + 28))               own-prompt attention of the held-out rows)
 *           + h ws                                per head in flight: its workspace, everything it holds
 *   output  = L C (8 KD + 8 kvh) + L kvh (4 d + 9) the compacted cache
 *   base    = 144 MiB                             what the heap does not hold, measured: the binary and
 *                                                 its libraries (72 MB resident here), OpenBLAS's GEMM
 *                                                 buffers, the threads' stacks, memory the allocator
 *                                                 keeps (0.12-0.15 GB in all at 4k-16k tokens)
 *
 * ws (kf_compact_head_ws_bytes) is the declared size of each workspace (one per head in flight),
 * from which the heads carve every buffer (nothing on the per-head path calls malloc): a head's widened bf16 rows,
 * its targets (fused: the scores), the validation head (its Rs scored rows); then the largest of
 * the targets' scratch and one variant's selection or its choice (the candidates' buffers, the normal equations kept for
 * the refit, the fold's covariance) plus its largest fit step. Each term is the sizing function of
 * its consumer (compactor/am.h, fold.h, diag.h: kf_ws_bytes of each buffer, 64-byte aligned).
 * Without the per-head choice the [choice] terms are 0. Several variants in one kf_compact_solve
 * add an output each (a thread's buffers are sized for the largest t; a head runs its variants in
 * turn). QUOKA prefill, the GPU backend and a caller's arena
 * are not covered. */
typedef struct {
    int64_t D, T, S, P;   /* context, document, longest source, the other sources (tokens) */
    int64_t Sv;           /* the validation prompts' tokens whose K/V the solve keeps (unfused sources) */
    int n_p;              /* count of those other sources */
    int64_t R, Rv, Rc, t; /* reference queries, held-out ones and the context's own per KV head; kept keys
                             per head */
    int64_t Rs;           /* the held-out rows the choice scores (kf_val_score_rows of Rv, T) */
    int64_t Rk;           /* the rows of the kept keys' logits the choice keeps for its fold candidate
                             (kf_kept_logits_rows; 0: no fold candidate) */
    int choice;           /* the per-head choice runs (validation prompts kept, the split built) */
    int refq_bf16;        /* reference queries stored in bf16 */
    int arena_bf16;       /* the KV arena in bf16 (arena_dtype) */
    int weights_bf16;     /* the model's weights in bf16 (kf_model_weight_dtype; 0 from kf_compact_mem_shape:
                             the caller sets it) */
    int chunk;            /* prefill chunk (0: KF_DEFAULT_CHUNK) */
    int attn_threads;     /* the CPU attention's pool threads */
    int solve_threads;    /* n: the solve's threads (the backend's; per-thread buffers) */
    int solve_heads;      /* h: KV heads solved at once, min(n, kvh) */
    int fold_on_probes;   /* fold_queries = KF_FOLD_ON_PROBES (a probe-row buffer per thread) */
    int refit_values;     /* the choice keeps its winner's normal equations (KF_REFIT_VALUES) */
    int64_t head_ws;      /* ws: bytes of one head's workspace (kf_compact_head_ws_bytes) */
    int fused;            /* the source forwards fuse AM's targets (the targets term) */
    int64_t Ru;           /* fused: the rows per KV head whose targets the solve computes (the context's own,
                             a QUOKA repeat's) */
} kf_mem_shape;

typedef struct {
    int64_t weights, arena, queries, forward, solve, output, base, total; /* bytes */
    int64_t targets;
} kf_mem_peak;

/* ws: the bytes of one head's workspace (kernels/workspace.h) for the shape s and head_dim d: what a
 * head carves from it, composed of the sizing functions beside each consumer (am.h, fold.h, diag.h).
 * The solve sizes its workspaces (one per head in flight) with it, once per job. */
int64_t kf_compact_head_ws_bytes(const kf_mem_shape *s, int d);
/* The shape kf_compact runs for model c, parameters p (method and budget included) and a context
 * of n_pre + n_doc + n_suf tokens; Rv and Rc estimated for the expected shares of the sampled rows.
 * The CPU backend's pool of attn_threads threads also runs the solve: n = attn_threads. */
void kf_compact_mem_shape(const kf_hfconfig *c, const kf_compact_params *p, int64_t n_pre, int64_t n_doc,
                          int64_t n_suf, int attn_threads, kf_mem_shape *out);
/* The formula above: the total in bytes, each term in *terms (may be NULL). */
int64_t kf_compact_peak_bytes(const kf_hfconfig *c, const kf_mem_shape *s, kf_mem_peak *terms);

#endif
