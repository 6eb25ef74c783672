/* blockcopy.h — copies a decoded kvf cache into a paged engine's KV block tensors (vLLM's layouts).
 *
 * Source: the decoded cache, contiguous [2 (K, V), n_layers, C, src_heads, head_dim] in src_dtype
 * (the kvf file's token-major order, keys first).
 *
 * Destination: one 5-D tensor per layer, described by a data pointer, shape, strides (in
 * elements, any order: a permuted HND tensor is just other strides) and dtype. Layouts (the
 * logical shapes of research/vllm-connector.md section 5):
 *   KVB_FLASH_ATTN  (2, blocks, block_size, kv_heads, head_dim)   FlashAttention, FlexAttention
 *   KVB_FLASHINFER  (blocks, 2, block_size, kv_heads, head_dim)   FlashInfer, Triton
 *   KVB_CPU         (2, blocks, kv_heads, block_size, head_dim)   vLLM's CPU backend
 * The tensor's block dimension counts kernel blocks of kbs tokens; the scheduler's blocks hold
 * block_size tokens, a multiple of kbs. Token p of the request sits in slot
 * s = block_ids[p / block_size] * block_size + p % block_size, i.e. kernel block s / kbs, offset
 * s % kbs (what vLLM's reshape_and_cache_flash does).
 *
 * Only tokens [t0, t1) are written, heads [head_start, head_start + kv_heads) of the source (a
 * tensor-parallel rank's slice), every layer. Nothing else in the tensors is touched.
 */
#ifndef KF_BLOCKCOPY_H
#define KF_BLOCKCOPY_H

#include <stdint.h>

#include "formats/error.h"
#include "formats/kvf.h"

typedef enum { KVB_FLASH_ATTN = 0, KVB_FLASHINFER = 1, KVB_CPU = 2 } kvb_layout;

typedef struct {
    void *data;         /* element (0, 0, 0, 0, 0) */
    int64_t shape[5];
    int64_t stride[5];  /* elements */
} kvb_tensor;

typedef struct {
    const void *src;           /* [2, n_layers, C, src_heads, head_dim] */
    kvf_dtype src_dtype;
    int n_layers;
    int64_t C;
    int src_heads, head_dim;
    int head_start;            /* first source head written (tensor parallelism) */
    int kv_heads;              /* heads per destination tensor */

    const kvb_tensor *dst;     /* [n_layers] */
    kvf_dtype dst_dtype;
    kvb_layout layout;

    const int32_t *block_ids;  /* [n_block_ids] the scheduler's blocks of the request, in token order */
    int64_t n_block_ids;
    int block_size;            /* tokens per scheduler block */
    int64_t t0, t1;            /* tokens written: [t0, t1), 0 <= t0 <= t1 <= C */
} kvb_copy_args;

const char *kvb_layout_name(kvb_layout l);
/* "flash_attn", "flashinfer" (also "triton"), "cpu"; 0 or -1 when unknown. */
int kvb_layout_parse(const char *s, kvb_layout *out);

/* Checks every argument (shapes against the layout, strides, block sizes, block ids against the
 * tensors) before anything is written, then copies, converting between dtypes when they differ
 * (round-to-nearest-even). KF_ERR_UNSUPPORTED for block sizes other than 16, 32, 64, 128. */
kf_status kvb_copy(const kvb_copy_args *a, kf_error *err);

#endif
