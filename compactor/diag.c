#include "compactor/diag.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/sort.h"

/* Unnormalised attention over the first n keys of one block for one query, in fp64: returns the
 * block's LSE and (acc not NULL) adds exp(z - ref) * v into acc and exp(z - ref) into *mass, ref a
 * shared shift, or the LSE itself when own_ref. NAN when out of memory. */
static double block_lse_acc(const float *q, int d, float scale, const kf_kv_block *b, int n, int own_ref, double ref,
                            double *acc, double *mass) {
    double mx = -INFINITY;
    double *z = malloc(sizeof(double) * (size_t)(n ? n : 1));
    if (!z)
        return NAN;
    for (int j = 0; j < n; j++) {
        double dot = 0;
        const float *k = b->k + (size_t)j * b->stride;
        for (int c = 0; c < d; c++)
            dot += (double)q[c] * k[c];
        z[j] = dot * scale + (b->beta ? b->beta[j] : 0.0);
        mx = z[j] > mx ? z[j] : mx;
    }
    double sum = 0;
    for (int j = 0; j < n; j++)
        sum += exp(z[j] - mx);
    const double lse = mx + log(sum);
    ref = own_ref ? lse : ref;
    if (acc)
        for (int j = 0; j < n; j++) {
            const double w = exp(z[j] - ref);
            *mass += w;
            const float *v = b->v + (size_t)j * b->stride;
            for (int c = 0; c < d; c++)
                acc[c] += w * v[c];
        }
    free(z);
    return lse;
}

void kf_diag_ref_free(kf_diag_ref *ref) {
    if (!ref)
        return;
    free(ref->lse);
    free(ref->o);
    free(ref->m);
    memset(ref, 0, sizeof *ref);
}

kf_status kf_diag_ref_init(kf_diag_ref *ref, const float *q, int R, int d, float scale, const kf_kv_block *orig,
                           const kf_kv_block *appended, const int *visible, kf_error *err) {
    memset(ref, 0, sizeof *ref);
    ref->R = R, ref->d = d;
    ref->lse = malloc(sizeof(double) * (size_t)(R ? R : 1));      /* [R] */
    ref->o = calloc((size_t)(R ? R : 1) * d, sizeof(double));     /* [R, d] */
    ref->m = calloc((size_t)(R ? R : 1), sizeof(double));         /* [R] */
    if (!ref->lse || !ref->o || !ref->m) {
        kf_diag_ref_free(ref);
        return kf_fail(err, KF_ERR_NOMEM, "diagnostics: out of memory");
    }
    for (int i = 0; i < R; i++) {
        const float *qi = q + (size_t)i * d;
        const int na = appended ? (visible ? visible[i] : appended->n) : 0;
        double *o1 = ref->o + (size_t)i * d;
        ref->lse[i] = block_lse_acc(qi, d, scale, orig, orig->n, 1, 0, o1, &ref->m[i]);
        if (na > 0)
            block_lse_acc(qi, d, scale, appended, na, 0, ref->lse[i], o1, &ref->m[i]);
    }
    return KF_OK;
}

kf_status kf_diag_head_vs(const kf_diag_ref *ref, const float *q, float scale, const kf_kv_block *comp,
                          const kf_kv_block *appended, const int *visible, kf_head_diag *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    const int R = ref->R, d = ref->d;
    double *o2 = malloc(sizeof(double) * d);
    if (!o2)
        return kf_fail(err, KF_ERR_NOMEM, "diagnostics: out of memory");
    double lse_sum = 0, out_sum = 0;
    for (int i = 0; i < R; i++) {
        const float *qi = q + (size_t)i * d;
        const int na = appended ? (visible ? visible[i] : appended->n) : 0;
        const double lse_o = ref->lse[i], m1 = ref->m[i];
        const double *o1 = ref->o + (size_t)i * d;
        /* outputs over [block | appended], shifted by the original block's LSE for range */
        double m2 = 0;
        memset(o2, 0, sizeof(double) * d);
        const double lse_c = block_lse_acc(qi, d, scale, comp, comp->n, 0, lse_o, o2, &m2);
        lse_sum += fabs(lse_c - lse_o);
        if (na > 0)
            block_lse_acc(qi, d, scale, appended, na, 0, lse_o, o2, &m2);
        double num = 0, den = 0;
        for (int c = 0; c < d; c++) {
            const double a = o1[c] / m1, b = o2[c] / m2;
            num += (a - b) * (a - b);
            den += a * a;
        }
        out_sum += den > 0 ? sqrt(num / den) : 0;
    }
    out->lse_err = R ? lse_sum / R : 0;
    out->out_err = R ? out_sum / R : 0;
    free(o2);
    return KF_OK;
}

