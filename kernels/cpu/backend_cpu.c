/* The CPU backend: host memory, fp32 weights, OpenBLAS GEMMs, OpenMP row kernels. */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

typedef struct {
    kf_cpu_attn_scratch attn;
    kf_cpu_quoka_scratch quoka;
    kf_cpu_sparse_scratch sparse;
    int attn_failed; /* sticky: set when attention could not get scratch memory */
} cpu_impl;

void kf_cpu_matmul(float *y, size_t ldy, const float *x, size_t ldx, const float *w, int M, int N, int K,
                   int accumulate) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, (int)ldx, w, K, accumulate ? 1.0f : 0.0f, y,
                (int)ldy);
}

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
    (void)b;
    kf_convert_to_f32(dst, src, dt, n);
}

static void cpu_matmul(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M, int N,
                       int K, int accumulate) {
    (void)b;
    kf_cpu_matmul(y, ldy, x, ldx, w, M, N, K, accumulate);
}

static void cpu_embed(kf_backend *b, float *out, const void *table, const int32_t *ids, int n, int width) {
    (void)b;
    const float *t = table;
    for (int r = 0; r < n; r++)
        memcpy(out + (size_t)r * width, t + (size_t)ids[r] * width, sizeof(float) * width);
}

static void cpu_rmsnorm(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int rows,
                        int n, float eps) {
    (void)b;
    kf_cpu_rmsnorm(y, ldy, x, ldx, w, rows, n, eps);
}

static void cpu_rope(kf_backend *b, float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                     const int64_t *positions, const double *inv_freq) {
    (void)b;
    kf_cpu_rope(x, tok_stride, n_tok, n_heads, head_dim, positions, inv_freq);
}

static void cpu_silu_mul(kf_backend *b, float *g, const float *u, int rows, int n) {
    (void)b;
    kf_cpu_silu_mul(g, u, rows, n);
}

static void cpu_add(kf_backend *b, float *y, const float *x, int rows, int n) {
    (void)b;
    kf_cpu_add(y, x, rows, n);
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

static int cpu_take_error(kf_backend *b) {
    cpu_impl *impl = b->impl;
    int e = impl->attn_failed;
    impl->attn_failed = 0;
    return e;
}

static void cpu_destroy(kf_backend *b) {
    cpu_impl *impl = b->impl;
    kf_cpu_attn_scratch_free(&impl->attn);
    kf_cpu_quoka_scratch_free(&impl->quoka);
    kf_cpu_sparse_scratch_free(&impl->sparse);
    free(impl);
    free(b);
}

kf_backend *kf_backend_cpu_create(void) {
    kf_backend *b = calloc(1, sizeof *b);
    cpu_impl *impl = calloc(1, sizeof *impl);
    if (!b || !impl) {
        free(b);
        free(impl);
        return NULL;
    }
    b->name = "cpu";
    b->weight_dtype = KF_DTYPE_F32;
    b->impl = impl;
    b->alloc = cpu_alloc;
    b->free = cpu_free;
    b->upload = cpu_memcpy;
    b->download = cpu_memcpy;
    b->copy = cpu_memcpy;
    b->upload_weight = cpu_upload_weight;
    b->matmul = cpu_matmul;
    b->embed = cpu_embed;
    b->rmsnorm = cpu_rmsnorm;
    b->rope = cpu_rope;
    b->silu_mul = cpu_silu_mul;
    b->add = cpu_add;
    b->kv_store = cpu_kv_store;
    b->attention = cpu_attention;
    b->quoka_select = cpu_quoka_select;
    b->sparse_attention = cpu_sparse_attention;
    b->take_error = cpu_take_error;
    b->destroy = cpu_destroy;
    return b;
}
