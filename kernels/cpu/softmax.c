/* Row softmax (CPU), vectorized with the branch-free exp of fast_exp.h. */
#include <float.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"

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
