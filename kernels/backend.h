/* backend.h — the compute backend interface: math on raw pointers with explicit strides.
 *
 * A backend owns memory (host for the CPU backend, device for CUDA) and implements the
 * operations the forward pass needs. It knows nothing of models, files or configs: every
 * operation takes pointers, sizes and strides (in elements, not bytes).
 *
 * Conventions
 *   - Index arrays (ids, positions, page tables) and inv_freq are host memory; the backend
 *     copies them where it needs them. Everything else is backend memory.
 *   - Activations are fp32 on the CPU backend. Weights are stored in the backend's
 *     weight dtype (kf_backend.weight_dtype), which a backend with set_weight_dtype lets its
 *     model choose before the first weight is uploaded. The CPU backend stores fp32 (4 bytes
 *     per parameter; every GEMM a plain cblas_sgemm) or bf16 (2 bytes: the GEMMs widen the
 *     weights to fp32 a tile at a time, the activations stay fp32; norms and embeddings are
 *     widened likewise). CUDA stores bf16 only.
 *   - Linear layers follow Hugging Face: W is [out, in] row-major and y = x W^T.
 *   - Paged KV: keys/values live in pages of KF_PAGE_TOKENS tokens. Within a page a
 *     layer's K (and V) block is token-major [KF_PAGE_TOKENS, kv_heads, head_dim];
 *     kf_paged_kv gives the base of page 0's block for one layer and the page stride.
 */
#ifndef KF_BACKEND_H
#define KF_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/base/dtype.h"
#include "kernels/workspace.h"

#define KF_PAGE_TOKENS 16
#define KF_MAX_HEAD_DIM 1024 /* kernels keep per-token scratch of this size on the stack */

/* RoPE frequencies: the three rope types of Llama/Qwen checkpoints. */
typedef enum { KF_ROPE_DEFAULT = 0, KF_ROPE_LINEAR = 1, KF_ROPE_LLAMA3 = 2 } kf_rope_kind;

typedef struct {
    kf_rope_kind kind;
    double theta;
    double factor;            /* linear, llama3 */
    double low_freq_factor;   /* llama3 */
    double high_freq_factor;  /* llama3 */
    double original_max_pos;  /* llama3 */
} kf_rope_spec;

/* inv_freq[i] for i < head_dim/2, as transformers computes it (in double here). */
void kf_rope_inv_freq(const kf_rope_spec *spec, int head_dim, double *inv_freq /* [head_dim/2] */);

/* One layer's view of the paged KV pool. Element (page p, slot s, head h, dim d) of K is
 * k[p * page_stride + s * kv_heads * head_dim + h * head_dim + d] in elements of dtype; the same
 * for V. dtype is KF_DTYPE_F32 (0: float, every backend) or KF_DTYPE_BF16 (uint16_t bf16 bits;
 * only where kf_backend.kv_bf16 is set, the CPU): kv_store rounds fp32 to bf16 (nearest even),
 * attention and quoka_select widen the pool's bf16 back to fp32 key block by key block. */
typedef struct {
    void *k;            /* float (F32) or uint16_t (BF16) */
    void *v;
    size_t page_stride; /* elements of dtype */
    int kv_heads;
    int head_dim;
    kf_dtype dtype;     /* KF_DTYPE_F32 or KF_DTYPE_BF16 */
} kf_paged_kv;

/* Causal GQA attention of one chunk of queries over paged keys.
 *
 * Keys 0 .. n_keys-1 are those of the page table in order (key j in page pages[j / 16],
 * slot j % 16). Query i (0 <= i < n_q) sees keys 0 .. n_past + i, where n_past = n_keys - n_q
 * (the chunk's own keys are the last n_q). Query head h reads KV head h / (n_heads / kv_heads).
 * scores = scale * q.k + bias[kv_head, j] (bias optional; NULL means 0, keys j >= bias_len get 0).
 */
