/* test_evaluate.c — compactor/evaluate: the quality measurement itself, on records-llama3-induct
 * (a model that answers every records question from the full document). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/diag.h"
#include "compactor/evaluate.h"
#include "kernels/backend.h"
#include "test_util.h"

static kf_backend *g_b;
static kf_model *g_m;
static int32_t g_doc[4096];
static int g_doc_n;
static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10}; /* "Repeat the records above.\n" */
enum { DASH = 45, NL = 10 };

static int init_model(void) {
    if (kf_test_model_open("records-llama3-induct", &g_b, &g_m))
        return -1;
    g_doc_n = kf_test_records_ids(1, g_doc, 4096); /* doc1-0: 16 lines, 92 tokens */
    return g_doc_n > 50 ? 0 : -1;
}

static int clean_model(void) {
    return kf_test_model_close(g_b, g_m);
}

/* Questions "Q: <name>?\nA:" with answers [name value \n] about the document's first n records. */
static int records_questions(const int32_t *doc, int doc_n, int32_t (*qs)[7], int32_t (*as)[3], kf_qa *qa, int n) {
    int nq = 0;
    for (int i = 0; i + 3 < doc_n && nq < n; i++) {
        if (!(doc[i] == DASH && doc[i + 3] == NL && (i == 0 || doc[i - 1] == NL)))
            continue;
        const int32_t q[7] = {81, 58, doc[i + 1], 63, 10, 65, 58};
        memcpy(qs[nq], q, sizeof q);
        as[nq][0] = doc[i + 1], as[nq][1] = doc[i + 2], as[nq][2] = NL;
        qa[nq] = (kf_qa){{qs[nq], 7}, {as[nq], 3}};
        nq++;
    }
    return nq;
}

static kf_compact_params params(kf_method method, double budget) {
    kf_compact_params p = kf_compact_params_default();
    p.method = method;
    p.budget = budget;
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    return p;
}

/* A 20-token document and a 100-token answer: the compacted cache's logits rows must hold the
 * answer (they held max(document, 64) rows; AddressSanitizer caught the overflow). */
static void test_long_answer_short_document(void) {
    static int32_t q[7], a[100];
    const int32_t name = g_doc[1];
    const int32_t qq[7] = {81, 58, name, 63, 10, 65, 58};
    memcpy(q, qq, sizeof q);
    for (int i = 0; i < 100; i++)
        a[i] = g_doc[(1 + i) % g_doc_n];
    kf_qa qa = {{q, 7}, {a, 100}};
    kf_prompt doc = {g_doc, 20}, instr = {kInstr, 6};
    kf_reference *ref;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_reference_build(g_m, &doc, &instr, &qa, 1, &ref, &err), KF_OK);
    kf_compacted c;
    kf_compact_params p = params(KF_METHOD_KEEP, 0.5);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
    kf_quality qm;
    CU_ASSERT_EQUAL(kf_quality_measure(g_m, ref, &c, &qm, NULL, NULL, &err), KF_OK);
    CU_ASSERT_EQUAL(qm.n_answer, 100);
    CU_ASSERT(isfinite(qm.kl_answer) && qm.kl_answer > 0);
    kf_compacted_free(&c);
    CU_ASSERT_EQUAL_FATAL(kf_reference_full_cache(ref, &c, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_quality_measure(g_m, ref, &c, &qm, NULL, NULL, &err), KF_OK);
    CU_ASSERT(qm.kl_answer < 1e-6);
    kf_compacted_free(&c);
    kf_reference_free(ref);
}

/* The uncompacted cache through the same measurement: no divergence, no error, and this model
 * recalls every fact and answers every question from the full document (tests/data/FIXTURES.md). */
