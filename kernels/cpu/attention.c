/* Causal GQA attention over the paged KV pool (CPU reference, fp32), blocked over keys.
 *
 * An item is one KV head g and one tile of tq queries: the rep = n_heads / kv_heads query heads
 * that read g are stacked into one matrix Qp [tq * rep, head_dim] (row i * rep + j: query i,
 * head j of the group), so the keys of g are read once for all of them. The keys visible to the
 * tile go by blocks of KEY_BLOCK (whole pages), each gathered from its pages into a contiguous
 * per-thread buffer, and the softmax is online (the running max m and sum l of each row):
 *   S = scale * Qp Kb^T                        [rows, kb]     (sgemm)
 *   S += bias; causal mask; m' = max(m, max S); P = exp(S - m'); l = l e^(m - m') + sum P
 *   O = O e^(m - m') + P Vb                    [rows, head_dim] (sgemm, beta 1)
 * and at the end out = O / l. The score block, the gathered keys and values and O stay in the
 * core's cache (about 1.3 MB per thread at tq * rep = 512, head_dim 128), where the former
 * whole-row scores [128, n_keys] and whole-context gathers streamed through memory; rows whose
 * query sees no key of a block skip it, so a causal chunk costs about half of a square one.
 * The sum l is kept in fp64. Against a whole-row softmax the result moves by float rounding only
 * (the order of the sums changes; tests/test_kernels.c holds it to 1e-5 of an fp64 reference).
 *
 * With a pool in the scratch, the items are spread over its threads, each with its own buffers;
 * OpenBLAS is held to one thread meanwhile so that the sgemms of the items run side by side
 * instead of queueing for its pool (the previous thread count is restored before returning).
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/cpu/pool.h"

#ifndef TILE_ROWS
#define TILE_ROWS 512 /* query rows (queries x heads of a group) per item, at most */
#endif
#ifndef KEY_BLOCK
#define KEY_BLOCK 256 /* keys per block: a multiple of KF_PAGE_TOKENS */
#endif

/* Grows a scratch buffer to hold n elements of elem bytes; 0, or -1 when out of memory (the
 * buffer is then unchanged). Shared by the kernels that keep scratch between calls. */
int kf_cpu_grow(void **buf, size_t *cap, size_t n, size_t elem) {
    if (n <= *cap)
        return 0;
    void *nb = realloc(*buf, n * elem);
    if (!nb)
        return -1;
    *buf = nb;
    *cap = n;
    return 0;
}

void kf_cpu_attn_scratch_free(kf_cpu_attn_scratch *s) {
    free(s->work);
    kf_pool *pool = s->pool;
    memset(s, 0, sizeof *s);
    s->pool = pool; /* not owned */
}

typedef struct {
    const kf_attn_args *a;
    float *work;         /* [threads, per_thread] */
    size_t per_thread;   /* floats */
    int rep, tq, n_tiles;
} attn_job;

/* One thread's buffers inside the job's work area. */
typedef struct {
    float *qp, *o;  /* [rows, hd] stacked queries, output accumulator */
    float *s;       /* [rows, KEY_BLOCK] scores, then weights */
    float *kb, *vb; /* [KEY_BLOCK, hd] one block of the group's keys and values */
    float *m;       /* [rows] running max */
    double *l;      /* [rows] running sum */
} attn_bufs;

static size_t bufs_floats(int rows, int hd) {
    return (size_t)rows * (2 * hd + KEY_BLOCK + 1 + 2) + (size_t)2 * KEY_BLOCK * hd + 16;
}

static attn_bufs bufs_at(float *w, int rows, int hd) {
    attn_bufs b;
    b.l = (double *)w; /* first, so that it is 8-byte aligned */
    b.qp = w + 2 * (size_t)rows;
    b.o = b.qp + (size_t)rows * hd;
    b.s = b.o + (size_t)rows * hd;
    b.kb = b.s + (size_t)rows * KEY_BLOCK;
    b.vb = b.kb + (size_t)KEY_BLOCK * hd;
    b.m = b.vb + (size_t)KEY_BLOCK * hd;
    return b;
}

/* Keys [k0, k0 + kb) of KV head g from their pages into kb/vb [kb, hd]. */
static void gather_block(const kf_attn_args *a, int g, int k0, int kb, float *kdst, float *vdst) {
    const int hd = a->kv.head_dim;
    const size_t row = (size_t)a->kv.kv_heads * hd;
    for (int t = k0; t < k0 + kb; t++) {
        const size_t src = (size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride +
                           (size_t)(t % KF_PAGE_TOKENS) * row + (size_t)g * hd;
        memcpy(kdst + (size_t)(t - k0) * hd, a->kv.k + src, sizeof(float) * hd);
        memcpy(vdst + (size_t)(t - k0) * hd, a->kv.v + src, sizeof(float) * hd);
    }
}

/* One row's online softmax step over a block: s [kb] scores of which the first nv are visible
 * (bias added to the first nb of them); leaves the weights exp(s - m') in s (0 past nv) and
 * returns the factor e^(m - m') that the row's O and l must be scaled by (1: unchanged). */
KF_ROW_CLONES static float online_row(float *s, int kb, int nv, const float *bias, int nb, float *m, double *l) {
    for (int j = 0; j < nb; j++)
        s[j] += bias[j];
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < nv; j++)
        mx = s[j] > mx ? s[j] : mx;
    const float m_new = mx > *m ? mx : *m;
#pragma omp simd
    for (int j = 0; j < nv; j++)
        s[j] = kf_expf(s[j] - m_new);
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < nv; j++)
        sum += s[j];
    for (int j = nv; j < kb; j++)
        s[j] = 0.0f;
    const float corr = m_new == *m ? 1.0f : kf_expf(*m - m_new);
    *m = m_new;
    *l = *l * corr + sum;
    return corr;
}

