/* The batch job's library pieces: the prefix-sharing plan (Quail's example), prefix sharing
 * through the arena (same logits, same compacted cache), and the round trip of a compacted cache
 * through a kvf file into the paged engine. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/cache_io.h"
#include "compactor/compact.h"
#include "compactor/engine.h"
#include "compactor/prefix_plan.h"
#include "kernels/base/convert.h"
#include "test_util.h"

/* ---- the plan ---- */

static int32_t g_trace[1900]; /* one agent trace; rows hold its first 1,000, 1,400 and 1,900 tokens */

static void make_trace(void) {
    uint64_t s = 12345;
    for (int i = 0; i < 1900; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        g_trace[i] = (int32_t)((s >> 33) % 3000) + 100;
    }
}

static void test_plan_quail_example(void) {
    make_trace();
    const int32_t *docs[3] = {g_trace, g_trace, g_trace};
    const int64_t lens[3] = {1000, 1400, 1900};
    kf_prefix_plan p;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens, 3, 16, NULL, &p, &err), KF_OK);
    CU_ASSERT(p.enabled);
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(p.order[i], i);
    CU_ASSERT_EQUAL(p.parent[0], -1);
    CU_ASSERT_EQUAL(p.parent[1], 0);
    CU_ASSERT_EQUAL(p.parent[2], 1);
    CU_ASSERT_EQUAL(p.shared[0], 0);
    CU_ASSERT_EQUAL(p.shared[1], 992);
    CU_ASSERT_EQUAL(p.shared[2], 1392);
    CU_ASSERT_EQUAL(p.tokens_computed, 1916);
    CU_ASSERT_EQUAL(p.tokens_total, 4300);
    kf_prefix_plan_free(&p);

    /* given in another order, the same plan up to the indices */
    const int64_t lens2[3] = {1900, 1000, 1400};
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens2, 3, 16, NULL, &p, &err), KF_OK);
    CU_ASSERT(p.order[0] == 1 && p.order[1] == 2 && p.order[2] == 0);
    CU_ASSERT(p.parent[1] == -1 && p.parent[2] == 1 && p.parent[0] == 2);
    CU_ASSERT(p.shared[1] == 0 && p.shared[2] == 992 && p.shared[0] == 1392);
    CU_ASSERT(p.pred[0] == 2 && p.pred[2] == 1 && p.pred[1] == -1);
    kf_prefix_plan_free(&p);
}

static void test_plan_siblings_cap_and_cost(void) {
    make_trace();
    int32_t other[40], sib[600];
    memcpy(other, g_trace, sizeof other);
    other[20] = 1; /* sorts before the trace; shares one 16-token page */
    memcpy(sib, g_trace, sizeof sib);
    sib[550] = 4000; /* shares 544 tokens with the 1,000-token row, then sorts after it */
    const int32_t *docs[5] = {g_trace, other, sib, g_trace, g_trace};
    const int64_t lens[5] = {1000, 40, 600, 1000, 32};
    kf_prefix_plan p;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens, 5, 16, NULL, &p, &err), KF_OK);
    /* sorted: other(1), trace[:32](4), trace[:1000](0), trace[:1000](3), sib(2) */
    CU_ASSERT(p.order[0] == 1 && p.order[1] == 4 && p.order[2] == 0 && p.order[3] == 3 && p.order[4] == 2);
    CU_ASSERT_EQUAL(p.shared[4], 16);  /* lcp 20 with other, rounded down */
    CU_ASSERT_EQUAL(p.parent[4], 1);
    CU_ASSERT_EQUAL(p.shared[0], 32);  /* all of the 32-token row */
    CU_ASSERT_EQUAL(p.parent[0], 4);
    CU_ASSERT_EQUAL(p.shared[3], 992); /* an exact duplicate still computes its last token */
    CU_ASSERT_EQUAL(p.parent[3], 0);
    CU_ASSERT_EQUAL(p.shared[2], 544);
    CU_ASSERT_EQUAL(p.parent[2], 0);   /* siblings name the document that computed the pages */
    CU_ASSERT_EQUAL(p.pred[2], 3);
    kf_prefix_plan_free(&p);

    /* granule 512 (QUOKA chunks): only whole chunks */
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens, 5, 512, NULL, &p, &err), KF_OK);
    CU_ASSERT(p.shared[0] == 0 && p.shared[3] == 512 && p.shared[2] == 512 && p.shared[4] == 0);
    kf_prefix_plan_free(&p);

    /* a cost model where keeping KV costs more than the compute it saves: no sharing */
    kf_prefix_cost dear = {.flops_per_token = 1e6, .flops_per_s = 1e12, .kv_bytes_per_token = 1e6, .bytes_per_s = 1e9,
                           .writes_kv = 1};
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens, 5, 16, &dear, &p, &err), KF_OK);
    CU_ASSERT(!p.enabled);
    CU_ASSERT(p.added_s > p.saved_s);
    CU_ASSERT_EQUAL(p.tokens_computed, p.tokens_total);
    for (int i = 0; i < 5; i++)
        CU_ASSERT(p.shared[i] == 0 && p.parent[i] == -1);
    kf_prefix_plan_free(&p);
    kf_prefix_cost cheap = {.flops_per_token = 1e9, .flops_per_s = 1e12, .kv_bytes_per_token = 1e5, .bytes_per_s = 1e11,
                            .writes_kv = 1};
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens, 5, 16, &cheap, &p, &err), KF_OK);
    CU_ASSERT(p.enabled && p.saved_s > p.added_s && p.tokens_computed < p.tokens_total);
    kf_prefix_plan_free(&p);
    CU_ASSERT_NOT_EQUAL(kf_prefix_plan_build(docs, lens, 5, 24, NULL, &p, &err), KF_OK);
}

