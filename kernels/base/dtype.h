/* dtype.h — the element types kvfold knows: one enumeration for compute, the KV arena, checkpoint
 * tensors (formats/safetensors.h) and the cache file (formats/kvf.h).
 *
 * Formats never write these numbers: each maps its own spellings to them where it reads and writes
 * ("BF16" in safetensors, "bfloat16" in a kvf file's dtype attribute). The numbers of F32, BF16
 * and F16 stay as they are: recipe digests hash the arena's dtype by its number, and F32 is 0 so
 * that a zeroed struct holds fp32.
 *
 * Names are PyTorch's ("bfloat16", "float32", "int64", "bool"); kf_dtype_parse also takes the
 * short spellings bf16, f16, fp16, f32, fp32 and f64.
 */
#ifndef KF_DTYPE_H
#define KF_DTYPE_H

#include <stddef.h>

typedef enum {
    KF_DTYPE_F32 = 0,
    KF_DTYPE_BF16 = 1,
    KF_DTYPE_F16 = 2,
    KF_DTYPE_F64 = 3,
    KF_DTYPE_I8 = 4,
    KF_DTYPE_U8 = 5,
    KF_DTYPE_I16 = 6,
    KF_DTYPE_U16 = 7,
    KF_DTYPE_I32 = 8,
    KF_DTYPE_U32 = 9,
    KF_DTYPE_I64 = 10,
    KF_DTYPE_U64 = 11,
    KF_DTYPE_BOOL = 12,
} kf_dtype;

#define KF_DTYPE_COUNT 13

/* Bytes per element; 0 for a value outside the enumeration. */
size_t kf_dtype_size(kf_dtype dt);
/* "float32", "bfloat16", "float16", "float64", "int8" ... "uint64", "bool"; "?" outside. */
const char *kf_dtype_name(kf_dtype dt);
/* A name or short spelling to its dtype: 0, or -1 when unknown (out unchanged). */
int kf_dtype_parse(const char *s, kf_dtype *out);

#endif