typedef struct {
    const float *q;          /* [n_q, n_heads, head_dim], token stride q_stride */
    size_t q_stride;
    float *out;              /* [n_q, n_heads, head_dim], token stride out_stride */
    size_t out_stride;
    int n_q;
    int n_heads;
    int n_keys;
    const int32_t *pages;    /* [ceil(n_keys / 16)] */
    kf_paged_kv kv;
    float scale;
    const float *bias;       /* [kv_heads, bias_stride] or NULL */
    size_t bias_stride;
    int bias_len;
    const struct kf_attn_targets *targets; /* NULL; else also AM's targets of some rows (below) */
} kf_attn_args;

/* AM's targets of a key block (compactor/am.h), emitted by `attention` for some query rows
 * (only where kf_backend.attn_targets is set; a caller of another backend computes them itself).
 *
 * The block is keys [blk0, blk1), entirely before the chunk: 0 <= blk0 < blk1 <= n_keys - n_q, so
 * every query sees all of it; bias must be NULL. For target row k (0 <= k < n_rows), query
 * i = rows[k] - row_base of the chunk (0 <= i < n_q; rows ascending), and each query head h:
 *   z_j = scale * q.k_j for the block's keys j (no bias); m = max_j z_j (fp32);
 *   y = sum_j exp(z_j - m) (summed in fp64, stored as fp32); Y = sum_j exp(z_j - m) v_j / y [head_dim];
 *   p_j = exp(z_j - m) / y, and score[g, j - blk0] += p_j (score_rms: p_j^2) in fp64, g = h's KV head.
 * m of (k, h) goes to m[k * row_stride + h * head_stride], y likewise, Y to
 * Y[(k * row_stride + h * head_stride) * head_dim ...] (head_dim floats). The score is summed over
 * the call's rows in an order fixed by the arguments (never by the thread count), added to what
 * score holds. The attention output itself is unchanged but for the order of its sums. */
typedef struct kf_attn_targets {
    int blk0, blk1;
    const int32_t *rows;     /* [n_rows] ascending */
    int n_rows;
    int row_base;
    float *m, *y;            /* element (k, h) at k * row_stride + h * head_stride */
    float *Y;                /* row (k, h) at (k * row_stride + h * head_stride) * head_dim */
    size_t row_stride, head_stride;
    double *score;           /* [kv_heads, score_stride] */
    size_t score_stride;
    int score_rms;           /* 1: sum of p^2 (AM's RMS score), 0: sum of p (mean) */
    /* Also, where app0 > 0, some target rows' attention over the call's own prompt, keys [app0, the
     * row's own position] (blk1 <= app0 <= n_keys - n_q: the prompt starts before the chunk): for
     * target row k with app_slot[k] >= 0 and each query head h, its m, y and Y over those keys
     * (defined as above) go to am, ay and aY at app_slot[k] * row_stride + h * app_head_stride
     * (aY: times head_dim). The rows' own keys are then attended first, the block second, which
     * moves the output by the order of its sums: a caller that wants the same output with and
     * without slots passes app0 either way (app_slot NULL: none). */
    int app0;
    const int32_t *app_slot; /* [n_rows] or NULL */
    float *am, *ay, *aY;
    size_t app_head_stride;
} kf_attn_targets;

/* QUOKA key selection (arXiv 2602.08722, Algorithm 1) for one chunk of queries over a paged
 * history: keys 0 .. n_hist-1 of the page table.
 *   1. per query head: mean m of the chunk's raw queries; keep the n_keep queries least
 *      cosine-similar to m, ordered by rank (most dissimilar first, ties: lower position first);
 *      when n_q <= n_keep every query is kept, in position order;
 *   2. normalize them and average rank by rank over the query heads of a KV head
 *      (pre-aggregation): qbar[g, j] = mean over h in group g of q[h, kept[h, j]] / |.|;
 *   3. score[g, t] = max_j qbar[g, j] . k[g, t] / |k[g, t]|   (cosine, max over kept queries);
 *   4. keep, per KV head, the history keys [win_lo, win_hi) (a forced window, on top of the
 *      budget) and the `budget` best-scoring other keys, keys t < n_sink first (they score +inf).
 *      Ties break towards the lower key index, so the set is deterministic.
 * out_idx receives, per KV head, kf_quoka_n_selected(...) key indices in ascending order.
 * out_idx and scores are backend memory. */
