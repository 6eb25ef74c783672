/* The solve's per-head path allocates nothing: each thread's workspace is sized once per job
 * (compactor/compact_mem.c) and every head carves its buffers from it.
 *
 * This executable interposes malloc, calloc, realloc, aligned_alloc and posix_memalign and counts
 * the calls made inside the items of the backend's parallel_for (which runs exactly the solve's
 * per-head work: the forward's kernels run on the pool directly), by wrapping the backend's
 * parallel_for with one that marks its items' threads. Every method, with and without the
 * per-head choice, fused and unfused targets, bf16 reference queries, the fold on probes, several
 * variants at once and per-head budgets, on 1 and 3 threads: 0 allocations. A counter that cannot
 * fail is no test: it also checks that an allocation inside an item is counted. Not built with
 * the sanitizers (they own malloc). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "test_util.h"

extern void *__libc_malloc(size_t), *__libc_calloc(size_t, size_t), *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static _Thread_local int t_in_item; /* this thread runs a parallel_for item */
static _Atomic long long g_allocs;  /* allocations inside items */

static void count(void) {
    if (t_in_item)
        atomic_fetch_add(&g_allocs, 1);
}
void *malloc(size_t n) {
    count();
    return __libc_malloc(n);
}
void *calloc(size_t a, size_t b) {
    count();
    return __libc_calloc(a, b);
}
void *realloc(void *q, size_t n) {
    count();
    return __libc_realloc(q, n);
}
void *aligned_alloc(size_t al, size_t n) {
    count();
    return __libc_memalign(al, n);
}
int posix_memalign(void **p, size_t al, size_t n) {
    count();
    *p = __libc_memalign(al, n);
    return *p ? 0 : 12;
}

/* The backend's parallel_for, its items marked. */
static void (*g_inner)(kf_backend *, int, kf_parallel_fn, void *);
typedef struct {
    kf_parallel_fn fn;
    void *ctx;
} wrapped;
static void marked_item(void *ctx, int i, int thread) {
    const wrapped *w = ctx;
    t_in_item = 1;
    w->fn(w->ctx, i, thread);
    t_in_item = 0;
}
static void marked_parallel_for(kf_backend *b, int n, kf_parallel_fn fn, void *ctx) {
    wrapped w = {fn, ctx};
    g_inner(b, n, marked_item, &w);
}

/* One item that allocates, through the wrapped parallel_for: counted (volatile: the compiler may
 * not drop a malloc whose block is freed unused). */
static void *volatile g_sink[8];
static void allocating_item(void *ctx, int i, int thread) {
    (void)ctx, (void)thread;
    g_sink[i] = malloc(64);
    free(g_sink[i]);
}

static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10};        /* "Repeat the records above.\n" */
static const int32_t kQuestion[] = {81, 58, 1541, 63, 10, 65, 58}; /* "Q: rake?\nA:" */
static int32_t g_doc[4096];
static int g_n_doc;

static int init_doc(void) {
    g_n_doc = kf_test_records_ids(5, g_doc, 4096);
    return g_n_doc > 200 ? 0 : -1;
}

typedef struct {
    const char *name;
    kf_method method;
    kf_head_choice choice;
    int context, bf16, on_probes, budgets, variants;
} solve_case;

/* Allocations inside the per-head items of one solve of case c on `threads` threads. */
static long long solve_allocs(const solve_case *c, int threads) {
    kf_backend *b = kf_backend_cpu_create_threads(threads);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    g_inner = b->parallel_for;
    b->parallel_for = marked_parallel_for;
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, kf_test_data("records-qwen3"), b, &err), KF_OK);
    kf_compact_params p = kf_compact_params_default();
    static const kf_prompt probe = {kQuestion, 7};
    p.method = c->method, p.choice.head_choice = c->choice, p.budget = 0.2;
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.probes = &probe, p.n_probes = 1;
    p.use_context_queries = c->context, p.run.refq_bf16 = c->bf16;
    p.solver.fold_queries = c->on_probes ? KF_FOLD_ON_PROBES : p.solver.fold_queries;
    static const float shares[] = {0.1f, 0.2f, 0.3f, 0.4f, 0.25f, 0.25f, 0.25f, 0.25f};
    p.solver.head_budgets = c->budgets ? shares : NULL;
    const kf_compact_variant v[2] = {{c->method, 0.2}, {KF_METHOD_DROP, 0.1}};
    const int n = c->variants;
    const kf_prompt doc = {g_doc, 200};
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(m, NULL, NULL, &doc, NULL, &p, v, n, &prep, &err), KF_OK);
    kf_compacted out[2];
    g_allocs = 0;
    const kf_status rc = kf_compact_solve(prep, v, n, out, &err);
    const long long allocs = g_allocs;
    CU_ASSERT_EQUAL(rc, KF_OK);
    if (rc != KF_OK)
        printf("\n    %s: %s", c->name, err.msg);
    for (int i = 0; rc == KF_OK && i < n; i++)
        kf_compacted_free(&out[i]);
    kf_compact_prep_free(prep, NULL);
    kf_model_free(m);
    b->destroy(b);
    return allocs;
}

static void test_counter_counts(void) {
    kf_backend *b = kf_backend_cpu_create_threads(2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    g_inner = b->parallel_for;
    b->parallel_for = marked_parallel_for;
    g_allocs = 0;
    kf_backend_parallel_for(b, 5, allocating_item, NULL);
    CU_ASSERT_EQUAL(g_allocs, 5);
    g_allocs = 0;
    g_sink[0] = malloc(64); /* outside an item: not counted */
    free(g_sink[0]);
    CU_ASSERT_EQUAL(g_allocs, 0);
    b->destroy(b);
}

static void test_no_allocation_per_head(void) {
    static const solve_case cases[] = {
        {"fold, choice", KF_METHOD_FOLD, KF_CHOICE_DEFAULT, 0, 0, 0, 0, 1},
        {"am, choice", KF_METHOD_AM, KF_CHOICE_DEFAULT, 0, 0, 0, 0, 1},
        {"am, no choice, per-head budgets", KF_METHOD_AM, KF_CHOICE_OFF, 0, 0, 0, 1, 1},
        {"fold, no choice, on probes", KF_METHOD_FOLD, KF_CHOICE_OFF, 0, 0, 1, 0, 1},
        {"fold, choice, on probes, bf16 queries", KF_METHOD_FOLD, KF_CHOICE_ON, 0, 1, 1, 0, 1},
        {"drop and keep, choice on", KF_METHOD_DROP, KF_CHOICE_ON, 0, 0, 0, 0, 1},
        {"keep, choice on", KF_METHOD_KEEP, KF_CHOICE_ON, 0, 0, 0, 0, 1},
        {"am, context queries (unfused targets)", KF_METHOD_AM, KF_CHOICE_DEFAULT, 1, 0, 0, 0, 1},
        {"fold + drop variants, context queries", KF_METHOD_FOLD, KF_CHOICE_DEFAULT, 1, 0, 0, 0, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const long long a1 = solve_allocs(&cases[i], 1), a3 = solve_allocs(&cases[i], 3);
        printf("\n    %-40s %lld, %lld allocations in the per-head items (1, 3 threads)", cases[i].name, a1, a3);
        CU_ASSERT_EQUAL(a1, 0);
        CU_ASSERT_EQUAL(a3, 0);
    }
    printf("\n");
}

static CU_TestInfo tests[] = {
    {"an allocation inside a parallel_for item is counted", test_counter_counts},
    {"the solve's per-head items allocate nothing", test_no_allocation_per_head},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"allocations on the per-head path (records-qwen3)", init_doc, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
