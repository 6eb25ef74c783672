/* The CUDA backend: a kf_backend whose operations queue kernels (the .cu files beside this one) on one stream.
 * Operations never block, except download (the host needs the bytes) and take_error (which
 * synchronizes so that errors of queued kernels are seen, at most once per chunk of the forward). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/add.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/convert.cuh"
#include "kernels/cuda/embed.cuh"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/kv_store.cuh"
#include "kernels/cuda/quoka.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/silu_mul.cuh"

#define LT_WORKSPACE ((size_t)32 << 20)

void kf_cuda_fail(kf_cuda_ctx *c, const char *file, int line, const char *fmt, ...) {
    if (c->failed)
        return; /* the first failure explains the rest */
    c->failed = 1;
    const char *base = strrchr(file, '/');
    int n = snprintf(c->msg, sizeof c->msg, "%s:%d: ", base ? base + 1 : file, line);
    if (n < 0 || n >= (int)sizeof c->msg)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg + n, sizeof c->msg - (size_t)n, fmt, ap);
    va_end(ap);
    /* Library code does not print; this one line is the only way a CUDA failure inside a queued
     * operation reaches the user through callers that see just take_error() != 0. */
    fprintf(stderr, "kvfold cuda: %s\n", c->msg);
}

void *kf_cuda_scratch(kf_cuda_ctx *c, int slot, size_t bytes) {
    if (c->failed)
        return NULL;
    if (c->scr_bytes[slot] < bytes) {
        if (c->scr[slot])
            KF_CUDA_CHECK(c, cudaFree(c->scr[slot])); /* synchronizes: no queued kernel still reads it */
        c->scr[slot] = NULL;
        c->scr_bytes[slot] = 0;
        const size_t want = bytes + bytes / 4; /* headroom: chunks grow by a little each time */
        KF_CUDA_CHECK(c, cudaMalloc(&c->scr[slot], want));
        if (c->failed)
            return NULL;
        c->scr_bytes[slot] = want;
    }
    return c->scr[slot];
}

const void *kf_cuda_stage(kf_cuda_ctx *c, int slot, const void *host, size_t bytes) {
    void *d = kf_cuda_scratch(c, slot, bytes ? bytes : 4);
    if (!d)
        return NULL;
    if (bytes)
        KF_CUDA_CHECK(c, cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, c->stream));
    return c->failed ? NULL : d;
}

static kf_cuda_ctx *ctx(kf_backend *b) { return (kf_cuda_ctx *)b->impl; }

static void *cu_alloc(kf_backend *b, size_t bytes) {
    (void)b;
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 64) != cudaSuccess) {
        (void)cudaGetLastError(); /* an allocation failure is reported by the NULL, not sticky */
        return NULL;
    }
    return p;
}

static void cu_free(kf_backend *b, void *p) {
    if (p)
        KF_CUDA_CHECK(ctx(b), cudaFree(p));
}

static void cu_upload(kf_backend *b, void *dst, const void *src, size_t bytes) {
    KF_CUDA_CHECK(ctx(b), cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx(b)->stream));
}

static void cu_download(kf_backend *b, void *dst, const void *src, size_t bytes) {
    KF_CUDA_CHECK(ctx(b), cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx(b)->stream));
    KF_CUDA_CHECK(ctx(b), cudaStreamSynchronize(ctx(b)->stream));
}

static void cu_copy(kf_backend *b, void *dst, const void *src, size_t bytes) {
    KF_CUDA_CHECK(ctx(b), cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx(b)->stream));
}

static void cu_upload_weight(kf_backend *b, void *dst, const void *src, kf_dtype dt, size_t n) {
    kf_cuda_upload_bf16(ctx(b), (__nv_bfloat16 *)dst, src, dt, n);
}

static void cu_matmul(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M, int N,
                      int K, int accumulate) {
    kf_cuda_gemm(ctx(b), y, ldy, x, ldx, (const __nv_bfloat16 *)w, M, N, K, accumulate);
}

static void cu_embed(kf_backend *b, float *out, const void *table, const int32_t *ids, int n, int width) {
    kf_cuda_embed(ctx(b), out, (const __nv_bfloat16 *)table, ids, n, width);
}

static void cu_rmsnorm(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int rows, int n,
                       float eps) {
    kf_cuda_rmsnorm(ctx(b), y, ldy, x, ldx, (const __nv_bfloat16 *)w, rows, n, eps);
}