typedef struct {
    const float *q;          /* [n_q, n_heads, head_dim], token stride q_stride */
    size_t q_stride;
    int n_q;
    int n_heads;
    int n_hist;              /* candidate keys: 0 .. n_hist-1 */
    const int32_t *pages;    /* [ceil(n_hist / 16)] */
    kf_paged_kv kv;
    int n_keep;              /* N_Q: queries kept per query head */
    int budget;              /* keys chosen by score per KV head, 1 <= budget */
    int n_sink;              /* keys 0 .. n_sink-1 win the score ranking (attention sinks); 0 = off */
    int win_lo, win_hi;      /* history keys always kept besides the budget; win_lo >= win_hi: none */
    int32_t *out_idx;        /* [kv_heads, idx_stride] */
    size_t idx_stride;
    float *scores;           /* NULL or [kv_heads, n_hist]: the cosine scores of step 3 (diagnostics) */
} kf_quoka_select_args;

/* Keys per KV head that kf_quoka_select_args selects: the window plus min(budget, the rest). */
static inline int kf_quoka_n_selected(int n_hist, int budget, int win_lo, int win_hi) {
    const int lo = win_lo < 0 ? 0 : win_lo, hi = win_hi > n_hist ? n_hist : win_hi;
    const int w = hi > lo ? hi - lo : 0, rest = n_hist - w;
    return w + (budget < rest ? budget : rest);
}

/* Attention of one chunk over a per-KV-head subset of the history plus the chunk's own keys.
 * attn is read as for `attention` (n_keys = n_hist + n_q, the chunk's keys are the last n_q),
 * except that query head h (KV head g = h / (n_heads / kv_heads)) sees only history keys
 * hist_idx[g, 0 .. n_sel-1] (each < n_hist) and, causally, chunk keys n_hist .. n_hist + i.
 * A bias, when given, applies to each key by its original index. With every history key
 * selected in ascending order the result equals `attention` bit for bit. hist_idx is backend
 * memory. */
typedef struct {
    kf_attn_args attn;
    const int32_t *hist_idx; /* [kv_heads, idx_stride] */
    size_t idx_stride;
    int n_sel;
} kf_sparse_attn_args;

typedef struct kf_backend kf_backend;

/* ---- The solve's operations (the compactor's per-head math: compactor/am.c, diag.c, fold.c) ----
 *
 * Memory: HOST memory on every backend (the solve's buffers are malloc'd; nothing here is
 * uploaded). A backend sets these operations only when it can run them on host memory, and then
 * all of them; the CPU backend does, the CUDA backend leaves them all NULL. Which backend runs
 * them is decided in ONE place, kf_solve_backend() below: the model's backend when it has them,
 * else the CPU's stateless solve ops (kf_backend_cpu_solve()). A model loaded on CUDA therefore
 * solves on the CPU, as before; a device implementation would set them and take host pointers.
 *
 * Threads: unlike the forward pass's operations, these are reentrant: parallel_for items call
 * them concurrently (no shared scratch, no state). Inside a CPU parallel_for the BLAS underneath
 * runs on one thread per item (parallel_for's contract); outside it on OpenBLAS's threads.
 *
 * Layout: row-major, fp32 or fp64 as named (s..., d...), strides in elements (ld >= the row's
 * width). The BLAS-shaped ones mean what their BLAS namesakes mean in row-major order (CBLAS);
 * the CPU backend makes exactly that BLAS call, so that results are those of a direct call, bit
 * for bit. Status: the operations that can fail return an int (0 = success) and never print. */
