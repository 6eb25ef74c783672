/* head_solve.c — one (layer, KV head): AM's targets over its reference rows (the fused ones read
 * from the pool, the others computed), its validation split, then per variant the selection, the
 * per-head choice, beta, the fold and the values, checked finite and written into the cache. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact_internal.h"
#include "compactor/fold.h"
/* out [t, d] = the kept keys folded along u (fitted on q [R, d] with lambda); fi->ok = 0: none. */
static kf_status fold_selection(const kf_backend *be, const float *q, int R, int d, float scale, double lambda,
                                const float *kc, const float *beta, int t, float *u, float *out, kf_fold_info *fi,
                                kf_ws *ws, kf_error *err) {
    KF_TRY(kf_fold_direction(be, q, R, d, lambda, u, fi, ws, err));
    if (fi->ok)
        kf_fold_keys(kc, d, beta, t, d, scale, u, out, d);
    return KF_OK;
}

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
                       "finite keys and queries overflowed, or a source's own keys or values were not finite)", l, g);
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

/* The head's targets live in the thread's workspace (or the pool's): forgotten, not freed. */
static void head_targets_free(head_shared *hs) {
    memset(&hs->tg, 0, sizeof hs->tg);
    hs->tg_view = 0;
}

/* The targets of the rows the forwards did not fuse (n_un positions): computed on those rows
 * alone, written into hs->tg's rows (the pool's), their score sums added to sum [T]. */
static kf_status unfused_targets(const kf_compact_prep *x, head_shared *hs, int64_t n_un, double *sum, kf_ws *ws,
                                 kf_error *err) {
    const int d = x->d, G = x->G;
    const int64_t n_pos = x->rq.n_pos, Rs = (int64_t)G * n_un;
    float *qs = kf_ws_alloc(ws, Rs * d, sizeof(float)); /* [Rs, d] */
    if (!qs)
        return kf_fail(err, KF_ERR_NOMEM, "compact: the workspace is too small for a head's reference queries");
    for (int j = 0, i = 0; j < G; j++)
        for (int64_t p = 0; p < n_pos; p++)
            if (!x->tg.fused[p])
                memcpy(qs + (size_t)i++ * d, hs->q + ((size_t)j * n_pos + p) * d, sizeof(float) * d);
    kf_am_head h = hs->h;
    h.q = qs, h.R = (int)Rs;
    kf_am_targets ts;
    KF_TRY(kf_am_targets_compute_ws(&h, x->p.solver.score, &ts, ws, err));
    for (int j = 0, i = 0; j < G; j++)
        for (int64_t p = 0; p < n_pos; p++) {
            if (x->tg.fused[p])
                continue;
            const size_t r = (size_t)j * n_pos + p;
            hs->tg.m[r] = ts.m[i], hs->tg.y[r] = ts.y[i];
            memcpy(hs->tg.Y + r * d, ts.Y + (size_t)i++ * d, sizeof(float) * d);
        }
    for (int c = 0; c < x->n_doc; c++) /* back from RMS or mean to the sum over the Rs rows */
        sum[c] += x->p.solver.score == KF_SCORE_RMS ? (double)ts.score[c] * ts.score[c] * Rs : (double)ts.score[c] * Rs;
    return KF_OK;
}

/* AM's targets of head hs (kf_am_targets_compute's results, by summation order only): the fused
 * rows' from the pool x->tg (layer hs->l is the one held), the others' computed, the score over
 * all R rows. */
