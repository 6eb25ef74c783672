/* gram_tiles.c — the normal equations' row tiles: their buffers, and one tile's products added into
 * the fp64 sums.
 *
 * Rows of the design matrix in tiles of KF_GRAM_TILE: X [n, t] in fp32 (am.c's logits and softmax),
 * the tile's X^T X and X^T Y in fp32, added into G and B in fp64 (docs/decisions/fp32-tile-products.md):
 * no R x t matrix is ever held, and fp32 rounding stays within one tile's sums. The values' X and
 * targets Y are rounded to bf16 first (docs/decisions/bf16-gram.md). */
#include <stdlib.h>
#include <string.h>

#include "compactor/am.h"
#include "kernels/backend.h"

void kf_gram_tiles_free(kf_gram_tiles *w) {
    if (!w->in_ws)
        free(w->Z), free(w->X), free(w->Gt), free(w->L);
    memset(w, 0, sizeof *w);
}

/* w->Gt: beta's t x t fp32 products, or gram_bf16's scratch for a tile of the values' equations. */
static int64_t gt_floats(int t, int d) {
    const int t1 = t ? t : 1;
    return d > 0 ? (int64_t)kf_gram_bf16_work(KF_GRAM_TILE, t1, d) : (int64_t)t1 * t1;
}

int64_t kf_gram_tiles_bytes(int t, int d, int logits) {
    const int64_t t1 = t ? t : 1;
    return (logits + 1) * kf_ws_bytes(KF_GRAM_TILE * t1, sizeof(float)) + kf_ws_bytes(gt_floats(t, d), sizeof(float));
}

int kf_gram_tiles_alloc(kf_gram_tiles *w, int t, int d, int logits, kf_ws *ws) {
    const size_t t1 = (size_t)(t ? t : 1);
    memset(w, 0, sizeof *w);
    w->t = t, w->d = d;
    if (ws) {
        w->in_ws = 1;
        w->Z = logits ? kf_ws_alloc(ws, KF_GRAM_TILE * (int64_t)t1, sizeof(float)) : NULL;
        w->X = kf_ws_alloc(ws, KF_GRAM_TILE * (int64_t)t1, sizeof(float));
        w->Gt = kf_ws_alloc(ws, gt_floats(t, d), sizeof(float));
        return (w->Z || !logits) && w->X && w->Gt ? 0 : -1;
    }
    w->Z = logits ? malloc(sizeof(float) * KF_GRAM_TILE * t1) : NULL;
    w->X = malloc(sizeof(float) * KF_GRAM_TILE * t1);
    w->Gt = malloc(sizeof(float) * (size_t)gt_floats(t, d));
    if ((w->Z || !logits) && w->X && w->Gt)
        return 0;
    kf_gram_tiles_free(w);
    return -1;
}

int kf_kept_logits_rows(int R, int t) {
    const int64_t per_row = (int64_t)(t > 0 ? t : 1) * (int64_t)sizeof(float);
    if ((int64_t)R * per_row <= KF_KEPT_LOGITS_MAX)
        return R;
    return (int)(KF_KEPT_LOGITS_MAX / per_row / KF_GRAM_TILE * KF_GRAM_TILE);
}

int64_t kf_kept_logits_bytes(int rows, int t) {
    return rows > 0 ? kf_ws_bytes((int64_t)rows * (t > 0 ? t : 1), sizeof(float)) : 0;
}

int kf_gram_tiles_keep_logits(kf_gram_tiles *w, int rows, kf_ws *ws) {
    const size_t n = (size_t)rows * (size_t)(w->t > 0 ? w->t : 1);
    w->L_rows = 0;
    if (rows <= 0)
        return 0;
    w->L = w->in_ws ? kf_ws_alloc(ws, (int64_t)n, sizeof(float)) : malloc(sizeof(float) * n);
    if (!w->L)
        return -1;
    w->L_rows = rows;
    return 0;
}

/* am.h. The values' equations: docs/decisions/bf16-gram.md; beta's: ssyrk into w->Gt. */
void kf_gram_tile_add(const kf_backend *be, float *X, const float *Y, int n, int t, int d, const kf_gram_tiles *w,
                      double *G, double *B, int first) {
    if (B) {
        kf_solve_gram_bf16(be, X, n, t, Y, d, w->Gt, G, t, B, d, first);
        return;
    }
    kf_solve_ssyrk(be, KF_TRANS, t, n, 1.0f, X, t, 0.0f, w->Gt, t);
    for (int r = 0; r < t; r++) {
        double *g = G + (size_t)r * t;
        const float *gt = w->Gt + (size_t)r * t;
        for (int c = r; c < t; c++)
            g[c] = (first ? 0.0 : g[c]) + gt[c];
    }
}
