/* kvf.h — the kvfold cache file: the compacted KV cache of one document for one model, in HDF5.
 *
 * Format "kvfold-kvf", version 2. HDF5 file format of the latest library version (superblock 3,
 * version-2 object headers: every piece of metadata carries a Jenkins checksum, which readers
 * require); readable by h5py and h5dump (HDF5 1.10+). Version 1 files are refused with a message
 * that says to recompact.
 *
 *   Root attributes (strings: fixed-length, null-terminated, UTF-8 without control characters: no
 *   C0, DEL, C1, bidirectional controls or line separators, kvf_is_clean_utf8; integers: int64 LE;
 *   reals: float64 LE). Readers check every value, not only its presence and type; writers refuse
 *   the same values.
 *     format             "kvfold-kvf"
 *     version            2; readers refuse any other version, naming it
 *     creator            "kvfold <version>" of the writer (printable UTF-8)
 *     model_fingerprint  32 lowercase hex digits: kf_model_fingerprint (config, tensor index, weights)
 *     tokenizer_digest   lowercase hex digits (up to 64), or "" when unknown (ids given directly)
 *     document_digest    32 lowercase hex digits: kvf_document_digest() of the document's token ids
 *     recipe_digest      32 lowercase hex digits: the compaction recipe (kf_recipe_digest in
 *                        compactor/recipe.h); its first 16 digits are part of the file name
 *     payload_digest     32 lowercase hex digits: XXH3-128 of the payload (see "Payload digest")
 *     n_doc_tokens       D, the document's length in tokens: 1 <= D <= 2^31 - 1
 *     n_tokens           C, the compacted length: the number of cache slots, 1 <= C <= D
 *     method             "keep" (top-t keys, original values), "drop" (kept keys, values refitted,
 *                        no bias), "am" (Attention Matching: kept keys, bias beta, refitted values),
 *                        "fold" (beta folded into the keys along u, values refitted without bias)
 *     budget             the target C / D the compactor was given, in (0, 1]
 *     lambda             the fold's ridge lambda (0 unless fold), finite and >= 0
 *     rope_frame         "compacted": keys were rotated by -(D - C) positions, so the question's token i
 *                        sits at position C + i (what a paged engine does after a prefix of C tokens);
 *                        "original": keys are in the AM frame, the question starts at position D
 *     placeholder        "digest", the only value of version 2 (readers refuse any other): the serving
 *                        side derives the C placeholder token ids from the cache's identity (the
 *                        connector's "digest-v1" scheme); a new scheme is a new value and a new
 *                        version
 *     dtype              element type of keys and values: "bfloat16", "float16" or "float32"
 *     n_layers (1..4096), kv_heads (1..4096), head_dim (1..65536)
 *     block_size         16: tokens per block of kvf_read_block (vLLM's block size); not the chunking
 *
 *   Datasets (every one chunked with exactly one filter, Fletcher32; every chunk must be present
 *   and stored with filter mask 0; HDF5 fill values are never read)
 *     keys, values  [n_layers, C, kv_heads, head_dim], token-major, exactly what goes into the paged
 *                   blocks. Chunk [1, C, 1, head_dim]: every slot of one (layer, KV head), so a
 *                   tensor-parallel rank serving heads [h0, h1) reads only those heads' chunks, one
 *                   lookup and one read each. A chunk (C * head_dim * element size + 4 bytes) must
 *                   stay below 4 GiB: writers and readers refuse a larger C * head_dim.
 *                   Element type by dtype: float32 = IEEE binary32 LE; float16 = IEEE binary16 LE (an
 *                   HDF5 float of size 2, numpy float16); bfloat16 = uint16 LE holding the bf16 bits
 *                   (HDF5 has no bfloat16; a custom 16-bit float would read as float16 in h5py).
 *                   Each carries a string attribute "dtype" equal to the root's. Every element is
 *                   finite.
 *     beta          [n_layers, kv_heads, C] float32: AM's additive attention bias of each slot
 *                   (0 for keep and drop; already inside the keys for fold); finite, or -inf in a
 *                   padding slot (position -1)
 *     u             [n_layers, kv_heads, head_dim] float32: the fold direction (zeros unless fold);
 *                   finite
 *     positions     [n_layers, kv_heads, C] int32: the original position of each slot's key in the
 *                   document, per head (AM keeps different keys per head), in [0, D); -1 marks a
 *                   padding slot
 *     head_method   [n_layers, kv_heads] uint8: the method (0 keep, 1 drop, 2 am, 3 fold) each head
 *                   was compacted with (all equal to `method` unless the compactor chose per head)
 *     beta, u, positions and head_method are chunked one layer per chunk.
 *     head_digest   [n_layers, kv_heads, 16] uint8, one chunk: the XXH3-128 digest of each (layer,
 *                   KV head) (below), in XXH's canonical (big-endian) byte order
 *   Optional root attributes (added within version 2: older readers ignore them; a file without
 *   them reads as a bare-text cache, all ""): a cache made through the model's chat template
 *   (kvfold compact --chat) records
 *     chat_template_digest      32 lowercase hex digits: XXH3-128 of the template's text
 *     chat_prefix_ids           the ids that precede the document inside the cache (the template's
 *                               text before the first user turn's content: BOS, system, header)
 *     chat_question_prefix_ids  what a question's ids begin with: the template's text between the
 *                               document and the next user turn's content (end of the document's
 *                               turn, the next turn's header)
 *     chat_question_suffix_ids  what follows the question's text: the end of its turn and the
 *                               generation prompt (the assistant's header)
 *   the three id lists as strings of decimal ids joined by commas ("151644,872,198"), each under
 *   KVF_CHAT_IDS_LEN bytes; written only with a template digest, and then all four.
 *   Readers of version 2 ignore any other attribute or dataset.
 *
 *   Payload digest. head_digest[l, h] = XXH3-128 of, in this order: keys[l, :, h, :] and
 *   values[l, :, h, :] ([C, head_dim] elements each, slot-major, LE: exactly the two chunks' data),
 *   beta[l, h] ([C] float32 LE), u[l, h] ([head_dim] float32 LE), positions[l, h] ([C] int32 LE),
 *   head_method[l, h] (1 byte), then l and h as uint64 LE. payload_digest = XXH3-128 of
 *   head_digest (L * kv_heads * 16 bytes, layer-major) followed by L and kv_heads as uint64 LE, as
 *   32 hex digits (high 64 bits first). kvf_open checks the head digests against payload_digest;
 *   every read of a head's keys and values (kvf_read_heads_raw, kvf_read_layer*,
 *   kvf_read_layer_all, kvf_read_block*, kvf_verify) checks that head against its digest, so a
 *   swapped (between heads or layers), missing, zeroed or altered chunk is refused even where its
 *   Fletcher32 sum holds, and a partial read is verified by digests covering exactly what it read
 *   (plus the layer's side chunks, which it reads whole and checks by their sums and values).
 *
 * Files and names
 *   - Content-addressed: <root>/<model_fingerprint>/<document_digest>.<method>-<budget>.<recipe16>.kvf,
 *     budget in its shortest round-trip decimal form ("0.1", "0.25", "1"), recipe16 the first 16
 *     hex digits of recipe_digest: kvf_cache_path().
 *   - kvf_write() builds the file in memory (HDF5's core driver, every chunk written directly with
 *     its Fletcher32 sum; the memory holds one file image, about the size of the file), then
 *     writes it with plain pwrite() calls (64 KiB each) to <final>.tmp-<pid>-<16 hex> in the same directory,
 *     fsyncs it, renames it over the final name and fsyncs the directory: a reader sees no file or
 *     a complete one, two writers of the same name leave one complete file, and a failed write (a
 *     full disk, EFBIG, EIO) leaves no file and no HDF5 state behind (a failed H5Fclose on a disk
 *     file leaves HDF5 1.10 with a freed file that it closes again at exit: SEGV). Files are
 *     deterministic: the same cache gives the same bytes (no object header records a time).
 *     SIGXFSZ is the caller's to ignore. A
 *     killed writer leaves only a temporary name, which kvf_open() refuses and
 *     kvf_clean_temps() removes once old enough.
 *   - HDF5 file locking is off (the files are immutable once renamed, and locks fail on some
 *     shared filesystems).
 *
 * Reading verifies, before anything large is allocated or read: format and version, the HDF5
 * metadata checksums (superblock 2+, object headers 2), every attribute's type and value, every
 * dataset's type, shape, chunking and filter, and that the file is large enough to hold the
 * chunks the header claims (its size taken from the descriptor HDF5 opened, so a complete file
 * renamed over the name meanwhile is never measured against another file's header). Each chunk read is checked for presence, filter mask, size and its
 * Fletcher32 sum ("checksum mismatch in keys, layer 3 head 2"); keys, values, beta, u and
 * positions are checked for their allowed values; reads of keys/values check the head digests of
 * the heads they read. kvf_read_block*() reads (and verifies) the block's whole layer once and
 * serves the layer's blocks from it.
 * kvf_check_model() refuses a file written for another model. A kvf_file is for one thread at a
 * time. Hosts are little-endian (checked at compile time).
 *
 * Library code: no printing, no exit; HDF5's own error printing is switched off and its error
 * stack becomes the kf_error message.
 */