/* One (KV head, query tile) item. */
static void tile_item(void *ctx, int item, int thread) {
    const attn_job *j = ctx;
    const kf_attn_args *a = j->a;
    const int hd = a->kv.head_dim, rep = j->rep, g = item / j->n_tiles, q0 = (item % j->n_tiles) * j->tq;
    const int n_past = a->n_keys - a->n_q;
    const int tq = a->n_q - q0 < j->tq ? a->n_q - q0 : j->tq, rows = tq * rep;
    const int kmax = n_past + q0 + tq; /* keys visible to the tile's last query */
    const float *bias = a->bias ? a->bias + (size_t)g * a->bias_stride : NULL;
    attn_bufs b = bufs_at(j->work + (size_t)thread * j->per_thread, rows, hd);
    for (int i = 0; i < tq; i++) /* the group's heads of query i are adjacent in q */
        memcpy(b.qp + (size_t)i * rep * hd, a->q + (size_t)(q0 + i) * a->q_stride + (size_t)g * rep * hd,
               sizeof(float) * rep * hd);
    memset(b.o, 0, sizeof(float) * (size_t)rows * hd);
    for (int r = 0; r < rows; r++) {
        b.m[r] = -INFINITY;
        b.l[r] = 0;
    }
    for (int k0 = 0; k0 < kmax; k0 += KEY_BLOCK) {
        const int kb = kmax - k0 < KEY_BLOCK ? kmax - k0 : KEY_BLOCK;
        /* rows before r0 belong to queries that see no key of this block */
        const int i0 = k0 - n_past - q0 > 0 ? k0 - n_past - q0 : 0, r0 = i0 * rep, ra = rows - r0;
        gather_block(a, g, k0, kb, b.kb, b.vb);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ra, kb, hd, a->scale, b.qp + (size_t)r0 * hd, hd, b.kb,
                    hd, 0.0f, b.s + (size_t)r0 * KEY_BLOCK, KEY_BLOCK);
        for (int r = r0; r < rows; r++) {
            const int valid = n_past + q0 + r / rep + 1 - k0; /* keys of the block this row sees */
            const int nv = valid < kb ? valid : kb;
            const int nb = !bias || a->bias_len <= k0 ? 0 : (a->bias_len - k0 < nv ? a->bias_len - k0 : nv);
            const float corr = online_row(b.s + (size_t)r * KEY_BLOCK, kb, nv, bias ? bias + k0 : NULL, nb, &b.m[r],
                                          &b.l[r]);
            if (corr != 1.0f)
                for (int d = 0; d < hd; d++)
                    b.o[(size_t)r * hd + d] *= corr;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ra, hd, kb, 1.0f, b.s + (size_t)r0 * KEY_BLOCK,
                    KEY_BLOCK, b.vb, hd, 1.0f, b.o + (size_t)r0 * hd, hd);
    }
    for (int r = 0; r < rows; r++) {
        const float inv = (float)(1.0 / b.l[r]);
        float *dst = a->out + (size_t)(q0 + r / rep) * a->out_stride + (size_t)(g * rep + r % rep) * hd;
        for (int d = 0; d < hd; d++)
            dst[d] = b.o[(size_t)r * hd + d] * inv;
    }
}

int kf_cpu_attention(kf_cpu_attn_scratch *s, const kf_attn_args *a) {
    const int nq = a->n_q, hd = a->kv.head_dim, rep = a->n_heads / a->kv.kv_heads;
    if (nq <= 0)
        return 0;
    const int threads = kf_pool_threads(s->pool);
    attn_job j = {.a = a, .rep = rep, .tq = TILE_ROWS / rep > 0 ? TILE_ROWS / rep : 1};
    j.tq = j.tq < nq ? j.tq : nq;
    /* smaller tiles while there would be fewer than two items per thread (down to 64 rows) */
    while (a->kv.kv_heads * ((nq + j.tq - 1) / j.tq) < 2 * threads && j.tq * rep > 64 && j.tq > 1)
        j.tq = (j.tq + 1) / 2;
    j.n_tiles = (nq + j.tq - 1) / j.tq;
    j.per_thread = bufs_floats(j.tq * rep, hd);
    j.per_thread = (j.per_thread + 15) & ~(size_t)15; /* 64-byte steps between threads */
    if (kf_cpu_grow((void **)&s->work, &s->work_cap, (size_t)threads * j.per_thread, sizeof(float)) != 0)
        return -1;
    j.work = s->work;
    const int n_items = a->kv.kv_heads * j.n_tiles;
    const int blas_threads = threads > 1 && n_items > 1 ? openblas_get_num_threads() : 1;
    if (blas_threads > 1)
        openblas_set_num_threads(1);
    kf_pool_run(s->pool, n_items, tile_item, &j);
    if (blas_threads > 1)
        openblas_set_num_threads(blas_threads);
    return 0;
}
