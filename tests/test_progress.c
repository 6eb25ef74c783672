/* A compaction's progress calls (compactor/progress.h) on records-qwen3 (4 layers, 2 KV heads):
 * their order and counts against what the document's lengths and the chunk size say, every call
 * on the caller's thread with the solve on a 3-thread pool, the heads' intermediate count when the
 * caller's thread solves a head first, the forwards' FLOPs, and the same bytes with and without a
 * callback. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "compactor/compact_flops.h"
#include "test_util.h"

static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10};        /* "Repeat the records above.\n" */
static const int32_t kQuestion[] = {81, 58, 1541, 63, 10, 65, 58}; /* "Q: rake?\nA:" */
enum { kPre = 5, kDoc = 240, kChunk = 64, kMaxCalls = 512 };
static const kf_compact_variant kVariant = {KF_METHOD_FOLD, 0.25};

static int32_t g_doc[4096];

typedef struct {
    kf_progress p[kMaxCalls];
    int n, off_thread;
    pthread_t caller;
} calls;

static void record(void *user, const kf_progress *p) {
    calls *c = user;
    c->off_thread += !pthread_equal(pthread_self(), c->caller);
    if (c->n < kMaxCalls)
        c->p[c->n] = *p;
    c->n++;
}

static kf_compact_params params(calls *c) {
    static const kf_prompt probe = {kQuestion, 7};
    kf_compact_params p = kf_compact_params_default();
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.solver.max_queries = 2000;
    p.probes = &probe;
    p.n_probes = 1;
    p.run.chunk = kChunk;
    if (c) {
        p.progress = record, p.progress_user = c;
        c->caller = pthread_self();
    }
    return p;
}

static void compact(kf_model *m, calls *c, kf_compacted *out) {
    kf_error err = {0};
    const kf_compact_params p = params(c);
    const kf_prompt pre = {g_doc + 300, kPre}, doc = {g_doc, kDoc};
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(m, NULL, &pre, &doc, NULL, &p, &kVariant, 1, &prep, &err), KF_OK);
    const kf_status rc = kf_compact_solve(prep, &kVariant, 1, out, &err);
    if (rc != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(rc, KF_OK);
    kf_compact_prep_free(prep, NULL);
}

/* Items of the solve on the pool one at a time in order, item i on thread i % 3 (the caller's
 * thread 0 solves head 0 first). */
static void (*g_pool_for)(kf_backend *, int, kf_parallel_fn, void *);
typedef struct {
    kf_parallel_fn fn;
    void *ctx;
    int item;
} one_item;
static void run_one(void *ctx, int item, int thread) {
    (void)item, (void)thread;
    const one_item *o = ctx;
    o->fn(o->ctx, o->item, o->item % 3);
}
static void in_order_for(kf_backend *b, int n_items, kf_parallel_fn fn, void *ctx) {
    for (int i = 0; i < n_items; i++) {
        one_item o = {fn, ctx, i};
        g_pool_for(b, 1, run_one, &o);
    }
}

/* Expects the next call at *k to be (stage, layer, done, total). */
static void expect(const calls *c, int *k, kf_stage st, int layer, int64_t done, int64_t total) {
    const kf_progress *p = *k < c->n ? &c->p[*k] : NULL;
    const int ok = p && p->stage == st && p->layer == layer && p->done == done && p->total == total && p->n_layers == 4;
    if (!ok)
        fprintf(stderr, "\ncall %d: want %s layer %d %lld/%lld, got %s layer %d %lld/%lld\n", *k, kf_stage_name(st),
                layer, (long long)done, (long long)total, p ? kf_stage_name(p->stage) : "none", p ? p->layer : -9,
                p ? (long long)p->done : -1LL, p ? (long long)p->total : -1LL);
    CU_ASSERT(ok);
    (*k)++;
}

/* The whole sequence: the context's chunks, then per layer the repeat's chunks and the probe, then
 * the solve (1/2 heads: mid 1 always, -1 where it came, 0 never). */
