/* kvf_internal.h — helpers shared by kvf.c, kvf_write.c and kvf_read.c (not a public header). */
#ifndef KF_KVF_INTERNAL_H
#define KF_KVF_INTERNAL_H

#include <hdf5.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/kvf.h"
#include "kernels/base/convert.h"

/* The method and dtype attributes' values (kvf.c): method i is kf_method i; dtype i is
 * kvf_dtype_of_attr[i]. */
#define KVF_N_METHODS 4
#define KVF_N_DTYPES 3
extern const char *const kvf_method_attrs[KVF_N_METHODS];
extern const char *const kvf_dtype_attrs[KVF_N_DTYPES];
extern const kf_dtype kvf_dtype_of_attr[KVF_N_DTYPES];
/* A method attribute's (or a file name's) value to its method: 0, or -1 when unknown. */
int kvf_method_from_attr(const char *s, kf_method *out);

/* Switches HDF5's automatic error printing off (once per process; library code never prints). */
void kvf_h5_quiet(void);

/* The most specific message on HDF5's error stack (empty when none), then clears the stack.
 * *checksum is set when a Fletcher32 (or other EDC) check failed; *truncated when HDF5 found the
 * file shorter than its superblock says. Either may be NULL. */
void kvf_h5_take_error(char *buf, size_t n, bool *checksum, bool *truncated);
/* Saves the current error stack (if any) for a later kvf_h5_take_error, before cleanup calls
 * that would clear it. */
void kvf_h5_capture(void);

/* The HDF5 type of a keys/values element for dtype (LE): H5Tclose it. */
hid_t kvf_h5_type(kf_dtype d);

/* Checks every header field the format constrains (not the version); msg names path. */
kf_status kvf_header_check(const kvf_header *h, const char *path, kf_error *err);

/* Index of the first NaN or infinity among n elements stored in dtype d, or -1. */
int64_t kvf_first_nonfinite(kf_dtype d, const void *x, size_t n);
/* One layer's side data has only allowed values: positions in [-1, D), beta finite or -inf at a
 * padding slot, u finite, head methods 0..3. KF_ERR_FORMAT naming path, layer, head and slot. */
kf_status kvf_check_side(const kvf_header *h, const char *path, int layer, const float *beta /* [H, C] */,
                         const float *u /* [H, D] */, const int32_t *pos /* [H, C] */, const uint8_t *hm /* [H] */,
                         kf_error *err);
/* The head digest of kvf.h ("Payload digest") with keys[layer, :, head] and values[layer, :, head]
 * already fed to an XXH3_state_t (reset, then the two chunks): adds the head's side data (taken
 * from one layer's beta [H, C], u [H, D], pos [H, C], hm [H]), the layer and the head. */
void kvf_head_digest_finish(const kvf_header *h, int layer, int head, void *xxh3_state, const float *beta,
                            const float *u, const int32_t *pos, const uint8_t *hm, uint8_t out[16]);
/* XXH3_128bits_update on an XXH3_state_t, with AVX2 where the CPU has it (same digests). */
void kvf_hash_update(void *xxh3_state, const void *p, size_t n);
void kvf_payload_digest(const uint8_t *head_digests /* [n_layers, kv_heads, 16] */, int n_layers, int kv_heads,
                        char out[KVF_DIGEST_LEN + 1]);

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvf reads and writes little-endian data in place: a big-endian host needs byte swaps"
#endif

/* The Fletcher32 sum HDF5's filter appends to each chunk (stored little-endian after the data):
 * bytes taken in big-endian pairs, a lone last byte as the high half, both sums folded into
 * 1..65535 (0 only for all-zero input). Matched against the library in test_kvf. */
uint32_t kvf_fletcher32(const void *data, size_t n);

/* An open file (kvf_read.c): the datasets, the header, the buffers of the reads. */
enum { DS_KEYS, DS_VALUES, DS_BETA, DS_U, DS_POS, DS_HM, DS_DIGEST, N_DS };

struct kvf_file {
    char *path;
    hid_t f;
    hid_t ds[N_DS];
    kvf_header hdr;
    int64_t file_size;
    uint8_t *digests; /* [n_layers, kv_heads, 16] + 4: head digests as stored */
    /* lazily allocated: one layer of keys / values as stored, a conversion buffer, a chunk */
    void *kbuf, *vbuf, *conv; /* [C, kv_heads, head_dim] in dtype each */
    unsigned char *chunkbuf;  /* one stored K/V chunk (data + sum): [C, head_dim] of one head */
    unsigned char *hk, *hv;   /* one layer's keys / values head-major, [kv_heads, C, head_dim] + 4 each */
    int block_layer;          /* the layer kbuf and vbuf hold whole and verified for block reads, or -1 */
    int64_t kv_bytes_read;    /* bytes of K/V chunks read (data + sums) since kvf_open */
    /* one layer of side data (+ 4 bytes of room for a chunk's sum each) */
    float *beta, *u;   /* [kv_heads, C], [kv_heads, head_dim] */
    int32_t *pos;      /* [kv_heads, C] */
    uint8_t *hm;       /* [kv_heads] */
    int pending_layer; /* the half of a layer kept by kvf_read_layer_raw, or -1 */
    kvf_which pending_which;
};

/* Reads and checks every header attribute into f->hdr (kvf_read_header.c). */
kf_status kvf_read_header(kvf_file *f, kf_error *err);
/* One string attribute into out [n] (clean, NUL-terminated), or an error naming it. */
kf_status kvf_attr_read_str(kvf_file *f, const char *name, char *out, size_t n, kf_error *err);
/* The format's name and version attributes: this reader's, or an error saying which it is. */
kf_status kvf_read_version(kvf_file *f, kf_error *err);
kf_status kvf_read_format(kvf_file *f, kf_error *err);

/* File access properties for reading: file locking off (the files never change once renamed). */
hid_t kvf_h5_fapl(void);

#endif