kf_status kf_diag_head(const float *q, int R, int d, float scale, const kf_kv_block *orig, const kf_kv_block *comp,
                       const kf_kv_block *appended, const int *visible, kf_head_diag *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    kf_diag_ref ref;
    KF_TRY(kf_diag_ref_init(&ref, q, R, d, scale, orig, appended, visible, err));
    const kf_status rc = kf_diag_head_vs(&ref, q, scale, comp, appended, visible, out, err);
    kf_diag_ref_free(&ref);
    return rc;
}

void kf_val_head_free(kf_val_head *v) {
    if (v->in_ws) {
        memset(v, 0, sizeof *v);
        return;
    }
    free(v->w);
    free(v->lse_a);
    free(v->o_a);
    free(v->o_full);
    free(v->Z);
    free(v->lse_b);
    free(v->wa);
    free(v->den);
    free(v->o_b);
    free(v->tmp);
    memset(v, 0, sizeof *v);
}

/* Z [v->n, nk] holds the candidate's attention weights (grown when needed); 0 or -1. */
static int z_reserve(kf_val_head *v, size_t rows, size_t nk) {
    if (rows * nk <= v->z_cap)
        return 0;
    if (v->in_ws) /* a workspace's Z has the size its init was given */
        return -1;
    float *z = realloc(v->Z, sizeof(float) * rows * nk);
    if (!z)
        return -1;
    v->Z = z;
    v->z_cap = rows * nk;
    return 0;
}

/* Softmax attention of rows q [n, d] over one block: lse [n] and output o [n, d]; P [n, b->n]
 * receives the weights. */
static void block_attend(const kf_backend *be, int n, int d, float scale, const float *q, const kf_kv_block *b,
                         float *P, double *lse, float *o) {
    if (b->n == 0) {
        for (int i = 0; i < n; i++)
            lse[i] = -INFINITY;
        if (o) /* kf_val_attend passes none */
            memset(o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    kf_solve_sgemm(be, KF_NO_TRANS, KF_TRANS, n, b->n, d, scale, q, d, b->k, b->stride, 0.0f, P, b->n);
    kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = P, .ldx = b->n, .rows = n, .n = b->n, .bias = b->beta,
                                                      .lse_out = lse});
    if (o)
        kf_solve_sgemm(be, KF_NO_TRANS, KF_NO_TRANS, n, d, b->n, 1.0f, P, b->n, b->v, b->stride, 0.0f, o, d);
}

/* Row i's weights of the block (lse_b) and of its appended block. */
static void mix_weights(const kf_val_head *v, int i, double lse_b, double *wb, double *wa) {
    const double la = v->lse_a[i], m = lse_b > la ? lse_b : la;
    *wb = exp(lse_b - m), *wa = isinf(la) ? 0 : exp(la - m);
}

/* The output over [block | appended] for row i from the two blocks' weights and the block's output. */
static void mix_with(const kf_val_head *v, int i, double wb, double wa, const float *o_b, double *out) {
    const float *oa = v->o_a + (size_t)i * v->d;
    for (int c = 0; c < v->d; c++)
        out[c] = (wb * o_b[c] + wa * oa[c]) / (wb + wa);
}

/* The output over [block | appended] for row i from the block's lse and output. */
static void mix(const kf_val_head *v, int i, double lse_b, const float *o_b, double *out) {
    double wb, wa;
    mix_weights(v, i, lse_b, &wb, &wa);
    mix_with(v, i, wb, wa, o_b, out);
}

/* A validation row in the order the appended blocks are attended in. */
typedef struct {
    const kf_kv_block *a;
    int vis, i;
} app_row;

static int by_block_then_visible(const void *x, const void *y) {
    const app_row *p = x, *q = y;
    if (p->a != q->a)
        return (uintptr_t)p->a < (uintptr_t)q->a ? -1 : 1;
    if (p->vis != q->vis)
        return p->vis < q->vis ? -1 : 1;
    return (p->i > q->i) - (p->i < q->i);
}

/* Rows r [nr] (one appended block, visible counts ascending) in tiles of APP_TILE: Z = s Q K^T over
 * the tile's largest visible count, each row's causal cut (weights past its count zeroed), the
 * row softmax, then O = P V. qt, ot [APP_TILE, d] and Z [APP_TILE, a->n] are scratch. */