#ifndef KF_KVF_H
#define KF_KVF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/base/convert.h"
#include "kernels/base/dtype.h"
#include "kernels/base/error.h"
#include "kernels/base/method.h"

#define KVF_FORMAT_NAME "kvfold-kvf"
#define KVF_VERSION 2
#define KVF_BLOCK 16           /* tokens per chunk */
#define KVF_DIGEST_LEN 32      /* hex digits of a fingerprint / document digest */
#define KVF_ALL_LAYERS (-1)
#define KVF_PLACEHOLDER "digest" /* the placeholder attribute's only value */
#define KVF_CHAT_IDS_LEN 4096  /* bytes of a chat id list attribute, NUL included */

typedef enum { KVF_FRAME_COMPACTED, KVF_FRAME_ORIGINAL } kvf_rope_frame;
typedef enum { KVF_KEYS, KVF_VALUES } kvf_which;

typedef struct {
    int version;                           /* KVF_VERSION */
    char creator[48];                      /* "kvfold 0.1.0" */
    char model_fingerprint[KVF_DIGEST_LEN + 1];
    char tokenizer_digest[65];             /* "" when unknown */
    char document_digest[KVF_DIGEST_LEN + 1];
    char recipe_digest[KVF_DIGEST_LEN + 1];  /* the caller's kf_recipe_digest (init: 32 zeros) */
    /* A chat cache (optional attributes; all "" for a document compacted as bare text): */
    char chat_template_digest[KVF_DIGEST_LEN + 1]; /* the chat template's, or "" */
    char chat_prefix_ids[KVF_CHAT_IDS_LEN];          /* ids before the document inside the cache */
    char chat_question_prefix_ids[KVF_CHAT_IDS_LEN]; /* what a question's ids begin with */
    char chat_question_suffix_ids[KVF_CHAT_IDS_LEN]; /* what follows the question's text */
    char payload_digest[KVF_DIGEST_LEN + 1]; /* filled by kvf_write / read by kvf_open */
    int64_t n_doc_tokens;                  /* D */
    int64_t n_tokens;                      /* C */
    kf_method method;                     /* the method attribute (kvf_method_attr) */
    double budget;
    double lambda;
    kvf_rope_frame rope_frame;
    char placeholder[64];
    kf_dtype dtype;                       /* bf16, f16 or f32 (kvf_dtype_attr) */
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
    const uint8_t *head_method; /* [n_layers, kv_heads] kf_method per head, or NULL: every head uses hdr.method */
} kvf_cache;

