/* One (layer, KV head)'s solve as it lands in the cache (compactor/head_solve.c): the kept slots
 * hold the context's keys and values at their recorded positions, am pads a smaller head with
 * no-weight slots, the prefix and suffix stay verbatim, the per-head choice records each head's
 * method with u and beta zero where unused; checked against a plain prefill of the context. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "formats/budgets.h"
#include "test_util.h"
#include "records_fixture.h"

/* The context's K and V of every layer [L, D, kvh * d] from a plain prefill of ids [D]: the
 * reference the cache's slots are checked against. */
static void context_kv(const int32_t *ids, int64_t D, float *K, float *V) {
    const kf_hfconfig *cfg = kf_model_config(g_m);
    const size_t row = (size_t)cfg->n_kv_heads * cfg->head_dim;
    kf_arena a;
    kf_seq seq;
    kf_error err = {0};
    kf_seq_init(&seq);
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, D, &err), KF_OK);
    kf_forward_args fa = {.ids = ids, .n_tokens = (int)D};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &a, &seq, &fa, &err), KF_OK);
    for (int l = 0; l < cfg->n_layers; l++)
        CU_ASSERT_EQUAL(kf_seq_read_kv(&a, &seq, l, 0, D, K + (size_t)l * D * row, V + (size_t)l * D * row, &err),
                        KF_OK);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
}

/* Every head's kept slots hold the context's key (back in AM's frame) at the position the head
 * records, inside the document block and strictly increasing; keep also the context's value, bit
 * for bit; drop and am refit their values (some differ). A head's slots taken from another head's
 * columns, or a position off by one, break it. */
static void test_kept_slots_gathered(void) {
    const kf_hfconfig *cfg = kf_model_config(g_m);
    const int L = cfg->n_layers, kvh = cfg->n_kv_heads, d = cfg->head_dim, n_pre = 2;
    const size_t row = (size_t)kvh * d;
    const int32_t pre_ids[2] = {3199, 10};
    const int64_t D = n_pre + g_doc_n;
    kf_prompt pre = {pre_ids, n_pre}, doc = {g_doc, g_doc_n};
    int32_t *ctx = malloc(sizeof(int32_t) * (size_t)D);
    float *K = malloc(sizeof(float) * (size_t)L * D * row), *V = malloc(sizeof(float) * (size_t)L * D * row);
    memcpy(ctx, pre_ids, sizeof pre_ids);
    memcpy(ctx + n_pre, g_doc, sizeof(int32_t) * g_doc_n);
    context_kv(ctx, D, K, V);
    const kf_method methods[3] = {KF_METHOD_KEEP, KF_METHOD_DROP, KF_METHOD_AM};
    for (int mi = 0; mi < 3; mi++) {
        kf_compact_params p = params(methods[mi], 0.1);
        p.choice.head_choice = KF_CHOICE_OFF;
        kf_compacted c;
        kf_error err = {0};
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, &pre, &doc, NULL, &p, &c, &err), KF_OK);
        kf_compacted_set_frame(&c, g_m, 0);
        double kdiff = 0;
        int bad_pos = 0, v_same = 0, n = 0;
        for (int l = 0; l < L; l++)
            for (int g = 0; g < kvh; g++) {
                const int32_t *hp = c.positions + ((size_t)l * kvh + g) * c.C;
                for (int64_t j = n_pre; j < n_pre + c.t; j++, n++) {
                    const int32_t pos = hp[j];
                    bad_pos += pos < n_pre || pos >= D || (j > n_pre && pos <= hp[j - 1]);
                    if (pos < 0 || pos >= D)
                        continue;
                    const size_t at = ((size_t)l * c.C + j) * row + (size_t)g * d;
                    const size_t ref = ((size_t)l * D + pos) * row + (size_t)g * d;
                    const double kd = kf_max_abs_diff(c.keys + at, K + ref, (size_t)d);
                    kdiff = kd > kdiff ? kd : kdiff;
                    v_same += memcmp(c.values + at, V + ref, sizeof(float) * d) == 0;
                }
            }
        printf("\n    %s: %d kept slots, max |dkey| %.2e, %d values the context's", kf_method_name(methods[mi]), n,
               kdiff, v_same);
        CU_ASSERT_EQUAL(bad_pos, 0);
        CU_ASSERT(kdiff < 1e-4);
        CU_ASSERT(methods[mi] == KF_METHOD_KEEP ? v_same == n : v_same < n);
        kf_compacted_free(&c);
    }
    printf("\n");
    free(ctx);
    free(K);
    free(V);
}

