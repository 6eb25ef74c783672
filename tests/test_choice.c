/* The per-head choice's building blocks (the same results, computed faster): the
 * validation head's appended and original attention, the validation error, and the fits that
 * share work, each against an independent fp64 reference computed here. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lapacke.h>

#include "compactor/am.h"
#include "compactor/compact.h"
#include "compactor/diag.h"
#include "compactor/fold.h"
#include "compactor/refq.h"
#include "kernels/base/convert.h"
#include "test_util.h"

/* ---- fp64 references ---- */

/* Attention of q [d] over the first n keys of b (bias included): lse and out [d]; -inf, 0 when n = 0. */
static double ref_attend(const float *q, int d, double scale, const kf_kv_block *b, int n, double *out) {
    double *z = malloc(sizeof(double) * (size_t)(n ? n : 1)), mx = -INFINITY, sum = 0;
    for (int j = 0; j < n; j++) {
        double dot = 0;
        for (int c = 0; c < d; c++)
            dot += (double)q[c] * b->k[(size_t)j * b->stride + c];
        z[j] = scale * dot + (b->beta ? b->beta[j] : 0.0);
        mx = fmax(mx, z[j]);
    }
    memset(out, 0, sizeof(double) * d);
    for (int j = 0; j < n; j++) {
        const double e = exp(z[j] - mx);
        sum += e;
        for (int c = 0; c < d; c++)
            out[c] += e * b->v[(size_t)j * b->stride + c];
    }
    for (int c = 0; c < d && n > 0; c++)
        out[c] /= sum;
    free(z);
    return n > 0 ? mx + log(sum) : -INFINITY;
}

/* The output over [block | appended] from the two blocks' lse and outputs. */
static void ref_mix(double lb, const double *ob, double la, const double *oa, int d, double *out) {
    const double m = fmax(lb, la), wb = exp(lb - m), wa = isinf(la) ? 0 : exp(la - m);
    for (int c = 0; c < d; c++)
        out[c] = (wb * ob[c] + wa * oa[c]) / (wb + wa);
}

/* ---- a validation head with several appended blocks ---- */

enum { D = 16, T = 90, NV = 300, NB = 3 };

typedef struct {
    float K[T * D], V[T * D], Q[NV * D];
    float AK[NB][200 * D], AV[NB][200 * D];
    kf_kv_block orig, blocks[NB];
    const kf_kv_block *app[NV];
    int vis[NV];
    double w[NV];
} val_case;

/* Row i's fp64 reference: its appended block (LSE returned, output oa; -inf and zeros without
 * one), the original block (ob) and the two mixed (of). */
static double ref_row(const val_case *c, float scale, int i, double *oa, double *ob, double *of) {
    const float *q = c->Q + (size_t)i * D;
    const double la = c->app[i] ? ref_attend(q, D, scale, c->app[i], c->vis[i], oa) : -INFINITY;
    if (!c->app[i])
        memset(oa, 0, sizeof(double) * D);
    ref_mix(ref_attend(q, D, scale, &c->orig, T, ob), ob, la, oa, D, of);
    return la;
}

/* Rows interleaved over three appended blocks (of 200, 150 and 7 keys: more rows than one tile on
 * the first), every 11th row without one; visible counts from 1 to the whole block. */
static void make_case(val_case *c) {
    static const int nb[NB] = {200, 150, 7};
    kf_test_fill_uniform(c->K, T * D, 1401, -1, 1);
    kf_test_fill_uniform(c->V, T * D, 1402, -1, 1);
    kf_test_fill_uniform(c->Q, NV * D, 1403, -2, 2);
    c->orig = (kf_kv_block){c->K, c->V, D, NULL, T};
    for (int b = 0; b < NB; b++) {
        kf_test_fill_uniform(c->AK[b], (size_t)nb[b] * D, 1410 + b, -1.5f, 1.5f);
        kf_test_fill_uniform(c->AV[b], (size_t)nb[b] * D, 1420 + b, -1, 1);
        c->blocks[b] = (kf_kv_block){c->AK[b], c->AV[b], D, NULL, nb[b]};
    }
    for (int i = 0; i < NV; i++) {
        const int b = (i * 7) % NB;
        c->app[i] = i % 11 == 5 ? NULL : &c->blocks[b];
        c->vis[i] = 1 + (int)(((unsigned)i * 2654435761u) % (unsigned)nb[b]);
        if (i % 13 == 0)
            c->vis[i] = nb[b];
        c->w[i] = 1 + i % 3;
    }
}

static void test_val_head_appended(void) {
    val_case *c = malloc(sizeof *c);
    make_case(c);
    const float scale = 0.35f;
    kf_val_head vh;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_val_head_init(&vh, NULL, c->Q, NV, D, scale, c->w, &c->orig, c->app, c->vis, &err), KF_OK);
    double oa[D], ob[D], of[D], worst_o = 0, worst_l = 0, worst_f = 0;
    int lse_inf_ok = 1;
    for (int i = 0; i < NV; i++) {
        const double la = ref_row(c, scale, i, oa, ob, of);
        if (isinf(la))
            lse_inf_ok &= isinf(vh.lse_a[i]) && vh.lse_a[i] < 0;
        else
            worst_l = fmax(worst_l, fabs(vh.lse_a[i] - la));
        for (int k = 0; k < D; k++) {
            worst_o = fmax(worst_o, fabs(vh.o_a[(size_t)i * D + k] - oa[k]));
            worst_f = fmax(worst_f, fabs(vh.o_full[(size_t)i * D + k] - of[k]));
        }
    }
    printf("\n    appended: max |lse - ref| %.2e, |o_a - ref| %.2e; |o_full - ref| %.2e\n", worst_l, worst_o, worst_f);
    CU_ASSERT(lse_inf_ok);
    CU_ASSERT(worst_l < 1e-5);
    CU_ASSERT(worst_o < 1e-5);
    CU_ASSERT(worst_f < 1e-5);
    double ws = 0;
    for (int i = 0; i < NV; i++)
        ws += vh.w[i];
    CU_ASSERT(fabs(ws - 1) < 1e-12);
    /* the same head from AM's targets of these rows instead of the original block's attention */
    kf_am_head h = {c->K, D, c->V, D, T, c->Q, NV, D, scale, NULL};
    kf_am_targets tg;
    kf_val_head vt;
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(
        kf_val_head_init_targets(&vt, NULL, c->Q, NV, D, scale, c->w, tg.m, tg.y, tg.Y, c->app, c->vis, NULL, NULL, 0, NULL, &err),
        KF_OK);
    double worst_t = 0;
    for (size_t k = 0; k < (size_t)NV * D; k++)
        worst_t = fmax(worst_t, fabs(vt.o_full[k] - vh.o_full[k]));
    printf("    from the targets: max |o_full - computed| %.2e\n", worst_t);
    CU_ASSERT(worst_t < 1e-5);
    kf_val_head_free(&vt);
    kf_am_targets_free(&tg);
    kf_val_head_free(&vh);
    free(c);
}

