/* compact.c — the compaction's orchestration: parameters, kf_compact_prepare (plan and prefill),
 * kf_compact_solve (the sources layer by layer, each layer's heads solved for every variant),
 * kf_compact_ex, the variants' budgets and outputs, the compacted cache's frame. The stages are in
 * sources.c, choice.c, head_solve.c and solve_pool.c (compact_internal.h). */
#include "compactor/compact.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact_internal.h"
#include "kernels/cpu/cpu_kernels.h"


kf_solver_params kf_solver_params_default(void) {
    return (kf_solver_params){.score = KF_SCORE_RMS, .lambda_rel = 1e-2, .fold_queries = KF_FOLD_ON_ALL,
                              .max_queries = 50000, .beta_fit = KF_BETA_AM, .value_ridge = 0,
                              .ridge_to = KF_RIDGE_TO_ORIG, .max_head_ratio = 0.75};
}

kf_choice_params kf_choice_params_default(void) {
    return (kf_choice_params){.head_choice = KF_CHOICE_DEFAULT,
                              .val_frac = 0.2,
                              .refit_all = KF_REFIT_VALUES,
                              .choice_margin = 0.5,
                              .choice_rows = 6,
                              .val_rows = 0.2,
                              .refit_rows = 8};
}

kf_run_params kf_run_params_default(void) {
    return (kf_run_params){.quoka_margin = 16};
}

kf_compact_params kf_compact_params_default(void) {
    kf_compact_params p = {0};
    p.method = KF_METHOD_FOLD;
    p.budget = 0.1;
    p.solver = kf_solver_params_default();
    p.choice = kf_choice_params_default();
    p.run = kf_run_params_default();
    return p;
}

int kf_head_choice_active(const kf_compact_params *p) {
    if (p->method == KF_METHOD_KEEP)
        return 0;
    if (p->choice.head_choice == KF_CHOICE_DEFAULT)
        return p->method == KF_METHOD_FOLD || p->method == KF_METHOD_AM;
    return p->choice.head_choice == KF_CHOICE_ON;
}

void kf_compacted_free(kf_compacted *c) {
    free(c->keys);
    free(c->values);
    free(c->beta);
    free(c->u);
    free(c->var_gain);
    free(c->positions);
    free(c->head_method);
    free(c->head_alpha);
    memset(c, 0, sizeof *c);
}

/* Per-head kept counts from a budget of t keys per head (uniform) or shares (AM's JSON form:
 * head h gets int(share_h * t * n_heads), capped at max_ratio * T, the excess spread over the
 * uncapped heads in proportion to their shares). */
static void head_budgets(const kf_compact_params *p, int n_heads, int T, int t, int *out) {
    if (!p->solver.head_budgets) {
        for (int i = 0; i < n_heads; i++)
            out[i] = t;
        return;
    }
    double *share = malloc(sizeof(double) * n_heads);
    char *capped = calloc((size_t)n_heads, 1);
    const double cap = p->solver.max_head_ratio * T, total = (double)t * n_heads;
    for (int i = 0; i < n_heads; i++)
        share[i] = p->solver.head_budgets[i] > 0 ? p->solver.head_budgets[i] : 0;
    for (int round = 0; round < n_heads; round++) { /* water-filling */
        double free_share = 0, fixed = 0;
        for (int i = 0; i < n_heads; i++) {
            if (capped[i])
                fixed += cap;
            else
                free_share += share[i];
        }
        int changed = 0;
        for (int i = 0; i < n_heads; i++)
            if (!capped[i] && free_share > 0 && share[i] / free_share * (total - fixed) > cap) {
                capped[i] = 1;
                changed = 1;
            }
        if (!changed) {
            for (int i = 0; i < n_heads; i++) {
                double want = capped[i] ? cap : (free_share > 0 ? share[i] / free_share * (total - fixed) : 0);
                int k = (int)want;
                out[i] = k < 1 ? 1 : (k > T ? T : k);
            }
            break;
        }
    }
    free(share);
    free(capped);
}