typedef enum { KF_NO_TRANS = 0, KF_TRANS = 1 } kf_trans;

/* kf_backend.lstsq's return values (which path the solve took, so callers count fallbacks). */
typedef enum {
    KF_LSTSQ_QR = 0,     /* Householder QR (LAPACK gels): the normal path */
    KF_LSTSQ_RIDGE = 1,  /* QR failed, or gave non-finite or absurd (|x| > 1e4 max|b|) values:
                            fp64 normal equations + tiny ridge */
    KF_LSTSQ_FAILED = 2, /* even the ridge solve failed (X is left zero) */
} kf_lstsq_path;

/* Row softmax over rows of x [rows, n] (row stride ldx), fp32, in place. Row i:
 *   x_ij += bias[j] for j < n (fp32 add; bias NULL: none), then over its first len_i entries
 *   (len_i = len ? len[i] : n, 1 <= len_i <= n) x_ij = exp(x_ij - max_i) / sum_i with
 *   max_i = max_j x_ij and sum_i = sum_j exp(x_ij - max_i) (the exponentials rounded to fp32, summed
 *   in fp64 in index order); entries len_i .. n-1 are set to 0 (a causal cut). -inf gets weight 0.
 * Optional outputs per row (NULL: not written): max_out[i] = max_i (fp32), sum_out[i] = sum_i,
 * lse_out[i] = max_i + log(sum_i) (the row's log-sum-exp over its len_i entries, fp64). */
typedef struct {
    float *x;          /* [rows, ldx] */
    size_t ldx;
    int rows, n;
    const float *bias; /* [n] or NULL */
    const int *len;    /* [rows] or NULL */
    float *max_out;    /* [rows] or NULL */
    double *sum_out;   /* [rows] or NULL */
    double *lse_out;   /* [rows] or NULL */
} kf_softmax_rows_args;

/* One item of a parallel_for: thread in [0, kf_backend_threads(b)) names the per-thread scratch
 * the item may use (0 is the calling thread). */
typedef void (*kf_parallel_fn)(void *ctx, int item, int thread);

struct kf_backend {
    const char *name;
    kf_dtype weight_dtype;
    void *impl;

    /* memory */
    void *(*alloc)(kf_backend *b, size_t bytes);               /* NULL on failure */
    void (*free)(kf_backend *b, void *p);
    void (*upload)(kf_backend *b, void *dst, const void *host_src, size_t bytes);
    void (*download)(kf_backend *b, void *host_dst, const void *src, size_t bytes);
    void (*copy)(kf_backend *b, void *dst, const void *src, size_t bytes);
    /* Convert n host values of dtype src_dtype into backend weight storage at dst. */
    void (*upload_weight)(kf_backend *b, void *dst, const void *host_src, kf_dtype src_dtype, size_t n);
    /* Sets weight_dtype, the storage of every weight the operations below read: 0, or nonzero when
     * the backend cannot store dt, or (CPU) already holds weights of the other dtype (then
     * unchanged). NULL: weight_dtype is fixed. */
    int (*set_weight_dtype)(kf_backend *b, kf_dtype dt);

