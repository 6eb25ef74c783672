/* records_fixture.h — the trained records model and one of its documents, shared by the suites
 * that compact it end to end (test_compact.c, test_head_solve.c): the model opened once per
 * suite, the compaction's parameters with the records' repeat instruction, and a question's
 * logits on top of a compacted cache. Include after test_util.h, in one .c file each. */
#ifndef KF_TESTS_RECORDS_FIXTURE_H
#define KF_TESTS_RECORDS_FIXTURE_H

#include "compactor/compact.h"
#include "test_util.h"

static kf_backend *g_b;
static kf_model *g_m;
static int32_t g_doc[4096];
static int g_doc_n;
static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10}; /* "Repeat the records above.\n" */

static inline int init_model(void) {
    if (kf_test_model_open("records-qwen3", &g_b, &g_m))
        return -1;
    g_doc_n = kf_test_records_ids(2, g_doc, 4096); /* doc1-1 */
    return g_doc_n > 100 ? 0 : -1;
}

static inline int clean_model(void) {
    return kf_test_model_close(g_b, g_m);
}

static inline kf_compact_params params(kf_method method, double budget) {
    kf_compact_params p = kf_compact_params_default();
    p.method = method;
    p.budget = budget;
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.solver.max_queries = 2000;
    return p;
}

/* Logits of a question run on top of a compacted cache. */
static inline void question_logits(kf_compacted *c, const int32_t *q, int nq, float *logits) {
    kf_arena a;
    kf_seq seq;
    kf_error err = {0};
    const float *bl[16];
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, c->C + nq, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compacted_attach(c, &a, &seq, &err), KF_OK);
    int32_t rows[16];
    for (int i = 0; i < nq; i++)
        rows[i] = i;
    kf_forward_args fa = {.ids = q, .n_tokens = nq, .pos_offset = kf_compacted_pos_offset(c), .logit_rows = rows,
                          .n_logit_rows = nq, .logits = logits, .key_bias = kf_compacted_bias(c, bl),
                          .key_bias_len = (int)c->C};
    CU_ASSERT_EQUAL(kf_model_forward(g_m, &a, &seq, &fa, &err), KF_OK);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
}

#endif
