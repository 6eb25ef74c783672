/* Attention Matching and the fold: each step on synthetic data with a known answer (the whole
 * compaction on the records model: test_compact.c, test_head_solve.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "compactor/diag.h"
#include "compactor/evaluate.h"
#include "compactor/fold.h"
#include "formats/budgets.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/linalg.h"
#include "test_util.h"

/* ---- least squares ---- */

static void test_lstsq_known_optimum(void) {
    const int m = 60, n = 12, r = 3;
    float *A = malloc(sizeof(float) * m * n), *X0 = malloc(sizeof(float) * n * r), *B = malloc(sizeof(float) * m * r);
    float *X = malloc(sizeof(float) * n * r);
    kf_test_fill_uniform(A, (size_t)m * n, 21, -1, 1);
    kf_test_fill_uniform(X0, (size_t)n * r, 22, -2, 2);
    for (int i = 0; i < m; i++)
        for (int c = 0; c < r; c++) {
            double s = 0;
            for (int k = 0; k < n; k++)
                s += (double)A[i * n + k] * X0[k * r + c];
            B[i * r + c] = (float)s;
        }
    CU_ASSERT_EQUAL(kf_lstsq(A, m, n, B, r, X), KF_LSTSQ_QR);
    CU_ASSERT(kf_max_abs_diff(X, X0, (size_t)n * r) < 1e-4);
    /* a duplicated column makes A rank-deficient: QR or the ridge path still fit B */
    for (int i = 0; i < m; i++)
        A[i * n + 1] = A[i * n + 0];
    for (int i = 0; i < m; i++)
        for (int c = 0; c < r; c++) {
            double s = 0;
            for (int k = 0; k < n; k++)
                s += (double)A[i * n + k] * X0[k * r + c];
            B[i * r + c] = (float)s;
        }
    int path = kf_lstsq(A, m, n, B, r, X);
    CU_ASSERT(path == KF_LSTSQ_RIDGE || path == KF_LSTSQ_QR);
    double worst = 0;
    for (int i = 0; i < m; i++)
        for (int c = 0; c < r; c++) {
            double s = 0;
            for (int k = 0; k < n; k++)
                s += (double)A[i * n + k] * X[k * r + c];
            worst = fmax(worst, fabs(s - B[i * r + c]));
        }
    CU_ASSERT(worst < 1e-2);
    /* only the sum of the duplicated columns' weights is identifiable; the rest is recovered */
    for (int c = 0; c < r; c++) {
        CU_ASSERT(fabs(X[0 * r + c] + X[1 * r + c] - (X0[0 * r + c] + X0[1 * r + c])) < 1e-2);
        for (int k = 2; k < n; k++)
            CU_ASSERT(fabs(X[k * r + c] - X0[k * r + c]) < 1e-2);
    }
    free(A);
    free(X0);
    free(B);
    free(X);
}

static void test_lstsq_underdetermined_min_norm(void) {
    const int m = 4, n = 9;
    float A[36], B[4], X[9];
    kf_test_fill_uniform(A, 36, 23, -1, 1);
    kf_test_fill_uniform(B, 4, 24, -1, 1);
    CU_ASSERT(kf_lstsq(A, m, n, B, 1, X) >= 0);
    for (int i = 0; i < m; i++) {
        double s = 0;
        for (int k = 0; k < n; k++)
            s += (double)A[i * n + k] * X[k];
        CU_ASSERT(fabs(s - B[i]) < 1e-4);
    }
    /* minimum norm: X lies in the row space of A, so X is orthogonal to A's null space: any z
     * with A z = 0 has z.X = 0. Build z from the ridge-free projection. */
    float z[9];
    kf_test_fill_uniform(z, 9, 25, -1, 1);
    float Az[4], w[9];
    for (int i = 0; i < m; i++) {
        double s = 0;
        for (int k = 0; k < n; k++)
            s += (double)A[i * n + k] * z[k];
        Az[i] = (float)s;
    }
    CU_ASSERT(kf_lstsq(A, m, n, Az, 1, w) >= 0); /* w = row-space part of z */
    double dot = 0;
    for (int k = 0; k < n; k++)
        dot += (z[k] - w[k]) * X[k];
    CU_ASSERT(fabs(dot) < 1e-4);
}

/* ---- AM steps ---- */

typedef struct {
    int T, R, d;
    float *K, *V, *Q;
} synth;

static synth make_synth(int T, int R, int d, uint64_t seed) {
    synth s = {T, R, d, malloc(sizeof(float) * T * d), malloc(sizeof(float) * T * d), malloc(sizeof(float) * R * d)};
    kf_test_fill_uniform(s.K, (size_t)T * d, seed, -1.5f, 1.5f);
    kf_test_fill_uniform(s.V, (size_t)T * d, seed + 1, -1, 1);
    kf_test_fill_uniform(s.Q, (size_t)R * d, seed + 2, -1.5f, 1.5f);
    for (int i = 0; i < R; i++) /* queries share a mean direction, as real ones do */
        for (int c = 0; c < d; c++)
            s.Q[i * d + c] += c % 3 == 0 ? 1.0f : 0.0f;
    return s;
}

