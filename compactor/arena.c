#include "compactor/arena.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

int kf_arena_dtype_parse(const char *name, kf_dtype *out) {
    if (strcmp(name, "f32") == 0)
        *out = KF_DTYPE_F32;
    else if (strcmp(name, "bf16") == 0)
        *out = KF_DTYPE_BF16;
    else
        return -1;
    return 0;
}

const char *kf_arena_dtype_name(kf_dtype dtype) {
    return dtype == KF_DTYPE_BF16 ? "bf16" : "f32";
}

kf_status kf_arena_init(kf_arena *a, kf_backend *b, int n_layers, int kv_heads, int head_dim, int n_pages,
                        kf_dtype dtype, kf_error *err) {
    return kf_arena_init_held(a, b, n_layers, n_layers, kv_heads, head_dim, n_pages, dtype, err);
}

kf_status kf_arena_init_held(kf_arena *a, kf_backend *b, int n_layers, int n_held, int kv_heads, int head_dim,
                             int n_pages, kf_dtype dtype, kf_error *err) {
    memset(a, 0, sizeof *a);
    if (n_layers <= 0 || kv_heads <= 0 || head_dim <= 0 || n_pages <= 0)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: layers, heads, head_dim and pages must be positive");
    if (n_held < 1 || n_held > n_layers)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: %d layers held of %d", n_held, n_layers);
    if (dtype != KF_DTYPE_F32 && dtype != KF_DTYPE_BF16)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: dtype %d is neither f32 nor bf16", (int)dtype);
    if (dtype == KF_DTYPE_BF16 && !b->kv_bf16)
        return kf_fail(err, KF_ERR_UNSUPPORTED,
                       "KV arena: the %s backend has no bf16 arena (its kernels read fp32 K/V only); use f32",
                       b->name ? b->name : "model's");
    a->backend = b;
    a->dtype = dtype;
    a->elem = kf_arena_elem(dtype);
    a->n_layers = n_layers;
    a->n_held = n_held;
    a->kv_heads = kv_heads;
    a->head_dim = head_dim;
    a->n_pages = n_pages;
    a->block = (size_t)KF_PAGE_TOKENS * kv_heads * head_dim;
    a->page_stride = (size_t)n_held * 2 * a->block;
    size_t bytes = (size_t)n_pages * a->page_stride * a->elem;
    a->storage = b->alloc(b, bytes);
    a->refcount = calloc((size_t)n_pages, sizeof *a->refcount);
    a->free_list = malloc((size_t)n_pages * sizeof *a->free_list);
    if (!a->storage || !a->refcount || !a->free_list) {
        kf_arena_free(a);
        return kf_fail(err, KF_ERR_NOMEM, "KV arena: cannot allocate %d pages (%.1f MiB)", n_pages,
                       bytes / (1024.0 * 1024.0));
    }
    /* Hand out low page ids first. */
    for (int i = 0; i < n_pages; i++)
        a->free_list[i] = n_pages - 1 - i;
    a->n_free = n_pages;
    return KF_OK;
}

void kf_arena_free(kf_arena *a) {
    if (a->storage)
        a->backend->free(a->backend, a->storage);
    free(a->refcount);
    free(a->free_list);
    memset(a, 0, sizeof *a);
}

kf_paged_kv kf_arena_layer(const kf_arena *a, int layer) {
    kf_paged_kv kv;
    kv.k = (char *)a->storage + (size_t)(layer % a->n_held) * 2 * a->block * a->elem;
    kv.v = (char *)kv.k + a->block * a->elem;
    kv.page_stride = a->page_stride;
    kv.kv_heads = a->kv_heads;
    kv.head_dim = a->head_dim;
    kv.dtype = a->dtype;
    return kv;
}

void kf_seq_init(kf_seq *s) {
    memset(s, 0, sizeof *s);
}

static void page_decref(kf_arena *a, int32_t p) {
    if (--a->refcount[p] == 0)
        a->free_list[a->n_free++] = p;
}

