/* workspace.c — the bump allocator of kernels/workspace.h. */
#include "kernels/workspace.h"

#include <stdlib.h>
#include <string.h>

/* Under AddressSanitizer the block's bytes outside live requests are poisoned: a buffer overrun
 * into its padding or into given-back scratch is reported as it would be for malloc's blocks. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define WS_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define WS_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define WS_POISON(p, n) ((void)(p), (void)(n))
#define WS_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

int kf_ws_init(kf_ws *ws, int64_t cap) {
    memset(ws, 0, sizeof *ws);
    ws->raw = malloc((size_t)(cap > 0 ? cap : 0) + KF_WS_ALIGN);
    if (!ws->raw)
        return -1;
    ws->base = (unsigned char *)(((uintptr_t)ws->raw + KF_WS_ALIGN - 1) & ~(uintptr_t)(KF_WS_ALIGN - 1));
    ws->cap = (size_t)(cap > 0 ? cap : 0);
    WS_POISON(ws->base, ws->cap);
    return 0;
}

void kf_ws_free(kf_ws *ws) {
    if (ws->base)
        WS_UNPOISON(ws->base, ws->cap);
    free(ws->raw);
    memset(ws, 0, sizeof *ws);
}

void *kf_ws_alloc(kf_ws *ws, int64_t n, int64_t size) {
    const int64_t b = kf_ws_bytes(n, size);
    if (n < 0 || size < 0 || !ws->base || (size_t)b > ws->cap - ws->used)
        return NULL;
    void *p = ws->base + ws->used;
    WS_UNPOISON(p, (size_t)(n * size));
    ws->used += (size_t)b;
    ws->peak = ws->used > ws->peak ? ws->used : ws->peak;
    return p;
}

void *kf_ws_zalloc(kf_ws *ws, int64_t n, int64_t size) {
    void *p = kf_ws_alloc(ws, n, size);
    if (p)
        memset(p, 0, (size_t)(n * size));
    return p;
}

kf_ws *kf_ws_or_own(kf_ws *ws, kf_ws *own, int64_t bytes) {
    memset(own, 0, sizeof *own);
    if (ws)
        return ws;
    return kf_ws_init(own, bytes) == 0 ? own : NULL;
}

void kf_ws_reset(kf_ws *ws, size_t mark) {
    if (mark < ws->used)
        WS_POISON(ws->base + mark, ws->used - mark);
    ws->used = mark;
}
