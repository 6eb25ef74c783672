/* budgets.h — per-head compaction budgets in the Attention Matching repository's JSON form.
 *
 *   { "L0H0": 0.0031, "L0H1": 0.0042, ..., "L35H7": 0.0029 }
 *
 * A flat object whose keys are "L{layer}H{kv_head}" and whose values are the head's share of the
 * total budget (non-negative numbers; over all heads they sum to about 1, uniform being
 * 1 / (layers * kv_heads)). A head missing from the file gets the uniform share. Keys naming a
 * layer or head the model does not have, shares that are negative, non-numeric or beyond a float
 * (FLT_MAX: an infinite share would make every budget NaN), and malformed keys are refused with
 * the key named. A key has one spelling: decimal numbers without sign or leading zeros ("L0H3";
 * "L00H3" is refused, so two keys never name one head).
 */
#ifndef KF_BUDGETS_H
#define KF_BUDGETS_H

#include "kernels/base/error.h"

/* shares[n_layers * kv_heads] (layer-major), renormalised to sum to 1. */
kf_status kf_head_budgets_load(const char *path, int n_layers, int kv_heads, float *shares, kf_error *err);

#endif