static void test_full_cache_is_exact(void) {
    static int32_t qs[8][7], as[8][3];
    kf_qa qa[8];
    const int nq = records_questions(g_doc, g_doc_n, qs, as, qa, 8);
    CU_ASSERT_EQUAL_FATAL(nq, 8);
    kf_prompt doc = {g_doc, g_doc_n}, instr = {kInstr, 6};
    kf_reference *ref;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_reference_build(g_m, &doc, &instr, qa, nq, &ref, &err), KF_OK);
    kf_compacted c;
    CU_ASSERT_EQUAL_FATAL(kf_reference_full_cache(ref, &c, &err), KF_OK);
    CU_ASSERT_EQUAL(c.C, g_doc_n);
    CU_ASSERT_EQUAL(c.positions[g_doc_n - 1], g_doc_n - 1);
    kf_quality qm;
    double head_out[4];
    CU_ASSERT_EQUAL_FATAL(kf_quality_measure(g_m, ref, &c, &qm, NULL, head_out, &err), KF_OK);
    CU_ASSERT(qm.kl_repeat < 1e-6 && qm.kl_answer < 1e-6);
    CU_ASSERT(qm.lse_err < 1e-5 && qm.out_err < 1e-5 && head_out[3] < 1e-5);
    CU_ASSERT_EQUAL(qm.n_facts, 8);
    CU_ASSERT_DOUBLE_EQUAL(qm.fact_acc, 1.0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(qm.qa_em, 1.0, 1e-12);
    int counts[4];
    kf_compacted_head_counts(&c, counts);
    CU_ASSERT(counts[KF_METHOD_KEEP] == 4 && counts[KF_METHOD_DROP] == 0);
    kf_compacted_free(&c);
    kf_reference_free(ref);
}

/* fact_acc of a compacted cache against a direct count: the cache attached, each question and
 * its answer run through the forward pass, the argmax of the row that predicts the value. */
static void test_fact_acc_matches_direct_count(void) {
    static int32_t qs[8][7], as[8][3];
    kf_qa qa[8];
    const int nq = records_questions(g_doc, g_doc_n, qs, as, qa, 8);
    kf_prompt doc = {g_doc, g_doc_n}, instr = {kInstr, 6};
    kf_reference *ref;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_reference_build(g_m, &doc, &instr, qa, nq, &ref, &err), KF_OK);
    kf_compacted c;
    kf_compact_params p = params(KF_METHOD_KEEP, 0.25);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
    kf_quality qm;
    CU_ASSERT_EQUAL_FATAL(kf_quality_measure(g_m, ref, &c, &qm, NULL, NULL, &err), KF_OK);
    const int V = kf_model_config(g_m)->vocab_size;
    float *logits = malloc(sizeof(float) * V);
    kf_arena a = {0};
    kf_seq seq;
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, c.C + 64, &err), KF_OK);
    int hits = 0;
    for (int i = 0; i < nq; i++) {
        CU_ASSERT_EQUAL_FATAL(kf_compacted_attach(&c, &a, &seq, &err), KF_OK);
        int32_t ids[8], row = 7; /* question (7) + the name: the next token is the value */
        memcpy(ids, qs[i], sizeof qs[i]);
        ids[7] = as[i][0];
        kf_forward_args fa = {.ids = ids, .n_tokens = 8, .logit_rows = &row, .n_logit_rows = 1, .logits = logits};
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &a, &seq, &fa, &err), KF_OK);
        int arg = 0;
        for (int v = 1; v < V; v++)
            arg = logits[v] > logits[arg] ? v : arg;
        hits += arg == as[i][1];
        kf_seq_release(&a, &seq);
    }
    printf("\n    keep 0.25: fact_acc %.3f, direct %d/%d\n", qm.fact_acc, hits, nq);
    CU_ASSERT_DOUBLE_EQUAL(qm.fact_acc, (double)hits / nq, 1e-12);
    CU_ASSERT(hits < nq); /* a quarter of the keys loses facts: the check is not vacuous */
    kf_arena_free(&a);
    free(logits);
    kf_compacted_free(&c);
    kf_reference_free(ref);
}

