/* How the per-head choice scores its candidates: drop's pick over the alpha grid against every
 * alpha solved and scored here, and the held-out rows it scores, a stratified subsample
 * (kf_val_score_rows, kf_split_head's order). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/am.h"
#include "compactor/compact.h"
#include "compactor/compact_internal.h"
#include "compactor/diag.h"
#include "compactor/refq.h"
#include "test_util.h"

/* ---- the alpha grid ---- */

static const double kGrid[] = {0, 1e-2, 1e-1}; /* the choice's grid (compactor/choice.c) */
enum { N_GRID = sizeof kGrid / sizeof *kGrid };

static double rank_worst; /* the ranking solves' worst norm-wise distance from fp64's, over the cases */

/* The ranking solve against kf_value_gram_solve's values s64: bit for bit below alpha 1e-3 (fp64
 * there too), else within 1e-4 norm-wise (fp32 factors of a ridged system). */
static void check_rank_solve(const float *vals, const float *s64, int n, double alpha) {
    double num = 0, den = 0;
    for (int k = 0; k < n; k++)
        num += ((double)vals[k] - s64[k]) * ((double)vals[k] - s64[k]), den += (double)s64[k] * s64[k];
    const double e = sqrt(num / fmax(den, 1e-300));
    if (alpha < 1e-3)
        CU_ASSERT(memcmp(vals, s64, sizeof(float) * (size_t)n) == 0);
    rank_worst = fmax(rank_worst, e);
    CU_ASSERT(e < 1e-4);
}

/* drop's pick over the whole grid, then keep's, as a scan of every alpha makes it: drop's value
 * normal equations on the choice's rows of the planted head (the first kf_choice_rows), each alpha
 * solved as the choice ranks (kf_value_gram_rank_solve, checked against the fp64 solve) and scored;
 * *drop_min: the grid index of drop's own minimum. */
static kf_head_pick full_grid_pick(kf_planted_head *ph, int *drop_min) {
    const int t = KF_PLANT_KEPT, d = KF_PLANT_D;
    const float *v0 = ph->p.solver.ridge_to == KF_RIDGE_TO_ORIG ? ph->V : NULL;
    kf_error err = {0};
    kf_value_gram g;
    const int rows = kf_choice_rows(&ph->p, ph->h.R, t);
    CU_ASSERT_FATAL(kf_value_gram_build(ph->h.be, ph->h.q, rows, d, ph->h.scale, ph->K, d, NULL, t, ph->tg.Y, &g,
                                        NULL, &err) == KF_OK);
    const kf_kv_block kb = {ph->K, NULL, d, NULL, t};
    CU_ASSERT_FATAL(kf_val_attend(&ph->vh, &kb) == 0);
    kf_head_pick best = {KF_METHOD_KEEP, ph->p.solver.lambda_rel, 0, INFINITY};
    float vals[KF_PLANT_KEPT * KF_PLANT_D], s64[KF_PLANT_KEPT * KF_PLANT_D];
    for (int a = 0; a < N_GRID; a++) {
        CU_ASSERT(kf_value_gram_solve(&g, kGrid[a], v0, d, s64, NULL, &err) == KF_OK);
        CU_ASSERT(kf_value_gram_rank_solve(&g, kGrid[a], v0, d, vals, &err) == KF_OK);
        check_rank_solve(vals, s64, t * d, kGrid[a]);
        const double e = kf_val_err_values(&ph->vh, vals, d);
        printf(" %.3e", e);
        if (e < best.err)
            best = (kf_head_pick){KF_METHOD_DROP, ph->p.solver.lambda_rel, kGrid[a], e}, *drop_min = a;
    }
    kf_value_gram_free(&g);
    const kf_kv_block keep = {ph->K, ph->V, d, NULL, t};
    const double e_keep = kf_val_err(&ph->vh, &keep);
    if (e_keep < best.err)
        best = (kf_head_pick){KF_METHOD_KEEP, ph->p.solver.lambda_rel, 0, e_keep};
    return best;
}

/* Planted heads of every kind (test_util.h), drop against keep: the choice's pick is the whole
 * grid's minimum. drop's own minimum falls at alpha 0 and past it across the cases (past it where
 * the validation queries are the training ones' and the ridge pulls towards the original values). */