kf_status kf_compact(kf_model *m, const kf_prompt *prefix, const kf_prompt *doc, const kf_prompt *suffix,
                     const kf_compact_params *p, kf_compacted *out, kf_error *err) {
    return kf_compact_ex(m, NULL, prefix, doc, suffix, p, out, err);
}

/* ---- stage 1: plan and context prefill (kf_compact_prepare) ---- */

static kf_status check_variant(const kf_compact_variant *v, kf_error *err) {
    if (!(v->budget > 0 && v->budget <= 1))
        return kf_fail(err, KF_ERR_INVALID, "compact: budget %g must be in (0, 1]", v->budget);
    if ((unsigned)v->method > KF_METHOD_FOLD)
        return kf_fail(err, KF_ERR_INVALID, "compact: unknown method %d", (int)v->method);
    return KF_OK;
}

static kf_compact_params variant_params(const kf_compact_params *p, const kf_compact_variant *v) {
    kf_compact_params q = *p;
    q.method = v->method;
    q.budget = v->budget;
    return q;
}

static kf_status check_context(const kf_compact_prep *x, const kf_compact_reuse *reuse, int64_t shared,
                               kf_error *err) {
    const kf_hfconfig *c = kf_model_config(x->m);
    if (x->n_doc < 1)
        return kf_fail(err, KF_ERR_INVALID, "compact: the document is empty");
    if (x->p.solver.max_queries < x->G)
        return kf_fail(err, KF_ERR_INVALID, "compact: max_queries %lld is below the group size %d",
                       (long long)x->p.solver.max_queries, x->G);
    if (c->max_position_embeddings > 0 && x->D > c->max_position_embeddings)
        return kf_fail(err, KF_ERR_INVALID, "compact: %lld context tokens exceed the model's %d positions",
                       (long long)x->D, c->max_position_embeddings);
    if (shared < 0 || shared >= x->D || (shared > 0 && (!reuse->arena || shared > reuse->parent->len)))
        return kf_fail(err, KF_ERR_INVALID, "compact: cannot share %lld of %lld context tokens (parent holds %lld)",
                       (long long)shared, (long long)x->D, reuse && reuse->parent ? (long long)reuse->parent->len : 0LL);
    if (reuse && reuse->keep && !reuse->arena)
        return kf_fail(err, KF_ERR_INVALID, "compact: keeping the context's pages needs the caller's arena");
    if (shared > 0 && x->p.use_context_queries)
        return kf_fail(err, KF_ERR_INVALID, "compact: context queries need the whole context computed (shared %lld)",
                       (long long)shared);
    return KF_OK;
}

static kf_status check_repeat(const kf_compact_params *p, kf_error *err) {
    if (!(p->repeat_fraction >= 0 && p->repeat_fraction <= 1))
        return kf_fail(err, KF_ERR_INVALID, "compact: repeat_fraction %g must be in [0, 1]", p->repeat_fraction);
    if (p->repeat_spans < 0 || p->repeat_spans > KF_REPEAT_SPANS_MAX)
        return kf_fail(err, KF_ERR_INVALID, "compact: repeat_spans %d must be in [0, %d]", p->repeat_spans,
                       KF_REPEAT_SPANS_MAX);
    return KF_OK;
}

int64_t kf_compact_arena_pages(const kf_compact_params *p, int64_t n_ctx, int n_doc) {
    (void)p, (void)n_doc; /* the sources run in an arena of their own */
    return kf_pages_for(n_ctx);
}

