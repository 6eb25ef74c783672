#include "compactor/diag.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

kf_status kf_diag_head(const float *q, int R, int d, float scale, const kf_kv_block *orig, const kf_kv_block *comp,
                       const kf_kv_block *appended, const int *visible, kf_head_diag *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    double *o1 = malloc(sizeof(double) * d), *o2 = malloc(sizeof(double) * d);
    if (!o1 || !o2) {
        free(o1);
        free(o2);
        return kf_fail(err, KF_ERR_NOMEM, "diagnostics: out of memory");
    }
    double lse_sum = 0, out_sum = 0;
    for (int i = 0; i < R; i++) {
        const float *qi = q + (size_t)i * d;
        const int na = appended ? (visible ? visible[i] : appended->n) : 0;
        const double lse_o = block_pass(qi, d, scale, orig, orig->n, 0, NULL, NULL);
        const double lse_c = block_pass(qi, d, scale, comp, comp->n, 0, NULL, NULL);
        lse_sum += fabs(lse_c - lse_o);
        /* outputs over [block | appended], shifted by the original block's LSE for range */
        double m1 = 0, m2 = 0;
        memset(o1, 0, sizeof(double) * d);
        memset(o2, 0, sizeof(double) * d);
        block_pass(qi, d, scale, orig, orig->n, lse_o, o1, &m1);
        block_pass(qi, d, scale, comp, comp->n, lse_o, o2, &m2);
        if (na > 0) {
            block_pass(qi, d, scale, appended, na, lse_o, o1, &m1);
            block_pass(qi, d, scale, appended, na, lse_o, o2, &m2);
        }
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
    free(o1);
    free(o2);
    return KF_OK;
}
