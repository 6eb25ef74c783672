/* am.h — Attention Matching (AM) for one (layer, KV head): select keys, fit biases, refit values.
 *
 * Notation (docs/design.md): the document block's keys K [T, d] and values V [T, d]
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
 *   values    C_v = argmin ||X C_v - Y||_F with X = softmax_j(s q_i.c_j + beta_j) over the kept keys
 *             (the compactor's fits: fp64 normal equations with a safety ridge of 1e-6 tr(X^T X)/t,
 *             kf_am_fit_values_ridge; kf_am_fit_values is the plain QR least squares). On ill-
 *             conditioned heads QR's exact solution reached |values| 5,190 (records-qwen3, am,
 *             budget 0.1; 888 with the ridge; drop's stay below 36) and 2,183 (records-llama3-
 *             induct; 36 with the ridge); the ridged fit is also the one the per-head choice
 *             validates. beta, drop and fold build their normal equations in row tiles: no R x t
 *             matrix is held.
 *
 * Softmax domains (a classic source of silent errors): targets and selection use the document
 * block only without bias; M uses unnormalised exponentials shifted by the block's row max; X uses
 * the kept keys with bias.
 */
#ifndef KF_AM_H
#define KF_AM_H

#include <stdint.h>

#include "kernels/base/error.h"
#include "kernels/backend.h"

typedef enum { KF_SCORE_RMS = 0, KF_SCORE_MEAN = 1 } kf_score_method;

/* How beta is fitted: AM's reference (clamped least-squares start, then two projected-gradient
 * steps), or the same start driven to convergence inside the box [e^-3, e^3] (fp64 coordinate
 * descent until the KKT conditions hold to a relative 1e-9, at most KF_BOX_MAX_SWEEPS sweeps). */
typedef enum { KF_BETA_AM = 0, KF_BETA_BOX = 1 } kf_beta_fit;
#define KF_BOX_MAX_SWEEPS 2000

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
    const kf_backend *be; /* runs the math (kf_solve_backend: NULL or a backend without the solve's ops = CPU) */
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

/* Scratch: every function below that takes a kf_ws carves its buffers from it (kernels/workspace.h)
 * and returns it as it found it, except for the buffers of the results it fills (normal equations,
 * covariances, targets: in_ws); NULL: a block of its own (results on the heap, as before). The
 * *_bytes functions beside them say how many bytes of workspace they take for given shapes. */

kf_status kf_am_targets_compute(const kf_am_head *h, kf_score_method method, kf_am_targets *out, kf_error *err);
/* The same with out's buffers and the scratch from ws (kf_am_targets_ws_bytes): out's stay in ws,
 * freed with it (never by kf_am_targets_free). */
kf_status kf_am_targets_compute_ws(const kf_am_head *h, kf_score_method method, kf_am_targets *out, kf_ws *ws,
                                   kf_error *err);
int64_t kf_am_targets_bytes(int R, int T, int d);    /* the results m, y, Y, score */
int64_t kf_am_targets_ws_bytes(int R, int T, int d); /* the results and the scratch */
void kf_am_targets_free(kf_am_targets *t);

/* sel[t]: indices of the t highest scores, ascending. */
kf_status kf_am_select(const float *score, int T, int t, int32_t *sel, kf_ws *ws, kf_error *err);
int64_t kf_am_select_bytes(int T);

/* beta[t] for the kept keys sel (AM's mass matching), fitted on the first h->R rows of the
 * targets; kf_am_fit_beta is the reference fit (KF_BETA_AM). */
kf_status kf_am_fit_beta(const kf_am_head *h, const kf_am_targets *tg, const int32_t *sel, int t, uint64_t seed,
                         float *beta, kf_am_stats *stats, kf_error *err);
kf_status kf_am_fit_beta_ex(const kf_am_head *h, const kf_am_targets *tg, const int32_t *sel, int t, uint64_t seed,
                            kf_beta_fit fit, float *beta, kf_am_stats *stats, kf_ws *ws, kf_error *err);
int64_t kf_am_fit_beta_bytes(int t, int d);

/* The beta fit in two halves (work shared between the per-head choice and the refit):
 * its fp64 normal equations over the kept keys kc [t, d] (contiguous) on the first h->R rows,
 * G = M^T M [t, t] (full), b = M^T y [t], yy = y^T y with M_ij = exp(s q_i.k_j - m_i), built in
 * row tiles (fp32 tile products summed in fp64, kf_gram_tiles: M is never held whole; h->k unused);
 * then the fit from them alone. Normal equations of disjoint row sets add: training rows +
 * validation rows = all rows.
 * kf_am_fit_beta_ex == kf_beta_normal_build then kf_am_fit_beta_normal. */
typedef struct {
    double *G, *b;
    double yy;
    int t;
    const kf_backend *be; /* the builder's h->be: the fit's solves run on it */
    int in_ws;            /* 1: G and b are a workspace's */
} kf_beta_normal;
kf_status kf_beta_normal_build(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t,
                               kf_beta_normal *out, kf_ws *ws, kf_error *err);
