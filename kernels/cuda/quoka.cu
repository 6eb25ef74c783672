/* QUOKA selection in four launches, all on the stream, no host round trip:
 *   keep:   one block per query head: fp64 mean of the chunk's queries, -cos of each query to it as
 *           an order key, a radix select of the n_keep largest, emitted in position order with a
 *           block scan, then ordered by rank (insertion sort of n_keep entries);
 *   qbar:   one block per (kept rank, KV head): the normalized kept queries averaged over the group;
 *   score:  one warp per history key: |k| and max_j qbar_j . k in one pass over the key, fp32;
 *   select: one block per KV head: 4-pass 8-bit radix select of the budget over the keys outside
 *           the window (sinks score +inf), then one ordered scan emitting window + chosen keys.
 * Ties go to the lower index everywhere, as in the CPU reference (kernels/cpu/quoka.c). */
#include <float.h>

#include "kernels/cuda/quoka.cuh"

#define QK_EPS 1e-6f
#define QK_THREADS 256
#define QK_MAX_HD 256

__device__ __forceinline__ uint32_t kf_order_key(float f) {
    if (f != f)
        return 0;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct kf_scan_smem {
    int warp_sums[QK_THREADS / 32];
    int total;
};

/* Exclusive block-wide prefix sum of v (blockDim.x == QK_THREADS); *total gets the sum. */
__device__ int kf_block_scan(int v, kf_scan_smem *s, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        s->warp_sums[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int w = 0; w < QK_THREADS / 32; w++) {
            const int t = s->warp_sums[w];
            s->warp_sums[w] = run;
            run += t;
        }
        s->total = run;
    }
    __syncthreads();
    const int r = s->warp_sums[warp] + x - v;
    *total = s->total;
    __syncthreads(); /* s is reused by the next call */
    return r;
}

struct kf_radix_smem {
    unsigned hist[256];
    uint32_t prefix, mask;
    int k;
};

/* The k-th largest key among the items i < n with src.cand(i) (1 <= k <= their count); *take_eq:
 * how many keys equal to it belong to the top k. Four passes of 8 bits. */
template <class Src>
__device__ uint32_t kf_block_radix_select(const Src &src, int n, int k, kf_radix_smem *s, int *take_eq) {
    if (threadIdx.x == 0) {
        s->prefix = 0;
        s->mask = 0;
        s->k = k;
    }
    for (int pass = 0; pass < 4; pass++) {
        const int sh = 24 - 8 * pass;
        for (int b = threadIdx.x; b < 256; b += blockDim.x)
            s->hist[b] = 0;
        __syncthreads();
        const uint32_t prefix = s->prefix, mask = s->mask;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (!src.cand(i))
                continue;
            const uint32_t u = src.key(i);
            if ((u & mask) == prefix)
                atomicAdd(&s->hist[(u >> sh) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255, kk = s->k;
            for (; d > 0 && (int)s->hist[d] < kk; d--)
                kk -= (int)s->hist[d];
            s->k = kk;
            s->prefix = prefix | ((uint32_t)d << sh);
            s->mask = mask | (255u << sh);
        }
        __syncthreads();
    }
    *take_eq = s->k;
    const uint32_t thr = s->prefix;
    __syncthreads();
    return thr;
}

/* Writes, in ascending i, every i < n that is forced or is a candidate in the top k
 * (key > thr, or == thr and among the first take_eq such in index order). Returns the count. */
template <class Src>
__device__ int kf_block_emit(const Src &src, int n, uint32_t thr, int take_eq, int32_t *out, kf_scan_smem *s) {
    int base_sel = 0, base_eq = 0;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const bool in = i < n, cand = in && src.cand(i);
        const uint32_t u = cand ? src.key(i) : 0u;
        int tot_eq, tot_sel;
        const int eq_before = base_eq + kf_block_scan(cand && u == thr, s, &tot_eq);
        const bool sel = in && (!cand || u > thr || (u == thr && eq_before < take_eq));
        const int pos = base_sel + kf_block_scan(sel, s, &tot_sel);
        if (sel)
            out[pos] = i;
        base_eq += tot_eq;
        base_sel += tot_sel;
    }
    return base_sel;
}

struct kf_query_keys {
    const uint32_t *keys;
    __device__ bool cand(int) const { return true; }
    __device__ uint32_t key(int i) const { return keys[i]; }
};

struct kf_hist_keys {
    const float *score;
    int w_lo, w_hi, n_sink;
    __device__ bool cand(int t) const { return t < w_lo || t >= w_hi; }
    __device__ uint32_t key(int t) const { return t < n_sink ? 0xffffffffu : kf_order_key(score[t]); }
};

__device__ double kf_block_sum_d(double v, double *part) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        t += part[w];
    __syncthreads();
    return t;
}