static void expect_sequence(const calls *c, int mid) {
    const int64_t D = kPre + kDoc, rep = 6 + kDoc, S = rep + 7;
    int k = 0;
    for (int64_t t = kChunk; t < D + kChunk; t += kChunk)
        expect(c, &k, KF_STAGE_PREFILL, -1, t < D ? t : D, D);
    for (int l = 0; l < 4; l++) {
        for (int64_t t = kChunk; t < rep + kChunk; t += kChunk)
            expect(c, &k, KF_STAGE_REPEAT, l, t < rep ? t : rep, S);
        expect(c, &k, KF_STAGE_REPEAT, l, S, S);
        expect(c, &k, KF_STAGE_SOLVE, l, 0, 2);
        if (mid > 0 || (mid < 0 && k < c->n && c->p[k].stage == KF_STAGE_SOLVE && c->p[k].done == 1))
            expect(c, &k, KF_STAGE_SOLVE, l, 1, 2);
        expect(c, &k, KF_STAGE_SOLVE, l, 2, 2);
    }
    CU_ASSERT_EQUAL(k, c->n);
}

/* fwd_done never goes back, reaches fwd_total at the end; the prefill's and the sources' FLOPs
 * are compact_flops.h's counts. */
static void expect_flops(const kf_model *m, const calls *c) {
    const kf_compact_params p = params(NULL);
    kf_compact_flops f;
    kf_compact_flops_count(kf_model_config(m), &p, kPre, kDoc, 0, 1, &f);
    const double pre = kf_flops_total(&f.prefill), src = kf_flops_total(&f.repeat);
    for (int i = 1; i < c->n; i++)
        CU_ASSERT(c->p[i].fwd_done >= c->p[i - 1].fwd_done);
    int last_prefill = 0;
    while (last_prefill + 1 < c->n && c->p[last_prefill + 1].stage == KF_STAGE_PREFILL)
        last_prefill++;
    CU_ASSERT_DOUBLE_EQUAL(c->p[last_prefill].fwd_done, pre, 1e-9 * pre);
    CU_ASSERT_DOUBLE_EQUAL(c->p[0].fwd_sources, src, 1e-9 * src);
    CU_ASSERT_DOUBLE_EQUAL(c->p[c->n - 1].fwd_total, pre + src, 1e-9 * (pre + src));
    CU_ASSERT_DOUBLE_EQUAL(c->p[c->n - 1].fwd_done, pre + src, 1e-9 * (pre + src));
}

static int same_bytes(const kf_compacted *a, const kf_compacted *b) {
    const size_t n = (size_t)a->n_layers * a->C * a->kv_heads * a->head_dim;
    return a->C == b->C && !memcmp(a->keys, b->keys, sizeof(float) * n) &&
           !memcmp(a->values, b->values, sizeof(float) * n);
}

static void test_progress_calls(void) {
    CU_ASSERT_FATAL(kf_test_records_ids(2, g_doc, 4096) > 310);
    kf_backend *b = kf_backend_cpu_create_threads(3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, kf_test_data("records-qwen3"), b, &err), KF_OK);
    calls *pool = calloc(1, sizeof *pool), *ordered = calloc(1, sizeof *ordered);
    kf_compacted none, a, o;
    compact(m, NULL, &none);
    compact(m, pool, &a); /* the pool: the middle count comes from whichever thread finishes first */
    g_pool_for = b->parallel_for;
    b->parallel_for = in_order_for;
    compact(m, ordered, &o);
    b->parallel_for = g_pool_for;
    printf("\n    %d calls on the pool, %d in order, %d off the caller's thread\n", pool->n, ordered->n,
           pool->off_thread + ordered->off_thread);
    CU_ASSERT_EQUAL(pool->off_thread, 0);
    CU_ASSERT_EQUAL(ordered->off_thread, 0);
    CU_ASSERT_FATAL(pool->n < kMaxCalls && ordered->n < kMaxCalls);
    expect_sequence(pool, -1); /* "1/2" when the caller's thread finished the first head */
    expect_sequence(ordered, 1);
    expect_flops(m, pool);
    CU_ASSERT(same_bytes(&none, &a));
    CU_ASSERT(same_bytes(&none, &o));
    kf_compacted_free(&none), kf_compacted_free(&a), kf_compacted_free(&o);
    free(pool), free(ordered);
    kf_model_free(m);
    b->destroy(b);
}

int main(void) {
    CU_TestInfo tests[] = {{"progress calls: order, counts, thread, FLOPs, same bytes", test_progress_calls},
                           CU_TEST_INFO_NULL};
    CU_SuiteInfo suites[] = {{"progress", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};
    return kf_test_main(suites);
}