/* The weighted mean relative error of a candidate (keys with a bias, values) against fp64. */
static double ref_val_err(const val_case *c, float scale, const kf_kv_block *comp) {
    double wsum = 0, e = 0, oa[D], ob[D], of[D], oc[D], mc[D];
    for (int i = 0; i < NV; i++)
        wsum += c->w[i];
    for (int i = 0; i < NV; i++) {
        const float *q = c->Q + (size_t)i * D;
        const double la = ref_row(c, scale, i, oa, ob, of);
        const double lc = ref_attend(q, D, scale, comp, comp->n, oc);
        ref_mix(lc, oc, la, oa, D, mc);
        double num = 0, den = 0;
        for (int k = 0; k < D; k++)
            num += (mc[k] - of[k]) * (mc[k] - of[k]), den += of[k] * of[k];
        e += c->w[i] / wsum * sqrt(num / den);
    }
    return e;
}

static void test_val_err_reference(void) {
    val_case *c = malloc(sizeof *c);
    make_case(c);
    const float scale = 0.35f;
    enum { t = 20 };
    float beta[t], v1[t * 4 * D], v2[t * 4 * D]; /* row stride 4 D, as the keys */
    kf_test_fill_uniform(beta, t, 1431, -1, 1);
    kf_test_fill_uniform(v1, t * 4 * D, 1432, -1, 1);
    kf_test_fill_uniform(v2, t * 4 * D, 1433, -1, 1);
    kf_val_head vh;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_val_head_init(&vh, NULL, c->Q, NV, D, scale, c->w, &c->orig, c->app, c->vis, &err), KF_OK);
    /* keys: every fourth original key; two value sets on the same keys and bias */
    const kf_kv_block c1 = {c->K, v1, 4 * D, beta, t}, c2 = {c->K, v2, 4 * D, beta, t};
    const double r1 = ref_val_err(c, scale, &c1), r2 = ref_val_err(c, scale, &c2);
    const double e1 = kf_val_err(&vh, &c1);
    CU_ASSERT_EQUAL_FATAL(kf_val_attend(&vh, &c1), 0);
    const double e1b = kf_val_err_values(&vh, v1, 4 * D), e2 = kf_val_err_values(&vh, v2, 4 * D);
    printf("\n    val_err %.9f (ref %.9f), shared weights %.9f, other values %.9f (ref %.9f)\n", e1, r1, e1b, e2, r2);
    CU_ASSERT(fabs(e1 - r1) < 1e-5 * r1);
    CU_ASSERT(e1b == e1);
    CU_ASSERT(fabs(e2 - r2) < 1e-5 * r2);
    CU_ASSERT(fabs(r1 - r2) > 1e-3); /* the two value sets do differ */
    kf_val_head_free(&vh);
    free(c);
}


/* kf_val_attend keeps each row's mixing weights and the head its rows' ||o_full||^2 for every value
 * set scored after it: scoring a second candidate on a head that scored another must
 * give the bits a fresh head gives it, and what is cached must be what it replaces. */
static void test_val_cache_fresh(void) {
    val_case *c = malloc(sizeof *c);
    make_case(c);
    const float scale = 0.35f;
    enum { t = 20 };
    float b1[t], b2[t], v1[t * D], v2[t * D];
    kf_test_fill_uniform(b1, t, 1441, -1, 1);
    kf_test_fill_uniform(b2, t, 1442, -3, 1);
    kf_test_fill_uniform(v1, t * D, 1443, -1, 1);
    kf_test_fill_uniform(v2, t * D, 1444, -1, 1);
    kf_val_head used, fresh;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_val_head_init(&used, NULL, c->Q, NV, D, scale, c->w, &c->orig, c->app, c->vis, &err),
                          KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_val_head_init(&fresh, NULL, c->Q, NV, D, scale, c->w, &c->orig, c->app, c->vis, &err),
                          KF_OK);
    const kf_kv_block c1 = {c->K, NULL, D, b1, t}, c2 = {c->K + 30 * D, NULL, D, b2, t};
    CU_ASSERT_EQUAL_FATAL(kf_val_attend(&used, &c1), 0);
    const double e1 = kf_val_err_values(&used, v1, D);
    CU_ASSERT_EQUAL_FATAL(kf_val_attend(&used, &c2), 0);
    const double e2 = kf_val_err_values(&used, v2, D), e2b = kf_val_err_values(&used, v1, D);
    CU_ASSERT_EQUAL_FATAL(kf_val_attend(&fresh, &c2), 0);
    const double f2 = kf_val_err_values(&fresh, v2, D), f2b = kf_val_err_values(&fresh, v1, D);
    printf("\n    second candidate %.17g (fresh head %.17g), first %.17g\n", e2, f2, e1);
    CU_ASSERT(e2 == f2 && e2b == f2b);
    CU_ASSERT(e1 != e2);
    /* the cached weights and norms are mix()'s, normalised: exp(lse - max) / their sum, and ||o_full||^2 */
    double worst_w = 0, worst_d = 0, ob[D];
    for (int i = 0; i < NV; i++) {
        const double lb = ref_attend(c->Q + (size_t)i * D, D, scale,
                                     &(kf_kv_block){c2.k, v2, D, b2, t}, t, ob), la = used.lse_a[i];
        const double m = fmax(lb, la), eb = exp(lb - m), ea = isinf(la) ? 0 : exp(la - m);
        const double wb = eb / (eb + ea), wa = ea / (eb + ea);
        worst_w = fmax(worst_w, fmax(fabs(used.lse_b[i] - wb), fabs(used.wa[i] - wa)));
        double den = 0;
        for (int k = 0; k < D; k++)
            den += (double)used.o_full[(size_t)i * D + k] * used.o_full[(size_t)i * D + k];
        worst_d = fmax(worst_d, fabs(used.den[i] - den) / den);
    }
    printf("    cached mixing weights vs fp64 %.1e, norms %.1e\n", worst_w, worst_d);
    CU_ASSERT(worst_w < 1e-5);
    CU_ASSERT(worst_d < 1e-12);
    kf_val_head_free(&used);
    kf_val_head_free(&fresh);
    free(c);
}


/* ---- normal equations of disjoint row sets add up (the refit reuses the choice's) ---- */

enum { NT = 60, ND = 8, NR = 150, NTR = 100, NK = 12 };

/* fp64 reference of one row set: the beta fit's G_M, b_M, yy and the value refit's G_X, B_X over
 * the kept keys kc (no bias). */
static void ref_normal(const float *Q, const kf_am_targets *tg, int r0, int r1, const float *kc, float scale,
                       double *GM, double *bM, double *yy, double *GX, double *BX) {
    memset(GM, 0, sizeof(double) * NK * NK), memset(bM, 0, sizeof(double) * NK), *yy = 0;
    memset(GX, 0, sizeof(double) * NK * NK), memset(BX, 0, sizeof(double) * NK * ND);
    for (int i = r0; i < r1; i++) {
        double z[NK], M[NK], X[NK], mx = -INFINITY, sum = 0;
        for (int j = 0; j < NK; j++) {
            double dot = 0;
            for (int c = 0; c < ND; c++)
                dot += (double)Q[i * ND + c] * kc[j * ND + c];
            z[j] = scale * dot;
            mx = fmax(mx, z[j]);
            M[j] = exp(z[j] - tg->m[i]);
        }
        for (int j = 0; j < NK; j++)
            sum += exp(z[j] - mx);
        for (int j = 0; j < NK; j++) /* the values' weights rounded to bf16, as the fit takes them */
            X[j] = kf_bf16_to_f32(kf_f32_to_bf16((float)(exp(z[j] - mx) / sum)));
        *yy += (double)tg->y[i] * tg->y[i];
        for (int a = 0; a < NK; a++) {
            bM[a] += M[a] * tg->y[i];
            for (int b = 0; b < NK; b++)
                GM[a * NK + b] += M[a] * M[b], GX[a * NK + b] += X[a] * X[b];
            for (int c = 0; c < ND; c++)
                BX[a * ND + c] += X[a] * kf_bf16_to_f32(kf_f32_to_bf16(tg->Y[i * ND + c])); /* targets too */
        }
    }
}