/* step 1: the n_keep queries of head blockIdx.x least cosine-similar to the head's mean query */
__global__ void __launch_bounds__(QK_THREADS) kf_quoka_keep(const float *q, size_t q_stride, int n_q, int hd,
                                                            int n_keep, uint32_t *keys_all, int32_t *kept_all) {
    __shared__ double mean[QK_MAX_HD];
    __shared__ double part[QK_THREADS / 32];
    __shared__ kf_radix_smem rs;
    __shared__ kf_scan_smem ss;
    const int h = blockIdx.x;
    int32_t *kept = kept_all + (size_t)h * n_keep;
    uint32_t *keys = keys_all + (size_t)h * n_q;
    if (n_q <= n_keep) { /* short chunk: every query, in position order */
        for (int j = threadIdx.x; j < n_keep; j += blockDim.x)
            kept[j] = j;
        return;
    }
    const float *qh = q + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        double s = 0.0;
        for (int i = 0; i < n_q; i++)
            s += qh[(size_t)i * q_stride + d];
        mean[d] = s / n_q;
    }
    __syncthreads();
    double mn2 = 0.0;
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        mn2 += mean[d] * mean[d];
    const double mn = fmax(sqrt(kf_block_sum_d(mn2, part)), (double)QK_EPS);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = warp; i < n_q; i += QK_THREADS / 32) {
        const float *qi = qh + (size_t)i * q_stride;
        double dot = 0.0, qn = 0.0;
        for (int d = lane; d < hd; d += 32) {
            dot += qi[d] * mean[d];
            qn += (double)qi[d] * qi[d];
        }
        for (int o = 16; o > 0; o >>= 1) {
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
            qn += __shfl_xor_sync(0xffffffffu, qn, o);
        }
        if (lane == 0)
            keys[i] = kf_order_key((float)(-dot / (fmax(sqrt(qn), (double)QK_EPS) * mn)));
    }
    __syncthreads();
    kf_query_keys src = {keys};
    int take_eq;
    const uint32_t thr = kf_block_radix_select(src, n_q, n_keep, &rs, &take_eq);
    kf_block_emit(src, n_q, thr, take_eq, kept, &ss);
    __syncthreads();
    if (threadIdx.x == 0) /* by rank: larger key first, then lower position (n_keep entries only) */
        for (int a = 1; a < n_keep; a++) {
            const int32_t x = kept[a];
            int b = a - 1;
            while (b >= 0 && (keys[kept[b]] < keys[x] || (keys[kept[b]] == keys[x] && kept[b] > x))) {
                kept[b + 1] = kept[b];
                b--;
            }
            kept[b + 1] = x;
        }
}

/* step 2: qbar[g, j] = sum over the group's heads h of q[h, kept[h, j]] / (|.| * rep) */
__global__ void kf_quoka_qbar(const float *q, size_t q_stride, int hd, int rep, int n_keep, const int32_t *kept_all,
                              float *qbar) {
    __shared__ double part[QK_THREADS / 32];
    const int j = blockIdx.x, g = blockIdx.y;
    float *out = qbar + ((size_t)g * n_keep + j) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        out[d] = 0.0f;
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const float *qi = q + (size_t)kept_all[(size_t)h * n_keep + j] * q_stride + (size_t)h * hd;
        double qn = 0.0;
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
            qn += (double)qi[d] * qi[d];
        qn = kf_block_sum_d(qn, part);
        const float w = (float)(1.0 / (fmax(sqrt(qn), (double)QK_EPS) * rep));
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
            out[d] += qi[d] * w; /* each thread owns its d: no race */
    }
}

