/* arena.h — the paged KV arena: every prefill writes its keys and values here.
 *
 * Storage is one backend allocation of n_pages pages. A page holds KF_PAGE_TOKENS (16)
 * consecutive tokens of one document, for every layer:
 *
 *   page p:  [n_layers][2 (K, V)][16 tokens][kv_heads][head_dim]   fp32 (CPU backend)
 *
 * so a page is copied in one piece (copy-on-write) and one layer's K of page p starts at
 * storage + p * page_stride + layer * 2 * block + 0, its V at ... + block, block = 16*kv_heads*head_dim.
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

#include "formats/error.h"
#include "kernels/backend.h"

typedef struct {
    kf_backend *backend;
    int n_layers;
    int n_held;           /* layers a page holds: n_layers, or fewer (kf_arena_init_held): layer l in slot
                             l % n_held, overwritten by layer l + n_held */
    int kv_heads;
    int head_dim;
    int n_pages;
    float *storage;       /* [n_pages, n_held, 2, 16, kv_heads, head_dim] backend memory */
    size_t page_stride;   /* floats per page */
    size_t block;         /* floats per (page, layer, K or V): 16 * kv_heads * head_dim */
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

kf_status kf_arena_init(kf_arena *a, kf_backend *b, int n_layers, int kv_heads, int head_dim, int n_pages,
                        kf_error *err);
/* An arena whose pages hold n_held (1 .. n_layers) layers, for a model of n_layers: a forward that
 * runs layer by layer (kf_model_forward_layers) keeps only the layers it still reads (the
 * compaction's reference sources hold one). */
kf_status kf_arena_init_held(kf_arena *a, kf_backend *b, int n_layers, int n_held, int kv_heads, int head_dim,
                             int n_pages, kf_error *err);
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

/* Copy K and V of tokens [t0, t0 + n) of one layer to host buffers k, v: [n, kv_heads, head_dim]. */
kf_status kf_seq_read_kv(const kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, float *k, float *v,
                         kf_error *err);

/* Write K and V of tokens [t0, t0 + n) of one layer from host buffers (pages must be writable:
 * reserved and not shared). Used to attach a cache built elsewhere (a compacted document). */
kf_status kf_seq_write_kv(kf_arena *a, const kf_seq *s, int layer, int64_t t0, int64_t n, const float *k,
                          const float *v, kf_error *err);

#endif