static void cu_rope(kf_backend *b, float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                    const int64_t *positions, const double *inv_freq) {
    kf_cuda_rope(ctx(b), x, tok_stride, n_tok, n_heads, head_dim, positions, inv_freq);
}

static void cu_silu_mul(kf_backend *b, float *g, const float *u, int rows, int n) {
    kf_cuda_silu_mul(ctx(b), g, u, rows, n);
}

static void cu_add(kf_backend *b, float *y, const float *x, int rows, int n) { kf_cuda_add(ctx(b), y, x, rows, n); }

static void cu_kv_store(kf_backend *b, const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n,
                        const float *k, const float *v) {
    kf_cuda_kv_store(ctx(b), kv, pages, first_slot, n, k, v);
}

static void cu_attention(kf_backend *b, const kf_attn_args *a) { kf_cuda_attention(ctx(b), a); }

static void cu_quoka_select(kf_backend *b, const kf_quoka_select_args *a) { kf_cuda_quoka_select(ctx(b), a); }

static void cu_sparse_attention(kf_backend *b, const kf_sparse_attn_args *a) { kf_cuda_sparse_attention(ctx(b), a); }

static int cu_take_error(kf_backend *b) {
    kf_cuda_ctx *c = ctx(b);
    KF_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));
    const int e = c->failed;
    c->failed = 0;
    return e;
}

static void ctx_release(kf_cuda_ctx *c) {
    for (int i = 0; i < KF_CUDA_N_SCR; i++)
        if (c->scr[i])
            cudaFree(c->scr[i]);
    if (c->lt_ws)
        cudaFree(c->lt_ws);
    if (c->lt)
        cublasLtDestroy(c->lt);
    if (c->stream)
        cudaStreamDestroy(c->stream);
}

static void cu_destroy(kf_backend *b) {
    kf_cuda_ctx *c = ctx(b);
    cudaStreamSynchronize(c->stream);
    ctx_release(c);
    free(c);
    free(b);
}

extern "C" int kf_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" const char *kf_backend_cuda_message(kf_backend *b) { return ctx(b)->msg; }

static kf_backend *create_fail(kf_error *err, kf_status code, const char *what, cudaError_t e) {
    if (err) {
        err->code = code;
        snprintf(err->msg, sizeof err->msg, "cuda backend: %s%s%s", what, e != cudaSuccess ? ": " : "",
                 e != cudaSuccess ? cudaGetErrorString(e) : "");
    }
    return NULL;
}

extern "C" kf_backend *kf_backend_cuda_create(int device, kf_error *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return create_fail(err, KF_ERR_NOTFOUND, "no CUDA device", e);
    }
    if (device < 0 || device >= n)
        return create_fail(err, KF_ERR_NOTFOUND, "no such CUDA device", cudaSuccess);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return create_fail(err, KF_ERR_UNSUPPORTED, "cudaSetDevice", e);
    kf_backend *b = (kf_backend *)calloc(1, sizeof *b);
    kf_cuda_ctx *c = (kf_cuda_ctx *)calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return create_fail(err, KF_ERR_NOMEM, "out of memory", cudaSuccess);
    }
    c->device = device;
    const char *what = NULL;
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess)
        what = "cudaStreamCreate";
    else if ((e = cudaMalloc(&c->lt_ws, LT_WORKSPACE)) != cudaSuccess)
        what = "cudaMalloc (cuBLASLt workspace)";
    else if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS)
        what = "cublasLtCreate";
    if (what) {
        ctx_release(c);
        free(c);
        free(b);
        return create_fail(err, KF_ERR_UNSUPPORTED, what, e);
    }
    c->lt_ws_bytes = LT_WORKSPACE;
    b->name = "cuda";
    b->weight_dtype = KF_DTYPE_BF16;
    b->impl = c;
    b->alloc = cu_alloc;
    b->free = cu_free;
    b->upload = cu_upload;
    b->download = cu_download;
    b->copy = cu_copy;
    b->upload_weight = cu_upload_weight;
    b->matmul = cu_matmul;
    b->embed = cu_embed;
    b->rmsnorm = cu_rmsnorm;
    b->rope = cu_rope;
    b->silu_mul = cu_silu_mul;
    b->add = cu_add;
    b->kv_store = cu_kv_store;
    b->attention = cu_attention;
    b->quoka_select = cu_quoka_select;
    b->sparse_attention = cu_sparse_attention;
    b->take_error = cu_take_error;
    b->destroy = cu_destroy;
    return b;
}
