/* kvf.h — the kvfold cache file: the compacted KV cache of one document for one model, in HDF5.
 *
 * Format "kvfold-kvf", version 1 (HDF5 1.8+ file format; readable by h5py and h5dump).
 *
 *   Root attributes (strings: variable-length UTF-8; integers: int64; reals: float64)
 *     format             "kvfold-kvf"
 *     version            1; readers refuse any other version, naming it
 *     creator            "kvfold <version>" of the writer
 *     model_fingerprint  32 lowercase hex digits: kf_model_fingerprint (config, tensor index, weights)
 *     tokenizer_digest   lowercase hex digits (up to 64), or "" when unknown (ids given directly)
 *     document_digest    32 lowercase hex digits: kvf_document_digest() of the document's token ids
 *     n_doc_tokens       D, the document's length in tokens (>= 1)
 *     n_tokens           C, the compacted length: the number of cache slots (1 <= C)
 *     method             "keep" (the full cache, C = D), "drop" (kept keys, no bias), "am" (Attention
 *                        Matching: kept keys, bias beta, refitted values), "fold" (beta folded into the
 *                        keys along u, values refitted without bias)
 *     budget             the target C / D the compactor was given (> 0)
 *     lambda             the fold's ridge lambda (0 unless fold)
 *     rope_frame         "compacted": keys were rotated by -(D - C) positions, so the question's token i
 *                        sits at position C + i (what a paged engine does after a prefix of C tokens);
 *                        "original": keys are in the AM frame, the question starts at position D
 *     placeholder        how the serving side derives the C placeholder token ids (e.g. "digest")
 *     dtype              element type of keys and values: "bfloat16", "float16" or "float32"
 *     n_layers, kv_heads, head_dim
 *     block_size         16: tokens per chunk of keys/values (vLLM's block size)
 *
 *   Datasets
 *     keys, values  [n_layers, C, kv_heads, head_dim], token-major, exactly what goes into the paged
 *                   blocks. Chunk [1, 16, kv_heads, head_dim]: one 16-token block of one layer (the
 *                   last block of a layer may be short). Fletcher32 checksum filter on every chunk.
 *                   Element type by dtype: float32 = IEEE binary32 LE; float16 = IEEE binary16 LE (an
 *                   HDF5 float of size 2, numpy float16); bfloat16 = uint16 LE holding the bf16 bits
 *                   (HDF5 has no bfloat16; a custom 16-bit float would read as float16 in h5py).
 *                   Each carries a string attribute "dtype" equal to the root's.
 *     beta          [n_layers, kv_heads, C] float32: AM's additive attention bias of each slot
 *                   (0 for keep and drop; already inside the keys for fold)
 *     u             [n_layers, kv_heads, head_dim] float32: the fold direction (zeros unless fold)
 *     positions     [n_layers, kv_heads, C] int32: the original position of each slot's key in the
 *                   document, per head (AM keeps different keys per head); -1 marks a padding slot
 *     beta, u and positions are chunked one layer per chunk, also with Fletcher32.
 *   Readers of version 1 ignore any other attribute or dataset.
 *
 * Files and names
 *   - Content-addressed: <root>/<model_fingerprint>/<document_digest>.<method>-<budget>.kvf, budget in
 *     its shortest round-trip decimal form ("0.1", "0.25", "1"): kvf_cache_path().
 *   - kvf_write() writes <final>.tmp-<pid>-<16 hex> in the same directory, fsyncs it, renames it over
 *     the final name and fsyncs the directory: a reader sees no file or a complete one, and two
 *     writers of the same name leave one complete file. A killed writer leaves only a temporary
 *     name, which kvf_open() refuses and kvf_clean_temps() removes once old enough.
 *   - HDF5 file locking is off (the files are immutable once renamed, and locks fail on some
 *     shared filesystems).
 *
 * Reading verifies: format and version, every attribute and dataset present with the right type
 * and shape, sizes consistent with the header, the checksum filter present; every chunk read is
 * checked against its Fletcher32 sum ("checksum mismatch in keys, layer 3 block 2"). kvf_check_model()
 * refuses a file written for another model. A kvf_file is for one thread at a time.
 *
 * Library code: no printing, no exit; HDF5's own error printing is switched off and its error
 * stack becomes the kf_error message.
 */
