/* blockcopy.h — copies a decoded kvf cache into a paged engine's KV block tensors (vLLM's layouts).
 *
 * Source: the decoded cache, contiguous [2 (K, V), n_layers, C, src_heads, head_dim] in src_dtype, or
 * with src_head_major [2, n_layers, src_heads, C, head_dim] (what kvf chunks hold: a load lands them
 * in place without a copy)
 * (the kvf file's token-major order, keys first).
 *
 * Destination: one tensor per layer, described by its memory (base address and size in bytes, so
 * every element it names is checked to lie inside), an element offset, a logical shape, strides
 * (in elements, any order: an HND or FlexAttention tensor is just other strides) and its own
 * dtype. Logical shapes (docs/connector.md, "KV layouts"):
 *   KVB_KV_FIRST      (2, blocks, block_size, kv_heads, head_dim)   FlashAttention to v0.22
 *   KVB_BLOCKS_FIRST  (blocks, 2, block_size, kv_heads, head_dim)   FlashAttention from v0.23,
 *                                                                   FlashInfer, Triton, FlexAttention
 *   KVB_CPU           (2, blocks, kv_heads, block_size, head_dim)   vLLM's CPU backend (5-D era)
 *   KVB_PACKED        (blocks, kv_heads, block_size, 2 * head_dim)  every backend from v0.26:
 *                                                                   K in [..., :head_dim], V after it
 * The tensor's block dimension counts kernel blocks of kbs tokens; the scheduler's blocks hold
 * block_size tokens, a multiple of kbs. Token p of the request sits in slot
 * s = block_ids[p / block_size] * block_size + p % block_size, i.e. kernel block s / kbs, offset
 * s % kbs (what vLLM's reshape_and_cache_flash does).
 *
 * With context parallelism each rank holds every cp_size-th run of tokens (kvb_copy_args), as
 * vLLM's block table maps them. Only tokens [t0, t1) are written, heads [head_start, head_start + kv_heads) of the source (a
 * tensor-parallel rank's slice), every layer. Nothing else in the tensors is touched.
 */
#ifndef KF_BLOCKCOPY_H
#define KF_BLOCKCOPY_H

#include <stdint.h>

#include "kernels/base/error.h"
#include "formats/kvf.h"

typedef enum { KVB_KV_FIRST = 0, KVB_BLOCKS_FIRST = 1, KVB_CPU = 2, KVB_PACKED = 3 } kvb_layout;

typedef struct {
    void *base;         /* the tensor's memory: [nbytes] bytes, all of it writable */
    int64_t nbytes;
    int64_t offset;     /* elements from base to element (0, 0, 0, 0[, 0]) */
    int ndim;           /* 5, or 4 for KVB_PACKED */
    int64_t shape[5];
    int64_t stride[5];  /* elements, each >= 1 */
    kf_dtype dtype;
    int layer;          /* the source layer written into it */
} kvb_tensor;

typedef struct {
    const void *src;           /* [2, n_layers, C, src_heads, head_dim] */
    int64_t src_bytes;         /* its size, checked against the shape */
    kf_dtype src_dtype;
    int n_layers;
    int64_t C;
    int64_t src_heads, head_dim;
    int64_t head_start;        /* first source head written (tensor parallelism) */
    bool src_head_major;       /* src is [2, n_layers, src_heads, C, head_dim] */
    int64_t kv_heads;          /* heads per destination tensor */

    const kvb_tensor *dst;     /* [n_dst]: a tensor per layer written (layers sharing one tensor, once) */
    int n_dst;
    kvb_layout layout;

    const int32_t *block_ids;  /* [n_block_ids] the scheduler's blocks of the request, in token order */
    int64_t n_block_ids;
    int block_size;            /* tokens per scheduler block (block_size / cp_size per rank's block) */
    int64_t t0, t1;            /* tokens written: [t0, t1), 0 <= t0 <= t1 <= C */
    /* context parallelism (decode x prefill CP; 0 means 1): the scheduler's block of block_size
     * tokens is spread over cp_size ranks, cp_interleave tokens at a time; this rank (cp_rank) holds
     * the tokens p with (p % block_size) / cp_interleave % cp_size == cp_rank, at local offset
     * (p % block_size) / (cp_size * cp_interleave) * cp_interleave + p % cp_interleave of its block */
    int cp_size, cp_rank, cp_interleave;
} kvb_copy_args;

/* "kv_first", "blocks_first", "cpu", "packed". */
const char *kvb_layout_name(kvb_layout l);
/* Those names; 0, or -1 when unknown. */
int kvb_layout_parse(const char *s, kvb_layout *out);

/* Checks every argument (sizes without overflow, shapes against the layout, every addressed
 * element inside its tensor's memory, block sizes, block ids, heads) before anything is written,
 * then copies, converting to each tensor's dtype (round-to-nearest-even). KF_ERR_UNSUPPORTED for
 * block sizes other than 16, 32, 64, 128. */
kf_status kvb_copy(const kvb_copy_args *a, kf_error *err);

#endif