/* The per-head choice records every head's method; heads not folded carry u = 0 and beta = 0. */
static void test_head_choice_recorded(void) {
    kf_prompt doc = {g_doc, g_doc_n};
    kf_error err = {0};
    for (int method = KF_METHOD_AM; method <= KF_METHOD_FOLD; method++) {
        kf_compact_params p = params((kf_method)method, 0.25);
        p.choice.head_choice = KF_CHOICE_ON;
        p.choice.choice_margin = 0;
        kf_compacted c;
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
        const int n = c.n_layers * c.kv_heads;
        int counts[4] = {0}, total = 0;
        CU_ASSERT_PTR_NOT_NULL_FATAL(c.head_method);
        CU_ASSERT(c.stats.n_val_queries > 0);
        for (int h = 0; h < n; h++) {
            const int hm = c.head_method[h];
            CU_ASSERT(hm == method || hm == KF_METHOD_DROP || hm == KF_METHOD_KEEP);
            counts[hm]++;
            double un = 0, bn = 0;
            for (int k = 0; k < c.head_dim; k++)
                un += fabs(c.u[(size_t)h * c.head_dim + k]);
            for (int64_t j = 0; j < c.C; j++)
                bn += fabs(c.beta[(size_t)h * c.C + j]);
            CU_ASSERT(hm == KF_METHOD_FOLD ? un > 0 : un == 0);
            CU_ASSERT(hm == KF_METHOD_AM ? bn > 0 : bn == 0);
        }
        for (int k = 0; k < 4; k++) {
            CU_ASSERT_EQUAL(counts[k], c.stats.heads_by_method[k]);
            total += c.stats.heads_by_method[k];
        }
        CU_ASSERT_EQUAL(total, n);
        printf("\n    %s with choice: keep %d drop %d am %d fold %d of %d heads, %d with alpha > 0",
               kf_method_name((kf_method)method), counts[0], counts[1], counts[2], counts[3], n, c.stats.heads_ridged);
        kf_compacted_free(&c);
    }
    printf("\n");
}

/* max |a - b| over n floats, relative to max |b| (0 when b is all zero). */
static double rel_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t k = 0; k < n; k++)
        m = fmax(m, fabs(b[k]));
    return m > 0 ? kf_max_abs_diff(a, b, n) / m : kf_max_abs_diff(a, b, n);
}

/* The values refit alone (KF_REFIT_VALUES) ships the validated candidate's beta and fold
 * direction: u, the folded keys and am's beta equal those of the fit on the training subsample
 * (KF_REFIT_TRAIN, which refits them afresh from the subsample's rows); every head's method and
 * alpha are those of the full refit (KF_REFIT_ALL: the choice does not depend on the refit), and its
 * drop and keep heads are the full refit's, bit for bit; its am and fold heads' values differ from
 * the subsample's (refitted on all the rows). */
static void test_refit_values_shipped(void) {
    kf_prompt doc = {g_doc, g_doc_n};
    kf_error err = {0};
    for (int method = KF_METHOD_AM; method <= KF_METHOD_FOLD; method++) {
        kf_compacted c[3]; /* KF_REFIT_TRAIN, KF_REFIT_ALL, KF_REFIT_VALUES */
        for (int r = 0; r < 3; r++) {
            kf_compact_params p = params((kf_method)method, 0.25);
            p.choice.head_choice = KF_CHOICE_ON;
            p.choice.choice_margin = 0;
            p.choice.choice_rows = 1; /* a subsample smaller than the training rows: KF_CHOICE_MIN_ROWS */
            p.choice.refit_all = r;
            CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c[r], &err), KF_OK);
        }
        const int d = c[0].head_dim, kvh = c[0].kv_heads;
        const size_t row = (size_t)kvh * d;
        int n_method = 0, n_other = 0, bad = 0;
        double du = 0, dk = 0, db = 0, dv_min = INFINITY;
        for (int h = 0; h < c[0].n_layers * kvh; h++) {
            const int l = h / kvh, g = h % kvh, hm = c[2].head_method[h];
            bad += hm != c[1].head_method[h] || hm != c[0].head_method[h] || c[2].head_alpha[h] != c[1].head_alpha[h];
            du = fmax(du, rel_diff(c[2].u + (size_t)h * d, c[0].u + (size_t)h * d, (size_t)d));
            db = fmax(db, rel_diff(c[2].beta + (size_t)h * c[0].C, c[0].beta + (size_t)h * c[0].C, (size_t)c[0].C));
            double vdiff = 0;
            for (int64_t j = 0; j < c[0].t; j++) {
                const size_t at = ((size_t)l * c[0].C + j) * row + (size_t)g * d;
                dk = fmax(dk, rel_diff(c[2].keys + at, c[0].keys + at, (size_t)d));
                vdiff = fmax(vdiff, kf_max_abs_diff(c[2].values + at, c[0].values + at, (size_t)d));
                if (hm == KF_METHOD_DROP || hm == KF_METHOD_KEEP)
                    bad += memcmp(c[2].keys + at, c[1].keys + at, sizeof(float) * d) != 0 ||
                           memcmp(c[2].values + at, c[1].values + at, sizeof(float) * d) != 0;
            }
            if (hm == method)
                n_method++, dv_min = fmin(dv_min, vdiff);
            else
                n_other++;
        }
        printf("\n    %s: %d heads of the method, %d others; against the subsample's fit: u %.1e, keys %.1e, beta "
               "%.1e (relative), values at least %.1e apart",
               kf_method_name((kf_method)method), n_method, n_other, du, dk, db, dv_min);
        CU_ASSERT_EQUAL(bad, 0);
        CU_ASSERT(n_method > 0 && n_other > 0);
        CU_ASSERT(du <= 1e-6 && dk <= 1e-6 && db <= 1e-6);
        CU_ASSERT(dv_min > 1e-6);
        for (int r = 0; r < 3; r++)
            kf_compacted_free(&c[r]);
    }
    printf("\n");
}

