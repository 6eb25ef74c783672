#include "compactor/compact_internal.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compactor/diag.h"
#include "compactor/fold.h"
#include "compactor/refq.h"
#include "compactor/refq_targets.h"
#include "kernels/cpu/cpu_kernels.h"


static const char *const kMethodNames[] = {"keep", "drop", "am", "fold"};

const char *kf_method_name(kf_method m) {
    return (unsigned)m < 4 ? kMethodNames[m] : "?";
}

int kf_method_parse(const char *name, kf_method *out) {
    for (int i = 0; i < 4; i++)
        if (strcmp(name, kMethodNames[i]) == 0) {
            *out = (kf_method)i;
            return 0;
        }
    return -1;
}

kf_compact_params kf_compact_params_default(void) {
    kf_compact_params p = {0};
    p.method = KF_METHOD_FOLD;
    p.budget = 0.1;
    p.score = KF_SCORE_RMS;
    p.lambda_rel = 1e-2;
    p.fold_queries = KF_FOLD_ON_ALL;
    p.max_queries = 50000;
    p.beta_fit = KF_BETA_AM;
    p.value_ridge = 0;
    p.ridge_to = KF_RIDGE_TO_ORIG;
    p.head_choice = KF_CHOICE_DEFAULT;
    p.val_frac = 0.2;
    p.refit_all = 1;
    p.choice_margin = 0.5;
    p.choice_rows = 6;
    p.max_head_ratio = 0.75;
    p.quoka_margin = 16;
    return p;
}



