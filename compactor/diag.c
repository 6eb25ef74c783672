#include "compactor/diag.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "kernels/cpu/cpu_kernels.h"

/* Unnormalised attention over one block for one query: returns the block's LSE and adds
 * exp(z - ref) * v into acc (ref a shared shift); *mass += sum exp(z - ref). Done in fp64. */
static double block_pass(const float *q, int d, float scale, const kf_kv_block *b, int n, double ref, double *acc,
                         double *mass) {
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

/* block_pass twice over the same keys, the scores computed once: the block's LSE, then (acc not
 * NULL) exp(z - ref) * v added into acc and *mass, ref = the LSE itself when own_ref. The same
 * arithmetic as the two calls, so the same bits. */
static double block_lse_acc(const float *q, int d, float scale, const kf_kv_block *b, int own_ref, double ref,
                            double *acc, double *mass) {
    const int n = b->n;
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
        ref->lse[i] = block_lse_acc(qi, d, scale, orig, 1, 0, o1, &ref->m[i]);
        if (na > 0)
            block_pass(qi, d, scale, appended, na, ref->lse[i], o1, &ref->m[i]);
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
        const double lse_c = block_lse_acc(qi, d, scale, comp, 0, lse_o, o2, &m2);
        lse_sum += fabs(lse_c - lse_o);
        if (na > 0)
            block_pass(qi, d, scale, appended, na, lse_o, o2, &m2);
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
    free(v->w);
    free(v->lse_a);
    free(v->o_a);
    free(v->o_full);
    free(v->Z);
    memset(v, 0, sizeof *v);
}

/* Softmax attention of every query over one block: lse [n] and output o [n, d]. */
static int block_attend(kf_val_head *v, const kf_kv_block *b, double *lse, float *o) {
    const int n = v->n, d = v->d;
    if (b->n == 0) {
        for (int i = 0; i < n; i++)
            lse[i] = -INFINITY;
        memset(o, 0, sizeof(float) * (size_t)n * d);
        return 0;
    }
    if ((size_t)b->n > v->z_cap) {
        float *z = realloc(v->Z, sizeof(float) * (size_t)n * b->n);
        if (!z)
            return -1;
        v->Z = z;
        v->z_cap = (size_t)b->n;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, b->n, d, v->scale, v->q, d, b->k, (int)b->stride, 0.0f,
                v->Z, b->n);
    for (int i = 0; i < n; i++) {
        float *z = v->Z + (size_t)i * b->n, mx;
        double sum;
        if (b->beta)
            for (int j = 0; j < b->n; j++)
                z[j] += b->beta[j];
        kf_cpu_softmax_row(z, b->n, &mx, &sum);
        lse[i] = mx + log(sum);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, b->n, 1.0f, v->Z, b->n, b->v, (int)b->stride, 0.0f, o,
                d);
    return 0;
}

/* The output over [block | appended] for row i from the block's lse and output. */
static void mix(const kf_val_head *v, int i, double lse_b, const float *o_b, double *out) {
    const double la = v->lse_a[i], m = lse_b > la ? lse_b : la;
    const double wb = exp(lse_b - m), wa = isinf(la) ? 0 : exp(la - m);
    const float *oa = v->o_a + (size_t)i * v->d;
    for (int c = 0; c < v->d; c++)
        out[c] = (wb * o_b[c] + wa * oa[c]) / (wb + wa);
}

kf_status kf_val_head_init(kf_val_head *v, const float *q, int n, int d, float scale, const double *w,
                           const kf_kv_block *orig, const kf_kv_block *const *app, const int *visible, kf_error *err) {
    memset(v, 0, sizeof *v);
    v->n = n, v->d = d, v->scale = scale, v->q = q;
    v->w = malloc(sizeof(double) * (size_t)(n ? n : 1));
    v->lse_a = malloc(sizeof(double) * (size_t)(n ? n : 1));
    v->o_a = calloc((size_t)(n ? n : 1) * d, sizeof(float));
    v->o_full = malloc(sizeof(float) * (size_t)(n ? n : 1) * d);
    double *lse_o = malloc(sizeof(double) * (size_t)(n ? n : 1)), *tmp = malloc(sizeof(double) * (size_t)d);
    float *o_o = malloc(sizeof(float) * (size_t)(n ? n : 1) * d);
    if (!v->w || !v->lse_a || !v->o_a || !v->o_full || !lse_o || !tmp || !o_o || block_attend(v, orig, lse_o, o_o)) {
        free(lse_o), free(tmp), free(o_o);
        kf_val_head_free(v);
        return kf_fail(err, KF_ERR_NOMEM, "validation: out of memory (%d queries, %d keys)", n, orig->n);
    }
    double wsum = 0;
    for (int i = 0; i < n; i++)
        wsum += (v->w[i] = w ? w[i] : 1.0);
    for (int i = 0; i < n; i++) {
        v->w[i] = wsum > 0 ? v->w[i] / wsum : 0;
        const float *qi = q + (size_t)i * d;
        const kf_kv_block *a = app ? app[i] : NULL;
        const int na = a ? (visible ? visible[i] : a->n) : 0;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < na; j++) { /* appended keys, one query at a time (their counts differ) */
            const double z = scale * cblas_sdot(d, qi, 1, a->k + (size_t)j * a->stride, 1);
            if (z > mx) {
                const double f = exp(mx - z);
                sum *= f;
                for (int c = 0; c < d; c++)
                    v->o_a[(size_t)i * d + c] *= (float)f;
                mx = z;
            }
            const double e = exp(z - mx);
            sum += e;
            cblas_saxpy(d, (float)e, a->v + (size_t)j * a->stride, 1, v->o_a + (size_t)i * d, 1);
        }
        for (int c = 0; na > 0 && c < d; c++)
            v->o_a[(size_t)i * d + c] = (float)(v->o_a[(size_t)i * d + c] / sum);
        v->lse_a[i] = na > 0 ? mx + log(sum) : -INFINITY;
        mix(v, i, lse_o[i], o_o + (size_t)i * d, tmp);
        for (int c = 0; c < d; c++)
            v->o_full[(size_t)i * d + c] = (float)tmp[c];
    }
    free(lse_o), free(tmp), free(o_o);
    return KF_OK;
}

double kf_val_err(kf_val_head *v, const kf_kv_block *comp) {
    const int n = v->n, d = v->d;
    double *lse = malloc(sizeof(double) * (size_t)(n ? n : 1)), *tmp = malloc(sizeof(double) * (size_t)d);
    float *o = malloc(sizeof(float) * (size_t)(n ? n : 1) * d);
    double e = NAN;
    if (lse && tmp && o && block_attend(v, comp, lse, o) == 0) {
        e = 0;
        for (int i = 0; i < n; i++) {
            mix(v, i, lse[i], o + (size_t)i * d, tmp);
            double num = 0, den = 0;
            for (int c = 0; c < d; c++) {
                const double ref = v->o_full[(size_t)i * d + c], diff = tmp[c] - ref;
                num += diff * diff;
                den += ref * ref;
            }
            e += v->w[i] * (den > 0 ? sqrt(num / den) : 0);
        }
    }
    free(lse), free(tmp), free(o);
    return e;
}