int64_t kf_beta_normal_bytes(int t);       /* G and b */
int64_t kf_beta_normal_build_bytes(int t); /* G, b and the build's row tiles */
void kf_beta_normal_add(kf_beta_normal *acc, const kf_beta_normal *part);
kf_status kf_am_fit_beta_normal(const kf_beta_normal *ne, uint64_t seed, kf_beta_fit fit, float *beta,
                                kf_am_stats *stats, kf_ws *ws, kf_error *err);
int64_t kf_am_fit_beta_normal_bytes(int t);
void kf_beta_normal_free(kf_beta_normal *ne);

/* Box-constrained least squares from its normal equations: w = argmin w^T G w / 2 - b^T w with
 * lo <= w <= hi, G [t, t] symmetric PSD (fp64, full), by cyclic coordinate descent from w (in and
 * out, clamped first). Stops when every projected gradient is below tol * max(|b|, |G w|) or after
 * max_sweeps. Returns the sweeps done (max_sweeps + 1 when not converged). */
int kf_box_lsq(const double *G, const double *b, int t, double lo, double hi, double tol, int max_sweeps, double *w);

/* values[t, d] = argmin ||X values - Y|| for keys[t, d] (row stride key_stride) and an optional
 * bias beta[t] (NULL: no bias). be: as kf_am_head.be (here and below). */
kf_status kf_am_fit_values(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                           size_t key_stride, const float *beta, int t, const float *Y, float *values,
                           kf_am_stats *stats, kf_error *err);

/* Tikhonov-regularised value refit (docs/decisions/value-ridge.md):
 *   values = argmin ||X values - Y||_F^2 + mu ||values - V0||_F^2,   mu = alpha * tr(X^T X) / t
 * towards V0 [t, d] (row stride v0_stride; NULL: towards zero), i.e. (X^T X + mu I) values =
 * X^T Y + mu V0 in fp64, with mu at least 1e-6 tr(X^T X) / t (kf_value_gram_solve): alpha = 0 is the
 * least-squares fit the per-head choice validated (normal equations with that safety ridge, not
 * kf_am_fit_values' QR: one exponential pass and tiles instead of an R x t QR). */
kf_status kf_am_fit_values_ridge(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                                 size_t key_stride, const float *beta, int t, const float *Y, double alpha,
                                 const float *v0, size_t v0_stride, float *values, kf_am_stats *stats, kf_ws *ws,
                                 kf_error *err); /* ws: kf_value_gram_build_bytes */

/* The normal equations of one value refit, built once and solved for several alphas (the per-head
 * choice). G = X^T X [t, t] (full), B = X^T Y [t, d], fp64 sums of each row tile's fp32 products
 * of X rounded to bf16 (kf_gram_tiles; X is never held whole). */
typedef struct {
    double *G, *B;
    double tr; /* tr(G) */
    int t, d;
    double *A, *Bs; /* [t, t], [t, d] the solves' scratch (one solve at a time per gram) */
    const kf_backend *be; /* the builder's: the solves run on it */
    int in_ws;            /* 1: the buffers are a workspace's */
} kf_value_gram;

#define KF_GRAM_TILE 512 /* rows of a normal-equations tile */

/* The row tiles the normal equations are built over, allocated once for up to t keys and reused
 * by every build (the per-head choice's candidates): KF_GRAM_TILE rows at a time. A tile's
 * products X^T X and X^T Y are taken in fp32 and added into the fp64 sums
 * (docs/decisions/fp32-tile-products.md): fp32 rounding stays within one tile's 512 rows. The
 * values' weights and targets are rounded to bf16 first (docs/decisions/bf16-gram.md). */
typedef struct {
    float *Z;  /* [512, t] the logits (kf_kept_normal_build only; NULL unless asked for) */
    float *X;  /* [512, t] the weights */
    float *Gt; /* [t, t] one tile's X^T X (upper triangle); with d > 0 kf_gram_bf16_work(512, t, d) */
    float *L;  /* [L_rows, t] the kept keys' logits of the first L_rows rows, kept by
                  kf_kept_normal_fill for kf_value_gram_rebuild_folded (NULL: none) */
    int L_rows;
    int t, d;
    int in_ws; /* 1: the buffers are a workspace's */
} kf_gram_tiles;
/* 0, or -1 when out of memory (nothing left allocated); logits: also Z. */
int kf_gram_tiles_alloc(kf_gram_tiles *w, int t, int d, int logits, kf_ws *ws);
int64_t kf_gram_tiles_bytes(int t, int d, int logits);
void kf_gram_tiles_free(kf_gram_tiles *w);
/* The rows of the kept keys' logits worth keeping for the fold candidate of t keys fitted on R
 * rows: all R while they take at most KF_KEPT_LOGITS_MAX bytes, else as many whole tiles as fit
 * (the rest are computed again). */
