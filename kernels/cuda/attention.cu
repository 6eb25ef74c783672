/* Flash-style attention (online softmax) in fp32 on the CUDA cores.
 *
 * One block = one KV head g and ATT_WARPS consecutive (query, head-in-group) rows, one warp per
 * row, so the rows of a block share every K/V tile the block loads. Keys are visited as a
 * "key sequence" of tiles of 16 (one page's worth):
 *   dense:  position j is key j; query i sees positions 0 .. n_past + i;
 *   sparse: positions j < n_sel are history keys hist_idx[g, j], position n_sel + c is chunk key
 *           n_past + c; query i sees positions 0 .. n_sel + i.
 * Both paths run the same code on the same tiles, so a full ascending selection reproduces the
 * dense result bit for bit (as the CPU backend promises).
 *
 * Per tile, lane l scores key l % 16 over half of head_dim (lanes 16..31 take the other half; one
 * shuffle adds the halves); the tile's max rescales the running sum once; each lane then owns
 * head_dim/32 output dims and accumulates p_k * V[k] with p_k broadcast by shuffles.
 * This is the simple correct version: fp32 FFMA, no tensor cores (see kernels/cuda/README.md for
 * the planned mma/wgmma version). */
#include <float.h>

#include "kernels/cuda/attention.cuh"

#define ATT_WARPS 8
#define ATT_TILE 16
#define ATT_DPL (KF_CUDA_ATTN_MAX_HD / 32) /* output dims per lane, max */

struct kf_attn_params {
    const float *q;
    size_t q_stride;
    float *out;
    size_t out_stride;
    int n_q, rep, hd;
    int n_past;     /* absolute index of the chunk's first key */
    int n_pre;      /* key-sequence positions before the chunk's keys: n_past (dense) or n_sel */
    const float *k, *v;
    size_t page_stride, row; /* row = kv_heads * head_dim */
    const int32_t *pages;    /* device */
    float scale;
    const float *bias;
    size_t bias_stride;
    int bias_len;
    const int32_t *hist_idx; /* device, or NULL (dense) */
    size_t idx_stride;
};

__global__ void __launch_bounds__(ATT_WARPS * 32) kf_attention_kernel(kf_attn_params p) {
    extern __shared__ float sm[];
    const int hd = p.hd, kstride = hd + 1; /* +1: lanes reading 16 different K rows hit different banks */
    float *ks = sm;                          /* [16, hd + 1] */
    float *vs = ks + ATT_TILE * kstride;     /* [16, hd] */
    float *qs = vs + ATT_TILE * hd;          /* [ATT_WARPS, hd] */
    float *bs = qs + ATT_WARPS * hd;         /* [16] bias of the tile's keys */
    int *ts = (int *)(bs + ATT_TILE);        /* [16] absolute key index, -1 past the end */

    const int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rows = p.n_q * p.rep;
    const int r0 = blockIdx.x * ATT_WARPS;
    const int r = r0 + warp;
    const int i = r / p.rep, h = g * p.rep + r % p.rep; /* query token, query head */
    const bool active = r < rows;
    const int len = active ? p.n_pre + i + 1 : 0; /* key-sequence positions this row sees */
    const int last_r = min(r0 + ATT_WARPS, rows) - 1;
    const int len_max = p.n_pre + last_r / p.rep + 1;

    if (active)
        for (int d = lane; d < hd; d += 32)
            qs[warp * hd + d] = p.q[(size_t)i * p.q_stride + (size_t)h * hd + d];

    float acc[ATT_DPL];
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++)
        acc[u] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int kk = lane & (ATT_TILE - 1), half = lane >> 4, h1 = hd / 2;
    const int d_lo = half ? h1 : 0, d_hi = half ? hd : h1;

    for (int j0 = 0; j0 < len_max; j0 += ATT_TILE) {
        __syncthreads(); /* the previous tile is no longer read */
        if (threadIdx.x < ATT_TILE) {
            const int j = j0 + threadIdx.x;
            int t = -1;
            if (j < len_max)
                t = j < p.n_pre ? (p.hist_idx ? p.hist_idx[(size_t)g * p.idx_stride + j] : j) : p.n_past + (j - p.n_pre);
            ts[threadIdx.x] = t;
            bs[threadIdx.x] = (p.bias && t >= 0 && t < p.bias_len) ? p.bias[(size_t)g * p.bias_stride + t] : 0.0f;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_TILE * hd; e += blockDim.x) {
            const int key = e / hd, d = e % hd, t = ts[key];
            float kv_k = 0.0f, kv_v = 0.0f;
            if (t >= 0) {
                const size_t off = (size_t)p.pages[t / KF_PAGE_TOKENS] * p.page_stride +
                                   (size_t)(t % KF_PAGE_TOKENS) * p.row + (size_t)g * hd + d;
                kv_k = p.k[off];
                kv_v = p.v[off];
            }
            ks[key * kstride + d] = kv_k;
            vs[key * hd + d] = kv_v;
        }
        __syncthreads();
        if (!active || j0 >= len)
            continue; /* warp-uniform: the whole warp skips */

        const float *qw = qs + warp * hd, *kr = ks + kk * kstride;
        float s = 0.0f;
        for (int d = d_lo; d < d_hi; d++)
            s += qw[d] * kr[d];
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        s = j0 + kk < len ? s * p.scale + bs[kk] : -INFINITY;
        float mt = s;
        for (int o = 8; o > 0; o >>= 1)
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
        const float mn = fmaxf(m, mt);
        if (mn == -INFINITY)
            continue; /* every key so far is -inf (a -inf bias): nothing to add */
        const float pk = expf(s - mn), corr = expf(m - mn);
        float ps = pk;
        for (int o = 8; o > 0; o >>= 1)
            ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l = l * corr + ps;
        m = mn;
#pragma unroll
        for (int u = 0; u < ATT_DPL; u++)
            acc[u] *= corr;
#pragma unroll
        for (int key = 0; key < ATT_TILE; key++) {
            const float pb = __shfl_sync(0xffffffffu, pk, key);
#pragma unroll
            for (int u = 0; u < ATT_DPL; u++) {
                const int d = lane + 32 * u;
                if (d < hd)
                    acc[u] += pb * vs[key * hd + d];
            }
        }
    }
    if (active) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float *o = p.out + (size_t)i * p.out_stride + (size_t)h * hd;