static void free_synth(synth *s) {
    free(s->K);
    free(s->V);
    free(s->Q);
}

static kf_am_head head_of(const synth *s) {
    return (kf_am_head){s->K, (size_t)s->d, s->V, (size_t)s->d, s->T, s->Q, s->R, s->d, 1.0f / sqrtf((float)s->d),
                        NULL};
}

static void test_targets_partition_function(void) {
    synth s = make_synth(50, 40, 16, 31);
    kf_am_head h = head_of(&s);
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    double worst_z = 0, worst_y = 0, score_sum_sq = 0;
    double *colsq = calloc(s.T, sizeof(double));
    for (int i = 0; i < s.R; i++) {
        double z[50], Z = 0, out[16] = {0};
        for (int j = 0; j < s.T; j++) {
            double dot = 0;
            for (int c = 0; c < s.d; c++)
                dot += (double)s.Q[i * s.d + c] * s.K[j * s.d + c];
            z[j] = exp(dot * h.scale);
            Z += z[j];
        }
        for (int j = 0; j < s.T; j++) {
            colsq[j] += (z[j] / Z) * (z[j] / Z);
            for (int c = 0; c < s.d; c++)
                out[c] += z[j] / Z * s.V[j * s.d + c];
        }
        worst_z = fmax(worst_z, fabs(tg.y[i] * exp(tg.m[i]) - Z) / Z);
        for (int c = 0; c < s.d; c++)
            worst_y = fmax(worst_y, fabs(out[c] - tg.Y[i * s.d + c]));
    }
    for (int j = 0; j < s.T; j++)
        score_sum_sq = fmax(score_sum_sq, fabs(sqrt(colsq[j] / s.R) - tg.score[j]));
    CU_ASSERT(worst_z < 1e-5);
    CU_ASSERT(worst_y < 1e-5);
    CU_ASSERT(score_sum_sq < 1e-6);
    free(colsq);
    kf_am_targets_free(&tg);
    free_synth(&s);
}

static void test_selection_recovers_planted_keys(void) {
    synth s = make_synth(200, 64, 16, 41);
    /* plant 5 keys aligned with the queries' mean: they take most of the attention */
    const int planted[5] = {3, 77, 78, 150, 199};
    for (int p = 0; p < 5; p++)
        for (int c = 0; c < s.d; c++)
            s.K[planted[p] * s.d + c] = c % 3 == 0 ? 4.0f : 0.0f;
    kf_am_head h = head_of(&s);
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    int32_t sel[5];
    CU_ASSERT_EQUAL(kf_am_select(tg.score, s.T, 5, sel, NULL, &err), KF_OK);
    for (int p = 0; p < 5; p++)
        CU_ASSERT_EQUAL(sel[p], planted[p]); /* and in position order */
    CU_ASSERT_EQUAL(kf_am_select(tg.score, s.T, 201, sel, NULL, &err), KF_ERR_INVALID);
    kf_am_targets_free(&tg);
    free_synth(&s);
}

static void test_beta_all_keys_and_duplicates(void) {
    synth s = make_synth(30, 120, 8, 51);
    kf_am_head h = head_of(&s);
    kf_am_targets tg;
    kf_error err = {0};
    kf_am_stats st = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    int32_t all[30];
    float beta[30];
    for (int j = 0; j < 30; j++)
        all[j] = j;
    CU_ASSERT_EQUAL(kf_am_fit_beta(&h, &tg, all, 30, 7, beta, &st, &err), KF_OK);
    for (int j = 0; j < 30; j++)
        CU_ASSERT(fabsf(beta[j]) < 1e-3); /* keeping everything needs no correction */
    kf_am_targets_free(&tg);
    /* keys 0 and 1 identical; keep only key 0: it must carry both masses, w = 2 */
    memcpy(s.K + s.d, s.K, sizeof(float) * s.d);
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    int32_t sel[29];
    sel[0] = 0;
    for (int j = 2; j < 30; j++)
        sel[j - 1] = j;
    CU_ASSERT_EQUAL(kf_am_fit_beta(&h, &tg, sel, 29, 7, beta, &st, &err), KF_OK);
    float others = 0;
    for (int j = 1; j < 29; j++)
        others = fmaxf(others, fabsf(beta[j]));
    printf("\n    duplicate kept once: beta %.5f (ln 2 = %.5f), the others' max |beta| %.5f\n", beta[0], logf(2.0f),
           others);
    CU_ASSERT(fabsf(beta[0] - logf(2.0f)) < 1e-3);
    CU_ASSERT(others < 1e-3);
    /* bounds: beta stays in [-3, 3] even when the fit wants more (25 copies of one key: ln 25 > 3) */
    for (int j = 1; j < 25; j++)
        memcpy(s.K + j * s.d, s.K, sizeof(float) * s.d);
    kf_am_targets_free(&tg);
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    int32_t sel2[6] = {0, 25, 26, 27, 28, 29};
    CU_ASSERT_EQUAL(kf_am_fit_beta(&h, &tg, sel2, 6, 7, beta, &st, &err), KF_OK);
    for (int j = 0; j < 6; j++)
        CU_ASSERT(beta[j] >= -3.0f - 1e-6f && beta[j] <= 3.0f + 1e-6f);
    CU_ASSERT(fabsf(beta[0] - 3.0f) < 1e-5); /* clamped at the bound */
    kf_am_targets_free(&tg);
    free_synth(&s);
}