/* step 3: score[g, t] = max_j qbar[g, j] . k[g, t] / |k[g, t]|, one warp per key */
__global__ void __launch_bounds__(QK_THREADS) kf_quoka_score(const float *kbase, size_t page_stride, size_t row,
                                                             const int32_t *pages, int nt, int hd, int n_keep,
                                                             const float *qbar, int qbar_in_smem, float *score) {
    extern __shared__ float qs[]; /* [n_keep, hd] when it fits */
    const int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *qb = qbar + (size_t)g * n_keep * hd;
    if (qbar_in_smem) {
        for (int e = threadIdx.x; e < n_keep * hd; e += blockDim.x)
            qs[e] = qb[e];
        __syncthreads();
        qb = qs;
    }
    const int t = blockIdx.x * (QK_THREADS / 32) + warp;
    if (t >= nt)
        return;
    const float *k = kbase + (size_t)pages[t / KF_PAGE_TOKENS] * page_stride + (size_t)(t % KF_PAGE_TOKENS) * row +
                     (size_t)g * hd;
    float kr[QK_MAX_HD / 32];
    float kn = 0.0f;
#pragma unroll
    for (int u = 0; u < QK_MAX_HD / 32; u++) {
        const int d = lane + 32 * u;
        kr[u] = d < hd ? k[d] : 0.0f;
        kn += kr[u] * kr[u];
    }
    for (int o = 16; o > 0; o >>= 1)
        kn += __shfl_xor_sync(0xffffffffu, kn, o);
    float best = -INFINITY;
    for (int j = 0; j < n_keep; j++) {
        const float *qj = qb + (size_t)j * hd;
        float dot = 0.0f;
#pragma unroll
        for (int u = 0; u < QK_MAX_HD / 32; u++) {
            const int d = lane + 32 * u;
            if (d < hd)
                dot += qj[d] * kr[u];
        }
        for (int o = 16; o > 0; o >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
        best = fmaxf(best, dot);
    }
    if (lane == 0)
        score[(size_t)g * nt + t] = best / fmaxf(sqrtf(kn), QK_EPS);
}

/* step 4: per KV head, the window plus the budget best other keys, ascending */
__global__ void __launch_bounds__(QK_THREADS) kf_quoka_pick(const float *score_all, int nt, int w_lo, int w_hi,
                                                            int n_sink, int budget, int n_cand, int32_t *out_all,
                                                            size_t idx_stride) {
    __shared__ kf_radix_smem rs;
    __shared__ kf_scan_smem ss;
    const int g = blockIdx.x;
    int32_t *out = out_all + (size_t)g * idx_stride;
    if (budget >= n_cand) { /* everything fits: the whole history */
        for (int t = threadIdx.x; t < nt; t += blockDim.x)
            out[t] = t;
        return;
    }
    kf_hist_keys src = {score_all + (size_t)g * nt, w_lo, w_hi, n_sink};
    int take_eq;
    const uint32_t thr = kf_block_radix_select(src, nt, budget, &rs, &take_eq);
    kf_block_emit(src, nt, thr, take_eq, out, &ss);
}

void kf_cuda_quoka_select(kf_cuda_ctx *c, const kf_quoka_select_args *a) {
    const int hd = a->kv.head_dim, kvh = a->kv.kv_heads, nh = a->n_heads, nq = a->n_q, nt = a->n_hist;
    if (nq <= 0 || nt <= 0 || a->budget < 1 || a->n_keep < 1 || kvh <= 0 || nh % kvh != 0 || hd > QK_MAX_HD) {
        kf_cuda_fail(c, __FILE__, __LINE__, "quoka_select: invalid arguments (n_q %d, n_hist %d, head_dim %d)", nq, nt,
                     hd);
        return;
    }
    const int rep = nh / kvh, n_keep = nq > a->n_keep ? a->n_keep : nq;
    const size_t row = (size_t)kvh * hd;
    /* scratch: order keys [nh, nq] | kept [nh, n_keep] | qbar [kvh, n_keep, hd] | score [kvh, nt] */
    const size_t b_keys = sizeof(uint32_t) * (size_t)nh * nq, b_kept = sizeof(int32_t) * (size_t)nh * n_keep;
    const size_t b_qbar = sizeof(float) * (size_t)kvh * n_keep * hd, b_score = sizeof(float) * (size_t)kvh * nt;
    char *scr = (char *)kf_cuda_scratch(c, KF_CUDA_SCR_QUOKA, b_keys + b_kept + b_qbar + b_score + 64);
    const int n_pages = (nt + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
    const int32_t *pages =
        (const int32_t *)kf_cuda_stage(c, KF_CUDA_SCR_IDX0, a->pages, sizeof(int32_t) * (size_t)n_pages);
    if (!scr || !pages)
        return;
    uint32_t *keys = (uint32_t *)scr;
    int32_t *kept = (int32_t *)(scr + b_keys);
    float *qbar = (float *)(scr + b_keys + b_kept);
    float *score = a->scores ? a->scores : (float *)(scr + b_keys + b_kept + b_qbar);

    kf_quoka_keep<<<nh, QK_THREADS, 0, c->stream>>>(a->q, a->q_stride, nq, hd, n_keep, keys, kept);
    KF_CUDA_LAUNCHED(c);
    kf_quoka_qbar<<<dim3((unsigned)n_keep, (unsigned)kvh), QK_THREADS, 0, c->stream>>>(a->q, a->q_stride, hd, rep,
                                                                                     n_keep, kept, qbar);
    KF_CUDA_LAUNCHED(c);
    const size_t qb_bytes = sizeof(float) * (size_t)n_keep * hd;
    const int in_smem = qb_bytes <= 32768;
    kf_quoka_score<<<dim3((unsigned)((nt + QK_THREADS / 32 - 1) / (QK_THREADS / 32)), (unsigned)kvh), QK_THREADS,
                     in_smem ? qb_bytes : 0, c->stream>>>((const float *)a->kv.k, a->kv.page_stride, row, pages, nt, hd, n_keep, qbar,
                                                          in_smem, score);
    KF_CUDA_LAUNCHED(c);
    const int w_lo = a->win_lo < 0 ? 0 : (a->win_lo > nt ? nt : a->win_lo);
    const int w_hi = a->win_hi > nt ? nt : (a->win_hi < w_lo ? w_lo : a->win_hi);
    const int n_cand = nt - (w_hi - w_lo);
    const int budget = a->budget < n_cand ? a->budget : n_cand;
    kf_quoka_pick<<<kvh, QK_THREADS, 0, c->stream>>>(score, nt, w_lo, w_hi, a->n_sink, budget, n_cand, a->out_idx,
                                                     a->idx_stride);
    KF_CUDA_LAUNCHED(c);
}
