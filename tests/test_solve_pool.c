/* The solve over KV heads in parallel: compaction with the per-head choice and
 * two variants gives the same bytes and the same stats on 1 thread, on 3 threads, and with the
 * heads run in reverse order on rotating thread indices (a deterministic stand-in for heads that
 * finish out of order: sums merged in completion order rather than head order differ there).
 * One prepare is solved three times: the prefill is not under test here (a 1-thread CPU
 * backend's attention leaves OpenBLAS its threads, a pooled one holds it to one, and OpenBLAS's
 * sgemm rounds differently with its thread count). Why: docs/decisions/parallel-solve.md. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "test_util.h"

static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10};        /* "Repeat the records above.\n" */
static const int32_t kQuestion[] = {81, 58, 1541, 63, 10, 65, 58}; /* "Q: rake?\nA:" */
static const kf_compact_variant kVariants[2] = {{KF_METHOD_FOLD, 0.25}, {KF_METHOD_AM, 0.1}};

static int32_t g_doc[4096];
static int g_doc_n;

static int init_doc(void) {
    g_doc_n = kf_test_records_ids(2, g_doc, 4096); /* doc1-1 of records-dev.jsonl */
    return g_doc_n > 300 ? 0 : -1;
}

/* prepare of both variants on records-qwen3 (loaded on b): a prefix, a probe, the choice on. */
static kf_compact_prep *prepare_on(kf_model *m) {
    kf_error err = {0};
    kf_compact_params p = kf_compact_params_default();
    static const kf_prompt probe = {kQuestion, 7};
    const kf_prompt pre = {g_doc + 300, 5}, doc = {g_doc, 240};
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.solver.max_queries = 2000;
    p.probes = &probe;
    p.n_probes = 1;
    p.choice.head_choice = KF_CHOICE_ON;
    p.choice.choice_margin = 0; /* am and fold win heads too */
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL(kf_compact_prepare(m, NULL, &pre, &doc, NULL, &p, kVariants, 2, &prep, &err), KF_OK);
    return prep;
}