static void test_alpha_grid(void) {
    static const int kRows[] = {12, 60, 240, 960}; /* 12: fewer rows than kept keys */
    int at[N_GRID] = {0}, cases = 0;
    for (int dup = 0; dup < 2; dup++)
        for (int s = 0; s < 2; s++)
            for (int to = 0; to < 2; to++)
                for (size_t r = 0; r < sizeof kRows / sizeof *kRows; r++) {
                    const int rtr = kRows[r];
                    kf_planted_head ph;
                    kf_planted_init(&ph, dup, s ? -1.0f : 1.0f, to ? KF_RIDGE_TO_ORIG : KF_RIDGE_TO_ZERO, rtr);
                    ph.p.method = KF_METHOD_DROP;
                    printf("\n    dup %d sign %+d to %s rows %4d: errors", dup, s ? -1 : 1, to ? "orig" : "zero", rtr);
                    int drop_min = 0;
                    const kf_head_pick want = full_grid_pick(&ph, &drop_min);
                    kf_head_pick got = {KF_METHOD_KEEP, 0, 0, NAN};
                    kf_error err = {0};
                    CU_ASSERT_EQUAL(kf_choose_head(&ph.p, &ph.h, &ph.tg, ph.sel, KF_PLANT_KEPT, ph.K, ph.V, &ph.vh, 1,
                                                   &got, NULL, NULL, &err),
                                    KF_OK);
                    printf("; picked %s alpha %g err %.9e (whole grid: %s alpha %g err %.9e)", kf_method_name(got.method), got.alpha, got.err,
                           kf_method_name(want.method), want.alpha, want.err);
                    CU_ASSERT(got.method == want.method && got.alpha == want.alpha);
                    CU_ASSERT(fabs(got.err - want.err) <= 1e-9 * want.err);
                    at[drop_min]++;
                    cases++;
                    kf_planted_free(&ph);
                }
    printf("\n    %d cases; drop's minimum at alpha 0: %d, 1e-2: %d, 1e-1: %d; ranking solves within %.1e of "
           "fp64's\n", cases, at[0], at[1], at[2], rank_worst);
    CU_ASSERT(at[0] > 0 && at[1] + at[2] > 0);
}

/* ---- the scored held-out rows ---- */

static void test_val_score_rows(void) {
    kf_compact_params p = kf_compact_params_default();
    CU_ASSERT_EQUAL(p.choice.val_rows, 0.2);
    CU_ASSERT_EQUAL(kf_val_score_rows(&p, 3280, 8192), 1639); /* ceil(1638.4) */
    CU_ASSERT_EQUAL(kf_val_score_rows(&p, 3300, 1000), KF_VAL_MIN_ROWS);
    CU_ASSERT_EQUAL(kf_val_score_rows(&p, 400, 1000), 400);
    CU_ASSERT_EQUAL(kf_val_score_rows(&p, 1000, 8192), 1000);
    p.choice.val_rows = 1.5;
    CU_ASSERT_EQUAL(kf_val_score_rows(&p, 3300, 411), 617); /* ceil(616.5) */
    p.choice.val_rows = 0;
    CU_ASSERT_EQUAL(kf_val_score_rows(&p, 3300, 8192), 3300);
}

enum { SP_D = 4, SP_GROUP = 2, SP_POS = 40, SP_R = SP_GROUP * SP_POS };

/* A split of SP_POS positions, the last ten probes: positions 0, 2, .., 18 and every probe held
 * out (40 rows of 80); row r's query, m, y and Y carry r. */
typedef struct {
    kf_refq rq;
    uint8_t source[SP_POS], is_val[SP_POS];
    float q[SP_R * SP_D], m[SP_R], y[SP_R], Y[SP_R * SP_D];
    int64_t tr_order[SP_R], pos_local[SP_POS];
    int pos_src[SP_POS];
    appended_kv ap;
    head_split s;
} split_case;

static void split_case_init(split_case *c, int64_t n_score) {
    memset(c, 0, sizeof *c);
    c->rq = (kf_refq){.kv_heads = 1, .head_dim = SP_D, .group = SP_GROUP, .n_pos = SP_POS, .R = SP_R,
                      .source = c->source};
    for (int k = 0; k < SP_POS; k++) {
        c->source[k] = k >= 30 ? KF_REFQ_PROBE : KF_REFQ_REPEAT;
        c->is_val[k] = k >= 30 || (k < 20 && k % 2 == 0);
        c->pos_local[k] = k;
    }
    for (int r = 0; r < SP_R; r++) {
        c->m[r] = c->y[r] = (float)r;
        for (int j = 0; j < SP_D; j++)
            c->q[r * SP_D + j] = c->Y[r * SP_D + j] = (float)r;
    }
    int64_t n_tr = 0;
    for (int r = 0; r < SP_R; r++)
        if (!c->is_val[r % SP_POS])
            c->tr_order[n_tr++] = r;
    c->ap.n_src = 1;
    CU_ASSERT_FATAL(kf_split_alloc(&c->s, SP_R, SP_R - n_tr, SP_D, 1) == 0);
    c->s.n_tr = n_tr, c->s.n_val = SP_R - n_tr, c->s.n_score = n_score;
    const kf_am_targets tg = {c->m, c->y, c->Y, NULL};
    kf_split_head(&c->s, &c->rq, c->q, &tg, c->is_val, c->tr_order, c->pos_src, c->pos_local, &c->ap, NULL, 0);
}