/* The refit's training rows (refit_rows), on a document long enough for more than
 * KF_REFIT_MIN_ROWS of them (doc1-3, 256 records): a cap past every row ships the uncapped refit
 * bit for bit; a cap at the floor leaves every head's method, alpha, keys, beta and fold direction
 * as they were (the choice does not depend on the refit) and keep heads bit for bit, and moves
 * the values of the heads it refits. */
static void test_refit_rows_cap(void) {
    static int32_t ids[4096];
    kf_prompt doc = {ids, kf_test_records_ids(4, ids, 4096)}; /* doc1-3 */
    kf_error err = {0};
    CU_ASSERT_FATAL(doc.n > 1500);
    for (int method = KF_METHOD_AM; method <= KF_METHOD_FOLD; method++) {
        kf_compacted c[3]; /* refit_rows 0 (all), past all, at the floor */
        const double cap[3] = {0, 1e6, 1};
        for (int r = 0; r < 3; r++) {
            kf_compact_params p = params((kf_method)method, 0.1);
            p.solver.max_queries = 4000; /* every query of the repeat: more than 2,048 training rows */
            p.choice.head_choice = KF_CHOICE_ON;
            p.choice.choice_margin = 0;
            p.choice.choice_rows = 1; /* KF_CHOICE_MIN_ROWS of more training rows */
            p.choice.refit_rows = cap[r];
            CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c[r], &err), KF_OK);
        }
        const int d = c[0].head_dim, kvh = c[0].kv_heads, n = c[0].n_layers * kvh;
        const size_t row = (size_t)kvh * d, kv = (size_t)c[0].n_layers * c[0].C * row;
        CU_ASSERT(memcmp(c[1].keys, c[0].keys, sizeof(float) * kv) == 0);
        CU_ASSERT(memcmp(c[1].values, c[0].values, sizeof(float) * kv) == 0);
        CU_ASSERT(memcmp(c[2].keys, c[0].keys, sizeof(float) * kv) == 0);
        CU_ASSERT(memcmp(c[2].beta, c[0].beta, sizeof(float) * (size_t)n * c[0].C) == 0);
        CU_ASSERT(memcmp(c[2].u, c[0].u, sizeof(float) * (size_t)n * d) == 0);
        int bad = 0, refitted = 0, moved = 0;
        for (int h = 0; h < n; h++) {
            const int l = h / kvh, g = h % kvh, hm = c[0].head_method[h];
            bad += c[2].head_method[h] != hm || c[2].head_alpha[h] != c[0].head_alpha[h];
            double dv = 0;
            for (int64_t j = 0; j < c[0].t; j++) {
                const size_t at = ((size_t)l * c[0].C + j) * row + (size_t)g * d;
                dv = fmax(dv, kf_max_abs_diff(c[2].values + at, c[0].values + at, (size_t)d));
            }
            bad += hm == KF_METHOD_KEEP && dv != 0;
            refitted += hm != KF_METHOD_KEEP;
            moved += hm != KF_METHOD_KEEP && dv > 1e-6;
        }
        printf("\n    %s: %d of %d refitted heads moved by the cap", kf_method_name((kf_method)method), moved,
               refitted);
        CU_ASSERT_EQUAL(bad, 0);
        CU_ASSERT(refitted > 0 && moved == refitted);
        for (int r = 0; r < 3; r++)
            kf_compacted_free(&c[r]);
    }
    printf("\n");
}