/* Sources, subsample, validation plan, arena, then the context's prefill. */
static kf_status prepare_run(kf_compact_prep *x, const kf_compact_reuse *reuse, int64_t shared, const kf_prompt *doc,
                             const int32_t *ctx_ids, int choice, kf_error *err) {
    int64_t n_cand = 0;
    KF_TRY(kf_sources_plan(x, doc, x->src, &n_cand, err));
    const int64_t cap_pos = x->p.solver.max_queries / x->G;
    const int64_t n_pos = n_cand < cap_pos ? n_cand : cap_pos;
    int64_t *sample = malloc(sizeof(int64_t) * (size_t)(n_pos ? n_pos : 1));
    x->rows = malloc(sizeof(int32_t) * (size_t)(n_pos ? n_pos : 1));
    kf_status rc = KF_OK;
    if (!sample || !x->rows || kf_sample_indices(n_cand, n_pos, x->p.solver.seed, sample) != 0)
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    if (rc == KF_OK)
        rc = kf_refq_init_held(&x->rq, x->L, 1, x->kvh, x->d, x->G, n_pos, x->p.run.refq_bf16, err);
    if (rc == KF_OK)
        rc = kf_sources_targets_init(x, err);
    if (rc == KF_OK) {
        kf_sources_rows(x, sample, n_pos);
        if (x->first[1] > 0) /* the context's own rows, every layer: captured before the sources run */
            rc = kf_refq_init(&x->ctxq, x->L, x->kvh, x->d, x->G, x->first[1], x->p.run.refq_bf16, err);
    }
    if (rc == KF_OK && choice)
        rc = kf_plan_validation(x->src, x->n_sources, sample, n_pos, &x->p, &x->pos_kind, &x->pos_src,
                                &x->pos_local, &x->is_val, &x->n_val_pos, &x->ap, err);
    if (rc == KF_OK && choice && x->tg.m) /* the held-out rows' own prompts, from the source forwards */
        rc = kf_refq_targets_own_init(&x->tg, x->is_val, err);
    for (int i = 1; rc == KF_OK && choice && i < x->n_sources; i++)
        x->ap.n[i] = kf_source_fused(x, i) ? 0 : x->ap.n[i]; /* those the solve attends itself only */
    if (rc == KF_OK && choice)
        rc = kf_appended_alloc(&x->ap, (size_t)x->kvh * x->d, err);
    if (rc == KF_OK && choice &&
        (!(x->tr_order = malloc(sizeof(int64_t) * (size_t)(n_pos ? n_pos * x->G : 1))) ||
         kf_choice_training_order(n_pos, x->G, x->pos_kind, x->is_val, x->p.solver.seed, x->tr_order) < 0))
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the training rows' order");
    x->ap.fork = x->forks;
    int64_t src_tokens = 0;
    for (int i = 1; i < x->n_sources; i++)
        src_tokens += x->src[i].n;
    kf_progress_sink_init(&x->pg, &x->p, kf_model_config(x->m), x->n_pre, x->n_doc, x->n_suf, shared, src_tokens,
                          x->tg.m != NULL);
    if (rc == KF_OK && x->ar == &x->own_arena)
        rc = kf_model_arena_dtype(x->m, x->ar, kf_pages_for(x->D) * KF_PAGE_TOKENS, x->p.run.arena_dtype, err);
    else if (rc == KF_OK && x->ar->dtype != x->p.run.arena_dtype)
        rc = kf_fail(err, KF_ERR_MISMATCH, "compact: the caller's KV arena is %s, the parameters ask for %s",
                     kf_arena_dtype_name(x->ar->dtype), kf_arena_dtype_name(x->p.run.arena_dtype));
    if (rc == KF_OK)
        rc = kf_context_prefill(x, reuse, shared, ctx_ids, err);
    free(sample);
    return rc;
}