/* ---- with a model ---- */

static kf_backend *g_b;
static kf_model *g_m;
static int32_t g_doc[4096]; /* doc1-1 of records-dev.jsonl */
static int g_doc_n;
static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10}; /* "Repeat the records above.\n" */
static const int32_t kQuestion[] = {81, 58, 1541, 63, 10, 65, 58}; /* "Q: rake?\nA:" */

static int init_model(void) {
    if (kf_test_model_open("records-qwen3", &g_b, &g_m))
        return -1;
    g_doc_n = kf_test_records_ids(2, g_doc, 4096); /* doc1-1 */
    make_trace();
    return g_doc_n > 300 ? 0 : -1;
}

static int clean_model(void) {
    return kf_test_model_close(g_b, g_m);
}

/* Quail's three rows prefilled with sharing (fork from the predecessor, prefill the rest) give the
 * same last-token logits as each row prefilled whole. */
static void test_sharing_logits_equal(void) {
    const int64_t lens[3] = {1000, 1400, 1900};
    const int32_t *docs[3] = {g_trace, g_trace, g_trace};
    kf_prefix_plan plan;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_prefix_plan_build(docs, lens, 3, 16, NULL, &plan, &err), KF_OK);
    const int V = kf_model_config(g_m)->vocab_size;
    float *shared_logits = malloc(sizeof(float) * V), *whole_logits = malloc(sizeof(float) * V);
    kf_arena a;
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, 1900 + 1400 + 32, &err), KF_OK);
    kf_seq prev, cur;
    kf_seq_init(&prev);
    int64_t computed = 0;
    double worst = 0;
    for (int k = 0; k < 3; k++) {
        const int i = plan.order[k];
        const int64_t s = plan.shared[i];
        kf_seq_init(&cur);
        if (s > 0)
            CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &prev, s, &cur, &err), KF_OK);
        int32_t row = (int32_t)(lens[i] - s - 1);
        kf_forward_args fa = {.ids = g_trace + s, .n_tokens = (int)(lens[i] - s), .logit_rows = &row, .n_logit_rows = 1,
                              .logits = shared_logits};
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &a, &cur, &fa, &err), KF_OK);
        computed += lens[i] - s;
        kf_seq_release(&a, &prev);
        prev = cur;
        /* the same row, whole, in a separate arena */
        kf_arena b;
        kf_seq w;
        kf_seq_init(&w);
        CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &b, lens[i] + 16, &err), KF_OK);
        row = (int32_t)(lens[i] - 1);
        kf_forward_args fw = {.ids = g_trace, .n_tokens = (int)lens[i], .logit_rows = &row, .n_logit_rows = 1,
                              .logits = whole_logits};
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &b, &w, &fw, &err), KF_OK);
        const double diff = kf_max_abs_diff(shared_logits, whole_logits, (size_t)V) / fmax(1, kf_max_abs(whole_logits, V));
        worst = fmax(worst, diff);
        kf_seq_release(&b, &w);
        kf_arena_free(&b);
    }
    CU_ASSERT_EQUAL(computed, 1916);
    /* equal up to fp32 summation order (the chunks start at different tokens) */
    CU_ASSERT(worst < 1e-5);
    if (worst >= 1e-5)
        fprintf(stderr, "sharing changed the logits by %g (relative)\n", worst);
    kf_seq_release(&a, &prev);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
    kf_prefix_plan_free(&plan);
    free(shared_logits);
    free(whole_logits);
}

static kf_compact_params params(kf_method method, double budget) {
    kf_compact_params p = kf_compact_params_default();
    p.method = method;
    p.budget = budget;
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.solver.max_queries = 2000;
    return p;
}

/* kf_compact_ex on a document whose first 288 tokens come from a parent gives the cache
 * kf_compact computes from scratch. */
static void test_compact_ex_shared_equals_whole(void) {
    kf_error err = {0};
    kf_arena a;
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, 4 * 400, &err), KF_OK);
    kf_compact_params p = params(KF_METHOD_FOLD, 0.25);
    kf_prompt parent_doc = {g_doc, 300}, doc = {g_doc, 400};
    kf_compacted pc, shared, whole;
    kf_seq parent;
    kf_compact_reuse r0 = {.arena = &a, .keep = &parent};
    CU_ASSERT_EQUAL_FATAL(kf_compact_ex(g_m, &r0, NULL, &parent_doc, NULL, &p, &pc, &err), KF_OK);
    CU_ASSERT_EQUAL(parent.len, 300);
    kf_compact_reuse r1 = {.arena = &a, .parent = &parent, .shared = 288};
    CU_ASSERT_EQUAL_FATAL(kf_compact_ex(g_m, &r1, NULL, &doc, NULL, &p, &shared, &err), KF_OK);
    kf_seq_release(&a, &parent);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages); /* nothing left behind in the caller's arena */
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &whole, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(shared.C, whole.C);
    const size_t n = (size_t)whole.n_layers * whole.C * whole.kv_heads * whole.head_dim;
    const double dk = kf_max_abs_diff(shared.keys, whole.keys, n) / kf_max_abs(whole.keys, n);
    const double dv = kf_max_abs_diff(shared.values, whole.values, n) / kf_max_abs(whole.values, n);
    CU_ASSERT(dk < 1e-3 && dv < 1e-3);
    if (!(dk < 1e-3 && dv < 1e-3))
        fprintf(stderr, "shared vs whole: keys %g values %g (relative)\n", dk, dv);
    CU_ASSERT_EQUAL(memcmp(shared.positions, whole.positions, sizeof(int32_t) * whole.n_layers * whole.kv_heads * whole.C),
                    0);
    /* refusals: more shared than the parent holds, context queries with sharing */
    kf_compacted_free(&pc);
    kf_seq_init(&parent);
    kf_compact_reuse bad = {.arena = &a, .parent = &parent, .shared = 16};
    CU_ASSERT_EQUAL(kf_compact_ex(g_m, &bad, NULL, &doc, NULL, &p, &pc, &err), KF_ERR_INVALID);
    kf_compact_reuse keep_no_arena = {.keep = &parent};
    CU_ASSERT_EQUAL(kf_compact_ex(g_m, &keep_no_arena, NULL, &doc, NULL, &p, &pc, &err), KF_ERR_INVALID);
    kf_compacted_free(&shared);
    kf_compacted_free(&whole);
    kf_arena_free(&a);
}

