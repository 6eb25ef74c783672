#include "compactor/compact.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compactor/diag.h"
#include "compactor/fold.h"
#include "compactor/refq.h"
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
    p.max_head_ratio = 0.75;
    p.quoka_margin = 16;
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
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


/* ---- per-head choice (issue 12) ---- */

static const double kAlphaGrid[] = {0, 1e-3, 1e-2, 1e-1};
/* times lambda_rel; 0.1x was dropped: its long u (keys moved by beta sqrt(d) u) made the folded keys
 * so large that rounding the cache to bf16 moved the records model's logits by 7 (test_e2e) */
static const double kLambdaGrid[] = {1, 10};


/* The validation split of the sampled positions: n_val of them, probe positions first (drawn
 * evenly when there are more than needed), then repeat positions; context rows never (they have
 * no prompt of their own to append). is_val [n_pos] is filled; returns the count. */
static int64_t pick_validation(int64_t n_pos, const uint8_t *kind, double frac, uint64_t seed, uint8_t *is_val) {
    int64_t n_elig = 0;
    memset(is_val, 0, (size_t)n_pos);
    for (int64_t k = 0; k < n_pos; k++)
        n_elig += kind[k] != KF_REFQ_CONTEXT;
    int64_t want = (int64_t)llround(frac * (double)n_elig);
    if (n_elig < 10 || want < 1 || want >= n_elig)
        return 0; /* too few queries to split */
    for (int pass = 0; pass < 2 && want > 0; pass++) { /* probes, then the rest */
        int64_t n_cand = 0;
        for (int64_t k = 0; k < n_pos; k++)
            n_cand += kind[k] != KF_REFQ_CONTEXT && !is_val[k] && (pass == 1 || kind[k] == KF_REFQ_PROBE);
        const int64_t take = want < n_cand ? want : n_cand;
        int64_t *idx = malloc(sizeof(int64_t) * (size_t)(take ? take : 1));
        if (!idx || kf_sample_indices(n_cand, take, seed + 77 + (uint64_t)pass, idx) != 0) {
            free(idx);
            memset(is_val, 0, (size_t)n_pos);
            return -1;
        }
        int64_t c = 0, t = 0;
        for (int64_t k = 0; k < n_pos && t < take; k++)
            if (kind[k] != KF_REFQ_CONTEXT && !is_val[k] && (pass == 1 || kind[k] == KF_REFQ_PROBE)) {
                if (idx[t] == c) {
                    is_val[k] = 2; /* not a candidate again in this pass */
                    t++;
                }
                c++;
            }
        want -= take;
        free(idx);
    }
    int64_t n = 0;
    for (int64_t k = 0; k < n_pos; k++)
        n += (is_val[k] = is_val[k] ? 1 : 0);
    return n;
}

/* out [t, d] = the kept keys folded along u (fitted on q [R, d] with lambda); fi->ok = 0: none. */
static kf_status fold_selection(const float *q, int R, int d, float scale, double lambda, const float *kc,
                                const float *beta, int t, float *u, float *out, kf_fold_info *fi, kf_error *err) {
    KF_TRY(kf_fold_direction(q, R, d, lambda, u, fi, err));
    if (fi->ok)
        kf_fold_keys(kc, d, beta, t, d, scale, u, out, d);
    return KF_OK;
}

/* Score every value refit alpha of one (keys, bias) candidate; updates best. */
static kf_status try_alphas(const kf_am_head *htr, const float *Ytr, const float *keys, const float *bias, int t,
                            const float *v0, kf_method method, double lambda, double penalty, kf_val_head *val,
                            float *vals, kf_head_pick *best, kf_error *err) {
    kf_value_gram gm;
    KF_TRY(kf_value_gram_build(htr->q, htr->R, htr->d, htr->scale, keys, htr->d, bias, t, Ytr, &gm, err));
    kf_status rc = KF_OK;
    for (size_t a = 0; a < sizeof kAlphaGrid / sizeof *kAlphaGrid && rc == KF_OK; a++) {
        rc = kf_value_gram_solve(&gm, kAlphaGrid[a], v0, htr->d, vals, NULL, err);
        const kf_kv_block cb = {keys, vals, (size_t)htr->d, bias, t};
        const double e = rc == KF_OK ? kf_val_err(val, &cb) * penalty : NAN;
        if (rc == KF_OK && isnan(e))
            rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory in the per-head validation");
        if (rc == KF_OK && e < best->err)
            *best = (kf_head_pick){method, lambda, kAlphaGrid[a], e};
    }
    kf_value_gram_free(&gm);
    return rc;
}

