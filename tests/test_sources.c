/* The reference queries' cheaper sources: a partial repeat (repeat_fraction, spans of
 * the document each run after the instruction at its whole-repeat positions) and the context's own
 * queries without a repeat (no_repeat): where the spans fall, which rows are pooled, the whole
 * fraction equal to the default bit for bit, the memory shape, bad values refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "compactor/model.h"
#include "test_util.h"

static kf_backend *g_b;
static kf_model *g_m;
static int32_t g_doc[4096]; /* doc1-1 of records-dev.jsonl */
static int g_doc_n;
static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10}; /* "Repeat the records above.\n" */
enum { N_DOC = 203, N_INSTR = 6 };

static int init_model(void) {
    if (kf_test_model_open("records-qwen3", &g_b, &g_m))
        return -1;
    g_doc_n = kf_test_records_ids(2, g_doc, 4096); /* doc1-1 */
    return g_doc_n > N_DOC ? 0 : -1;
}

static int clean_model(void) {
    return kf_test_model_close(g_b, g_m);
}

static kf_compact_params params(void) {
    kf_compact_params p = kf_compact_params_default();
    p.method = KF_METHOD_FOLD;
    p.budget = 0.25;
    p.repeat_instruction = (kf_prompt){kInstr, N_INSTR};
    p.solver.max_queries = 2000;
    return p;
}

/* The caches' keys, values, positions and pooled-query counts byte for byte (1: identical). */
static int same_cache(const kf_compacted *a, const kf_compacted *b) {
    if (a->C != b->C || a->t != b->t || a->stats.n_queries != b->stats.n_queries)
        return 0;
    const size_t hs = (size_t)a->n_layers * a->kv_heads, kv = hs * a->C * a->head_dim;
    return !memcmp(a->keys, b->keys, sizeof(float) * kv) && !memcmp(a->values, b->values, sizeof(float) * kv) &&
           !memcmp(a->positions, b->positions, sizeof(int32_t) * hs * a->C) &&
           !memcmp(a->u, b->u, sizeof(float) * hs * a->head_dim);
}

/* The spans by hand: the whole document by default and at F = 1; F = 0.25 over 203 tokens in 4
 * strata [0, 50) [50, 101) [101, 152) [152, 203): runs of 13 tokens (round(12.5), round(12.75))
 * inside each, placed by the seed; no instruction or no_repeat: none; more spans than tokens: one
 * token each. */
static void test_spans_by_hand(void) {
    kf_compact_params p = params();
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX], off1[KF_REPEAT_SPANS_MAX], len1[KF_REPEAT_SPANS_MAX];
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, N_DOC, off, len), 1);
    CU_ASSERT(off[0] == 0 && len[0] == N_DOC);
    p.repeat_fraction = 1;
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, N_DOC, off, len), 1);
    CU_ASSERT(off[0] == 0 && len[0] == N_DOC);
    p.repeat_fraction = 0.25;
    CU_ASSERT_EQUAL_FATAL(kf_repeat_spans(&p, N_DOC, off, len), 4);
    static const int b0[5] = {0, 50, 101, 152, 203};
    for (int k = 0; k < 4; k++) {
        CU_ASSERT_EQUAL(len[k], 13);
        CU_ASSERT(off[k] >= b0[k] && off[k] + len[k] <= b0[k + 1]);
    }
    p.solver.seed = 1; /* another seed moves at least one span, the same seed none */
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, N_DOC, off1, len1), 4);
    CU_ASSERT(memcmp(off, off1, sizeof(int) * 4) != 0);
    CU_ASSERT_EQUAL(memcmp(len, len1, sizeof(int) * 4), 0);
    p.solver.seed = 0;
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, N_DOC, off1, len1), 4);
    CU_ASSERT_EQUAL(memcmp(off, off1, sizeof(int) * 4), 0);
    p.repeat_spans = 10;
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, 3, off, len), 3);
    CU_ASSERT(off[0] == 0 && off[1] == 1 && off[2] == 2 && len[0] == 1 && len[1] == 1 && len[2] == 1);
    p.no_repeat = 1;
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, N_DOC, off, len), 0);
    p.no_repeat = 0;
    p.repeat_instruction.n = 0;
    CU_ASSERT_EQUAL(kf_repeat_spans(&p, N_DOC, off, len), 0);
}

/* F = 1 and any span count: the default's cache bit for bit. */
static void test_whole_fraction_is_default(void) {
    kf_error err = {0};
    const kf_prompt doc = {g_doc, N_DOC};
    kf_compact_params p = params(), q = params();
    q.repeat_fraction = 1;
    q.repeat_spans = 7;
    kf_compacted a, b;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &q, &b, &err), KF_OK);
    CU_ASSERT(same_cache(&a, &b));
    kf_compacted_free(&a), kf_compacted_free(&b);
}