/* Every array of two compacted caches byte for byte (1: identical). */
static int compacted_identical(const kf_compacted *a, const kf_compacted *b) {
    if (a->C != b->C || a->t != b->t || a->D != b->D || a->method != b->method || a->budget != b->budget ||
        a->rotated != b->rotated)
        return 0;
    const size_t hs = (size_t)a->n_layers * a->kv_heads, kv = (size_t)a->n_layers * a->C * a->kv_heads * a->head_dim;
    return !memcmp(a->keys, b->keys, sizeof(float) * kv) && !memcmp(a->values, b->values, sizeof(float) * kv) &&
           !memcmp(a->beta, b->beta, sizeof(float) * hs * a->C) && !memcmp(a->u, b->u, sizeof(float) * hs * a->head_dim) &&
           !memcmp(a->positions, b->positions, sizeof(int32_t) * hs * a->C) &&
           !memcmp(a->var_gain, b->var_gain, sizeof(float) * hs) && !memcmp(a->head_alpha, b->head_alpha, sizeof(float) * hs) &&
           !memcmp(a->head_method, b->head_method, hs) &&
           !memcmp(a->stats.heads_by_method, b->stats.heads_by_method, sizeof a->stats.heads_by_method) &&
           a->stats.n_queries == b->stats.n_queries && a->stats.n_val_queries == b->stats.n_val_queries &&
           a->stats.fold_fallback_heads == b->stats.fold_fallback_heads && a->stats.mean_var_gain == b->stats.mean_var_gain;
}

/* One prepare and one solve for several (method, budget) variants (a prefix and a probe included)
 * give, for each, exactly the cache kf_compact computes for it alone; a prepare that planned no
 * variant with the per-head choice refuses to solve one. */
