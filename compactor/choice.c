/* choice.c — the per-head choice (docs/decisions/per-head-choice.md): the validation split of the
 * reference rows, the training rows' order, each candidate's fit and score, kf_choose_head. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact_internal.h"
#include "compactor/fold.h"
/* ---- per-head choice (docs/decisions/per-head-choice.md) ---- */

/* 1e-3 was dropped: it won few heads and the quality tables did not miss it, while each alpha is
 * one Cholesky solve and one validation error per candidate (docs/decisions/per-head-choice.md) */
static const double kAlphaGrid[] = {0, 1e-2, 1e-1};
/* times lambda_rel; 0.1x was dropped: its long u (keys moved by beta sqrt(d) u) made the folded keys
 * so large that rounding the cache to bf16 moved the records model's logits by 7 (test_e2e); 10x
 * too: it won a head in twenty and the tables did not miss it, at a quarter of the choice's cost */
static const double kLambdaGrid[] = {1};

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

/* kf_choose_head's buffers, allocated once per head and reused by every candidate. */
typedef struct {
    float *beta, *u;     /* [t], [d] */
    float *keys, *vals;  /* [t, d] a candidate's keys (folded) and values */
    kf_gram_tiles tiles; /* [512, t] the normal equations' row tiles (logits included) */
    kf_value_gram gm;    /* [t, t], [t, d] a candidate's value normal equations (G NULL: none) */
    kf_ws *ws;           /* where they live (NULL: the heap) and every fit's scratch */
} choice_ws;

static void choice_ws_free(choice_ws *w) {
    if (!w->ws)
        free(w->beta), free(w->u), free(w->keys), free(w->vals);
    kf_gram_tiles_free(&w->tiles);
    kf_value_gram_free(&w->gm);
}

/* gram: also the candidates' normal equations (am, fold); keep_rows: rows of the kept keys' logits
 * kept for the fold candidate (kf_kept_logits_rows; 0: none); from ws (NULL: the heap). 0, or -1
 * when out of memory. */