static void solve(kf_compact_prep *prep, kf_compacted *outs) {
    kf_error err = {0};
    const kf_status rc = kf_compact_solve(prep, kVariants, 2, outs, &err);
    if (rc != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(rc, KF_OK);
}

/* Every array byte for byte and every stat that is not a time (1: the same). */
static int same_cache(const kf_compacted *a, const kf_compacted *b) {
    if (a->C != b->C || a->t != b->t || a->D != b->D || a->method != b->method || a->rotated != b->rotated)
        return 0;
    const size_t hs = (size_t)a->n_layers * a->kv_heads, kv = hs * a->C * a->head_dim;
    const kf_compact_stats *s = &a->stats, *r = &b->stats;
    return !memcmp(a->keys, b->keys, sizeof(float) * kv) && !memcmp(a->values, b->values, sizeof(float) * kv) &&
           !memcmp(a->beta, b->beta, sizeof(float) * hs * a->C) && !memcmp(a->u, b->u, sizeof(float) * hs * a->head_dim) &&
           !memcmp(a->positions, b->positions, sizeof(int32_t) * hs * a->C) &&
           !memcmp(a->var_gain, b->var_gain, sizeof(float) * hs) &&
           !memcmp(a->head_alpha, b->head_alpha, sizeof(float) * hs) && !memcmp(a->head_method, b->head_method, hs) &&
           !memcmp(s->heads_by_method, r->heads_by_method, sizeof s->heads_by_method) &&
           !memcmp(&s->solver, &r->solver, sizeof s->solver) && s->n_queries == r->n_queries &&
           s->n_val_queries == r->n_val_queries && s->fold_fallback_heads == r->fold_fallback_heads &&
           s->heads_ridged == r->heads_ridged && !memcmp(&s->mean_var_gain, &r->mean_var_gain, sizeof(double));
}

/* Stand-ins on the 3-thread CPU backend, through its own parallel_for one item at a time (the
 * pool runs a single item inline, OpenBLAS held to one thread as for any job): items in order on
 * thread 0 (what a 1-thread CPU backend does), or in reverse order with item i on thread i % 3
 * (heads that finish out of order, deterministically). */
static void (*g_pool_for)(kf_backend *, int, kf_parallel_fn, void *);
static int g_rotate;
typedef struct {
    kf_parallel_fn fn;
    void *ctx;
    int item;
} one_item;

static void run_one(void *ctx, int item, int thread) {
    (void)item, (void)thread;
    const one_item *o = ctx;
    o->fn(o->ctx, o->item, g_rotate ? o->item % 3 : 0);
}

static void in_order_for(kf_backend *b, int n_items, kf_parallel_fn fn, void *ctx) {
    for (int i = 0; i < n_items; i++) {
        one_item o = {fn, ctx, i};
        g_pool_for(b, 1, run_one, &o);
    }
}

static void reverse_for(kf_backend *b, int n_items, kf_parallel_fn fn, void *ctx) {
    for (int i = n_items - 1; i >= 0; i--) {
        one_item o = {fn, ctx, i};
        g_pool_for(b, 1, run_one, &o);
    }
}

/* One prepare; its solve on one thread, on the pool's 3 threads, and in reverse order. */
static void test_threads_same_bytes(void) {
    kf_backend *b = kf_backend_cpu_create_threads(3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    CU_ASSERT_EQUAL(kf_backend_threads(b), 3);
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, kf_test_data("records-qwen3"), b, &err), KF_OK);
    kf_compact_prep *prep = prepare_on(m);
    CU_ASSERT_PTR_NOT_NULL_FATAL(prep);
    kf_compacted one[2], three[2], rev[2];
    g_pool_for = b->parallel_for;
    b->parallel_for = in_order_for, b->threads = 1, g_rotate = 0;
    solve(prep, one);
    b->parallel_for = g_pool_for, b->threads = 3;
    solve(prep, three);
    b->parallel_for = reverse_for, g_rotate = 1;
    solve(prep, rev);
    b->parallel_for = g_pool_for;
    kf_compact_prep_free(prep, NULL);
    for (int i = 0; i < 2; i++) {
        const kf_compact_stats *s = &one[i].stats;
        printf("\n    %s: keep %d drop %d am %d fold %d, mean var gain %.17g", kf_method_name(kVariants[i].method),
               s->heads_by_method[0], s->heads_by_method[1], s->heads_by_method[2], s->heads_by_method[3],
               s->mean_var_gain);
        CU_ASSERT(s->n_val_queries > 0);
        CU_ASSERT(same_cache(&one[i], &three[i]));
        CU_ASSERT(same_cache(&one[i], &rev[i]));
        if (!same_cache(&one[i], &three[i]) || !same_cache(&one[i], &rev[i]))
            fprintf(stderr, "\n%s: 1 thread vs 3 threads %s, vs reverse order %s (mean var gain %.17g %.17g %.17g)\n",
                    kf_method_name(kVariants[i].method), same_cache(&one[i], &three[i]) ? "same" : "DIFFER",
                    same_cache(&one[i], &rev[i]) ? "same" : "DIFFER", s->mean_var_gain, three[i].stats.mean_var_gain,
                    rev[i].stats.mean_var_gain);
    }
    printf("\n");
    /* the fold variant folds several heads, so its var_sum is a sum whose order shows */
    CU_ASSERT(one[0].stats.heads_by_method[KF_METHOD_FOLD] >= 3);
    for (int i = 0; i < 2; i++) {
        kf_compacted_free(&one[i]);
        kf_compacted_free(&three[i]);
        kf_compacted_free(&rev[i]);
    }
    kf_model_free(m);
    b->destroy(b);
}


/* ---- the first failing head (non-finite input in some heads only) ----
 * A parent document is prefilled into the caller's arena and NaN is written into layer 1's
 * keys (and values) of the chosen KV heads at one document position; a context that shares the
 * parent's first 200 tokens (kf_compact_reuse) then has non-finite input in layer 1 at exactly
 * those heads (layer 0 is clean; from layer 2 on every head is NaN, but the solve stops at layer
 * 1). The solve must refuse with the first failing head's own error in head order, whatever the
 * order the heads ran in, free every output, and leave the arena's pages as they were. */
enum { kBadLayer = 1, kBadPos = 150, kShared = 200 };

/* NaN at kBadPos of layer kBadLayer: in the keys of head key_head and the values of head val_head
 * (-1: none). */
static void poison(kf_model *m, kf_arena *a, const kf_seq *s, int key_head, int val_head) {
    const kf_hfconfig *c = kf_model_config(m);
    const int d = c->head_dim, row = c->n_kv_heads * d;
    float *k = malloc(sizeof(float) * row), *v = malloc(sizeof(float) * row); /* [1, kvh * d] */
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_seq_read_kv(a, s, kBadLayer, kBadPos, 1, k, v, &err), KF_OK);
    if (key_head >= 0)
        k[key_head * d + 7] = NAN;
    if (val_head >= 0)
        v[val_head * d + 3] = -INFINITY;
    CU_ASSERT_EQUAL_FATAL(kf_seq_write_kv(a, s, kBadLayer, kBadPos, 1, k, v, &err), KF_OK);
    free(k), free(v);
}

/* The three solves (1 thread in order, the 3-thread pool, reverse order) of one poisoned prepare
 * each fail with `want` in the message; every output is freed. */