#ifndef KF_KVF_H
#define KF_KVF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/error.h"

#define KVF_FORMAT_NAME "kvfold-kvf"
#define KVF_VERSION 1
#define KVF_BLOCK 16           /* tokens per chunk */
#define KVF_DIGEST_LEN 32      /* hex digits of a fingerprint / document digest */
#define KVF_ALL_LAYERS (-1)

typedef enum { KVF_METHOD_KEEP, KVF_METHOD_DROP, KVF_METHOD_AM, KVF_METHOD_FOLD } kvf_method;
typedef enum { KVF_BF16, KVF_F16, KVF_F32 } kvf_dtype;
typedef enum { KVF_FRAME_COMPACTED, KVF_FRAME_ORIGINAL } kvf_rope_frame;
typedef enum { KVF_KEYS, KVF_VALUES } kvf_which;

typedef struct {
    int version;                           /* KVF_VERSION */
    char creator[48];                      /* "kvfold 0.1.0" */
    char model_fingerprint[KVF_DIGEST_LEN + 1];
    char tokenizer_digest[65];             /* "" when unknown */
    char document_digest[KVF_DIGEST_LEN + 1];
    int64_t n_doc_tokens;                  /* D */
    int64_t n_tokens;                      /* C */
    kvf_method method;
    double budget;
    double lambda;
    kvf_rope_frame rope_frame;
    char placeholder[64];
    kvf_dtype dtype;
    int n_layers, kv_heads, head_dim;
    int block_size;                        /* KVF_BLOCK */
} kvf_header;

/* What a compactor hands to kvf_write(). Give keys/values in fp32 (converted to hdr.dtype with
 * round-to-nearest-even) or, when those are NULL, keys_raw/values_raw already in hdr.dtype. */
typedef struct {
    kvf_header hdr;
    const float *keys;          /* [n_layers, C, kv_heads, head_dim] */
    const float *values;        /* [n_layers, C, kv_heads, head_dim] */
    const void *keys_raw;       /* [n_layers, C, kv_heads, head_dim] in hdr.dtype */
    const void *values_raw;     /* [n_layers, C, kv_heads, head_dim] in hdr.dtype */
    const float *beta;          /* [n_layers, kv_heads, C] or NULL: zeros */
    const float *u;             /* [n_layers, kv_heads, head_dim] or NULL: zeros */
    const int32_t *positions;   /* [n_layers, kv_heads, C] or NULL: slot j holds token j (keep) */
} kvf_cache;

typedef struct kvf_file kvf_file;

/* ---- names and small helpers ---- */

/* Defaults: version, creator, block size 16, rope_frame compacted, placeholder "digest", bf16. */
void kvf_header_init(kvf_header *h);
const char *kvf_method_name(kvf_method m);      /* "keep", "drop", "am", "fold" */
const char *kvf_dtype_name(kvf_dtype d);        /* "bfloat16", "float16", "float32" */
const char *kvf_rope_frame_name(kvf_rope_frame f);
/* Parse a name (also "bf16", "f16", "f32", "fp16", "fp32" for dtypes); 0 or -1 when unknown. */
int kvf_method_parse(const char *s, kvf_method *out);
int kvf_dtype_parse(const char *s, kvf_dtype *out);
size_t kvf_dtype_size(kvf_dtype d);
/* Bytes of keys plus values: 2 * n_layers * C * kv_heads * head_dim * dtype size. */
int64_t kvf_kv_bytes(const kvf_header *h);

/* XXH3-128 of the ids as little-endian int32 followed by the count as little-endian uint64;
 * 32 lowercase hex digits (the same hash family as kf_model_fingerprint). */