/* The rows pooled are the spans': G (4 (6 + 13)) of them at F = 0.25 (the memory shape's R, S and
 * P agree), G 203 with the context's own queries and no repeat. And a one-span repeat whose seed
 * puts it at offset 0 is exactly that span run as a probe (instruction + span, same positions) with
 * no repeat (the per-head choice off, which alone weighs the kinds apart): its rows are the span's. */
static void test_rows_from_the_spans(void) {
    kf_error err = {0};
    const kf_hfconfig *c = kf_model_config(g_m);
    const int G = c->n_heads / c->n_kv_heads;
    const kf_prompt doc = {g_doc, N_DOC};
    kf_compact_params p = params();
    p.repeat_fraction = 0.25;
    kf_compacted a, b;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_OK);
    CU_ASSERT_EQUAL(a.stats.n_queries, (int64_t)G * 4 * (N_INSTR + 13));
    kf_mem_shape sh;
    kf_compact_mem_shape(c, &p, 0, N_DOC, 0, 2, &sh);
    CU_ASSERT_EQUAL(sh.R, a.stats.n_queries);
    CU_ASSERT(sh.S == N_INSTR + 13 && sh.P == 3 * (N_INSTR + 13) && sh.n_p == 3);
    kf_compacted_free(&a);

    kf_compact_params ctx = params();
    ctx.no_repeat = 1, ctx.use_context_queries = 1;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &ctx, &a, &err), KF_OK);
    CU_ASSERT_EQUAL(a.stats.n_queries, (int64_t)G * N_DOC);
    kf_compact_mem_shape(c, &ctx, 0, N_DOC, 0, 2, &sh);
    CU_ASSERT(sh.R == a.stats.n_queries && sh.Rc == sh.R && sh.S == 0 && sh.P == 0);
    kf_compacted_free(&a);

    kf_compact_params one = params();
    one.repeat_fraction = 0.5, one.repeat_spans = 1, one.choice.head_choice = KF_CHOICE_OFF;
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX];
    for (one.solver.seed = 0; one.solver.seed < 5000; one.solver.seed++)
        if (kf_repeat_spans(&one, N_DOC, off, len) == 1 && off[0] == 0)
            break;
    CU_ASSERT_FATAL(off[0] == 0 && len[0] == 102);
    int32_t span[N_INSTR + 102];
    memcpy(span, kInstr, sizeof kInstr);
    memcpy(span + N_INSTR, g_doc, sizeof(int32_t) * 102);
    const kf_prompt probe = {span, N_INSTR + 102};
    kf_compact_params as_probe = one;
    as_probe.no_repeat = 1, as_probe.probes = &probe, as_probe.n_probes = 1;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &one, &a, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &as_probe, &b, &err), KF_OK);
    CU_ASSERT_EQUAL(a.stats.n_queries, (int64_t)G * (N_INSTR + 102));
    CU_ASSERT(same_cache(&a, &b));
    kf_compacted_free(&a), kf_compacted_free(&b);

    /* a span at offset o > 0 sits o positions later than that probe would: the same rows counted,
     * another cache (the same one would mean the span was not placed at its whole-repeat positions) */
    for (one.solver.seed = 0; one.solver.seed < 5000; one.solver.seed++)
        if (kf_repeat_spans(&one, N_DOC, off, len) == 1 && off[0] > 0)
            break;
    CU_ASSERT_FATAL(off[0] > 0 && len[0] == 102);
    memcpy(span + N_INSTR, g_doc + off[0], sizeof(int32_t) * 102);
    as_probe.solver.seed = one.solver.seed;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &one, &a, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &as_probe, &b, &err), KF_OK);
    CU_ASSERT_EQUAL(a.stats.n_queries, b.stats.n_queries);
    CU_ASSERT(!same_cache(&a, &b));
    kf_compacted_free(&a), kf_compacted_free(&b);
}

/* A fraction outside [0, 1] (or NaN) or a span count outside [0, 64]: refused, the field named. */
static void test_bad_values_refused(void) {
    kf_error err = {0};
    const kf_prompt doc = {g_doc, N_DOC};
    const double bad_f[3] = {1.5, -0.25, NAN};
    kf_compacted a;
    for (int i = 0; i < 3; i++) {
        kf_compact_params p = params();
        p.repeat_fraction = bad_f[i];
        CU_ASSERT_EQUAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_ERR_INVALID);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "repeat_fraction"));
    }
    kf_compact_params p = params();
    p.repeat_fraction = 0.5, p.repeat_spans = KF_REPEAT_SPANS_MAX + 1;
    CU_ASSERT_EQUAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "repeat_spans"));
    p = params(); /* nothing left to pool */
    p.no_repeat = 1;
    CU_ASSERT_EQUAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "no reference queries"));
}

static CU_TestInfo tests[] = {
    {"the spans by hand", test_spans_by_hand},
    {"repeat fraction 1 == the default, bit for bit", test_whole_fraction_is_default},
    {"the rows pooled come from the spans (and the context's rows without a repeat)", test_rows_from_the_spans},
    {"bad fractions and span counts refused, the field named", test_bad_values_refused},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"reference-query sources on records-qwen3", init_model, clean_model, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
