/* blockcopy.c — decoded kvf cache -> paged KV block tensors (see blockcopy.h). */
#include "connector/ext/blockcopy.h"

#include <string.h>

/* Dimension of each role in the logical shape of a layout. */
typedef struct {
    int kv, blk, tok, head, dim;
} roles;

static roles layout_roles(kvb_layout l) {
    switch (l) {
    case KVB_FLASHINFER:
        return (roles){1, 0, 2, 3, 4};
    case KVB_CPU:
        return (roles){0, 1, 3, 2, 4};
    case KVB_FLASH_ATTN:
    default:
        return (roles){0, 1, 2, 3, 4};
    }
}

const char *kvb_layout_name(kvb_layout l) {
    return l == KVB_FLASHINFER ? "flashinfer" : l == KVB_CPU ? "cpu" : "flash_attn";
}

int kvb_layout_parse(const char *s, kvb_layout *out) {
    if (!strcmp(s, "flash_attn"))
        *out = KVB_FLASH_ATTN;
    else if (!strcmp(s, "flashinfer") || !strcmp(s, "triton"))
        *out = KVB_FLASHINFER;
    else if (!strcmp(s, "cpu"))
        *out = KVB_CPU;
    else
        return -1;
    return 0;
}

static bool supported_block(int64_t bs) {
    return bs == 16 || bs == 32 || bs == 64 || bs == 128;
}

static float load_f32(const unsigned char *p, kvf_dtype d) {
    uint16_t h;
    float f;
    switch (d) {
    case KVF_F32:
        memcpy(&f, p, 4);
        return f;
    case KVF_BF16:
        memcpy(&h, p, 2);
        return kvf_bf16_to_f32(h);
    case KVF_F16:
    default:
        memcpy(&h, p, 2);
        return kvf_f16_to_f32(h);
    }
}

static void store_f32(unsigned char *p, kvf_dtype d, float f) {
    uint16_t h;
    switch (d) {
    case KVF_F32:
        memcpy(p, &f, 4);
        return;
    case KVF_BF16:
        h = kvf_f32_to_bf16(f);
        break;
    case KVF_F16:
    default:
        h = kvf_f32_to_f16(f);
        break;
    }
    memcpy(p, &h, 2);
}

/* n elements: source contiguous, destination with element stride dstride. */
static void copy_run(unsigned char *dst, int64_t dstride, const unsigned char *src, int64_t n, kvf_dtype sd,
                     kvf_dtype dd) {
    const size_t ss = kvf_dtype_size(sd), ds = kvf_dtype_size(dd);
    if (sd == dd && dstride == 1) {
        memcpy(dst, src, (size_t)n * ss);
        return;
    }
    if (sd == dd && ss == 2) {
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + (size_t)(i * dstride) * 2, src + (size_t)i * 2, 2);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        store_f32(dst + (size_t)(i * dstride) * ds, dd, load_f32(src + (size_t)i * ss, sd));
}