static void test_values_recover_v(void) {
    synth s = make_synth(20, 200, 8, 61);
    kf_am_head h = head_of(&s);
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    float *vals = malloc(sizeof(float) * 20 * 8);
    CU_ASSERT_EQUAL(kf_am_fit_values(NULL, s.Q, s.R, s.d, h.scale, s.K, s.d, NULL, 20, tg.Y, vals, NULL, &err), KF_OK);
    CU_ASSERT(kf_max_abs_diff(vals, s.V, 20 * 8) < 1e-3);
    free(vals);
    kf_am_targets_free(&tg);
    free_synth(&s);
}

static void test_fold_identities(void) {
    synth s = make_synth(40, 300, 16, 71);
    float u[16];
    kf_fold_info fi;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_fold_direction(NULL, s.Q, s.R, s.d, 1e-2, u, &fi, NULL, &err), KF_OK);
    CU_ASSERT_FATAL(fi.ok);
    double mu[16] = {0}, mtu = 0, mean_gain = 0;
    for (int i = 0; i < s.R; i++)
        for (int c = 0; c < s.d; c++)
            mu[c] += s.Q[i * s.d + c] / (double)s.R;
    for (int c = 0; c < s.d; c++)
        mtu += mu[c] * u[c];
    for (int i = 0; i < s.R; i++) {
        double g = 0;
        for (int c = 0; c < s.d; c++)
            g += (double)s.Q[i * s.d + c] * u[c];
        mean_gain += g / s.R;
    }
    CU_ASSERT(fabs(mtu - 1.0) < 1e-5);
    CU_ASSERT(fabs(mean_gain - 1.0) < 1e-5);
    /* the fold is exact for the mean query: s mu.k'_j = s mu.k_j + beta_j */
    float beta[40], kf[40 * 16];
    kf_test_fill_uniform(beta, 40, 72, -3, 3);
    const float scale = 1.0f / 4.0f;
    kf_fold_keys(s.K, s.d, beta, 40, s.d, scale, u, kf, s.d);
    double worst = 0;
    for (int j = 0; j < 40; j++) {
        double a = 0, b = 0;
        for (int c = 0; c < s.d; c++) {
            a += mu[c] * kf[j * s.d + c];
            b += mu[c] * s.K[j * s.d + c];
        }
        worst = fmax(worst, fabs(scale * a - (scale * b + beta[j])));
    }
    CU_ASSERT(worst < 1e-4);
    /* a zero mean has no fold direction */
    float zq[4 * 16];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 16; c++)
            zq[i * 16 + c] = (i % 2 ? -1.0f : 1.0f) * (c + 1);
    CU_ASSERT_EQUAL(kf_fold_direction(NULL, zq, 4, 16, 1e-2, u, &fi, NULL, &err), KF_OK);
    CU_ASSERT_FALSE(fi.ok);
    free_synth(&s);
}

/* Synthetic version of diag.h's appended-block check: with an appended uncompacted block,
 * am < fold < drop on the LSE error. */
