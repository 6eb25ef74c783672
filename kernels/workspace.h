/* workspace.h — one block of scratch per thread, handed out by bumping an offset.
 *
 * The solve's per-head path allocates nothing: every function on it takes a kf_ws and carves its
 * buffers from it, and a sizing function beside it says how many bytes it takes for given shapes
 * (kf_ws_bytes of each buffer, summed over what is held at once, the maximum over what is not).
 * The job sizes each thread's block once from those functions, the same ones the memory formula
 * adds up (compactor/compact_mem.c), so the formula's per-thread term is the declared size.
 *
 *   size_t m = kf_ws_mark(ws);           a scope
 *   double *G = kf_ws_alloc(ws, t * t, sizeof *G);    [t, t], 64-byte aligned (SIMD, cache lines)
 *   ...
 *   kf_ws_reset(ws, m);                  everything since the mark is free again
 *
 * A request that does not fit returns NULL (a sizing function that undercounts: the caller reports
 * it as KF_ERR_NOMEM); the block never grows. Not thread-safe: one per thread. */
#ifndef KF_WORKSPACE_H
#define KF_WORKSPACE_H

#include <stddef.h>
#include <stdint.h>

#define KF_WS_ALIGN 64

typedef struct {
    void *raw;           /* the one allocation (malloc: what a heap counter sees) */
    unsigned char *base; /* [cap] inside raw, KF_WS_ALIGN-aligned */
    size_t cap;          /* bytes */
    size_t used;         /* bytes handed out (a multiple of KF_WS_ALIGN) */
    size_t peak;         /* the most ever handed out at once */
} kf_ws;

/* The bytes one kf_ws_alloc(ws, n, size) takes: n * size rounded up to KF_WS_ALIGN. */
static inline int64_t kf_ws_bytes(int64_t n, int64_t size) {
    const int64_t b = n > 0 ? n * size : 0;
    return (b + KF_WS_ALIGN - 1) / KF_WS_ALIGN * KF_WS_ALIGN;
}

static inline int64_t kf_ws_max(int64_t a, int64_t b) {
    return a > b ? a : b;
}

/* A block of cap bytes (0: an empty one, in which only empty requests fit); 0, or -1 when out of
 * memory. */
int kf_ws_init(kf_ws *ws, int64_t cap);
void kf_ws_free(kf_ws *ws);

/* n elements of size bytes (uninitialised), or NULL when they do not fit. n = 0 gives a valid
 * pointer to no bytes. */
void *kf_ws_alloc(kf_ws *ws, int64_t n, int64_t size);
/* kf_ws_alloc, zeroed. */
void *kf_ws_zalloc(kf_ws *ws, int64_t n, int64_t size);

/* ws itself, or (ws NULL: a function called without one) a block of `bytes` of its own in *own,
 * which the function frees (kf_ws_free(own): nothing when ws was given); NULL when out of memory. */
kf_ws *kf_ws_or_own(kf_ws *ws, kf_ws *own, int64_t bytes);

static inline size_t kf_ws_mark(const kf_ws *ws) {
    return ws->used;
}
/* Gives back everything handed out since mark (kf_ws_mark). */
void kf_ws_reset(kf_ws *ws, size_t mark);

#endif
