/* blockcopy.c — decoded kvf cache -> paged KV block tensors (see blockcopy.h). */
#include "connector/ext/blockcopy.h"
#include "kernels/base/convert.h"

#include <stdio.h>
#include <string.h>

/* Element strides of each role, and the sizes the copy needs, for one destination tensor. */
typedef struct {
    int64_t s_kv, s_blk, s_tok, s_head, s_dim; /* elements */
    int64_t kbs, n_blocks, heads, dim;         /* kernel block size, kernel blocks, heads, head_dim */
} roles;

/* Dimension of blocks, K/V, tokens, heads, head_dim in each 5-D logical shape. */
static const int kDims5[3][5] = {
    [KVB_KV_FIRST] = {1, 0, 2, 3, 4}, [KVB_BLOCKS_FIRST] = {0, 1, 2, 3, 4}, [KVB_CPU] = {1, 0, 3, 2, 4}};

static roles tensor_roles(const kvb_tensor *t, kvb_layout l, int64_t head_dim) {
    if (l == KVB_PACKED) /* (blocks, heads, block_size, 2 * head_dim): V is head_dim further on */
        return (roles){.s_kv = head_dim * t->stride[3], .s_blk = t->stride[0], .s_tok = t->stride[2],
                       .s_head = t->stride[1], .s_dim = t->stride[3], .kbs = t->shape[2], .n_blocks = t->shape[0],
                       .heads = t->shape[1], .dim = t->shape[3] / 2};
    const int *d = kDims5[l]; /* blk, kv, tok, head, dim */
    return (roles){.s_kv = t->stride[d[1]], .s_blk = t->stride[d[0]], .s_tok = t->stride[d[2]],
                   .s_head = t->stride[d[3]], .s_dim = t->stride[d[4]], .kbs = t->shape[d[2]],
                   .n_blocks = t->shape[d[0]], .heads = t->shape[d[3]], .dim = t->shape[d[4]]};
}

static const char *const kNames[] = {"kv_first", "blocks_first", "cpu", "packed"};

const char *kvb_layout_name(kvb_layout l) {
    return (unsigned)l < 4 ? kNames[l] : "unknown";
}

int kvb_layout_parse(const char *s, kvb_layout *out) {
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, kNames[i])) {
            *out = (kvb_layout)i;
            return 0;
        }
    return -1;
}

static bool supported_block(int64_t bs) {
    return bs == 16 || bs == 32 || bs == 64 || bs == 128;
}

static float load_f32(const unsigned char *p, kf_dtype d) {
    uint16_t h;
    float f;
    switch (d) {
    case KF_DTYPE_F32:
        memcpy(&f, p, 4);
        return f;
    case KF_DTYPE_BF16:
        memcpy(&h, p, 2);
        return kf_bf16_to_f32(h);
    case KF_DTYPE_F16:
    default:
        memcpy(&h, p, 2);
        return kf_f16_to_f32(h);
    }
}

static void store_f32(unsigned char *p, kf_dtype d, float f) {
    uint16_t h;
    switch (d) {
    case KF_DTYPE_F32:
        memcpy(p, &f, 4);
        return;
    case KF_DTYPE_BF16:
        h = kf_f32_to_bf16(f);
        break;
    case KF_DTYPE_F16:
    default:
        h = kf_f32_to_f16(f);
        break;
    }
    memcpy(p, &h, 2);
}

