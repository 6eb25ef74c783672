#include "compactor/compact.h"

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

static uint64_t span_mix(uint64_t z) { /* splitmix64's finalizer */
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int kf_repeat_spans(const kf_compact_params *p, int n_doc, int *off, int *len) {
    if (p->no_repeat || p->repeat_instruction.n <= 0 || n_doc <= 0)
        return 0;
    const double F = p->repeat_fraction;
    if (!(F > 0 && F < 1)) { /* 0 (unset), 1, or out of range: the whole document */
        off[0] = 0, len[0] = n_doc;
        return 1;
    }
    int K = p->repeat_spans > 0 ? p->repeat_spans : KF_REPEAT_SPANS_DEFAULT;
    K = K > KF_REPEAT_SPANS_MAX ? KF_REPEAT_SPANS_MAX : K;
    K = K > n_doc ? n_doc : K;
    for (int k = 0; k < K; k++) {
        const int b0 = (int)((int64_t)k * n_doc / K), seg = (int)((int64_t)(k + 1) * n_doc / K) - b0;
        int n = (int)llround(F * seg);
        n = n < 1 ? 1 : (n > seg ? seg : n);
        off[k] = b0 + (int)(span_mix(p->seed ^ span_mix((uint64_t)k + 0x5ba5)) % (uint64_t)(seg - n + 1));
        len[k] = n;
    }
    return K;
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


/* ---- per-head choice (docs/decisions/per-head-choice.md) ---- */

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

typedef struct {
    double key;
    int64_t r;
} keyed_row;

static int by_key_then_row(const void *a, const void *b) {
    const keyed_row *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return (x->r > y->r) - (x->r < y->r);
}

int64_t kf_choice_training_order(int64_t n_pos, int G, const uint8_t *kind, const uint8_t *is_val, uint64_t seed,
                                 int64_t *order) {
    const int64_t R = (int64_t)G * n_pos;
    keyed_row *kr = malloc(sizeof *kr * (size_t)(R ? R : 1));
    if (!kr)
        return -1;
    int64_t n = 0;
    for (uint8_t c = KF_REFQ_CONTEXT; c <= KF_REFQ_PROBE; c++) {
        const int64_t first = n;
        for (int64_t r = 0; r < R; r++)
            if (!is_val[r % n_pos] && kind[r % n_pos] == c)
                kr[n++].r = r;
        const int64_t m = n - first;
        for (int64_t i = m - 1; i > 0; i--) { /* Fisher-Yates */
            const int64_t j = (int64_t)(span_mix(seed ^ span_mix(0x7a11ULL + (uint64_t)c * 0x10001ULL + (uint64_t)i)) %
                                        (uint64_t)(i + 1));
            const int64_t tmp = kr[first + i].r;
            kr[first + i].r = kr[first + j].r, kr[first + j].r = tmp;
        }
        for (int64_t i = 0; i < m; i++)
            kr[first + i].key = ((double)i + 0.5) / (double)m;
    }
    qsort(kr, (size_t)n, sizeof *kr, by_key_then_row);
    for (int64_t i = 0; i < n; i++)
        order[i] = kr[i].r;
    free(kr);
    return n;
}

/* out [t, d] = the kept keys folded along u (fitted on q [R, d] with lambda); fi->ok = 0: none. */
static kf_status fold_selection(const kf_backend *be, const float *q, int R, int d, float scale, double lambda,
                                const float *kc, const float *beta, int t, float *u, float *out, kf_fold_info *fi,
                                kf_error *err) {
    KF_TRY(kf_fold_direction(be, q, R, d, lambda, u, fi, err));
    if (fi->ok)
        kf_fold_keys(kc, d, beta, t, d, scale, u, out, d);
    return KF_OK;
}

/* kf_choose_head's buffers, allocated once per head and reused by every candidate. */
typedef struct {
    float *beta, *u;     /* [t], [d] */
    float *keys, *vals;  /* [t, d] a candidate's keys (folded) and values */
    kf_gram_tiles tiles; /* [256, t] the normal equations' row tiles (logits included) */
    kf_value_gram gm;    /* [t, t], [t, d] a candidate's value normal equations (G NULL: none) */
} choice_ws;

static void choice_ws_free(choice_ws *w) {
    free(w->beta), free(w->u), free(w->keys), free(w->vals);
    kf_gram_tiles_free(&w->tiles);
    kf_value_gram_free(&w->gm);
}

/* gram: also the candidates' normal equations (am, fold). 0, or -1 when out of memory. */
static int choice_ws_alloc(choice_ws *w, const kf_backend *be, int t, int d, int gram) {
    const size_t t1 = (size_t)(t ? t : 1);
    memset(w, 0, sizeof *w);
    w->beta = malloc(sizeof(float) * t1), w->u = malloc(sizeof(float) * (size_t)d);
    w->keys = malloc(sizeof(float) * t1 * d), w->vals = malloc(sizeof(float) * t1 * d);
    if (!w->beta || !w->u || !w->keys || !w->vals || kf_gram_tiles_alloc(&w->tiles, t, d, 1) != 0 ||
        (gram && kf_value_gram_alloc(&w->gm, be, t, d) != 0))
        return -1;
    return 0;
}

/* Score every value refit alpha of one (keys, bias) candidate from its normal equations gm;
 * updates best. The candidate's attention weights on the validation rows are computed once for
 * the whole grid (they do not depend on the values) and stay in val for the caller (keep reuses
 * drop's). */
static kf_status score_alphas(const kf_value_gram *gm, const float *keys, const float *bias, int t, int d,
                              const float *v0, kf_method method, double lambda, double penalty, kf_val_head *val,
                              float *vals, kf_head_pick *best, kf_error *err) {
    const kf_kv_block cb = {keys, NULL, (size_t)d, bias, t};
    kf_status rc = kf_val_attend(val, &cb) == 0
                       ? KF_OK
                       : kf_fail(err, KF_ERR_NOMEM, "compact: out of memory in the per-head validation");
    for (size_t a = 0; a < sizeof kAlphaGrid / sizeof *kAlphaGrid && rc == KF_OK; a++) {
        rc = kf_value_gram_solve(gm, kAlphaGrid[a], v0, d, vals, NULL, err);
        const double e = rc == KF_OK ? kf_val_err_values(val, vals, (size_t)d) * penalty : NAN;
        if (rc == KF_OK && e < best->err)
            *best = (kf_head_pick){method, lambda, kAlphaGrid[a], e};
    }
    return rc;
}

/* score_alphas with the candidate's normal equations built on the training rows (into w->gm). */
static kf_status try_alphas(const kf_am_head *htr, const float *Ytr, const float *keys, const float *bias,
                            const float *v0, kf_method method, double lambda, double penalty, kf_val_head *val,
                            choice_ws *w, kf_head_pick *best, kf_error *err) {
    kf_value_gram_rebuild(htr->q, htr->R, htr->scale, keys, htr->d, bias, Ytr, &w->tiles, &w->gm);
    return score_alphas(&w->gm, keys, bias, w->gm.t, htr->d, v0, method, lambda, penalty, val, w->vals, best, err);
}

/* The fold candidates: u fitted on the training rows (their mean and covariance cov) for each
 * lambda of the grid, the kept keys folded along it (w->beta), every alpha scored. */
static kf_status try_folds(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr,
                           const kf_fold_cov *cov, const float *kc, int t, const float *v0, kf_val_head *val,
                           choice_ws *w, kf_head_pick *best, kf_error *err) {
    kf_status rc = KF_OK;
    for (size_t li = 0; li < sizeof kLambdaGrid / sizeof *kLambdaGrid && rc == KF_OK; li++) {
        const double lambda = kLambdaGrid[li] * p->lambda_rel;
        kf_fold_info fi;
        rc = kf_fold_direction_cov(cov, lambda, w->u, &fi, err);
        if (rc == KF_OK && fi.ok) {
            kf_fold_keys(kc, htr->d, w->beta, t, htr->d, htr->scale, w->u, w->keys, htr->d);
            rc = try_alphas(htr, ttr->Y, w->keys, NULL, v0, KF_METHOD_FOLD, lambda, 1 + p->choice_margin, val, w, best,
                            err);
        }
    }
    return rc;
}

/* The method's candidates (am, fold): beta fitted on the training rows from one pass that also
 * builds drop's normal equations (bn, dg, kept for the refit); fold's covariance first, while the
 * least is held (the memory formula's P1). */
static kf_status method_fits(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr, int t,
                             const float *kc, const float *v0, kf_val_head *val, uint64_t seed, choice_ws *w,
                             kf_beta_normal *bn, kf_value_gram *dg, kf_head_pick *best, kf_error *err) {
    kf_fold_cov cov = {0};
    if (p->method == KF_METHOD_FOLD)
        KF_TRY(kf_fold_cov_compute(htr->be, htr->q, htr->R, htr->d, &cov, err));
    kf_status rc = kf_kept_normal_build(htr, ttr, kc, t, &w->tiles, bn, dg, err);
    if (rc == KF_OK)
        rc = kf_am_fit_beta_normal(bn, seed, p->beta_fit, w->beta, NULL, err);
    if (rc == KF_OK && p->method == KF_METHOD_AM)
        rc = try_alphas(htr, ttr->Y, kc, w->beta, v0, KF_METHOD_AM, 0, 1 + p->choice_margin, val, w, best, err);
    else if (rc == KF_OK)
        rc = try_folds(p, htr, ttr, &cov, kc, t, v0, val, w, best, err);
    kf_fold_cov_free(&cov);
    return rc;
}

/* The choice's candidates other than keep: the method's and drop; keep's weights are drop's, left
 * in val. bn, dg: the training rows' normal equations (for the refit). */
static kf_status choose_fits(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr, int t,
                             const float *kc, const float *v0, kf_val_head *val, uint64_t seed, choice_ws *w,
                             kf_beta_normal *bn, kf_value_gram *dg, kf_head_pick *best, kf_error *err) {
    const int d = htr->d;
    if (p->method == KF_METHOD_AM || p->method == KF_METHOD_FOLD) {
        KF_TRY(method_fits(p, htr, ttr, t, kc, v0, val, seed, w, bn, dg, best, err));
    } else {
        if (kf_value_gram_alloc(dg, htr->be, t, d) != 0)
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for drop's normal equations (t %d)", t);
        kf_value_gram_rebuild(htr->q, htr->R, htr->scale, kc, d, NULL, ttr->Y, &w->tiles, dg);
    }
    return score_alphas(dg, kc, NULL, t, d, v0, KF_METHOD_DROP, p->lambda_rel, 1, val, w->vals, best, err);
}

void kf_choice_fits_free(kf_choice_fits *f) {
    kf_beta_normal_free(&f->beta);
    kf_value_gram_free(&f->drop);
}

kf_status kf_choice_refit_add(kf_choice_fits *f, int beta, const kf_am_head *parts, const kf_am_targets *tgs,
                              int n_parts, const float *kc, int t, kf_error *err) {
    if (beta ? !f->beta.G : !f->drop.G)
        return kf_fail(err, KF_ERR_INVALID, "compact: refit: the choice kept no normal equations for %s",
                       beta ? "beta" : "drop's values");
    for (int k = 0; k < n_parts; k++) {
        const kf_am_head *h = &parts[k];
        if (h->R == 0)
            continue;
        if (beta) {
            kf_beta_normal part;
            KF_TRY(kf_beta_normal_build(h, &tgs[k], kc, t, &part, err));
            kf_beta_normal_add(&f->beta, &part);
            kf_beta_normal_free(&part);
        } else {
            kf_value_gram part;
            KF_TRY(kf_value_gram_build(h->be, h->q, h->R, h->d, h->scale, kc, (size_t)h->d, NULL, t, tgs[k].Y, &part,
                                       err));
            kf_value_gram_add(&f->drop, &part);
            kf_value_gram_free(&part);
        }
    }
    return KF_OK;
}

int kf_choice_rows(const kf_compact_params *p, int R, int t) {
    if (!(p->choice_rows > 0))
        return R;
    const double want = ceil(p->choice_rows * t), n = want > KF_CHOICE_MIN_ROWS ? want : KF_CHOICE_MIN_ROWS;
    return n < R ? (int)n : R;
}

kf_status kf_choose_head(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr,
                         const int32_t *sel, int t, const float *kc, const float *vo, kf_val_head *val, uint64_t seed,
                         kf_head_pick *best, kf_choice_fits *keep, kf_error *err) {
    (void)sel; /* the kept keys are kc */
    const int d = htr->d;
    kf_am_head hsub = *htr; /* every candidate's fits: the training rows' first kf_choice_rows */
    hsub.R = kf_choice_rows(p, htr->R, t);
    const float *v0 = p->ridge_to == KF_RIDGE_TO_ORIG ? vo : NULL;
    kf_choice_fits f = {0};
    choice_ws w;
    *best = (kf_head_pick){KF_METHOD_KEEP, p->lambda_rel, 0, INFINITY};
    kf_status rc = KF_OK;
    const kf_kv_block kb = {kc, vo, (size_t)d, NULL, t};
    if (choice_ws_alloc(&w, htr->be, t, d, p->method == KF_METHOD_AM || p->method == KF_METHOD_FOLD) != 0)
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the per-head choice (t %d)", t);
    else if (p->method != KF_METHOD_KEEP)
        rc = choose_fits(p, &hsub, ttr, t, kc, v0, val, seed, &w, &f.beta, &f.drop, best, err);
    else if (kf_val_attend(val, &kb) != 0) /* keep alone: the kept keys' weights */
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory in the per-head validation");
    if (rc == KF_OK) {
        const double e = kf_val_err_values(val, vo, (size_t)d);
        if (e < best->err)
            *best = (kf_head_pick){KF_METHOD_KEEP, p->lambda_rel, 0, e};
    }
    f.rows = hsub.R;
    if (rc == KF_OK && keep)
        *keep = f; /* the refit adds the other training rows' part and the validation rows' */
    else
        kf_choice_fits_free(&f);
    choice_ws_free(&w);
    return rc;
}

/* The appended prompts of the validation rows: a source i >= 1 holding validation rows has its
 * tokens on its fork of the context, fork[i] (the context's D tokens shared, then the source's),
 * while the sources run layer by layer; k[i], v[i] [n[i], kv_heads * d] hold layer l of its first
 * n[i] tokens (appended_load, in the layer's hook, before the layer's heads). */
typedef struct {
    const kf_seq *fork; /* [n_src] the prep's forks (x->forks), not owned */
    float **k, **v;     /* [n_src] -> [n[i], kv_heads * d], NULL where n[i] = 0 */
    int64_t *n;         /* [n_src] */
    int n_src;
} appended_kv;

static void appended_free(appended_kv *ap) {
    for (int i = 0; ap->k && i < ap->n_src; i++) {
        free(ap->k[i]);
        free(ap->v[i]);
    }
    free(ap->k), free(ap->v), free(ap->n);
    memset(ap, 0, sizeof *ap);
}

/* Layer l's keys and values of every kept validation prompt into k, v (solve_layer's prologue). */
static kf_status appended_load(const kf_arena *a, int64_t D, appended_kv *ap, int l, kf_error *err) {
    for (int i = 1; i < ap->n_src; i++)
        if (ap->n[i] > 0)
            KF_TRY(kf_seq_read_kv(a, &ap->fork[i], l, D, ap->n[i], ap->k[i], ap->v[i], err));
    return KF_OK;
}

/* Split one head's rows into training and validation: training q/targets gathered into tr_q,
 * tr (m, y, Y), validation queries into val_q with weights, appended blocks and visible counts. */
typedef struct {
    float *tr_q, *tr_m, *tr_y, *tr_Y, *val_q;
    float *val_m, *val_y, *val_Y; /* the validation rows' targets (the refit adds their part) */
    double *val_w;
    const kf_kv_block **val_app;
    int *val_vis;
    kf_kv_block *blocks; /* [n_src] for the current head */
    int64_t n_tr, n_val;
} head_split;

static void split_free(head_split *s) {
    free(s->tr_q), free(s->tr_m), free(s->tr_y), free(s->tr_Y), free(s->val_q), free(s->val_w);
    free(s->val_m), free(s->val_y), free(s->val_Y);
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
    s->val_m = malloc(sizeof(float) * (size_t)(n_val ? n_val : 1));
    s->val_y = malloc(sizeof(float) * (size_t)(n_val ? n_val : 1));
    s->val_Y = malloc(sizeof(float) * (size_t)(n_val ? n_val : 1) * d);
    s->val_w = malloc(sizeof(double) * (size_t)n_val);
    s->val_app = malloc(sizeof(*s->val_app) * (size_t)n_val);
    s->val_vis = malloc(sizeof(int) * (size_t)n_val);
    s->blocks = calloc((size_t)n_src, sizeof *s->blocks);
    return s->tr_q && s->tr_m && s->tr_y && s->tr_Y && s->val_q && s->val_w && s->val_app && s->val_vis && s->blocks &&
                   s->val_m && s->val_y && s->val_Y
               ? 0
               : -1;
}

/* pos_src/pos_local [n_pos]: source and index inside it of every sampled position; ap holds the
 * layer of this head (appended_load). */
static void split_head(head_split *s, const kf_refq *rq, const float *q, const kf_am_targets *tg, const uint8_t *is_val,
                       const int64_t *tr_order, const int *pos_src, const int64_t *pos_local, const appended_kv *ap,
                       int g) {
    const int d = rq->head_dim;
    const size_t row = (size_t)rq->kv_heads * d;
    for (int i = 1; i < ap->n_src; i++)
        if (ap->k[i])
            s->blocks[i] = (kf_kv_block){ap->k[i] + (size_t)g * d, ap->v[i] + (size_t)g * d, row, NULL, (int)ap->n[i]};
    int64_t n_probe = 0, nv = 0;
    for (int64_t k = 0; k < rq->n_pos; k++)
        n_probe += is_val[k] && rq->source[k] == KF_REFQ_PROBE;
    const int64_t n_val_pos = s->n_val / rq->group, n_other = n_val_pos - n_probe;
    for (int64_t i = 0; i < s->n_tr; i++) { /* training rows in tr_order (kf_choice_training_order) */
        const int64_t r = tr_order[i];
        memcpy(s->tr_q + (size_t)i * d, q + (size_t)r * d, sizeof(float) * d);
        memcpy(s->tr_Y + (size_t)i * d, tg->Y + (size_t)r * d, sizeof(float) * d);
        s->tr_m[i] = tg->m[r], s->tr_y[i] = tg->y[r];
    }
    for (int j = 0; j < rq->group; j++)
        for (int64_t k = 0; k < rq->n_pos; k++) {
            const int64_t r = (int64_t)j * rq->n_pos + k;
            if (!is_val[k])
                continue;
            memcpy(s->val_q + (size_t)nv * d, q + (size_t)r * d, sizeof(float) * d);
            memcpy(s->val_Y + (size_t)nv * d, tg->Y + (size_t)r * d, sizeof(float) * d);
            s->val_m[nv] = tg->m[r], s->val_y[nv] = tg->y[r];
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
    int32_t *ids_owned; /* repeat prompt = instruction + document (or a span of it) */
    int64_t pos_offset; /* a repeat span's RoPE shift: the positions it has in the whole repeat */
    int doc_off;        /* a repeat span's first document token */
} source;

/* The per-head choice's validation plan: every sampled position's source, index inside it and
 * kind; the held-out positions (is_val); and, for the sources that hold validation rows, how many
 * of their tokens to keep (n) and one layer's buffers for them. */
static kf_status plan_validation(const source *src, int n_sources, const int64_t *sample, int64_t n_pos,
                                 const kf_compact_params *p, size_t row, uint8_t **kind, int **pos_src,
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
            ap->k[i] = malloc(sizeof(float) * (size_t)ap->n[i] * row);
            ap->v[i] = malloc(sizeof(float) * (size_t)ap->n[i] * row);
            if (!ap->k[i] || !ap->v[i])
                return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation prompts' keys");
        }
    return KF_OK;
}

kf_status kf_compact(kf_model *m, const kf_prompt *prefix, const kf_prompt *doc, const kf_prompt *suffix,
                     const kf_compact_params *p, kf_compacted *out, kf_error *err) {
    return kf_compact_ex(m, NULL, prefix, doc, suffix, p, out, err);
}

/* ---- stage 1: plan and context prefill (kf_compact_prepare) ---- */

struct kf_compact_prep {
    kf_model *m;
    kf_compact_params p;       /* the caller's; method and budget come from each variant */
    int L, kvh, d, G, nh, n_pre, n_doc, n_suf, n_sources;
    int n_rep;                 /* repeat sources src[1 .. n_rep] (at least one slot, empty without a repeat) */
    int64_t D;
    float scale;
    kf_arena own_arena;
    kf_arena *ar;              /* own_arena or the caller's */
    kf_seq seq;                /* the context's pages (D tokens) */
    source *src;               /* [n_sources] the reference sources: the context's rows, the repeat's spans
                                  (src[1 .. n_rep], ids owned), the probes */
    int32_t *rows;             /* [n_pos] each sampled position's row in its source's forward (source 0: in
                                  the context's) */
    int64_t *first;            /* [n_sources + 1] source i's sampled positions are first[i] .. first[i + 1] - 1 */
    kf_arena src_ar;           /* while the sources run: one layer of the context (src_ctx) and of their forks */
    kf_seq src_ctx;            /* the context's pages in src_ar (D tokens, the layer being run) */
    kf_seq *forks;             /* [n_sources] source i >= 1's fork of src_ctx in src_ar while the sources run */
    kf_refq rq;                /* reference queries, one layer at a time: [kvh][R, d] */
    kf_refq ctxq;              /* the context's own rows (use_context_queries), every layer: [L][kvh][G n_ctx, d] */
    kf_refq_targets tg;        /* AM's targets of the rows the source forwards fused, one layer at a time like
                                  rq (m NULL: none) */
    kf_refq_targets_dst *tdst; /* [n_sources] source i's per-layer destinations of them (NULL: no pool) */
    uint8_t *pos_kind, *is_val; /* validation plan, [n_pos] each (NULL: no variant needs it) */
    int64_t *tr_order;          /* [G n_pos] the training rows in the order split_head gathers them */
    int *pos_src;
    int64_t *pos_local, n_val_pos;
    appended_kv ap;
    double prefill_s, refq_s;
    kf_progress_sink pg;       /* the caller's progress calls (p.progress) and this document's totals */
};

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

/* src [n_sources]: the document's own queries, the repeat's spans (instruction + span, owned; the
 * whole document by default), the probes; *n_cand their total length. */
static kf_status plan_sources(const kf_compact_prep *x, const kf_prompt *doc, source *src, int64_t *n_cand,
                              kf_error *err) {
    const kf_compact_params *p = &x->p;
    const int I = p->repeat_instruction.n;
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX];
    if (p->use_context_queries)
        src[0] = (source){doc->ids, x->n_doc, KF_REFQ_CONTEXT, NULL, 0, 0};
    const int n_spans = kf_repeat_spans(p, x->n_doc, off, len);
    for (int k = 0; k < n_spans; k++) {
        const int n = I + len[k];
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
        if (!ids)
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
        memcpy(ids, p->repeat_instruction.ids, sizeof(int32_t) * I);
        memcpy(ids + I, doc->ids + off[k], sizeof(int32_t) * len[k]);
        src[1 + k] = (source){ids, n, KF_REFQ_REPEAT, ids, off[k], off[k]};
    }
    for (int i = 0; i < p->n_probes; i++)
        src[1 + x->n_rep + i] = (source){p->probes[i].ids, p->probes[i].n, KF_REFQ_PROBE, NULL, 0, 0};
    *n_cand = 0;
    for (int i = 0; i < x->n_sources; i++)
        *n_cand += src[i].n;
    if (*n_cand == 0)
        return kf_fail(err, KF_ERR_INVALID,
                       "compact: no reference queries: give a repeat instruction, probes or context queries");
    return KF_OK;
}

/* Where the forward pass captures the rows of sampled positions first .. of one source: straight
 * into the pool (kf_refq_capture_dst), qdst [L] for an fp32 pool or qdst_h [L] for a bf16 one. */
typedef struct {
    float **q;
    uint16_t **qh;
} capture_to;

static void capture_dst(const kf_refq *rq, int64_t first, capture_to *dst) {
    for (int l = 0; l < rq->n_layers; l++) {
        if (rq->q)
            dst->q[l] = kf_refq_capture_dst(rq, l, first);
        else
            dst->qh[l] = kf_refq_capture_dst_bf16(rq, l, first);
    }
}

/* fa's capture of n_rows rows into dst at rq's strides. */
static void capture_args(const kf_refq *rq, kf_forward_args *fa, int n_rows, const capture_to *dst) {
    fa->queries = n_rows && rq->q ? dst->q : NULL;
    fa->queries_bf16 = n_rows && rq->qh ? dst->qh : NULL;
    fa->queries_row_stride = (size_t)rq->head_dim;
    fa->queries_head_stride = kf_refq_head_stride(rq);
}

/* Layer l of the context's own rows (x->ctxq, captured by the prefill) into the pool's positions
 * 0 .. n - 1, which are theirs (source 0 comes first), before the layer is solved. */
static void context_rows_load(kf_compact_prep *x, int l) {
    const kf_refq *c = &x->ctxq;
    const size_t elem = x->rq.q ? sizeof(float) : sizeof(uint16_t), n = (size_t)c->n_pos * x->d;
    char *dst = x->rq.q ? (char *)kf_refq_capture_dst(&x->rq, l, 0) : (char *)kf_refq_capture_dst_bf16(&x->rq, l, 0);
    const char *src = c->q ? (const char *)kf_refq_capture_dst(c, l, 0) : (const char *)kf_refq_capture_dst_bf16(c, l, 0);
    for (int h = 0; h < x->nh; h++) /* [n_heads, n_pos, d] both, n_pos differing */
        memcpy(dst + (size_t)h * kf_refq_head_stride(&x->rq) * elem, src + (size_t)h * n * elem, n * elem);
}

/* Every source's capture rows (x->rows, x->first) from the sorted sample [n_pos], and the pool's
 * source kinds. */
static void plan_rows(kf_compact_prep *x, const int64_t *sample, int64_t n_pos) {
    int64_t base = 0, k = 0;
    for (int i = 0; i < x->n_sources; i++) {
        x->first[i] = k;
        for (; k < n_pos && sample[k] < base + x->src[i].n; k++) /* the context's rows: after its prefix */
            x->rows[k] = (int32_t)(sample[k] - base) + (i == 0 ? x->n_pre : 0);
        memset(x->rq.source + x->first[i], x->src[i].kind, (size_t)(k - x->first[i]));
        base += x->src[i].n;
    }
    x->first[x->n_sources] = k;
}

/* Prefill the context (from `shared` on, forking reuse->parent), capturing the document's sampled
 * rows (source 0) into x->ctxq, all layers (the pool holds one). */
static kf_status run_prefill(kf_compact_prep *x, const kf_compact_reuse *reuse, int64_t shared,
                             const int32_t *ctx_ids, capture_to *qdst, kf_error *err) {
    const double t0 = now_s();
    const int n_rows = (int)(x->first[1] - x->first[0]);
    capture_dst(&x->ctxq, 0, qdst);
    kf_forward_args fa = {.ids = ctx_ids + shared, .n_tokens = (int)(x->D - shared), .chunk = x->p.chunk,
                          .capture_rows = x->rows, .n_capture_rows = n_rows, .quoka = x->p.quoka};
    capture_args(&x->ctxq, &fa, n_rows, qdst);
    if (x->pg.fn)
        fa.progress = kf_progress_on_prefill, fa.progress_ctx = &x->pg;
    if (shared > 0)
        KF_TRY(kf_seq_fork(x->ar, reuse->parent, shared, &x->seq, err));
    KF_TRY(kf_model_forward(x->m, x->ar, &x->seq, &fa, err));
    x->prefill_s = now_s() - t0;
    return KF_OK;
}

/* ---- stage 2: the sources layer by layer, each layer solved (kf_compact_solve) ---- */

/* Where the attention is to be AM's targets of source i's captured rows (*fa is complete, quoka
 * included; it sees the whole document block): into the pool x->tg at the source's sampled
 * positions, which are then marked fused; nothing when the model cannot make them. */
static void source_targets(kf_compact_prep *x, int i, kf_forward_args *fa, kf_forward_targets *ft) {
    const int64_t first = x->first[i], n_rows = x->first[i + 1] - first;
    if (!x->tg.m || n_rows == 0 || !kf_model_targets_supported(x->m, fa))
        return;
    kf_refq_targets_capture(&x->tg, first, x->n_pre, &x->tdst[i], ft);
    fa->targets = ft;
    memset(x->tg.fused + first, 1, (size_t)n_rows);
}

/* 1 when source i is one of the repeat's spans. */
static int is_repeat(const kf_compact_prep *x, int i) {
    return i >= 1 && i <= x->n_rep;
}

/* The forward arguments of source i >= 1 (QUOKA window for the repeat), capturing into dst and,
 * where the model can, AM's targets through *ft. */
static void source_args(kf_compact_prep *x, int i, capture_to *dst, kf_quoka_params *qk, kf_forward_args *fa,
                        kf_forward_targets *ft) {
    const kf_compact_params *p = &x->p;
    const int n_rows = (int)(x->first[i + 1] - x->first[i]);
    *fa = (kf_forward_args){.ids = x->src[i].ids, .n_tokens = x->src[i].n, .chunk = p->chunk,
                            .capture_rows = x->rows + x->first[i], .n_capture_rows = n_rows,
                            .pos_offset = x->src[i].pos_offset};
    capture_dst(&x->rq, x->first[i], dst);
    capture_args(&x->rq, fa, n_rows, dst);
    if (is_repeat(x, i) && p->quoka && p->quoka_repeat) {
        /* the copy token at sequence index D + I + j reads document token o + j at n_pre + o + j
         * (o: the span's first document token, 0 for the whole repeat) */
        *qk = *p->quoka;
        if (p->quoka_margin >= 0) {
            qk->align_start = x->D + p->repeat_instruction.n;
            qk->align_shift = x->D + p->repeat_instruction.n - x->n_pre - x->src[i].doc_off;
            qk->align_margin = p->quoka_margin;
        }
        fa->quoka = qk;
    }
    source_targets(x, i, fa, ft);
}

/* Pages a source of n tokens run on a fork of the D-token context takes: its own pages past the
 * context's full ones (a partly filled last context page is copied on write). */
static int64_t fork_pages(int64_t D, int64_t n) {
    return kf_pages_for(D + n) - D / KF_PAGE_TOKENS;
}

/* The sources' own arena: pages of one layer (kf_arena_init_held), holding the context's layer
 * being run (x->src_ctx) and every source's fork of it; the sources never write the context's arena. */
static kf_status sources_arena(kf_compact_prep *x, kf_error *err) {
    int64_t pages = kf_pages_for(x->D);
    for (int i = 1; i < x->n_sources; i++)
        pages += x->src[i].n > 0 ? fork_pages(x->D, x->src[i].n) : 0;
    KF_TRY(kf_arena_init_held(&x->src_ar, kf_model_backend(x->m), x->L, 1, x->kvh, x->d, (int)pages, x->ar->dtype,
                              err)); /* the context's dtype: its pages are copied in byte for byte */
    KF_TRY(kf_seq_reserve(&x->src_ar, &x->src_ctx, x->D, err));
    x->src_ctx.len = x->D;
    return KF_OK;
}

static void sources_arena_free(kf_compact_prep *x) {
    for (int i = 0; x->forks && i < x->n_sources; i++)
        kf_seq_release(&x->src_ar, &x->forks[i]);
    if (x->src_ar.storage) {
        kf_seq_release(&x->src_ar, &x->src_ctx);
        kf_arena_free(&x->src_ar);
    }
}

/* K and V of page sp, layer slot of src, to page dp of dst (16 tokens: n elements of elem bytes each;
 * src and dst of the same dtype). */
static void copy_page_layer(kf_backend *b, const kf_paged_kv *src, int32_t sp, const kf_paged_kv *dst, int32_t dp,
                            size_t n, size_t elem) {
    const size_t so = (size_t)sp * src->page_stride * elem, dof = (size_t)dp * dst->page_stride * elem;
    b->copy(b, (char *)dst->k + dof, (const char *)src->k + so, elem * n);
    b->copy(b, (char *)dst->v + dof, (const char *)src->v + so, elem * n);
}

/* Before the sources' layer l: the context's layer l into the sources' arena, its pages and each
 * fork's own copy of the context's partly filled last page (whose other slots the source rewrites
 * in layer l before reading them: they still hold layer l - 1). */
static void context_layer_copy(kf_compact_prep *x, int l) {
    kf_backend *b = kf_model_backend(x->m);
    const kf_paged_kv src = kf_arena_layer(x->ar, l), dst = kf_arena_layer(&x->src_ar, l);
    const int np = kf_pages_for(x->D);
    for (int i = 0; i < np; i++)
        copy_page_layer(b, &src, x->seq.pages[i], &dst, x->src_ctx.pages[i], x->ar->block, x->ar->elem);
    for (int i = 1; x->D % KF_PAGE_TOKENS && i < x->n_sources; i++)
        if (x->forks[i].n_pages >= np && x->forks[i].pages[np - 1] != x->src_ctx.pages[np - 1])
            copy_page_layer(b, &src, x->seq.pages[np - 1], &dst, x->forks[i].pages[np - 1], x->ar->block,
                            x->ar->elem);
}

/* kf_model_forward_layers' hook for the sources: the context's layer copied in before, the
 * caller's on_layer after. */
typedef struct {
    kf_compact_prep *x;
    const kf_layer_hook *inner;
} sources_hook;

static kf_status sources_before(void *ctx, int l, kf_error *err) {
    (void)err;
    const sources_hook *h = ctx;
    context_layer_copy(h->x, l);
    if (h->x->tg.m) /* the attention adds layer l's score sums into the held slot */
        kf_refq_targets_layer_reset(&h->x->tg, l);
    return KF_OK;
}

static kf_status sources_after(void *ctx, int l, kf_error *err) {
    const sources_hook *h = ctx;
    return h->inner->on_layer ? h->inner->on_layer(h->inner->ctx, l, err) : KF_OK;
}

/* Every source i >= 1 on its own fork of the context in the sources' one-layer arena (KV rewind:
 * the context's pages are never written), layer-major through kf_model_forward_layers, hook's
 * on_layer after each layer (the per-layer solve); the sources' arena is made at the first call and
 * kept for the next (freed with the prep), the forks' pages released after each.
 * x->refq_s: the sources' forward seconds summed over the layers. */
static kf_status run_sources(kf_compact_prep *x, const kf_layer_hook *hook, kf_error *err) {
    const int n = x->n_sources, L = x->L;
    kf_forward_pass *passes = calloc((size_t)n, sizeof *passes);
    kf_forward_args *fa = calloc((size_t)n, sizeof *fa);
    capture_to *dst = calloc((size_t)n, sizeof *dst);
    float **qp = calloc((size_t)n * L, sizeof *qp);    /* [n, L] */
    uint16_t **hp = calloc((size_t)n * L, sizeof *hp); /* [n, L] */
    double *pass_s = calloc((size_t)n, sizeof *pass_s);
    kf_forward_targets *ft = calloc((size_t)n, sizeof *ft);
    kf_progress_pass *pp = calloc((size_t)n, sizeof *pp); /* [n] each pass's progress context */
    kf_quoka_params qk;
    kf_status rc = !passes || !fa || !dst || !qp || !hp || !pass_s || !ft || !pp
                       ? kf_fail(err, KF_ERR_NOMEM, "compact: out of memory")
                       : KF_OK;
    if (rc == KF_OK && !x->src_ar.storage) /* once per prep: every kf_compact_solve reuses it */
        rc = sources_arena(x, err);
    int np = 0;
    int64_t before = 0; /* the sources' tokens before source i in a layer */
    for (int i = 1; i < n && rc == KF_OK; i++) {
        if (x->src[i].n == 0)
            continue;
        dst[i] = (capture_to){qp + (size_t)i * L, hp + (size_t)i * L};
        source_args(x, i, &dst[i], &qk, &fa[i], &ft[i]);
        pp[i] = (kf_progress_pass){&x->pg, before};
        before += x->src[i].n;
        if (x->pg.fn)
            fa[i].progress = kf_progress_on_source, fa[i].progress_ctx = &pp[i];
        rc = kf_seq_fork(&x->src_ar, &x->src_ctx, x->D, &x->forks[i], err);
        passes[np++] = (kf_forward_pass){&x->forks[i], &fa[i]};
    }
    sources_hook sh = {x, hook};
    const kf_layer_hook h = {.before_layer = sources_before, .on_layer = sources_after, .ctx = &sh, .pass_s = pass_s};
    if (rc == KF_OK)
        rc = kf_model_forward_layers(x->m, &x->src_ar, passes, np, &h, err);
    x->refq_s = 0;
    for (int i = 0; pass_s && i < np; i++)
        x->refq_s += pass_s[i];
    for (int i = 0; i < n; i++) /* the forks' pages back; the context's layer stays for the next solve */
        kf_seq_release(&x->src_ar, &x->forks[i]);
    free(passes), free(fa), free(dst), free(qp), free(hp), free(pass_s), free(ft), free(pp);
    return rc;
}

/* The pool of fused targets (x->tg, one layer held like x->rq) when a source past the context can
 * have them: the repeat (unless QUOKA runs it) or a probe, on a backend whose attention makes them. */
static kf_status targets_init(kf_compact_prep *x, kf_error *err) {
    const kf_compact_params *p = &x->p;
    const kf_forward_args dense = {0};
    const int quoka_repeat = p->quoka && p->quoka_repeat && p->quoka->mode == KF_PREFILL_QUOKA;
    int any = 0;
    for (int i = 1; i < x->n_sources; i++)
        any |= x->src[i].n > 0 && !(is_repeat(x, i) && quoka_repeat);
    if (!any || !kf_model_targets_supported(x->m, &dense))
        return KF_OK;
    KF_TRY(kf_refq_targets_init(&x->tg, &x->rq, x->n_doc, p->score == KF_SCORE_RMS, err));
    if (!(x->tdst = calloc((size_t)x->n_sources, sizeof *x->tdst)))
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    for (int i = 1; i < x->n_sources; i++)
        KF_TRY(kf_refq_targets_dst_init(&x->tdst[i], x->L, err));
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
    KF_TRY(plan_sources(x, doc, x->src, &n_cand, err));
    const int64_t cap_pos = x->p.max_queries / x->G;
    const int64_t n_pos = n_cand < cap_pos ? n_cand : cap_pos;
    int64_t *sample = malloc(sizeof(int64_t) * (size_t)(n_pos ? n_pos : 1));
    x->rows = malloc(sizeof(int32_t) * (size_t)(n_pos ? n_pos : 1));
    capture_to qdst = {malloc(sizeof(float *) * (size_t)x->L), malloc(sizeof(uint16_t *) * (size_t)x->L)}; /* [L] */
    kf_status rc = KF_OK;
    if (!sample || !x->rows || !qdst.q || !qdst.qh || kf_sample_indices(n_cand, n_pos, x->p.seed, sample) != 0)
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    if (rc == KF_OK)
        rc = kf_refq_init_held(&x->rq, x->L, 1, x->kvh, x->d, x->G, n_pos, x->p.refq_bf16, err);
    if (rc == KF_OK)
        rc = targets_init(x, err);
    if (rc == KF_OK) {
        plan_rows(x, sample, n_pos);
        if (x->first[1] > 0) /* the context's own rows, every layer: captured before the sources run */
            rc = kf_refq_init(&x->ctxq, x->L, x->kvh, x->d, x->G, x->first[1], x->p.refq_bf16, err);
    }
    if (rc == KF_OK && choice)
        rc = plan_validation(x->src, x->n_sources, sample, n_pos, &x->p, (size_t)x->kvh * x->d, &x->pos_kind,
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
        rc = run_prefill(x, reuse, shared, ctx_ids, &qdst, err);
    free(qdst.q), free(qdst.qh);
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
    appended_free(&x->ap);
    sources_arena_free(x);
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

/* One variant's state in kf_compact_solve, or one thread's view of it. kf_compact_solve keeps
 * one per variant (its budgets, its output, folded and var_sum merged so far); every thread holds
 * a view per variant for the head it solves: the same p, choice, t and budgets, the thread's head
 * buffers, `out` a copy of the output's header (the variant's arrays, written at the head's own
 * slots only; stats of this head alone) and folded / var_sum of this head alone, merged in head
 * order after the layer (solve_layer). */
typedef struct {
    kf_compact_params p;           /* the prep's, with this variant's method and budget */
    int choice, t;                 /* per-head choice on; kept keys per head (the largest) */
    int *budgets;                  /* [L * kvh] kept keys of each head (the variant's) */
    int32_t *sel;                  /* [t] (views only: the thread's buffers) */
    float *beta;                   /* [t] */
    float *kfold, *vals, *kc, *vo; /* [t, d] each */
    int folded;
    double var_sum;
    kf_compacted *out;
} variant_ws;

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

/* What one (layer, KV head) shares between the variants: its block and reference rows, AM's
 * targets over them and, when a variant chooses per head, the validation split. */
typedef struct {
    int l, g;
    const float *q;      /* [R, d] the head's reference queries */
    float *q_own;        /* [R, d] q converted from a bf16 pool, or NULL */
    kf_am_head h;
    kf_am_targets tg;    /* m, y, Y point into the prep's pool of fused targets when tg_view */
    int tg_view;
    const head_split *sp; /* NULL: no variant chooses per head */
    kf_val_head vh;
    double targets_s, split_s;
} head_shared;

/* The first of n rows of d floats (row stride) holding a NaN or an infinity: its row, or -1. */
static int64_t first_nonfinite(const float *a, int64_t n, int d, size_t stride) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = a + (size_t)r * stride;
        int bad = 0; /* the exponent bits all ones: NaN or infinity */
#pragma omp simd reduction(| : bad)
        for (int c = 0; c < d; c++) {
            uint32_t u;
            memcpy(&u, row + c, sizeof u);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        if (bad)
            return r;
    }
    return -1;
}

/* Why head g of layer l met a NaN or an infinity: the first non-finite input (the context's keys
 * and values, its reference queries q [R, d], with the choice (choice) the kept validation
 * prompts' keys and values), or, all finite, an overflow in the attention. Scans every input:
 * called on the failure path only. */
static kf_status head_nonfinite_cause(const kf_compact_prep *x, int l, int g, const float *K, const float *V,
                                      const float *q, int choice, kf_error *err) {
    const size_t row = (size_t)x->kvh * x->d, off = (size_t)g * x->d;
    const char *what = NULL;
    int64_t at = -1;
    if ((at = first_nonfinite(K + off, x->D, x->d, row)) >= 0)
        what = "key at context position";
    else if ((at = first_nonfinite(V + off, x->D, x->d, row)) >= 0)
        what = "value at context position";
    else if ((at = first_nonfinite(q, x->rq.R, x->d, (size_t)x->d)) >= 0)
        what = "reference query at row";
    for (int i = 1; !what && choice && i < x->ap.n_src; i++)
        if (x->ap.k[i] && ((at = first_nonfinite(x->ap.k[i] + off, x->ap.n[i], x->d, row)) >= 0 ||
                           (at = first_nonfinite(x->ap.v[i] + off, x->ap.n[i], x->d, row)) >= 0))
            what = "key or value of a validation prompt at position";
    if (!what)
        return kf_fail(err, KF_ERR_INVALID, "compact: layer %d KV head %d: non-finite attention (the logits of "
                       "finite keys and queries overflowed)", l, g);
    return kf_fail(err, KF_ERR_INVALID, "compact: layer %d KV head %d: non-finite %s %lld (NaN or infinity)", l, g,
                   what, (long long)at);
}

/* Non-finite input is refused, naming (layer, head) and the cause: attention over a NaN or an
 * infinity is NaN, and the fits would turn it into a cache that looks valid (a failed solve gives
 * zeros) or NaN. Checked cheaply on what the head computes from its inputs, while hot: AM's targets
 * (m, y, Y: a non-finite query, document key or value makes them non-finite), the validation rows'
 * outputs (vh, NULL without the choice: the validation prompts' keys and values), and the prefix
 * and suffix rows that go into the cache verbatim. The kept keys and fitted values are checked as
 * written (head_output_check). */
static kf_status head_check_finite(const kf_compact_prep *x, int l, int g, const float *K, const float *V,
                                   const float *q, const kf_am_targets *tg, const kf_val_head *vh, kf_error *err) {
    const size_t row = (size_t)x->kvh * x->d, off = (size_t)g * x->d;
    const int64_t tail = x->n_pre + x->n_doc;
    if (first_nonfinite(tg->m, x->rq.R, 1, 1) >= 0 || first_nonfinite(tg->y, x->rq.R, 1, 1) >= 0 ||
        first_nonfinite(tg->Y, x->rq.R, x->d, (size_t)x->d) >= 0 ||
        (vh && first_nonfinite(vh->o_full, vh->n, x->d, (size_t)x->d) >= 0) ||
        first_nonfinite(K + off, x->n_pre, x->d, row) >= 0 || first_nonfinite(V + off, x->n_pre, x->d, row) >= 0 ||
        first_nonfinite(K + tail * row + off, x->n_suf, x->d, row) >= 0 ||
        first_nonfinite(V + tail * row + off, x->n_suf, x->d, row) >= 0)
        return head_nonfinite_cause(x, l, g, K, V, q, vh != NULL, err);
    return KF_OK;
}

static void head_targets_free(head_shared *hs) {
    if (hs->tg_view)
        free(hs->tg.score);
    else
        kf_am_targets_free(&hs->tg);
    memset(&hs->tg, 0, sizeof hs->tg);
    hs->tg_view = 0;
}

/* The targets of the rows the forwards did not fuse (n_un positions): computed on those rows
 * alone, written into hs->tg's rows (the pool's), their score sums added to sum [T]. */
static kf_status unfused_targets(const kf_compact_prep *x, head_shared *hs, int64_t n_un, double *sum,
                                 kf_error *err) {
    const int d = x->d, G = x->G;
    const int64_t n_pos = x->rq.n_pos, Rs = (int64_t)G * n_un;
    float *qs = malloc(sizeof(float) * (size_t)Rs * d); /* [Rs, d] */
    if (!qs)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for a head's reference queries");
    for (int j = 0, i = 0; j < G; j++)
        for (int64_t p = 0; p < n_pos; p++)
            if (!x->tg.fused[p])
                memcpy(qs + (size_t)i++ * d, hs->q + ((size_t)j * n_pos + p) * d, sizeof(float) * d);
    kf_am_head h = hs->h;
    h.q = qs, h.R = (int)Rs;
    kf_am_targets ts;
    kf_status rc = kf_am_targets_compute(&h, x->p.score, &ts, err);
    free(qs);
    if (rc != KF_OK)
        return rc;
    for (int j = 0, i = 0; j < G; j++)
        for (int64_t p = 0; p < n_pos; p++) {
            if (x->tg.fused[p])
                continue;
            const size_t r = (size_t)j * n_pos + p;
            hs->tg.m[r] = ts.m[i], hs->tg.y[r] = ts.y[i];
            memcpy(hs->tg.Y + r * d, ts.Y + (size_t)i++ * d, sizeof(float) * d);
        }
    for (int c = 0; c < x->n_doc; c++) /* back from RMS or mean to the sum over the Rs rows */
        sum[c] += x->p.score == KF_SCORE_RMS ? (double)ts.score[c] * ts.score[c] * Rs : (double)ts.score[c] * Rs;
    kf_am_targets_free(&ts);
    return KF_OK;
}

/* AM's targets of head hs (kf_am_targets_compute's results, by summation order only): the fused
 * rows' from the pool x->tg (layer hs->l is the one held), the others' computed, the score over
 * all R rows. */
static kf_status head_targets(kf_compact_prep *x, head_shared *hs, kf_error *err) {
    if (!x->tg.m)
        return kf_am_targets_compute(&hs->h, x->p.score, &hs->tg, err);
    const int d = x->d, T = x->n_doc;
    const int64_t R = x->rq.R;
    const size_t r0 = kf_refq_targets_row0(&x->tg, hs->l, hs->g);
    hs->tg = (kf_am_targets){x->tg.m + r0, x->tg.y + r0, x->tg.Y + r0 * d, malloc(sizeof(float) * T)};
    hs->tg_view = 1;
    double *sum = malloc(sizeof(double) * T); /* [T] */
    if (!hs->tg.score || !sum) {
        free(sum);
        head_targets_free(hs);
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for a head's scores");
    }
    memcpy(sum, kf_refq_targets_score(&x->tg, hs->l, hs->g), sizeof(double) * T);
    int64_t n_un = 0;
    for (int64_t p = 0; p < x->rq.n_pos; p++)
        n_un += !x->tg.fused[p];
    kf_status rc = n_un > 0 ? unfused_targets(x, hs, n_un, sum, err) : KF_OK;
    for (int c = 0; c < T; c++)
        hs->tg.score[c] = (float)(x->p.score == KF_SCORE_RMS ? sqrt(sum[c] / R) : sum[c] / R);
    free(sum);
    if (rc != KF_OK)
        head_targets_free(hs);
    return rc;
}

static kf_status head_prepare(kf_compact_prep *x, int l, int g, const float *K, const float *V, head_split *sp,
                              head_shared *hs, kf_error *err) {
    const size_t row = (size_t)x->kvh * x->d;
    memset(hs, 0, sizeof *hs);
    hs->l = l, hs->g = g;
    if (x->rq.qh && !(hs->q_own = malloc(sizeof(float) * (size_t)x->rq.R * x->d)))
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for a head's reference queries");
    hs->q = kf_refq_head(&x->rq, l, g, hs->q_own);
    hs->h = (kf_am_head){.k = K + (size_t)x->n_pre * row + (size_t)g * x->d, .k_stride = row,
                         .v = V + (size_t)x->n_pre * row + (size_t)g * x->d, .v_stride = row,
                         .T = x->n_doc, .q = hs->q, .R = (int)x->rq.R, .d = x->d, .scale = x->scale,
                         .be = kf_model_backend(x->m)};
    double ts = now_s();
    kf_status rc = head_targets(x, hs, err);
    if (rc == KF_OK && !sp && (rc = head_check_finite(x, l, g, K, V, hs->q, &hs->tg, NULL, err)) != KF_OK)
        head_targets_free(hs);
    if (rc != KF_OK) {
        free(hs->q_own);
        return rc;
    }
    hs->targets_s = now_s() - ts;
    if (!sp)
        return KF_OK;
    ts = now_s();
    split_head(sp, &x->rq, hs->q, &hs->tg, x->is_val, x->tr_order, x->pos_src, x->pos_local, &x->ap, g);
    /* the original block's attention on the validation rows is their targets */
    rc = kf_val_head_init_targets(&hs->vh, hs->h.be, sp->val_q, (int)sp->n_val, x->d, x->scale, sp->val_w, sp->val_m,
                                  sp->val_y, sp->val_Y, sp->val_app, sp->val_vis, err);
    if (rc == KF_OK && (rc = head_check_finite(x, l, g, K, V, hs->q, &hs->tg, &hs->vh, err)) != KF_OK)
        kf_val_head_free(&hs->vh);
    if (rc != KF_OK) {
        head_targets_free(hs);
        free(hs->q_own);
        return rc;
    }
    hs->sp = sp;
    hs->split_s = now_s() - ts;
    return KF_OK;
}

static void head_shared_free(head_shared *hs) {
    head_targets_free(hs);
    free(hs->q_own);
    if (hs->sp)
        kf_val_head_free(&hs->vh);
}

/* The head's slots [n_pre, n_pre + t) of one variant: th fitted keys kk and values, am's padding
 * after them. */
static void write_head(const kf_compact_prep *x, variant_ws *w, const head_shared *hs, kf_method method,
                       const float *kk, int th) {
    kf_compacted *out = w->out;
    const int d = x->d, n_pre = x->n_pre, hi = hs->l * x->kvh + hs->g;
    const size_t row = (size_t)x->kvh * d;
    float *ok = out->keys + (size_t)hs->l * out->C * row, *ov = out->values + (size_t)hs->l * out->C * row;
    float *hb = out->beta + (size_t)hi * out->C;
    int32_t *hp = out->positions + (size_t)hi * out->C;
    out->head_method[hi] = (uint8_t)method;
    out->stats.heads_by_method[method]++;
    for (int j = 0; j < w->t; j++) {
        float *dk = ok + (size_t)(n_pre + j) * row + (size_t)hs->g * d;
        float *dv = ov + (size_t)(n_pre + j) * row + (size_t)hs->g * d;
        if (j >= th) { /* am padding: a slot that receives exactly no weight */
            memset(dk, 0, sizeof(float) * d);
            memset(dv, 0, sizeof(float) * d);
            hb[n_pre + j] = -INFINITY;
            hp[n_pre + j] = -1;
            continue;
        }
        memcpy(dk, kk + (size_t)j * d, sizeof(float) * d);
        memcpy(dv, (method == KF_METHOD_KEEP ? w->vo : w->vals) + (size_t)j * d, sizeof(float) * d);
        hb[n_pre + j] = method == KF_METHOD_AM ? w->beta[j] : 0.0f;
        hp[n_pre + j] = (int32_t)(n_pre + w->sel[j]);
    }
}

/* qsub [rows, d] = the head's rows q [R, d] at probe positions; returns their count. */
static int probe_rows(const kf_refq *rq, const float *q, int d, float *qsub) {
    int n = 0;
    for (int j = 0; j < rq->group; j++)
        for (int64_t pp = 0; pp < rq->n_pos; pp++)
            if (rq->source[pp] == KF_REFQ_PROBE)
                memcpy(qsub + (size_t)n++ * d, q + ((size_t)j * rq->n_pos + pp) * d, sizeof(float) * d);
    return n;
}

/* The rows the choice held out, as a head and targets (their part of the refit on all the rows). */
static void val_rows(const head_shared *hs, kf_am_head *hv, kf_am_targets *tv) {
    *hv = hs->h;
    hv->q = hs->sp->val_q, hv->R = (int)hs->sp->n_val;
    *tv = (kf_am_targets){hs->sp->val_m, hs->sp->val_y, hs->sp->val_Y, NULL};
}

/* The training rows from..n_tr - 1 the choice's fits do not cover, as a head and targets (their
 * part of the refit on all the rows). */
static void rest_rows(const head_shared *hs, int from, kf_am_head *hr, kf_am_targets *tr) {
    const head_split *sp = hs->sp;
    const int d = hs->h.d;
    *hr = hs->h;
    hr->q = sp->tr_q + (size_t)from * d, hr->R = (int)sp->n_tr - from;
    *tr = (kf_am_targets){sp->tr_m + from, sp->tr_y + from, sp->tr_Y + (size_t)from * d, NULL};
}

/* The parts of a refit on all the rows beyond the choice's first `rows` training rows, into hv/tv
 * [2]: the other training rows (when any), then the validation rows; returns how many. */
static int refit_parts(const head_shared *hs, int rows, kf_am_head *hv, kf_am_targets *tv) {
    int n = 0;
    if (rows < hs->sp->n_tr)
        rest_rows(hs, rows, &hv[n], &tv[n]), n++;
    val_rows(hs, &hv[n], &tv[n]), n++;
    return n;
}

/* The picked candidate's beta: from the choice's normal equations (plus the other training rows'
 * and the validation rows' parts with refit_all) when it kept them, else fitted on hf/tf. */
static kf_status fit_beta(const variant_ws *w, const head_shared *hs, const kf_am_head *hf, const kf_am_targets *tf,
                          kf_choice_fits *fits, int th, uint64_t seed, kf_error *err) {
    const kf_compact_params *p = &w->p;
    kf_am_stats *st = &w->out->stats.solver;
    if (!fits || !fits->beta.G)
        return kf_am_fit_beta_ex(hf, tf, w->sel, th, seed, p->beta_fit, w->beta, st, err);
    if (p->refit_all) { /* the other training rows, then the validation rows */
        kf_am_head hv[2];
        kf_am_targets tv[2];
        const int n = refit_parts(hs, fits->rows, hv, tv);
        KF_TRY(kf_choice_refit_add(fits, 1, hv, tv, n, w->kc, th, err));
    }
    return kf_am_fit_beta_normal(&fits->beta, seed, p->beta_fit, w->beta, st, err);
}

/* The values for keys kk [th, d] (bias: am's beta): drop's from the choice's normal equations
 * (plus the other training rows' and the validation rows' parts with refit_all) when it kept
 * them, else fitted on hf/tf. */
static kf_status fit_values(const kf_compact_prep *x, variant_ws *w, const head_shared *hs, const kf_am_head *hf,
                            const kf_am_targets *tf, kf_choice_fits *fits, kf_method method, const float *kk,
                            double alpha, int th, kf_error *err) {
    const kf_compact_params *p = &w->p;
    const float *v0 = p->ridge_to == KF_RIDGE_TO_ORIG ? w->vo : NULL;
    kf_am_stats *st = &w->out->stats.solver;
    if (method != KF_METHOD_DROP || !fits || !fits->drop.G)
        return kf_am_fit_values_ridge(hf->be, hf->q, hf->R, x->d, x->scale, kk, x->d,
                                      method == KF_METHOD_AM ? w->beta : NULL, th, tf->Y, alpha, v0, x->d, w->vals, st,
                                      err);
    if (p->refit_all) { /* the other training rows, then the validation rows */
        kf_am_head hv[2];
        kf_am_targets tv[2];
        const int n = refit_parts(hs, fits->rows, hv, tv);
        KF_TRY(kf_choice_refit_add(fits, 0, hv, tv, n, kk, th, err));
    }
    return kf_value_gram_solve(&fits->drop, alpha, v0, x->d, w->vals, st, err);
}

/* beta, the fold and the values of the picked candidate, fitted on hf/tf (or from what the
 * choice kept in fits, NULL: nothing), then written. */
static kf_status variant_fit(const kf_compact_prep *x, variant_ws *w, const head_shared *hs, const kf_am_head *hf,
                             const kf_am_targets *tf, const kf_head_pick *pick, kf_choice_fits *fits, int th,
                             float *qsub, kf_error *err) {
    kf_compacted *out = w->out;
    const kf_compact_params *p = &w->p;
    const int d = x->d, hi = hs->l * x->kvh + hs->g;
    kf_method method = pick->method;
    double ts = now_s();
    if (method != KF_METHOD_KEEP && method != KF_METHOD_DROP) {
        KF_TRY(fit_beta(w, hs, hf, tf, fits, th, p->seed + (uint64_t)hi, err));
        out->stats.beta_s += now_s() - ts;
    }
    const float *kk = w->kc; /* [th, d] keys the values are fitted for */
    float *u = out->u + (size_t)hi * d;
    memset(u, 0, sizeof(float) * d); /* u = 0 unless folded */
    if (method == KF_METHOD_FOLD) {
        ts = now_s();
        const int on_probes = p->fold_queries == KF_FOLD_ON_PROBES;
        const int fR = on_probes ? probe_rows(&x->rq, hs->q, d, qsub) : hf->R;
        kf_fold_info fi;
        KF_TRY(fold_selection(hf->be, on_probes ? qsub : hf->q, fR, d, x->scale, pick->lambda, w->kc, w->beta, th, u,
                              w->kfold, &fi, err));
        if (fi.ok) {
            kk = w->kfold;
            w->folded++;
            w->var_sum += fi.var_gain;
            out->var_gain[hi] = (float)fi.var_gain;
        } else {
            method = KF_METHOD_DROP; /* no fold direction: compact this head as drop */
            memset(u, 0, sizeof(float) * d);
            out->stats.fold_fallback_heads++;
        }
        out->stats.fold_s += now_s() - ts;
    }
    if (method != KF_METHOD_KEEP) {
        ts = now_s();
        KF_TRY(fit_values(x, w, hs, hf, tf, fits, method, kk, pick->alpha, th, err));
        out->stats.values_s += now_s() - ts;
        out->stats.heads_ridged += pick->alpha > 0;
        out->head_alpha[hi] = (float)pick->alpha;
    }
    write_head(x, w, hs, method, kk, th);
    return KF_OK;
}

/* The head's th written slots of one variant (keys and values [th, d] at the cache's row stride)
 * are finite: a fit that overflows (a fold along a huge u, a diverging solve) is refused, not
 * shipped. */
static kf_status head_output_check(const kf_compact_prep *x, const variant_ws *w, const head_shared *hs, int th,
                                   kf_error *err) {
    const kf_compacted *out = w->out;
    const size_t row = (size_t)x->kvh * x->d, at = ((size_t)hs->l * out->C + x->n_pre) * row + (size_t)hs->g * x->d;
    const int64_t bad_k = first_nonfinite(out->keys + at, th, x->d, row);
    const int64_t bad = bad_k >= 0 ? bad_k : first_nonfinite(out->values + at, th, x->d, row);
    if (bad < 0)
        return KF_OK;
    return kf_fail(err, KF_ERR_INVALID, "compact: layer %d KV head %d: %s %g gave a non-finite %s in kept slot %lld",
                   hs->l, hs->g, kf_method_name(out->head_method[hs->l * x->kvh + hs->g]), w->p.budget,
                   bad_k >= 0 ? "key" : "value", (long long)bad);
}

/* One variant on one head: its selection, the per-head choice when on, then the fits. */
static kf_status variant_head(const kf_compact_prep *x, variant_ws *w, head_shared *hs, float *qsub,
                              kf_error *err) {
    kf_compacted *out = w->out;
    const kf_compact_params *p = &w->p;
    const int d = x->d, hi = hs->l * x->kvh + hs->g;
    const size_t row = (size_t)x->kvh * d;
    double ts = now_s();
    /* am pads a smaller head with no-weight slots; the bias-free methods keep t keys */
    const int th = p->method == KF_METHOD_AM ? w->budgets[hi] : w->t;
    KF_TRY(kf_am_select(hs->tg.score, x->n_doc, th, w->sel, err));
    out->stats.select_s += hs->targets_s + (now_s() - ts);
    for (int j = 0; j < th; j++) { /* the kept keys and their original values */
        memcpy(w->kc + (size_t)j * d, hs->h.k + (size_t)w->sel[j] * row, sizeof(float) * d);
        memcpy(w->vo + (size_t)j * d, hs->h.v + (size_t)w->sel[j] * row, sizeof(float) * d);
    }
    kf_head_pick pick = {p->method, p->lambda_rel, p->value_ridge, 0};
    kf_am_head hf = hs->h; /* the rows the final beta, u and values are fitted on */
    kf_am_targets tf = hs->tg;
    kf_choice_fits fits = {0}; /* what the choice keeps for the refit */
    if (w->choice) {
        ts = now_s();
        const head_split *sp = hs->sp;
        kf_am_head htr = hs->h;
        htr.q = sp->tr_q, htr.R = (int)sp->n_tr;
        kf_am_targets ttr = {sp->tr_m, sp->tr_y, sp->tr_Y, NULL};
        KF_TRY(kf_choose_head(p, &htr, &ttr, w->sel, th, w->kc, w->vo, &hs->vh, p->seed + (uint64_t)hi, &pick, &fits,
                              err));
        if (!p->refit_all) { /* ship the fit that was validated: on the training rows' subsample */
            hf = htr, tf = ttr;
            hf.R = kf_choice_rows(p, htr.R, th);
        }
        out->stats.choice_s += hs->split_s + (now_s() - ts);
    }
    kf_status rc = variant_fit(x, w, hs, &hf, &tf, &pick, w->choice ? &fits : NULL, th, qsub, err);
    kf_choice_fits_free(&fits);
    if (rc == KF_OK)
        rc = head_output_check(x, w, hs, th, err);
    return rc;
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
    split_free(&t->sp);
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
        if (split_alloc(&t->sp, x->rq.R, x->n_val_pos * x->G, d, x->n_sources) != 0)
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
    kf_status rc = head_prepare(j->x, j->l, g, j->K, j->V, j->any_choice ? &t->sp : NULL, &hs, &j->err[g]);
    if (rc == KF_OK) {
        for (int i = 0; i < j->n && rc == KF_OK; i++)
            rc = variant_head(j->x, &t->w[i], &hs, t->qsub, &j->err[g]);
        head_shared_free(&hs);
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
        KF_TRY(appended_load(&x->src_ar, x->D, &x->ap, l, err));
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
        context_rows_load(h->x, l);
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
        rc = run_sources(x, &hook, err);
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
