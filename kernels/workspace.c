/* workspace.c — the bump allocator of kernels/workspace.h. */
#include "kernels/workspace.h"

#include <stdlib.h>
#include <string.h>

int kf_ws_init(kf_ws *ws, int64_t cap) {
    memset(ws, 0, sizeof *ws);
    ws->raw = malloc((size_t)(cap > 0 ? cap : 0) + KF_WS_ALIGN);
    if (!ws->raw)
        return -1;
    ws->base = (unsigned char *)(((uintptr_t)ws->raw + KF_WS_ALIGN - 1) & ~(uintptr_t)(KF_WS_ALIGN - 1));
    ws->cap = (size_t)(cap > 0 ? cap : 0);
    return 0;
}

void kf_ws_free(kf_ws *ws) {
    free(ws->raw);
    memset(ws, 0, sizeof *ws);
}

void *kf_ws_alloc(kf_ws *ws, int64_t n, int64_t size) {
    const int64_t b = kf_ws_bytes(n, size);
    if (n < 0 || size < 0 || !ws->base || (size_t)b > ws->cap - ws->used)
        return NULL;
    void *p = ws->base + ws->used;
    ws->used += (size_t)b;
    ws->peak = ws->used > ws->peak ? ws->used : ws->peak;
    return p;
}

void *kf_ws_zalloc(kf_ws *ws, int64_t n, int64_t size) {
    void *p = kf_ws_alloc(ws, n, size);
    if (p)
        memset(p, 0, (size_t)kf_ws_bytes(n, size));
    return p;
}

kf_ws *kf_ws_or_own(kf_ws *ws, kf_ws *own, int64_t bytes) {
    memset(own, 0, sizeof *own);
    if (ws)
        return ws;
    return kf_ws_init(own, bytes) == 0 ? own : NULL;
}