typedef struct kvf_file kvf_file;

/* ---- names and small helpers ---- */

/* Defaults: version, creator, block size 16, rope_frame compacted, placeholder "digest", bf16,
 * recipe_digest 32 zeros. */
void kvf_header_init(kvf_header *h);
const char *kvf_rope_frame_name(kvf_rope_frame f);
/* The file's spellings of what it stores: the method attribute and a file name's method ("keep",
 * "drop", "am", "fold"; the head_method bytes are kf_method's numbers), the dtype attribute
 * ("bfloat16", "float16", "float32"). NULL for a method or dtype the file cannot hold. */
const char *kvf_method_attr(kf_method m);
const char *kvf_dtype_attr(kf_dtype d);
/* kf_dtype_parse (also "bf16", "fp16", "fp32", ...) for a dtype the file stores: 0, or -1 for an
 * unknown name or another dtype (out unchanged). */
int kvf_dtype_parse(const char *s, kf_dtype *out);
/* Bytes of keys plus values: 2 * n_layers * C * kv_heads * head_dim * dtype size. */
int64_t kvf_kv_bytes(const kvf_header *h);

/* XXH3-128 of the ids as little-endian int32 followed by the count as little-endian uint64;
 * 32 lowercase hex digits (the same hash family as kf_model_fingerprint). */