static void test_fact_row(void) {
    const int32_t q[4] = {81, 58, 5, 63};
    const int32_t a1[3] = {5, 6, 10}, a2[3] = {7, 5, 6}, a3[2] = {7, 8}, a4[1] = {5};
    CU_ASSERT_EQUAL(kf_qa_fact_row(&(kf_qa){{q, 4}, {a1, 3}}), 1);
    CU_ASSERT_EQUAL(kf_qa_fact_row(&(kf_qa){{q, 4}, {a2, 3}}), 2);
    CU_ASSERT_EQUAL(kf_qa_fact_row(&(kf_qa){{q, 4}, {a3, 2}}), -1);
    CU_ASSERT_EQUAL(kf_qa_fact_row(&(kf_qa){{q, 4}, {a4, 1}}), -1); /* the name is the last token */
}

static void test_head_counts(void) {
    kf_compacted c = {.n_layers = 2, .kv_heads = 3, .method = KF_METHOD_FOLD};
    c.stats.fold_fallback_heads = 2;
    int n[4];
    kf_compacted_head_counts(&c, n); /* not filled: fold with two fallbacks to drop */
    CU_ASSERT(n[KF_METHOD_FOLD] == 4 && n[KF_METHOD_DROP] == 2 && n[KF_METHOD_KEEP] == 0 && n[KF_METHOD_AM] == 0);
    uint8_t hm[6] = {KF_METHOD_FOLD, KF_METHOD_KEEP, KF_METHOD_DROP, KF_METHOD_DROP, KF_METHOD_DROP, KF_METHOD_FOLD};
    c.head_method = hm;
    kf_compacted_head_counts(&c, n); /* per-head choice stored */
    CU_ASSERT(n[KF_METHOD_FOLD] == 2 && n[KF_METHOD_DROP] == 3 && n[KF_METHOD_KEEP] == 1);
    c.stats.heads_by_method[KF_METHOD_KEEP] = 6;
    kf_compacted_head_counts(&c, n); /* the compaction's own counts win when they cover every head */
    CU_ASSERT(n[KF_METHOD_KEEP] == 6 && n[KF_METHOD_FOLD] == 0);
}


/* Independent fp64 reference of one query's diagnostics: LSE of the block alone, and the
 * normalised softmax output over [block | first na appended keys]. */
static void naive_diag(const float *q, int d, double scale, const kf_kv_block *blk, const kf_kv_block *app, int na,
                       double *lse, double *o) {
    const int n = blk->n + na;
    double z[128], mx = -INFINITY, mb = -INFINITY, sb = 0, s = 0;
    for (int j = 0; j < n; j++) {
        const kf_kv_block *b = j < blk->n ? blk : app;
        const int t = j < blk->n ? j : j - blk->n;
        double dot = 0;
        for (int c = 0; c < d; c++)
            dot += (double)q[c] * b->k[(size_t)t * b->stride + c];
        z[j] = dot * scale + (b->beta ? b->beta[t] : 0.0);
        mx = fmax(mx, z[j]);
        mb = j < blk->n ? fmax(mb, z[j]) : mb;
    }
    for (int j = 0; j < blk->n; j++)
        sb += exp(z[j] - mb);
    *lse = mb + log(sb);
    for (int c = 0; c < d; c++)
        o[c] = 0;
    for (int j = 0; j < n; j++) {
        const kf_kv_block *b = j < blk->n ? blk : app;
        const int t = j < blk->n ? j : j - blk->n;
        const double w = exp(z[j] - mx);
        s += w;
        for (int c = 0; c < d; c++)
            o[c] += w * b->v[(size_t)t * b->stride + c];
    }
    for (int c = 0; c < d; c++)
        o[c] /= s;
}

/* The original block's side computed once (kf_diag_ref_init) and measured against two
 * compacted blocks in turn gives kf_diag_head's figures to the bit, and both match an
 * independent fp64 computation. */
