/* diag.h — per-head quality of a compacted block on held-out queries.
 *
 *   lse_err  |LSE_comp - LSE_orig| of the document block alone, LSE = log sum_j exp(s q.k_j + beta_j):
 *            the block's attention mass, which drop and keep lose;
 *   out_err  ||o_comp - o_orig|| / ||o_orig|| of the attention output over the block followed by an
 *            uncompacted appended block (the question's own keys). Block-local output error alone
 *            misleads (research note §7.4: drop looks better than fold there), so the appended block
 *            is what puts the mass error into the output.
 * Both are averaged over the held-out queries. Keys of both blocks must be in the same frame as the
 * queries (AM's frame: kf_compacted_set_frame(c, m, 0)).
 */
#ifndef KF_DIAG_H
#define KF_DIAG_H

#include <stddef.h>

#include "formats/error.h"

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

#endif