static void test_synthetic_ordering(void) {
    synth s = make_synth(300, 600, 16, 81);
    synth held = make_synth(300, 200, 16, 82); /* same distribution, other draws */
    memcpy(held.K, s.K, sizeof(float) * 300 * 16);
    memcpy(held.V, s.V, sizeof(float) * 300 * 16);
    kf_am_head h = head_of(&s);
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    const int t = 30, d = 16;
    int32_t sel[30];
    float beta[30], ks[30 * 16], kfold[30 * 16], v_am[30 * 16], v_drop[30 * 16], v_fold[30 * 16], u[16];
    CU_ASSERT_EQUAL(kf_am_select(tg.score, 300, t, sel, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_beta(&h, &tg, sel, t, 3, beta, NULL, &err), KF_OK);
    for (int j = 0; j < t; j++)
        memcpy(ks + j * d, s.K + sel[j] * d, sizeof(float) * d);
    kf_fold_info fi;
    CU_ASSERT_EQUAL(kf_fold_direction(NULL, s.Q, s.R, d, 1e-2, u, &fi, NULL, &err), KF_OK);
    kf_fold_keys(ks, d, beta, t, d, h.scale, u, kfold, d);
    CU_ASSERT_EQUAL(kf_am_fit_values(NULL, s.Q, s.R, d, h.scale, ks, d, beta, t, tg.Y, v_am, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_values(NULL, s.Q, s.R, d, h.scale, ks, d, NULL, t, tg.Y, v_drop, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_values(NULL, s.Q, s.R, d, h.scale, kfold, d, NULL, t, tg.Y, v_fold, NULL, &err), KF_OK);
    float app_k[60 * 16], app_v[60 * 16];
    kf_test_fill_uniform(app_k, 60 * 16, 83, -1.5f, 1.5f);
    kf_test_fill_uniform(app_v, 60 * 16, 84, -1, 1);
    kf_kv_block orig = {s.K, s.V, 16, NULL, 300}, app = {app_k, app_v, 16, NULL, 60};
    kf_kv_block am = {ks, v_am, 16, beta, t}, drop = {ks, v_drop, 16, NULL, t}, fold = {kfold, v_fold, 16, NULL, t};
    kf_head_diag d_am, d_drop, d_fold;
    CU_ASSERT_EQUAL(kf_diag_head(held.Q, held.R, d, h.scale, &orig, &am, &app, NULL, &d_am, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_diag_head(held.Q, held.R, d, h.scale, &orig, &drop, &app, NULL, &d_drop, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_diag_head(held.Q, held.R, d, h.scale, &orig, &fold, &app, NULL, &d_fold, &err), KF_OK);
    printf("\n    lse_err am %.3f fold %.3f drop %.3f; out_err am %.3f fold %.3f drop %.3f\n", d_am.lse_err,
           d_fold.lse_err, d_drop.lse_err, d_am.out_err, d_fold.out_err, d_drop.out_err);
    CU_ASSERT(d_am.lse_err < d_fold.lse_err);
    CU_ASSERT(d_fold.lse_err < d_drop.lse_err);
    CU_ASSERT(d_am.out_err < d_drop.out_err);
    kf_am_targets_free(&tg);
    free_synth(&s);
    free_synth(&held);
}

/* ---- Tikhonov refit, converged box fit, restart count, per-head choice ---- */

/* x = A^-1 b for a small dense A [n, n] (fp64 Gauss-Jordan with partial pivoting; b [n, m]). */
static void gauss_solve(double *A, int n, double *b, int m) {
    for (int c = 0; c < n; c++) {
        int piv = c;
        for (int r = c + 1; r < n; r++)
            if (fabs(A[r * n + c]) > fabs(A[piv * n + c]))
                piv = r;
        for (int k = 0; k < n; k++) {
            double t = A[c * n + k];
            A[c * n + k] = A[piv * n + k], A[piv * n + k] = t;
        }
        for (int k = 0; k < m; k++) {
            double t = b[c * m + k];
            b[c * m + k] = b[piv * m + k], b[piv * m + k] = t;
        }
        for (int r = 0; r < n; r++) {
            if (r == c)
                continue;
            const double f = A[r * n + c] / A[c * n + c];
            for (int k = 0; k < n; k++)
                A[r * n + k] -= f * A[c * n + k];
            for (int k = 0; k < m; k++)
                b[r * m + k] -= f * b[c * m + k];
        }
    }
    for (int r = 0; r < n; r++)
        for (int k = 0; k < m; k++)
            b[r * m + k] /= A[r * n + r];
}

/* The Tikhonov refit against its closed form (X^T X + mu I) C = X^T Y + mu V0, mu = alpha tr(X^T X)/t,
 * with X built here in fp64, towards V0 and towards zero, over- and underdetermined. */
static void check_tikhonov(int R, double alpha, int towards_orig) {
    const int t = 12, d = 5;
    float K[12 * 5], Q[40 * 5], beta[12], Y[40 * 5], V0[12 * 5], C[12 * 5];
    kf_test_fill_uniform(K, t * d, 401, -1, 1);
    kf_test_fill_uniform(Q, (size_t)R * d, 402, -2, 2);
    kf_test_fill_uniform(beta, t, 403, -1, 1);
    kf_test_fill_uniform(Y, (size_t)R * d, 404, -1, 1);
    kf_test_fill_uniform(V0, t * d, 405, -1, 1);
    const float scale = 0.5f;
    double X[40 * 12], G[12 * 12] = {0}, B[12 * 5] = {0}, tr = 0;
    for (int i = 0; i < R; i++) {
        double z[12], mx = -1e300, sum = 0;
        for (int j = 0; j < t; j++) {
            double dot = 0;
            for (int c = 0; c < d; c++)
                dot += (double)Q[i * d + c] * K[j * d + c];
            z[j] = scale * dot + beta[j];
            mx = fmax(mx, z[j]);
        }
        for (int j = 0; j < t; j++)
            sum += exp(z[j] - mx);
        for (int j = 0; j < t; j++) /* rounded to bf16, as the fit rounds its weights */
            X[i * t + j] = kf_bf16_to_f32(kf_f32_to_bf16((float)(exp(z[j] - mx) / sum)));
    }
    for (int a = 0; a < t; a++) {
        for (int b = 0; b < t; b++)
            for (int i = 0; i < R; i++)
                G[a * t + b] += X[i * t + a] * X[i * t + b];
        for (int c = 0; c < d; c++) /* the targets rounded to bf16 too */
            for (int i = 0; i < R; i++)
                B[a * d + c] += X[i * t + a] * kf_bf16_to_f32(kf_f32_to_bf16(Y[i * d + c]));
        tr += G[a * t + a];
    }
    const double mu = alpha * tr / t;
    for (int a = 0; a < t; a++) {
        G[a * t + a] += mu;
        for (int c = 0; c < d && towards_orig; c++)
            B[a * d + c] += mu * V0[a * d + c];
    }
    gauss_solve(G, t, B, d);
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_am_fit_values_ridge(NULL, Q, R, d, scale, K, d, beta, t, Y, alpha, towards_orig ? V0 : NULL, d,
                                           C, NULL, NULL, &err),
                    KF_OK);
    double worst = 0, moved = 0;
    for (int k = 0; k < t * d; k++) {
        worst = fmax(worst, fabs(C[k] - B[k]));
        moved = fmax(moved, fabs(B[k]));
    }
    printf("\n    R %d alpha %g towards %s: max |C - closed form| %.2e (max |C| %.2f)", R, alpha,
           towards_orig ? "V0" : "zero", worst, moved);
    CU_ASSERT(worst < 1e-4 * fmax(1, moved));
}

static void test_tikhonov_closed_form(void) {
    check_tikhonov(40, 0.05, 1);
    check_tikhonov(40, 0.05, 0);
    check_tikhonov(7, 0.01, 1); /* fewer queries than keys: only the ridge makes it well posed */
    check_tikhonov(7, 0.3, 0);
    printf("\n");
}

/* A gram indefinite by less than 1e-5 of its scale (as fp32 tile products can leave one): the
 * solve at the safety ridge (1e-6 tr / t) fails and is retried at 1e-5 tr / t, which gives the
 * closed form there; one indefinite by more than 1e-4 gives values 0 and a failure. */
static void test_ridge_retry(void) {
    const int t = 2, d = 1;
    double G[4], B[2] = {1, 2}, A[4], Bs[2];
    kf_value_gram g = {G, B, 0, t, d, A, Bs, NULL, 1};
    for (int big = 0; big < 2; big++) {
        const double delta = big ? 1e-3 : 4e-6; /* eigenvalues about 2 and -delta / 2 */
        G[0] = G[1] = G[2] = 1, G[3] = 1 - delta;
        g.tr = 2 - delta;
        float v[2] = {7, 7};
        kf_am_stats st = {0};
        kf_error err = {0};
        CU_ASSERT_EQUAL(kf_value_gram_solve(&g, 0, NULL, 0, v, &st, &err), KF_OK);
        if (big) {
            CU_ASSERT(v[0] == 0 && v[1] == 0 && st.failures == 1 && st.value_fallbacks == 2);
            continue;
        }
        const double mu = 1e-5 * g.tr / t, a = 1 + mu, b = 1, c = 1 - delta + mu, det = a * c - b * b;
        const double x0 = (c * B[0] - b * B[1]) / det, x1 = (a * B[1] - b * B[0]) / det;
        printf("\n    indefinite by %.0e: values %.6g %.6g (closed form at 1e-5 tr / t: %.6g %.6g), retries %d",
               delta, v[0], v[1], x0, x1, st.value_fallbacks);
        CU_ASSERT(st.failures == 0 && st.value_fallbacks == 1);
        CU_ASSERT(fabs(v[0] - x0) <= 1e-5 * fabs(x0) && fabs(v[1] - x1) <= 1e-5 * fabs(x1));
    }
    printf("\n");
}

/* Projected-gradient KKT violation of w for min w^T G w / 2 - b^T w on [lo, hi], relative to max |b|. */
static double kkt_violation(const double *G, const double *b, int t, double lo, double hi, const double *w) {
    double worst = 0, bmax = 0;
    for (int j = 0; j < t; j++) {
        double g = -b[j];
        for (int c = 0; c < t; c++)
            g += G[j * t + c] * w[c];
        const double slack = 1e-7 * (hi - lo);
        const double v = w[j] <= lo + slack ? fmax(0, -g) : (w[j] >= hi - slack ? fmax(0, g) : fabs(g));
        worst = fmax(worst, v);
        bmax = fmax(bmax, fabs(b[j]));
    }
    return worst / bmax;
}

static void test_box_fit_reaches_kkt(void) {
    /* a random box least-squares problem whose free optimum leaves the box on both sides */
    const int R = 60, t = 20;
    const double lo = exp(-3.0), hi = exp(3.0);
    float Mf[60 * 20], wt[20];
    kf_test_fill_uniform(Mf, R * t, 411, -6, 1);
    kf_test_fill_uniform(wt, t, 412, -10, 40);
    double G[20 * 20] = {0}, b[20] = {0}, w[20], y[60];
    for (int i = 0; i < R; i++) {
        y[i] = 0;
        for (int j = 0; j < t; j++)
            y[i] += exp(Mf[i * t + j]) * wt[j];
    }
    for (int a = 0; a < t; a++) {
        for (int i = 0; i < R; i++) {
            b[a] += exp(Mf[i * t + a]) * y[i];
            for (int c = 0; c < t; c++)
                G[a * t + c] += exp(Mf[i * t + a]) * exp(Mf[i * t + c]);
        }
        w[a] = 1;
    }
    const int sweeps = kf_box_lsq(G, b, t, lo, hi, 1e-10, 100000, w);
    int at_lo = 0, at_hi = 0, inside = 0;
    for (int j = 0; j < t; j++) {
        at_lo += w[j] == lo, at_hi += w[j] == hi;
        inside += w[j] > lo && w[j] < hi;
        CU_ASSERT(w[j] >= lo && w[j] <= hi);
    }
    const double v = kkt_violation(G, b, t, lo, hi, w);
    printf("\n    box fit: %d sweeps, %d at e^-3, %d at e^3, %d inside, KKT violation %.1e\n", sweeps, at_lo, at_hi,
           inside, v);
    CU_ASSERT(sweeps <= 100000);
    CU_ASSERT(at_lo > 0 && at_hi > 0 && inside > 0);
    CU_ASSERT(v < 1e-8);

    /* the beta fit with KF_BETA_BOX satisfies KKT for its own problem; AM's two steps do not */
    synth s = make_synth(120, 300, 8, 413);
    for (int j = 60; j < 120; j++) /* half the keys duplicate kept ones: masses up to 2x and beyond */
        memcpy(s.K + j * s.d, s.K + (j % 7) * s.d, sizeof(float) * s.d);
    kf_am_head h = head_of(&s);
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    const int tk = 24;
    int32_t sel[24];
    float beta_box[24], beta_am[24];
    for (int j = 0; j < tk; j++)
        sel[j] = 2 * j + 1;
    CU_ASSERT_EQUAL(kf_am_fit_beta_ex(&h, &tg, sel, tk, 5, KF_BETA_BOX, beta_box, NULL, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_am_fit_beta_ex(&h, &tg, sel, tk, 5, KF_BETA_AM, beta_am, NULL, NULL, &err), KF_OK);
    double *Gb = calloc((size_t)tk * tk, sizeof(double)), *bb = calloc(tk, sizeof(double));
    double w_box[24], w_am[24];
    for (int i = 0; i < s.R; i++) {
        double mrow[24];
        for (int j = 0; j < tk; j++) {
            double dot = 0;
            for (int c = 0; c < s.d; c++)
                dot += (double)s.Q[i * s.d + c] * s.K[sel[j] * s.d + c];
            mrow[j] = exp(dot * h.scale - tg.m[i]);
        }
        for (int a = 0; a < tk; a++) {
            bb[a] += mrow[a] * tg.y[i];
            for (int c = 0; c < tk; c++)
                Gb[a * tk + c] += mrow[a] * mrow[c];
        }
    }
    for (int j = 0; j < tk; j++)
        w_box[j] = exp(beta_box[j]), w_am[j] = exp(beta_am[j]);
    const double v_box = kkt_violation(Gb, bb, tk, lo, hi, w_box), v_am = kkt_violation(Gb, bb, tk, lo, hi, w_am);
    printf("    beta fit KKT violation: box %.1e, AM's two steps %.1e\n", v_box, v_am);
    CU_ASSERT(v_box < 1e-4); /* w from float beta: about 1e-7 relative per weight */
    CU_ASSERT(v_box < v_am);
    free(Gb);
    free(bb);
    kf_am_targets_free(&tg);
    free_synth(&s);
}

/* The restart from w = 1 is counted exactly when the clamped least-squares start fits worse. */
static void test_beta_restart_counted(void) {
    const int R = 40, d = 4;
    float K[3 * 4] = {1.0f, 0.2f, 0.0f, 0.1f, 0.9f, 0.35f, 0.05f, 0.0f, -1, 0, 1, 0}, Q[40 * 4];
    kf_test_fill_uniform(Q, R * d, 421, -1, 1);
    kf_am_head h = {K, 4, K, 4, 3, Q, R, d, 1.0f, NULL};
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    const int32_t sel[2] = {0, 1};
    const double lo = exp(-3.0), hi = exp(3.0);
    const double cases[2][2] = {{30, -25}, {2, 0.5}}; /* free optimum far outside the box; inside it */
    kf_am_stats st = {0};
    for (int k = 0; k < 2; k++) {
        double m0[40], m1[40], r_clamp = 0, r_one = 0;
        const double w0 = fmin(hi, fmax(lo, cases[k][0])), w1 = fmin(hi, fmax(lo, cases[k][1]));
        for (int i = 0; i < R; i++) { /* plant y = M w_true */
            double z0 = 0, z1 = 0;
            for (int c = 0; c < d; c++)
                z0 += Q[i * d + c] * K[c], z1 += Q[i * d + c] * K[d + c];
            m0[i] = exp(z0 - tg.m[i]), m1[i] = exp(z1 - tg.m[i]);
            tg.y[i] = (float)(m0[i] * cases[k][0] + m1[i] * cases[k][1]);
        }
        for (int i = 0; i < R; i++) {
            r_clamp += pow(m0[i] * w0 + m1[i] * w1 - tg.y[i], 2);
            r_one += pow(m0[i] + m1[i] - tg.y[i], 2);
        }
        const int before = st.beta_restarts;
        float beta[2];
        CU_ASSERT_EQUAL(kf_am_fit_beta(&h, &tg, sel, 2, 1, beta, &st, &err), KF_OK);
        printf("\n    w* (%g, %g): clamped start residual %.3g, w = 1 residual %.3g, restarts +%d", cases[k][0],
               cases[k][1], r_clamp, r_one, st.beta_restarts - before);
        CU_ASSERT_EQUAL(st.beta_restarts - before, r_clamp > r_one ? 1 : 0);
        CU_ASSERT_EQUAL(r_clamp > r_one, k == 0); /* the planted cases cover both branches */
    }
    printf("\n");
    kf_am_targets_free(&tg);
}


static void test_frame_rotation_keeps_dot_products(void) {
    const int d = 16, n = 5;
    kf_rope_spec spec = {.kind = KF_ROPE_DEFAULT, .theta = 10000};
    double inv[8];
    kf_rope_inv_freq(&spec, d, inv);
    float q[16], k[5 * 16], q2[16], k2[5 * 16];
    kf_test_fill_uniform(q, 16, 91, -1, 1);
    kf_test_fill_uniform(k, 80, 92, -1, 1);
    memcpy(q2, q, sizeof q);
    memcpy(k2, k, sizeof k);
    const int64_t D = 1000, C = 130;
    int64_t kp[5] = {3, 50, 400, 777, 999}, qp = D + 7, qp2 = C + 7, shift[5];
    kf_cpu_rope(k, d, n, 1, d, kp, inv); /* cached keys at their positions */
    kf_cpu_rope(k2, d, n, 1, d, kp, inv);
    for (int j = 0; j < n; j++)
        shift[j] = -(D - C);
    kf_cpu_rope(k2, d, n, 1, d, shift, inv); /* compacted frame */
    kf_cpu_rope(q, d, 1, 1, d, &qp, inv);    /* question token in AM's frame */
    kf_cpu_rope(q2, d, 1, 1, d, &qp2, inv);  /* ... and where vLLM puts it */
    for (int j = 0; j < n; j++) {
        double a = 0, b = 0;
        for (int c = 0; c < d; c++) {
            a += (double)q[c] * k[j * d + c];
            b += (double)q2[c] * k2[j * d + c];
        }
        CU_ASSERT(fabs(a - b) < 1e-4);
    }
}

/* ---- normal equations from fp32 tile products (docs/decisions/fp32-tile-products.md) ---- */

enum { NE_T = 400, NE_t = 300, NE_d = 16, NE_R = 1200 }; /* 2 whole tiles of 512 rows and a ragged one */

/* |a - ref| against tol times the entry's own sum of |terms| (abs), the worst ratio over n entries */
static double worst_ratio(const double *a, const double *ref, const double *abs, int n) {
    double w = 0;
    for (int k = 0; k < n; k++)
        w = fmax(w, fabs(a[k] - ref[k]) / abs[k]);
    return w;
}

/* The same norm-wise: |a - ref| over |abs| (Frobenius). The values' weights are rounded to bf16 by
 * the fit and by the reference alike, but from fp32 and fp64 softmaxes that can land on either side
 * of a rounding boundary: such a term is off by 2^-8 of itself, which an entry with few terms shows
 * whole; norm-wise those few terms vanish among all the others, and a lost row does not. */
static double norm_ratio(const double *a, const double *ref, const double *abs, int n) {
    double e = 0, s = 0;
    for (int k = 0; k < n; k++)
        e += (a[k] - ref[k]) * (a[k] - ref[k]), s += abs[k] * abs[k];
    return sqrt(e / s);
}

/* fp64 loops over the rows: X (softmax with bias) and M (exp(z - m)) of the kept keys kc [t, d];
 * G = X^T X, B = X^T Y, GM = M^T M, bM = M^T y, each with its sum of |terms| (G's own: >= 0). */
typedef struct {
    double G[NE_t * NE_t], B[NE_t * NE_d], Babs[NE_t * NE_d], GM[NE_t * NE_t], bM[NE_t], yy;
} ne_ref;

static void ne_reference(const float *Q, const float *kc, const float *bias, float scale, const kf_am_targets *tg,
                         ne_ref *r) {
    memset(r, 0, sizeof *r);
    static double X[NE_t], M[NE_t];
    for (int i = 0; i < NE_R; i++) {
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < NE_t; j++) {
            double dot = 0;
            for (int c = 0; c < NE_d; c++)
                dot += (double)Q[i * NE_d + c] * kc[j * NE_d + c];
            M[j] = scale * dot, X[j] = M[j] + (bias ? bias[j] : 0);
            mx = fmax(mx, X[j]);
            M[j] = exp(M[j] - tg->m[i]);
        }
        for (int j = 0; j < NE_t; j++)
            sum += X[j] = exp(X[j] - mx);
        for (int j = 0; j < NE_t; j++) /* the values' weights as the fit takes them: rounded to bf16 */
            X[j] = kf_bf16_to_f32(kf_f32_to_bf16((float)(X[j] / sum)));
        r->yy += (double)tg->y[i] * tg->y[i];
        for (int a = 0; a < NE_t; a++) {
            const double xa = X[a];
            r->bM[a] += M[a] * tg->y[i];
            for (int b = 0; b < NE_t; b++)
                r->G[a * NE_t + b] += xa * X[b], r->GM[a * NE_t + b] += M[a] * M[b];
            for (int c = 0; c < NE_d; c++) { /* the targets rounded likewise */
                const double y = kf_bf16_to_f32(kf_f32_to_bf16(tg->Y[i * NE_d + c]));
                r->B[a * NE_d + c] += xa * y, r->Babs[a * NE_d + c] += fabs(xa * y);
            }
        }
    }
}

/* kf_value_gram_rebuild (over a gram holding another build's sums), kf_beta_normal_build and
 * kf_kept_normal_build against the fp64 loops. Beta's: each entry within 2e-6 of its own sum of
 * |terms|: a tile's fp32 sum of 512 products rounds by at most 512 ulps (3e-5) and by about 23
 * (1.4e-6) in practice, the inputs' own rounding (fp32 logits) adds about as much. The values'
 * (weights and targets rounded to bf16 on both sides): within 1e-5 norm-wise (norm_ratio). A row lost or
 * counted twice, or a tile left in the sums of the next build, is 1e-3 or more. */
static void test_fp32_tile_normal_equations(void) {
    static float K[NE_T * NE_d], Q[NE_R * NE_d], bias[NE_t];
    static ne_ref ref;
    kf_test_fill_uniform(K, NE_T * NE_d, 611, -1, 1);
    kf_test_fill_uniform(Q, NE_R * NE_d, 612, -2, 2);
    kf_test_fill_uniform(bias, NE_t, 613, -1, 1);
    const float scale = 0.5f;
    kf_am_head h = {K, NE_d, K, NE_d, NE_T, Q, NE_R, NE_d, scale, NULL}; /* values: the keys */
    kf_am_targets tg;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, KF_SCORE_RMS, &tg, &err), KF_OK);
    const float *kc = K; /* the first t keys kept */
    kf_value_gram g, g2;
    kf_gram_tiles w;
    CU_ASSERT_FATAL(kf_value_gram_alloc(&g, NULL, NE_t, NE_d, NULL) == 0 &&
                    kf_gram_tiles_alloc(&w, NE_t, NE_d, 0, NULL) == 0);
    kf_value_gram_rebuild(Q, NE_R, scale, K + NE_d, NE_d, NULL, tg.Y, &w, &g); /* other keys first */
    kf_value_gram_rebuild(Q, NE_R, scale, kc, NE_d, bias, tg.Y, &w, &g);
    ne_reference(Q, kc, bias, scale, &tg, &ref);
    const double eG = norm_ratio(g.G, ref.G, ref.G, NE_t * NE_t), eB = norm_ratio(g.B, ref.B, ref.Babs, NE_t * NE_d);
    kf_beta_normal bn, b1;
    CU_ASSERT_EQUAL_FATAL(kf_beta_normal_build(&h, &tg, kc, NE_t, &bn, NULL, &err), KF_OK);
    const double eM = worst_ratio(bn.G, ref.GM, ref.GM, NE_t * NE_t), eb = worst_ratio(bn.b, ref.bM, ref.bM, NE_t);
    CU_ASSERT_EQUAL_FATAL(kf_kept_normal_build(&h, &tg, kc, NE_t, NULL, &b1, &g2, NULL, &err), KF_OK);
    const double eK = worst_ratio(b1.G, ref.GM, ref.GM, NE_t * NE_t);
    ne_reference(Q, kc, NULL, scale, &tg, &ref); /* drop's: no bias */
    const double eD = fmax(norm_ratio(g2.G, ref.G, ref.G, NE_t * NE_t), norm_ratio(g2.B, ref.B, ref.Babs, NE_t * NE_d));
    printf("\n    vs fp64 loops (beta: of each entry's sum of |terms|; values: norm-wise): values G %.1e B %.1e; "
           "beta G %.1e b %.1e yy %.1e; one pass: beta G %.1e, drop %.1e\n", eG, eB, eM, eb,
           fabs(bn.yy - ref.yy) / ref.yy, eK, eD);
    CU_ASSERT(eM < 2e-6 && eb < 2e-6 && eK < 2e-6);
    CU_ASSERT(eG < 1e-5 && eB < 1e-5 && eD < 1e-5);
    CU_ASSERT(fabs(bn.yy - ref.yy) < 1e-12 * ref.yy);
    kf_value_gram_free(&g), kf_value_gram_free(&g2), kf_gram_tiles_free(&w);
    kf_beta_normal_free(&bn), kf_beta_normal_free(&b1);
    kf_am_targets_free(&tg);
}

static CU_TestInfo synthetic_tests[] = {
    {"least squares: known optimum, rank-deficient fallback", test_lstsq_known_optimum},
    {"least squares: underdetermined gives the minimum norm", test_lstsq_underdetermined_min_norm},
    {"targets: partition function, output, RMS score", test_targets_partition_function},
    {"selection recovers planted keys", test_selection_recovers_planted_keys},
    {"beta: all keys -> 0, duplicate -> ln 2, clamp at 3", test_beta_all_keys_and_duplicates},
    {"values: all keys recover V", test_values_recover_v},
    {"fold: mu.u = 1, mean gain 1, exact for the mean query", test_fold_identities},
    {"synthetic: am < fold < drop with an appended block", test_synthetic_ordering},
    {"frame rotation keeps question-key dot products", test_frame_rotation_keeps_dot_products},
    {"values: Tikhonov refit equals its closed form", test_tikhonov_closed_form},
    {"values: a failed Cholesky is retried with a larger ridge", test_ridge_retry},
    {"beta: the box fit reaches the KKT conditions", test_box_fit_reaches_kkt},
    {"beta: restarts from w = 1 are counted", test_beta_restart_counted},
    {"normal equations from fp32 tile products == fp64 loops", test_fp32_tile_normal_equations},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"am and fold steps", NULL, NULL, NULL, NULL, synthetic_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