static int choice_ws_alloc(choice_ws *w, const kf_backend *be, int t, int d, int gram, int keep_rows, kf_ws *ws) {
    const size_t t1 = (size_t)(t ? t : 1);
    memset(w, 0, sizeof *w);
    w->ws = ws;
    if (ws) {
        w->beta = kf_ws_alloc(ws, (int64_t)t1, sizeof(float)), w->u = kf_ws_alloc(ws, d, sizeof(float));
        w->keys = kf_ws_alloc(ws, (int64_t)t1 * d, sizeof(float));
        w->vals = kf_ws_alloc(ws, (int64_t)t1 * d, sizeof(float));
    } else {
        w->beta = malloc(sizeof(float) * t1), w->u = malloc(sizeof(float) * (size_t)d);
        w->keys = malloc(sizeof(float) * t1 * d), w->vals = malloc(sizeof(float) * t1 * d);
    }
    if (!w->beta || !w->u || !w->keys || !w->vals || kf_gram_tiles_alloc(&w->tiles, t, d, 1, ws) != 0 ||
        (gram && kf_value_gram_alloc(&w->gm, be, t, d, ws) != 0) || kf_gram_tiles_keep_logits(&w->tiles, keep_rows, ws))
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
        rc = kf_value_gram_rank_solve(gm, kAlphaGrid[a], v0, d, vals, err);
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

/* A candidate of the method (am, fold) that just became the best: its value normal equations
 * (w->gm), beta and fold direction copied into f's (when kept: win.G). */
static void keep_winner(kf_choice_fits *f, const choice_ws *w, kf_method method, double var_gain) {
    if (!f->win.G)
        return;
    const int t = f->win.t, d = f->win.d;
    memcpy(f->win.G, w->gm.G, sizeof(double) * (size_t)t * t);
    memcpy(f->win.B, w->gm.B, sizeof(double) * (size_t)t * d);
    f->win.tr = w->gm.tr;
    memcpy(f->win_beta, w->beta, sizeof(float) * (size_t)t);
    memcpy(f->win_u, w->u, sizeof(float) * (size_t)d);
    f->win_method = method, f->win_var_gain = var_gain;
}

/* The fold candidates: u fitted on the training rows (their mean and covariance cov) for each
 * lambda of the grid, the kept keys folded along it (w->beta), every alpha scored; the best kept
 * in f. */
static kf_status try_folds(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr,
                           const kf_fold_cov *cov, const float *kc, int t, const float *v0, kf_val_head *val,
                           choice_ws *w, kf_choice_fits *f, kf_head_pick *best, kf_error *err) {
    kf_status rc = KF_OK;
    for (size_t li = 0; li < sizeof kLambdaGrid / sizeof *kLambdaGrid && rc == KF_OK; li++) {
        const double lambda = kLambdaGrid[li] * p->solver.lambda_rel, before = best->err;
        kf_fold_info fi;
        rc = kf_fold_direction_cov(cov, lambda, w->u, &fi, w->ws, err);
        if (rc == KF_OK && fi.ok) { /* its normal equations from the kept keys' logits, scored with its keys */
            kf_fold_keys(kc, htr->d, w->beta, t, htr->d, htr->scale, w->u, w->keys, htr->d);
            kf_value_gram_rebuild_folded(htr->q, htr->R, htr->scale, kc, htr->d, w->beta, w->u, ttr->Y, &w->tiles,
                                         &w->gm);
            rc = score_alphas(&w->gm, w->keys, NULL, t, htr->d, v0, KF_METHOD_FOLD, lambda, 1 + p->choice.choice_margin,
                              val, w->vals, best, err);
            if (rc == KF_OK && best->err < before)
                keep_winner(f, w, KF_METHOD_FOLD, fi.var_gain);
        }
    }
    return rc;
}

/* The method's candidates (am, fold): beta fitted on the training rows from one pass that also
 * builds drop's normal equations (f->beta, f->drop, kept for the refit; with a workspace, already
 * allocated there by kf_choose_head); fold's covariance first. The best candidate kept in f. */
static kf_status method_fits(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr, int t,
                             const float *kc, const float *v0, kf_val_head *val, uint64_t seed, choice_ws *w,
                             kf_choice_fits *f, kf_head_pick *best, kf_error *err) {
    kf_fold_cov cov = {0};
    if (p->method == KF_METHOD_FOLD)
        KF_TRY(kf_fold_cov_compute(htr->be, htr->q, htr->R, htr->d, &cov, w->ws, err));
    kf_status rc = w->ws ? kf_kept_normal_fill(htr, ttr, kc, t, &w->tiles, &f->beta, &f->drop, w->ws, err)
                         : kf_kept_normal_build(htr, ttr, kc, t, &w->tiles, &f->beta, &f->drop, NULL, err);
    if (rc == KF_OK) /* its counts go with the winner when the refit keeps this beta */
        rc = kf_am_fit_beta_normal(&f->beta, seed, p->solver.beta_fit, w->beta, &f->win_beta_stats, w->ws, err);
    const double before = best->err;
    if (rc == KF_OK && p->method == KF_METHOD_AM) {
        rc = try_alphas(htr, ttr->Y, kc, w->beta, v0, KF_METHOD_AM, 0, 1 + p->choice.choice_margin, val, w, best, err);
        if (rc == KF_OK && best->err < before)
            keep_winner(f, w, KF_METHOD_AM, 0);
    } else if (rc == KF_OK)
        rc = try_folds(p, htr, ttr, &cov, kc, t, v0, val, w, f, best, err);
    kf_fold_cov_free(&cov);
    return rc;
}

/* The choice's candidates other than keep: the method's and drop; keep's weights are drop's, left
 * in val. f: the training rows' normal equations and the method's best candidate (for the refit). */
static kf_status choose_fits(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr, int t,
                             const float *kc, const float *v0, kf_val_head *val, uint64_t seed, choice_ws *w,
                             kf_choice_fits *f, kf_head_pick *best, kf_error *err) {
    const int d = htr->d;
    kf_value_gram *dg = &f->drop;
    if (p->method == KF_METHOD_AM || p->method == KF_METHOD_FOLD) {
        KF_TRY(method_fits(p, htr, ttr, t, kc, v0, val, seed, w, f, best, err));
    } else {
        if (!w->ws && kf_value_gram_alloc(dg, htr->be, t, d, NULL) != 0) /* with ws: kf_choose_head's */
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for drop's normal equations (t %d)", t);
        kf_value_gram_rebuild(htr->q, htr->R, htr->scale, kc, d, NULL, ttr->Y, &w->tiles, dg);
    }
    return score_alphas(dg, kc, NULL, t, d, v0, KF_METHOD_DROP, p->solver.lambda_rel, 1, val, w->vals, best, err);
}

void kf_choice_fits_free(kf_choice_fits *f) {
    if (!f->win.in_ws)
        free(f->win_beta), free(f->win_u);
    kf_beta_normal_free(&f->beta);
    kf_value_gram_free(&f->drop);
    kf_value_gram_free(&f->win);
    f->win_beta = f->win_u = NULL;
}

/* f's win buffers for t keys (value normal equations, beta, u) from ws (NULL: the heap); 0, or -1
 * when out of memory. */
static int win_alloc(kf_choice_fits *f, const kf_backend *be, int t, int d, kf_ws *ws) {
    const int ok = kf_value_gram_alloc(&f->win, be, t, d, ws) == 0;
    const size_t t1 = (size_t)(t ? t : 1);
    f->win_beta = ws ? kf_ws_alloc(ws, (int64_t)t1, sizeof(float)) : malloc(sizeof(float) * t1);
    f->win_u = ws ? kf_ws_alloc(ws, d, sizeof(float)) : malloc(sizeof(float) * (size_t)d);
    f->win_method = KF_METHOD_KEEP;
    return ok && f->win_beta && f->win_u ? 0 : -1;
}

int64_t kf_choice_kept_bytes(int t, int d, int refit_values) {
    return kf_beta_normal_bytes(t) + kf_value_gram_bytes(t, d) +
           (refit_values ? kf_value_gram_bytes(t, d) + kf_ws_bytes(t ? t : 1, sizeof(float)) +
                               kf_ws_bytes(d, sizeof(float))
                         : 0);
}

kf_status kf_choice_refit_add(kf_choice_fits *f, kf_refit_add_to to, const kf_am_head *parts, const kf_am_targets *tgs,
                              int n_parts, const float *kc, int t, kf_ws *ws, kf_error *err) {
    const int beta = to == KF_REFIT_ADD_BETA;
    kf_value_gram *g = to == KF_REFIT_ADD_WIN ? &f->win : &f->drop;
    if (beta ? !f->beta.G : !g->G || (to == KF_REFIT_ADD_WIN && f->win_method == KF_METHOD_KEEP))
        return kf_fail(err, KF_ERR_INVALID, "compact: refit: the choice kept no normal equations for %s",
                       beta ? "beta" : to == KF_REFIT_ADD_WIN ? "the method's values" : "drop's values");
    const float *bias = to == KF_REFIT_ADD_WIN && f->win_method == KF_METHOD_AM ? f->win_beta : NULL;
    for (int k = 0; k < n_parts; k++) {
        const kf_am_head *h = &parts[k];
        if (h->R == 0)
            continue;
        const size_t mark = ws ? kf_ws_mark(ws) : 0; /* each part is scratch */
        if (beta) {
            kf_beta_normal part;
            KF_TRY(kf_beta_normal_build(h, &tgs[k], kc, t, &part, ws, err));
            kf_beta_normal_add(&f->beta, &part);
            kf_beta_normal_free(&part);
        } else {
            kf_value_gram part;
            KF_TRY(kf_value_gram_build(h->be, h->q, h->R, h->d, h->scale, kc, (size_t)h->d, bias, t, tgs[k].Y, &part,
                                       ws, err));
            kf_value_gram_add(g, &part);
            kf_value_gram_free(&part);
        }
        if (ws)
            kf_ws_reset(ws, mark);
    }
    return KF_OK;
}

/* min(all, max(ceil(per * x), floor)) rows; all of them when per is 0. */
static int64_t rows_per(double per, int64_t x, int64_t floor_, int64_t all) {
    if (!(per > 0))
        return all;
    const double want = ceil(per * (double)x), n = want > (double)floor_ ? want : (double)floor_;
    return n < (double)all ? (int64_t)n : all;
}

int kf_choice_rows(const kf_compact_params *p, int R, int t) {
    return (int)rows_per(p->choice.choice_rows, t, KF_CHOICE_MIN_ROWS, R);
}

int kf_refit_rows(const kf_compact_params *p, int R, int t) {
    if (p->choice.refit_all != KF_REFIT_VALUES) /* --refit all refits everything on every row */
        return R;
    const int n = (int)rows_per(p->choice.refit_rows, t, KF_REFIT_MIN_ROWS, R), c = kf_choice_rows(p, R, t);
    return n > c ? n : c;
}

int64_t kf_val_score_rows(const kf_compact_params *p, int64_t n_val, int64_t T) {
    return rows_per(p->choice.val_rows, T, KF_VAL_MIN_ROWS, n_val);
}

kf_status kf_choose_head(const kf_compact_params *p, const kf_am_head *htr, const kf_am_targets *ttr,
                         const int32_t *sel, int t, const float *kc, const float *vo, kf_val_head *val, uint64_t seed,
                         kf_head_pick *best, kf_choice_fits *keep, kf_ws *ws, kf_error *err) {
    (void)sel; /* the kept keys are kc */
    const int d = htr->d;
    kf_am_head hsub = *htr; /* every candidate's fits: the training rows' first kf_choice_rows */
    hsub.R = kf_choice_rows(p, htr->R, t);
    const float *v0 = p->solver.ridge_to == KF_RIDGE_TO_ORIG ? vo : NULL;
    kf_choice_fits f = {0};
    choice_ws w = {0};
    *best = (kf_head_pick){KF_METHOD_KEEP, p->solver.lambda_rel, 0, INFINITY};
    kf_status rc = KF_OK;
    const kf_kv_block kb = {kc, vo, (size_t)d, NULL, t};
    const int am_fold = p->method == KF_METHOD_AM || p->method == KF_METHOD_FOLD;
    const size_t mark = ws ? kf_ws_mark(ws) : 0;
    int kept_ok = 1; /* with ws, the normal equations kept for the refit first, below the choice's own buffers */
    if (ws && am_fold)
        kept_ok = kf_kept_normal_alloc(&f.beta, &f.drop, htr->be, t, d, ws) == 0;
    else if (ws && p->method != KF_METHOD_KEEP)
        kept_ok = kf_value_gram_alloc(&f.drop, htr->be, t, d, ws) == 0;
    if (am_fold && p->choice.refit_all == KF_REFIT_VALUES && kept_ok) /* the method's best candidate */
        kept_ok = win_alloc(&f, htr->be, t, d, ws) == 0;
    const size_t own = ws ? kf_ws_mark(ws) : 0;
    const int keep_rows = p->method == KF_METHOD_FOLD ? kf_kept_logits_rows(hsub.R, t) : 0;
    if (!kept_ok || choice_ws_alloc(&w, htr->be, t, d, am_fold, keep_rows, ws) != 0)
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the per-head choice (t %d)", t);
    else if (p->method != KF_METHOD_KEEP)
        rc = choose_fits(p, &hsub, ttr, t, kc, v0, val, seed, &w, &f, best, err);
    else if (kf_val_attend(val, &kb) != 0) /* keep alone: the kept keys' weights */
        rc = kf_fail(err, KF_ERR_NOMEM, "compact: out of memory in the per-head validation");
    if (rc == KF_OK) {
        const double e = kf_val_err_values(val, vo, (size_t)d);
        if (e < best->err)
            *best = (kf_head_pick){KF_METHOD_KEEP, p->solver.lambda_rel, 0, e};
    }
    f.rows = hsub.R;
    if (rc == KF_OK && keep)
        *keep = f; /* the refit adds the other training rows' part and the validation rows' */
    else
        kf_choice_fits_free(&f);
    choice_ws_free(&w);
    if (ws) /* the kept normal equations stay in ws */
        kf_ws_reset(ws, rc == KF_OK && keep ? own : mark);
    return rc;
}

/* ---- the validation split: held-out rows, their prompts, one head's split ---- */

void kf_appended_free(appended_kv *ap) {
    for (int i = 0; ap->k && i < ap->n_src; i++) {
        free(ap->k[i]);
        free(ap->v[i]);
    }
    free(ap->k), free(ap->v), free(ap->n);
    memset(ap, 0, sizeof *ap);
}

kf_status kf_appended_load(const kf_arena *a, int64_t D, appended_kv *ap, int l, kf_error *err) {
    for (int i = 1; i < ap->n_src; i++)
        if (ap->n[i] > 0)
            KF_TRY(kf_seq_read_kv(a, &ap->fork[i], l, D, ap->n[i], ap->k[i], ap->v[i], err));
    return KF_OK;
}

void kf_split_free(head_split *s) {
    free(s->tr_q), free(s->tr_m), free(s->tr_y), free(s->tr_Y), free(s->val_q), free(s->val_w);
    free(s->val_m), free(s->val_y), free(s->val_Y);
    free((void *)s->val_app), free(s->val_vis), free(s->blocks), free(s->val_lse_a), free(s->val_oa);
    memset(s, 0, sizeof *s);
}

int kf_split_alloc(head_split *s, int64_t R, int64_t n_val, int d, int n_src) {
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
    s->val_lse_a = malloc(sizeof(double) * (size_t)(n_val ? n_val : 1));
    s->val_oa = malloc(sizeof(float) * (size_t)(n_val ? n_val : 1) * d);
    s->blocks = calloc((size_t)n_src, sizeof *s->blocks);
    return s->tr_q && s->tr_m && s->tr_y && s->tr_Y && s->val_q && s->val_w && s->val_app && s->val_vis && s->blocks &&
                   s->val_m && s->val_y && s->val_Y && s->val_lse_a && s->val_oa
               ? 0
               : -1;
}

/* Row i of n rows of one kind (probe or other) is scored when it is one of `take` evenly spaced. */
static int scored_row(int64_t i, int64_t n, int64_t take) {
    return (i + 1) * take / n > i * take / n;
}

void kf_split_head(head_split *s, const kf_refq *rq, const float *q, const kf_am_targets *tg, const uint8_t *is_val,
                   const int64_t *tr_order, const int *pos_src, const int64_t *pos_local, const appended_kv *ap,
                   const own_rows *own, int g) {
    const int d = rq->head_dim;
    const size_t row = (size_t)rq->kv_heads * d;
    for (int i = 1; i < ap->n_src; i++)
        if (ap->k[i])
            s->blocks[i] = (kf_kv_block){ap->k[i] + (size_t)g * d, ap->v[i] + (size_t)g * d, row, NULL, (int)ap->n[i]};
    int64_t n_probe = 0;
    for (int64_t k = 0; k < rq->n_pos; k++)
        n_probe += is_val[k] && rq->source[k] == KF_REFQ_PROBE;
    const int64_t n_val_pos = s->n_val / rq->group, n_other = n_val_pos - n_probe;
    for (int64_t i = 0; i < s->n_tr; i++) { /* training rows in tr_order (kf_choice_training_order) */
        const int64_t r = tr_order[i];
        memcpy(s->tr_q + (size_t)i * d, q + (size_t)r * d, sizeof(float) * d);
        memcpy(s->tr_Y + (size_t)i * d, tg->Y + (size_t)r * d, sizeof(float) * d);
        s->tr_m[i] = tg->m[r], s->tr_y[i] = tg->y[r];
    }
    /* the scored rows first (probe rows, then the others evenly spaced), then the rest, each in
     * gather order; probe rows weigh half of the scored rows' total when both kinds are scored */
    const int64_t n_pr = n_probe * rq->group, n_or = n_other * rq->group;
    const int64_t take_p = s->n_score < n_pr ? s->n_score : n_pr, take_o = s->n_score - take_p;
    const int both = take_p && take_o;
    const double w_probe = both ? 0.5 / (double)n_probe * ((double)n_pr / (double)take_p) : 1.0;
    const double w_other = both ? 0.5 / (double)n_other * ((double)n_or / (double)take_o) : 1.0;
    int64_t ip = 0, io = 0, at_scored = 0, at_rest = s->n_score;
    for (int j = 0; j < rq->group; j++)
        for (int64_t k = 0; k < rq->n_pos; k++) {
            const int64_t r = (int64_t)j * rq->n_pos + k;
            if (!is_val[k])
                continue;
            const int probe = rq->source[k] == KF_REFQ_PROBE;
            const int in = probe ? scored_row(ip++, n_pr, take_p) : scored_row(io++, n_or, take_o);
            const int64_t nv = in ? at_scored++ : at_rest++;
            memcpy(s->val_q + (size_t)nv * d, q + (size_t)r * d, sizeof(float) * d);
            memcpy(s->val_Y + (size_t)nv * d, tg->Y + (size_t)r * d, sizeof(float) * d);
            s->val_m[nv] = tg->m[r], s->val_y[nv] = tg->y[r];
            s->val_w[nv] = probe ? w_probe : w_other;
            s->val_app[nv] = &s->blocks[pos_src[k]];
            s->val_vis[nv] = (int)pos_local[k] + 1;
            if (own && own->done[k]) { /* the source forward attended its prompt already */
                const size_t a = (size_t)j * own->n_own + (size_t)own->slot[k];
                s->val_app[nv] = NULL;
                s->val_lse_a[nv] = own->m[a] + log((double)own->y[a]);
                memcpy(s->val_oa + (size_t)nv * d, own->Y + a * d, sizeof(float) * d);
            }
        }
}

kf_status kf_plan_validation(const source *src, int n_sources, const int64_t *sample, int64_t n_pos,
                             const kf_compact_params *p, uint8_t **kind, int **pos_src,
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
    *n_val = pick_validation(n_pos, *kind, p->choice.val_frac, p->solver.seed, *is_val);
    if (*n_val < 0)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation split");
    for (k = 0; k < n_pos; k++)
        if ((*is_val)[k] && (*pos_local)[k] + 1 > ap->n[(*pos_src)[k]])
            ap->n[(*pos_src)[k]] = (*pos_local)[k] + 1;
    return KF_OK;
}

kf_status kf_appended_alloc(appended_kv *ap, size_t row, kf_error *err) {
    for (int i = 1; i < ap->n_src; i++)
        if (ap->n[i] > 0) {
            ap->k[i] = malloc(sizeof(float) * (size_t)ap->n[i] * row);
            ap->v[i] = malloc(sizeof(float) * (size_t)ap->n[i] * row);
            if (!ap->k[i] || !ap->v[i])
                return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation prompts' keys");
        }
    return KF_OK;
}