static int32_t page_take(kf_arena *a) {
    int32_t p = a->free_list[--a->n_free];
    a->refcount[p] = 1;
    return p;
}

void kf_seq_release(kf_arena *a, kf_seq *s) {
    for (int i = 0; i < s->n_pages; i++)
        page_decref(a, s->pages[i]);
    free(s->pages);
    kf_seq_init(s);
}

static kf_status ensure_cap(kf_seq *s, int n_pages, kf_error *err) {
    if (n_pages <= s->cap)
        return KF_OK;
    int cap = s->cap ? s->cap : 16;
    while (cap < n_pages)
        cap *= 2;
    int32_t *np = realloc(s->pages, (size_t)cap * sizeof *np);
    if (!np)
        return kf_fail(err, KF_ERR_NOMEM, "KV arena: out of memory for a page table of %d pages", cap);
    s->pages = np;
    s->cap = cap;
    return KF_OK;
}

kf_status kf_seq_reserve(kf_arena *a, kf_seq *s, int64_t n, kf_error *err) {
    if (n < 0)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: negative reserve");
    const int have = s->n_pages;
    const int need_total = kf_pages_for(s->len + n);
    const int64_t used_pages = kf_pages_for(s->len);
    /* The page holding token len is written if len is inside it; copy it when shared. */
    const int cow = n > 0 && s->len % KF_PAGE_TOKENS != 0 && a->refcount[s->pages[used_pages - 1]] > 1;
    const int fresh = (need_total > have ? need_total - have : 0) + cow;
    if (fresh > a->n_free)
        return kf_fail(err, KF_ERR_NOSPACE,
                       "KV arena out of pages: %d more needed, %d free of %d (%lld tokens); raise the arena size",
                       fresh, a->n_free, a->n_pages, (long long)a->n_pages * KF_PAGE_TOKENS);
    KF_TRY(ensure_cap(s, need_total > have ? need_total : have, err));
    if (cow) {
        int32_t old = s->pages[used_pages - 1];
        int32_t p = page_take(a);
        char *base = a->storage;
        a->backend->copy(a->backend, base + (size_t)p * a->page_stride * a->elem,
                         base + (size_t)old * a->page_stride * a->elem, a->page_stride * a->elem);
        page_decref(a, old);
        s->pages[used_pages - 1] = p;
    }
    for (int i = have; i < need_total; i++)
        s->pages[i] = page_take(a);
    if (need_total > have)
        s->n_pages = need_total;
    return KF_OK;
}

kf_status kf_seq_fork(kf_arena *a, const kf_seq *src, int64_t len, kf_seq *dst, kf_error *err) {
    if (len < 0 || len > src->len)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: cannot fork %lld tokens of a %lld-token document",
                       (long long)len, (long long)src->len);
    kf_seq_init(dst);
    const int np = kf_pages_for(len);
    KF_TRY(ensure_cap(dst, np, err));
    for (int i = 0; i < np; i++) {
        dst->pages[i] = src->pages[i];
        a->refcount[src->pages[i]]++;
    }
    dst->n_pages = np;
    dst->len = len;
    return KF_OK;
}

kf_status kf_seq_truncate(kf_arena *a, kf_seq *s, int64_t len, kf_error *err) {
    if (len < 0 || len > s->len)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: cannot rewind a %lld-token document to %lld tokens",
                       (long long)s->len, (long long)len);
    const int keep = kf_pages_for(len);
    for (int i = keep; i < s->n_pages; i++)
        page_decref(a, s->pages[i]);
    s->n_pages = keep;
    s->len = len;
    return KF_OK;
}

static kf_status check_range(const kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, kf_error *err) {
    if (layer < 0 || layer >= a->n_layers || t0 < 0 || n < 0 || t0 + n > (int64_t)s->n_pages * KF_PAGE_TOKENS)
        return kf_fail(err, KF_ERR_INVALID, "KV arena: layer %d tokens [%lld, %lld) outside the document", layer,
                       (long long)t0, (long long)(t0 + n));
    return KF_OK;
}

