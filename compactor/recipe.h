/* recipe.h — the identity of a compaction recipe: everything, besides the model and the document,
 * that changes the bytes of a compacted cache.
 *
 * kf_recipe_digest() is XXH3-128 (32 lowercase hex digits, high 64 bits first) over a canonical
 * byte string: for each field, in the order of recipe.c's list,
 *     name as ASCII, one 0 byte, a type byte ('i' int64, 'f' float64, 'a' int32 array,
 *     'F' float32 array, '-' absent, 's' string), then the value: int64 LE; float64 LE (bit pattern, with
 *     -0.0 and every NaN as +0.0 and the canonical quiet NaN); an array's count as int64 LE and
 *     its elements LE; nothing for absent.
 * The fields: the kvf format version (KVF_VERSION), the stored dtype, method, budget, lambda_rel,
 * score method, fold_queries, max_queries, seed, use_context_queries, the repeat instruction's ids,
 * each probe's ids (count, then one array each), head_budgets ([n_layers * kv_heads] or absent),
 * max_head_ratio, the prefill chunk (0 = the default; it decides where QUOKA chooses and the
 * summation order), QUOKA's settings (absent for dense prefill: mode, n_q, budget, budget_frac,
 * budget_min, n_sink, align_start, align_shift, align_margin), quoka_repeat, quoka_margin, the
 * beta fit, value_ridge, ridge_to, whether the per-head choice is active (the default resolved by
 * method) and, only when it is, val_frac, choice_margin and refit_all; then, each only when set,
 * the later fields of recipe.c (refq_bf16, arena_dtype, no_repeat, the partial repeat, and the chat
 * template's digest: name, 0, 's', its 32 hex digits).
 * Every field is always hashed (also at its default), so a changed default changes the digest.
 * Adding a parameter that changes bytes is one line in recipe.c (and a new digest for every file).
 */
#ifndef KF_RECIPE_H
#define KF_RECIPE_H

#include "compactor/compact.h"
#include "formats/kvf.h"

/* n_head_budgets: n_layers * kv_heads, the length of p->solver.head_budgets (ignored when NULL). */
void kf_recipe_digest(const kf_compact_params *p, kf_dtype dtype, int64_t n_head_budgets,
                      char out[KVF_DIGEST_LEN + 1]);

#endif