static double rel_diff(const double *a, const double *b, int n) {
    double num = 0, den = 0;
    for (int k = 0; k < n; k++)
        num = fmax(num, fabs(a[k] - b[k])), den = fmax(den, fabs(b[k]));
    return den > 0 ? num / den : num;
}

static void test_normal_equations_add(void) {
    float K[NT * ND], V[NT * ND], Q[NR * ND], kc[NK * ND], beta_all[NK], beta_sum[NK], v_all[NK * ND], v_sum[NK * ND];
    kf_test_fill_uniform(K, NT * ND, 1501, -1, 1);
    kf_test_fill_uniform(V, NT * ND, 1502, -1, 1);
    kf_test_fill_uniform(Q, NR * ND, 1503, -1.5f, 1.5f);
    for (int i = 0; i < NR; i++)
        Q[i * ND] += 1.0f; /* a common direction: a peaked, uneven attention */
    const float scale = 0.6f;
    kf_am_head h = {K, ND, V, ND, NT, Q, NR, ND, scale, NULL};
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    int32_t sel[NK];
    CU_ASSERT_EQUAL_FATAL(kf_am_select(tg.score, NT, NK, sel, NULL, &err), KF_OK);
    for (int j = 0; j < NK; j++)
        memcpy(kc + j * ND, K + sel[j] * ND, sizeof(float) * ND);
    /* training rows [0, NTR), validation rows [NTR, NR): heads and targets over each */
    kf_am_head htr = h, hv = h;
    htr.R = NTR, hv.q = Q + NTR * ND, hv.R = NR - NTR;
    kf_am_targets tv = {tg.m + NTR, tg.y + NTR, tg.Y + NTR * ND, NULL};
    kf_beta_normal bn, part;
    kf_value_gram gm, gpart;
    CU_ASSERT_EQUAL_FATAL(kf_beta_normal_build(&htr, &tg, kc, NK, &bn, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_beta_normal_build(&hv, &tv, kc, NK, &part, NULL, &err), KF_OK);
    kf_beta_normal_add(&bn, &part);
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, Q, NTR, ND, scale, kc, ND, NULL, NK, tg.Y, &gm, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, hv.q, hv.R, ND, scale, kc, ND, NULL, NK, tv.Y, &gpart, NULL, &err),
                          KF_OK);
    kf_value_gram_add(&gm, &gpart);
    double GM[NK * NK], bM[NK], yy, GX[NK * NK], BX[NK * ND], tr = 0;
    ref_normal(Q, &tg, 0, NR, kc, scale, GM, bM, &yy, GX, BX);
    for (int j = 0; j < NK; j++)
        tr += GX[j * NK + j];
    const double eG = rel_diff(bn.G, GM, NK * NK), eb = rel_diff(bn.b, bM, NK), ey = fabs(bn.yy - yy) / yy;
    const double eGX = rel_diff(gm.G, GX, NK * NK), eBX = rel_diff(gm.B, BX, NK * ND), etr = fabs(gm.tr - tr) / tr;
    printf("\n    train + validation vs fp64 over all rows: beta G %.1e b %.1e yy %.1e; values G %.1e B %.1e tr %.1e",
           eG, eb, ey, eGX, eBX, etr);
    CU_ASSERT(eG < 1e-5 && eb < 1e-5 && ey < 1e-6);
    CU_ASSERT(eGX < 1e-5 && eBX < 1e-5 && etr < 1e-6);
    /* and the fits from the sums equal the fits on all the rows */
    CU_ASSERT_EQUAL(kf_am_fit_beta_normal(&bn, 7, KF_BETA_AM, beta_sum, NULL, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_beta(&h, &tg, sel, NK, 7, beta_all, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_value_gram_solve(&gm, 1e-3, V, ND, v_sum, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(
        kf_am_fit_values_ridge(NULL, Q, NR, ND, scale, kc, ND, NULL, NK, tg.Y, 1e-3, V, ND, v_all, NULL, NULL, &err),
        KF_OK);
    double db = 0, dv = 0, mb = 0;
    for (int j = 0; j < NK; j++)
        db = fmax(db, fabs(beta_sum[j] - beta_all[j])), mb = fmax(mb, fabs(beta_all[j]));
    for (int k = 0; k < NK * ND; k++)
        dv = fmax(dv, fabs(v_sum[k] - v_all[k]));
    printf("\n    fits from the sums vs on all rows: max |d beta| %.1e (max |beta| %.2f), max |d values| %.1e\n", db, mb,
           dv);
    CU_ASSERT(mb > 0.05); /* the fit moved off beta = 0 */
    CU_ASSERT(db < 1e-4);
    CU_ASSERT(dv < 1e-4);
    /* one pass for both (the choice's) == the two builds, over all the rows */
    kf_beta_normal b1, b2;
    kf_value_gram g1, g2;
    CU_ASSERT_EQUAL_FATAL(kf_kept_normal_build(&h, &tg, kc, NK, NULL, &b1, &g1, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_beta_normal_build(&h, &tg, kc, NK, &b2, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, Q, NR, ND, scale, kc, ND, NULL, NK, tg.Y, &g2, NULL, &err), KF_OK);
    const double e1 = rel_diff(b1.G, b2.G, NK * NK), e2 = rel_diff(b1.b, b2.b, NK);
    const double e3 = rel_diff(g1.G, g2.G, NK * NK), e4 = rel_diff(g1.B, g2.B, NK * ND);
    printf("    one pass vs two builds: %.1e %.1e %.1e %.1e, yy %.1e tr %.1e\n", e1, e2, e3, e4, b1.yy - b2.yy,
           g1.tr - g2.tr);
    CU_ASSERT(e1 < 1e-12 && e2 < 1e-12 && e3 < 1e-12 && e4 < 1e-12);
    CU_ASSERT(fabs(b1.yy - b2.yy) < 1e-12 * b2.yy && fabs(g1.tr - g2.tr) < 1e-12 * g2.tr);
    kf_beta_normal_free(&b1), kf_beta_normal_free(&b2);
    kf_value_gram_free(&g1), kf_value_gram_free(&g2);
    kf_beta_normal_free(&bn), kf_beta_normal_free(&part);
    kf_value_gram_free(&gm), kf_value_gram_free(&gpart);
    kf_am_targets_free(&tg);
}

/* The choice's candidates share one gram and one set of row tiles per head: a gram
 * rebuilt in place for other keys, after another candidate, must hold what a fresh build holds,
 * bit for bit (also on no rows), and the kept keys' one pass with the shared tiles what it gives
 * with its own. */
static void test_gram_rebuild_fresh(void) {
    enum { R = 600, d = 8, t = 12 }; /* R: three row tiles, the last one partial */
    float *Q = malloc(sizeof(float) * R * d), *Y = malloc(sizeof(float) * R * d), k1[t * d], k2[t * d], b1[t];
    kf_test_fill_uniform(Q, R * d, 1601, -1.5f, 1.5f);
    kf_test_fill_uniform(Y, R * d, 1602, -1, 1);
    kf_test_fill_uniform(k1, t * d, 1603, -1, 1);
    kf_test_fill_uniform(k2, t * d, 1604, -1, 1);
    kf_test_fill_uniform(b1, t, 1605, -2, 2);
    const float scale = 0.7f;
    kf_error err = {0};
    kf_gram_tiles w;
    kf_value_gram g, fresh, zero;
    CU_ASSERT_EQUAL_FATAL(kf_gram_tiles_alloc(&w, t, d, 1, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_alloc(&g, NULL, t, d, NULL), 0);
    kf_value_gram_rebuild(Q, R, scale, k1, d, b1, Y, &w, &g); /* the first candidate */
    const double tr1 = g.tr;
    kf_value_gram_rebuild(Q, R, scale, k2, d, NULL, Y, &w, &g); /* the second, in place */
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, Q, R, d, scale, k2, d, NULL, t, Y, &fresh, NULL, &err), KF_OK);
    int same = memcmp(g.G, fresh.G, sizeof(double) * t * t) == 0 && memcmp(g.B, fresh.B, sizeof(double) * t * d) == 0;
    printf("\n    rebuilt gram == fresh build: %s (tr %.17g, the first candidate's %.17g)\n", same ? "yes" : "NO",
           g.tr, tr1);
    CU_ASSERT(same && g.tr == fresh.tr);
    CU_ASSERT(tr1 != fresh.tr);
    kf_value_gram_rebuild(Q, 0, scale, k1, d, b1, Y, &w, &g); /* no rows: zero, as a fresh build */
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, Q, 0, d, scale, k1, d, b1, t, Y, &zero, NULL, &err), KF_OK);
    CU_ASSERT(memcmp(g.G, zero.G, sizeof(double) * t * t) == 0 && memcmp(g.B, zero.B, sizeof(double) * t * d) == 0);
    /* the kept keys' one pass with the tiles the candidates used == with its own */
    kf_am_head h = {k1, d, k1, d, t, Q, R, d, scale, NULL};
    kf_am_targets tg;
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    kf_beta_normal bw, bo;
    kf_value_gram dw, dn;
    CU_ASSERT_EQUAL_FATAL(kf_kept_normal_build(&h, &tg, k2, t, &w, &bw, &dw, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_kept_normal_build(&h, &tg, k2, t, NULL, &bo, &dn, NULL, &err), KF_OK);
    CU_ASSERT(memcmp(bw.G, bo.G, sizeof(double) * t * t) == 0 && memcmp(bw.b, bo.b, sizeof(double) * t) == 0);
    CU_ASSERT(memcmp(dw.G, dn.G, sizeof(double) * t * t) == 0 && memcmp(dw.B, dn.B, sizeof(double) * t * d) == 0);
    kf_beta_normal_free(&bw), kf_beta_normal_free(&bo);
    kf_value_gram_free(&dw), kf_value_gram_free(&dn);
    kf_am_targets_free(&tg);
    kf_value_gram_free(&g), kf_value_gram_free(&fresh), kf_value_gram_free(&zero);
    kf_gram_tiles_free(&w);
    free(Q), free(Y);
}

/* The fold candidate's normal equations from the kept keys' logits and their rank-one change
 * (kf_value_gram_rebuild_folded) == a build on the folded keys themselves (within the fp32 rounding
 * of the logits, which the bf16 weights mostly hide); and the same bits whether the kept keys'
 * logits were kept for no rows, the first tile, or all of them (the rest computed again). */
static void test_gram_rebuild_folded(void) {
    enum { R = 1300, d = 8, t = 12 }; /* R: three row tiles, the last one partial */
    float *Q = malloc(sizeof(float) * R * d), *Y = malloc(sizeof(float) * R * d), kc[t * d], kf[t * d], beta[t], u[d];
    kf_test_fill_uniform(Q, R * d, 1701, -1.5f, 1.5f);
    kf_test_fill_uniform(kc, t * d, 1703, -1, 1);
    kf_test_fill_uniform(beta, t, 1704, -2, 2);
    kf_test_fill_uniform(u, d, 1705, -0.8f, 0.8f);
    const float scale = 0.7f;
    kf_fold_keys(kc, d, beta, t, d, scale, u, kf, d);
    kf_error err = {0};
    kf_am_head h = {kc, d, kc, d, t, Q, R, d, scale, NULL};
    kf_am_targets tg;
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    memcpy(Y, tg.Y, sizeof(float) * R * d);
    kf_value_gram ref, g[3];
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, Q, R, d, scale, kf, d, NULL, t, Y, &ref, NULL, &err), KF_OK);
    const int kept[3] = {0, KF_GRAM_TILE, R};
    for (int c = 0; c < 3; c++) {
        kf_gram_tiles w;
        kf_beta_normal bn;
        kf_value_gram drop;
        CU_ASSERT_EQUAL_FATAL(kf_gram_tiles_alloc(&w, t, d, 1, NULL), 0);
        CU_ASSERT_EQUAL_FATAL(kf_gram_tiles_keep_logits(&w, kept[c], NULL), 0);
        CU_ASSERT_EQUAL_FATAL(kf_kept_normal_build(&h, &tg, kc, t, &w, &bn, &drop, NULL, &err), KF_OK);
        CU_ASSERT_EQUAL_FATAL(kf_value_gram_alloc(&g[c], NULL, t, d, NULL), 0);
        kf_value_gram_rebuild_folded(Q, R, scale, kc, d, beta, u, Y, &w, &g[c]);
        kf_beta_normal_free(&bn), kf_value_gram_free(&drop), kf_gram_tiles_free(&w);
    }
    const double eG = rel_diff(g[2].G, ref.G, t * t), eB = rel_diff(g[2].B, ref.B, t * d);
    printf("\n    folded from the kept logits vs the folded keys' build: G %.1e, B %.1e\n", eG, eB);
    CU_ASSERT(eG < 1e-5 && eB < 1e-5);
    for (int c = 0; c < 2; c++) /* kept for none, one tile, all rows: the same bits */
        CU_ASSERT(memcmp(g[c].G, g[2].G, sizeof(double) * t * t) == 0 &&
                  memcmp(g[c].B, g[2].B, sizeof(double) * t * d) == 0 && g[c].tr == g[2].tr);
    for (int c = 0; c < 3; c++)
        kf_value_gram_free(&g[c]);
    kf_value_gram_free(&ref);
    /* what is kept: all the rows within 64 MiB (8k tokens at 0.1: 4,914 rows of 819 keys, 16 MB),
     * else whole tiles (32k: 64 MiB / (3,276 x 4 bytes) = 5,121 rows, ten tiles of them), else none */
    CU_ASSERT_EQUAL(kf_kept_logits_rows(4914, 819), 4914);
    CU_ASSERT_EQUAL(kf_kept_logits_rows(19656, 3276), 5120);
    CU_ASSERT_EQUAL(kf_kept_logits_rows(600000, 40000), 0);
    kf_am_targets_free(&tg);
    free(Q), free(Y);
}