/* One run of n <= 16 tokens of a layer's pool at element off: to host fp32 (read) or from it (write);
 * a bf16 pool goes through tmp [16 * row] bf16. */
static void run_read(const kf_arena *a, const void *src, size_t off, size_t count, float *dst, uint16_t *tmp) {
    const char *at = (const char *)src + off * a->elem;
    if (a->dtype == KF_DTYPE_F32) {
        a->backend->download(a->backend, dst, at, count * sizeof(float));
        return;
    }
    a->backend->download(a->backend, tmp, at, count * sizeof(uint16_t));
    kf_bf16_to_f32_n(dst, tmp, count);
}

static void run_write(const kf_arena *a, void *dst, size_t off, size_t count, const float *src, uint16_t *tmp) {
    char *at = (char *)dst + off * a->elem;
    if (a->dtype == KF_DTYPE_F32) {
        a->backend->upload(a->backend, at, src, count * sizeof(float));
        return;
    }
    kf_f32_to_bf16_n(tmp, src, count);
    a->backend->upload(a->backend, at, tmp, count * sizeof(uint16_t));
}

/* A bf16 arena's conversion buffer of one page's row block; NULL for fp32 (none needed). */
static kf_status conv_tmp(const kf_arena *a, uint16_t **tmp, kf_error *err) {
    *tmp = NULL;
    if (a->dtype == KF_DTYPE_F32)
        return KF_OK;
    *tmp = malloc((size_t)KF_PAGE_TOKENS * a->kv_heads * a->head_dim * sizeof(uint16_t));
    return *tmp ? KF_OK : kf_fail(err, KF_ERR_NOMEM, "KV arena: out of memory for a bf16 conversion buffer");
}

/* Tokens [t0, t0 + n) of a layer (range checked by the caller), page run by page run: into
 * k_out, v_out [n, row] (a read) or, when they are NULL, from k_in, v_in [n, row] (a write). */
static kf_status copy_kv(const kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, float *k_out,
                         float *v_out, const float *k_in, const float *v_in, kf_error *err) {
    const kf_paged_kv kv = kf_arena_layer(a, layer);
    const size_t row = (size_t)a->kv_heads * a->head_dim;
    uint16_t *tmp;
    KF_TRY(conv_tmp(a, &tmp, err));
    for (int64_t t = t0; t < t0 + n;) {
        const int64_t slot = t % KF_PAGE_TOKENS;
        const int64_t run = (KF_PAGE_TOKENS - slot) < (t0 + n - t) ? KF_PAGE_TOKENS - slot : t0 + n - t;
        const size_t off = (size_t)s->pages[t / KF_PAGE_TOKENS] * kv.page_stride + (size_t)slot * row;
        const size_t at = (size_t)(t - t0) * row;
        if (k_out) {
            run_read(a, kv.k, off, (size_t)run * row, k_out + at, tmp);
            run_read(a, kv.v, off, (size_t)run * row, v_out + at, tmp);
        } else {
            run_write(a, kv.k, off, (size_t)run * row, k_in + at, tmp);
            run_write(a, kv.v, off, (size_t)run * row, v_in + at, tmp);
        }
        t += run;
    }
    free(tmp);
    return KF_OK;
}

kf_status kf_seq_read_kv(const kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, float *k, float *v,
                         kf_error *err) {
    KF_TRY(check_range(a, s, layer, t0, n, err));
    return copy_kv(a, s, layer, t0, n, k, v, NULL, NULL, err);
}

kf_status kf_seq_write_kv(kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, const float *k,
                          const float *v, kf_error *err) {
    KF_TRY(check_range(a, s, layer, t0, n, err));
    for (int64_t t = t0; t < t0 + n; t += KF_PAGE_TOKENS - t % KF_PAGE_TOKENS)
        if (a->refcount[s->pages[t / KF_PAGE_TOKENS]] > 1)
            return kf_fail(err, KF_ERR_INVALID, "KV arena: page %d is shared and cannot be written",
                           s->pages[t / KF_PAGE_TOKENS]);
    return copy_kv(a, s, layer, t0, n, NULL, NULL, k, v, err);
}
