/* kf_compact end to end on the trained records model (compactor/compact.c): the compacted frame
 * against AM's, keep at budget 1 against the full cache, determinism for a seed, bad parameters
 * refused, the methods' mass error in the expected order, and the parameters' defaults. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "compactor/evaluate.h"
#include "test_util.h"
#include "records_fixture.h"

static void test_compacted_frame_equals_am_frame(void) {
    kf_compacted c;
    kf_error err = {0};
    kf_prompt doc = {g_doc, g_doc_n};
    const int32_t q[7] = {81, 58, 1317, 63, 10, 65, 58};
    const int V = kf_model_config(g_m)->vocab_size;
    float *a = malloc(sizeof(float) * 7 * V), *b = malloc(sizeof(float) * 7 * V);
    for (int method = KF_METHOD_AM; method <= KF_METHOD_FOLD; method++) {
        kf_compact_params p = params((kf_method)method, 0.25);
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
        CU_ASSERT(c.rotated);
        CU_ASSERT_EQUAL(c.C, (int64_t)(0.25 * g_doc_n));
        question_logits(&c, q, 7, a); /* at C, C+1, ... */
        kf_compacted_set_frame(&c, g_m, 0);
        CU_ASSERT_EQUAL(kf_compacted_pos_offset(&c), c.D - c.C);
        question_logits(&c, q, 7, b); /* at D, D+1, ... */
        double diff = kf_max_abs_diff(a, b, (size_t)7 * V);
        printf("\n    %s: compacted vs AM frame max |dlogit| %.2e", kf_method_name((kf_method)method), diff);
        /* fp32 rounding of two RoPE frames: 3.7e-4 .. 5.8e-4 in the release build, fold 1.35e-3 in the
         * -O2 sanitizer build (its compaction rounds differently); a wrong rotation is off by O(1) */
        CU_ASSERT(diff < 2e-3);
        kf_compacted_free(&c);
    }
    printf("\n");
    free(a);
    free(b);
}

static void test_keep_everything_equals_full_cache(void) {
    kf_compacted c;
    kf_error err = {0};
    kf_prompt doc = {g_doc, g_doc_n};
    kf_compact_params p = params(KF_METHOD_KEEP, 1.0);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
    CU_ASSERT_EQUAL(c.C, g_doc_n);
    for (int j = 0; j < g_doc_n; j++)
        CU_ASSERT_EQUAL(c.positions[j], j);
    const int32_t q[7] = {81, 58, 1317, 63, 10, 65, 58};
    const int V = kf_model_config(g_m)->vocab_size;
    float *a = malloc(sizeof(float) * 7 * V), *full = malloc(sizeof(float) * 7 * V);
    question_logits(&c, q, 7, a);
    /* the same question on a plain prefill of the document */
    kf_arena ar;
    kf_seq seq;
    kf_seq_init(&seq);
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &ar, g_doc_n + 7, &err), KF_OK);
    kf_forward_args fd = {.ids = g_doc, .n_tokens = g_doc_n};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &ar, &seq, &fd, &err), KF_OK);
    int32_t rows[7] = {0, 1, 2, 3, 4, 5, 6};
    kf_forward_args fq = {.ids = q, .n_tokens = 7, .logit_rows = rows, .n_logit_rows = 7, .logits = full};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &ar, &seq, &fq, &err), KF_OK);
    CU_ASSERT(kf_max_abs_diff(a, full, (size_t)7 * V) < 1e-3);
    kf_seq_release(&ar, &seq);
    kf_arena_free(&ar);
    free(a);
    free(full);
    kf_compacted_free(&c);
}

static void test_deterministic_for_a_seed(void) {
    kf_compacted a, b;
    kf_error err = {0};
    kf_prompt doc = {g_doc, g_doc_n};
    kf_compact_params p = params(KF_METHOD_FOLD, 0.1);
    p.solver.max_queries = 300; /* forces the subsample */
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &b, &err), KF_OK);
    const size_t n = (size_t)a.n_layers * a.C * a.kv_heads * a.head_dim;
    CU_ASSERT_EQUAL(memcmp(a.keys, b.keys, n * sizeof(float)), 0);
    CU_ASSERT_EQUAL(memcmp(a.values, b.values, n * sizeof(float)), 0);
    CU_ASSERT_EQUAL(a.stats.n_queries, 2 * 150);
    kf_compacted_free(&b);
    p.solver.seed = 99;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &b, &err), KF_OK);
    CU_ASSERT_NOT_EQUAL(memcmp(a.values, b.values, n * sizeof(float)), 0);
    kf_compacted_free(&a);
    kf_compacted_free(&b);
}

static void test_bad_parameters(void) {
    kf_compacted c;
    kf_error err = {0};
    kf_prompt doc = {g_doc, g_doc_n}, empty = {g_doc, 0};
    kf_compact_params p = params(KF_METHOD_FOLD, 0.0);
    CU_ASSERT_EQUAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "budget"));
    p = params(KF_METHOD_FOLD, 0.1);
    CU_ASSERT_EQUAL(kf_compact(g_m, NULL, &empty, NULL, &p, &c, &err), KF_ERR_INVALID);
    p.repeat_instruction.n = 0;
    CU_ASSERT_EQUAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "reference queries"));
}

/* On a document of the trained model, the mass error orders am < fold < drop (keep loses the
 * mass as drop does). Probes: questions about records that are not evaluated. */