/* ---- the subsampled choice: candidates on a subsample of the training rows ---- */

/* The training rows' order: a permutation of the rows not held out, the same for a seed and
 * another for another seed, every prefix holding each source kind in proportion (+-1 row). */
static void test_training_order_stratified(void) {
    enum { NP = 500, G = 2 };
    uint8_t kind[NP], is_val[NP];
    int64_t order[G * NP], again[G * NP], other[G * NP];
    int n_kind[3] = {0};
    for (int k = 0; k < NP; k++) {
        kind[k] = k < 100 ? KF_REFQ_CONTEXT : (k < 400 ? KF_REFQ_REPEAT : KF_REFQ_PROBE);
        is_val[k] = kind[k] != KF_REFQ_CONTEXT && k % 7 == 0;
        n_kind[kind[k]] += G * !is_val[k];
    }
    const int64_t n = kf_choice_training_order(NP, G, kind, is_val, 5, order);
    CU_ASSERT_EQUAL_FATAL(n, n_kind[0] + n_kind[1] + n_kind[2]);
    CU_ASSERT_EQUAL(kf_choice_training_order(NP, G, kind, is_val, 5, again), n);
    CU_ASSERT_EQUAL(kf_choice_training_order(NP, G, kind, is_val, 6, other), n);
    CU_ASSERT(memcmp(order, again, sizeof(int64_t) * (size_t)n) == 0);
    CU_ASSERT(memcmp(order, other, sizeof(int64_t) * (size_t)n) != 0);
    uint8_t seen[G * NP] = {0};
    int dup = 0, held = 0, ascending = 0, worst = 0;
    int cnt[3] = {0};
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = order[i];
        dup += seen[r]++, held += is_val[r % NP];
        ascending += i > 0 && r > order[i - 1];
        cnt[kind[r % NP]]++;
        for (int c = 0; c < 3; c++) { /* the prefix of i + 1 rows against its proportional share */
            const double want = (double)(i + 1) * n_kind[c] / (double)n;
            worst = fmax(worst, fabs(cnt[c] - want) > 1.0 ? 1 : 0);
        }
    }
    printf("\n    %lld training rows: duplicates %d, held-out %d, ascending steps %d, a prefix off its share by > 1: %s\n",
           (long long)n, dup, held, ascending, worst ? "YES" : "no");
    CU_ASSERT(dup == 0 && held == 0 && !worst);
    CU_ASSERT(ascending > n / 3 && ascending < 2 * n / 3); /* shuffled, not in row order */
}