#define APP_TILE 64
static void appended_attend(kf_val_head *v, const app_row *r, int nr, float *qt, float *ot) {
    const int d = v->d;
    const kf_kv_block *a = r[0].a;
    for (int i0 = 0; i0 < nr; i0 += APP_TILE) {
        const int n = nr - i0 < APP_TILE ? nr - i0 : APP_TILE, nk = r[i0 + n - 1].vis;
        int vis[APP_TILE];
        double lse[APP_TILE];
        for (int i = 0; i < n; i++) {
            memcpy(qt + (size_t)i * d, v->q + (size_t)r[i0 + i].i * d, sizeof(float) * d);
            vis[i] = r[i0 + i].vis;
        }
        kf_solve_sgemm(v->be, KF_NO_TRANS, KF_TRANS, n, nk, d, v->scale, qt, d, a->k, a->stride, 0.0f, v->Z, nk);
        kf_solve_softmax_rows(v->be, &(kf_softmax_rows_args){.x = v->Z, .ldx = nk, .rows = n, .n = nk, .len = vis,
                                                             .lse_out = lse}); /* causal: weights past vis are 0 */
        for (int i = 0; i < n; i++)
            v->lse_a[r[i0 + i].i] = lse[i];
        kf_solve_sgemm(v->be, KF_NO_TRANS, KF_NO_TRANS, n, d, nk, 1.0f, v->Z, nk, a->v, a->stride, 0.0f, ot, d);
        for (int i = 0; i < n; i++)
            memcpy(v->o_a + (size_t)r[i0 + i].i * d, ot + (size_t)i * d, sizeof(float) * d);
    }
}

static int64_t appended_bytes(int n, int d) {
    return 2 * kf_ws_bytes(n, sizeof(app_row)) + 2 * kf_ws_bytes((int64_t)APP_TILE * d, sizeof(float));
}

/* lse_a and o_a of every row: the rows grouped by appended block, each group attended in tiles;
 * the scratch from ws (appended_bytes). */
static int appended_all(kf_val_head *v, const kf_kv_block *const *app, const int *visible, kf_ws *ws) {
    const int n = v->n, d = v->d;
    const size_t mark = kf_ws_mark(ws);
    app_row *r = kf_ws_alloc(ws, n, sizeof *r), *tmp = kf_ws_alloc(ws, n, sizeof *r); /* [n] rows, the sort's */
    float *qt = kf_ws_alloc(ws, (int64_t)APP_TILE * d, sizeof(float));
    float *ot = kf_ws_alloc(ws, (int64_t)APP_TILE * d, sizeof(float)); /* [APP_TILE, d] */
    int nr = 0, rc = r && tmp && qt && ot ? 0 : -1;
    for (int i = 0; i < n && rc == 0; i++) {
        const kf_kv_block *a = app ? app[i] : NULL;
        const int na = a ? (visible ? visible[i] : a->n) : 0;
        v->lse_a[i] = -INFINITY; /* o_a is zero (calloc) for rows without an appended block */
        if (na > 0)
            r[nr++] = (app_row){a, na, i};
    }
    if (rc == 0)
        kf_sort(r, (size_t)nr, sizeof *r, by_block_then_visible, tmp);
    for (int g0 = 0, g1; rc == 0 && g0 < nr; g0 = g1) {
        for (g1 = g0; g1 < nr && r[g1].a == r[g0].a; g1++)
            ;
        rc = z_reserve(v, APP_TILE, (size_t)r[g1 - 1].vis);
        if (rc == 0)
            appended_attend(v, r + g0, g1 - g0, qt, ot);
    }
    kf_ws_reset(ws, mark);
    return rc;
}

/* o_full from the original block's lse_b and o_b (filled by the caller) and the appended block's. */
static void mix_full(kf_val_head *v) {
    const int d = v->d;
    for (int i = 0; i < v->n; i++) {
        mix(v, i, v->lse_b[i], v->o_b + (size_t)i * d, v->tmp);
        double den = 0;
        for (int c = 0; c < d; c++) {
            const double ref = v->o_full[(size_t)i * d + c] = (float)v->tmp[c];
            den += ref * ref;
        }
        v->den[i] = den;
    }
}

/* The original block's attention over row tiles (ORIG_TILE x T weights at a time) into lse_b, o_b. */
#define ORIG_TILE 256
static int original_all(kf_val_head *v, const kf_kv_block *orig) {
    const int n = v->n, d = v->d;
    if (z_reserve(v, ORIG_TILE, (size_t)orig->n) != 0)
        return -1;
    for (int i0 = 0; i0 < n; i0 += ORIG_TILE) {
        const int m = n - i0 < ORIG_TILE ? n - i0 : ORIG_TILE;
        block_attend(v->be, m, d, v->scale, v->q + (size_t)i0 * d, orig, v->Z, v->lse_b + i0, v->o_b + (size_t)i0 * d);
    }
    return 0;
}