void kvf_document_digest(const int32_t *ids /* [n] */, int64_t n, char out[KVF_DIGEST_LEN + 1]);
/* The budget's shortest decimal that reads back as the same double: 0.1 -> "0.1". */
void kvf_format_budget(double budget, char *out, size_t out_len);
/* <root>/<model_fp>/<doc_digest>.<method>-<budget>.<first 16 hex of recipe_digest>.kvf; with
 * create_dirs, makes the directories. */
kf_status kvf_cache_path(const char *root, const char *model_fp, const char *doc_digest, kf_method method,
                         double budget, const char *recipe_digest, bool create_dirs, char *out, size_t out_len,
                         kf_error *err);
/* A chat id list attribute ("", or decimal ids in [0, 2^31) joined by commas) into out [cap]: the
 * count, or -1 when s is not such a list or holds more than cap ids (out NULL: counted only). */
int kvf_parse_ids(const char *s, int32_t *out, int cap);
/* True when s is exactly len lowercase hex digits. */
bool kvf_is_hex(const char *s, size_t len);
/* True when s (NUL-terminated) is valid UTF-8 without control characters: C0, DEL, C1, the
 * bidirectional controls and the line separators (kf_text_is_plain in formats/escape.h). */
bool kvf_is_clean_utf8(const char *s);
/* True when name (a path or base name) is a writer's temporary file: "*.tmp-<pid>-<16 hex>". */
bool kvf_is_temp_name(const char *name);

/* The stored elements to fp32 and back: kf_convert_to_f32 / kf_convert_from_f32
 * (kernels/base/convert.h). */

/* ---- writing ---- */

/* Validates the cache (header values, finite keys/values/beta/u, positions, head methods) and
 * writes it atomically to path (built in memory, then temporary name, fsync, rename, fsync of the
 * directory). Fills nothing in c: the payload digest is computed here. Any failure (KF_ERR_IO
 * with errno's words for a full disk) leaves no file. An existing file at path is replaced:
 * callers that skip existing work ask kvf_exists_valid() first. */
kf_status kvf_write(const char *path, const kvf_cache *c, kf_error *err);

/* True when path holds a kvf file that kvf_open() and kvf_verify() accept (every checksum, the
 * payload digest, every value), written for model_fp and recipe_digest (either NULL: not checked). */
bool kvf_exists_valid(const char *path, const char *model_fp, const char *recipe_digest);

/* What a file must be to stand for a writer's output: the identity its name and header carry.
 * A NULL string, a negative method, dtype or n_doc_tokens, a budget of 0: not checked. */
typedef struct {
    const char *model_fingerprint, *document_digest, *recipe_digest; /* 32 hex digits each */
    int method;                                                      /* kf_method */
    double budget;
    int dtype;                                                       /* kf_dtype */
    int64_t n_doc_tokens;                                            /* D */
} kvf_identity;

/* KF_ERR_MISMATCH naming the first header field that differs from want (both values). */
kf_status kvf_check_identity(const kvf_file *f, const kvf_identity *want, kf_error *err);

/* The file at path for a writer that would write identity want (a job's skip check): KF_OK when
 * kvf_open() and kvf_verify() accept it and its header is want; KF_ERR_NOTFOUND when nothing is
 * there; else the cause, in err, why it cannot stand for the writer's output (damaged, another
 * document, method, budget, recipe or model: KF_ERR_MISMATCH). */
kf_status kvf_check_existing(const char *path, const kvf_identity *want, kf_error *err);

/* The identity a content-addressed name (kvf_cache_path) claims, against the header: when the
 * base name of path has the form <32 hex>.<method>-<budget>.<16 hex>.kvf, its document digest,
 * method, budget and recipe digest's first 16 digits must be the header's (KF_ERR_MISMATCH naming
 * the field); any other name is not checked (KF_OK). A file copied over another's name is then
 * refused by every reader that checks it. */
