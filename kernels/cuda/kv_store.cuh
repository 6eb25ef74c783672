/* kv_store.cuh — writes n tokens of k/v ([n, kv_heads, head_dim]) into the paged pool at slots
 * first_slot .. first_slot+n-1 of the (host) page table. */
#ifndef KF_CUDA_KV_STORE_CUH
#define KF_CUDA_KV_STORE_CUH
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
void kf_cuda_kv_store(kf_cuda_ctx *c, const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n,
                      const float *k, const float *v);
#endif