/* n elements: source contiguous, destination with element stride dstride. */
static void copy_run(unsigned char *dst, int64_t dstride, const unsigned char *src, int64_t n, kf_dtype sd,
                     kf_dtype dd) {
    const size_t ss = kf_dtype_size(sd), ds = kf_dtype_size(dd);
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

/* a * b * ... without overflow (all factors >= 0): false when the product exceeds INT64_MAX. */
static bool mul_ok(int64_t *out, int n, const int64_t *f) {
    int64_t p = 1;
    for (int i = 0; i < n; i++)
        if (f[i] < 0 || __builtin_mul_overflow(p, f[i], &p))
            return false;
    *out = p;
    return true;
}

/* Every element the tensor's shape and strides name lies inside its memory. */
static kf_status check_extent(const kvb_tensor *t, int l, kf_error *err) {
    const size_t es = kf_dtype_size(t->dtype);
    int64_t last = t->offset, term; /* offset of the last element */
    if (!t->base || t->nbytes < 0 || t->offset < 0)
        return kf_fail(err, KF_ERR_INVALID, "layer %d: no tensor memory", l);
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 1 || t->stride[d] < 1)
            return kf_fail(err, KF_ERR_INVALID, "layer %d: dim %d of size %lld, stride %lld (empty, expanded or "
                           "broadcast tensor)", l, d, (long long)t->shape[d], (long long)t->stride[d]);
        if (__builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &term) || __builtin_add_overflow(last, term, &last))
            return kf_fail(err, KF_ERR_INVALID, "layer %d: shape and strides overflow", l);
    }
    if (last >= t->nbytes / (int64_t)es)
        return kf_fail(err, KF_ERR_INVALID, "layer %d: shape and strides reach element %lld of a %lld-byte tensor", l,
                       (long long)last, (long long)t->nbytes);
    return KF_OK;
}

static kf_status check_source(const kvb_copy_args *a, kf_error *err) {
    if (!a->src || !a->dst || a->n_dst < 1 || a->n_layers < 1 || a->C < 1 || a->head_dim < 1 || a->kv_heads < 1 || a->src_heads < 1)
        return kf_fail(err, KF_ERR_INVALID, "block copy: empty source or destination");
    const int64_t f[6] = {2, a->n_layers, a->C, a->src_heads, a->head_dim, (int64_t)kf_dtype_size(a->src_dtype)};
    int64_t need;
    if (!mul_ok(&need, 6, f) || need > a->src_bytes)
        return kf_fail(err, KF_ERR_INVALID, "block copy: a source of %lld bytes is smaller than 2 x %d layers x %lld "
                       "tokens x %lld heads x %lld", (long long)a->src_bytes, a->n_layers, (long long)a->C,
                       (long long)a->src_heads, (long long)a->head_dim);
    if (a->t0 < 0 || a->t0 > a->t1 || a->t1 > a->C)
        return kf_fail(err, KF_ERR_INVALID, "block copy: tokens [%lld, %lld) outside the cache's %lld",
                       (long long)a->t0, (long long)a->t1, (long long)a->C);
    if (a->head_start < 0 || a->head_start > a->src_heads - a->kv_heads)
        return kf_fail(err, KF_ERR_INVALID, "block copy: %lld heads from head %lld: outside the cache's %lld kv heads",
                       (long long)a->kv_heads, (long long)a->head_start, (long long)a->src_heads);
    const int cp = a->cp_size > 0 ? a->cp_size : 1, ci = a->cp_interleave > 0 ? a->cp_interleave : 1;
    if (a->cp_rank < 0 || a->cp_rank >= cp || a->block_size % cp || (a->block_size / cp) % ci)
        return kf_fail(err, KF_ERR_INVALID, "block copy: context-parallel rank %d of %d, interleave %d, does not fit "
                       "blocks of %d", a->cp_rank, cp, ci, a->block_size);
    if (!supported_block(a->block_size / cp))
        return kf_fail(err, KF_ERR_UNSUPPORTED, "block size %d (%d per context-parallel rank) is not supported (16, 32, "
                       "64 or 128 per rank)", a->block_size, a->block_size / cp);
    if (a->t1 > a->t0 && (a->t1 - 1) / a->block_size >= a->n_block_ids)
        return kf_fail(err, KF_ERR_INVALID, "block copy: %lld block ids cannot hold tokens up to %lld",
                       (long long)a->n_block_ids, (long long)a->t1);
    return KF_OK;
}