    /* y[M, N] = x[M, K] (row stride ldx) . w[N, K]^T  (+ y if accumulate). The CPU backend gives
     * each row the same bits whatever rows share the call and whatever the thread count. */
    void (*matmul)(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M, int N,
                   int K, int accumulate);
    /* out[r, :] = table[ids[r], :]   table [rows, width] in weight storage */
    void (*embed)(kf_backend *b, float *out, const void *table, const int32_t *ids, int n, int width);
    /* y[r, :] = x[r, :] / rms(x[r, :]) * w     rows of width n, strides in elements; y may be x */
    void (*rmsnorm)(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int rows, int n,
                    float eps);
    /* NeoX rotate-half RoPE in place on x[t, head, :] for t < n_tok, head < n_heads;
     * positions[t] is the absolute position of token t. */
    void (*rope)(kf_backend *b, float *x, size_t tok_stride, int n_tok, int n_heads, int head_dim,
                 const int64_t *positions, const double *inv_freq);
    /* g[r, i] = silu(g[r, i]) * u[r, i] */
    void (*silu_mul)(kf_backend *b, float *g, const float *u, int rows, int n);
    /* y[r, i] += x[r, i] */
    void (*add)(kf_backend *b, float *y, const float *x, int rows, int n);
    /* write n tokens of k/v ([n, kv_heads, head_dim], contiguous) into the pool at slots
     * first_slot .. first_slot+n-1 of the page table */
    void (*kv_store)(kf_backend *b, const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n,
                     const float *k, const float *v);
    int kv_bf16; /* nonzero: kv_store, attention, quoka_select and sparse_attention take a bf16 pool
                    (kf_paged_kv.dtype); 0 (CUDA): fp32 pools only, a bf16 arena is refused */
    void (*attention)(kf_backend *b, const kf_attn_args *args);
    int attn_targets; /* nonzero: attention fills args->targets; 0 (CUDA): it must be NULL */
    void (*quoka_select)(kf_backend *b, const kf_quoka_select_args *args);
    void (*sparse_attention)(kf_backend *b, const kf_sparse_attn_args *args);

    /* Host work that is none of the operations above (the compactor's solve over KV heads):
     * fn(ctx, i, thread) for every i in [0, n_items), in any order, on up to `threads` threads;
     * returns when all have finished. The contract:
     *   - items are independent: each writes its own memory (per-thread scratch by `thread`, its
     *     own output slots), so the results cannot depend on the order or the thread count; what
     *     must be summed in order the caller merges after the job, in item order;
     *   - jobs never overlap: one thread of control calls parallel_for at a time, and an item
     *     calls neither parallel_for nor any other operation of this backend except the solve's
     *     operations (reentrant, host memory);
     *   - the CPU backend runs the items on its pool with OpenBLAS held to one thread for the
     *     duration (restored after), so that the items' own BLAS calls run side by side instead
     *     of queueing for OpenBLAS's threads; it does so for any pool size, so that every BLAS
     *     call of an item computes the same bits whatever the thread count.
     * NULL (CUDA, tests' stubs): kf_backend_parallel_for runs the items inline, in order. */
    void (*parallel_for)(kf_backend *b, int n_items, kf_parallel_fn fn, void *ctx);
    int threads; /* parallel_for's threads (0: one) */