static kf_status head_targets(kf_compact_prep *x, head_shared *hs, kf_ws *ws, kf_error *err) {
    if (!x->tg.m)
        return kf_am_targets_compute_ws(&hs->h, x->p.solver.score, &hs->tg, ws, err);
    const int d = x->d, T = x->n_doc;
    const int64_t R = x->rq.R;
    const size_t r0 = kf_refq_targets_row0(&x->tg, hs->l, hs->g);
    hs->tg = (kf_am_targets){x->tg.m + r0, x->tg.y + r0, x->tg.Y + r0 * d, kf_ws_alloc(ws, T, sizeof(float))};
    hs->tg_view = 1;
    const size_t mark = kf_ws_mark(ws);
    double *sum = kf_ws_alloc(ws, T, sizeof(double)); /* [T] */
    if (!hs->tg.score || !sum) {
        head_targets_free(hs);
        return kf_fail(err, KF_ERR_NOMEM, "compact: the workspace is too small for a head's scores");
    }
    memcpy(sum, kf_refq_targets_score(&x->tg, hs->l, hs->g), sizeof(double) * T);
    int64_t n_un = 0;
    for (int64_t p = 0; p < x->rq.n_pos; p++)
        n_un += !x->tg.fused[p];
    kf_status rc = n_un > 0 ? unfused_targets(x, hs, n_un, sum, ws, err) : KF_OK;
    for (int c = 0; c < T; c++)
        hs->tg.score[c] = (float)(x->p.solver.score == KF_SCORE_RMS ? sqrt(sum[c] / R) : sum[c] / R);
    kf_ws_reset(ws, mark);
    if (rc != KF_OK)
        head_targets_free(hs);
    return rc;
}

/* Head (l, g)'s held-out rows' own-prompt attention in the pool, into *own; NULL: none kept. */
static own_rows *own_view(const kf_refq_targets *tg, int l, int g, own_rows *own) {
    if (!tg->am)
        return NULL;
    const size_t r0 = kf_refq_targets_own_row0(tg, l, g);
    *own = (own_rows){tg->am + r0, tg->ay + r0, tg->aY + r0 * tg->head_dim, tg->own_slot, tg->own_done, tg->n_own};
    return own;
}

kf_status kf_head_prepare(kf_compact_prep *x, int l, int g, const float *K, const float *V, head_split *sp,
                          head_shared *hs, kf_ws *ws, int t_max, kf_error *err) {
    const size_t row = (size_t)x->kvh * x->d;
    memset(hs, 0, sizeof *hs);
    hs->l = l, hs->g = g;
    if (x->rq.qh && !(hs->q_own = kf_ws_alloc(ws, x->rq.R * x->d, sizeof(float))))
        return kf_fail(err, KF_ERR_NOMEM, "compact: the workspace is too small for a head's reference queries");
    hs->q = kf_refq_head(&x->rq, l, g, hs->q_own);
    hs->h = (kf_am_head){.k = K + (size_t)x->n_pre * row + (size_t)g * x->d, .k_stride = row,
                         .v = V + (size_t)x->n_pre * row + (size_t)g * x->d, .v_stride = row,
                         .T = x->n_doc, .q = hs->q, .R = (int)x->rq.R, .d = x->d, .scale = x->scale,
                         .be = kf_model_backend(x->m)};
    double ts = now_s();
    kf_status rc = head_targets(x, hs, ws, err);
    if (rc == KF_OK && !sp && (rc = head_check_finite(x, l, g, K, V, hs->q, &hs->tg, NULL, err)) != KF_OK)
        head_targets_free(hs);
    if (rc != KF_OK)
        return rc;
    hs->targets_s = now_s() - ts;
    if (!sp)
        return KF_OK;
    ts = now_s();
    own_rows own, *ow = own_view(&x->tg, l, g, &own);
    kf_split_head(sp, &x->rq, hs->q, &hs->tg, x->is_val, x->tr_order, x->pos_src, x->pos_local, &x->ap, ow, g);
    /* the original block's attention on the validation rows is their targets; their prompts' the
     * source forwards' where they made it */
    rc = kf_val_head_init_targets(&hs->vh, hs->h.be, sp->val_q, (int)sp->n_score, x->d, x->scale, sp->val_w, sp->val_m,
                                  sp->val_y, sp->val_Y, sp->val_app, sp->val_vis, ow ? sp->val_lse_a : NULL,
                                  sp->val_oa, t_max, ws, err);
    if (rc == KF_OK && (rc = head_check_finite(x, l, g, K, V, hs->q, &hs->tg, &hs->vh, err)) != KF_OK)
        kf_val_head_free(&hs->vh);
    if (rc != KF_OK) {
        head_targets_free(hs);
        return rc;
    }
    hs->sp = sp;
    hs->split_s = now_s() - ts;
    return KF_OK;
}