kf_status kf_compact_prepare(kf_model *m, const kf_compact_reuse *reuse, const kf_prompt *prefix,
                             const kf_prompt *doc, const kf_prompt *suffix, const kf_compact_params *p,
                             const kf_compact_variant *v, int n_variants, kf_compact_prep **out, kf_error *err) {
    *out = NULL;
    const kf_hfconfig *c = kf_model_config(m);
    kf_compact_prep *x = calloc(1, sizeof *x);
    if (!x)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    *x = (kf_compact_prep){.m = m, .p = *p, .L = c->n_layers, .kvh = c->n_kv_heads, .d = c->head_dim,
                           .nh = c->n_heads, .G = c->n_heads / c->n_kv_heads, .n_pre = prefix ? prefix->n : 0,
                           .n_doc = doc->n, .n_suf = suffix ? suffix->n : 0};
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX];
    const int n_spans = kf_repeat_spans(p, doc->n, off, len);
    x->n_rep = n_spans > 1 ? n_spans : 1;
    x->n_sources = 1 + x->n_rep + p->n_probes;
    x->D = (int64_t)x->n_pre + x->n_doc + x->n_suf;
    x->scale = 1.0f / sqrtf((float)x->d);
    x->ar = reuse && reuse->arena ? reuse->arena : &x->own_arena;
    kf_seq_init(&x->seq);
    const int64_t shared = reuse && reuse->parent ? reuse->shared : 0;
    int choice = 0; /* the validation split is planned when a variant needs it */
    kf_status rc = check_context(x, reuse, shared, err);
    if (rc == KF_OK)
        rc = check_repeat(p, err);
    for (int i = 0; rc == KF_OK && i < n_variants; i++) {
        const kf_compact_params vp = variant_params(p, &v[i]);
        rc = check_variant(&v[i], err);
        choice |= kf_head_choice_active(&vp);
    }
    x->src = calloc((size_t)x->n_sources, sizeof *x->src);
    x->first = calloc((size_t)x->n_sources + 1, sizeof *x->first);
    x->forks = calloc((size_t)x->n_sources, sizeof *x->forks);
    int32_t *ctx_ids = malloc(sizeof(int32_t) * (size_t)(x->D ? x->D : 1));
    if (rc == KF_OK && (!x->src || !x->first || !x->forks || !ctx_ids))
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    if (rc == KF_OK) {
        if (x->n_pre)
            memcpy(ctx_ids, prefix->ids, sizeof(int32_t) * x->n_pre);
        memcpy(ctx_ids + x->n_pre, doc->ids, sizeof(int32_t) * x->n_doc);
        if (x->n_suf)
            memcpy(ctx_ids + x->n_pre + x->n_doc, suffix->ids, sizeof(int32_t) * x->n_suf);
        rc = prepare_run(x, reuse, shared, doc, ctx_ids, choice, err);
    }
    free(ctx_ids);
    if (rc != KF_OK)
        kf_compact_prep_free(x, NULL);
    else
        *out = x;
    return rc;
}

void kf_compact_prep_free(kf_compact_prep *x, kf_seq *keep) {
    if (!x)
        return;
    kf_appended_free(&x->ap);
    kf_sources_arena_free(x);
    if (keep)
        *keep = x->seq; /* the caller now owns these pages */
    else
        kf_seq_release(x->ar, &x->seq);
    if (x->own_arena.storage)
        kf_arena_free(&x->own_arena);
    kf_refq_free(&x->rq);
    kf_refq_free(&x->ctxq);
    kf_refq_targets_free(&x->tg);
    for (int i = 0; x->tdst && i < x->n_sources; i++)
        kf_refq_targets_dst_free(&x->tdst[i]);
    free(x->tdst);
    for (int i = 1; x->src && i <= x->n_rep; i++)
        free(x->src[i].ids_owned);
    free(x->src), free(x->rows), free(x->first), free(x->forks);
    free(x->pos_kind);
    free(x->is_val);
    free(x->tr_order);
    free(x->pos_src);
    free(x->pos_local);
    free(x);
}

/* ---- stages 3-4: per layer and KV head the targets once, then every variant (kf_compact_solve) ---- */

static void variant_free(variant_ws *w) {
    free(w->budgets);
}

/* t and the per-head budgets: C holds the largest head (vLLM has one length for every layer and
 * head); am pads the smaller heads with no-weight slots, the bias-free methods keep t keys in all. */