kf_status kf_choose_head(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr,
                         const int32_t *sel, int t, const float *kc, const float *vo, kf_val_head *val, uint64_t seed,
                         kf_head_pick *best, kf_error *err) {
    const int d = htr->d;
    float *beta = malloc(sizeof(float) * (size_t)(t ? t : 1)), *u = malloc(sizeof(float) * (size_t)d);
    float *keys = malloc(sizeof(float) * (size_t)(t ? t : 1) * d), *vals = malloc(sizeof(float) * (size_t)(t ? t : 1) * d);
    const float *v0 = p->ridge_to == KF_RIDGE_TO_ORIG ? vo : NULL;
    *best = (kf_head_pick){KF_METHOD_KEEP, p->lambda_rel, 0, INFINITY};
    kf_status rc = KF_OK;
    if (!beta || !u || !keys || !vals) {
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the per-head choice (t %d)", t);
        goto out;
    }
    if (p->method == KF_METHOD_AM || p->method == KF_METHOD_FOLD) {
        if ((rc = kf_am_fit_beta_ex(htr, ttr, sel, t, seed, p->beta_fit, beta, NULL, err)) != KF_OK)
            goto out;
        if (p->method == KF_METHOD_AM &&
            (rc = try_alphas(htr, ttr->Y, kc, beta, t, v0, KF_METHOD_AM, 0, 1 + p->choice_margin, val, vals, best, err)) != KF_OK)
            goto out;
        for (size_t li = 0; p->method == KF_METHOD_FOLD && li < sizeof kLambdaGrid / sizeof *kLambdaGrid; li++) {
            const double lambda = kLambdaGrid[li] * p->lambda_rel;
            kf_fold_info fi;
            if ((rc = fold_selection(htr->q, htr->R, d, htr->scale, lambda, kc, beta, t, u, keys, &fi, err)) != KF_OK ||
                (fi.ok && (rc = try_alphas(htr, ttr->Y, keys, NULL, t, v0, KF_METHOD_FOLD, lambda, 1 + p->choice_margin, val, vals, best,
                                           err)) != KF_OK))
                goto out;
        }
    }
    if (p->method != KF_METHOD_KEEP &&
        (rc = try_alphas(htr, ttr->Y, kc, NULL, t, v0, KF_METHOD_DROP, p->lambda_rel, 1, val, vals, best, err)) != KF_OK)
        goto out;
    const kf_kv_block kb = {kc, vo, (size_t)d, NULL, t};
    const double e = kf_val_err(val, &kb);
    if (isnan(e))
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory in the per-head validation");
    else if (e < best->err)
        *best = (kf_head_pick){KF_METHOD_KEEP, p->lambda_rel, 0, e};
out:
    free(beta), free(u), free(keys), free(vals);
    return rc;
}

/* The appended prompts of the validation rows: per source i >= 1 its keys and values
 * [n_layers, app_n[i], kv_heads * d] from the forward pass that produced its queries. */
typedef struct {
    float **k, **v;
    int64_t *n;
    int n_src;
} appended_kv;

static void appended_free(appended_kv *a) {
    for (int i = 0; a->k && i < a->n_src; i++) {
        free(a->k[i]);
        free(a->v[i]);
    }
    free(a->k), free(a->v), free(a->n);
    memset(a, 0, sizeof *a);
}

/* Split one head's rows into training and validation: training q/targets gathered into tr_q,
 * tr (m, y, Y), validation queries into val_q with weights, appended blocks and visible counts. */
typedef struct {
    float *tr_q, *tr_m, *tr_y, *tr_Y, *val_q;
    double *val_w;
    const kf_kv_block **val_app;
    int *val_vis;
    kf_kv_block *blocks; /* [n_src] for the current head */
    int64_t n_tr, n_val;
} head_split;

static void split_free(head_split *s) {
    free(s->tr_q), free(s->tr_m), free(s->tr_y), free(s->tr_Y), free(s->val_q), free(s->val_w);
    free((void *)s->val_app), free(s->val_vis), free(s->blocks);
    memset(s, 0, sizeof *s);
}

static int split_alloc(head_split *s, int64_t R, int64_t n_val, int d, int n_src) {
    memset(s, 0, sizeof *s);
    const int64_t n_tr = R - n_val;
    s->tr_q = malloc(sizeof(float) * (size_t)n_tr * d);
    s->tr_m = malloc(sizeof(float) * (size_t)n_tr);
    s->tr_y = malloc(sizeof(float) * (size_t)n_tr);
    s->tr_Y = malloc(sizeof(float) * (size_t)n_tr * d);
    s->val_q = malloc(sizeof(float) * (size_t)n_val * d);
    s->val_w = malloc(sizeof(double) * (size_t)n_val);
    s->val_app = malloc(sizeof(*s->val_app) * (size_t)n_val);
    s->val_vis = malloc(sizeof(int) * (size_t)n_val);
    s->blocks = calloc((size_t)n_src, sizeof *s->blocks);
    return s->tr_q && s->tr_m && s->tr_y && s->tr_Y && s->val_q && s->val_w && s->val_app && s->val_vis && s->blocks
               ? 0
               : -1;
}