static void test_shared_stages_equal_separate(void) {
    kf_error err = {0};
    const kf_compact_variant v[] = {{KF_METHOD_KEEP, 0.25}, {KF_METHOD_DROP, 0.25}, {KF_METHOD_AM, 0.25},
                                    {KF_METHOD_FOLD, 0.25}, {KF_METHOD_FOLD, 0.1},  {KF_METHOD_AM, 0.1}};
    const int n = (int)(sizeof v / sizeof *v);
    kf_compact_params p = params(KF_METHOD_FOLD, 0.25);
    const kf_prompt probe = {kQuestion, 7}, pre = {g_doc + 300, 5}, doc = {g_doc, 200};
    p.probes = &probe;
    p.n_probes = 1;
    kf_compacted shared[6], alone;
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(g_m, NULL, &pre, &doc, NULL, &p, v, n, &prep, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compact_solve(prep, v, n, shared, &err), KF_OK);
    kf_compact_prep_free(prep, NULL);
    for (int i = 0; i < n; i++) {
        kf_compact_params q = p;
        q.method = v[i].method, q.budget = v[i].budget;
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, &pre, &doc, NULL, &q, &alone, &err), KF_OK);
        CU_ASSERT(compacted_identical(&shared[i], &alone));
        if (!compacted_identical(&shared[i], &alone))
            fprintf(stderr, "shared vs alone differ for %s %g\n", kf_method_name(v[i].method), v[i].budget);
        kf_compacted_free(&alone);
        kf_compacted_free(&shared[i]);
    }
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(g_m, NULL, NULL, &doc, NULL, &p, v, 2, &prep, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_compact_solve(prep, v + 2, 1, shared, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NULL(shared[0].keys);
    kf_compact_prep_free(prep, NULL);
    const kf_compact_variant bad = {KF_METHOD_FOLD, 1.5};
    CU_ASSERT_EQUAL(kf_compact_prepare(g_m, NULL, NULL, &doc, NULL, &p, &bad, 1, &prep, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NULL(prep);
}

/* The same where the choice scores a subsample of the held-out rows (1,100 tokens of records-dev's
 * longest document, half the positions held out and 0.5 scored per token: more held-out rows than
 * kf_val_score_rows takes, and more scored rows than its floor): the scored rows are the document's,
 * not the budget's, so fold at 0.1 solved beside fold at 0.25 is fold at 0.1 alone. */
static void test_shared_variants_scored_subsample(void) {
    kf_error err = {0};
    const kf_compact_variant v[] = {{KF_METHOD_FOLD, 0.1}, {KF_METHOD_FOLD, 0.25}};
    kf_compact_params p = params(KF_METHOD_FOLD, 0.1);
    p.choice.val_frac = 0.5, p.choice.val_rows = 0.5;
    static int32_t ids[4096];
    const int n_all = kf_test_records_ids(25, ids, 4096), n_doc = n_all < 1100 ? n_all : 1100;
    const kf_prompt doc = {ids, n_doc};
    kf_compacted shared[2], alone;
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(g_m, NULL, NULL, &doc, NULL, &p, v, 2, &prep, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_compact_solve(prep, v, 2, shared, &err), KF_OK);
    kf_compact_prep_free(prep, NULL);
    const int64_t n_val = shared[0].stats.n_val_queries;
    printf("\n    %d tokens: %lld held-out rows, %lld scored\n", n_doc, (long long)n_val,
           (long long)kf_val_score_rows(&p, n_val, n_doc));
    CU_ASSERT(kf_val_score_rows(&p, n_val, n_doc) < n_val && kf_val_score_rows(&p, n_val, n_doc) > KF_VAL_MIN_ROWS);
    for (int i = 0; i < 2; i++) {
        kf_compact_params q = p;
        q.budget = v[i].budget;
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &q, &alone, &err), KF_OK);
        CU_ASSERT(compacted_identical(&shared[i], &alone));
        kf_compacted_free(&alone);
        kf_compacted_free(&shared[i]);
    }
}

/* A caller's arena of exactly kf_compact_arena_pages pages (a 203-token context: 13 pages) is
 * enough and one page less is not: the reference sources (a 209-token repeat prompt, a 7-token
 * probe) run layer by layer in an arena of their own inside kf_compact_solve (with or without the
 * per-head choice), so the caller's holds the context alone, from kf_compact_prepare to
 * kf_compact_prep_free, and nothing after. */
static void test_prep_arena_pages(void) {
    kf_error err = {0};
    kf_compact_params p = params(KF_METHOD_FOLD, 0.25);
    const kf_prompt probe = {kQuestion, 7}, doc = {g_doc, 203};
    p.probes = &probe;
    p.n_probes = 1;
    const int64_t pages = kf_compact_arena_pages(&p, 203, 203);
    CU_ASSERT_EQUAL_FATAL(pages, 13);
    const kf_compact_variant fold = {KF_METHOD_FOLD, 0.25}, keep = {KF_METHOD_KEEP, 0.25};
    for (int run = 0; run < 3; run++) {
        const int choice = run != 1, short_by_one = run == 2;
        kf_arena a;
        const kf_hfconfig *mc = kf_model_config(g_m);
        CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, kf_model_backend(g_m), mc->n_layers, mc->n_kv_heads, mc->head_dim,
                                            (int)pages - short_by_one, KF_DTYPE_F32, &err), KF_OK);
        const kf_compact_reuse r = {.arena = &a};
        const kf_compact_variant *v = choice ? &fold : &keep;
        kf_compact_prep *prep = NULL;
        kf_compacted c;
        kf_status st = kf_compact_prepare(g_m, &r, NULL, &doc, NULL, &p, v, 1, &prep, &err);
        CU_ASSERT_EQUAL(st, short_by_one ? KF_ERR_NOSPACE : KF_OK);
        if (st == KF_OK) {
            CU_ASSERT_EQUAL(a.n_pages - a.n_free, 13);
            CU_ASSERT_EQUAL_FATAL(kf_compact_solve(prep, v, 1, &c, &err), KF_OK);
            CU_ASSERT_EQUAL(a.n_pages - a.n_free, 13);
            CU_ASSERT_EQUAL(c.stats.n_val_queries > 0, choice);
            kf_compacted_free(&c);
        }
        kf_compact_prep_free(prep, NULL);
        CU_ASSERT_EQUAL(a.n_free, a.n_pages);
        kf_arena_free(&a);
    }
}

/* The memory formula (compact.h) on a hand-computed case: L 2, H 64, I 128, V 100 (tied), 4 heads
 * over 2 KV heads of d 16 with q/k norms; D 40 (T 32), S 38, one 7-token probe (no fused targets: the
 * solve keeps all 45 validation prompt tokens, Sv), R 100, Rv 20, Rc 20,
 * t 8, chunk 16, 2 attention threads, the solve on 2 threads (2 heads at once), ws 50,000 bytes.
 * Every term by hand:
 *   weights 4 (6,400 + 64 + 2 (8,192 + 4,096 + 24,576 + 128 + 32))             = 322,048
 *   arena   128 * 2 * 32 * pg 40 = 3 + 128 * 32 * (3 + pg 78 = 5 - 2 + pg 7 = 1 + 2) = 61,440
 *   queries 4 * 2 * 100 * 16 (one layer) + 4 * 2 * 2 * 20 * 16 (context rows)   = 17,920
 *   forward 4 * 16 * 576 + 8 * 16 + 4 * 2 * 19,808 + 4 * 64 * 45               = 206,976
 *           (the attention's tile per thread: q' = 16 queries, 32 rows (40 with padding): 64 + 2 * 640
 *           + 40 * 256 + 2 * 256 * 16 + 32 floats)
 *   solve   8 * 40 * 32 + 8 * 45 * 32 + 8 * 100                             the training rows' order: 8 R
 *           + 2 (8 * 8 + 16 * 8 * 16 + 8 * 100 * 17 + 20 * 92) + 2 * 50,000      per thread, per head
 *           = 10,240 + 11,520 + 800 + 2 * 67,552                               = 157,664
 *   output  2 * 16 * (256 + 16) + 2 * 2 * 73                                   = 8,996
 *   targets 0 (sh: no fused targets; the fused case below)
 *   base    144 MiB                                                            = 150,994,944
 * and the weights term against the parameters records-qwen3 really loads. */