/* The rows' weights w [n] (NULL: uniform), normalised. */
static void val_weights(kf_val_head *v, const double *w) {
    double wsum = 0;
    for (int i = 0; i < v->n; i++)
        wsum += (v->w[i] = w ? w[i] : 1.0);
    for (int i = 0; i < v->n; i++)
        v->w[i] = wsum > 0 ? v->w[i] / wsum : 0;
}

/* The head's buffers from ws, Z for z_cap floats (in_ws); 0 or -1. */
static int val_head_carve(kf_val_head *v, int64_t z_cap, kf_ws *ws) {
    const int64_t n1 = v->n ? v->n : 1, d = v->d;
    v->in_ws = 1;
    v->w = kf_ws_alloc(ws, n1, sizeof(double));
    v->lse_a = kf_ws_alloc(ws, n1, sizeof(double));
    v->o_a = kf_ws_zalloc(ws, n1 * d, sizeof(float));
    v->o_full = kf_ws_alloc(ws, n1 * d, sizeof(float));
    v->lse_b = kf_ws_alloc(ws, n1, sizeof(double));
    v->wa = kf_ws_alloc(ws, n1, sizeof(double));
    v->den = kf_ws_alloc(ws, n1, sizeof(double));
    v->o_b = kf_ws_alloc(ws, n1 * d, sizeof(float));
    v->tmp = kf_ws_alloc(ws, d, sizeof(double));
    v->Z = kf_ws_alloc(ws, z_cap, sizeof(float));
    v->z_cap = (size_t)z_cap;
    return v->w && v->lse_a && v->o_a && v->o_full && v->lse_b && v->wa && v->den && v->o_b && v->tmp && v->Z ? 0
                                                                                                              : -1;
}

/* The most keys of an appended block a row sees. */
static int max_visible(int n, const kf_kv_block *const *app, const int *visible) {
    int most = 0;
    for (int i = 0; i < n; i++) {
        const int na = app && app[i] ? (visible ? visible[i] : app[i]->n) : 0;
        most = na > most ? na : most;
    }
    return most;
}

int64_t kf_val_head_bytes(int n, int d, int max_keys, int max_vis) {
    const int64_t n1 = n ? n : 1;
    const int64_t z = kf_ws_max(n1 * max_keys, (int64_t)APP_TILE * max_vis);
    return 5 * kf_ws_bytes(n1, sizeof(double)) + 3 * kf_ws_bytes(n1 * d, sizeof(float)) +
           kf_ws_bytes(d, sizeof(double)) + kf_ws_bytes(z, sizeof(float)) + appended_bytes(n, d);
}

/* The head's buffers, weights and appended blocks (what both initialisations share): from ws with
 * Z for max_keys keys, or (ws NULL) from the heap, Z grown as needed. */
static int val_head_common(kf_val_head *v, const kf_backend *be, const float *q, int n, int d, float scale,
                           const double *w, const kf_kv_block *const *app, const int *visible, int max_keys,
                           kf_ws *ws) {
    memset(v, 0, sizeof *v);
    v->n = n, v->d = d, v->scale = scale, v->q = q, v->be = be;
    const size_t n1 = (size_t)(n ? n : 1);
    if (ws) {
        const int64_t z = kf_ws_max((int64_t)n1 * max_keys, (int64_t)APP_TILE * max_visible(n, app, visible));
        if (val_head_carve(v, z, ws) != 0 || appended_all(v, app, visible, ws) != 0)
            return -1;
        val_weights(v, w);
        return 0;
    }
    v->w = malloc(sizeof(double) * n1);
    v->lse_a = malloc(sizeof(double) * n1);
    v->o_a = calloc(n1 * d, sizeof(float));
    v->o_full = malloc(sizeof(float) * n1 * d);
    v->lse_b = malloc(sizeof(double) * n1);
    v->wa = malloc(sizeof(double) * n1);
    v->den = malloc(sizeof(double) * n1);
    v->o_b = malloc(sizeof(float) * n1 * d);
    v->tmp = malloc(sizeof(double) * (size_t)d);
    if (!v->w || !v->lse_a || !v->o_a || !v->o_full || !v->lse_b || !v->wa || !v->den || !v->o_b || !v->tmp)
        return -1;
    kf_ws own, *sw = kf_ws_or_own(NULL, &own, appended_bytes(n, d));
    const int rc = sw ? appended_all(v, app, visible, sw) : -1;
    kf_ws_free(&own);
    if (rc != 0)
        return -1;
    val_weights(v, w);
    return 0;
}