static kf_status check(const kvb_copy_args *a, kf_error *err) {
    if (!a->src || !a->dst || a->n_layers < 1 || a->C < 1 || a->head_dim < 1 || a->kv_heads < 1)
        return kf_fail(err, KF_ERR_INVALID, "block copy: empty source or destination");
    if (a->t0 < 0 || a->t0 > a->t1 || a->t1 > a->C)
        return kf_fail(err, KF_ERR_INVALID, "block copy: tokens [%lld, %lld) outside the cache's %lld",
                       (long long)a->t0, (long long)a->t1, (long long)a->C);
    if (!supported_block(a->block_size))
        return kf_fail(err, KF_ERR_UNSUPPORTED, "block size %d is not supported (16, 32, 64 or 128)", a->block_size);
    if (a->t1 > a->t0 && (a->t1 - 1) / a->block_size >= a->n_block_ids)
        return kf_fail(err, KF_ERR_INVALID, "block copy: %lld block ids cannot hold tokens up to %lld",
                       (long long)a->n_block_ids, (long long)a->t1);
    const roles r = layout_roles(a->layout);
    for (int l = 0; l < a->n_layers; l++) {
        const kvb_tensor *t = &a->dst[l];
        if (!t->data)
            return kf_fail(err, KF_ERR_INVALID, "layer %d: no tensor", l);
        if (t->shape[r.kv] != 2 || t->shape[r.head] != a->kv_heads || t->shape[r.dim] != a->head_dim)
            return kf_fail(err, KF_ERR_MISMATCH,
                           "layer %d: tensor of shape (%lld, %lld, %lld, %lld, %lld) is not a %s cache of %d kv heads"
                           " x head_dim %d",
                           l, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                           (long long)t->shape[3], (long long)t->shape[4], kvb_layout_name(a->layout), a->kv_heads,
                           a->head_dim);
        const int64_t kbs = t->shape[r.tok];
        if (!supported_block(kbs) || a->block_size % kbs != 0)
            return kf_fail(err, KF_ERR_UNSUPPORTED,
                           "layer %d: kernel block size %lld is not supported with scheduler blocks of %d", l,
                           (long long)kbs, a->block_size);
        for (int d = 0; d < 5; d++)
            if (t->stride[d] < 1)
                return kf_fail(err, KF_ERR_INVALID, "layer %d: stride %lld of dim %d (expanded or broadcast tensor)",
                               l, (long long)t->stride[d], d);
        const int64_t per = a->block_size / kbs; /* kernel blocks per scheduler block */
        for (int64_t b = a->t0 / a->block_size; a->t1 > a->t0 && b <= (a->t1 - 1) / a->block_size; b++)
            if (a->block_ids[b] < 0 || ((int64_t)a->block_ids[b] + 1) * per > t->shape[r.blk])
                return kf_fail(err, KF_ERR_INVALID, "layer %d: block id %d outside the tensor's %lld blocks of %d", l,
                               a->block_ids[b], (long long)(t->shape[r.blk] / per), a->block_size);
    }
    if (a->head_start < 0 || a->head_start + a->kv_heads > a->src_heads)
        return kf_fail(err, KF_ERR_INVALID, "block copy: heads %d..%d outside the cache's %d kv heads",
                       a->head_start, a->head_start + a->kv_heads - 1, a->src_heads);
    return KF_OK;
}

kf_status kvb_copy(const kvb_copy_args *a, kf_error *err) {
    KF_TRY(check(a, err));
    const roles r = layout_roles(a->layout);
    const size_t ss = kvf_dtype_size(a->src_dtype), ds = kvf_dtype_size(a->dst_dtype);
    const int H = a->kv_heads, D = a->head_dim;
    const int64_t src_tok = (int64_t)a->src_heads * D; /* source elements per token */
    for (int l = 0; l < a->n_layers; l++) {
        const kvb_tensor *t = &a->dst[l];
        const int64_t kbs = t->shape[r.tok];
        const int64_t s_kv = t->stride[r.kv], s_blk = t->stride[r.blk], s_tok = t->stride[r.tok];
        const int64_t s_head = t->stride[r.head], s_dim = t->stride[r.dim];
        const bool token_rows = s_dim == 1 && s_head == D;   /* a token's heads are one run */
        const bool block_rows = token_rows && s_tok == H * D; /* so are consecutive tokens */
        for (int kv = 0; kv < 2; kv++) {
            const unsigned char *src_layer =
                (const unsigned char *)a->src + (size_t)(((int64_t)kv * a->n_layers + l) * a->C) * src_tok * ss;
            int64_t p = a->t0;
            while (p < a->t1) {
                const int64_t slot = (int64_t)a->block_ids[p / a->block_size] * a->block_size + p % a->block_size;
                const int64_t kb = slot / kbs, off = slot % kbs;
                int64_t n = kbs - off; /* tokens left in this kernel block */
                if (n > a->t1 - p)
                    n = a->t1 - p;
                if (n > a->block_size - p % a->block_size)
                    n = a->block_size - p % a->block_size;
                unsigned char *dst = (unsigned char *)t->data + (size_t)(kv * s_kv + kb * s_blk + off * s_tok) * ds;
                const unsigned char *src = src_layer + (size_t)(p * src_tok + (int64_t)a->head_start * D) * ss;
                if (block_rows && a->src_heads == H) {
                    copy_run(dst, 1, src, n * H * D, a->src_dtype, a->dst_dtype);
                } else {
                    for (int64_t i = 0; i < n; i++) {
                        unsigned char *dt = dst + (size_t)(i * s_tok) * ds;
                        const unsigned char *st = src + (size_t)(i * src_tok) * ss;
                        if (token_rows)
                            copy_run(dt, 1, st, (int64_t)H * D, a->src_dtype, a->dst_dtype);
                        else
                            for (int h = 0; h < H; h++)
                                copy_run(dt + (size_t)(h * s_head) * ds, s_dim, st + (size_t)h * D * ss, D,
                                         a->src_dtype, a->dst_dtype);
                    }
                }
                p += n;
            }
        }
    }
    return KF_OK;
}