static void test_memory_formula(void) {
    kf_hfconfig c = {0};
    c.n_layers = 2, c.hidden_size = 64, c.intermediate_size = 128, c.vocab_size = 100, c.n_heads = 4;
    c.n_kv_heads = 2, c.head_dim = 16, c.tie_word_embeddings = 1, c.has_qk_norm = 1;
    const kf_mem_shape sh = {.D = 40, .T = 32, .S = 38, .P = 7, .Sv = 45, .n_p = 1, .R = 100, .Rv = 20, .Rc = 20, .t = 8,
                             .choice = 1, .chunk = 16, .attn_threads = 2, .solve_threads = 2, .solve_heads = 2,
                             .head_ws = 50000};
    kf_mem_peak m;
    const int64_t total = kf_compact_peak_bytes(&c, &sh, &m);
    CU_ASSERT_EQUAL(m.weights, 322048);
    CU_ASSERT_EQUAL(m.arena, 61440);
    CU_ASSERT_EQUAL(m.queries, 17920);
    CU_ASSERT_EQUAL(m.forward, 206976);
    CU_ASSERT_EQUAL(m.solve, 157664);
    CU_ASSERT_EQUAL(m.output, 8996);
    CU_ASSERT_EQUAL(m.base, 150994944);
    CU_ASSERT_EQUAL(total, 151769988);
    CU_ASSERT_EQUAL(m.total, total);
    /* ws, every buffer 64-byte aligned (kf_ws_bytes), T 32, R 100, t 8, d 16, fused, no choice: the
     * head's scores 4 * 32 -> 128, then the largest of the score sums (8 * 32 -> 256) and a variant:
     * the selection (2 * 8 * 32 = 512) or its largest fit step, the fold direction's covariance
     * (mu 128, Sigma 8 * 256 = 2,048) and its 1,024-row tile 8 * 1,024 * 16 = 131,072 */
    kf_mem_shape ws = {.T = 32, .R = 100, .t = 8, .fused = 1, .S = 38};
    CU_ASSERT_EQUAL(kf_compact_head_ws_bytes(&ws, 16), 128 + 2176 + 131072);
    /* with the choice (Rv 20, all of them scored: Rs 20): the validation head, 5 [20] fp64 (192 each) + 3 [20, 16] fp32 (1,280
     * each) + [16] fp64 128 + the candidates' weights 4 * max(20 * 8, 64 * 38) = 9,728 + the appended
     * rows' scratch 2 * 20 * 16 (320) + 2 * 4 * 64 * 16 (4,096 each) = 23,488; the normal equations
     * the choice keeps for the refit (beta's 512 + 64, drop's 2 * 512 + 2 * 1,024) = 3,648, beside
     * its own buffers (beta 64, u 64, keys and values 2 * 512, the row tiles of 512 rows: logits
     * 16,384, weights 16,384, a tile's products' scratch, the larger of the portable path's
     * (8 * 16 + 512 * 16) * 4 = 33,280 and the bf16 pairs of its rows, X's by strips of 32 and
     * groups of 12 columns and Y's by strips, and a pair row: (256 * (32 + 12 + 32) + 32) * 4 =
     * 77,952; the candidates' value normal equations 3,072; the covariance 2,176) = 117,120 and the
     * covariance's row tile 131,072 */
    ws.choice = 1, ws.Rv = 20, ws.Rs = 20;
    CU_ASSERT_EQUAL(kf_compact_head_ws_bytes(&ws, 16), 128 + 23488 + 3648 + 117120 + 131072);
    /* the fold candidate's kept logits among the choice's own buffers: Rk 80 rows of t 8, 2,560 */
    ws.Rk = 80;
    CU_ASSERT_EQUAL(kf_compact_head_ws_bytes(&ws, 16), 128 + 23488 + 3648 + 117120 + 2560 + 131072);
    ws.Rk = 0;
    /* unfused targets: all R rows' m, y, Y and scores (2 * 448 + 6,400 + 128) held, their scratch
     * (score sums 256, a tile's logits 4 * 256 * 32 = 32,768) below the variant's */
    ws.fused = 0;
    CU_ASSERT_EQUAL(kf_compact_head_ws_bytes(&ws, 16), 896 + 6400 + 128 + 23488 + 3648 + 117120 + 131072);
    /* bf16 reference queries: half the pool, and each head in flight's rows widened (2 * 4 * 100 * 16) */
    kf_mem_shape sh16 = sh;
    sh16.refq_bf16 = 1;
    kf_mem_peak m16;
    kf_compact_peak_bytes(&c, &sh16, &m16);
    CU_ASSERT(m16.queries == 8960 && m16.solve == 157664 && m16.total == total - 17920 + 8960);
    ws.refq_bf16 = 1; /* the head's rows widened to fp32 in the workspace: 4 * 100 * 16 */
    CU_ASSERT_EQUAL(kf_compact_head_ws_bytes(&ws, 16), 6400 + 896 + 6400 + 128 + 23488 + 3648 + 117120 + 131072);
    /* one thread: one thread's buffers and one head in flight */
    kf_mem_shape sh1 = sh;
    sh1.solve_threads = 1, sh1.solve_heads = 1;
    kf_compact_peak_bytes(&c, &sh1, &m16);
    CU_ASSERT_EQUAL(m16.solve, 157664 - 67552);
    /* fused targets (0 above: sh is not fused), one layer held: 2 * (4 * 100 * 18 + 8 * 32) = 14,912
     * in the pool; the attention's logits of r = 2 min(floor(512 / 2), 16) = 32 rows and 8 padding
     * rows per thread, 4 * 2 * 40 * 32 = 10,240; parts of ceil(16 / 16) + ceil(16 / 256) = 2 tiles
     * per KV head, 8 * 2 * 32 * 2 = 1,024; the own keys' state of those 32 rows per thread, 4 * 2 *
     * (32 * 16 + 3 * 32) = 4,864; the held-out rows' own prompts (Rv 20 of R / G = 50 positions),
     * 2 * 4 * 20 * 18 + 5 * 50 = 3,130; and the solve keeps no validation prompt (Sv 0: the sources
     * give those rows' attention), 8 * 45 * 32 = 11,520 less */
    kf_mem_shape shf = sh;
    shf.fused = 1, shf.Sv = 0;
    kf_mem_peak mf;
    CU_ASSERT_EQUAL(m.targets, 0);
    /* (what a head holds of them is in ws) */
    CU_ASSERT_EQUAL(kf_compact_peak_bytes(&c, &shf, &mf), total + 14912 + 10240 + 1024 + 4864 + 3130 - 11520);
    CU_ASSERT_EQUAL(mf.targets, 14912 + 10240 + 1024 + 4864 + 3130);
    CU_ASSERT_EQUAL(mf.solve, 157664 - 11520);
    /* chunk 64, so c' = min(64, max(40, 38)) = 40: the target tiles have q = min(256, 40) = 40 queries,
     * those without targets q' = 40 halved once to 20 (2 ceil(40 / 40) = 2 < 2 A = 4 and 80 > 64;
     * then 2 ceil(40 / 20) = 4 is not < 4): logits 4 * 2 * (80 + 8) * 32 = 22,528, the wider tiles
     * 4 * 2 * 2 * 20 * (2 * 16 + 259) = 93,120, parts 8 * 2 * 32 * (ceil(40 / 40) + ceil(40 / 256))
     * = 1,024, the own keys' state of 80 rows 4 * 2 * (80 * 16 + 3 * 80) = 12,160 */
    kf_mem_shape shc = shf;
    shc.chunk = 64;
    kf_compact_peak_bytes(&c, &shc, &mf);
    CU_ASSERT_EQUAL(mf.targets, 14912 + 22528 + 93120 + 1024 + 12160 + 3130);
    /* and it does not grow with the layers: the pool is one layer whatever L */
    kf_hfconfig c4 = c;
    c4.n_layers = 4;
    kf_compact_peak_bytes(&c4, &shf, &mf);
    CU_ASSERT_EQUAL(mf.targets, 14912 + 10240 + 1024 + 4864 + 3130);

    /* the weights term counts what the model loads */
    kf_mem_shape real;
    kf_compact_params p = params(KF_METHOD_FOLD, 0.25);
    kf_compact_mem_shape(kf_model_config(g_m), &p, 0, 200, 0, 1, &real);
    kf_compact_peak_bytes(kf_model_config(g_m), &real, &m);
    CU_ASSERT_EQUAL(m.weights, 4 * kf_model_n_params(g_m));
    /* and the shape is the one kf_compact runs: 2 x 206 positions, 2 x 41 held out, t 50, the fold
     * candidate's logits kept for all 330 training rows (the choice's: fewer than 512); the solve
     * on the pool's threads, min(threads, kv heads) heads at once */
    CU_ASSERT(real.R == 412 && real.Rv == 82 && real.t == 50 && real.S == 206 && real.choice == 1 && real.Rc == 0);
    CU_ASSERT_EQUAL(real.Rk, 330);
    CU_ASSERT(real.fused == 1 && real.Ru == 0); /* the repeat fuses its targets; no context rows */
    CU_ASSERT(real.solve_threads == 1 && real.solve_heads == 1);
    CU_ASSERT_EQUAL(real.head_ws, kf_compact_head_ws_bytes(&real, 64));
    kf_mem_shape three;
    kf_compact_mem_shape(kf_model_config(g_m), &p, 0, 200, 0, 3, &three);
    CU_ASSERT(three.solve_threads == 3 && three.solve_heads == 2);
    kf_compacted out;
    kf_error err = {0};
    const kf_prompt doc = {g_doc, 200};
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &out, &err), KF_OK);
    CU_ASSERT_EQUAL(out.stats.n_queries, real.R);
    CU_ASSERT_EQUAL(out.stats.n_val_queries, real.Rv);
    CU_ASSERT_EQUAL(out.t, real.t);
    /* the solve's declared buffers are the formula's: each thread's workspace is ws, and its heads
     * used most of it (ws is their peak, up to what one variant's choice never holds at once) */
    CU_ASSERT_EQUAL(out.stats.ws_bytes, real.head_ws);
    CU_ASSERT(out.stats.ws_peak <= out.stats.ws_bytes && out.stats.ws_peak > out.stats.ws_bytes / 2);
    printf("\n    workspace %lld bytes, %lld used at most ", (long long)out.stats.ws_bytes,
           (long long)out.stats.ws_peak);
    kf_compacted_free(&out);
}

