/* diag.h — per-head quality of a compacted block on held-out queries.
 *
 *   lse_err  |LSE_comp - LSE_orig| of the document block alone, LSE = log sum_j exp(s q.k_j + beta_j):
 *            the block's attention mass, which drop and keep lose;
 *   out_err  ||o_comp - o_orig|| / ||o_orig|| of the attention output over the block followed by an
 *            uncompacted appended block (the question's own keys). Block-local output error alone
 *            misleads (drop looks better than fold there), so the appended block
 *            is what puts the mass error into the output.
 * Both are averaged over the held-out queries. Keys of both blocks must be in the same frame as the
 * queries (AM's frame: kf_compacted_set_frame(c, m, 0)).
 */
#ifndef KF_DIAG_H
#define KF_DIAG_H

#include <stddef.h>

#include "kernels/base/error.h"
#include "kernels/backend.h"

typedef struct {
    const float *k;  /* [n, d] row stride */
    const float *v;
    size_t stride;
    const float *beta; /* [n] or NULL */
    int n;
} kf_kv_block;

typedef struct {
    double lse_err;
    double out_err;
} kf_head_diag;

/* q [R, d]; visible[i] = how many appended keys query i sees (NULL: all). */
kf_status kf_diag_head(const float *q, int R, int d, float scale, const kf_kv_block *orig, const kf_kv_block *comp,
                       const kf_kv_block *appended, const int *visible, kf_head_diag *out, kf_error *err);

/* kf_diag_head in two halves, for one head measured against several compacted blocks: the
 * original block's side (each query's LSE over it, and its output over [orig | appended]) once,
 * then each compacted block against it. kf_diag_head_vs takes the q, appended and visible of the
 * init and gives kf_diag_head's result to the bit. */
typedef struct {
    int R, d;
    double *lse;   /* [R] the original block's LSE per query */
    double *o, *m; /* [R, d] output over [orig | appended] shifted by lse, unnormalised; [R] its mass */
} kf_diag_ref;

kf_status kf_diag_ref_init(kf_diag_ref *ref, const float *q, int R, int d, float scale, const kf_kv_block *orig,
                           const kf_kv_block *appended, const int *visible, kf_error *err);
kf_status kf_diag_head_vs(const kf_diag_ref *ref, const float *q, float scale, const kf_kv_block *comp,
                          const kf_kv_block *appended, const int *visible, kf_head_diag *out, kf_error *err);
void kf_diag_ref_free(kf_diag_ref *ref);

/* Validation of one head's compaction candidates (docs/decisions/per-head-choice.md).
 * Built once per head from validation queries that were not used for fitting: the original
 * block's output and mass, and each query's appended block (the tokens before it in its own
 * prompt: the repeat or probe prompt it came from, `visible` of them, itself included).
 * kf_val_err then scores a candidate (keys, bias, values) by the weighted mean relative error of
 * the attention output over [block | appended]: the out_err of the evaluation, on validation rows. */
typedef struct {
    int n, d;
    float scale;
    const kf_backend *be; /* runs the math (kf_solve_backend: NULL = the CPU's) */
    const float *q;  /* [n, d] (not owned) */
    double *w;       /* [n] weights, summing to 1 */
    double *lse_a;   /* [n] appended block's log-sum-exp (-inf: none) */
    float *o_a;      /* [n, d] appended block's output */
    float *o_full;   /* [n, d] original output over [block | appended] */
    /* workspace, allocated once per head: */
    float *Z;        /* [n, z_n] the last attended candidate's weights (scratch in init) */
    size_t z_cap;    /* floats in Z */
    int z_n;
    double *lse_b;   /* [n] the last attended candidate's log-sum-exp (in init), then its mixing
                        weight wb / (wb + wa), wb = exp(lse_b - max(lse_b, lse_a)) (kf_val_attend) */
    double *wa;      /* [n] the appended block's weight beside it, wa / (wb + wa), wa = exp(lse_a -
                        max(..)) or 0 */
    double *den;     /* [n] ||o_full_i||^2, summed in index order (the error's denominator) */
    float *o_b;      /* [n, d] its output */
    double *tmp;     /* [d] */
    int in_ws;       /* 1: every buffer is a workspace's (kf_val_head_free only forgets them) */
} kf_val_head;

/* q [n, d]; w [n] (NULL: uniform; normalised here); app[i] the appended block of row i (NULL:
 * none) of which visible[i] keys are seen. */
kf_status kf_val_head_init(kf_val_head *v, const kf_backend *be, const float *q, int n, int d, float scale,
                           const double *w, const kf_kv_block *orig, const kf_kv_block *const *app, const int *visible,
                           kf_error *err);
/* kf_val_head_init with the original block's attention given instead of computed: AM's targets
 * of these rows (m [n], y [n], Y [n, d]: lse = m + ln y, output Y), which the solve has already;
 * and, for the rows whose app[i] is NULL, the appended block's too where lse_a is not NULL
 * (lse_a [n], o_a [n, d]: made by the source forwards; -inf: none).
 * ws: v's buffers stay in it, Z sized for candidates of up to max_keys keys (kf_val_head_bytes,
 * max_vis the most appended keys a row sees); NULL: the heap, Z grown as needed. */
kf_status kf_val_head_init_targets(kf_val_head *v, const kf_backend *be, const float *q, int n, int d, float scale,
                                   const double *w, const float *m, const float *y, const float *Y,
                                   const kf_kv_block *const *app, const int *visible, const double *lse_a,
                                   const float *o_a, int max_keys, kf_ws *ws, kf_error *err);
int64_t kf_val_head_bytes(int n, int d, int max_keys, int max_vis);
/* Weighted mean relative output error of a compacted block (n keys; beta may be NULL); NAN when
 * out of memory. */
double kf_val_err(kf_val_head *v, const kf_kv_block *comp);
/* kf_val_err in two halves, for several value sets on the same keys and bias (the alpha grid):
 * kf_val_attend keeps the attention weights of keys (keys->v unused) in v (0, or -1 when out of
 * memory); kf_val_err_values then scores values [keys->n, d] (row stride) with them. Both reuse
 * v's workspace: no allocation per candidate once Z is large enough. */
int kf_val_attend(kf_val_head *v, const kf_kv_block *keys);
double kf_val_err_values(kf_val_head *v, const float *values, size_t stride);
void kf_val_head_free(kf_val_head *v);

#endif