static void test_diag_reference_reused(void) {
    enum { R = 6, D = 8, N = 40, C = 10, A = 5 };
    float q[R * D], k[N * D], v[N * D], ak[A * D], av[A * D], ck[2][C * D], cv[2][C * D], beta[C];
    kf_test_fill_uniform(q, R * D, 1, -1, 1);
    kf_test_fill_uniform(k, N * D, 2, -1, 1);
    kf_test_fill_uniform(v, N * D, 3, -1, 1);
    kf_test_fill_uniform(ak, A * D, 4, -1, 1);
    kf_test_fill_uniform(av, A * D, 5, -1, 1);
    kf_test_fill_uniform(beta, C, 6, -1, 1);
    for (int i = 0; i < C; i++) /* two compacted blocks: every 4th key, and keys 3..12 perturbed */
        for (int c = 0; c < D; c++) {
            ck[0][i * D + c] = k[(4 * i) * D + c], cv[0][i * D + c] = v[(4 * i) * D + c];
            ck[1][i * D + c] = 1.1f * k[(3 + i) * D + c], cv[1][i * D + c] = v[(3 + i) * D + c] - 0.1f;
        }
    const int vis[R] = {1, 2, 3, 5, 0, 4};
    const float scale = 0.7f;
    const kf_kv_block orig = {k, v, D, NULL, N}, app = {ak, av, D, NULL, A};
    const kf_kv_block comp[2] = {{ck[0], cv[0], D, beta, C}, {ck[1], cv[1], D, NULL, C}};
    kf_error err = {0};
    kf_diag_ref ref;
    CU_ASSERT_EQUAL_FATAL(kf_diag_ref_init(&ref, q, R, D, scale, &orig, &app, vis, &err), KF_OK);
    for (int b = 0; b < 2; b++) {
        kf_head_diag once, reused;
        CU_ASSERT_EQUAL(kf_diag_head(q, R, D, scale, &orig, &comp[b], &app, vis, &once, &err), KF_OK);
        CU_ASSERT_EQUAL(kf_diag_head_vs(&ref, q, scale, &comp[b], &app, vis, &reused, &err), KF_OK);
        CU_ASSERT(memcmp(&once, &reused, sizeof once) == 0);
        double lse_err = 0, out_err = 0;
        for (int i = 0; i < R; i++) {
            double lo, lc, oo[D], oc[D], num = 0, den = 0;
            naive_diag(q + i * D, D, scale, &orig, &app, vis[i], &lo, oo);
            naive_diag(q + i * D, D, scale, &comp[b], &app, vis[i], &lc, oc);
            for (int c = 0; c < D; c++)
                num += (oo[c] - oc[c]) * (oo[c] - oc[c]), den += oo[c] * oo[c];
            lse_err += fabs(lc - lo) / R;
            out_err += sqrt(num / den) / R;
        }
        CU_ASSERT(lse_err > 1e-3 && out_err > 1e-3); /* the blocks do differ */
        CU_ASSERT_DOUBLE_EQUAL(reused.lse_err, lse_err, 1e-12);
        CU_ASSERT_DOUBLE_EQUAL(reused.out_err, out_err, 1e-12);
    }
    kf_diag_ref_free(&ref);
}

static CU_TestInfo unit_tests[] = {
    {"fact row: the token after the name", test_fact_row},
    {"heads per method", test_head_counts},
    {"diagnostics: the original side once, against fp64", test_diag_reference_reused},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo model_tests[] = {
    {"20-token document, 100-token answer", test_long_answer_short_document},
    {"the full cache measures as exact", test_full_cache_is_exact},
    {"fact_acc == direct count", test_fact_acc_matches_direct_count},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"evaluate helpers", NULL, NULL, NULL, NULL, unit_tests},
    {"quality on records-llama3-induct", init_model, clean_model, NULL, NULL, model_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