/* The pick of the per-head choice on a planted head (all 200 rows) (test_util.h: kf_planted_init), and the
 * validation error of keep. */
static kf_head_pick planted_choice(int dup, float val_sign, kf_ridge_target to, double *err_out) {
    kf_planted_head ph;
    kf_planted_init(&ph, dup, val_sign, to, 200);
    kf_error err = {0};
    kf_head_pick pick = {KF_METHOD_KEEP, 0, 0, NAN};
    CU_ASSERT_EQUAL(
        kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, KF_PLANT_KEPT, ph.K, ph.V, &ph.vh, 1, &pick, NULL, NULL, &err),
        KF_OK);
    /* the errors of keep and of the winner, for the message */
    const kf_kv_block kb = {ph.K, ph.V, KF_PLANT_D, NULL, KF_PLANT_KEPT};
    *err_out = kf_val_err(&ph.vh, &kb);
    kf_planted_free(&ph);
    return pick;
}

static void test_head_choice_planted(void) {
    struct {
        int dup;
        float sign;
        kf_ridge_target to;
        kf_method want;
        const char *why;
    } cases[] = {
        {1, 1, KF_RIDGE_TO_ORIG, KF_METHOD_FOLD, "mass to restore, questions like the training queries"},
        {1, -1, KF_RIDGE_TO_ORIG, KF_METHOD_DROP, "mass to restore, questions whose gain q.u is -1"},
        {0, 1, KF_RIDGE_TO_ZERO, KF_METHOD_KEEP, "no mass lost: the original values are exact"},
    };
    for (int k = 0; k < 3; k++) {
        double keep_err;
        const kf_head_pick pk = planted_choice(cases[k].dup, cases[k].sign, cases[k].to, &keep_err);
        printf("\n    %s: picked %s (lambda %g, alpha %g, err %.2e; keep %.2e)", cases[k].why, kf_method_name(pk.method),
               pk.lambda, pk.alpha, pk.err, keep_err);
        CU_ASSERT_EQUAL(pk.method, cases[k].want);
        CU_ASSERT(pk.err <= keep_err);
    }
    printf("\n");
}

/* A head where one candidate is clearly best (the planted cases of test_head_choice_planted, with
 * five times the training rows): the choice on its subsample of them (choice_rows 4: 512 of 1000)
 * picks it as the choice on all of them does, and keeps its normal equations for the refit, naming
 * the rows they cover. */
static kf_head_pick planted_on(int dup, float val_sign, kf_ridge_target to, double choice_rows, int *rows, int *kept) {
    kf_planted_head ph; /* test_util.h */
    kf_planted_init(&ph, dup, val_sign, to, 1000);
    kf_error err = {0};
    kf_head_pick pick = {KF_METHOD_KEEP, 0, 0, NAN};
    ph.p.choice.choice_rows = choice_rows;
    *rows = kf_choice_rows(&ph.p, ph.h.R, KF_PLANT_KEPT);
    kf_choice_fits fits = {0};
    CU_ASSERT_EQUAL(
        kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, KF_PLANT_KEPT, ph.K, ph.V, &ph.vh, 1, &pick, &fits, NULL, &err),
        KF_OK);
    *kept = (fits.beta.G != NULL) + (fits.drop.G != NULL) + 10 * (fits.rows == *rows); /* what the refit reuses */
    kf_choice_fits_free(&fits);
    kf_planted_free(&ph);
    return pick;
}

static void test_subsampled_choice_planted(void) {
    struct {
        int dup;
        float sign;
        kf_ridge_target to;
        kf_method want;
    } cases[] = {
        {1, 1, KF_RIDGE_TO_ORIG, KF_METHOD_FOLD}, /* mass to restore, questions like the training rows */
        {1, -1, KF_RIDGE_TO_ORIG, KF_METHOD_DROP}, /* questions whose gain q.u is -1 */
        {0, 1, KF_RIDGE_TO_ZERO, KF_METHOD_KEEP}, /* no mass lost: the original values are exact */
    };
    for (int k = 0; k < 3; k++) {
        int n_sub, n_all, kept_sub, kept_all;
        const kf_head_pick sub = planted_on(cases[k].dup, cases[k].sign, cases[k].to, 4, &n_sub, &kept_sub);
        const kf_head_pick all = planted_on(cases[k].dup, cases[k].sign, cases[k].to, 0, &n_all, &kept_all);
        printf("\n    want %s: on %d rows %s (err %.2e), on all %d %s (err %.2e)", kf_method_name(cases[k].want), n_sub,
               kf_method_name(sub.method), sub.err, n_all, kf_method_name(all.method), all.err);
        CU_ASSERT_EQUAL(n_sub, 512);
        CU_ASSERT_EQUAL(n_all, 1000);
        CU_ASSERT_EQUAL(sub.method, cases[k].want);
        CU_ASSERT_EQUAL(all.method, cases[k].want);
        CU_ASSERT(sub.err <= 1.05 * all.err + 1e-6); /* the winner fits as well on its subsample */
        /* the normal equations kept for the refit, and the training rows they cover */
        CU_ASSERT(kept_sub == 12 && kept_all == 12);
    }
    printf("\n");
}

/* How many training rows the winner's refit takes: refit_rows per kept key, at least
 * KF_REFIT_MIN_ROWS and the choice's own, all of them when fewer or when refit_rows is 0. */
