/* common.cuh — the CUDA backend's shared state and error checks (device code and host glue).
 *
 * One kf_cuda_ctx per backend: the device, the one stream every operation is queued on, the
 * cuBLASLt handle and workspace, and scratch buffers for host index arrays (page tables, ids,
 * positions) that operations copy to the device. Errors are sticky: the first failing call's
 * file, line and message are kept and reported through the backend's take_error.
 */
#ifndef KF_CUDA_COMMON_CUH
#define KF_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

enum {
    KF_CUDA_SCR_IDX0 = 0, /* page tables, token ids */
    KF_CUDA_SCR_IDX1,     /* positions */
    KF_CUDA_SCR_IDX2,     /* inv_freq */
    KF_CUDA_SCR_ACT,      /* bf16 copy of a GEMM's activations */
    KF_CUDA_SCR_QUOKA,    /* QUOKA: order keys, kept queries, qbar, scores */
    KF_CUDA_SCR_RAW,      /* upload_weight staging */
    KF_CUDA_N_SCR
};

typedef struct {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_ws; /* cuBLASLt workspace */
    size_t lt_ws_bytes;
    void *scr[KF_CUDA_N_SCR];
    size_t scr_bytes[KF_CUDA_N_SCR];
    int failed;     /* set by any failure since the last take_error */
    char msg[512];  /* the first failure's message */
} kf_cuda_ctx;

/* Records a failure (first message wins until take_error clears it). */
void kf_cuda_fail(kf_cuda_ctx *c, const char *file, int line, const char *fmt, ...);

#define KF_CUDA_CHECK(c, expr)                                                                     \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            kf_cuda_fail((c), __FILE__, __LINE__, "%s: %s", #expr, cudaGetErrorString(e_));        \
    } while (0)

#define KF_CUBLAS_CHECK(c, expr)                                                                   \
    do {                                                                                           \
        cublasStatus_t s_ = (expr);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            kf_cuda_fail((c), __FILE__, __LINE__, "%s: cuBLAS status %d", #expr, (int)s_);         \
    } while (0)

/* After each kernel launch: catches bad launch configurations at once (execution errors surface
 * at the next synchronizing call). */
#define KF_CUDA_LAUNCHED(c) KF_CUDA_CHECK((c), cudaGetLastError())

/* Device scratch buffer `slot` of at least `bytes` (grown, never shrunk); NULL after a failure. */
void *kf_cuda_scratch(kf_cuda_ctx *c, int slot, size_t bytes);

/* Copies a host array into scratch `slot` on the stream; returns the device copy or NULL. */
const void *kf_cuda_stage(kf_cuda_ctx *c, int slot, const void *host, size_t bytes);

static inline unsigned kf_cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65535u * 16u ? 65535u * 16u : (b ? b : 1)); /* grid-stride loops cover the rest */
}

#endif