    /* ---- the solve's operations (see "The solve's operations" above; NULL on CUDA) ---- */
    /* C[M, N] = alpha op(A) op(B) + beta C (cblas_sgemm): op(A) [M, K] is A [M, K] (NO_TRANS, row
     * stride lda >= K) or the transpose of A [K, M] (TRANS, lda >= M); op(B) [K, N] likewise from
     * B [K, N] or B [N, K]; C [M, N] row stride ldc >= N. beta = 0: C's contents are not read. */
    void (*sgemm)(const kf_backend *b, kf_trans ta, kf_trans tb, int M, int N, int K, float alpha, const float *A,
                  size_t lda, const float *B, size_t ldb, float beta, float *C, size_t ldc);
    /* the same in fp64 (cblas_dgemm) */
    void (*dgemm)(const kf_backend *b, kf_trans ta, kf_trans tb, int M, int N, int K, double alpha, const double *A,
                  size_t lda, const double *B, size_t ldb, double beta, double *C, size_t ldc);
    /* y = alpha op(A) x + beta y (cblas_dgemv, contiguous x and y): A [rows, cols] row stride lda;
     * op(A) = A (x [cols], y [rows]) or A^T (x [rows], y [cols]). beta = 0: y is not read. */
    void (*dgemv)(const kf_backend *b, kf_trans ta, int rows, int cols, double alpha, const double *A, size_t lda,
                  const double *x, double beta, double *y);
    /* Gram accumulation, fp64 (cblas_dsyrk, upper): C[N, N] = alpha op(A) + beta C on the upper
     * triangle (j >= i) only; the strict lower triangle is neither read nor written. TRANS:
     * op(A) = A^T A for A [K, N] (lda >= N); NO_TRANS: A A^T for A [N, K] (lda >= K). ldc >= N. */
    void (*dsyrk)(const kf_backend *b, kf_trans ta, int N, int K, double alpha, const double *A, size_t lda,
                  double beta, double *C, size_t ldc);
    /* the same in fp32 (cblas_ssyrk) */
    void (*ssyrk)(const kf_backend *b, kf_trans ta, int N, int K, float alpha, const float *A, size_t lda,
                  float beta, float *C, size_t ldc);
    /* A tile's normal equations from bf16 inputs (the values'): X [n, t] (row stride t) is rounded
     * in place to bf16, nearest even (X then holds those values in fp32), Y [n, d] (row stride d,
     * read only) is rounded likewise, and G's upper triangle [t, t] (row stride ldg, fp64) += X^T X
     * and B [t, d] (row stride ldb, fp64) += X^T Y, the products summed in fp32 over the n rows
     * (first: overwritten, not read); the strict lower triangle of G is neither read nor written.
     * B NULL: the Gram alone (Y not read). work: kf_gram_bf16_work(n, t, d) floats of scratch. */
    void (*gram_bf16)(const kf_backend *b, float *X, int n, int t, const float *Y, int d, float *work, double *G,
                      size_t ldg, double *B, size_t ldb, int first);
    /* y[n] = alpha S x + beta y for a symmetric S [n, n] (row stride lds) of which only the upper
     * triangle is read (cblas_dsymv, upper); x, y contiguous. beta = 0: y is not read. */
    void (*dsymv)(const kf_backend *b, int n, double alpha, const double *S, size_t lds, const double *x, double beta,
                  double *y);
    /* Cholesky factorization in place of a symmetric positive-definite A [n, n] (row stride lda),
     * given whole (both triangles: which one is read is the backend's choice). Afterwards A holds
     * the factor in a layout only dpotrs reads. Returns 0, or nonzero (A's contents then
     * unspecified) when A is not positive definite or holds a NaN. */
    int (*dpotrf)(const kf_backend *b, double *A, size_t lda, int n);
    /* X = A^-1 B in place for B [n, nrhs] (row stride ldb >= nrhs) from dpotrf's factor F of A.
     * Returns 0, or nonzero when the backend refused (a NaN in F or B where it checks for them). */
    int (*dpotrs)(const kf_backend *b, const double *F, size_t ldf, int n, double *B, size_t ldb, int nrhs);
    /* the same two in fp32 (the choice's ranking solves: docs/decisions/fp32-ranking-solves.md) */
    int (*spotrf)(const kf_backend *b, float *A, size_t lda, int n);
    int (*spotrs)(const kf_backend *b, const float *F, size_t ldf, int n, float *B, size_t ldb, int nrhs);
    /* X [n, nrhs] = argmin ||A X - B||_F for A [m, n], B [m, nrhs] (contiguous, not modified), fp32:
     * Householder QR; when QR fails, or gives non-finite values or |X| > 1e4 max|B| (QR does not
     * reveal rank), fp64 normal equations (A^T A + delta I) X = A^T B with delta = 1e-6 tr / n
     * (their dual when m < n). Returns a kf_lstsq_path, or -1 when out of memory. */
    int (*lstsq)(const kf_backend *b, const float *A, int m, int n, const float *B, int nrhs, float *X);
    /* kf_softmax_rows_args above */
    void (*softmax_rows)(const kf_backend *b, const kf_softmax_rows_args *a);
    /* x_ij = exp(x_ij - shift[i]) for x [rows, n] (row stride ldx), fp32, unnormalised: the
     * exponentials of AM's mass matching, shifted by each row's own max over the whole block. */
    void (*exp_rows)(const kf_backend *b, float *x, size_t ldx, int rows, int n, const float *shift);

