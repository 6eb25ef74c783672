/* arena.h — the paged KV arena: every prefill writes its keys and values here.
 *
 * Storage is one backend allocation of n_pages pages. A page holds KF_PAGE_TOKENS (16)
 * consecutive tokens of one document, for every layer:
 *
 *   page p:  [n_layers][2 (K, V)][16 tokens][kv_heads][head_dim]   fp32, or bf16 (dtype)
 *
 * so a page is copied in one piece (copy-on-write) and one layer's K of page p starts at element
 * p * page_stride + layer * 2 * block + 0 of storage, its V at ... + block, block = 16*kv_heads*head_dim.
 * The dtype is chosen at init: KF_DTYPE_F32 (every backend) or KF_DTYPE_BF16 (half the bytes; the
 * CPU backend only, kf_backend.kv_bf16: the prefill rounds K and V to bf16 as it stores them, the
 * attention widens them back to fp32 block by block). kf_seq_read_kv / kf_seq_write_kv convert.
 *
 * A document (kf_seq) is a list of page ids and a length in tokens; token t lives in page
 * pages[t / 16], slot t % 16. Pages are reference-counted and return to the free list at zero.
 *
 *   fork      a new document sharing the pages that hold a prefix of another (refcount + 1),
 *             including a partly filled last page;
 *   truncate  rewind to any length, also inside a page; pages past the end are released;
 *   append    before a prefill writes tokens [len, len + n), kf_seq_reserve gives the
 *             document its own copy of a shared page that is about to be written (copy-on-write)
 *             and enough fresh pages for the rest. A page with refcount > 1 is never written.
 *
 * Running out of pages is a status (KF_ERR_NOSPACE), never a crash; the failed call leaves the
 * document and the arena as they were.
 */
#ifndef KF_ARENA_H
#define KF_ARENA_H

#include <stdint.h>

#include "kernels/base/error.h"
#include "kernels/backend.h"

typedef struct {
    kf_backend *backend;
    int n_layers;
    int n_held;           /* layers a page holds: n_layers, or fewer (kf_arena_init_held): layer l in slot
                             l % n_held, overwritten by layer l + n_held */
    int kv_heads;
    int head_dim;
    int n_pages;
    kf_dtype dtype;       /* KF_DTYPE_F32 or KF_DTYPE_BF16 */
    size_t elem;          /* bytes per element: 4 or 2 */
    void *storage;        /* [n_pages, n_held, 2, 16, kv_heads, head_dim] of dtype, backend memory */
    size_t page_stride;   /* elements per page */
    size_t block;         /* elements per (page, layer, K or V): 16 * kv_heads * head_dim */
    int32_t *refcount;    /* [n_pages] */
    int32_t *free_list;   /* [n_pages] stack of free page ids */
    int n_free;
} kf_arena;

typedef struct {
    int32_t *pages;  /* [n_pages] page ids in token order */
    int n_pages;
    int cap;
    int64_t len;     /* tokens */
} kf_seq;

/* dtype: KF_DTYPE_F32, or KF_DTYPE_BF16 where the backend has kv_bf16 (else KF_ERR_UNSUPPORTED). */
kf_status kf_arena_init(kf_arena *a, kf_backend *b, int n_layers, int kv_heads, int head_dim, int n_pages,
                        kf_dtype dtype, kf_error *err);
/* An arena whose pages hold n_held (1 .. n_layers) layers, for a model of n_layers: a forward that
 * runs layer by layer (kf_model_forward_layers) keeps only the layers it still reads (the
 * compaction's reference sources hold one). */
kf_status kf_arena_init_held(kf_arena *a, kf_backend *b, int n_layers, int n_held, int kv_heads, int head_dim,
                             int n_pages, kf_dtype dtype, kf_error *err);
/* Bytes of one element of a KV arena of dtype (4 for fp32, 2 for bf16). */
static inline size_t kf_arena_elem(kf_dtype dtype) {
    return dtype == KF_DTYPE_BF16 ? 2 : 4;
}
/* 0 and *out set for "f32" or "bf16" (the names of --arena-dtype), else -1. */
int kf_arena_dtype_parse(const char *name, kf_dtype *out);
const char *kf_arena_dtype_name(kf_dtype dtype);
void kf_arena_free(kf_arena *a);

/* Pages needed to hold n tokens. */
static inline int kf_pages_for(int64_t n_tokens) {
    return (int)((n_tokens + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS);
}

/* The paged view of one layer (its slot, layer % n_held), for kernels. */
kf_paged_kv kf_arena_layer(const kf_arena *a, int layer);

void kf_seq_init(kf_seq *s);
/* Release every page of s; s becomes empty (and may be reused). */
void kf_seq_release(kf_arena *a, kf_seq *s);

/* Make tokens [s->len, s->len + n) writable: copy a shared partial last page, add fresh pages.
 * Does not change s->len (the writer advances it once the tokens are written). */
kf_status kf_seq_reserve(kf_arena *a, kf_seq *s, int64_t n, kf_error *err);

/* dst (empty) becomes a document of len tokens sharing src's pages for [0, len). */
kf_status kf_seq_fork(kf_arena *a, const kf_seq *src, int64_t len, kf_seq *dst, kf_error *err);

/* Rewind s to len <= s->len tokens. */
kf_status kf_seq_truncate(kf_arena *a, kf_seq *s, int64_t len, kf_error *err);

/* Copy K and V of tokens [t0, t0 + n) of one layer to host buffers k, v: [n, kv_heads, head_dim]
 * (fp32: a bf16 arena's values widened, exactly). */
kf_status kf_seq_read_kv(const kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, float *k, float *v,
                         kf_error *err);

/* Write K and V of tokens [t0, t0 + n) of one layer from host buffers (pages must be writable:
 * reserved and not shared); a bf16 arena stores them rounded to nearest even. Used to attach a
 * cache built elsewhere (a compacted document). */
kf_status kf_seq_write_kv(kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, const float *k,
                          const float *v, kf_error *err);

#endif
