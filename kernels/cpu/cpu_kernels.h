/* cpu_kernels.h — the CPU reference kernels behind the CPU backend.
 *
 * Plain functions on fp32 host buffers, usable directly as the reference that every other
 * backend is tested against. Strides are in elements. The functions here run on the calling
 * thread (attention also on a kf_pool when its scratch has one); the CPU backend spreads the
 * row kernels over its pool (kernels/cpu/pool.h) by ranges of rows, which changes no result.
 * GEMMs go to OpenBLAS held to one thread, in calls shaped so that no result depends on the
 * thread count (matmul.c, attention.c).
 */
#ifndef KF_CPU_KERNELS_H
#define KF_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/base/convert.h"

/* The row kernels' loops are built three times on x86-64 with GCC (AVX-512, AVX2, baseline
 * SSE2) and the loader picks the one the CPU runs (an ifunc): the portable build stays portable
 * and a softmax row runs 16 floats wide where the machine allows. Only the vector width
 * changes, so the results are those of the baseline up to the order of the reductions. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KF_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KF_ROW_CLONES
#endif

/* dtype conversions: kernels/base/convert.h */
/* n values, aligned: bf16 widened to fp32 (exact), fp32 rounded to bf16 (nearest even) */
void kf_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n);
void kf_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n);

typedef struct kf_pool kf_pool;

/* Scratch of kf_cpu_matmul_pool, reused between calls (one per thread of control). */
typedef struct {
    float *tail;     /* the rows past the last whole row group, padded (matmul.c) */
    size_t tail_cap; /* floats */
    kf_pool *pool;   /* NULL: one thread; else the column parts run on it (not owned) */
} kf_cpu_mm_scratch;

/* y [M, ldy] = x [M, ldx] w^T (+ y when accumulate), w [N, K] row-major, on OpenBLAS held to one
 * thread (the pool's threads share the columns): each row's result has the same bits for any
 * thread count and whatever rows share its call. 0, or -1 when out of memory (y unchanged). */
int kf_cpu_matmul_pool(kf_cpu_mm_scratch *scratch, float *y, size_t ldy, const float *x, size_t ldx, const float *w,
                       int M, int N, int K, int accumulate);
void kf_cpu_mm_scratch_free(kf_cpu_mm_scratch *scratch);
/* The same on the calling thread, with scratch of its own. */
int kf_cpu_matmul(float *y, size_t ldy, const float *x, size_t ldx, const float *w, int M, int N, int K,
                  int accumulate);


/* bf16 weights (kernels/cpu/gemm_bf16.c). kf_cpu_matmul_bf16 is kf_cpu_matmul_pool on w widened to
 * fp32 a tile of kf_cpu_widen_rows(M, N, K) rows at a time into the scratch (at most
 * KF_WIDEN_ELEMS + KF_WIDEN_ROWS K floats), the tile widened on the pool's threads; 0, or -1 when
 * the scratch could not be had. A tile of about 4 MB for M >= KF_WIDEN_M (fewer calls: OpenBLAS
 * packs the activations again for each), 1 MB below (a few rows: the tile must stay in the cache,
 * the widening is most of the work). */
#define KF_WIDEN_ROWS 16         /* rows of a tile, at least */
#define KF_WIDEN_ELEMS (1 << 20) /* floats of a tile, about, for M >= KF_WIDEN_M; a quarter below */
#define KF_WIDEN_M 64
typedef struct {
    float *buf;     /* [rows, K] one tile of widened weight rows */
    size_t cap;     /* floats */
    kf_pool *pool; /* NULL: widened on the calling thread; else on the pool (not owned) */
} kf_cpu_widen;
static inline int kf_cpu_widen_rows(int M, int N, int K) {
    const int elems = M >= KF_WIDEN_M ? KF_WIDEN_ELEMS : KF_WIDEN_ELEMS / 4;
    /* a multiple of KF_WIDEN_ROWS, so that each tile's column parts begin where the fp32 GEMM's
     * would (matmul.c): the same bits as fp32 weights */
    const int rows = elems / K > KF_WIDEN_ROWS ? elems / K / KF_WIDEN_ROWS * KF_WIDEN_ROWS : KF_WIDEN_ROWS;
    return N < rows ? N : rows;
}
int kf_cpu_matmul_bf16(kf_cpu_widen *s, kf_cpu_mm_scratch *mm, float *y, size_t ldy, const float *x, size_t ldx, const uint16_t *w, int M,
                       int N, int K, int accumulate);
void kf_cpu_embed_bf16(float *out, const uint16_t *table, const int32_t *ids, int n, int width);
void kf_cpu_to_bf16(uint16_t *dst, const void *src, kf_dtype dt, size_t n);
void kf_cpu_widen_free(kf_cpu_widen *s);
void kf_cpu_rmsnorm(float *y, size_t ldy, const float *x, size_t ldx, const float *w, int rows, int n, float eps);
void kf_cpu_rope(float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim, const int64_t *positions,
                 const double *inv_freq);