static kf_status check_tensor(const kvb_copy_args *a, int l, kf_error *err) {
    const kvb_tensor *t = &a->dst[l];
    if (t->ndim != (a->layout == KVB_PACKED ? 4 : 5))
        return kf_fail(err, KF_ERR_MISMATCH, "layer %d: a %d-D tensor is not a %s cache", l, t->ndim,
                       kvb_layout_name(a->layout));
    if (t->layer < 0 || t->layer >= a->n_layers)
        return kf_fail(err, KF_ERR_INVALID, "destination %d: layer %d outside the cache's %d", l, t->layer, a->n_layers);
    KF_TRY(check_extent(t, l, err));
    const roles r = tensor_roles(t, a->layout, a->head_dim);
    const int64_t two = a->layout == KVB_PACKED ? t->shape[3] - 2 * r.dim + 2 : t->shape[kDims5[a->layout][1]];
    if (two != 2 || r.heads != a->kv_heads || r.dim != a->head_dim) {
        char shape[120];
        int n = 0;
        for (int d = 0; d < t->ndim; d++)
            n += snprintf(shape + n, sizeof shape - (size_t)n, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        return kf_fail(err, KF_ERR_MISMATCH, "layer %d: a tensor of shape (%s) is not a %s cache of %lld kv heads x "
                       "head_dim %lld", l, shape, kvb_layout_name(a->layout), (long long)a->kv_heads,
                       (long long)a->head_dim);
    }
    const int64_t local_bs = a->block_size / (a->cp_size > 0 ? a->cp_size : 1); /* this rank's tokens per block */
    if (!supported_block(r.kbs) || local_bs % r.kbs != 0)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "layer %d: kernel block size %lld is not supported with blocks of %lld",
                       l, (long long)r.kbs, (long long)local_bs);
    const int64_t per = local_bs / r.kbs; /* kernel blocks per scheduler block */
    for (int64_t b = a->t0 / a->block_size; a->t1 > a->t0 && b <= (a->t1 - 1) / a->block_size; b++)
        if (a->block_ids[b] < 0 || ((int64_t)a->block_ids[b] + 1) * per > r.n_blocks)
            return kf_fail(err, KF_ERR_INVALID, "layer %d: block id %d outside the tensor's %lld blocks of %d", l,
                           a->block_ids[b], (long long)(r.n_blocks / per), a->block_size);
    return KF_OK;
}

/* n tokens from p of a head-major source layer ([src_heads, C, head_dim]) to dst, the first token's
 * place in the tensor: each head's run of D elements per token (a fixed-size copy where the
 * dtypes match and a head's elements are contiguous: 128 and 256 bytes inline). */
static void copy_head_major(const kvb_copy_args *a, const kvb_tensor *t, const roles *r, unsigned char *dst,
                            const unsigned char *src_layer, int64_t p, int64_t n) {
    const size_t ss = kf_dtype_size(a->src_dtype), ds = kf_dtype_size(t->dtype);
    const int64_t D = a->head_dim;
    const size_t hb = (size_t)D * ss;
    const bool raw = a->src_dtype == t->dtype && r->s_dim == 1;
    const size_t dstep = (size_t)r->s_tok * ds, hstep = (size_t)r->s_head * ds, sh = (size_t)a->C * hb;
    const unsigned char *s0 = src_layer + (size_t)((a->head_start * a->C + p) * D) * ss; /* head 0, token p */
    for (int64_t i = 0; i < n; i++) { /* token by token: the destination is written in order */
        unsigned char *d = dst + (size_t)i * dstep;
        const unsigned char *s = s0 + (size_t)i * hb;
        if (raw && hb == 256)
            for (int64_t h = 0; h < a->kv_heads; h++)
                memcpy(d + (size_t)h * hstep, s + (size_t)h * sh, 256);
        else if (raw && hb == 128)
            for (int64_t h = 0; h < a->kv_heads; h++)
                memcpy(d + (size_t)h * hstep, s + (size_t)h * sh, 128);
        else
            for (int64_t h = 0; h < a->kv_heads; h++)
                copy_run(d + (size_t)h * hstep, r->s_dim, s + (size_t)h * sh, D, a->src_dtype, t->dtype);
    }
}

