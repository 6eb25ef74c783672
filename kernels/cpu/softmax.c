/* Row softmax (CPU), vectorized with the branch-free exp of fast_exp.h. */
#include <float.h>
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/cpu/solve_ops.h"

KF_ROW_CLONES void kf_cpu_softmax_row(float *x, int n, float *max_out, double *sum_out) {
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < n; j++)
        mx = x[j] > mx ? x[j] : mx;
#pragma omp simd
    for (int j = 0; j < n; j++)
        x[j] = kf_expf(x[j] - mx);
    /* summed in index order, as before the exponentials were vectorized: the callers' results
     * (AM's and the diagnostics' softmax) keep their bits */
    double sum = 0;
    for (int j = 0; j < n; j++)
        sum += x[j];
    const float inv = (float)(1.0 / sum);
#pragma omp simd
    for (int j = 0; j < n; j++)
        x[j] *= inv;
    if (max_out)
        *max_out = mx;
    if (sum_out)
        *sum_out = sum;
}

/* kf_backend.softmax_rows (kernels/backend.h): each row through kf_cpu_softmax_row. */
void kf_cpu_softmax_rows(const kf_backend *b, const kf_softmax_rows_args *a) {
    (void)b;
    for (int i = 0; i < a->rows; i++) {
        float *x = a->x + (size_t)i * a->ldx, mx;
        double sum;
        const int len = a->len ? a->len[i] : a->n;
        if (a->bias)
            kf_cpu_add(x, a->bias, 1, a->n);
        kf_cpu_softmax_row(x, len, &mx, &sum);
        for (int j = len; j < a->n; j++)
            x[j] = 0.0f;
        if (a->max_out)
            a->max_out[i] = mx;
        if (a->sum_out)
            a->sum_out[i] = sum;
        if (a->lse_out)
            a->lse_out[i] = mx + log(sum);
    }
}

/* kf_backend.exp_rows: x_ij = exp(x_ij - shift_i), the fast exp of fast_exp.h. */
KF_ROW_CLONES void kf_cpu_exp_rows(const kf_backend *b, float *x, size_t ldx, int rows, int n, const float *shift) {
    (void)b;
    for (int i = 0; i < rows; i++) {
        float *row = x + (size_t)i * ldx;
        const float s = shift[i];
#pragma omp simd
        for (int j = 0; j < n; j++)
            row[j] = kf_expf(row[j] - s);
    }
}