/* Per-head budgets from AM's JSON: C is set by the largest head; am pads smaller heads with
 * slots whose bias is -inf, so whatever keys those slots hold, the question's logits do not move. */
static void test_head_budgets(void) {
    const kf_hfconfig *cfg = kf_model_config(g_m);
    const int L = cfg->n_layers, kvh = cfg->n_kv_heads, d = cfg->head_dim;
    const char *json = "{\"L0H0\": 3, \"L0H1\": 1, \"L1H0\": 1, \"L2H1\": 0.5}";
    char path[512];
    snprintf(path, sizeof path, "%s", kf_test_write_file("budgets.json", json, strlen(json)));
    float shares[64];
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_head_budgets_load(path, L, kvh, shares, &err), KF_OK);
    double total = 0;
    for (int i = 0; i < L * kvh; i++)
        total += shares[i];
    CU_ASSERT(fabs(total - 1.0) < 1e-5);
    CU_ASSERT(shares[0] > shares[1]);
    CU_ASSERT(fabs(shares[3] - 1.0 / (L * kvh) / (5.5 + (L * kvh - 4) * 1.0 / (L * kvh))) < 1e-5); /* missing */
    /* malformed, missing heads, negative, non-numeric; then a share beyond a float (inf / inf would
     * make every budget NaN) and keys that would alias L0H0 */
    const char *bad[] = {"{\"L0X1\": 1}", "{\"L99H0\": 1}", "{\"L0H0\": -1}", "{\"L0H0\": \"a\"}", "[1]",
                         "{\"L0H0\": 1e39, \"L0H1\": 1e39}", "{\"L00H0\": 1}", "{\"L0H0\": 1, \"L00H0\": 2}",
                         "{\"L+0H0\": 1}", "{\"L 0H0\": 1}", "{\"L0H-0\": 1}"};
    for (int i = 0; i < (int)(sizeof bad / sizeof *bad); i++) {
        const char *bp = kf_test_write_file("bad-budgets.json", bad[i], strlen(bad[i]));
        CU_ASSERT_NOT_EQUAL(kf_head_budgets_load(bp, L, kvh, shares, &err), KF_OK);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "bad-budgets.json"));
    }
    CU_ASSERT_EQUAL_FATAL(kf_head_budgets_load(path, L, kvh, shares, &err), KF_OK);
    kf_prompt doc = {g_doc, g_doc_n};
    kf_compact_params p = params(KF_METHOD_AM, 0.1);
    p.solver.head_budgets = shares;
    kf_compacted c;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
    CU_ASSERT(c.C > (int64_t)(0.1 * g_doc_n)); /* the largest head sets C */
    int padded = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < kvh; g++)
            for (int64_t j = 0; j < c.C; j++) {
                const size_t hj = ((size_t)l * kvh + g) * c.C + j;
                if (c.positions[hj] >= 0)
                    continue;
                padded++;
                CU_ASSERT(isinf(c.beta[hj]) && c.beta[hj] < 0);
            }
    CU_ASSERT(padded > 0);
    const int32_t q[7] = {81, 58, 1317, 63, 10, 65, 58};
    const int V = kf_model_config(g_m)->vocab_size;
    float *a = malloc(sizeof(float) * 7 * V), *b = malloc(sizeof(float) * 7 * V);
    question_logits(&c, q, 7, a);
    for (int l = 0; l < L; l++) /* fill the padded slots with loud keys and values */
        for (int g = 0; g < kvh; g++)
            for (int64_t j = 0; j < c.C; j++)
                if (c.positions[((size_t)l * kvh + g) * c.C + j] < 0)
                    for (int e = 0; e < d; e++) {
                        c.keys[(((size_t)l * c.C + j) * kvh + g) * d + e] = 50.0f;
                        c.values[(((size_t)l * c.C + j) * kvh + g) * d + e] = 1e3f;
                    }
    question_logits(&c, q, 7, b);
    CU_ASSERT_EQUAL(kf_max_abs_diff(a, b, (size_t)7 * V), 0.0);
    free(a);
    free(b);
    kf_compacted_free(&c);
    /* fold with the same budgets: real keys everywhere, no padding */
    p.method = KF_METHOD_FOLD;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
    int pads = 0;
    for (size_t i = 0; i < (size_t)L * kvh * c.C; i++)
        pads += c.positions[i] < 0;
    CU_ASSERT_EQUAL(pads, 0);
    kf_compacted_free(&c);
}

