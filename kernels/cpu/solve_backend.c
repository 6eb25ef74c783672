/* The CPU's solve operations as a backend of their own (kf_backend_cpu_solve: what a model on a
 * backend without them solves with) and installed into the CPU backend. */
#include "kernels/cpu/linalg.h"
#include "kernels/cpu/solve_ops.h"

int kf_cpu_lstsq_op(const kf_backend *b, const float *A, int m, int n, const float *B, int nrhs, float *X) {
    (void)b;
    return kf_lstsq(A, m, n, B, nrhs, X);
}

static const kf_backend cpu_solve = {
    .name = "cpu-solve",
    .weight_dtype = KF_DTYPE_F32,
    .sgemm = kf_cpu_sgemm,
    .dgemm = kf_cpu_dgemm,
    .dgemv = kf_cpu_dgemv,
    .dsyrk = kf_cpu_dsyrk,
    .ssyrk = kf_cpu_ssyrk,
    .gram_bf16 = kf_cpu_gram_bf16,
    .dsymv = kf_cpu_dsymv,
    .dpotrf = kf_cpu_dpotrf,
    .dpotrs = kf_cpu_dpotrs,
    .spotrf = kf_cpu_spotrf,
    .spotrs = kf_cpu_spotrs,
    .lstsq = kf_cpu_lstsq_op,
    .softmax_rows = kf_cpu_softmax_rows,
    .exp_rows = kf_cpu_exp_rows,
};

const kf_backend *kf_backend_cpu_solve(void) {
    return &cpu_solve;
}

void kf_cpu_solve_ops_install(kf_backend *b) {
    b->sgemm = cpu_solve.sgemm;
    b->dgemm = cpu_solve.dgemm;
    b->dgemv = cpu_solve.dgemv;
    b->dsyrk = cpu_solve.dsyrk;
    b->ssyrk = cpu_solve.ssyrk;
    b->gram_bf16 = cpu_solve.gram_bf16;
    b->dsymv = cpu_solve.dsymv;
    b->dpotrf = cpu_solve.dpotrf;
    b->dpotrs = cpu_solve.dpotrs;
    b->spotrf = cpu_solve.spotrf;
    b->spotrs = cpu_solve.spotrs;
    b->lstsq = cpu_solve.lstsq;
    b->softmax_rows = cpu_solve.softmax_rows;
    b->exp_rows = cpu_solve.exp_rows;
}
