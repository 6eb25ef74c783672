/* Paged KV store: one grid-stride pass over n * kv_heads * head_dim values of K and V. Only the
 * pages the n slots touch are copied to the device. */
#include "kernels/cuda/kv_store.cuh"

__global__ void kf_kv_store_kernel(float *pk, float *pv, size_t page_stride, const int32_t *pages, int slot0_in_page,
                                   int n, int row, const float *k, const float *v) {
    const size_t total = (size_t)n * row;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(e / row), c = (int)(e % row);
        const int s = slot0_in_page + i; /* slot relative to the first touched page */
        const size_t off = (size_t)pages[s / KF_PAGE_TOKENS] * page_stride + (size_t)(s % KF_PAGE_TOKENS) * row + c;
        pk[off] = k[e];
        pv[off] = v[e];
    }
}

void kf_cuda_kv_store(kf_cuda_ctx *c, const kf_paged_kv *kv, const int32_t *pages, int64_t first_slot, int n,
                      const float *k, const float *v) {
    if (n <= 0)
        return;
    const int64_t p0 = first_slot / KF_PAGE_TOKENS, p1 = (first_slot + n - 1) / KF_PAGE_TOKENS;
    const int32_t *d =
        (const int32_t *)kf_cuda_stage(c, KF_CUDA_SCR_IDX0, pages + p0, sizeof(int32_t) * (size_t)(p1 - p0 + 1));
    if (!d)
        return;
    const int row = kv->kv_heads * kv->head_dim;
    kf_kv_store_kernel<<<kf_cuda_blocks((size_t)n * row, 256), 256, 0, c->stream>>>(
        (float *)kv->k, (float *)kv->v, kv->page_stride, d, (int)(first_slot % KF_PAGE_TOKENS), n, row, k, v);
    KF_CUDA_LAUNCHED(c);
}