/* refq_bf16 compacts from the queries rounded to bf16: the same shape and query count, not the
 * same bytes (the option acts), and close to the fp32 result: most kept positions the same. */
static void test_refq_bf16_close(void) {
    kf_error err = {0};
    const kf_prompt doc = {g_doc, 200};
    kf_compact_params p = params(KF_METHOD_FOLD, 0.25);
    kf_compacted a, b;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &a, &err), KF_OK);
    p.run.refq_bf16 = 1;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &b, &err), KF_OK);
    CU_ASSERT_FATAL(a.C == b.C && a.stats.n_queries == b.stats.n_queries);
    CU_ASSERT(!compacted_identical(&a, &b));
    const size_t np = (size_t)a.n_layers * a.kv_heads * a.C;
    size_t same = 0;
    for (size_t i = 0; i < np; i++)
        same += a.positions[i] == b.positions[i];
    const size_t n = (size_t)a.n_layers * a.C * a.kv_heads * a.head_dim;
    const double dv = kf_max_abs_diff(a.values, b.values, n) / kf_max_abs(a.values, n);
    printf("\n    bf16 reference queries: %zu of %zu kept positions as fp32's, values max diff %.3g (relative)\n",
           same, np, dv);
    CU_ASSERT(same >= np * 9 / 10);
    kf_compacted_free(&a);
    kf_compacted_free(&b);
}