void kf_head_release(head_shared *hs) {
    head_targets_free(hs);
    hs->q_own = NULL; /* the workspace's */
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

/* The training rows from..to - 1 the choice's fits do not cover, as a head and targets (their
 * part of the refit). */
static void rest_rows(const head_shared *hs, int from, int to, kf_am_head *hr, kf_am_targets *tr) {
    const head_split *sp = hs->sp;
    const int d = hs->h.d;
    *hr = hs->h;
    hr->q = sp->tr_q + (size_t)from * d, hr->R = to - from;
    *tr = (kf_am_targets){sp->tr_m + from, sp->tr_y + from, sp->tr_Y + (size_t)from * d, NULL};
}

/* The parts of the refit of a head of t kept keys beyond the choice's first `rows` training rows,
 * into hv/tv [2]: the training rows up to kf_refit_rows (when more), then the validation rows;
 * returns how many. */
static int refit_parts(const kf_compact_params *p, const head_shared *hs, int rows, int t, kf_am_head *hv,
                       kf_am_targets *tv) {
    const int to = kf_refit_rows(p, (int)hs->sp->n_tr, t);
    int n = 0;
    if (rows < to)
        rest_rows(hs, rows, to, &hv[n], &tv[n]), n++;
    val_rows(hs, &hv[n], &tv[n]), n++;
    return n;
}

/* The picked candidate's beta: from the choice's normal equations (plus the other training rows'
 * and the validation rows' parts with refit_all) when it kept them, else fitted on hf/tf. */
static kf_status fit_beta(const variant_ws *w, const head_shared *hs, const kf_am_head *hf, const kf_am_targets *tf,
                          kf_choice_fits *fits, int th, uint64_t seed, kf_ws *ws, kf_error *err) {
    const kf_compact_params *p = &w->p;
    kf_am_stats *st = &w->out->stats.solver;
    if (!fits || !fits->beta.G)
        return kf_am_fit_beta_ex(hf, tf, w->sel, th, seed, p->solver.beta_fit, w->beta, st, ws, err);
    if (p->choice.refit_all) { /* the other training rows, then the validation rows */
        kf_am_head hv[2];
        kf_am_targets tv[2];
        const int n = refit_parts(p, hs, fits->rows, th, hv, tv);
        KF_TRY(kf_choice_refit_add(fits, KF_REFIT_ADD_BETA, hv, tv, n, w->kc, th, ws, err));
    }
    return kf_am_fit_beta_normal(&fits->beta, seed, p->solver.beta_fit, w->beta, st, ws, err);
}

/* The values for keys kk [th, d] (bias: am's beta): drop's from the choice's normal equations
 * (plus the other training rows' and the validation rows' parts with refit_all) when it kept
 * them, else fitted on hf/tf. */
static kf_status fit_values(const kf_compact_prep *x, variant_ws *w, const head_shared *hs, const kf_am_head *hf,
                            const kf_am_targets *tf, kf_choice_fits *fits, kf_method method, const float *kk,
                            double alpha, int th, kf_ws *ws, kf_error *err) {
    const kf_compact_params *p = &w->p;
    const float *v0 = p->solver.ridge_to == KF_RIDGE_TO_ORIG ? w->vo : NULL;
    kf_am_stats *st = &w->out->stats.solver;
    if (method != KF_METHOD_DROP || !fits || !fits->drop.G)
        return kf_am_fit_values_ridge(hf->be, hf->q, hf->R, x->d, x->scale, kk, x->d,
                                      method == KF_METHOD_AM ? w->beta : NULL, th, tf->Y, alpha, v0, x->d, w->vals, st,
                                      ws, err);
    if (p->choice.refit_all) { /* the other training rows, then the validation rows */
        kf_am_head hv[2];
        kf_am_targets tv[2];
        const int n = refit_parts(p, hs, fits->rows, th, hv, tv);
        KF_TRY(kf_choice_refit_add(fits, KF_REFIT_ADD_DROP, hv, tv, n, kk, th, ws, err));
    }
    return kf_value_gram_solve(&fits->drop, alpha, v0, x->d, w->vals, st, err);
}

/* The picked candidate of the method (am, fold) with the values refitted alone on all the rows
 * (KF_REFIT_VALUES): its beta and fold direction the choice's (fits->win_*), its keys folded along
 * it as in the choice, its values from the choice's normal equations plus the other training rows'
 * and the validation rows' parts; then written. */
static kf_status variant_fit_win(const kf_compact_prep *x, variant_ws *w, const head_shared *hs,
                                 const kf_head_pick *pick, kf_choice_fits *fits, int th, kf_ws *ws, kf_error *err) {
    kf_compacted *out = w->out;
    const int d = x->d, hi = hs->l * x->kvh + hs->g;
    const float *v0 = w->p.solver.ridge_to == KF_RIDGE_TO_ORIG ? w->vo : NULL;
    const float *kk = w->kc; /* [th, d] keys the values are fitted for */
    float *u = out->u + (size_t)hi * d;
    memcpy(w->beta, fits->win_beta, sizeof(float) * (size_t)th);
    kf_am_stats *st = &out->stats.solver; /* the shipped beta's fit: the choice's */
    st->beta_fallbacks += fits->win_beta_stats.beta_fallbacks;
    st->beta_restarts += fits->win_beta_stats.beta_restarts;
    st->failures += fits->win_beta_stats.failures;
    memset(u, 0, sizeof(float) * d); /* u = 0 unless folded */
    if (pick->method == KF_METHOD_FOLD) {
        memcpy(u, fits->win_u, sizeof(float) * d);
        kf_fold_keys(w->kc, d, w->beta, th, d, x->scale, u, w->kfold, d);
        kk = w->kfold;
        w->folded++;
        w->var_sum += fits->win_var_gain;
        out->var_gain[hi] = (float)fits->win_var_gain;
    }
    const double ts = now_s();
    kf_am_head hv[2];
    kf_am_targets tv[2];
    const int n = refit_parts(&w->p, hs, fits->rows, th, hv, tv);
    KF_TRY(kf_choice_refit_add(fits, KF_REFIT_ADD_WIN, hv, tv, n, kk, th, ws, err));
    KF_TRY(kf_value_gram_solve(&fits->win, pick->alpha, v0, x->d, w->vals, &out->stats.solver, err));
    out->stats.values_s += now_s() - ts;
    out->stats.heads_ridged += pick->alpha > 0;
    out->head_alpha[hi] = (float)pick->alpha;
    write_head(x, w, hs, pick->method, kk, th);
    return KF_OK;
}

/* beta, the fold and the values of the picked candidate, fitted on hf/tf (or from what the
 * choice kept in fits, NULL: nothing), then written. */
static kf_status variant_fit(const kf_compact_prep *x, variant_ws *w, const head_shared *hs, const kf_am_head *hf,
                             const kf_am_targets *tf, const kf_head_pick *pick, kf_choice_fits *fits, int th,
                             float *qsub, kf_ws *ws, kf_error *err) {
    kf_compacted *out = w->out;
    const kf_compact_params *p = &w->p;
    const int d = x->d, hi = hs->l * x->kvh + hs->g;
    kf_method method = pick->method;
    if (fits && fits->win.G && p->choice.refit_all == KF_REFIT_VALUES && fits->win_method == method &&
        (method == KF_METHOD_AM || method == KF_METHOD_FOLD))
        return variant_fit_win(x, w, hs, pick, fits, th, ws, err);
    double ts = now_s();
    if (method != KF_METHOD_KEEP && method != KF_METHOD_DROP) {
        KF_TRY(fit_beta(w, hs, hf, tf, fits, th, p->solver.seed + (uint64_t)hi, ws, err));
        out->stats.beta_s += now_s() - ts;
    }
    const float *kk = w->kc; /* [th, d] keys the values are fitted for */
    float *u = out->u + (size_t)hi * d;
    memset(u, 0, sizeof(float) * d); /* u = 0 unless folded */
    if (method == KF_METHOD_FOLD) {
        ts = now_s();
        const int on_probes = p->solver.fold_queries == KF_FOLD_ON_PROBES;
        const int fR = on_probes ? probe_rows(&x->rq, hs->q, d, qsub) : hf->R;
        kf_fold_info fi;
        KF_TRY(fold_selection(hf->be, on_probes ? qsub : hf->q, fR, d, x->scale, pick->lambda, w->kc, w->beta, th, u,
                              w->kfold, &fi, ws, err));
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
        KF_TRY(fit_values(x, w, hs, hf, tf, fits, method, kk, pick->alpha, th, ws, err));
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
static kf_status variant_head(const kf_compact_prep *x, variant_ws *w, head_shared *hs, float *qsub, kf_ws *ws,
                              kf_error *err) {
    kf_compacted *out = w->out;
    const kf_compact_params *p = &w->p;
    const int d = x->d, hi = hs->l * x->kvh + hs->g;
    const size_t row = (size_t)x->kvh * d;
    double ts = now_s();
    /* am pads a smaller head with no-weight slots; the bias-free methods keep t keys */
    const int th = p->method == KF_METHOD_AM ? w->budgets[hi] : w->t;
    KF_TRY(kf_am_select(hs->tg.score, x->n_doc, th, w->sel, ws, err));
    out->stats.select_s += hs->targets_s + (now_s() - ts);
    for (int j = 0; j < th; j++) { /* the kept keys and their original values */
        memcpy(w->kc + (size_t)j * d, hs->h.k + (size_t)w->sel[j] * row, sizeof(float) * d);
        memcpy(w->vo + (size_t)j * d, hs->h.v + (size_t)w->sel[j] * row, sizeof(float) * d);
    }
    kf_head_pick pick = {p->method, p->solver.lambda_rel, p->solver.value_ridge, 0};
    kf_am_head hf = hs->h; /* the rows the final beta, u and values are fitted on */
    kf_am_targets tf = hs->tg;
    kf_choice_fits fits = {0}; /* what the choice keeps for the refit */
    if (w->choice) {
        ts = now_s();
        const head_split *sp = hs->sp;
        kf_am_head htr = hs->h;
        htr.q = sp->tr_q, htr.R = (int)sp->n_tr;
        kf_am_targets ttr = {sp->tr_m, sp->tr_y, sp->tr_Y, NULL};
        KF_TRY(kf_choose_head(p, &htr, &ttr, w->sel, th, w->kc, w->vo, &hs->vh, p->solver.seed + (uint64_t)hi, &pick, &fits,
                              ws, err));
        if (!p->choice.refit_all) { /* ship the fit that was validated: on the training rows' subsample */
            hf = htr, tf = ttr;
            hf.R = kf_choice_rows(p, htr.R, th);
        }
        out->stats.choice_s += hs->split_s + (now_s() - ts);
    }
    kf_status rc = variant_fit(x, w, hs, &hf, &tf, &pick, w->choice ? &fits : NULL, th, qsub, ws, err);
    kf_choice_fits_free(&fits);
    if (rc == KF_OK)
        rc = head_output_check(x, w, hs, th, err);
    return rc;
}

kf_status kf_head_variant(const kf_compact_prep *x, variant_ws *w, head_shared *hs, float *qsub, kf_ws *ws,
                          kf_error *err) {
    const size_t mark = kf_ws_mark(ws);
    const kf_status rc = variant_head(x, w, hs, qsub, ws, err);
    kf_ws_reset(ws, mark); /* the next variant reuses the scratch */
    return rc;
}