    /* Nonzero when an operation failed since the last call (e.g. scratch memory could not be
     * had); clears the flag. Operations themselves return nothing so that a device backend
     * can queue them. */
    int (*take_error)(kf_backend *b);
    void (*destroy)(kf_backend *b);
};

/* Threads an item of kf_backend_parallel_for may be given (its per-thread scratch count). */
static inline int kf_backend_threads(const kf_backend *b) {
    return b && b->parallel_for && b->threads > 1 ? b->threads : 1;
}

/* b->parallel_for, or the items inline in order on thread 0 when b has none. */
static inline void kf_backend_parallel_for(kf_backend *b, int n_items, kf_parallel_fn fn, void *ctx) {
    if (b && b->parallel_for) {
        b->parallel_for(b, n_items, fn, ctx);
        return;
    }
    for (int i = 0; i < n_items; i++)
        fn(ctx, i, 0);
}

/* The CPU's solve operations alone (every other member NULL): stateless, on host memory, usable
 * from any thread; the CPU backend's own solve operations are these. */
const kf_backend *kf_backend_cpu_solve(void);

/* THE rule for which backend runs the solve: b when it implements the solve's operations, else
 * (b NULL, the CUDA backend, tests' stubs) the CPU's. */
static inline const kf_backend *kf_solve_backend(const kf_backend *b) {
    return b && b->sgemm ? b : kf_backend_cpu_solve();
}