/* compact -> kvf -> load -> attach: the question's log-probabilities from the file equal those of
 * the in-memory cache (f32 files exactly; bf16 files equal the in-memory cache rounded to bf16). */
static void test_round_trip_through_kvf(void) {
    kf_error err = {0};
    const kf_method methods[] = {KF_METHOD_FOLD, KF_METHOD_AM, KF_METHOD_KEEP, KF_METHOD_DROP};
    const kf_dtype dtypes[] = {KF_DTYPE_F32, KF_DTYPE_BF16, KF_DTYPE_F16};
    const int V = kf_model_config(g_m)->vocab_size;
    const int32_t answer[] = {1541, 2644, 10};
    kf_prompt q = {kQuestion, 7}, ans = {answer, 3};
    float *lp_mem = malloc(sizeof(float) * 3 * V), *lp_file = malloc(sizeof(float) * 3 * V); /* [3, V] */
    float *lp_again = malloc(sizeof(float) * 3 * V);                                            /* [3, V] */
    kf_prompt doc = {g_doc, 200};
    const char *dir = kf_test_make_dir("roundtrip");
    for (int mi = 0; mi < 4; mi++) {
        kf_compact_params p = params(methods[mi], 0.25);
        kf_compacted c;
        CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, NULL, &doc, NULL, &p, &c, &err), KF_OK);
        for (int di = 0; di < 3; di++) {
            kvf_cache kc;
            kf_compacted_to_kvf(&c, &kc);
            kc.hdr.dtype = dtypes[di];
            snprintf(kc.hdr.model_fingerprint, sizeof kc.hdr.model_fingerprint, "%s", kf_model_fingerprint(g_m));
            kvf_document_digest(doc.ids, doc.n, kc.hdr.document_digest);
            char path[4096];
            snprintf(path, sizeof path, "%s/%s-%s.kvf", dir, kf_method_name(methods[mi]), kf_dtype_name(dtypes[di]));
            CU_ASSERT_EQUAL_FATAL(kvf_write(path, &kc, &err), KF_OK);
            /* the in-memory cache as the file stores it */
            kf_compacted r = c;
            const size_t n = (size_t)c.n_layers * c.C * c.kv_heads * c.head_dim;
            r.keys = malloc(sizeof(float) * n);
            r.values = malloc(sizeof(float) * n);
            for (size_t i = 0; i < n; i++) {
                r.keys[i] = dtypes[di] == KF_DTYPE_BF16  ? kf_bf16_to_f32(kf_f32_to_bf16(c.keys[i]))
                            : dtypes[di] == KF_DTYPE_F16 ? kf_f16_to_f32(kf_f32_to_f16(c.keys[i]))
                                                         : c.keys[i];
                r.values[i] = dtypes[di] == KF_DTYPE_BF16  ? kf_bf16_to_f32(kf_f32_to_bf16(c.values[i]))
                              : dtypes[di] == KF_DTYPE_F16 ? kf_f16_to_f32(kf_f32_to_f16(c.values[i]))
                                                           : c.values[i];
            }
            kf_engine e;
            CU_ASSERT_EQUAL_FATAL(kf_engine_from_compacted(&e, g_m, &r, 16, &err), KF_OK);
            CU_ASSERT_EQUAL_FATAL(kf_engine_logprobs(&e, g_m, &q, &ans, lp_mem, &err), KF_OK);
            kf_engine_free(&e);
            free(r.keys);
            free(r.values);

            kvf_file *f;
            kf_compacted l;
            CU_ASSERT_EQUAL_FATAL(kvf_open(path, &f, &err), KF_OK);
            CU_ASSERT_EQUAL(kvf_check_model(f, kf_model_fingerprint(g_m), c.n_layers, c.kv_heads, c.head_dim, &err), KF_OK);
            CU_ASSERT_EQUAL_FATAL(kf_compacted_load(f, &l, &err), KF_OK);
            kvf_close(f);
            CU_ASSERT(l.C == c.C && l.D == c.D && l.method == c.method && l.rotated == 1);
            CU_ASSERT_EQUAL_FATAL(kf_engine_from_compacted(&e, g_m, &l, 16, &err), KF_OK);
            CU_ASSERT_EQUAL_FATAL(kf_engine_logprobs(&e, g_m, &q, &ans, lp_file, &err), KF_OK);
            /* a second prompt on the same engine: the first was rewound, so the same answer */
            CU_ASSERT_EQUAL_FATAL(kf_engine_logprobs(&e, g_m, &q, &ans, lp_again, &err), KF_OK);
            kf_engine_free(&e);
            CU_ASSERT_EQUAL(memcmp(lp_again, lp_file, sizeof(float) * 3 * V), 0);
            /* the file's cache against the in-memory one (computed before the file was read) */
            CU_ASSERT_EQUAL(memcmp(lp_mem, lp_file, sizeof(float) * 3 * V), 0);
            if (memcmp(lp_mem, lp_file, sizeof(float) * 3 * V) != 0)
                fprintf(stderr, "%s %s: file vs memory %g\n", kf_method_name(methods[mi]), kf_dtype_name(dtypes[di]),
                        kf_max_abs_diff(lp_mem, lp_file, (size_t)3 * V));
            /* and the log-probabilities are real ones: finite, each row a distribution */
            for (int row = 0; row < 3; row++) {
                double mass = 0;
                for (int v = 0; v < V; v++)
                    mass += exp((double)lp_file[(size_t)row * V + v]);
                CU_ASSERT(fabs(mass - 1) < 1e-3);
            }
            kf_compacted_free(&l);
        }
        kf_compacted_free(&c);
    }
    free(lp_mem);
    free(lp_file);
    free(lp_again);
}

