/* quoka.cuh — QUOKA key selection on the device (see kf_quoka_select_args in kernels/backend.h):
 * query selection per head, pre-aggregation per KV head, fused normalize-dot-max scoring of the
 * paged keys, and a per-KV-head top-budget by radix select (no sort) emitted in ascending order.
 * The page table is a host array; out_idx and scores are device memory. */
#ifndef KF_CUDA_QUOKA_CUH
#define KF_CUDA_QUOKA_CUH
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
void kf_cuda_quoka_select(kf_cuda_ctx *c, const kf_quoka_select_args *a);
#endif
