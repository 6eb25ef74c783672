/* The CPU backend: host memory, fp32 or bf16 weights (gemm_bf16.c), OpenBLAS GEMMs; GEMMs, row kernels and attention on
 * a small pthread pool of as many threads as OpenBLAS would use (OPENBLAS_NUM_THREADS, else the
 * cores), OpenBLAS itself held to one thread meanwhile, so that no result depends on the thread
 * count (matmul.c). The pool's workers sleep between jobs; parallel_for (the compactor's heads)
 * runs on the same pool. */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/solve_ops.h"

/* Row kernels run inline below this many elements: waking the workers costs more. */
#define PAR_MIN_ELEMS 16384

typedef struct {
    kf_pool *pool;
    kf_cpu_mm_scratch mm;
    kf_cpu_attn_scratch attn;
    kf_cpu_quoka_scratch quoka;
    kf_cpu_sparse_scratch sparse;
    kf_cpu_widen widen;  /* bf16 weights: the GEMMs' tile of widened rows */
    float *norm_w;       /* bf16 weights: [n] a norm's weight widened */
    size_t norm_cap;
    int attn_failed; /* sticky: set when an operation could not get scratch memory */
    int uploaded;    /* a weight was uploaded: the weight dtype is fixed from then on */
} cpu_impl;

static void *cpu_alloc(kf_backend *b, size_t bytes) {
    (void)b;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    return p;
}

static void cpu_free(kf_backend *b, void *p) {
    (void)b;
    free(p);
}

static void cpu_memcpy(kf_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    memcpy(dst, src, bytes);
}

static void cpu_upload_weight(kf_backend *b, void *dst, const void *src, kf_dtype dt, size_t n) {
    ((cpu_impl *)b->impl)->uploaded = 1;
    if (b->weight_dtype == KF_DTYPE_BF16)
        kf_cpu_to_bf16(dst, src, dt, n);
    else
        kf_convert_to_f32(dst, src, dt, n);
}

static int cpu_set_weight_dtype(kf_backend *b, kf_dtype dt) {
    const cpu_impl *impl = b->impl;
    if ((dt != KF_DTYPE_F32 && dt != KF_DTYPE_BF16) || (dt != b->weight_dtype && impl->uploaded))
        return -1; /* weights already held in the other dtype would be misread */
    b->weight_dtype = dt;
    return 0;
}

static void cpu_matmul(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M, int N,
                       int K, int accumulate) {
    cpu_impl *impl = b->impl;
    const int rc = b->weight_dtype == KF_DTYPE_BF16
                       ? kf_cpu_matmul_bf16(&impl->widen, &impl->mm, y, ldy, x, ldx, w, M, N, K, accumulate)
                       : kf_cpu_matmul_pool(&impl->mm, y, ldy, x, ldx, w, M, N, K, accumulate);
    if (rc != 0)
        impl->attn_failed = 1;
}

static void cpu_embed(kf_backend *b, float *out, const void *table, const int32_t *ids, int n, int width) {
    if (b->weight_dtype == KF_DTYPE_BF16) {
        kf_cpu_embed_bf16(out, table, ids, n, width);
        return;
    }
    const float *t = table;
    for (int r = 0; r < n; r++)
        memcpy(out + (size_t)r * width, t + (size_t)ids[r] * width, sizeof(float) * width);
}

/* A row kernel over row ranges: part i of `parts` handles rows [lo, hi). */
typedef struct {
    int op; /* 0 rmsnorm, 1 rope, 2 silu_mul, 3 add */
    int rows, parts;
    float *y;
    const float *x;
    size_t ldy, ldx;
    const float *w;
    int n, n_heads;
    float eps;
    const int64_t *positions;
    const double *inv_freq;
} rows_job;

static void rows_item(void *ctx, int item, int thread) {
    (void)thread;
    const rows_job *j = ctx;
    int lo, hi;
    kf_pool_range(j->rows, j->parts, item, &lo, &hi);
    if (lo >= hi)
        return;
    switch (j->op) {
    case 0: kf_cpu_rmsnorm(j->y + lo * j->ldy, j->ldy, j->x + lo * j->ldx, j->ldx, j->w, hi - lo, j->n, j->eps); break;
    case 1: kf_cpu_rope(j->y + lo * j->ldy, j->ldy, hi - lo, j->n_heads, j->n, j->positions + lo, j->inv_freq); break;
    case 2: kf_cpu_silu_mul(j->y + lo * j->ldy, j->x + lo * j->ldx, hi - lo, j->n); break;
    default: kf_cpu_add(j->y + lo * j->ldy, j->x + lo * j->ldx, hi - lo, j->n); break;
    }
}

/* Runs the job inline when small, else over the pool in up to 4 ranges per thread. */
static void rows_run(cpu_impl *impl, rows_job *j, size_t elems) {
    const int threads = kf_pool_threads(impl->pool);
    j->parts = elems < PAR_MIN_ELEMS || threads == 1 ? 1 : (j->rows < 4 * threads ? j->rows : 4 * threads);
    kf_pool_run(impl->pool, j->parts, rows_item, j);
}

static void cpu_rmsnorm(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int rows,
                        int n, float eps) {
    cpu_impl *impl = b->impl;
    if (b->weight_dtype == KF_DTYPE_BF16) { /* the weight widened once for every row */
        if (kf_cpu_grow((void **)&impl->norm_w, &impl->norm_cap, (size_t)n, sizeof(float)) != 0) {
            impl->attn_failed = 1;
            return;
        }
        kf_bf16_to_f32_n(impl->norm_w, w, (size_t)n);
        w = impl->norm_w;
    }
    rows_job j = {.op = 0, .rows = rows, .y = y, .x = x, .ldy = ldy, .ldx = ldx, .w = w, .n = n, .eps = eps};
    rows_run(b->impl, &j, (size_t)rows * n);
}