static kf_status variant_budgets(const kf_compact_prep *x, variant_ws *w, kf_error *err) {
    const int n = x->L * x->kvh;
    int t = (int)floor(w->p.budget * x->n_doc);
    t = t < 1 ? 1 : (t > x->n_doc ? x->n_doc : t);
    if (!(w->budgets = malloc(sizeof(int) * (size_t)n)))
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    head_budgets(&w->p, n, x->n_doc, t, w->budgets);
    if (w->p.solver.head_budgets) {
        t = 1;
        for (int i = 0; i < n; i++)
            t = w->budgets[i] > t ? w->budgets[i] : t;
    }
    w->t = t;
    return KF_OK;
}

/* The output's header and arrays. */
static kf_status variant_init(const kf_compact_prep *x, const kf_compact_variant *v, kf_compacted *out,
                              variant_ws *w, kf_error *err) {
    KF_TRY(check_variant(v, err));
    w->p = variant_params(&x->p, v);
    w->out = out;
    w->choice = kf_head_choice_active(&w->p) && x->n_val_pos > 0;
    if (kf_head_choice_active(&w->p) && !x->is_val)
        return kf_fail(err, KF_ERR_INVALID, "compact: %s needs the per-head choice, not prepared for",
                       kf_method_name(v->method));
    KF_TRY(variant_budgets(x, w, err));
    const int L = x->L, kvh = x->kvh, d = x->d, t = w->t;
    const int64_t C = x->n_pre + (int64_t)t + x->n_suf;
    const size_t row = (size_t)kvh * d;
    *out = (kf_compacted){.n_layers = L, .kv_heads = kvh, .head_dim = d, .D = x->D, .C = C, .n_prefix = x->n_pre,
                          .n_suffix = x->n_suf, .t = t, .method = v->method, .budget = v->budget,
                          .lambda_rel = x->p.solver.lambda_rel};
    out->stats.prefill_s = x->prefill_s;
    out->stats.refq_s = x->refq_s;
    out->stats.n_queries = x->rq.R;
    out->stats.n_val_queries = w->choice ? x->n_val_pos * x->G : 0;
    out->keys = malloc(sizeof(float) * (size_t)L * C * row);
    out->values = malloc(sizeof(float) * (size_t)L * C * row);
    out->beta = calloc((size_t)L * kvh * C, sizeof(float));
    out->u = calloc((size_t)L * kvh * d, sizeof(float));
    out->var_gain = calloc((size_t)L * kvh, sizeof(float));
    out->positions = malloc(sizeof(int32_t) * (size_t)L * kvh * C);
    out->head_method = malloc((size_t)L * kvh);
    out->head_alpha = calloc((size_t)L * kvh, sizeof(float));
    if (!out->keys || !out->values || !out->beta || !out->u || !out->var_gain || !out->positions ||
        !out->head_method || !out->head_alpha)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the compacted cache");
    return KF_OK;
}

