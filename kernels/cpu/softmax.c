/* Row softmax (CPU), vectorized with the branch-free exp of fast_exp.h. */
#include <float.h>
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/cpu/solve_ops.h"

/* x [n] = exp(x - max x); returns max x (-FLT_MAX when n = 0). Inlined into each clone of its
 * callers, so it vectorizes for the clone's ISA. */
static inline __attribute__((always_inline)) float exp_minus_max(float *x, int n) {
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < n; j++)
        mx = x[j] > mx ? x[j] : mx;
#pragma omp simd
    for (int j = 0; j < n; j++)
        x[j] = kf_expf(x[j] - mx);
    return mx;
}

KF_ROW_CLONES void kf_cpu_softmax_row(float *x, int n, float *max_out, double *sum_out) {
    const float mx = exp_minus_max(x, n);
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

/* SUM_ROWS rows of x (row stride ldx, n entries, bias added) as kf_cpu_softmax_row, with the
 * rows' fp64 sums interleaved: each row's sum is still in index order (the same bits), but the
 * SUM_ROWS additions of one index are independent, not one long chain of dependent adds (the
 * chain was most of the softmax's time at the solve's widths, t ~ 200). */
#define SUM_ROWS 8
KF_ROW_CLONES static void softmax_row_group(float *x, size_t ldx, int n, const float *bias, float *mx, double *sum) {
    for (int r = 0; r < SUM_ROWS; r++) {
        float *row = x + (size_t)r * ldx;
        if (bias)
            kf_cpu_add(row, bias, 1, n);
        mx[r] = exp_minus_max(row, n);
        sum[r] = 0;
    }
    for (int j = 0; j < n; j++)
        for (int r = 0; r < SUM_ROWS; r++)
            sum[r] += x[(size_t)r * ldx + j];
    for (int r = 0; r < SUM_ROWS; r++) {
        float *row = x + (size_t)r * ldx;
        const float inv = (float)(1.0 / sum[r]);
#pragma omp simd
        for (int j = 0; j < n; j++)
            row[j] *= inv;
    }
}

/* The per-row outputs of rows i0 .. i0 + k - 1. */
static void row_outputs(const kf_softmax_rows_args *a, int i0, int k, const float *mx, const double *sum) {
    for (int r = 0; r < k; r++) {
        if (a->max_out)
            a->max_out[i0 + r] = mx[r];
        if (a->sum_out)
            a->sum_out[i0 + r] = sum[r];
        if (a->lse_out)
            a->lse_out[i0 + r] = mx[r] + log(sum[r]);
    }
}

/* kf_backend.softmax_rows (kernels/backend.h): each row through kf_cpu_softmax_row, or (full
 * rows, no causal cut) SUM_ROWS at a time through softmax_row_group: the same bits. */
void kf_cpu_softmax_rows(const kf_backend *b, const kf_softmax_rows_args *a) {
    (void)b;
    int i0 = 0;
    for (; !a->len && i0 + SUM_ROWS <= a->rows; i0 += SUM_ROWS) {
        float mx[SUM_ROWS];
        double sum[SUM_ROWS];
        softmax_row_group(a->x + (size_t)i0 * a->ldx, a->ldx, a->n, a->bias, mx, sum);
        row_outputs(a, i0, SUM_ROWS, mx, sum);
    }
    for (int i = i0; i < a->rows; i++) {
        float *x = a->x + (size_t)i * a->ldx, mx;
        double sum;
        const int len = a->len ? a->len[i] : a->n;
        if (a->bias)
            kf_cpu_add(x, a->bias, 1, a->n);
        kf_cpu_softmax_row(x, len, &mx, &sum);
        for (int j = len; j < a->n; j++)
            x[j] = 0.0f;
        row_outputs(a, i, 1, &mx, &sum);
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
