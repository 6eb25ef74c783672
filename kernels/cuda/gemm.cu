/* bf16 GEMM through cuBLASLt: A = W (bf16 [N, K] row-major, i.e. column-major K x N, transposed),
 * B = x rounded to bf16 (column-major K x M), C = D = y (fp32, column-major N x M with ld ldy),
 * computed in fp32. Row-major y = x W^T is column-major y^T = W x^T, so no transposes are copied. */
#include "kernels/cuda/gemm.cuh"

__global__ void kf_to_bf16_rows(__nv_bfloat16 *dst, const float *x, size_t ldx, int M, int K) {
    const size_t total = (size_t)M * K;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / (size_t)K, k = e % (size_t)K;
        dst[e] = __float2bfloat16_rn(x[r * ldx + k]);
    }
}

void kf_cuda_gemm(kf_cuda_ctx *c, float *y, size_t ldy, const float *x, size_t ldx, const __nv_bfloat16 *w, int M,
                  int N, int K, int accumulate) {
    if (M <= 0 || N <= 0 || K <= 0)
        return;
    __nv_bfloat16 *xb = (__nv_bfloat16 *)kf_cuda_scratch(c, KF_CUDA_SCR_ACT, sizeof(__nv_bfloat16) * (size_t)M * K);
    if (!xb)
        return;
    kf_to_bf16_rows<<<kf_cuda_blocks((size_t)M * K, 256), 256, 0, c->stream>>>(xb, x, ldx, M, K);
    KF_CUDA_LAUNCHED(c);

    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    KF_CUBLAS_CHECK(c, cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    KF_CUBLAS_CHECK(c, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KF_CUBLAS_CHECK(c, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    KF_CUBLAS_CHECK(c, cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, (uint64_t)K, (uint64_t)N, (int64_t)K));
    KF_CUBLAS_CHECK(c, cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, (uint64_t)K, (uint64_t)M, (int64_t)K));
    KF_CUBLAS_CHECK(c, cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, (uint64_t)N, (uint64_t)M, (int64_t)ldy));
    KF_CUBLAS_CHECK(c, cublasLtMatmulPreferenceCreate(&pref));
    KF_CUBLAS_CHECK(c, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &c->lt_ws_bytes, sizeof c->lt_ws_bytes));
    if (!c->failed) {
        KF_CUBLAS_CHECK(c, cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, lc, lc, pref, 1, &heur, &found));
        if (!c->failed && found < 1)
            kf_cuda_fail(c, __FILE__, __LINE__, "cuBLASLt has no bf16 algorithm for M=%d N=%d K=%d", M, N, K);
    }
    if (!c->failed)
        KF_CUBLAS_CHECK(c, cublasLtMatmul(c->lt, op, &alpha, w, la, xb, lb, &beta, y, lc, y, lc, &heur.algo, c->lt_ws,
                                          c->lt_ws_bytes, c->stream));
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (lc)
        cublasLtMatrixLayoutDestroy(lc);
    if (lb)
        cublasLtMatrixLayoutDestroy(lb);
    if (la)
        cublasLtMatrixLayoutDestroy(la);
    if (op)
        cublasLtMatmulDescDestroy(op);
}
