/* The memory formula's solve term (compact.h) against the heap the solve really holds: this
 * executable counts every live heap byte (malloc, calloc, realloc, free interposed; the bytes
 * malloc_usable_size reports) and kf_compact_solve's peak above what existed before it must be
 * the formula's solve + output terms, less the validation prompts' keys and values and the
 * training rows' order that the prepare allocates, plus the targets term less its pool (the sources' forwards run inside the
 * solve: the attention's targets scratch grows there), within 2% - on 1 thread and on 3 (3
 * threads' buffers, min(3, 2 KV heads)
 * heads in flight), at two document lengths; and each thread's workspace is exactly the formula's
 * ws. Not built with the sanitizers (they own malloc). */
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "compactor/refq_targets.h"
#include "test_util.h"

extern void *__libc_malloc(size_t), *__libc_calloc(size_t, size_t), *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static _Atomic long long g_live, g_peak;
static _Atomic int g_on, g_aligned; /* counting; posix_memalign's blocks counted too */

static void count(long long n) {
    if (!g_on)
        return;
    const long long v = atomic_fetch_add(&g_live, n) + n;
    long long p = g_peak;
    while (v > p && !atomic_compare_exchange_weak(&g_peak, &p, v))
        ;
}
void *malloc(size_t n) {
    void *p = __libc_malloc(n);
    if (p)
        count((long long)malloc_usable_size(p));
    return p;
}
void *calloc(size_t a, size_t b) {
    void *p = __libc_calloc(a, b);
    if (p)
        count((long long)malloc_usable_size(p));
    return p;
}
void *realloc(void *q, size_t n) {
    const long long before = q ? (long long)malloc_usable_size(q) : 0;
    void *p = __libc_realloc(q, n);
    if (p)
        count((long long)malloc_usable_size(p) - before);
    return p;
}
int posix_memalign(void **out, size_t align, size_t n) { /* the CPU backend's buffers (the arena, the plan) */
    void *p = __libc_memalign(align, n);
    if (!p)
        return ENOMEM;
    if (g_aligned)
        count((long long)malloc_usable_size(p));
    *out = p;
    return 0;
}
void free(void *p) { /* a block of posix_memalign's: freed while counting only if made while counting */
    if (p)
        count(-(long long)malloc_usable_size(p));
    __libc_free(p);
}

static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10};        /* "Repeat the records above.\n" */
static const int32_t kQuestion[] = {81, 58, 1541, 63, 10, 65, 58}; /* "Q: rake?\nA:" */
static int32_t g_doc[4096];

static int init_doc(void) {
    return kf_test_records_ids(5, g_doc, 4096) > 3000 ? 0 : -1; /* doc1-5: 3,321 tokens */
}

/* records-qwen3 on a CPU backend of `threads` (*b: to destroy after the model). */
static kf_model *load_records(int threads, kf_backend **b) {
    *b = kf_backend_cpu_create_threads(threads);
    CU_ASSERT_PTR_NOT_NULL_FATAL(*b);
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, kf_test_data("records-qwen3"), *b, &err), KF_OK);
    return m;
}