static void solve_fails(kf_backend *b, kf_model *m, int key_head, int val_head, const char *want) {
    kf_error err = {0};
    kf_arena a;
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(m, &a, 4 * 320, &err), KF_OK);
    kf_seq parent;
    kf_seq_init(&parent);
    kf_forward_args fa = {.ids = g_doc, .n_tokens = kShared};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(m, &a, &parent, &fa, &err), KF_OK);
    poison(m, &a, &parent, key_head, val_head);
    kf_compact_params p = kf_compact_params_default();
    static const kf_prompt probe = {kQuestion, 7};
    const kf_prompt doc = {g_doc, 240};
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.solver.max_queries = 2000;
    p.probes = &probe;
    p.n_probes = 1;
    const kf_compact_reuse reuse = {.arena = &a, .parent = &parent, .shared = kShared};
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(m, &reuse, NULL, &doc, NULL, &p, kVariants, 2, &prep, &err), KF_OK);
    g_pool_for = b->parallel_for;
    for (int run = 0; run < 3; run++) {
        b->parallel_for = run == 1 ? g_pool_for : (run == 0 ? in_order_for : reverse_for);
        b->threads = run == 0 ? 1 : 3, g_rotate = run == 2;
        kf_compacted outs[2];
        memset(&err, 0, sizeof err);
        memset(outs, 0x5a, sizeof outs); /* the solve must zero them on failure */
        const kf_status rc = kf_compact_solve(prep, kVariants, 2, outs, &err);
        CU_ASSERT_EQUAL(rc, KF_ERR_INVALID);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, want));
        if (rc != KF_ERR_INVALID || !strstr(err.msg, want))
            fprintf(stderr, "\n  run %d: status %d \"%s\", want \"%s\"\n", run, (int)rc, err.msg, want);
        for (int i = 0; i < 2; i++) {
            CU_ASSERT(outs[i].keys == NULL && outs[i].values == NULL && outs[i].beta == NULL && outs[i].C == 0);
            if (rc == KF_OK)
                kf_compacted_free(&outs[i]);
        }
    }
    b->parallel_for = g_pool_for, b->threads = 3, g_rotate = 0;
    kf_compact_prep_free(prep, NULL);
    /* kf_compact_ex: the same error, no output, no page of the caller's arena kept */
    kf_compacted out;
    memset(&err, 0, sizeof err);
    CU_ASSERT_EQUAL(kf_compact_ex(m, &reuse, NULL, &doc, NULL, &p, &out, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, want));
    CU_ASSERT_PTR_NULL(out.keys);
    kf_seq_release(&a, &parent);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
}

static void test_first_failing_head(void) {
    kf_backend *b = kf_backend_cpu_create_threads(3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, kf_test_data("records-qwen3"), b, &err), KF_OK);
    /* one head of two: head 1's keys (head 0 solves fine) */
    solve_fails(b, m, 1, -1, "layer 1 KV head 1: non-finite key at context position 150");
    /* both heads: head 0's values, head 1's keys; head 1 runs first in reverse order */
    solve_fails(b, m, 1, 0, "layer 1 KV head 0: non-finite value at context position 150");
    kf_model_free(m);
    b->destroy(b);
}


/* A backend without parallel_for runs the items inline, in order, on thread 0; so does a 1-thread
 * CPU backend. */
static int g_order[8], g_seen;
static void record(void *ctx, int item, int thread) {
    (void)ctx;
    g_order[g_seen++] = item * 10 + thread;
}

static void test_inline_without_parallel_for(void) {
    kf_backend stub = {0};
    CU_ASSERT_EQUAL(kf_backend_threads(&stub), 1);
    stub.threads = 4; /* ignored without parallel_for */
    CU_ASSERT_EQUAL(kf_backend_threads(&stub), 1);
    g_seen = 0;
    kf_backend_parallel_for(&stub, 3, record, NULL);
    CU_ASSERT(g_seen == 3 && g_order[0] == 0 && g_order[1] == 10 && g_order[2] == 20);
    kf_backend *b1 = kf_backend_cpu_create_threads(1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b1);
    CU_ASSERT_EQUAL(kf_backend_threads(b1), 1);
    g_seen = 0;
    kf_backend_parallel_for(b1, 3, record, NULL);
    CU_ASSERT(g_seen == 3 && g_order[0] == 0 && g_order[1] == 10 && g_order[2] == 20);
    b1->destroy(b1);
}

static CU_TestInfo tests[] = {
    {"solve over heads: 1 thread == 3 threads == reverse order", test_threads_same_bytes},
    {"no parallel_for or 1 thread: items inline in order", test_inline_without_parallel_for},
    {"non-finite input in some heads: the first failing head's error, nothing kept", test_first_failing_head},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"the solve's threads on records-qwen3", init_doc, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