#pragma unroll
        for (int u = 0; u < ATT_DPL; u++) {
            const int d = lane + 32 * u;
            if (d < hd)
                o[d] = acc[u] * inv;
        }
    }
}

static void launch(kf_cuda_ctx *c, const kf_attn_args *a, int n_pre, const int32_t *hist_idx, size_t idx_stride) {
    const int kvh = a->kv.kv_heads, hd = a->kv.head_dim;
    if (a->n_q <= 0)
        return;
    if (hd > KF_CUDA_ATTN_MAX_HD || hd < 2 || kvh <= 0 || a->n_heads % kvh) {
        kf_cuda_fail(c, __FILE__, __LINE__, "attention: head_dim %d / heads %d/%d not supported (head_dim <= %d)", hd,
                     a->n_heads, kvh, KF_CUDA_ATTN_MAX_HD);
        return;
    }
    const int n_pages = (a->n_keys + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
    const int32_t *pages =
        (const int32_t *)kf_cuda_stage(c, KF_CUDA_SCR_IDX0, a->pages, sizeof(int32_t) * (size_t)n_pages);
    if (!pages)
        return;
    kf_attn_params p;
    p.q = a->q;
    p.q_stride = a->q_stride;
    p.out = a->out;
    p.out_stride = a->out_stride;
    p.n_q = a->n_q;
    p.rep = a->n_heads / kvh;
    p.hd = hd;
    p.n_past = a->n_keys - a->n_q;
    p.n_pre = n_pre;
    p.k = (const float *)a->kv.k; /* fp32: the CUDA backend has no bf16 pool (kv_bf16 = 0) */
    p.v = (const float *)a->kv.v;
    p.page_stride = a->kv.page_stride;
    p.row = (size_t)kvh * hd;
    p.pages = pages;
    p.scale = a->scale;
    p.bias = a->bias;
    p.bias_stride = a->bias_stride;
    p.bias_len = a->bias ? a->bias_len : 0;
    p.hist_idx = hist_idx;
    p.idx_stride = idx_stride;
    const size_t smem = sizeof(float) * ((size_t)ATT_TILE * (hd + 1) + (size_t)ATT_TILE * hd + (size_t)ATT_WARPS * hd +
                                         ATT_TILE) + sizeof(int) * ATT_TILE;
    const int rows = a->n_q * p.rep;
    dim3 grid((unsigned)((rows + ATT_WARPS - 1) / ATT_WARPS), (unsigned)kvh);
    kf_attention_kernel<<<grid, ATT_WARPS * 32, smem, c->stream>>>(p);
    KF_CUDA_LAUNCHED(c);
}

void kf_cuda_attention(kf_cuda_ctx *c, const kf_attn_args *a) {
    launch(c, a, a->n_keys - a->n_q, NULL, 0);
}

void kf_cuda_sparse_attention(kf_cuda_ctx *c, const kf_sparse_attn_args *a) {
    if (a->n_sel < 0 || a->attn.n_keys < a->attn.n_q) {
        kf_cuda_fail(c, __FILE__, __LINE__, "sparse attention: bad selection (%d keys)", a->n_sel);
        return;
    }
    launch(c, &a->attn, a->n_sel, a->hist_idx, a->idx_stride);
}