void kvf_document_digest(const int32_t *ids /* [n] */, int64_t n, char out[KVF_DIGEST_LEN + 1]);
/* The budget's shortest decimal that reads back as the same double: 0.1 -> "0.1". */
void kvf_format_budget(double budget, char *out, size_t out_len);
/* <root>/<model_fp>/<doc_digest>.<method>-<budget>.kvf; with create_dirs, makes the directories. */
kf_status kvf_cache_path(const char *root, const char *model_fp, const char *doc_digest, kvf_method method,
                         double budget, bool create_dirs, char *out, size_t out_len, kf_error *err);
/* True when name (a path or base name) is a writer's temporary file: "*.tmp-<pid>-<16 hex>". */
bool kvf_is_temp_name(const char *name);

/* f32 <-> bf16 / f16 bit patterns, round-to-nearest-even (NaN stays NaN). */
uint16_t kvf_f32_to_bf16(float x);
float kvf_bf16_to_f32(uint16_t b);
uint16_t kvf_f32_to_f16(float x);
float kvf_f16_to_f32(uint16_t h);

/* ---- writing ---- */

/* Validates the cache and writes it atomically to path (temporary name, fsync, rename, fsync of the
 * directory). An existing file at path is replaced: callers that skip existing work ask
 * kvf_exists_valid() first. */
kf_status kvf_write(const char *path, const kvf_cache *c, kf_error *err);

/* True when path holds a kvf file that kvf_open() accepts (structure, not every checksum) and,
 * if model_fp is not NULL, that was written for that model. */
bool kvf_exists_valid(const char *path, const char *model_fp);

/* Finds writers' temporary files under root (recursively) whose mtime is at least older_than_s
 * seconds ago; calls found(ctx, path, age_s) for each when given, removes them unless dry_run, and
 * counts them in *n_found. */
kf_status kvf_clean_temps(const char *root, double older_than_s, bool dry_run,
                          void (*found)(void *ctx, const char *path, double age_s), void *ctx, int *n_found,
                          kf_error *err);

/* ---- reading ---- */

kf_status kvf_open(const char *path, kvf_file **out, kf_error *err);
void kvf_close(kvf_file *f);
const kvf_header *kvf_file_header(const kvf_file *f);
const char *kvf_file_path(const kvf_file *f);

/* KF_ERR_MISMATCH, naming both fingerprints (or the shape), when the file was written for another
 * model. Negative shape arguments are not checked. */
kf_status kvf_check_model(const kvf_file *f, const char *model_fp, int n_layers, int kv_heads, int head_dim,
                          kf_error *err);

/* One layer of keys or values, converted to fp32 / as stored (kvf_dtype_size bytes per element). */
kf_status kvf_read_layer(kvf_file *f, int layer, kvf_which which, float *out /* [C, kv_heads, head_dim] */,
                         kf_error *err);
kf_status kvf_read_layer_raw(kvf_file *f, int layer, kvf_which which, void *out /* [C, kv_heads, head_dim] */,
                             kf_error *err);
/* One 16-token block (block b holds slots 16b .. 16b+15); *n_tokens = its length (16, or less for
 * the last block). The buffers hold KVF_BLOCK tokens. */
kf_status kvf_read_block(kvf_file *f, int layer, int64_t block, kvf_which which,
                         float *out /* [16, kv_heads, head_dim] */, int *n_tokens, kf_error *err);
kf_status kvf_read_block_raw(kvf_file *f, int layer, int64_t block, kvf_which which,
                             void *out /* [16, kv_heads, head_dim] */, int *n_tokens, kf_error *err);
int64_t kvf_n_blocks(const kvf_file *f); /* ceil(C / 16) */

/* layer = KVF_ALL_LAYERS reads every layer: [n_layers, ...]. */
kf_status kvf_read_beta(kvf_file *f, int layer, float *out /* [kv_heads, C] */, kf_error *err);
kf_status kvf_read_u(kvf_file *f, int layer, float *out /* [kv_heads, head_dim] */, kf_error *err);
kf_status kvf_read_positions(kvf_file *f, int layer, int32_t *out /* [kv_heads, C] */, kf_error *err);

/* Reads every chunk of every dataset, verifying all checksums. */
kf_status kvf_verify(kvf_file *f, kf_error *err);

#endif