/* x[0..n) <- softmax(x) in place. Optionally returns the row max and sum_j exp(x_j - max)
 * (accumulated in fp64): the row's log-sum-exp is max + log(sum). -inf entries get weight 0. */
void kf_cpu_softmax_row(float *x, int n, float *max_out, double *sum_out);
void kf_cpu_silu_mul(float *g, const float *u, int rows, int n);
void kf_cpu_add(float *y, const float *x, int rows, int n);
void kf_cpu_kv_store(const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n, const float *k,
                     const float *v);

/* *buf grows to n elements of elem bytes (capacity *cap in elements); 0, or -1 when out of memory. */
int kf_cpu_grow(void **buf, size_t *cap, size_t n, size_t elem);

/* Scratch memory the attention kernel reuses between calls (one per thread of control). */
typedef struct {
    float *work;         /* [threads, per-thread] each thread's query tile, key block and scores (64-byte aligned) */
    void *work_raw;      /* the allocation work lies in */
    size_t work_cap;     /* floats; independent of the number of keys (but for AM's targets) */
    int *tiles;          /* [tiles + 1] the tiles' first queries */
    size_t tiles_cap;
    double *part;        /* [items, block keys] per item score sums of AM's targets (kf_attn_targets) */
    size_t part_cap;
    uint8_t *has;        /* [items] 1: the item's part holds target rows */
    size_t has_cap;
    kf_pool *pool;       /* NULL: one thread; else the (KV head, tile) items run on it (not owned) */
} kf_cpu_attn_scratch;

/* Returns 0, or -1 when scratch memory could not be allocated. */
int kf_cpu_attention(kf_cpu_attn_scratch *scratch, const kf_attn_args *a);
/* One thread's share of work, in floats, for a tile of `rows` query rows (queries x heads of a
 * group, at most 512) and head_dim hd: its queries, output, one key block's logits, keys and
 * values, running max and sum; ld_blk > 0 (targets) adds the block's kept logits [rows + 8,
 * ld_blk], own (the rows' own prompts asked for too) the own keys' state kept aside [rows, hd + 3].
 * The memory formula counts it (compactor/compact.h, forward and targets). */
size_t kf_cpu_attn_tile_floats(int rows, int hd, int ld_blk, int own);
void kf_cpu_attn_scratch_free(kf_cpu_attn_scratch *scratch);


/* QUOKA selection scratch, reused between calls. */
typedef struct {
    double *mean;      /* [head_dim] */
    size_t mean_cap;
    uint32_t *keys;    /* [max(n_q, n_hist)] order keys of one row */
    size_t keys_cap;
    int32_t *kept;     /* [n_heads, n_keep] kept query positions */
    size_t kept_cap;
    float *qbar;       /* [kv_heads, n_keep, head_dim] pre-aggregated unit queries */
    size_t qbar_cap;
    float *score;      /* [kv_heads, n_hist] */
    size_t score_cap;
} kf_cpu_quoka_scratch;

/* Returns 0, or -1 when scratch memory could not be allocated or the arguments are invalid. */
int kf_cpu_quoka_select(kf_cpu_quoka_scratch *scratch, const kf_quoka_select_args *a);
void kf_cpu_quoka_scratch_free(kf_cpu_quoka_scratch *scratch);

/* Top-k by radix selection over order-preserving keys (no sort): the k-th largest of
 * keys[0 .. n-1] (1 <= k <= n); *take_eq = how many keys equal to it are in the top k. */
uint32_t kf_cpu_radix_select(const uint32_t *keys, int n, int k, int *take_eq);
/* Order-preserving map float -> uint32 (NaN sorts below -inf). */
uint32_t kf_cpu_order_key(float f);

/* Sparse attention scratch: the selected keys and values gathered into 16-token "pages". */
typedef struct {
    float *k, *v;      /* [n_sel + n_q, kv_heads, head_dim] */
    size_t kv_cap;
    float *bias;       /* [kv_heads, n_sel + n_q] */
    size_t bias_cap;
    int32_t *pages;    /* [ceil((n_sel + n_q) / 16)] identity page table */
    size_t pages_cap;
    kf_cpu_attn_scratch attn;
} kf_cpu_sparse_scratch;

/* Gathers the selected keys and runs kf_cpu_attention on them. Returns 0, or -1 when out of memory. */
int kf_cpu_sparse_attention(kf_cpu_sparse_scratch *scratch, const kf_sparse_attn_args *a);
void kf_cpu_sparse_scratch_free(kf_cpu_sparse_scratch *scratch);

#endif
