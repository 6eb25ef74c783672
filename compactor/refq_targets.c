#include "compactor/refq_targets.h"

#include <stdlib.h>
#include <string.h>

int64_t kf_refq_targets_bytes(int64_t n_held, int64_t kv_heads, int64_t R, int head_dim, int64_t n_doc) {
    return n_held * kv_heads * (4 * R * (head_dim + 2) + 8 * n_doc);
}

kf_status kf_refq_targets_init(kf_refq_targets *t, const kf_refq *rq, int n_doc, int score_rms, kf_error *err) {
    memset(t, 0, sizeof *t);
    *t = (kf_refq_targets){.n_layers = rq->n_layers, .n_held = rq->n_held, .kv_heads = rq->kv_heads, .head_dim = rq->head_dim,
                           .group = rq->group, .n_doc = n_doc, .n_pos = rq->n_pos, .R = rq->R,
                           .score_rms = score_rms};
    const size_t rows = (size_t)rq->n_held * rq->kv_heads * (size_t)rq->R;
    t->m = malloc(sizeof(float) * (rows ? rows : 1));
    t->y = malloc(sizeof(float) * (rows ? rows : 1));
    t->Y = malloc(sizeof(float) * (rows ? rows : 1) * rq->head_dim);
    t->score = calloc((size_t)rq->n_held * rq->kv_heads * (size_t)(n_doc ? n_doc : 1), sizeof(double));
    t->fused = calloc((size_t)(rq->n_pos ? rq->n_pos : 1), 1);
    if (!t->m || !t->y || !t->Y || !t->score || !t->fused) {
        const double mib = (double)kf_refq_targets_bytes(rq->n_held, rq->kv_heads, rq->R, rq->head_dim, n_doc);
        kf_refq_targets_free(t);
        return kf_fail(err, KF_ERR_NOMEM, "reference queries: out of memory for their targets (%.1f MiB)",
                       mib / (1 << 20));
    }
    return KF_OK;
}

int64_t kf_refq_targets_own_bytes(int64_t n_held, int64_t kv_heads, int64_t n_own_rows, int head_dim,
                                  int64_t n_pos) {
    return n_held * kv_heads * 4 * n_own_rows * (head_dim + 2) + 5 * n_pos;
}

kf_status kf_refq_targets_own_init(kf_refq_targets *t, const uint8_t *is_val, kf_error *err) {
    const size_t n_pos = (size_t)(t->n_pos ? t->n_pos : 1);
    t->own_slot = malloc(sizeof(int32_t) * n_pos);
    t->own_done = calloc(n_pos, 1);
    if (!t->own_slot || !t->own_done)
        return kf_fail(err, KF_ERR_NOMEM, "reference queries: out of memory for the held-out rows' prompts");
    t->n_own = 0;
    for (int64_t p = 0; p < t->n_pos; p++)
        t->own_slot[p] = is_val[p] ? (int32_t)t->n_own++ : -1;
    const size_t rows = (size_t)t->n_held * t->kv_heads * (size_t)t->group * (size_t)(t->n_own ? t->n_own : 1);
    t->am = malloc(sizeof(float) * rows);
    t->ay = malloc(sizeof(float) * rows);
    t->aY = malloc(sizeof(float) * rows * t->head_dim);
    if (!t->am || !t->ay || !t->aY) {
        const double mib = (double)kf_refq_targets_own_bytes(t->n_held, t->kv_heads, t->group * t->n_own,
                                                             t->head_dim, t->n_pos);
        return kf_fail(err, KF_ERR_NOMEM, "reference queries: out of memory for the held-out rows' prompts (%.1f MiB)",
                       mib / (1 << 20));
    }
    return KF_OK;
}

void kf_refq_targets_layer_reset(kf_refq_targets *t, int layer) {
    memset(kf_refq_targets_score(t, layer, 0), 0, sizeof(double) * (size_t)t->kv_heads * (size_t)t->n_doc);
}

void kf_refq_targets_free(kf_refq_targets *t) {
    free(t->m);
    free(t->y);
    free(t->Y);
    free(t->score);
    free(t->fused);
    free(t->own_slot);
    free(t->own_done);
    free(t->am);
    free(t->ay);
    free(t->aY);
    memset(t, 0, sizeof *t);
}

kf_status kf_refq_targets_dst_init(kf_refq_targets_dst *d, int n_layers, kf_error *err) {
    const size_t n = (size_t)(n_layers > 0 ? n_layers : 1);
    d->m = malloc(sizeof(float *) * n);
    d->y = malloc(sizeof(float *) * n);
    d->Y = malloc(sizeof(float *) * n);
    d->score = malloc(sizeof(double *) * n);
    d->am = malloc(sizeof(float *) * n);
    d->ay = malloc(sizeof(float *) * n);
    d->aY = malloc(sizeof(float *) * n);
    if (d->m && d->y && d->Y && d->score && d->am && d->ay && d->aY)
        return KF_OK;
    kf_refq_targets_dst_free(d);
    return kf_fail(err, KF_ERR_NOMEM, "reference queries: out of memory");
}

void kf_refq_targets_dst_free(kf_refq_targets_dst *d) {
    free(d->m);
    free(d->y);
    free(d->Y);
    free(d->score);
    free(d->am);
    free(d->ay);
    free(d->aY);
    memset(d, 0, sizeof *d);
}

void kf_refq_targets_capture(const kf_refq_targets *t, int64_t first, int blk0, int app0,
                             const kf_refq_targets_dst *dst, kf_forward_targets *fa) {
    /* like the queries, the pool is also [n_layers, n_heads, n_pos] (query head h = g * group + j) */
    for (int l = 0; l < t->n_layers; l++) {
        const size_t at = kf_refq_targets_row0(t, l, 0) + (size_t)first;
        dst->m[l] = t->m + at;
        dst->y[l] = t->y + at;
        dst->Y[l] = t->Y + at * t->head_dim;
        dst->score[l] = kf_refq_targets_score(t, l, 0);
    }
    *fa = (kf_forward_targets){.blk0 = blk0, .blk1 = blk0 + t->n_doc, .m = dst->m, .y = dst->y, .Y = dst->Y,
                               .row_stride = 1, .head_stride = (size_t)t->n_pos, .score = dst->score,
                               .score_stride = (size_t)t->n_doc, .score_rms = t->score_rms};
    fa->app0 = app0; /* always: the forward's sums in one order whether or not rows are held out */
    if (!t->am)
        return;
    for (int l = 0; l < t->n_layers; l++) {
        const size_t at = kf_refq_targets_own_row0(t, l, 0);
        dst->am[l] = t->am + at;
        dst->ay[l] = t->ay + at;
        dst->aY[l] = t->aY + at * t->head_dim;
    }
    fa->app_slot = t->own_slot + first, fa->am = dst->am, fa->ay = dst->ay, fa->aY = dst->aY;
    fa->app_head_stride = (size_t)t->n_own;
}