/* A chat-template prefix and suffix stay verbatim (beta 0, original positions) around the block. */
static void test_prefix_suffix_verbatim(void) {
    const kf_hfconfig *cfg = kf_model_config(g_m);
    const int kvh = cfg->n_kv_heads, d = cfg->head_dim;
    const size_t row = (size_t)kvh * d;
    const int32_t pre_ids[3] = {3199, 45, 10}, suf_ids[2] = {10, 3199};
    kf_prompt pre = {pre_ids, 3}, doc = {g_doc, g_doc_n}, suf = {suf_ids, 2};
    kf_compact_params p = params(KF_METHOD_AM, 0.25);
    kf_compacted c;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, &pre, &doc, &suf, &p, &c, &err), KF_OK);
    const int t = (int)(0.25 * g_doc_n);
    CU_ASSERT_EQUAL(c.D, 3 + g_doc_n + 2);
    CU_ASSERT_EQUAL(c.C, 3 + t + 2);
    kf_compacted_set_frame(&c, g_m, 0); /* compare keys at their original positions */
    /* the context's own K/V from a plain prefill */
    int32_t *ctx = malloc(sizeof(int32_t) * (size_t)c.D);
    memcpy(ctx, pre_ids, sizeof pre_ids);
    memcpy(ctx + 3, g_doc, sizeof(int32_t) * g_doc_n);
    memcpy(ctx + 3 + g_doc_n, suf_ids, sizeof suf_ids);
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, c.D, &err), KF_OK);
    kf_forward_args fa = {.ids = ctx, .n_tokens = (int)c.D};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &a, &seq, &fa, &err), KF_OK);
    float *K = malloc(sizeof(float) * (size_t)c.D * row), *V = malloc(sizeof(float) * (size_t)c.D * row);
    for (int l = 0; l < c.n_layers; l++) {
        CU_ASSERT_EQUAL_FATAL(kf_seq_read_kv(&a, &seq, l, 0, c.D, K, V, &err), KF_OK);
        const float *ck = c.keys + (size_t)l * c.C * row, *cv = c.values + (size_t)l * c.C * row;
        CU_ASSERT(kf_max_abs_diff(ck, K, 3 * row) < 1e-4);                                   /* prefix */
        CU_ASSERT(kf_max_abs_diff(cv, V, 3 * row) == 0);
        CU_ASSERT(kf_max_abs_diff(ck + (3 + t) * row, K + (3 + g_doc_n) * row, 2 * row) < 1e-4); /* suffix */
        CU_ASSERT(kf_max_abs_diff(cv + (3 + t) * row, V + (3 + g_doc_n) * row, 2 * row) == 0);
        for (int g = 0; g < kvh; g++) {
            const float *hb = c.beta + ((size_t)l * kvh + g) * c.C;
            const int32_t *hp = c.positions + ((size_t)l * kvh + g) * c.C;
            CU_ASSERT(hb[0] == 0 && hb[2] == 0 && hb[3 + t] == 0 && hb[4 + t] == 0);
            CU_ASSERT(hp[0] == 0 && hp[2] == 2 && hp[3 + t] == 3 + g_doc_n && hp[4 + t] == 4 + g_doc_n);
            for (int j = 3; j < 3 + t; j++)
                CU_ASSERT(hp[j] >= 3 && hp[j] < 3 + g_doc_n && (j == 3 || hp[j] > hp[j - 1]));
        }
    }
    free(K);
    free(V);
    free(ctx);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    kf_compacted_free(&c);
}

static CU_TestInfo model_tests[] = {
    {"kept slots: the context's K/V at the recorded positions", test_kept_slots_gathered},
    {"per-head budgets: padding gets no weight", test_head_budgets},
    {"prefix and suffix kept verbatim", test_prefix_suffix_verbatim},
    {"per-head choice recorded; u, beta zero where not folded", test_head_choice_recorded},
    {"values refit: the validated beta and direction, values on all rows", test_refit_values_shipped},
    {"refit rows: past all rows the same bits, at the floor the same picks", test_refit_rows_cap},
    CU_TEST_INFO_NULL,
};

static CU_SuiteInfo suites[] = {
    {"per-head solve on records-qwen3", init_model, clean_model, NULL, NULL, model_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