kf_status kf_compact_solve(kf_compact_prep *x, const kf_compact_variant *v, int n, kf_compacted *outs,
                           kf_error *err) {
    if (n <= 0)
        return KF_OK;
    memset(outs, 0, sizeof *outs * (size_t)n);
    const size_t row = (size_t)x->kvh * x->d;
    const int threads = kf_backend_threads(kf_model_backend(x->m));
    variant_ws *w = calloc((size_t)n, sizeof *w);
    float *K = malloc(sizeof(float) * (size_t)x->D * row), *V = malloc(sizeof(float) * (size_t)x->D * row);
    layer_job j = {0};
    kf_status rc = !w || !K || !V ? kf_fail(err, KF_ERR_NOMEM, "compact: out of memory") : KF_OK;
    int any_choice = 0;
    for (int i = 0; i < n && rc == KF_OK; i++) {
        rc = variant_init(x, &v[i], &outs[i], &w[i], err);
        any_choice |= w[i].choice;
    }
    if (rc == KF_OK)
        rc = kf_pool_init(x, w, n, any_choice, threads, &j, err);
    solve_hook sh = {x, w, n, K, V, &j};
    const kf_layer_hook hook = {.on_layer = kf_pool_on_layer, .ctx = &sh};
    if (rc == KF_OK)
        rc = kf_sources_run(x, &hook, err);
    for (int i = 0; i < n; i++) {
        if (rc == KF_OK) { /* the compacted frame: questions at C, C+1, ... see what they would at D, D+1, ... */
            outs[i].stats.refq_s = x->refq_s;
            outs[i].stats.ws_bytes = j.ws_bytes;
            for (int s = 0; s < j.n_ws; s++)
                outs[i].stats.ws_peak = (int64_t)j.ws[s].peak > outs[i].stats.ws_peak ? (int64_t)j.ws[s].peak
                                                                                       : outs[i].stats.ws_peak;
            outs[i].stats.mean_var_gain = w[i].folded ? w[i].var_sum / w[i].folded : 0;
            kf_compacted_set_frame(&outs[i], x->m, 1);
        } else {
            kf_compacted_free(&outs[i]);
        }
        if (w)
            variant_free(&w[i]);
    }
    kf_pool_free(&j, threads);
    free(w), free(K), free(V);
    return rc;
}

kf_status kf_compact_ex(kf_model *m, const kf_compact_reuse *reuse, const kf_prompt *prefix, const kf_prompt *doc,
                        const kf_prompt *suffix, const kf_compact_params *p, kf_compacted *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    const kf_compact_variant v = {p->method, p->budget};
    kf_compact_prep *x;
    KF_TRY(kf_compact_prepare(m, reuse, prefix, doc, suffix, p, &v, 1, &x, err));
    const kf_status rc = kf_compact_solve(x, &v, 1, out, err);
    kf_compact_prep_free(x, rc == KF_OK && reuse && reuse->keep ? reuse->keep : NULL);
    return rc;
}

void kf_compacted_set_frame(kf_compacted *c, const kf_model *m, int compacted) {
    if (compacted == c->rotated || c->C == c->D)
        return;
    const int64_t delta = compacted ? -(c->D - c->C) : c->D - c->C;
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)c->C);
    if (!pos)
        return;
    for (int64_t i = 0; i < c->C; i++)
        pos[i] = delta;
    const size_t row = (size_t)c->kv_heads * c->head_dim;
    for (int l = 0; l < c->n_layers; l++)
        kf_cpu_rope(c->keys + (size_t)l * c->C * row, row, (int)c->C, c->kv_heads, c->head_dim, pos,
                    kf_model_inv_freq(m));
    free(pos);
    c->rotated = compacted;
}

kf_status kf_compacted_attach(const kf_compacted *c, kf_arena *a, kf_seq *seq, kf_error *err) {
    kf_seq_init(seq);
    KF_TRY(kf_seq_reserve(a, seq, c->C, err));
    for (int l = 0; l < c->n_layers; l++) {
        const size_t off = (size_t)l * c->C * c->kv_heads * c->head_dim;
        kf_status rc = kf_seq_write_kv(a, seq, l, 0, c->C, c->keys + off, c->values + off, err);
        if (rc != KF_OK) {
            kf_seq_release(a, seq);
            return rc;
        }
    }
    seq->len = c->C;
    return KF_OK;
}

const float *const *kf_compacted_bias(const kf_compacted *c, const float **per_layer) {
    if (c->method != KF_METHOD_AM)
        return NULL;
    for (int l = 0; l < c->n_layers; l++)
        per_layer[l] = c->beta + (size_t)l * c->kv_heads * c->C;
    return per_layer;
}

int64_t kf_compacted_pos_offset(const kf_compacted *c) {
    return c->rotated ? 0 : c->D - c->C;
}