int kf_head_choice_active(const kf_compact_params *p) {
    if (p->method == KF_METHOD_KEEP)
        return 0;
    if (p->head_choice == KF_CHOICE_DEFAULT)
        return p->method == KF_METHOD_FOLD || p->method == KF_METHOD_AM;
    return p->head_choice == KF_CHOICE_ON;
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
    if (!p->head_budgets) {
        for (int i = 0; i < n_heads; i++)
            out[i] = t;
        return;
    }
    double *share = malloc(sizeof(double) * n_heads);
    char *capped = calloc((size_t)n_heads, 1);
    const double cap = p->max_head_ratio * T, total = (double)t * n_heads;
    for (int i = 0; i < n_heads; i++)
        share[i] = p->head_budgets[i] > 0 ? p->head_budgets[i] : 0;
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
    if (x->p.max_queries < x->G)
        return kf_fail(err, KF_ERR_INVALID, "compact: max_queries %lld is below the group size %d",
                       (long long)x->p.max_queries, x->G);
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
    const int64_t cap_pos = x->p.max_queries / x->G;
    const int64_t n_pos = n_cand < cap_pos ? n_cand : cap_pos;
    int64_t *sample = malloc(sizeof(int64_t) * (size_t)(n_pos ? n_pos : 1));
    x->rows = malloc(sizeof(int32_t) * (size_t)(n_pos ? n_pos : 1));
    kf_status rc = KF_OK;
    if (!sample || !x->rows || kf_sample_indices(n_cand, n_pos, x->p.seed, sample) != 0)
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    if (rc == KF_OK)
        rc = kf_refq_init_held(&x->rq, x->L, 1, x->kvh, x->d, x->G, n_pos, x->p.refq_bf16, err);
    if (rc == KF_OK)
        rc = kf_sources_targets_init(x, err);
    if (rc == KF_OK) {
        kf_sources_rows(x, sample, n_pos);
        if (x->first[1] > 0) /* the context's own rows, every layer: captured before the sources run */
            rc = kf_refq_init(&x->ctxq, x->L, x->kvh, x->d, x->G, x->first[1], x->p.refq_bf16, err);
    }
    if (rc == KF_OK && choice)
        rc = kf_plan_validation(x->src, x->n_sources, sample, n_pos, &x->p, (size_t)x->kvh * x->d, &x->pos_kind,
                                &x->pos_src, &x->pos_local, &x->is_val, &x->n_val_pos, &x->ap, err);
    if (rc == KF_OK && choice &&
        (!(x->tr_order = malloc(sizeof(int64_t) * (size_t)(n_pos ? n_pos * x->G : 1))) ||
         kf_choice_training_order(n_pos, x->G, x->pos_kind, x->is_val, x->p.seed, x->tr_order) < 0))
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the training rows' order");
    x->ap.fork = x->forks;
    int64_t src_tokens = 0;
    for (int i = 1; i < x->n_sources; i++)
        src_tokens += x->src[i].n;
    kf_progress_sink_init(&x->pg, &x->p, kf_model_config(x->m), x->n_pre, x->n_doc, x->n_suf, shared, src_tokens,
                          x->tg.m != NULL);
    if (rc == KF_OK && x->ar == &x->own_arena)
        rc = kf_model_arena_dtype(x->m, x->ar, kf_pages_for(x->D) * KF_PAGE_TOKENS, x->p.arena_dtype, err);
    else if (rc == KF_OK && x->ar->dtype != x->p.arena_dtype)
        rc = kf_fail(err, KF_ERR_MISMATCH, "compact: the caller's KV arena is %s, the parameters ask for %s",
                     kf_arena_dtype_name(x->ar->dtype), kf_arena_dtype_name(x->p.arena_dtype));
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
    if (w->p.head_budgets) {
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
                          .lambda_rel = x->p.lambda_rel};
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

/* Layer l's prefix and suffix, verbatim, with their positions; K, V [D, kvh * d]. */
static void variant_edges(const kf_compact_prep *x, variant_ws *w, int l, const float *K, const float *V) {
    kf_compacted *out = w->out;
    const size_t row = (size_t)x->kvh * x->d;
    const int n_pre = x->n_pre, n_suf = x->n_suf, t = w->t;
    float *ok = out->keys + (size_t)l * out->C * row, *ov = out->values + (size_t)l * out->C * row;
    memcpy(ok, K, sizeof(float) * n_pre * row);
    memcpy(ov, V, sizeof(float) * n_pre * row);
    memcpy(ok + (size_t)(n_pre + t) * row, K + (size_t)(n_pre + x->n_doc) * row, sizeof(float) * n_suf * row);
    memcpy(ov + (size_t)(n_pre + t) * row, V + (size_t)(n_pre + x->n_doc) * row, sizeof(float) * n_suf * row);
    for (int g = 0; g < x->kvh; g++) {
        int32_t *hp = out->positions + ((size_t)l * x->kvh + g) * out->C;
        for (int i = 0; i < n_pre; i++)
            hp[i] = i;
        for (int i = 0; i < n_suf; i++)
            hp[n_pre + t + i] = (int32_t)(n_pre + x->n_doc + i);
    }
}

/* ---- the solve over the KV heads of a layer, in parallel (backend.h's parallel_for) ---- */

/* One thread's scratch for the heads it solves, allocated once per kf_compact_solve. */
typedef struct {
    head_split sp;                 /* the head's validation split (when a variant chooses per head) */
    float *qsub;                   /* [R, d] probe rows (fold on probes), else NULL */
    int32_t *sel;                  /* [t_max] shared by the views: a head runs its variants in turn */
    float *beta;                   /* [t_max] */
    float *kfold, *vals, *kc, *vo; /* [t_max, d] each */
    variant_ws *w;                 /* [n] the thread's views of the variants (variant_ws) */
    kf_compacted *out;             /* [n] the views' outputs */
} thread_ws;

/* What one (head, variant) adds to the variant: its stats, folded and var_sum. */
typedef struct {
    kf_compact_stats st;
    int folded;
    double var_sum;
} head_add;

/* One layer's heads as a parallel_for job: item g solves head g on thread ws tw[thread]. */
typedef struct {
    kf_compact_prep *x;
    int n, l, any_choice;
    const float *K, *V;  /* [D, kvh * d] the layer's keys and values */
    thread_ws *tw;       /* [threads] */
    kf_status *rc;       /* [kvh] each head's status */
    kf_error *err;       /* [kvh] its cause */
    head_add *add;       /* [kvh, n] */
    atomic_int *heads_done; /* the layer's heads finished so far (progress) */
} layer_job;

static void thread_free(thread_ws *t) {
    kf_split_free(&t->sp);
    free(t->qsub), free(t->sel), free(t->beta), free(t->kfold), free(t->vals), free(t->kc), free(t->vo);
    free(t->w), free(t->out);
    memset(t, 0, sizeof *t);
}

/* Thread t's buffers for the largest of the n variants w and its views of them. */
static kf_status thread_init(const kf_compact_prep *x, const variant_ws *w, int n, int any_choice, thread_ws *t,
                             kf_error *err) {
    const int d = x->d;
    int tm = 1;
    for (int i = 0; i < n; i++)
        tm = w[i].t > tm ? w[i].t : tm;
    memset(t, 0, sizeof *t);
    t->sel = malloc(sizeof(int32_t) * (size_t)tm);
    t->beta = malloc(sizeof(float) * (size_t)tm);
    t->kfold = malloc(sizeof(float) * (size_t)tm * d);
    t->vals = malloc(sizeof(float) * (size_t)tm * d);
    t->kc = malloc(sizeof(float) * (size_t)tm * d);
    t->vo = malloc(sizeof(float) * (size_t)tm * d);
    t->w = calloc((size_t)n, sizeof *t->w);
    t->out = calloc((size_t)n, sizeof *t->out);
    if (x->p.fold_queries == KF_FOLD_ON_PROBES)
        t->qsub = malloc(sizeof(float) * (size_t)x->rq.R * d);
    if (!t->sel || !t->beta || !t->kfold || !t->vals || !t->kc || !t->vo || !t->w || !t->out ||
        (x->p.fold_queries == KF_FOLD_ON_PROBES && !t->qsub))
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the solve's per-thread buffers (t %d)", tm);
    if (any_choice) {
        if (kf_split_alloc(&t->sp, x->rq.R, x->n_val_pos * x->G, d, x->n_sources) != 0)
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation split");
        t->sp.n_val = x->n_val_pos * x->G;
        t->sp.n_tr = x->rq.R - t->sp.n_val;
    }
    for (int i = 0; i < n; i++) {
        t->w[i] = w[i];
        t->out[i] = *w[i].out;
        t->w[i].out = &t->out[i];
        t->w[i].sel = t->sel, t->w[i].beta = t->beta, t->w[i].kfold = t->kfold;
        t->w[i].vals = t->vals, t->w[i].kc = t->kc, t->w[i].vo = t->vo;
    }
    return KF_OK;
}

/* Item g of a layer_job: head g's shared work, then every variant on it (the first failing one
 * stops it); its stats go to add[g, :]. */
static void head_item(void *ctx, int g, int thread) {
    const layer_job *j = ctx;
    thread_ws *t = &j->tw[thread];
    for (int i = 0; i < j->n; i++) {
        memset(&t->out[i].stats, 0, sizeof t->out[i].stats);
        t->w[i].folded = 0, t->w[i].var_sum = 0;
    }
    head_shared hs;
    kf_status rc = kf_head_prepare(j->x, j->l, g, j->K, j->V, j->any_choice ? &t->sp : NULL, &hs, &j->err[g]);
    if (rc == KF_OK) {
        for (int i = 0; i < j->n && rc == KF_OK; i++)
            rc = kf_head_variant(j->x, &t->w[i], &hs, t->qsub, &j->err[g]);
        kf_head_release(&hs);
    }
    for (int i = 0; i < j->n; i++)
        j->add[(size_t)g * j->n + i] = (head_add){t->out[i].stats, t->w[i].folded, t->w[i].var_sum};
    j->rc[g] = rc;
    const int done = atomic_fetch_add(j->heads_done, 1) + 1;
    if (thread == 0 && done < j->x->kvh) /* thread 0 is the caller's: the layer's end is reported there */
        kf_progress_solve(&j->x->pg, j->l, done, j->x->kvh);
}

/* The variant's stats += one head's (head order: the sums one thread would make). */
static void head_merge(variant_ws *w, const head_add *a) {
    kf_compact_stats *s = &w->out->stats;
    s->select_s += a->st.select_s, s->beta_s += a->st.beta_s, s->values_s += a->st.values_s;
    s->fold_s += a->st.fold_s, s->choice_s += a->st.choice_s;
    s->fold_fallback_heads += a->st.fold_fallback_heads;
    s->heads_ridged += a->st.heads_ridged;
    for (int k = 0; k < 4; k++)
        s->heads_by_method[k] += a->st.heads_by_method[k];
    s->solver.beta_fallbacks += a->st.solver.beta_fallbacks;
    s->solver.value_fallbacks += a->st.solver.value_fallbacks;
    s->solver.failures += a->st.solver.failures;
    s->solver.beta_restarts += a->st.solver.beta_restarts;
    w->folded += a->folded;
    w->var_sum += a->var_sum;
}

/* Layer l: its K, V [D, kvh * d] read once, then its heads in parallel (each head's shared work,
 * then every variant), then their stats merged in head order; the first failing head's error. */
static kf_status solve_layer(kf_compact_prep *x, variant_ws *w, int n, int l, float *K, float *V, layer_job *j,
                             kf_error *err) {
    KF_TRY(kf_seq_read_kv(x->ar, &x->seq, l, 0, x->D, K, V, err));
    if (j->any_choice)
        KF_TRY(kf_appended_load(&x->src_ar, x->D, &x->ap, l, err));
    kf_progress_solve(&x->pg, l, 0, x->kvh);
    for (int i = 0; i < n; i++)
        variant_edges(x, &w[i], l, K, V);
    atomic_int heads_done = 0;
    j->l = l, j->K = K, j->V = V, j->heads_done = &heads_done;
    kf_backend_parallel_for(kf_model_backend(x->m), x->kvh, head_item, j);
    for (int g = 0; g < x->kvh; g++) {
        if (j->rc[g] != KF_OK) {
            if (err)
                *err = j->err[g];
            return j->rc[g];
        }
        for (int i = 0; i < n; i++)
            head_merge(&w[i], &j->add[(size_t)g * n + i]);
    }
    kf_progress_solve(&x->pg, l, x->kvh, x->kvh);
    return KF_OK;
}

/* What the per-layer hook of the sources' forward solves with. */
typedef struct {
    kf_compact_prep *x;
    variant_ws *w;
    int n;
    float *K, *V; /* [D, kvh * d] */
    layer_job *j;
} solve_hook;

/* kf_model_forward_layers' on_layer: every source's layer l is in the arena and its queries in the
 * pool; solve the layer's heads for every variant. */
static kf_status solve_on_layer(void *ctx, int l, kf_error *err) {
    solve_hook *h = ctx;
    if (h->x->ctxq.n_pos > 0)
        kf_context_rows_load(h->x, l);
    return solve_layer(h->x, h->w, h->n, l, h->K, h->V, h->j, err);
}

/* The job's per-head results and every thread's scratch (tw [threads], zeroed by the caller). */
static kf_status job_init(kf_compact_prep *x, const variant_ws *w, int n, int any_choice, int threads,
                          layer_job *j, kf_error *err) {
    j->x = x, j->n = n, j->any_choice = any_choice;
    j->rc = calloc((size_t)x->kvh, sizeof *j->rc);
    j->err = calloc((size_t)x->kvh, sizeof *j->err);
    j->add = calloc((size_t)x->kvh * n, sizeof *j->add);
    if (!j->rc || !j->err || !j->add)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    for (int t = 0; t < threads; t++)
        KF_TRY(thread_init(x, w, n, any_choice, &j->tw[t], err));
    return KF_OK;
}

static void job_free(layer_job *j, int threads) {
    for (int t = 0; j->tw && t < threads; t++)
        thread_free(&j->tw[t]);
    free(j->tw), free(j->rc), free(j->err), free(j->add);
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
    layer_job j = {.tw = calloc((size_t)threads, sizeof(thread_ws))};
    kf_status rc = !w || !K || !V || !j.tw ? kf_fail(err, KF_ERR_NOMEM, "compact: out of memory") : KF_OK;
    int any_choice = 0;
    for (int i = 0; i < n && rc == KF_OK; i++) {
        rc = variant_init(x, &v[i], &outs[i], &w[i], err);
        any_choice |= w[i].choice;
    }
    if (rc == KF_OK)
        rc = job_init(x, w, n, any_choice, threads, &j, err);
    solve_hook sh = {x, w, n, K, V, &j};
    const kf_layer_hook hook = {.on_layer = solve_on_layer, .ctx = &sh};
    if (rc == KF_OK)
        rc = kf_sources_run(x, &hook, err);
    for (int i = 0; i < n; i++) {
        if (rc == KF_OK) { /* the compacted frame: questions at C, C+1, ... see what they would at D, D+1, ... */
            outs[i].stats.refq_s = x->refq_s;
            outs[i].stats.mean_var_gain = w[i].folded ? w[i].var_sum / w[i].folded : 0;
            kf_compacted_set_frame(&outs[i], x->m, 1);
        } else {
            kf_compacted_free(&outs[i]);
        }
        if (w)
            variant_free(&w[i]);
    }
    job_free(&j, threads);
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
