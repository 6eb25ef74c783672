/* safetensors.h — a validating, mmap-based reader for Hugging Face safetensors files.
 *
 * File format (https://huggingface.co/docs/safetensors):
 *
 *   offset 0      u64 little-endian N: length of the JSON header in bytes
 *   offset 8      N bytes of UTF-8 JSON: an object mapping tensor names to
 *                   { "dtype": "BF16"|"F16"|"F32"|..., "shape": [d0, d1, ...],
 *                     "data_offsets": [begin, end] }
 *                 plus an optional "__metadata__": { string: string }
 *   offset 8+N    the data section; data_offsets are relative to its start.
 *
 * The reader checks everything before it hands out a pointer:
 *   - N is at most KF_ST_MAX_HEADER (100 MB, the reference limit) and fits the file;
 *   - the header is a well-formed JSON object, each entry has the three fields with
 *     the right JSON types, a known dtype and non-negative dimensions;
 *   - begin <= end <= data size, prod(shape) * dtype size == end - begin (no overflow);
 *   - no two tensors overlap.
 * A defect gives KF_ERR_FORMAT with a message naming the file, the tensor and the defect.
 *
 * Sharded checkpoints: kf_st_open_dir() reads model.safetensors, or
 * model.safetensors.index.json whose "weight_map" maps tensor names to shard files
 * in the same directory; every shard is validated and every mapped tensor must exist
 * in the shard that the index names.
 *
 * Data pointers point into the read-only mapping and may be unaligned for their dtype
 * (the format does not promise alignment): read them with memcpy.
 */
#ifndef KF_SAFETENSORS_H
#define KF_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/base/dtype.h"
#include "kernels/base/error.h"

#define KF_ST_MAX_HEADER (100u * 1000u * 1000u)
#define KF_ST_MAX_DIMS 8

typedef struct {
    char *name;
    kf_dtype dtype;
    int ndim;
    int64_t shape[KF_ST_MAX_DIMS];
    int64_t numel;
    const void *data;  /* inside the mapping; possibly unaligned */
    size_t nbytes;
    int file;          /* index into kf_st_set.files */
} kf_st_tensor;

typedef struct {
    char *path;
    void *map;
    size_t size;
    uint64_t header_len;
} kf_st_file;

typedef struct {
    kf_st_file *files;      /* [n_files] */
    int n_files;
    kf_st_tensor *tensors;  /* [n_tensors], sorted by name */
    size_t n_tensors;
} kf_st_set;

/* Open one .safetensors file. */
kf_status kf_st_open_file(kf_st_set *set, const char *path, kf_error *err);
/* Open a model directory: model.safetensors, or the shards named by model.safetensors.index.json. */
kf_status kf_st_open_dir(kf_st_set *set, const char *dir, kf_error *err);
void kf_st_close(kf_st_set *set);
/* "dir/name" (malloc'ed; NULL when out of memory): a file of a model directory. */
char *kf_st_dir_file(const char *dir, const char *name);

/* Let the tensor's bytes leave the process's resident memory (madvise MADV_DONTNEED on the pages
 * that hold them): the mapping stays valid, a later read faults them in again from the file. A
 * model converted into its own buffers calls it so that the file does not stay resident beside
 * them (its pages counted in the process's RSS until the set is closed). */
void kf_st_release_pages(const kf_st_set *set, const kf_st_tensor *t);

/* NULL when absent. */
const kf_st_tensor *kf_st_find(const kf_st_set *set, const char *name);

/* Index of the first NaN or infinite element of a floating-point tensor (F16, BF16, F32, F64) and,
 * in *is_nan, which of the two it is; -1 when every element is finite or the dtype is not floating. */
int64_t kf_st_first_nonfinite(const kf_st_tensor *t, int *is_nan);

/* The header's spelling of a dtype ("BF16", "F32", "I64", ...); "?" for one safetensors lacks. */
const char *kf_st_dtype_name(kf_dtype dt);

#endif