kf_status kf_val_head_init(kf_val_head *v, const kf_backend *be, const float *q, int n, int d, float scale,
                           const double *w, const kf_kv_block *orig, const kf_kv_block *const *app, const int *visible,
                           kf_error *err) {
    if (val_head_common(v, be, q, n, d, scale, w, app, visible, 0, NULL) != 0 || original_all(v, orig) != 0) {
        kf_val_head_free(v);
        return kf_fail(err, KF_ERR_NOMEM, "validation: out of memory (%d queries, %d keys)", n, orig->n);
    }
    mix_full(v);
    return KF_OK;
}

kf_status kf_val_head_init_targets(kf_val_head *v, const kf_backend *be, const float *q, int n, int d, float scale,
                                   const double *w, const float *m, const float *y, const float *Y,
                                   const kf_kv_block *const *app, const int *visible, const double *lse_a,
                                   const float *o_a, int max_keys, kf_ws *ws, kf_error *err) {
    if (val_head_common(v, be, q, n, d, scale, w, app, visible, max_keys, ws) != 0) {
        kf_val_head_free(v);
        return kf_fail(err, KF_ERR_NOMEM, "validation: out of memory (%d queries)", n);
    }
    for (int i = 0; lse_a && i < n; i++)
        if (!app || !app[i]) {
            v->lse_a[i] = lse_a[i];
            memcpy(v->o_a + (size_t)i * d, o_a + (size_t)i * d, sizeof(float) * d);
        }
    for (int i = 0; i < n; i++)
        v->lse_b[i] = m[i] + log((double)y[i]);
    memcpy(v->o_b, Y, sizeof(float) * (size_t)n * d);
    mix_full(v);
    return KF_OK;
}

int kf_val_attend(kf_val_head *v, const kf_kv_block *keys) {
    if (z_reserve(v, (size_t)v->n, (size_t)keys->n) != 0)
        return -1;
    block_attend(v->be, v->n, v->d, v->scale, v->q, keys, v->Z, v->lse_b, NULL);
    v->z_n = keys->n;
    for (int i = 0; i < v->n; i++) { /* the mixing weights, normalised, once for every value set scored */
        double wb, wa;
        mix_weights(v, i, v->lse_b[i], &wb, &wa);
        v->lse_b[i] = wb / (wb + wa), v->wa[i] = wa / (wb + wa);
    }
    return 0;
}

/* Independent partial sums of a row's squared error (the alpha grid scores 4 value sets per
 * candidate: one sequential sum over d waited on each add). */
#define ERR_LANES 8

double kf_val_err_values(kf_val_head *v, const float *values, size_t stride) {
    const int n = v->n, d = v->d, nk = v->z_n;
    if (nk > 0)
        kf_solve_sgemm(v->be, KF_NO_TRANS, KF_NO_TRANS, n, d, nk, 1.0f, v->Z, nk, values, stride, 0.0f, v->o_b, d);
    else
        memset(v->o_b, 0, sizeof(float) * (size_t)n * d);
    double e = 0;
    for (int i = 0; i < n; i++) { /* the output over [block | appended] (mix_with's, weights normalised) */
        const float *ob = v->o_b + (size_t)i * d, *oa = v->o_a + (size_t)i * d, *of = v->o_full + (size_t)i * d;
        const double wb = v->lse_b[i], wa = v->wa[i];
        double acc[ERR_LANES] = {0}, num = 0; /* lane k sums the columns c = k mod ERR_LANES */
        int c = 0;
        for (; c + ERR_LANES <= d; c += ERR_LANES)
            for (int k = 0; k < ERR_LANES; k++) {
                const double diff = (wb * ob[c + k] + wa * oa[c + k]) - of[c + k];
                acc[k] += diff * diff;
            }
        for (; c < d; c++) {
            const double diff = (wb * ob[c] + wa * oa[c]) - of[c];
            num += diff * diff;
        }
        for (int k = 0; k < ERR_LANES; k++)
            num += acc[k];
        e += v->w[i] * (v->den[i] > 0 ? sqrt(num / v->den[i]) : 0);
    }
    return e;
}

double kf_val_err(kf_val_head *v, const kf_kv_block *comp) {
    if (kf_val_attend(v, comp) != 0)
        return NAN;
    return kf_val_err_values(v, comp->v, comp->stride);
}