/* pos_src/pos_local [n_pos]: source and index inside it of every sampled position. */
static void split_head(head_split *s, const kf_refq *rq, const float *q, const kf_am_targets *tg, const uint8_t *is_val,
                       const int *pos_src, const int64_t *pos_local, const appended_kv *ap, int layer, int g) {
    const int d = rq->head_dim;
    const size_t row = (size_t)rq->kv_heads * d;
    for (int i = 1; i < ap->n_src; i++)
        if (ap->k[i])
            s->blocks[i] = (kf_kv_block){ap->k[i] + (size_t)layer * ap->n[i] * row + (size_t)g * d,
                                         ap->v[i] + (size_t)layer * ap->n[i] * row + (size_t)g * d, row, NULL,
                                         (int)ap->n[i]};
    int64_t n_probe = 0, nt = 0, nv = 0;
    for (int64_t k = 0; k < rq->n_pos; k++)
        n_probe += is_val[k] && rq->source[k] == KF_REFQ_PROBE;
    const int64_t n_val_pos = s->n_val / rq->group, n_other = n_val_pos - n_probe;
    for (int j = 0; j < rq->group; j++)
        for (int64_t k = 0; k < rq->n_pos; k++) {
            const int64_t r = (int64_t)j * rq->n_pos + k;
            if (!is_val[k]) {
                memcpy(s->tr_q + (size_t)nt * d, q + (size_t)r * d, sizeof(float) * d);
                memcpy(s->tr_Y + (size_t)nt * d, tg->Y + (size_t)r * d, sizeof(float) * d);
                s->tr_m[nt] = tg->m[r], s->tr_y[nt] = tg->y[r];
                nt++;
                continue;
            }
            memcpy(s->val_q + (size_t)nv * d, q + (size_t)r * d, sizeof(float) * d);
            const int probe = rq->source[k] == KF_REFQ_PROBE;
            /* probe rows weigh half of the total when there are both kinds */
            s->val_w[nv] = n_probe && n_other ? 0.5 / (double)(probe ? n_probe : n_other) : 1.0;
            s->val_app[nv] = &s->blocks[pos_src[k]];
            s->val_vis[nv] = (int)pos_local[k] + 1;
            nv++;
        }
}

/* The sources of reference queries, in the order their candidate rows are numbered. */
typedef struct {
    const int32_t *ids;
    int n;
    uint8_t kind;
    int32_t *ids_owned; /* repeat prompt = instruction + document */
} source;

/* The per-head choice's validation plan: every sampled position's source, index inside it and
 * kind; the held-out positions (is_val); and buffers for the appended prompts of the sources
 * that hold validation rows (filled by the forward passes). */
static kf_status plan_validation(const source *src, int n_sources, const int64_t *sample, int64_t n_pos,
                                 const kf_compact_params *p, int L, size_t row, uint8_t **kind, int **pos_src,
                                 int64_t **pos_local, uint8_t **is_val, int64_t *n_val, appended_kv *ap,
                                 kf_error *err) {
    *kind = malloc((size_t)(n_pos ? n_pos : 1));
    *is_val = malloc((size_t)(n_pos ? n_pos : 1));
    *pos_src = malloc(sizeof(int) * (size_t)(n_pos ? n_pos : 1));
    *pos_local = malloc(sizeof(int64_t) * (size_t)(n_pos ? n_pos : 1));
    ap->n_src = n_sources;
    ap->k = calloc((size_t)n_sources, sizeof *ap->k);
    ap->v = calloc((size_t)n_sources, sizeof *ap->v);
    ap->n = calloc((size_t)n_sources, sizeof *ap->n);
    if (!*kind || !*is_val || !*pos_src || !*pos_local || !ap->k || !ap->v || !ap->n)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation split");
    int64_t base = 0, k = 0;
    for (int i = 0; i < n_sources; i++) {
        for (; k < n_pos && sample[k] < base + src[i].n; k++) {
            (*pos_src)[k] = i;
            (*pos_local)[k] = sample[k] - base;
            (*kind)[k] = src[i].kind;
        }
        base += src[i].n;
    }
    *n_val = pick_validation(n_pos, *kind, p->val_frac, p->seed, *is_val);
    if (*n_val < 0)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation split");
    for (k = 0; k < n_pos; k++)
        if ((*is_val)[k] && (*pos_local)[k] + 1 > ap->n[(*pos_src)[k]])
            ap->n[(*pos_src)[k]] = (*pos_local)[k] + 1;
    for (int i = 1; i < n_sources; i++)
        if (ap->n[i] > 0) {
            ap->k[i] = malloc(sizeof(float) * (size_t)L * ap->n[i] * row);
            ap->v[i] = malloc(sizeof(float) * (size_t)L * ap->n[i] * row);
            if (!ap->k[i] || !ap->v[i])
                return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation prompts' keys");
        }
    return KF_OK;
}