kf_status kvf_check_name(const char *path, const kvf_header *h, kf_error *err);

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

/* Everything of one layer, checked against its layer digest: keys and values as stored
 * (kf_dtype_size bytes per element), beta, u, positions and head methods. Any pointer may be NULL
 * (read into the file's scratch, still checked). */
kf_status kvf_read_layer_all(kvf_file *f, int layer, void *keys_raw /* [C, kv_heads, head_dim] */,
                             void *values_raw /* [C, kv_heads, head_dim] */, float *beta /* [kv_heads, C] */,
                             float *u /* [kv_heads, head_dim] */, int32_t *positions /* [kv_heads, C] */,
                             uint8_t *head_method /* [kv_heads] */, kf_error *err);

/* One layer of keys or values, converted to fp32 / as stored (kf_dtype_size bytes per element),
 * checked against the layer digest (the layer's other half is kept, so reading keys then values of
 * a layer reads it once). */
kf_status kvf_read_layer(kvf_file *f, int layer, kvf_which which, float *out /* [C, kv_heads, head_dim] */,
                         kf_error *err);
kf_status kvf_read_layer_raw(kvf_file *f, int layer, kvf_which which, void *out /* [C, kv_heads, head_dim] */,
                             kf_error *err);
/* Heads [h0, h1) of one layer's keys and values as stored, each checked against its head digest
 * (the layer's side chunks are read and checked too): head h of slot t lands at [t, h] of the
 * [C, kv_heads, head_dim] buffers, whose other heads are left as they were. Only these heads'
 * K/V chunks are read. */
kf_status kvf_read_heads_raw(kvf_file *f, int layer, int h0, int h1, void *keys_raw /* [C, kv_heads, head_dim] */,
                             void *values_raw /* [C, kv_heads, head_dim] */, kf_error *err);
/* The same, head-major, as the chunks hold them: head h lands at [h] of the [kv_heads, C, head_dim]
 * buffers, read there directly (no copy); nothing outside heads [h0, h1) is written. */
kf_status kvf_read_heads_hm(kvf_file *f, int layer, int h0, int h1, void *keys_raw /* [kv_heads, C, head_dim] */,
                            void *values_raw /* [kv_heads, C, head_dim] */, kf_error *err);
/* Bytes of K/V chunks (data and sums) this file has read since kvf_open. */
int64_t kvf_kv_bytes_read(const kvf_file *f);
/* One 16-token block (block b holds slots 16b .. 16b+15); *n_tokens = its length (16, or less for
 * the last block). The buffers hold KVF_BLOCK tokens. The first block read of a layer reads and
 * verifies the whole layer (a chunk holds every slot of a head); the layer's other blocks come
 * from memory. */
kf_status kvf_read_block(kvf_file *f, int layer, int64_t block, kvf_which which,
                         float *out /* [16, kv_heads, head_dim] */, int *n_tokens, kf_error *err);
kf_status kvf_read_block_raw(kvf_file *f, int layer, int64_t block, kvf_which which,
                             void *out /* [16, kv_heads, head_dim] */, int *n_tokens, kf_error *err);
int64_t kvf_n_blocks(const kvf_file *f); /* ceil(C / 16) */

/* layer = KVF_ALL_LAYERS reads every layer: [n_layers, ...]. */
kf_status kvf_read_beta(kvf_file *f, int layer, float *out /* [kv_heads, C] */, kf_error *err);
kf_status kvf_read_u(kvf_file *f, int layer, float *out /* [kv_heads, head_dim] */, kf_error *err);
kf_status kvf_read_positions(kvf_file *f, int layer, int32_t *out /* [kv_heads, C] */, kf_error *err);
/* Every head's kf_method. */
kf_status kvf_read_head_methods(kvf_file *f, uint8_t *out /* [n_layers, kv_heads] */, kf_error *err);

/* KF_ERR_MISMATCH when the document (D) or the cache (C) is longer than the model's positions
 * (max_positions <= 0: unknown, not checked). */
kf_status kvf_check_positions(const kvf_file *f, int64_t max_positions, kf_error *err);

/* Reads every chunk of every dataset, verifying all checksums, every value and every layer's
 * digest. */
kf_status kvf_verify(kvf_file *f, kf_error *err);

#endif