static void test_refit_rows(void) {
    kf_compact_params p = kf_compact_params_default();
    CU_ASSERT_EQUAL(p.choice.refit_rows, 8);
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 13100, 819), 6552);
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 6000, 819), 6000); /* fewer than 8 per key: all */
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 3300, 10), KF_REFIT_MIN_ROWS);
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 200, 10), 200);
    p.choice.refit_rows = 2; /* below the choice's 6 per key: the choice's */
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 13100, 819), kf_choice_rows(&p, 13100, 819));
    p.choice.refit_rows = 7.5;
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 13100, 819), 6143); /* ceil(6142.5) */
    p.choice.refit_rows = 0;
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 13100, 819), 13100);
    p.choice.refit_rows = 8;
    p.choice.refit_all = KF_REFIT_ALL; /* refits everything on every row */
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 13100, 819), 13100);
    p.choice.refit_all = KF_REFIT_VALUES;
    p.choice.choice_rows = 0; /* the choice on all: so is the refit */
    p.choice.refit_rows = 8;
    CU_ASSERT_EQUAL(kf_refit_rows(&p, 13100, 819), 13100);
}

/* How many training rows the candidates get: choice_rows per kept key, at least KF_CHOICE_MIN_ROWS,
 * at most all (0: all). */
static void test_choice_rows(void) {
    kf_compact_params p = kf_compact_params_default();
    CU_ASSERT_EQUAL(p.choice.choice_rows, 6);
    CU_ASSERT_EQUAL(kf_choice_rows(&p, 3300, 204), 1224);
    CU_ASSERT_EQUAL(kf_choice_rows(&p, 3300, 10), KF_CHOICE_MIN_ROWS);
    CU_ASSERT_EQUAL(kf_choice_rows(&p, 200, 10), 200);
    CU_ASSERT_EQUAL(kf_choice_rows(&p, 1000, 204), 1000);
    p.choice.choice_rows = 2.5;
    CU_ASSERT_EQUAL(kf_choice_rows(&p, 3300, 205), 513); /* ceil(512.5) */
    p.choice.choice_rows = 0;
    CU_ASSERT_EQUAL(kf_choice_rows(&p, 3300, 204), 3300);
}

/* ---- the winner's refit on all the rows: three parts == one fit ---- */

enum { RF_T = KF_PLANT_T, RF_t = KF_PLANT_KEPT, RF_d = KF_PLANT_D, RF_TR = KF_PLANT_RTR_MAX, RF_V = KF_PLANT_RV,
       RF_R = RF_TR + RF_V };

/* fp64 rows of one fit on all the rows (query i of q [RF_R, d]): over the head's keys K, V [T, d] with
 * the first RF_t kept, beta's design M [R, t] (exp(z - m)) and target y [R], the values' design X
 * [R, t] (softmax over the kept keys) and target Y [R, d] (the attention output over all T). */
static void refit_ref_rows(const float *q, const float *K, const float *V, double scale, double *M, double *y,
                           double *X, double *Y) {
    for (int i = 0; i < RF_R; i++) {
        double z[RF_T], m = -INFINITY, sx = 0;
        for (int j = 0; j < RF_T; j++) {
            z[j] = 0;
            for (int c = 0; c < RF_d; c++)
                z[j] += (double)q[i * RF_d + c] * K[j * RF_d + c];
            z[j] *= scale, m = fmax(m, z[j]);
        }
        y[i] = 0;
        for (int c = 0; c < RF_d; c++)
            Y[i * RF_d + c] = 0;
        for (int j = 0; j < RF_T; j++) {
            const double e = exp(z[j] - m);
            y[i] += e;
            for (int c = 0; c < RF_d; c++)
                Y[i * RF_d + c] += e * V[j * RF_d + c];
            if (j < RF_t)
                M[i * RF_t + j] = e, sx += e;
        }
        for (int c = 0; c < RF_d; c++)
            Y[i * RF_d + c] /= y[i];
        for (int j = 0; j < RF_t; j++)
            X[i * RF_t + j] = M[i * RF_t + j] / sx;
    }
}

/* The ridge refit toward V0 [t, d] as LAPACK least squares on the stacked system
 * [X; sqrt(mu) I] values = [Y; sqrt(mu) V0], mu = max(alpha, 1e-6) tr(X^T X) / t; `round`: X and Y
 * rounded to fp32 first (a same-precision reference). out [t, d]; 0 on success. */
static int refit_ref_values(const double *X, const double *Y, const float *V0, double alpha, int round, double *out) {
    enum { NA = RF_R + RF_t };
    double *A = calloc((size_t)NA * RF_t, sizeof(double)), *B = calloc((size_t)NA * RF_d, sizeof(double)), tr = 0;
    for (int i = 0; i < RF_R; i++) {
        for (int j = 0; j < RF_t; j++) {
            const double x = round ? (double)(float)X[i * RF_t + j] : X[i * RF_t + j];
            A[i * RF_t + j] = x, tr += x * x;
        }
        for (int c = 0; c < RF_d; c++)
            B[i * RF_d + c] = round ? (double)(float)Y[i * RF_d + c] : Y[i * RF_d + c];
    }
    const double s = sqrt(fmax(alpha, 1e-6) * tr / RF_t);
    for (int j = 0; j < RF_t; j++) {
        A[(RF_R + j) * RF_t + j] = s;
        for (int c = 0; c < RF_d; c++)
            B[(RF_R + j) * RF_d + c] = s * V0[j * RF_d + c];
    }
    const int rc = (int)LAPACKE_dgels(LAPACK_ROW_MAJOR, 'N', NA, RF_t, RF_d, A, RF_t, B, RF_d);
    memcpy(out, B, sizeof(double) * RF_t * RF_d);
    free(A), free(B);
    return rc;
}

/* beta from fp64 normal equations of all the rows (G = M^T M, b = M^T y, yy), by the library's fit. */
static void refit_ref_beta(const double *M, const double *y, uint64_t seed, float *beta) {
    double *G = calloc(RF_t * RF_t, sizeof(double)), b[RF_t] = {0}, yy = 0;
    for (int i = 0; i < RF_R; i++) {
        yy += y[i] * y[i];
        for (int a = 0; a < RF_t; a++) {
            b[a] += M[i * RF_t + a] * y[i];
            for (int c = 0; c < RF_t; c++)
                G[a * RF_t + c] += M[i * RF_t + a] * M[i * RF_t + c];
        }
    }
    kf_beta_normal ne = {G, b, yy, RF_t, NULL, 0};
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_am_fit_beta_normal(&ne, seed, KF_BETA_AM, beta, NULL, NULL, &err), KF_OK);
    free(G);
}

/* The choice on its subsample (512 of 1000 training rows) keeps beta's and drop's normal equations;
 * the refit adds the other training rows' part and the validation rows' (kf_choice_refit_add, as
 * kf_compact does) and solves. That must be one fit on all 1100 rows: beta as from fp64 normal
 * equations of all of them, drop's values as LAPACK least squares on all of them, within twice the
 * distance of the same least squares on fp32-rounded inputs (docs/design.md's tolerance rule). */