static void test_records_lse_ordering(void) {
    kf_prompt doc = {g_doc, g_doc_n};
    kf_prompt instr = {kInstr, 6};
    /* held-out questions about the first 4 records, probes about 12 others */
    static int32_t qs[4][7], as[4][3], probes[12][10];
    kf_qa qa[4];
    kf_prompt pr[12];
    int nq = 0, np = 0;
    for (int i = 0; i + 3 < g_doc_n && (nq < 4 || np < 12); i++) {
        if (!(g_doc[i] == 45 && g_doc[i + 3] == 10 && (i == 0 || g_doc[i - 1] == 10)))
            continue;
        const int32_t name = g_doc[i + 1], value = g_doc[i + 2];
        const int32_t q[7] = {81, 58, name, 63, 10, 65, 58};
        if (nq < 4) {
            memcpy(qs[nq], q, sizeof q);
            as[nq][0] = name, as[nq][1] = value, as[nq][2] = 10;
            qa[nq] = (kf_qa){{qs[nq], 7}, {as[nq], 3}};
            nq++;
        } else if (np < 12) {
            memcpy(probes[np], q, sizeof q);
            probes[np][7] = name, probes[np][8] = value, probes[np][9] = 10;
            pr[np] = (kf_prompt){probes[np], 10};
            np++;
        }
    }
    CU_ASSERT_EQUAL_FATAL(nq, 4);
    kf_reference *ref;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_reference_build(g_m, &doc, &instr, qa, nq, &ref, &err), KF_OK);
    double lse[4];
    for (int method = 0; method < 4; method++) {
        kf_compact_params p = params((kf_method)method, 0.25);
        p.probes = pr;
        p.n_probes = np;
        p.choice.head_choice = KF_CHOICE_OFF; /* the methods themselves (the choice may pick drop everywhere) */
        kf_compacted c;
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
        kf_quality qm;
        CU_ASSERT_EQUAL_FATAL(kf_quality_measure(g_m, ref, &c, &qm, NULL, NULL, &err), KF_OK);
        lse[method] = qm.lse_err;
        printf("\n    %-4s lse_err %.3f out_err %.3f kl_answer %.3f kl_repeat %.3f copy %.2f em %.2f",
               kf_method_name((kf_method)method), qm.lse_err, qm.out_err, qm.kl_answer, qm.kl_repeat, qm.copy_acc,
               qm.qa_em);
        CU_ASSERT(c.rotated); /* measuring restores the frame */
        kf_compacted_free(&c);
    }
    printf("\n");
    CU_ASSERT(lse[KF_METHOD_AM] < lse[KF_METHOD_FOLD]);
    CU_ASSERT(lse[KF_METHOD_FOLD] < lse[KF_METHOD_DROP]);
    kf_reference_free(ref);
}

/* The top level and each group hold the defaults compact.h documents beside the fields, and the
 * whole's groups are the groups' own defaults. */
static void test_param_defaults(void) {
    const kf_compact_params p = kf_compact_params_default();
    CU_ASSERT(p.method == KF_METHOD_FOLD && p.budget == 0.1 && !p.repeat_instruction.n && !p.probes &&
              !p.use_context_queries && !p.no_repeat && p.repeat_fraction == 0 && !p.repeat_spans &&
              !p.chat_template && !p.progress);
    const kf_solver_params s = kf_solver_params_default();
    CU_ASSERT(s.score == KF_SCORE_RMS && s.lambda_rel == 1e-2 && s.fold_queries == KF_FOLD_ON_ALL &&
              s.max_queries == 50000 && s.beta_fit == KF_BETA_AM && s.value_ridge == 0 &&
              s.ridge_to == KF_RIDGE_TO_ORIG && s.seed == 0 && !s.head_budgets && s.max_head_ratio == 0.75);
    const kf_choice_params c = kf_choice_params_default();
    CU_ASSERT(c.head_choice == KF_CHOICE_DEFAULT && c.val_frac == 0.2 && c.choice_margin == 0.5 &&
              c.refit_all == KF_REFIT_VALUES && c.choice_rows == 6);
    const kf_run_params r = kf_run_params_default();
    CU_ASSERT(r.chunk == 0 && !r.quoka && r.quoka_repeat == 0 && r.quoka_margin == 16 && r.refq_bf16 == 0 &&
              r.arena_dtype == KF_DTYPE_F32);
    CU_ASSERT(p.solver.lambda_rel == s.lambda_rel && p.solver.max_queries == s.max_queries &&
              p.solver.max_head_ratio == s.max_head_ratio && p.solver.ridge_to == s.ridge_to);
    CU_ASSERT(p.choice.head_choice == c.head_choice && p.choice.val_frac == c.val_frac &&
              p.choice.choice_margin == c.choice_margin && p.choice.refit_all == c.refit_all &&
              p.choice.choice_rows == c.choice_rows);
    CU_ASSERT(p.run.quoka_margin == r.quoka_margin && p.run.arena_dtype == r.arena_dtype);
}

static CU_TestInfo model_tests[] = {
    {"compacted frame at C == AM frame at D", test_compacted_frame_equals_am_frame},
    {"keep at budget 1 == the full cache", test_keep_everything_equals_full_cache},
    {"deterministic for a seed", test_deterministic_for_a_seed},
    {"bad parameters", test_bad_parameters},
    {"records model: lse_err am < fold < drop", test_records_lse_ordering},
    CU_TEST_INFO_NULL,
};

static CU_TestInfo param_tests[] = {
    {"defaults: the top level and each group's", test_param_defaults},
    CU_TEST_INFO_NULL,
};

static CU_SuiteInfo suites[] = {
    {"compaction parameters", NULL, NULL, NULL, NULL, param_tests},
    {"compaction on records-qwen3", init_model, clean_model, NULL, NULL, model_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