/* The held-out rows in gather order (by query head, then position), as row numbers. */
static int gather_order(const split_case *c, int *rows) {
    int n = 0;
    for (int j = 0; j < SP_GROUP; j++)
        for (int k = 0; k < SP_POS; k++)
            if (c->is_val[k])
                rows[n++] = j * SP_POS + k;
    return n;
}

/* Every held-out row once, its query and targets with it. */
static int split_complete(const split_case *c) {
    int seen[SP_R] = {0}, ok = 1;
    for (int64_t i = 0; i < c->s.n_val; i++) {
        const int r = (int)c->s.val_q[i * SP_D];
        ok &= r >= 0 && r < SP_R && c->is_val[r % SP_POS] && !seen[r]++;
        ok &= c->s.val_m[i] == r && c->s.val_y[i] == r && c->s.val_Y[i * SP_D + SP_D - 1] == r;
        ok &= c->s.val_vis[i] == r % SP_POS + 1;
    }
    return ok;
}

/* All scored: gather order, probe rows half the weight. Thirty: the twenty probe rows and every
 * other repeat row first (each half the weight again), the rest after. Twelve: probe rows only,
 * evenly spaced, all weighing the same. */
static void test_split_scored_rows(void) {
    int order[SP_R];
    split_case c;
    split_case_init(&c, 40);
    CU_ASSERT_EQUAL(gather_order(&c, order), 40);
    CU_ASSERT(split_complete(&c));
    for (int i = 0; i < 40; i++) {
        CU_ASSERT_EQUAL((int)c.s.val_q[i * SP_D], order[i]);
        CU_ASSERT_EQUAL(c.s.val_w[i], 0.05); /* 0.5 / 10 positions of either kind */
    }
    kf_split_free(&c.s);

    split_case_init(&c, 30);
    CU_ASSERT(split_complete(&c));
    double w_probe = 0, w_other = 0;
    int n_probe = 0, prev = -1;
    for (int i = 0; i < 30; i++) {
        const int r = (int)c.s.val_q[i * SP_D], probe = r % SP_POS >= 30;
        n_probe += probe;
        *(probe ? &w_probe : &w_other) += c.s.val_w[i];
        if (!probe) { /* the repeat rows at positions 2, 6, 10, 14, 18 of both query heads */
            CU_ASSERT(r % SP_POS % 4 == 2);
            CU_ASSERT(r > prev);
            prev = r;
        }
    }
    CU_ASSERT_EQUAL(n_probe, 20);
    CU_ASSERT(fabs(w_probe - w_other) < 1e-12);
    for (int i = 30; i < 40; i++) /* the rest: repeat rows at positions 0, 4, .., 16 */
        CU_ASSERT((int)c.s.val_q[i * SP_D] % SP_POS % 4 == 0);
    kf_split_free(&c.s);

    split_case_init(&c, 12);
    CU_ASSERT(split_complete(&c));
    for (int i = 0; i < 12; i++) {
        CU_ASSERT((int)c.s.val_q[i * SP_D] % SP_POS >= 30);
        CU_ASSERT_EQUAL(c.s.val_w[i], 1.0);
    }
    CU_ASSERT_EQUAL((int)c.s.val_q[0], 31); /* of 20 probe rows, 12 evenly spaced: the second first */
    kf_split_free(&c.s);
}

static CU_TestInfo scoring_tests[] = {
    {"drop's alpha == every alpha of the grid scored by hand, on planted heads", test_alpha_grid},
    {"scored held-out rows: per document token, floor, all", test_val_score_rows},
    {"the split: the scored rows first (probes, then evenly spaced), weights halved between kinds",
     test_split_scored_rows},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"per-head choice: scoring", NULL, NULL, NULL, NULL, scoring_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