/* Tokens [t0, t1) of K or V of one layer into one tensor. */
static void copy_layer(const kvb_copy_args *a, const kvb_tensor *t, const unsigned char *src_layer, int kv) {
    const roles r = tensor_roles(t, a->layout, a->head_dim);
    const size_t ss = kf_dtype_size(a->src_dtype), ds = kf_dtype_size(t->dtype);
    const int64_t H = a->kv_heads, D = a->head_dim, src_tok = a->src_heads * D; /* source elements per token */
    const bool token_rows = r.s_dim == 1 && r.s_head == D;  /* a token's heads are one run */
    const bool block_rows = token_rows && r.s_tok == H * D; /* so are consecutive tokens */
    unsigned char *base = (unsigned char *)t->base + (size_t)(t->offset + kv * r.s_kv) * ds;
    const int64_t cp = a->cp_size > 0 ? a->cp_size : 1, ci = a->cp_interleave > 0 ? a->cp_interleave : 1;
    const int64_t local_bs = a->block_size / cp;
    int64_t p = a->t0;
    while (p < a->t1) {
        const int64_t vo = p % a->block_size; /* offset in the scheduler's block */
        int64_t n = cp > 1 ? ci - vo % ci : a->block_size - vo; /* tokens left in this run of this rank */
        if ((vo / ci) % cp != a->cp_rank) {   /* another context-parallel rank's tokens */
            p += n;
            continue;
        }
        const int64_t slot = (int64_t)a->block_ids[p / a->block_size] * local_bs + vo / (cp * ci) * ci + vo % ci;
        const int64_t kb = slot / r.kbs, off = slot % r.kbs;
        if (n > r.kbs - off) /* tokens left in this kernel block */
            n = r.kbs - off;
        if (n > a->t1 - p)
            n = a->t1 - p;
        unsigned char *dst = base + (size_t)(kb * r.s_blk + off * r.s_tok) * ds;
        if (a->src_head_major) {
            copy_head_major(a, t, &r, dst, src_layer, p, n);
            p += n;
            continue;
        }
        const unsigned char *src = src_layer + (size_t)(p * src_tok + a->head_start * D) * ss;
        if (block_rows && a->src_heads == H) {
            copy_run(dst, 1, src, n * H * D, a->src_dtype, t->dtype);
        } else {
            for (int64_t i = 0; i < n; i++) {
                unsigned char *dt = dst + (size_t)(i * r.s_tok) * ds;
                const unsigned char *st = src + (size_t)(i * src_tok) * ss;
                if (token_rows)
                    copy_run(dt, 1, st, H * D, a->src_dtype, t->dtype);
                else
                    for (int64_t h = 0; h < H; h++)
                        copy_run(dt + (size_t)(h * r.s_head) * ds, r.s_dim, st + (size_t)(h * D) * ss, D, a->src_dtype,
                                 t->dtype);
            }
        }
        p += n;
    }
}

kf_status kvb_copy(const kvb_copy_args *a, kf_error *err) {
    KF_TRY(check_source(a, err));
    if ((unsigned)a->layout > KVB_PACKED)
        return kf_fail(err, KF_ERR_INVALID, "block copy: unknown layout %d", (int)a->layout);
    for (int l = 0; l < a->n_dst; l++)
        KF_TRY(check_tensor(a, l, err));
    const size_t ss = kf_dtype_size(a->src_dtype);
    const size_t layer_elems = (size_t)a->C * (size_t)a->src_heads * (size_t)a->head_dim; /* fits: checked */
    for (int i = 0; i < a->n_dst; i++)
        for (int kv = 0; kv < 2; kv++) {
            const size_t first = ((size_t)kv * (size_t)a->n_layers + (size_t)a->dst[i].layer) * layer_elems;
            copy_layer(a, &a->dst[i], (const unsigned char *)a->src + first * ss, kv);
        }
    return KF_OK;
}