static void test_refit_three_parts(void) {
    static kf_planted_head ph; /* test_util.h; large */
    kf_planted_init(&ph, 1, 1, KF_RIDGE_TO_ORIG, RF_TR);
    ph.p.choice.choice_rows = 4;
    kf_error err = {0};
    kf_head_pick pick;
    kf_choice_fits fits = {0};
    CU_ASSERT_EQUAL_FATAL(
        kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, RF_t, ph.K, ph.V, &ph.vh, 1, &pick, &fits, NULL, &err), KF_OK);
    CU_ASSERT_FATAL(fits.rows == 512 && fits.beta.G && fits.drop.G);
    /* the parts: training rows [512, 1000) and the validation rows, with their own targets */
    kf_am_head parts[2] = {ph.h, ph.h};
    kf_am_targets tgs[2] = {{ph.tg.m + fits.rows, ph.tg.y + fits.rows, ph.tg.Y + fits.rows * RF_d, NULL}, {0}};
    parts[0].q = ph.Qtr + fits.rows * RF_d, parts[0].R = RF_TR - fits.rows;
    parts[1].q = ph.Qv, parts[1].R = RF_V;
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&parts[1], KF_SCORE_RMS, &tgs[1], &err), KF_OK);
    const double alpha = 1e-2;
    float beta[RF_t], beta_ref[RF_t], vals[RF_t * RF_d];
    CU_ASSERT_EQUAL(kf_choice_refit_add(&fits, 1, parts, tgs, 2, ph.K, RF_t, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_choice_refit_add(&fits, 0, parts, tgs, 2, ph.K, RF_t, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_beta_normal(&fits.beta, 7, KF_BETA_AM, beta, NULL, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_value_gram_solve(&fits.drop, alpha, ph.V, RF_d, vals, NULL, &err), KF_OK);
    /* the references over all the rows, in fp64 from the head's keys and values */
    float *q = malloc(sizeof(float) * RF_R * RF_d);
    double *M = malloc(sizeof(double) * RF_R * RF_t), *X = malloc(sizeof(double) * RF_R * RF_t);
    double *Y = malloc(sizeof(double) * RF_R * RF_d), y[RF_R], v64[RF_t * RF_d], v32[RF_t * RF_d];
    memcpy(q, ph.Qtr, sizeof(float) * RF_TR * RF_d);
    memcpy(q + RF_TR * RF_d, ph.Qv, sizeof(float) * RF_V * RF_d);
    refit_ref_rows(q, ph.K, ph.V, ph.h.scale, M, y, X, Y);
    refit_ref_beta(M, y, 7, beta_ref);
    CU_ASSERT_EQUAL(refit_ref_values(X, Y, ph.V, alpha, 0, v64), 0);
    CU_ASSERT_EQUAL(refit_ref_values(X, Y, ph.V, alpha, 1, v32), 0);
    /* the same-precision reference: the library's one fit on all the rows at once */
    kf_am_head all = ph.h;
    all.q = q, all.R = RF_R;
    kf_am_targets tall;
    float beta_one[RF_t], v_one[RF_t * RF_d];
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&all, KF_SCORE_RMS, &tall, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_beta(&all, &tall, ph.sel, RF_t, 7, beta_one, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_values_ridge(NULL, q, RF_R, RF_d, all.scale, ph.K, RF_d, NULL, RF_t, tall.Y, alpha, ph.V,
                                           RF_d, v_one, NULL, NULL, &err),
                    KF_OK);
    double db = 0, db1 = 0, mb = 0, dv = 0, dv1 = 0, d32 = 0, mv = 0;
    for (int j = 0; j < RF_t; j++) {
        db = fmax(db, fabs(beta[j] - beta_ref[j])), db1 = fmax(db1, fabs(beta_one[j] - beta_ref[j]));
        mb = fmax(mb, fabs(beta_ref[j]));
    }
    for (int k = 0; k < RF_t * RF_d; k++) {
        dv = fmax(dv, fabs(vals[k] - v64[k])), dv1 = fmax(dv1, fabs(v_one[k] - v64[k]));
        d32 = fmax(d32, fabs(v32[k] - v64[k])), mv = fmax(mv, fabs(v64[k]));
    }
    printf("\n    from fp64 on all %d rows: 3-part refit's beta %.1e, one fit's %.1e (max |beta| %.2f); values "
           "3-part %.1e, one fit %.1e, LAPACK on fp32 inputs %.1e (max |v| %.2f)\n",
           RF_R, db, db1, mb, dv, dv1, d32, mv);
    CU_ASSERT(mb > 0.05); /* the fit moved off beta = 0 */
    CU_ASSERT(db <= 2 * db1 + 1e-6 * mb);
    CU_ASSERT(dv <= 2 * fmax(dv1, d32) + 1e-7 * mv);
    kf_am_targets_free(&tall);
    free(q), free(M), free(X), free(Y);
    kf_am_targets_free(&tgs[1]);
    kf_choice_fits_free(&fits);
    kf_planted_free(&ph);
}

/* The values refit alone (KF_REFIT_VALUES): the choice keeps the method's best candidate (fold at
 * its best lambda; am) as its beta, its fold direction and its value normal equations on the
 * subsample (512 of 1000 training rows); the refit adds the other training rows' part and the
 * validation rows'. That must equal the normal equations built afresh on all 1100 rows for the
 * same keys (and am's bias), up to rounding (the fp32 tile products of other tiles); beta and u must be the subsample's own fits
 * (beta from the kept normal equations, u from the first 512 rows' covariance at the picked
 * lambda). */
static void refit_values_case(kf_method method) {
    static kf_planted_head ph; /* test_util.h; large */
    kf_planted_init(&ph, 1, 1, KF_RIDGE_TO_ORIG, RF_TR);
    ph.p.method = method;
    ph.p.choice.choice_rows = 4;
    ph.p.choice.refit_all = KF_REFIT_VALUES;
    kf_error err = {0};
    kf_head_pick pick;
    kf_choice_fits fits = {0};
    CU_ASSERT_EQUAL_FATAL(
        kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, RF_t, ph.K, ph.V, &ph.vh, 1, &pick, &fits, NULL, &err), KF_OK);
    CU_ASSERT_FATAL(fits.rows == 512 && fits.win.G && fits.win_method == method);
    if (method == KF_METHOD_FOLD)
        CU_ASSERT_EQUAL(pick.method, KF_METHOD_FOLD); /* the planted head folds */
    /* beta: the subsample's fit from its kept normal equations (before any part is added) */
    float beta[RF_t], u[RF_d], keys[RF_t * RF_d];
    CU_ASSERT_EQUAL(kf_am_fit_beta_normal(&fits.beta, 1, KF_BETA_AM, beta, NULL, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(memcmp(beta, fits.win_beta, sizeof beta), 0);
    memcpy(keys, ph.K, sizeof(float) * RF_t * RF_d);
    if (method == KF_METHOD_FOLD) { /* u on the subsample at the picked lambda, the keys folded along it */
        kf_fold_info fi;
        CU_ASSERT_EQUAL(kf_fold_direction(NULL, ph.Qtr, fits.rows, RF_d, pick.lambda, u, &fi, NULL, &err), KF_OK);
        double du = 0, mu = 0;
        for (int c = 0; c < RF_d; c++)
            du = fmax(du, fabs(u[c] - fits.win_u[c])), mu = fmax(mu, fabs(u[c]));
        CU_ASSERT(fi.ok && du <= 1e-6 * mu && fabs(fi.var_gain - fits.win_var_gain) <= 1e-9 * fi.var_gain);
        kf_fold_keys(ph.K, RF_d, beta, RF_t, RF_d, ph.h.scale, fits.win_u, keys, RF_d);
    }
    /* the parts: training rows [512, 1000) and the validation rows, with their own targets */
    kf_am_head parts[2] = {ph.h, ph.h};
    kf_am_targets tgs[2] = {{ph.tg.m + fits.rows, ph.tg.y + fits.rows, ph.tg.Y + fits.rows * RF_d, NULL}, {0}};
    parts[0].q = ph.Qtr + fits.rows * RF_d, parts[0].R = RF_TR - fits.rows;
    parts[1].q = ph.Qv, parts[1].R = RF_V;
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&parts[1], KF_SCORE_RMS, &tgs[1], &err), KF_OK);
    CU_ASSERT_EQUAL(kf_choice_refit_add(&fits, KF_REFIT_ADD_WIN, parts, tgs, 2, keys, RF_t, NULL, &err), KF_OK);
    /* the reference: one fresh build on all the rows for the same keys and bias */
    float *q = malloc(sizeof(float) * RF_R * RF_d), *Y = malloc(sizeof(float) * RF_R * RF_d);
    memcpy(q, ph.Qtr, sizeof(float) * RF_TR * RF_d);
    memcpy(q + RF_TR * RF_d, ph.Qv, sizeof(float) * RF_V * RF_d);
    memcpy(Y, ph.tg.Y, sizeof(float) * RF_TR * RF_d);
    memcpy(Y + RF_TR * RF_d, tgs[1].Y, sizeof(float) * RF_V * RF_d);
    kf_value_gram ref;
    CU_ASSERT_EQUAL_FATAL(kf_value_gram_build(NULL, q, RF_R, RF_d, ph.h.scale, keys, RF_d,
                                              method == KF_METHOD_AM ? beta : NULL, RF_t, Y, &ref, NULL, &err),
                          KF_OK);
    double dG = 0, mG = 0, dB = 0, mB = 0;
    for (int k = 0; k < RF_t * RF_t; k++)
        dG = fmax(dG, fabs(fits.win.G[k] - ref.G[k])), mG = fmax(mG, fabs(ref.G[k]));
    for (int k = 0; k < RF_t * RF_d; k++)
        dB = fmax(dB, fabs(fits.win.B[k] - ref.B[k])), mB = fmax(mB, fabs(ref.B[k]));
    printf("\n    %s: kept + 2 parts against one build on all %d rows: G %.1e (max %.2f), B %.1e (max %.2f)",
           kf_method_name(method), RF_R, dG, mG, dB, mB);
    /* the parts' tiles start at other rows: their fp32 tile products round differently (a few ulps
     * of fp32 per tile; a row counted twice or left out moves G by ~ mG / 1100) */
    CU_ASSERT(mG > 1 && dG <= 1e-6 * mG && dB <= 1e-6 * mB && fabs(fits.win.tr - ref.tr) <= 1e-6 * ref.tr);
    kf_value_gram_free(&ref);
    free(q), free(Y);
    kf_am_targets_free(&tgs[1]);
    kf_choice_fits_free(&fits);
    kf_planted_free(&ph);
}

static void test_refit_values(void) {
    refit_values_case(KF_METHOD_FOLD);
    refit_values_case(KF_METHOD_AM);
    printf("\n");
}

/* kf_choose_head on a workspace: the heap's pick and kept normal equations to the bit; only those
 * stay in the workspace (the choice's own buffers given back), and a refit from them after more
 * scratch is carved over what was given back gives the heap's beta. */
static void test_choice_on_workspace(void) {
    static kf_planted_head ph;
    kf_planted_init(&ph, 1, 1, KF_RIDGE_TO_ORIG, 1000);
    const int t = KF_PLANT_KEPT, d = KF_PLANT_D;
    kf_error err = {0};
    kf_head_pick ph_pick, ws_pick;
    kf_choice_fits hf = {0}, wf = {0};
    CU_ASSERT_EQUAL_FATAL(
        kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, t, ph.K, ph.V, &ph.vh, 3, &ph_pick, &hf, NULL, &err), KF_OK);
    kf_ws ws;
    CU_ASSERT_EQUAL_FATAL(kf_ws_init(&ws, 1 << 22), 0);
    CU_ASSERT_EQUAL_FATAL(
        kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, t, ph.K, ph.V, &ph.vh, 3, &ws_pick, &wf, &ws, &err), KF_OK);
    CU_ASSERT(ws_pick.method == ph_pick.method && ws_pick.lambda == ph_pick.lambda && ws_pick.alpha == ph_pick.alpha &&
              ws_pick.err == ph_pick.err);
    CU_ASSERT_FATAL(wf.beta.G && wf.drop.G && wf.rows == hf.rows);
    CU_ASSERT_EQUAL(memcmp(wf.beta.G, hf.beta.G, sizeof(double) * t * t), 0);
    CU_ASSERT_EQUAL(memcmp(wf.drop.G, hf.drop.G, sizeof(double) * t * t), 0);
    CU_ASSERT_EQUAL(memcmp(wf.drop.B, hf.drop.B, sizeof(double) * t * d), 0);
    CU_ASSERT_EQUAL((int64_t)ws.used, kf_choice_kept_bytes(t, d, ph.p.choice.refit_all == KF_REFIT_VALUES));
    CU_ASSERT(ws.peak > ws.used); /* the choice's own buffers were there */
    memset(kf_ws_alloc(&ws, (int64_t)(ws.peak - ws.used), 1), 0xff, ws.peak - ws.used);
    float bh[KF_PLANT_KEPT], bw[KF_PLANT_KEPT];
    CU_ASSERT_EQUAL(kf_am_fit_beta_normal(&hf.beta, 7, KF_BETA_AM, bh, NULL, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_beta_normal(&wf.beta, 7, KF_BETA_AM, bw, NULL, &ws, &err), KF_OK);
    CU_ASSERT_EQUAL(memcmp(bh, bw, sizeof bh), 0);
    kf_choice_fits_free(&hf);
    kf_choice_fits_free(&wf);
    kf_ws_free(&ws);
    kf_planted_free(&ph);
}