/* fold at budget 0.1 (the per-head choice on, a probe) on n_doc tokens, solved on `threads`. */
static void solve_vs_formula(int threads, int n_doc) {
    kf_backend *b = NULL;
    kf_model *m = load_records(threads, &b);
    kf_error err = {0};
    kf_compact_params p = kf_compact_params_default();
    static const kf_prompt probe = {kQuestion, 7};
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.probes = &probe;
    p.n_probes = 1;
    const kf_prompt doc = {g_doc, n_doc};
    const kf_compact_variant v = {p.method, p.budget};
    kf_compact_prep *prep = NULL;
    CU_ASSERT_EQUAL_FATAL(kf_compact_prepare(m, NULL, NULL, &doc, NULL, &p, &v, 1, &prep, &err), KF_OK);
    kf_compacted out;
    g_live = 0;
    g_peak = 0;
    g_on = 1;
    CU_ASSERT_EQUAL_FATAL(kf_compact_solve(prep, &v, 1, &out, &err), KF_OK);
    g_on = 0;
    kf_mem_shape sh;
    kf_mem_peak t;
    const kf_hfconfig *c = kf_model_config(m);
    kf_compact_mem_shape(c, &p, 0, n_doc, 0, threads, &sh);
    kf_compact_peak_bytes(c, &sh, &t);
    CU_ASSERT(sh.R == out.stats.n_queries && sh.Rv == out.stats.n_val_queries && sh.t == out.t);
    /* the declared buffers: each thread's workspace is the formula's ws */
    CU_ASSERT_EQUAL(out.stats.ws_bytes, sh.head_ws);
    /* the validation prompts' K/V and the training rows' order */
    const int64_t prepared = 8 * sh.Sv * c->n_kv_heads * c->head_dim + 8 * sh.R;
    /* the sources run in the solve: their attention's targets scratch grows there (the targets term
     * but the pool, which the prepare allocates) */
    const int64_t G = c->n_heads / c->n_kv_heads;
    const int64_t pool = kf_refq_targets_bytes(1, c->n_kv_heads, sh.R, c->head_dim, sh.T) +
                         kf_refq_targets_own_bytes(1, c->n_kv_heads, sh.Rv, c->head_dim, sh.R / G);
    CU_ASSERT_FATAL(sh.fused && t.targets > pool);
    const double want = (double)(t.solve + t.output - prepared + t.targets - pool), ratio = (double)g_peak / want;
    printf("\n    %d threads, %d tokens: solve peak %lld bytes, formula %.0f (ratio %.4f)", threads, n_doc,
           (long long)g_peak, want, ratio);
    CU_ASSERT(ratio > 0.98 && ratio < 1.02);
    kf_compacted_free(&out);
    kf_compact_prep_free(prep, NULL);
    kf_model_free(m);
    b->destroy(b);
}

/* The whole compaction (kf_compact: the prefill, the sources' forwards, the solve) on n_doc tokens
 * and `threads`: its heap peak against every term of the formula but the weights and the base,
 * which it does not allocate. */
static void compact_vs_formula(int threads, int n_doc) {
    kf_backend *b = NULL;
    kf_model *m = load_records(threads, &b);
    kf_error err = {0};
    kf_compact_params p = kf_compact_params_default();
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    const kf_prompt doc = {g_doc, n_doc};
    kf_compacted out;
    g_live = 0;
    g_peak = 0;
    g_aligned = g_on = 1;
    CU_ASSERT_EQUAL_FATAL(kf_compact(m, NULL, &doc, NULL, &p, &out, &err), KF_OK);
    g_aligned = g_on = 0;
    kf_mem_shape sh;
    kf_mem_peak t;
    kf_compact_mem_shape(kf_model_config(m), &p, 0, n_doc, 0, threads, &sh);
    sh.weights_bf16 = kf_model_weight_dtype(m) == KF_DTYPE_BF16;
    kf_compact_peak_bytes(kf_model_config(m), &sh, &t);
    const double want = (double)(t.total - t.weights - t.base), ratio = (double)g_peak / want;
    printf("\n    %d threads, %d tokens: compaction's heap peak %lld bytes, formula %.0f (ratio %.4f)", threads,
           n_doc, (long long)g_peak, want, ratio);
    CU_ASSERT(ratio > 0.98 && ratio < 1.02);
    kf_compacted_free(&out);
    kf_model_free(m);
    b->destroy(b);
}

static void test_compact_heap(void) {
    compact_vs_formula(1, 1024);
    compact_vs_formula(3, 1024);
    printf("\n");
}

static void test_solve_heap(void) {
    solve_vs_formula(1, 1024);
    solve_vs_formula(3, 1024);
    solve_vs_formula(1, 3000);
    solve_vs_formula(3, 3000);
    printf("\n");
}

static CU_TestInfo tests[] = {
    {"the solve's heap peak == the formula's solve + output terms (1 and 3 threads)", test_solve_heap},
    {"the whole compaction's heap peak == the formula less weights and base", test_compact_heap},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"the memory formula's solve term on records-qwen3", init_doc, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