/* Greedy decoding through the engine: after the repeat instruction and the document's first six
 * tokens ("- vaziri bresnu\n- reka"), a full-context engine continues copying the document (the
 * records model copies well; it has not learned to answer questions); every token is the argmax of
 * the teacher-forced log-probs of the prompt plus the tokens before it (one prefill, an independent
 * path); the context is rewound after each prompt. */
static void test_engine_greedy_full_context(void) {
    kf_error err = {0};
    kf_engine e;
    kf_prompt doc = {g_doc, g_doc_n};
    int32_t prompt[6 + 6]; /* instruction, then the document's first 6 tokens */
    memcpy(prompt, kInstr, sizeof kInstr);
    memcpy(prompt + 6, g_doc, sizeof(int32_t) * 6);
    kf_prompt q = {prompt, 12};
    CU_ASSERT_EQUAL_FATAL(kf_engine_from_document(&e, g_m, &doc, 64, &err), KF_OK);
    const int V = kf_model_config(g_m)->vocab_size;
    int32_t out[8];
    int n = 0;
    const int32_t eos = 3199;
    CU_ASSERT_EQUAL_FATAL(kf_engine_greedy(&e, g_m, &q, 8, &eos, 1, NULL, NULL, out, &n, &err), KF_OK);
    CU_ASSERT_EQUAL(e.seq.len, g_doc_n); /* rewound */
    CU_ASSERT_EQUAL_FATAL(n, 8);
    /* " stuflo\nIn meadow stone.\nIn": the document's tokens 6..13 */
    CU_ASSERT_EQUAL(memcmp(out, g_doc + 6, sizeof out), 0);
    for (int j = 0; j < n && memcmp(out, g_doc + 6, sizeof out) != 0; j++)
        fprintf(stderr, "greedy token %d: %d, the document's %d\n", j, out[j], g_doc[6 + j]);
    float *lp = malloc(sizeof(float) * (size_t)n * V); /* [n, V] */
    kf_prompt ans = {out, n};
    CU_ASSERT_EQUAL_FATAL(kf_engine_logprobs(&e, g_m, &q, &ans, lp, &err), KF_OK);
    for (int j = 0; j < n; j++) {
        int best = 0;
        for (int v = 1; v < V; v++)
            best = lp[(size_t)j * V + v] > lp[(size_t)j * V + best] ? v : best;
        CU_ASSERT_EQUAL(out[j], best);
    }
    free(lp);
    int32_t n2_out[8];
    int n2 = 0;
    CU_ASSERT_EQUAL_FATAL(kf_engine_greedy(&e, g_m, &q, 3, &eos, 1, NULL, NULL, n2_out, &n2, &err), KF_OK);
    CU_ASSERT(n2 == 3 && memcmp(out, n2_out, sizeof(int32_t) * 3) == 0);
    kf_engine_free(&e);
}

static CU_TestInfo plan_tests[] = {
    {"Quail's example: order, parents, shared, 1,916 of 4,300", test_plan_quail_example},
    {"siblings, duplicates, granules and the cost rule", test_plan_siblings_cap_and_cost},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo model_tests[] = {
    {"logits with sharing equal logits without", test_sharing_logits_equal},
    {"kf_compact_ex with a shared prefix == kf_compact", test_compact_ex_shared_equals_whole},
    {"one prepare, several variants == kf_compact for each", test_shared_stages_equal_separate},
    {"several variants == each alone where the choice scores a subsample", test_shared_variants_scored_subsample},
    {"a caller's arena of kf_compact_arena_pages; the sources held together only while they run", test_prep_arena_pages},
    {"the memory formula: a hand-computed case, the loaded weights, kf_compact's shape", test_memory_formula},
    {"bf16 reference queries: a different, close compaction", test_refq_bf16_close},
    {"round trip compact -> kvf -> engine", test_round_trip_through_kvf},
    {"engine: greedy decoding and rewind", test_engine_greedy_full_context},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"prefix plan", NULL, NULL, NULL, NULL, plan_tests},
    {"compaction job on records-qwen3", init_model, clean_model, NULL, NULL, model_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