/* The solve's operations through kf_solve_backend(be): what the compactor calls. */
static inline void kf_solve_sgemm(const kf_backend *be, kf_trans ta, kf_trans tb, int M, int N, int K, float alpha,
                                  const float *A, size_t lda, const float *B, size_t ldb, float beta, float *C,
                                  size_t ldc) {
    be = kf_solve_backend(be);
    be->sgemm(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
static inline void kf_solve_dgemm(const kf_backend *be, kf_trans ta, kf_trans tb, int M, int N, int K, double alpha,
                                  const double *A, size_t lda, const double *B, size_t ldb, double beta, double *C,
                                  size_t ldc) {
    be = kf_solve_backend(be);
    be->dgemm(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
static inline void kf_solve_dgemv(const kf_backend *be, kf_trans ta, int rows, int cols, double alpha,
                                  const double *A, size_t lda, const double *x, double beta, double *y) {
    be = kf_solve_backend(be);
    be->dgemv(be, ta, rows, cols, alpha, A, lda, x, beta, y);
}
static inline void kf_solve_dsyrk(const kf_backend *be, kf_trans ta, int N, int K, double alpha, const double *A,
                                  size_t lda, double beta, double *C, size_t ldc) {
    be = kf_solve_backend(be);
    be->dsyrk(be, ta, N, K, alpha, A, lda, beta, C, ldc);
}
static inline void kf_solve_ssyrk(const kf_backend *be, kf_trans ta, int N, int K, float alpha, const float *A,
                                  size_t lda, float beta, float *C, size_t ldc) {
    be = kf_solve_backend(be);
    be->ssyrk(be, ta, N, K, alpha, A, lda, beta, C, ldc);
}
/* The scratch of gram_bf16 in floats: the portable path's products [t, max(t, d)] and Y rounded
 * [n, d], or the tile's pair words in the order its blocks read them (X's by strips of
 * KF_GRAM_BF16_STRIP columns and again by groups of KF_GRAM_BF16_GROUP, Y's by strips, each padded
 * with zero words to whole strips and groups) and one pair row. */
#define KF_GRAM_BF16_STRIP 32
#define KF_GRAM_BF16_GROUP 12
static inline size_t kf_gram_bf16_work(int n, int t, int d) {
    const size_t S = KF_GRAM_BF16_STRIP, G = KF_GRAM_BF16_GROUP, T = (size_t)t, D = (size_t)d;
    const size_t np = (size_t)(n + 1) / 2, ts = (T + S - 1) / S * S, tg = (T + G - 1) / G * G, ds = (D + S - 1) / S * S;
    const size_t row = ts > tg ? (ts > ds ? ts : ds) : (tg > ds ? tg : ds);
    const size_t portable = T * (T > D ? T : D) + (size_t)n * D, pairs = np * (ts + tg + ds) + row;
    return portable > pairs ? portable : pairs;
}
static inline void kf_solve_gram_bf16(const kf_backend *be, float *X, int n, int t, const float *Y, int d, float *work,
                                      double *G, size_t ldg, double *B, size_t ldb, int first) {
    be = kf_solve_backend(be);
    be->gram_bf16(be, X, n, t, Y, d, work, G, ldg, B, ldb, first);
}
static inline void kf_solve_dsymv(const kf_backend *be, int n, double alpha, const double *S, size_t lds,
                                  const double *x, double beta, double *y) {
    be = kf_solve_backend(be);
    be->dsymv(be, n, alpha, S, lds, x, beta, y);
}
static inline int kf_solve_dpotrf(const kf_backend *be, double *A, size_t lda, int n) {
    be = kf_solve_backend(be);
    return be->dpotrf(be, A, lda, n);
}
static inline int kf_solve_dpotrs(const kf_backend *be, const double *F, size_t ldf, int n, double *B, size_t ldb,
                                  int nrhs) {
    be = kf_solve_backend(be);
    return be->dpotrs(be, F, ldf, n, B, ldb, nrhs);
}
static inline int kf_solve_spotrf(const kf_backend *be, float *A, size_t lda, int n) {
    be = kf_solve_backend(be);
    return be->spotrf(be, A, lda, n);
}
static inline int kf_solve_spotrs(const kf_backend *be, const float *F, size_t ldf, int n, float *B, size_t ldb,
                                  int nrhs) {
    be = kf_solve_backend(be);
    return be->spotrs(be, F, ldf, n, B, ldb, nrhs);
}
static inline int kf_solve_lstsq(const kf_backend *be, const float *A, int m, int n, const float *B, int nrhs,
                                 float *X) {
    be = kf_solve_backend(be);
    return be->lstsq(be, A, m, n, B, nrhs, X);
}
static inline void kf_solve_softmax_rows(const kf_backend *be, const kf_softmax_rows_args *a) {
    be = kf_solve_backend(be);
    be->softmax_rows(be, a);
}
static inline void kf_solve_exp_rows(const kf_backend *be, float *x, size_t ldx, int rows, int n,
                                     const float *shift) {
    be = kf_solve_backend(be);
    be->exp_rows(be, x, ldx, rows, n, shift);
}
/* x = (S + lambda I)^-1 rhs for a symmetric positive semi-definite S [d, d] (fp64, whole, row
 * stride d, not modified) by dpotrf + dpotrs on a copy taken from ws (kf_solve_spd_bytes; NULL: a
 * block of its own). Returns 0, 1 when the factorization or the solve failed, -1 when out of
 * memory. (kernels/solve.c) */
int kf_solve_spd(const kf_backend *be, const double *S, int d, double lambda, const double *rhs, double *x, kf_ws *ws);
int64_t kf_solve_spd_bytes(int d);

/* The CPU backend (OpenBLAS GEMMs; row kernels and attention on a pthread pool of as many
 * threads as OpenBLAS has). Returns NULL when out of memory. */
kf_backend *kf_backend_cpu_create(void);
/* The same with a pool of `threads` threads (<= 0: as many as OpenBLAS has); parallel_for uses
 * them all. */
kf_backend *kf_backend_cpu_create_threads(int threads);

#endif