static CU_TestInfo val_tests[] = {
    {"validation head: appended and original attention == fp64", test_val_head_appended},
    {"validation error == fp64; weights shared between value sets", test_val_err_reference},
    {"validation: what attend caches == a fresh head's, bit for bit", test_val_cache_fresh},
    {"normal equations: training + validation == all rows (fp64)", test_normal_equations_add},
    {"normal equations rebuilt in place == a fresh build, bit for bit", test_gram_rebuild_fresh},
    {"fold candidate's normal equations from the kept keys' logits == the folded keys' build",
     test_gram_rebuild_folded},
    {"training rows' order: a seeded permutation, every prefix stratified", test_training_order_stratified},
    {"per-head choice picks fold, drop and keep on planted heads", test_head_choice_planted},
    {"subsampled choice picks the planted best candidate, as on all rows", test_subsampled_choice_planted},
    {"choice rows: per kept key, floor, all", test_choice_rows},
    {"refit rows: per kept key, floor, at least the choice's, all", test_refit_rows},
    {"winner's refit: subsample's normal equations + two parts == one fit on all rows", test_refit_three_parts},
    {"values refit: the method's best candidate kept + two parts == one build on all rows", test_refit_values},
    {"the choice on a workspace: the heap's pick and kept normal equations, its own buffers given back",
     test_choice_on_workspace},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"per-head choice: validation", NULL, NULL, NULL, NULL, val_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