#define KF_KEPT_LOGITS_MAX ((int64_t)64 << 20)
int kf_kept_logits_rows(int R, int t);
int64_t kf_kept_logits_bytes(int rows, int t);
/* w->L for rows rows of w->t logits (w allocated with ws, or the heap when ws is NULL); 0, or -1
 * when out of memory. */
int kf_gram_tiles_keep_logits(kf_gram_tiles *w, int rows, kf_ws *ws);
/* One tile's X [n, t] (and Y [n, d]; B NULL: none) into G's upper triangle [t, t] and B [t, d],
 * summed in fp64; first: G, B overwritten (not read). The values' equations (B given): X rounded
 * to bf16 in place and Y's rounded copy, both products through gram_bf16; beta's (no B): X^T X
 * in fp32. */
void kf_gram_tile_add(const kf_backend *be, float *X, const float *Y, int n, int t, int d, const kf_gram_tiles *w,
                      double *G, double *B, int first);

/* g's buffers for t keys, head_dim d: G, B zeroed, the solves' scratch; 0, or -1 when out of memory. */
int kf_value_gram_alloc(kf_value_gram *g, const kf_backend *be, int t, int d, kf_ws *ws);
int64_t kf_value_gram_bytes(int t, int d);
/* kf_value_gram_build into g (allocated for t = g->t keys, its contents replaced) with the tiles w
 * (for at least t keys): the same bits, nothing allocated. */
void kf_value_gram_rebuild(const float *q, int R, float scale, const float *keys, size_t key_stride,
                           const float *beta, const float *Y, kf_gram_tiles *w, kf_value_gram *g);
/* kf_value_gram_rebuild for the keys kc [t, d] folded along u (kf_fold_keys with beta [t] and
 * scale), from their logits' rank-one change: the kept keys' logits (w->L's rows where
 * kf_kept_normal_fill kept them, else computed again by the same GEMM) plus beta_j (q_r . u). */
void kf_value_gram_rebuild_folded(const float *q, int R, float scale, const float *kc, size_t key_stride,
                                  const float *beta, const float *u, const float *Y, kf_gram_tiles *w,
                                  kf_value_gram *g);
kf_status kf_value_gram_build(const kf_backend *be, const float *q, int R, int d, float scale, const float *keys,
                              size_t key_stride, const float *beta, int t, const float *Y, kf_value_gram *out,
                              kf_ws *ws, kf_error *err);
int64_t kf_value_gram_build_bytes(int t, int d); /* the gram and its row tiles */
/* mu = max(alpha, 1e-6) * tr / t (the floor is the least-squares fallback's safety ridge). A
 * Cholesky that fails below mu = 1e-4 tr / t is retried with mu ten times larger (each retry counted
 * in stats->value_fallbacks); one that still fails gives values 0 (stats->failures). */
kf_status kf_value_gram_solve(const kf_value_gram *g, double alpha, const float *v0, size_t v0_stride, float *values,
                              kf_am_stats *stats, kf_error *err);
/* The per-head choice's solve, which only ranks candidates (the shipped values are solved again
 * by kf_value_gram_solve): with alpha >= 1e-3 the same system in fp32 (spotrf, spotrs), which a
 * ridge of that size keeps well conditioned; below it, or when the fp32 factorization fails,
 * kf_value_gram_solve (docs/decisions/fp32-ranking-solves.md). */
kf_status kf_value_gram_rank_solve(const kf_value_gram *g, double alpha, const float *v0, size_t v0_stride,
                                   float *values, kf_error *err);
/* Beta's normal equations and drop's value refit (the kept keys without bias) in one pass over
 * the rows: one logit GEMM per row tile for both; each equal to its own build
 * (kf_beta_normal_build, kf_value_gram_build with beta NULL). tiles: with logits, for at least t
 * keys, or NULL (its own). */
kf_status kf_kept_normal_build(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t,
                               kf_gram_tiles *tiles, kf_beta_normal *bn, kf_value_gram *drop, kf_ws *ws, kf_error *err);
int64_t kf_kept_normal_build_bytes(int t, int d, int own_tiles);
/* kf_kept_normal_build in two steps, so that a caller can take the results' buffers from a
 * workspace before its own scratch (the per-head choice keeps them for the refit): bn, drop
 * allocated zeroed for t keys (0, or -1 when out of memory, nothing left), then filled. */
int kf_kept_normal_alloc(kf_beta_normal *bn, kf_value_gram *drop, const kf_backend *be, int t, int d, kf_ws *ws);
kf_status kf_kept_normal_fill(const kf_am_head *h, const kf_am_targets *tg, const float *kc, int t,
                              kf_gram_tiles *tiles, kf_beta_normal *bn, kf_value_gram *drop, kf_ws *ws, kf_error *err);
/* acc += part (the same keys and bias on another set of rows: training + validation = all). */
void kf_value_gram_add(kf_value_gram *acc, const kf_value_gram *part);
void kf_value_gram_free(kf_value_gram *g);

#endif