kf_status kf_compact(kf_model *m, const kf_prompt *prefix, const kf_prompt *doc, const kf_prompt *suffix,
                     const kf_compact_params *p, kf_compacted *out, kf_error *err) {
    return kf_compact_ex(m, NULL, prefix, doc, suffix, p, out, err);
}

kf_status kf_compact_ex(kf_model *m, const kf_compact_reuse *reuse, const kf_prompt *prefix, const kf_prompt *doc,
                        const kf_prompt *suffix, const kf_compact_params *p, kf_compacted *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    const kf_hfconfig *c = kf_model_config(m);
    const int L = c->n_layers, kvh = c->n_kv_heads, d = c->head_dim, nh = c->n_heads, G = nh / kvh;
    const int n_pre = prefix ? prefix->n : 0, n_doc = doc->n, n_suf = suffix ? suffix->n : 0;
    const int64_t D = (int64_t)n_pre + n_doc + n_suf;
    if (n_doc < 1)
        return kf_fail(err, KF_ERR_INVALID, "compact: the document is empty");
    if (!(p->budget > 0 && p->budget <= 1))
        return kf_fail(err, KF_ERR_INVALID, "compact: budget %g must be in (0, 1]", p->budget);
    if (p->max_queries < G)
        return kf_fail(err, KF_ERR_INVALID, "compact: max_queries %lld is below the group size %d",
                       (long long)p->max_queries, G);
    if ((unsigned)p->method > KF_METHOD_FOLD)
        return kf_fail(err, KF_ERR_INVALID, "compact: unknown method %d", (int)p->method);
    if (c->max_position_embeddings > 0 && D > c->max_position_embeddings)
        return kf_fail(err, KF_ERR_INVALID, "compact: %lld context tokens exceed the model's %d positions",
                       (long long)D, c->max_position_embeddings);
    const int64_t shared = reuse && reuse->parent ? reuse->shared : 0;
    if (shared < 0 || shared >= D || (shared > 0 && (!reuse->arena || shared > reuse->parent->len)))
        return kf_fail(err, KF_ERR_INVALID, "compact: cannot share %lld of %lld context tokens (parent holds %lld)",
                       (long long)shared, (long long)D, reuse && reuse->parent ? (long long)reuse->parent->len : 0LL);
    if (reuse && reuse->keep && !reuse->arena)
        return kf_fail(err, KF_ERR_INVALID, "compact: keeping the context's pages needs the caller's arena");
    if (shared > 0 && p->use_context_queries)
        return kf_fail(err, KF_ERR_INVALID, "compact: context queries need the whole context computed (shared %lld)",
                       (long long)shared);

    int t = (int)floor(p->budget * n_doc);
    t = t < 1 ? 1 : (t > n_doc ? n_doc : t);
    /* Per-head budgets: C holds the largest head (vLLM has one length for every layer and head);
     * am pads the smaller heads with no-weight slots, the bias-free methods keep t keys in all. */
    int *budgets = malloc(sizeof(int) * (size_t)L * kvh);
    if (!budgets)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    head_budgets(p, L * kvh, n_doc, t, budgets);
    if (p->head_budgets) {
        t = 1;
        for (int i = 0; i < L * kvh; i++)
            t = budgets[i] > t ? budgets[i] : t;
    }
    const int64_t C = n_pre + (int64_t)t + n_suf;
    const float scale = 1.0f / sqrtf((float)d);

    /* ---- plan the reference-query sources and the subsample ---- */
    const int n_sources = 2 + p->n_probes;
    source *src = calloc((size_t)n_sources, sizeof *src);
    int32_t *ctx_ids = malloc(sizeof(int32_t) * (size_t)D);
    kf_status rc = KF_OK;
    kf_arena own_arena = {0};
    kf_arena *const ar = reuse && reuse->arena ? reuse->arena : &own_arena;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_refq rq = {0};
    int64_t *sample = NULL;
    int32_t *rows = NULL;
    float **qbuf = NULL;
    float *K = NULL, *V = NULL;
    int32_t *sel = NULL;
    float *beta = NULL, *kfold = NULL, *vals = NULL, *qsub = NULL, *kc = NULL, *vo = NULL;
    uint8_t *pos_kind = NULL, *is_val = NULL;
    int *pos_src = NULL;
    int64_t *pos_local = NULL, n_val_pos = 0;
    appended_kv ap = {0};
    head_split sp = {0};
    const int choice = kf_head_choice_active(p);
    if (!src || !ctx_ids) {
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
        goto out;
    }
    if (n_pre)
        memcpy(ctx_ids, prefix->ids, sizeof(int32_t) * n_pre);
    memcpy(ctx_ids + n_pre, doc->ids, sizeof(int32_t) * n_doc);
    if (n_suf)
        memcpy(ctx_ids + n_pre + n_doc, suffix->ids, sizeof(int32_t) * n_suf);
    if (p->use_context_queries)
        src[0] = (source){doc->ids, n_doc, KF_REFQ_CONTEXT, NULL};
    if (p->repeat_instruction.n > 0) {
        const int n = p->repeat_instruction.n + n_doc;
        src[1].ids_owned = malloc(sizeof(int32_t) * (size_t)n);
        if (!src[1].ids_owned) {
            rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
            goto out;
        }
        memcpy(src[1].ids_owned, p->repeat_instruction.ids, sizeof(int32_t) * p->repeat_instruction.n);
        memcpy(src[1].ids_owned + p->repeat_instruction.n, doc->ids, sizeof(int32_t) * n_doc);
        src[1] = (source){src[1].ids_owned, n, KF_REFQ_REPEAT, src[1].ids_owned};
    }
    int64_t n_cand = 0, longest = 0;
    for (int i = 0; i < p->n_probes; i++)
        src[2 + i] = (source){p->probes[i].ids, p->probes[i].n, KF_REFQ_PROBE, NULL};
    for (int i = 0; i < n_sources; i++) {
        n_cand += src[i].n;
        if (i > 0 && src[i].n > longest)
            longest = src[i].n;
    }
    if (n_cand == 0) {
        rc = kf_fail(err, KF_ERR_INVALID,
                     "compact: no reference queries: give a repeat instruction, probes or context queries");
        goto out;
    }
    const int64_t cap_pos = p->max_queries / G;
    const int64_t n_pos = n_cand < cap_pos ? n_cand : cap_pos;
    sample = malloc(sizeof(int64_t) * (size_t)n_pos);
    rows = malloc(sizeof(int32_t) * (size_t)(n_pos ? n_pos : 1));
    qbuf = calloc((size_t)L, sizeof *qbuf);
    if (!sample || !rows || !qbuf || kf_sample_indices(n_cand, n_pos, p->seed, sample) != 0) {
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
        goto out;
    }
    if ((rc = kf_refq_init(&rq, L, kvh, d, G, n_pos, err)) != KF_OK)
        goto out;
    if (choice && (rc = plan_validation(src, n_sources, sample, n_pos, p, L, (size_t)kvh * d, &pos_kind, &pos_src, &pos_local, &is_val,
                                        &n_val_pos, &ap, err)) != KF_OK)
        goto out;
    /* capture buffers sized for the largest per-source count */
    int64_t max_rows = 0;
    {
        int64_t base = 0, k = 0;
        for (int i = 0; i < n_sources; i++) {
            int64_t cnt = 0;
            while (k + cnt < n_pos && sample[k + cnt] < base + src[i].n)
                cnt++;
            max_rows = cnt > max_rows ? cnt : max_rows;
            k += cnt;
            base += src[i].n;
        }
    }
    for (int l = 0; l < L; l++) {
        qbuf[l] = malloc(sizeof(float) * (size_t)(max_rows ? max_rows : 1) * nh * d);
        if (!qbuf[l]) {
            rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for query capture");
            goto out;
        }
    }

    /* ---- prefill the context, then each source on top of it ---- */
    double t0 = now_s();
    if (ar == &own_arena && (rc = kf_model_arena(m, ar, D + longest + KF_PAGE_TOKENS, err)) != KF_OK)
        goto out;
    int64_t base = 0, k = 0;
    for (int i = 0; i < n_sources; i++) {
        int n_rows = 0;
        const int64_t first = k;
        while (k < n_pos && sample[k] < base + src[i].n)
            rows[n_rows++] = (int32_t)(sample[k++] - base);
        if (i == 0) { /* the context prefill; its document rows are source 0 */
            for (int r = 0; r < n_rows; r++)
                rows[r] += n_pre;
            kf_forward_args fa = {.ids = ctx_ids + shared, .n_tokens = (int)(D - shared), .chunk = p->chunk,
                                  .capture_rows = rows, .n_capture_rows = n_rows, .queries = n_rows ? qbuf : NULL,
                                  .quoka = p->quoka};
            if (p->progress)
                p->progress(p->progress_ctx, "prefill", 0, D);
            if (shared > 0 && (rc = kf_seq_fork(ar, reuse->parent, shared, &seq, err)) != KF_OK)
                goto out;
            if ((rc = kf_model_forward(m, ar, &seq, &fa, err)) != KF_OK)
                goto out;
            out->stats.prefill_s = now_s() - t0;
            t0 = now_s();
        } else if (src[i].n > 0) {
            kf_forward_args fa = {.ids = src[i].ids, .n_tokens = src[i].n, .chunk = p->chunk, .capture_rows = rows,
                                  .n_capture_rows = n_rows, .queries = n_rows ? qbuf : NULL};
            kf_quoka_params rq_quoka;
            if (i == 1 && p->quoka && p->quoka_repeat) {
                /* the copy token at sequence index D + I + j reads document token j at n_pre + j */
                rq_quoka = *p->quoka;
                if (p->quoka_margin >= 0) {
                    rq_quoka.align_start = D + p->repeat_instruction.n;
                    rq_quoka.align_shift = D + p->repeat_instruction.n - n_pre;
                    rq_quoka.align_margin = p->quoka_margin;
                }
                fa.quoka = &rq_quoka;
            }
            if (p->progress)
                p->progress(p->progress_ctx, i == 1 ? "repeat" : "probes", i, n_sources);
            if ((rc = kf_model_forward(m, ar, &seq, &fa, err)) != KF_OK)
                goto out;
            for (int l = 0; ap.k && ap.k[i] && l < L && rc == KF_OK; l++) /* validation rows' prompts */
                rc = kf_seq_read_kv(ar, &seq, l, D, ap.n[i], ap.k[i] + (size_t)l * ap.n[i] * kvh * d,
                                    ap.v[i] + (size_t)l * ap.n[i] * kvh * d, err);
            if (rc != KF_OK)
                goto out;
            if ((rc = kf_seq_truncate(ar, &seq, D, err)) != KF_OK) /* KV rewind */
                goto out;
        }
        if (n_rows)
            kf_refq_store(&rq, qbuf, n_rows, first, src[i].kind);
        base += src[i].n;
    }
    out->stats.refq_s = now_s() - t0;
    out->stats.n_queries = rq.R;

    /* ---- per layer, per KV head ---- */
    out->n_layers = L;
    out->kv_heads = kvh;
    out->head_dim = d;
    out->D = D;
    out->C = C;
    out->n_prefix = n_pre;
    out->n_suffix = n_suf;
    out->t = t;
    out->method = p->method;
    out->budget = p->budget;
    out->lambda_rel = p->lambda_rel;
    const size_t row = (size_t)kvh * d;
    out->keys = malloc(sizeof(float) * (size_t)L * C * row);
    out->values = malloc(sizeof(float) * (size_t)L * C * row);
    out->beta = calloc((size_t)L * kvh * C, sizeof(float));
    out->u = calloc((size_t)L * kvh * d, sizeof(float));
    out->var_gain = calloc((size_t)L * kvh, sizeof(float));
    out->positions = malloc(sizeof(int32_t) * (size_t)L * kvh * C);
    K = malloc(sizeof(float) * (size_t)D * row);
    V = malloc(sizeof(float) * (size_t)D * row);
    sel = malloc(sizeof(int32_t) * (size_t)t);
    beta = malloc(sizeof(float) * (size_t)t);
    kfold = malloc(sizeof(float) * (size_t)t * d);
    vals = malloc(sizeof(float) * (size_t)t * d);
    qsub = p->fold_queries == KF_FOLD_ON_PROBES ? malloc(sizeof(float) * (size_t)rq.R * d) : NULL;
    kc = malloc(sizeof(float) * (size_t)t * d);
    vo = malloc(sizeof(float) * (size_t)t * d);
    out->head_method = malloc((size_t)L * kvh);
    out->head_alpha = calloc((size_t)L * kvh, sizeof(float));
    if (!out->keys || !out->values || !out->beta || !out->u || !out->positions || !K || !V || !sel ||
        !beta || !kfold || !vals || !kc || !vo || !out->head_method || !out->head_alpha ||
        (p->fold_queries == KF_FOLD_ON_PROBES && !qsub)) {
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the compacted cache");
        goto out;
    }
    if (n_val_pos > 0 && split_alloc(&sp, rq.R, n_val_pos * G, d, n_sources) != 0) {
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation split");
        goto out;
    }
    sp.n_val = n_val_pos * G;
    sp.n_tr = rq.R - sp.n_val;
    out->stats.n_val_queries = sp.n_val;
    int folded = 0;
    double var_sum = 0;
    for (int l = 0; l < L; l++) {
        if ((rc = kf_seq_read_kv(ar, &seq, l, 0, D, K, V, err)) != KF_OK)
            goto out;
        if (p->progress)
            p->progress(p->progress_ctx, "compact", l, L);
        float *ok = out->keys + (size_t)l * C * row, *ov = out->values + (size_t)l * C * row;
        /* prefix and suffix verbatim */
        memcpy(ok, K, sizeof(float) * n_pre * row);
        memcpy(ov, V, sizeof(float) * n_pre * row);
        memcpy(ok + (size_t)(n_pre + t) * row, K + (size_t)(n_pre + n_doc) * row, sizeof(float) * n_suf * row);
        memcpy(ov + (size_t)(n_pre + t) * row, V + (size_t)(n_pre + n_doc) * row, sizeof(float) * n_suf * row);
        for (int g = 0; g < kvh; g++) {
            float *hb = out->beta + ((size_t)l * kvh + g) * C;
            int32_t *hp = out->positions + ((size_t)l * kvh + g) * C;
            for (int i = 0; i < n_pre; i++)
                hp[i] = i;
            for (int i = 0; i < n_suf; i++)
                hp[n_pre + t + i] = (int32_t)(n_pre + n_doc + i);
            const float *q = kf_refq_rows(&rq, l, g);
            kf_am_head h = {.k = K + (size_t)n_pre * row + (size_t)g * d, .k_stride = row,
                            .v = V + (size_t)n_pre * row + (size_t)g * d, .v_stride = row,
                            .T = n_doc, .q = q, .R = (int)rq.R, .d = d, .scale = scale};
            kf_am_targets tg;
            double ts = now_s();
            if ((rc = kf_am_targets_compute(&h, p->score, &tg, err)) != KF_OK)
                goto out;
            /* am pads a smaller head with no-weight slots; the bias-free methods keep t keys */
            const int th = p->method == KF_METHOD_AM ? budgets[l * kvh + g] : t;
            rc = kf_am_select(tg.score, n_doc, th, sel, err);
            out->stats.select_s += now_s() - ts;
            for (int j = 0; rc == KF_OK && j < th; j++) { /* the kept keys and their original values */
                memcpy(kc + (size_t)j * d, h.k + (size_t)sel[j] * row, sizeof(float) * d);
                memcpy(vo + (size_t)j * d, h.v + (size_t)sel[j] * row, sizeof(float) * d);
            }
            kf_head_pick pick = {p->method, p->lambda_rel, p->value_ridge, 0};
            kf_am_head hf = h; /* the rows the final beta, u and values are fitted on */
            kf_am_targets tf = tg;
            if (rc == KF_OK && sp.n_val > 0) {
                ts = now_s();
                split_head(&sp, &rq, q, &tg, is_val, pos_src, pos_local, &ap, l, g);
                kf_am_head htr = h;
                htr.q = sp.tr_q, htr.R = (int)sp.n_tr;
                kf_am_targets ttr = {sp.tr_m, sp.tr_y, sp.tr_Y, NULL};
                const kf_kv_block orig = {h.k, h.v, row, NULL, n_doc};
                kf_val_head vh;
                rc = kf_val_head_init(&vh, sp.val_q, (int)sp.n_val, d, scale, sp.val_w, &orig, sp.val_app, sp.val_vis,
                                      err);
                if (rc == KF_OK) {
                    rc = kf_choose_head(p, &htr, &ttr, sel, th, kc, vo, &vh, p->seed + (uint64_t)(l * kvh + g), &pick,
                                        err);
                    kf_val_head_free(&vh);
                }
                if (!p->refit_all) /* ship the fit that was validated */
                    hf = htr, tf = ttr;
                out->stats.choice_s += now_s() - ts;
            }
            kf_method method = pick.method;
            if (rc == KF_OK && method != KF_METHOD_KEEP && method != KF_METHOD_DROP) {
                ts = now_s();
                rc = kf_am_fit_beta_ex(&hf, &tf, sel, th, p->seed + (uint64_t)(l * kvh + g), p->beta_fit, beta,
                                       &out->stats.solver, err);
                out->stats.beta_s += now_s() - ts;
            }
            const float *kk = kc; /* [th, d] keys the values are fitted for */
            const float *bias = NULL;
            float *u = out->u + ((size_t)l * kvh + g) * d;
            memset(u, 0, sizeof(float) * d); /* u = 0 unless folded */
            if (rc == KF_OK && method == KF_METHOD_FOLD) {
                ts = now_s();
                const float *fq = hf.q;
                int fR = hf.R;
                if (p->fold_queries == KF_FOLD_ON_PROBES) { /* rows of probe positions only */
                    fR = 0;
                    for (int j = 0; j < G; j++)
                        for (int64_t pp = 0; pp < rq.n_pos; pp++)
                            if (rq.source[pp] == KF_REFQ_PROBE)
                                memcpy(qsub + (size_t)fR++ * d, q + ((size_t)j * rq.n_pos + pp) * d, sizeof(float) * d);
                    fq = qsub;
                }
                kf_fold_info fi;
                rc = fold_selection(fq, fR, d, scale, pick.lambda, kc, beta, th, u, kfold, &fi, err);
                if (rc == KF_OK && fi.ok) {
                    kk = kfold;
                    folded++;
                    var_sum += fi.var_gain;
                    out->var_gain[l * kvh + g] = (float)fi.var_gain;
                } else if (rc == KF_OK) {
                    method = KF_METHOD_DROP; /* no fold direction: compact this head as drop */
                    memset(u, 0, sizeof(float) * d);
                    out->stats.fold_fallback_heads++;
                }
                out->stats.fold_s += now_s() - ts;
            }
            if (rc == KF_OK && method == KF_METHOD_AM)
                bias = beta;
            if (rc == KF_OK && method != KF_METHOD_KEEP) {
                ts = now_s();
                rc = kf_am_fit_values_ridge(hf.q, hf.R, d, scale, kk, d, bias, th, tf.Y, pick.alpha,
                                            p->ridge_to == KF_RIDGE_TO_ORIG ? vo : NULL, d, vals, &out->stats.solver,
                                            err);
                out->stats.values_s += now_s() - ts;
                out->stats.heads_ridged += pick.alpha > 0;
                out->head_alpha[l * kvh + g] = (float)pick.alpha;
            }
            if (rc == KF_OK) {
                out->head_method[l * kvh + g] = (uint8_t)method;
                out->stats.heads_by_method[method]++;
                for (int j = 0; j < t; j++) {
                    float *dk = ok + (size_t)(n_pre + j) * row + (size_t)g * d;
                    float *dv = ov + (size_t)(n_pre + j) * row + (size_t)g * d;
                    if (j >= th) { /* am padding: a slot that receives exactly no weight */
                        memset(dk, 0, sizeof(float) * d);
                        memset(dv, 0, sizeof(float) * d);
                        hb[n_pre + j] = -INFINITY;
                        hp[n_pre + j] = -1;
                        continue;
                    }
                    memcpy(dk, kk + (size_t)j * d, sizeof(float) * d);
                    memcpy(dv, (method == KF_METHOD_KEEP ? vo : vals) + (size_t)j * d, sizeof(float) * d);
                    hb[n_pre + j] = method == KF_METHOD_AM ? beta[j] : 0.0f;
                    hp[n_pre + j] = (int32_t)(n_pre + sel[j]);
                }
            }
            kf_am_targets_free(&tg);
            if (rc != KF_OK)
                goto out;
        }
    }
    out->stats.mean_var_gain = folded ? var_sum / folded : 0;
    /* the compacted frame: questions at C, C+1, ... see what they would see at D, D+1, ... */
    kf_compacted_set_frame(out, m, 1);

out:
    if (rc != KF_OK)
        kf_compacted_free(out);
    if (src) {
        free(src[1].ids_owned);
        free(src);
    }
    free(ctx_ids);
    if (rc == KF_OK && reuse && reuse->keep)
        *reuse->keep = seq; /* the caller now owns these pages */
    else
        kf_seq_release(ar, &seq);
    if (own_arena.storage)
        kf_arena_free(&own_arena);
    kf_refq_free(&rq);
    free(sample);
    free(rows);
    if (qbuf)
        for (int l = 0; l < L; l++)
            free(qbuf[l]);
    free(qbuf);
    free(K);
    free(V);
    free(budgets);
    free(sel);
    free(beta);
    free(kfold);
    free(vals);
    free(qsub);
    free(kc);
    free(vo);
    free(pos_kind);
    free(is_val);
    free(pos_src);
    free(pos_local);
    appended_free(&ap);
    split_free(&sp);
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
