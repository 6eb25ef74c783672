/* gemm_bf16.c — y = x w^T with bf16 weights on the CPU, by widening tiles.
 *
 * OpenBLAS as Debian builds it has no bf16 GEMM (no cblas_sbgemm), and sbgemm would round the
 * activations to bf16 too. Here a tile of weight rows is widened to fp32 (on every thread of the
 * backend's pool: it is memory-bound) into a scratch that every call reuses, and that tile goes
 * through the fp32 GEMM (matmul.c: the same bits for any thread count). Tiles begin at multiples
 * of matmul.c's column group and bf16 -> fp32 is exact, so each output has the bits of the fp32
 * GEMM on the same (widened) weights: only the weights are bf16 (as a bf16 checkpoint stores
 * them), never the activations. A tile of about 4 MB for a chunk's rows: OpenBLAS packs the
 * activations again for each call, so fewer, wider tiles cost less (measured at M = 512, K = 1024:
 * 256-row tiles 0.85 of fp32's speed with two threads, 1024-row ones 0.93, the whole matrix 0.95);
 * 1 MB for a few rows (M = 1: 256-row tiles 1.14 of fp32's speed, 1024-row ones 0.73, once the
 * tile leaves the cache).
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/pool.h"

/* One part of a tile's widening: part i of `parts` of n values. */
typedef struct {
    float *dst;
    const uint16_t *src;
    size_t n;
    int parts;
} widen_job;

static void widen_part(void *ctx, int item, int thread) {
    (void)thread;
    const widen_job *j = ctx;
    const size_t lo = j->n * (size_t)item / (size_t)j->parts, hi = j->n * (size_t)(item + 1) / (size_t)j->parts;
    kf_bf16_to_f32_n(j->dst + lo, j->src + lo, hi - lo);
}

int kf_cpu_matmul_bf16(kf_cpu_widen *s, kf_cpu_mm_scratch *mm, float *y, size_t ldy, const float *x, size_t ldx, const uint16_t *w, int M,
                       int N, int K, int accumulate) {
    const int rows = kf_cpu_widen_rows(M, N, K);
    if (kf_cpu_grow((void **)&s->buf, &s->cap, (size_t)rows * K, sizeof(float)) != 0)
        return -1;
    for (int n0 = 0; n0 < N; n0 += rows) {
        const int nt = N - n0 < rows ? N - n0 : rows;
        widen_job j = {.dst = s->buf, .src = w + (size_t)n0 * K, .n = (size_t)nt * K}; /* [nt, K] */
        j.parts = j.n < 65536 ? 1 : kf_pool_threads(s->pool); /* widening is memory-bound: every core */
        kf_pool_run(s->pool, j.parts, widen_part, &j);
        if (kf_cpu_matmul_pool(mm, y + n0, ldy, x, ldx, s->buf, M, nt, K, accumulate) != 0)
            return -1;
    }
    return 0;
}

/* Rows of a bf16 table (the embeddings) widened into out. */
void kf_cpu_embed_bf16(float *out, const uint16_t *table, const int32_t *ids, int n, int width) {
    for (int r = 0; r < n; r++)
        kf_bf16_to_f32_n(out + (size_t)r * width, table + (size_t)ids[r] * width, (size_t)width);
}

/* n host values of dtype src into bf16 storage: bf16 copied, fp32 and f16 rounded (nearest even;
 * f16 through fp32, which holds it exactly). src may be unaligned (a checkpoint's bytes). */
void kf_cpu_to_bf16(uint16_t *dst, const void *src, kf_dtype dt, size_t n) {
    if (dt == KF_DTYPE_BF16) {
        memcpy(dst, src, n * sizeof(uint16_t));
        return;
    }
    const size_t esz = kf_dtype_size(dt);
    float tmp[1024]; /* aligned fp32 staging */
    for (size_t i = 0; i < n; i += 1024) {
        const size_t k = n - i < 1024 ? n - i : 1024;
        kf_convert_to_f32(tmp, (const unsigned char *)src + i * esz, dt, k);
        kf_f32_to_bf16_n(dst + i, tmp, k);
    }
}

void kf_cpu_widen_free(kf_cpu_widen *s) {
    free(s->buf);
    s->buf = NULL;
    s->cap = 0;
}
