/* recipe.c — kf_recipe_digest: the canonical bytes of a compaction recipe (see recipe.h). */
#include "compactor/recipe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

static void put_le(XXH3_state_t *st, uint64_t v, int n) {
    uint8_t b[8];
    for (int i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    XXH3_128bits_update(st, b, (size_t)n);
}

static void tag(XXH3_state_t *st, const char *name, char type) {
    XXH3_128bits_update(st, name, strlen(name) + 1);
    XXH3_128bits_update(st, &type, 1);
}

static void put_i(XXH3_state_t *st, const char *name, int64_t v) {
    tag(st, name, 'i');
    put_le(st, (uint64_t)v, 8);
}

static void put_f(XXH3_state_t *st, const char *name, double v) {
    tag(st, name, 'f');
    if (v == 0 || isnan(v))
        v = isnan(v) ? NAN : 0.0; /* -0.0 as 0.0, one NaN */
    uint64_t u;
    memcpy(&u, &v, 8);
    put_le(st, u, 8);
}

static void put_ids(XXH3_state_t *st, const char *name, const int32_t *ids, int64_t n) {
    tag(st, name, 'a');
    put_le(st, (uint64_t)n, 8);
    for (int64_t i = 0; i < n; i++)
        put_le(st, (uint32_t)ids[i], 4);
}

static void put_floats(XXH3_state_t *st, const char *name, const float *x, int64_t n) {
    if (!x) {
        tag(st, name, '-');
        return;
    }
    tag(st, name, 'F');
    put_le(st, (uint64_t)n, 8);
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] == 0 ? 0.0f : x[i];
        uint32_t u;
        memcpy(&u, &v, 4);
        put_le(st, u, 4);
    }
}

static void put_quoka(XXH3_state_t *st, const kf_quoka_params *q) {
    if (!q || q->mode == KF_PREFILL_DENSE) {
        tag(st, "quoka", '-');
        return;
    }
    put_i(st, "quoka.mode", q->mode);
    put_i(st, "quoka.n_q", q->n_q);
    put_i(st, "quoka.budget", q->budget);
    put_f(st, "quoka.budget_frac", q->budget_frac);
    put_i(st, "quoka.budget_min", q->budget_min);
    put_i(st, "quoka.n_sink", q->n_sink);
    put_i(st, "quoka.align_start", q->align_start);
    put_i(st, "quoka.align_shift", q->align_shift);
    put_i(st, "quoka.align_margin", q->align_margin);
}

/* The stored dtype as the digest numbers it (bf16 0, f16 1, f32 2, the order the file format once
 * had): kf_dtype's own numbers would change every digest, and so every file name. */
static int64_t dtype_code(kf_dtype d) {
    return d == KF_DTYPE_BF16 ? 0 : d == KF_DTYPE_F16 ? 1 : 2;
}

void kf_recipe_digest(const kf_compact_params *p, kf_dtype dtype, int64_t n_head_budgets,
                      char out[KVF_DIGEST_LEN + 1]) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    /* one line per field; keep the order (it is part of the digest) */
    put_i(&st, "kvf_version", KVF_VERSION);
    put_i(&st, "dtype", dtype_code(dtype));
    put_i(&st, "method", p->method);
    put_f(&st, "budget", p->budget);
    put_f(&st, "lambda_rel", p->solver.lambda_rel);
    put_i(&st, "score", p->solver.score);
    put_i(&st, "fold_queries", p->solver.fold_queries);
    put_i(&st, "max_queries", p->solver.max_queries);
    put_i(&st, "seed", (int64_t)p->solver.seed);
    put_i(&st, "use_context_queries", p->use_context_queries);
    put_ids(&st, "repeat_instruction", p->repeat_instruction.ids, p->repeat_instruction.n);
    put_i(&st, "n_probes", p->n_probes);
    for (int i = 0; i < p->n_probes; i++)
        put_ids(&st, "probe", p->probes[i].ids, p->probes[i].n);
    put_floats(&st, "head_budgets", p->solver.head_budgets, n_head_budgets);
    put_f(&st, "max_head_ratio", p->solver.max_head_ratio);
    put_i(&st, "chunk", p->run.chunk);
    put_quoka(&st, p->run.quoka);
    put_i(&st, "quoka_repeat", p->run.quoka_repeat);
    put_i(&st, "quoka_margin", p->run.quoka_margin);
    put_i(&st, "beta_fit", p->solver.beta_fit);
    put_f(&st, "value_ridge", p->solver.value_ridge);
    put_i(&st, "ridge_to", p->solver.ridge_to);
    const int choice = kf_head_choice_active(p); /* the default resolved, so "on" = default for fold */
    put_i(&st, "head_choice", choice);
    if (choice) {
        put_f(&st, "val_frac", p->choice.val_frac);
        put_f(&st, "choice_margin", p->choice.choice_margin);
        put_i(&st, "refit_all", p->choice.refit_all);
        put_f(&st, "choice_rows", p->choice.choice_rows); /* also marks the subsampled choice's bits */
        put_f(&st, "val_rows", p->choice.val_rows);
        /* only where it acts (the values refit): the earlier recipes keep their digests */
        if (p->choice.refit_rows > 0 && p->choice.refit_all == KF_REFIT_VALUES)
            put_f(&st, "refit_rows", p->choice.refit_rows);
    }
    if (p->run.refq_bf16) /* only when set: the fp32 default keeps every earlier recipe */
        put_i(&st, "refq_bf16", 1);
    if (p->run.arena_dtype != KF_DTYPE_F32) /* likewise: a bf16 arena rounds the prefill's K/V */
        put_i(&st, "arena_dtype", (int)p->run.arena_dtype);
    if (p->no_repeat) /* likewise: only a repeat other than the whole document's */
        put_i(&st, "no_repeat", 1);
    if (p->repeat_fraction > 0 && p->repeat_fraction < 1) {
        put_f(&st, "repeat_fraction", p->repeat_fraction);
        put_i(&st, "repeat_spans", p->repeat_spans > 0 ? p->repeat_spans : KF_REPEAT_SPANS_DEFAULT);
    }
    if (p->chat_template) { /* likewise: a bare-text cache's recipe is unchanged */
        XXH3_128bits_update(&st, "chat_template", sizeof "chat_template");
        XXH3_128bits_update(&st, "s", 1);
        XXH3_128bits_update(&st, p->chat_template, strlen(p->chat_template));
    }
    XXH128_hash_t h = XXH3_128bits_digest(&st);
    snprintf(out, KVF_DIGEST_LEN + 1, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
}
