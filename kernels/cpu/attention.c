/* Causal GQA attention over the paged KV pool (CPU reference, fp32).
 *
 * The keys and values of the visible pages are first gathered into contiguous
 * [n_keys, kv_heads, head_dim] buffers (a copy of O(n_keys * kv_heads * head_dim), small next
 * to the O(n_q * n_keys * n_heads * head_dim) of the attention itself), so that each query head
 * and tile of TILE_Q queries becomes two sgemm calls around a row softmax:
 *   S = scale * Q_tile K_g^T   [tile, keys visible to the tile's last query]
 *   S += bias; causal mask; P = softmax(S)
 *   O_tile = P V_g
 * Keys past the last visible one are never touched, so a causal chunk costs about half of a
 * square one.
 *
 * With a pool in the scratch, the (head, tile) items are spread over its threads, each with its
 * own score tile, and the gather over pages too; OpenBLAS is held to one thread meanwhile so that
 * the sgemms of the items run side by side instead of queueing for its pool (the previous
 * thread count is restored before returning). The arithmetic of every item is unchanged.
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/pool.h"

#define TILE_Q 128

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
    free(s->kbuf);
    free(s->vbuf);
    free(s->scores);
    kf_pool *pool = s->pool;
    memset(s, 0, sizeof *s);
    s->pool = pool; /* not owned */
}

typedef struct {
    kf_cpu_attn_scratch *s;
    const kf_attn_args *a;
    int n_tiles, n_pages, pages_per_item;
} attn_job;

/* One item of the gather: pages [i * pages_per_item, ...) into kbuf/vbuf. */
static void gather_item(void *ctx, int item, int thread) {
    (void)thread;
    const attn_job *j = ctx;
    const kf_attn_args *a = j->a;
    const size_t row = (size_t)a->kv.kv_heads * a->kv.head_dim;
    const int p0 = item * j->pages_per_item;
    const int p1 = p0 + j->pages_per_item < j->n_pages ? p0 + j->pages_per_item : j->n_pages;
    for (int p = p0; p < p1; p++) {
        const int ntok = (p + 1) * KF_PAGE_TOKENS <= a->n_keys ? KF_PAGE_TOKENS : a->n_keys - p * KF_PAGE_TOKENS;
        const size_t src = (size_t)a->pages[p] * a->kv.page_stride;
        memcpy(j->s->kbuf + (size_t)p * KF_PAGE_TOKENS * row, a->kv.k + src, (size_t)ntok * row * sizeof(float));
        memcpy(j->s->vbuf + (size_t)p * KF_PAGE_TOKENS * row, a->kv.v + src, (size_t)ntok * row * sizeof(float));
    }
}

/* One (head, tile) item: S = scale Q K^T + bias, causal softmax, O = P V. */
static void tile_item(void *ctx, int item, int thread) {
    const attn_job *j = ctx;
    const kf_attn_args *a = j->a;
    const int hd = a->kv.head_dim, rep = a->n_heads / a->kv.kv_heads;
    const int n_past = a->n_keys - a->n_q;
    const size_t row = (size_t)a->kv.kv_heads * hd;
    const int h = item / j->n_tiles, q0 = (item % j->n_tiles) * TILE_Q, g = h / rep;
    const float *kg = j->s->kbuf + (size_t)g * hd;
    const float *vg = j->s->vbuf + (size_t)g * hd;
    const float *bias = a->bias ? a->bias + (size_t)g * a->bias_stride : NULL;
    const int tq = a->n_q - q0 < TILE_Q ? a->n_q - q0 : TILE_Q;
    const int kmax = n_past + q0 + tq;                                   /* keys visible to the tile's last query */
    float *S = j->s->scores + (size_t)thread * TILE_Q * a->n_keys;       /* [tq, kmax] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tq, kmax, hd, a->scale,
                a->q + (size_t)q0 * a->q_stride + (size_t)h * hd, (int)a->q_stride, kg, (int)row, 0.0f, S, kmax);
    for (int i = 0; i < tq; i++) {
        float *sr = S + (size_t)i * kmax;
        const int valid = n_past + q0 + i + 1;
        if (bias) {
            const int nb = valid < a->bias_len ? valid : a->bias_len;
            for (int jj = 0; jj < nb; jj++)
                sr[jj] += bias[jj];
        }
        kf_cpu_softmax_row(sr, valid, NULL, NULL);
        for (int jj = valid; jj < kmax; jj++)
            sr[jj] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, tq, hd, kmax, 1.0f, S, kmax, vg, (int)row, 0.0f,
                a->out + (size_t)q0 * a->out_stride + (size_t)h * hd, (int)a->out_stride);
}

int kf_cpu_attention(kf_cpu_attn_scratch *s, const kf_attn_args *a) {
    const int nk = a->n_keys, nq = a->n_q;
    const size_t row = (size_t)a->kv.kv_heads * a->kv.head_dim;
    if (nq <= 0)
        return 0;
    const int threads = kf_pool_threads(s->pool);
    /* Buffers grow by half again at least, so that decoding (one key more per call) reallocates
     * them a logarithmic number of times, not at every token. */
    size_t kv_need = (size_t)nk * row;
    if (s->kv_cap < kv_need) {
        kv_need = kv_need > s->kv_cap + s->kv_cap / 2 ? kv_need : s->kv_cap + s->kv_cap / 2;
        free(s->kbuf);
        free(s->vbuf);
        s->kbuf = malloc(kv_need * sizeof(float));
        s->vbuf = malloc(kv_need * sizeof(float));
        s->kv_cap = (s->kbuf && s->vbuf) ? kv_need : 0;
        if (!s->kv_cap)
            return -1;
    }
    size_t sc_need = (size_t)threads * TILE_Q * nk;
    if (s->scores_cap < sc_need)
        sc_need = sc_need > s->scores_cap + s->scores_cap / 2 ? sc_need : s->scores_cap + s->scores_cap / 2;
    if (kf_cpu_grow((void **)&s->scores, &s->scores_cap, sc_need, sizeof(float)) != 0)
        return -1;

    attn_job j = {.s = s, .a = a, .n_tiles = (nq + TILE_Q - 1) / TILE_Q,
                  .n_pages = (nk + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS};
    const int n_items = a->n_heads * j.n_tiles;
    const int blas_threads = threads > 1 && n_items > 1 ? openblas_get_num_threads() : 1;
    if (blas_threads > 1)
        openblas_set_num_threads(1);
    const int gather_items = j.n_pages < 4 * threads ? j.n_pages : 4 * threads;
    j.pages_per_item = (j.n_pages + gather_items - 1) / gather_items;
    kf_pool_run(s->pool, (j.n_pages + j.pages_per_item - 1) / j.pages_per_item, gather_item, &j);
    kf_pool_run(s->pool, n_items, tile_item, &j);
    if (blas_threads > 1)
        openblas_set_num_threads(blas_threads);
    return 0;
}