static void cpu_rope(kf_backend *b, float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                     const int64_t *positions, const double *inv_freq) {
    rows_job j = {.op = 1, .rows = n_tok, .y = x, .ldy = tok_stride, .n = head_dim, .n_heads = n_heads,
                  .positions = positions, .inv_freq = inv_freq};
    rows_run(b->impl, &j, (size_t)n_tok * n_heads * head_dim);
}

static void cpu_silu_mul(kf_backend *b, float *g, const float *u, int rows, int n) {
    rows_job j = {.op = 2, .rows = rows, .y = g, .x = u, .ldy = (size_t)n, .ldx = (size_t)n, .n = n};
    rows_run(b->impl, &j, (size_t)rows * n);
}

static void cpu_add(kf_backend *b, float *y, const float *x, int rows, int n) {
    rows_job j = {.op = 3, .rows = rows, .y = y, .x = x, .ldy = (size_t)n, .ldx = (size_t)n, .n = n};
    rows_run(b->impl, &j, (size_t)rows * n);
}

static void cpu_kv_store(kf_backend *b, const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n,
                         const float *k, const float *v) {
    (void)b;
    kf_cpu_kv_store(kv, pages, first_slot, n, k, v);
}

static void cpu_attention(kf_backend *b, const kf_attn_args *args) {
    cpu_impl *impl = b->impl;
    if (kf_cpu_attention(&impl->attn, args) != 0)
        impl->attn_failed = 1;
}

static void cpu_quoka_select(kf_backend *b, const kf_quoka_select_args *args) {
    cpu_impl *impl = b->impl;
    if (kf_cpu_quoka_select(&impl->quoka, args) != 0)
        impl->attn_failed = 1;
}

static void cpu_sparse_attention(kf_backend *b, const kf_sparse_attn_args *args) {
    cpu_impl *impl = b->impl;
    if (kf_cpu_sparse_attention(&impl->sparse, args) != 0)
        impl->attn_failed = 1;
}

/* Items on the pool, OpenBLAS on one thread meanwhile (backend.h's contract). */
static void cpu_parallel_for(kf_backend *b, int n_items, kf_parallel_fn fn, void *ctx) {
    cpu_impl *impl = b->impl;
    const int blas_threads = openblas_get_num_threads();
    if (blas_threads > 1)
        openblas_set_num_threads(1);
    kf_pool_run(impl->pool, n_items, fn, ctx);
    if (blas_threads > 1)
        openblas_set_num_threads(blas_threads);
}

static int cpu_take_error(kf_backend *b) {
    cpu_impl *impl = b->impl;
    int e = impl->attn_failed;
    impl->attn_failed = 0;
    return e;
}

static void cpu_destroy(kf_backend *b) {
    cpu_impl *impl = b->impl;
    kf_cpu_mm_scratch_free(&impl->mm);
    kf_cpu_attn_scratch_free(&impl->attn);
    kf_cpu_quoka_scratch_free(&impl->quoka);
    kf_cpu_sparse_scratch_free(&impl->sparse);
    kf_cpu_widen_free(&impl->widen);
    free(impl->norm_w);
    kf_pool_destroy(impl->pool);
    free(impl);
    free(b);
}

kf_backend *kf_backend_cpu_create(void) {
    return kf_backend_cpu_create_threads(0);
}

kf_backend *kf_backend_cpu_create_threads(int threads) {
    kf_backend *b = calloc(1, sizeof *b);
    cpu_impl *impl = calloc(1, sizeof *impl);
    if (!b || !impl) {
        free(b);
        free(impl);
        return NULL;
    }
    if (threads <= 0)
        threads = openblas_get_num_threads();
    impl->pool = kf_pool_create(threads > 0 ? threads : 1);
    if (!impl->pool) {
        free(b);
        free(impl);
        return NULL;
    }
    impl->mm.pool = impl->pool;
    impl->attn.pool = impl->pool;
    impl->sparse.attn.pool = impl->pool;
    impl->widen.pool = impl->pool;
    b->name = "cpu";
    b->weight_dtype = KF_DTYPE_F32;
    b->impl = impl;
    b->alloc = cpu_alloc;
    b->free = cpu_free;
    b->upload = cpu_memcpy;
    b->download = cpu_memcpy;
    b->copy = cpu_memcpy;
    b->upload_weight = cpu_upload_weight;
    b->set_weight_dtype = cpu_set_weight_dtype;
    b->matmul = cpu_matmul;
    b->embed = cpu_embed;
    b->rmsnorm = cpu_rmsnorm;
    b->rope = cpu_rope;
    b->silu_mul = cpu_silu_mul;
    b->add = cpu_add;
    b->kv_store = cpu_kv_store;
    b->attention = cpu_attention;
    b->attn_targets = 1;
    b->kv_bf16 = 1;
    b->quoka_select = cpu_quoka_select;
    b->sparse_attention = cpu_sparse_attention;
    kf_cpu_solve_ops_install(b);
    b->parallel_for = cpu_parallel_for;
    b->threads = kf_pool_threads(impl->pool);
    b->take_error = cpu_take_error;
    b->destroy = cpu_destroy;
    return b;
}
