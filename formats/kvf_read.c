/* kvf_read.c — opening, validating and reading kvf cache files (see kvf.h for the format).
 *
 * Every dataset is read chunk by chunk with H5Dread_chunk, past HDF5's filter pipeline (keys and
 * values: one chunk per (layer, head), landing head-major, then token-major where asked): each
 * chunk must be present, stored with filter mask 0 and exactly its size plus the 4-byte
 * Fletcher32 sum, which is checked here (HDF5's pipeline would skip the check for a chunk whose
 * mask says so, and would read an absent chunk as fill values). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "formats/kvf_internal.h"
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

static const char *const kDsNames[N_DS] = {"keys", "values", "beta", "u", "positions", "head_method", "head_digest"};

void kvf_close(kvf_file *f) {
    if (!f)
        return;
    for (int i = 0; i < N_DS; i++)
        if (f->ds[i] >= 0)
            H5Dclose(f->ds[i]);
    if (f->f >= 0)
        H5Fclose(f->f);
    free(f->digests);
    free(f->kbuf);
    free(f->vbuf);
    free(f->conv);
    free(f->chunkbuf);
    free(f->hk);
    free(f->hv);
    free(f->beta);
    free(f->u);
    free(f->pos);
    free(f->hm);
    free(f->path);
    free(f);
}

const kvf_header *kvf_file_header(const kvf_file *f) {
    return &f->hdr;
}
const char *kvf_file_path(const kvf_file *f) {
    return f->path;
}
int64_t kvf_n_blocks(const kvf_file *f) {
    return (f->hdr.n_tokens + KVF_BLOCK - 1) / KVF_BLOCK;
}

static size_t layer_n(const kvf_header *h) {
    return (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim;
}
static size_t row_bytes(const kvf_header *h) {
    return (size_t)h->kv_heads * (size_t)h->head_dim * kf_dtype_size(h->dtype);
}
static size_t head_chunk_bytes(const kvf_header *h) { /* one (layer, head) chunk's data: [C, head_dim] */
    return (size_t)h->n_tokens * (size_t)h->head_dim * kf_dtype_size(h->dtype);
}
int64_t kvf_kv_bytes_read(const kvf_file *f) {
    return f->kv_bytes_read;
}

/* ---- attributes ---- */

/* Opens a scalar attribute of exactly type want (for strings: any fixed-length NUL-terminated
 * UTF-8 string of at most max_len bytes; *len gets its size). */
/* The bytes the header's chunks take (data + sums), which the file must at least hold: a file
 * claiming 4,096 layers or C = 2^21 in a few KB is refused before anything is allocated. */
static double claimed_bytes(const kvf_header *h) {
    const double L = h->n_layers, H = h->kv_heads, C = (double)h->n_tokens, D = h->head_dim;
    const double kv = 2 * L * H * (C * D * (double)kf_dtype_size(h->dtype) + 4);
    return kv + L * (2 * (H * C * 4 + 4) + H * D * 4 + 4 + H + 4) + L * H * 16 + 4;
}

/* ---- datasets ---- */

static void dims_text(char *buf, size_t n, int rank, const hsize_t *d) {
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < rank && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, "%s%llu", i ? ", " : "", (unsigned long long)d[i]);
}

/* Shape, chunk and element type of each dataset as the header implies them. */
static int ds_spec(const kvf_header *h, int which, hsize_t *dims, hsize_t *chunk, hid_t *type) {
    const hsize_t L = (hsize_t)h->n_layers, C = (hsize_t)h->n_tokens, H = (hsize_t)h->kv_heads,
                  D = (hsize_t)h->head_dim;
    switch (which) {
    case DS_KEYS:
    case DS_VALUES:
        memcpy(dims, (hsize_t[]){L, C, H, D}, 4 * sizeof(hsize_t));
        memcpy(chunk, (hsize_t[]){1, C, 1, D}, 4 * sizeof(hsize_t));
        *type = kvf_h5_type(h->dtype);
        return 4;
    case DS_U:
        memcpy(dims, (hsize_t[]){L, H, D}, 3 * sizeof(hsize_t));
        memcpy(chunk, (hsize_t[]){1, H, D}, 3 * sizeof(hsize_t));
        *type = H5Tcopy(H5T_IEEE_F32LE);
        return 3;
    case DS_BETA:
    case DS_POS:
        memcpy(dims, (hsize_t[]){L, H, C}, 3 * sizeof(hsize_t));
        memcpy(chunk, (hsize_t[]){1, H, C}, 3 * sizeof(hsize_t));
        *type = H5Tcopy(which == DS_BETA ? H5T_IEEE_F32LE : H5T_STD_I32LE);
        return 3;
    case DS_HM:
        memcpy(dims, (hsize_t[]){L, H}, 2 * sizeof(hsize_t));
        memcpy(chunk, (hsize_t[]){1, H}, 2 * sizeof(hsize_t));
        *type = H5Tcopy(H5T_STD_U8LE);
        return 2;
    default:
        memcpy(dims, (hsize_t[]){L, H, 16}, 3 * sizeof(hsize_t));
        memcpy(chunk, (hsize_t[]){L, H, 16}, 3 * sizeof(hsize_t));
        *type = H5Tcopy(H5T_STD_U8LE);
        return 3;
    }
}

/* The dataset's type, shape, layout, chunk and pipeline (exactly Fletcher32) against spec. */
static kf_status check_dataset(kvf_file *f, int which, hid_t d, kf_error *err) {
    const char *name = kDsNames[which];
    hsize_t want[4], chunk[4], got[8], gc[8];
    hid_t want_t = -1;
    const int rank = ds_spec(&f->hdr, which, want, chunk, &want_t);
    hid_t t = H5Dget_type(d), s = H5Dget_space(d), p = H5Dget_create_plist(d);
    char got_s[96], want_s[96];
    kf_status st = KF_OK;
    H5O_info_t oi;
    if (t < 0 || s < 0 || p < 0 || want_t < 0 || H5Oget_info2(d, &oi, H5O_INFO_HDR) < 0) {
        st = kf_fail(err, KF_ERR_FORMAT, "%s: cannot read the description of dataset '%s'", f->path, name);
    } else if (oi.hdr.version < 2) {
        st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' has an object header without checksums", f->path, name);
    } else if (H5Tequal(t, want_t) <= 0) {
        st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' does not hold the documented element type", f->path, name);
    } else {
        const int r = H5Sget_simple_extent_ndims(s);
        if (r != rank || H5Sget_simple_extent_dims(s, got, NULL) != rank ||
            memcmp(got, want, sizeof(hsize_t) * (size_t)rank) != 0) {
            dims_text(got_s, sizeof got_s, r > 0 && r <= 8 && H5Sget_simple_extent_dims(s, got, NULL) == r ? r : 0,
                      got);
            dims_text(want_s, sizeof want_s, rank, want);
            st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' has shape [%s], the header implies [%s]", f->path, name,
                         got_s, want_s);
        } else if (H5Pget_layout(p) != H5D_CHUNKED || H5Pget_chunk(p, rank, gc) != rank ||
                   memcmp(gc, chunk, sizeof(hsize_t) * (size_t)rank) != 0) {
            dims_text(want_s, sizeof want_s, rank, chunk);
            st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' is not chunked in [%s]", f->path, name, want_s);
        } else {
            unsigned fl = 0;
            size_t n0 = 0;
            if (H5Pget_nfilters(p) != 1 || H5Pget_filter2(p, 0, &fl, &n0, NULL, 0, NULL, NULL) != H5Z_FILTER_FLETCHER32)
                st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' does not have exactly the Fletcher32 filter",
                             f->path, name);
        }
    }
    H5Eclear2(H5E_DEFAULT);
    if (p >= 0)
        H5Pclose(p);
    if (s >= 0)
        H5Sclose(s);
    if (t >= 0)
        H5Tclose(t);
    if (want_t >= 0)
        H5Tclose(want_t);
    return st;
}

static kf_status open_dataset(kvf_file *f, int which, kf_error *err) {
    const char *name = kDsNames[which];
    if (H5Lexists(f->f, name, H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: missing dataset '%s'", f->path, name);
    }
    H5L_info_t li;
    if (H5Lget_info(f->f, name, &li, H5P_DEFAULT) < 0 || li.type != H5L_TYPE_HARD) {
        H5Eclear2(H5E_DEFAULT); /* a soft or external link would read another object or file */
        return kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' is a link, not a dataset of this file", f->path, name);
    }
    hid_t d = H5Dopen2(f->f, name, H5P_DEFAULT);
    if (d < 0) {
        char m[256];
        kvf_h5_take_error(m, sizeof m, NULL, NULL);
        return kf_fail(err, KF_ERR_FORMAT, "%s: cannot open dataset '%s': %s", f->path, name, m);
    }
    kf_status st = check_dataset(f, which, d, err);
    if (st == KF_OK && which <= DS_VALUES) {
        char dt[32];
        hid_t keep = f->f;
        f->f = d; /* read_str reads attributes of f->f */
        st = kvf_attr_read_str(f, "dtype", dt, sizeof dt, err);
        f->f = keep;
        if (st == KF_OK && strcmp(dt, kvf_dtype_attr(f->hdr.dtype)) != 0)
            st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' has dtype attribute '%s', the file says '%s'", f->path,
                         name, dt, kf_dtype_name(f->hdr.dtype));
    }
    if (st != KF_OK) {
        H5Dclose(d);
        return st;
    }
    f->ds[which] = d;
    return KF_OK;
}

/* ---- chunks ---- */

static void chunk_where(const kvf_file *f, int which, const hsize_t *coord, char *buf, size_t n) {
    (void)f;
    if (which <= DS_VALUES) {
        snprintf(buf, n, "%s, layer %d head %d", kDsNames[which], (int)coord[0], (int)coord[2]);
    } else if (which == DS_DIGEST) {
        snprintf(buf, n, "%s", kDsNames[which]);
    } else {
        snprintf(buf, n, "%s, layer %d", kDsNames[which], (int)coord[0]);
    }
}

/* The stored chunk at coord: n data bytes then the 4-byte sum into dst (room for n + 4), present,
 * with filter mask 0 and a matching Fletcher32 sum. */
static kf_status get_chunk(kvf_file *f, int which, const hsize_t *coord, size_t n, void *dst, kf_error *err) {
    const hid_t d = f->ds[which];
    hsize_t size = 0;
    uint32_t mask = 0;
    char where[128], m[300];
    if (H5Dget_chunk_storage_size(d, coord, &size) < 0) {
        /* HDF5 1.10 fails here for a chunk that was never written: tell that apart */
        H5Eclear2(H5E_DEFAULT);
        haddr_t addr = 0;
        unsigned fm = 0;
        hsize_t sz = 0;
        if (H5Dget_chunk_info_by_coord(d, coord, &fm, &addr, &sz) >= 0 && (addr == HADDR_UNDEF || sz == 0))
            size = 0;
        else
            size = (hsize_t)-1;
    }
    if (size == (hsize_t)-1 || (size == n + 4 && H5Dread_chunk(d, H5P_DEFAULT, coord, &mask, dst) < 0)) {
        kvf_h5_take_error(m, sizeof m, NULL, NULL);
        chunk_where(f, which, coord, where, sizeof where);
        return kf_fail(err, KF_ERR_FORMAT, "%s: cannot read %s: %s", f->path, where, m);
    }
    if (size != n + 4 || mask != 0) {
        chunk_where(f, which, coord, where, sizeof where);
        if (size == 0)
            return kf_fail(err, KF_ERR_FORMAT, "%s: %s was never written (no stored chunk): the file is damaged",
                           f->path, where);
        if (size != n + 4)
            return kf_fail(err, KF_ERR_FORMAT, "%s: %s is stored in %llu bytes, not %zu: the file is damaged", f->path,
                           where, (unsigned long long)size, n + 4);
        return kf_fail(err, KF_ERR_FORMAT, "%s: %s is stored with filter mask %u (its checksum skipped): refused",
                       f->path, where, mask);
    }
    const unsigned char *t = (const unsigned char *)dst + n;
    if (kvf_fletcher32(dst, n) !=
        ((uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24)) {
        chunk_where(f, which, coord, where, sizeof where);
        return kf_fail(err, KF_ERR_FORMAT, "%s: checksum mismatch in %s: the file is damaged", f->path, where);
    }
    return KF_OK;
}

static kf_status alloc_buffers(kvf_file *f, kf_error *err) {
    if (f->chunkbuf)
        return KF_OK;
    const kvf_header *h = &f->hdr;
    const size_t H = (size_t)h->kv_heads, C = (size_t)h->n_tokens, D = (size_t)h->head_dim;
    if (!(f->chunkbuf = malloc(head_chunk_bytes(h) + 4)) || !(f->beta = malloc(H * C * 4 + 4)) ||
        !(f->u = malloc(H * D * 4 + 4)) || !(f->pos = malloc(H * C * 4 + 4)) || !(f->hm = malloc(H + 4))) {
        free(f->chunkbuf);
        f->chunkbuf = NULL;
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", f->path);
    }
    return KF_OK;
}

static kf_status layer_buffer(kvf_file *f, void **b, kf_error *err) {
    if (!*b && !(*b = malloc(layer_n(&f->hdr) * kf_dtype_size(f->hdr.dtype))))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a layer (%lld slots)", f->path,
                       (long long)f->hdr.n_tokens);
    return KF_OK;
}

/* The C x head_dim elements of one head's keys/values chunk x are finite. */
static kf_status check_finite(kvf_file *f, int which, int layer, int head, const void *x, kf_error *err) {
    const size_t D = (size_t)f->hdr.head_dim;
    const int64_t bad = kvf_first_nonfinite(f->hdr.dtype, x, (size_t)f->hdr.n_tokens * D);
    if (bad < 0)
        return KF_OK;
    return kf_fail(err, KF_ERR_FORMAT, "%s: %s of layer %d, slot %lld, head %d is NaN or infinite: refused", f->path,
                   kDsNames[which], layer, (long long)((size_t)bad / D), head);
}

/* Head hd of one layer's keys (which = DS_KEYS) or values, [C, head_dim] as stored, from its
 * chunk into dst (room for the data and its 4-byte sum): sum and values checked, hashed into st. */
static kf_status read_head_chunk(kvf_file *f, int which, int layer, int hd, unsigned char *dst, XXH3_state_t *st,
                                 kf_error *err) {
    const size_t cb = head_chunk_bytes(&f->hdr);
    const hsize_t coord[4] = {(hsize_t)layer, 0, (hsize_t)hd, 0};
    KF_TRY(get_chunk(f, which, coord, cb, dst, err));
    f->kv_bytes_read += (int64_t)cb + 4;
    KF_TRY(check_finite(f, which, layer, hd, dst, err));
    kvf_hash_update(st, dst, cb);
    return KF_OK;
}

/* Heads [h0, h1) from head-major src ([h1 - h0, C, head_dim]) into token-major out ([C, kv_heads,
 * head_dim]): written slot by slot, in order (a scatter head by head is several times slower). */
static void heads_to_tokens(const kvf_header *h, int h0, int h1, const unsigned char *src, unsigned char *out) {
    const size_t C = (size_t)h->n_tokens, hb = (size_t)h->head_dim * kf_dtype_size(h->dtype);
    const size_t row = (size_t)h->kv_heads * hb, nh = (size_t)(h1 - h0);
#if defined(__SSE2__)
    if (hb % 16 == 0 && (uintptr_t)out % 16 == 0 && row % 16 == 0) { /* streaming stores: out is not read back here */
        for (size_t t = 0; t < C; t++) {
            __m128i *o = (__m128i *)(out + t * row + (size_t)h0 * hb);
            for (size_t j = 0; j < nh; j++) {
                const unsigned char *sp = src + (j * C + t) * hb;
                for (size_t b = 0; b < hb; b += 16, o++)
                    _mm_stream_si128(o, _mm_loadu_si128((const __m128i *)(sp + b)));
            }
        }
        _mm_sfence();
        return;
    }
#endif
    for (size_t t = 0; t < C; t++) {
        unsigned char *o = out + t * row + (size_t)h0 * hb;
        for (size_t j = 0; j < nh; j++)
            memcpy(o + j * hb, src + (j * C + t) * hb, hb);
    }
}

/* One layer of side data into f->beta, u, pos, hm, checked for allowed values. */
static kf_status read_side_layer(kvf_file *f, int layer, kf_error *err) {
    KF_TRY(alloc_buffers(f, err));
    const size_t H = (size_t)f->hdr.kv_heads, C = (size_t)f->hdr.n_tokens, D = (size_t)f->hdr.head_dim;
    const hsize_t coord[3] = {(hsize_t)layer, 0, 0};
    KF_TRY(get_chunk(f, DS_BETA, coord, H * C * 4, f->beta, err));
    KF_TRY(get_chunk(f, DS_U, coord, H * D * 4, f->u, err));
    KF_TRY(get_chunk(f, DS_POS, coord, H * C * 4, f->pos, err));
    KF_TRY(get_chunk(f, DS_HM, coord, H, f->hm, err));
    return kvf_check_side(&f->hdr, f->path, layer, f->beta, f->u, f->pos, f->hm, err);
}

/* ---- open ---- */

static kf_status read_digests(kvf_file *f, kf_error *err) {
    const int L = f->hdr.n_layers, H = f->hdr.kv_heads;
    if (!(f->digests = malloc((size_t)L * (size_t)H * 16 + 4)))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", f->path);
    const hsize_t zero[3] = {0, 0, 0};
    KF_TRY(get_chunk(f, DS_DIGEST, zero, (size_t)L * (size_t)H * 16, f->digests, err));
    char got[KVF_DIGEST_LEN + 1];
    kvf_payload_digest(f->digests, L, H, got);
    if (strcmp(got, f->hdr.payload_digest) != 0)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: the head digests give payload digest %s, the header says %s: the file "
                       "is damaged",
                       f->path, got, f->hdr.payload_digest);
    return KF_OK;
}

/* HDF5's own checksums cover the metadata only from superblock version 2 and object header
 * version 2 on (what H5F_LIBVER_LATEST writes). */
static kf_status check_metadata_checksums(kvf_file *f, kf_error *err) {
    H5F_info2_t fi;
    H5O_info_t oi;
    bool ok = H5Fget_info2(f->f, &fi) >= 0 && fi.super.version >= 2 && H5Oget_info2(f->f, &oi, H5O_INFO_HDR) >= 0 &&
              oi.hdr.version >= 2;
    H5Eclear2(H5E_DEFAULT);
    if (!ok)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: written without HDF5 metadata checksums (superblock or root object header too old)",
                       f->path);
    return KF_OK;
}

static kf_status open_contents(kvf_file *f, kf_error *err) {
    KF_TRY(kvf_read_version(f, err));
    KF_TRY(check_metadata_checksums(f, err));
    KF_TRY(kvf_read_format(f, err));
    KF_TRY(kvf_read_header(f, err));
    const double need = claimed_bytes(&f->hdr);
    if (need > (double)f->file_size)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: the header claims %d layers x %lld slots x %d kv heads x %d (%.0f bytes of chunks), the "
                       "file has %lld bytes",
                       f->path, f->hdr.n_layers, (long long)f->hdr.n_tokens, f->hdr.kv_heads, f->hdr.head_dim, need,
                       (long long)f->file_size);
    for (int i = 0; i < N_DS; i++)
        KF_TRY(open_dataset(f, i, err));
    return read_digests(f, err);
}

/* f->file_size from the descriptor HDF5 opened, not from the path: a file renamed over the name
 * between a stat of the path and the open would otherwise lend its size to the other file's
 * header check. */
static kf_status opened_size(kvf_file *f, kf_error *err) {
    hid_t fapl = H5Fget_access_plist(f->f);
    const bool sec2 = fapl >= 0 && H5Pget_driver(fapl) == H5FD_SEC2;
    if (fapl >= 0)
        H5Pclose(fapl);
    void *handle = NULL;
    struct stat sb;
    hsize_t size = 0;
    if (sec2 && H5Fget_vfd_handle(f->f, H5P_DEFAULT, &handle) >= 0 && handle && fstat(*(int *)handle, &sb) == 0) {
        if (!S_ISREG(sb.st_mode))
            return kf_fail(err, KF_ERR_FORMAT, "%s: not a regular file", f->path);
        f->file_size = (int64_t)sb.st_size;
    } else if (!sec2 && H5Fget_filesize(f->f, &size) >= 0) {
        f->file_size = (int64_t)size;
    } else {
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_IO, "%s: cannot find the size of the opened file", f->path);
    }
    return KF_OK;
}

kf_status kvf_open(const char *path, kvf_file **out, kf_error *err) {
    *out = NULL;
    kvf_h5_quiet();
    if (kvf_is_temp_name(path))
        return kf_fail(err, KF_ERR_INVALID,
                       "%s: a writer's temporary file (unfinished or killed), never read as a cache; "
                       "kvf_clean_temps removes old ones",
                       path);
    struct stat sb;
    if (stat(path, &sb) != 0)
        return kf_fail(err, errno == ENOENT ? KF_ERR_NOTFOUND : KF_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return kf_fail(err, KF_ERR_FORMAT, "%s: not a regular file", path);
    kvf_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    }
    f->f = -1;
    f->pending_layer = -1;
    f->block_layer = -1;
    for (int i = 0; i < N_DS; i++)
        f->ds[i] = -1;
    hid_t fapl = kvf_h5_fapl();
    f->f = fapl < 0 ? -1 : H5Fopen(path, H5F_ACC_RDONLY, fapl);
    if (f->f < 0)
        kvf_h5_capture();
    if (fapl >= 0)
        H5Pclose(fapl);
    kf_status st = KF_OK;
    if (f->f >= 0)
        st = opened_size(f, err);
    if (f->f < 0) {
        char m[300];
        bool truncated;
        kvf_h5_take_error(m, sizeof m, NULL, &truncated);
        if (truncated)
            st = kf_fail(err, KF_ERR_FORMAT, "%s: truncated file, %lld bytes (HDF5: %s)", path, (long long)sb.st_size,
                         m);
        else
            st = kf_fail(err, KF_ERR_FORMAT, "%s: not an HDF5 file, or damaged (%lld bytes; HDF5: %s)", path,
                         (long long)sb.st_size, m);
    } else if (st == KF_OK) {
        st = open_contents(f, err);
    }
    H5Eclear2(H5E_DEFAULT);
    if (st != KF_OK) {
        kvf_close(f);
        return st;
    }
    *out = f;
    return KF_OK;
}

static kf_status read_heads_hm(kvf_file *f, int layer, int h0, int h1, void *k, void *v, int hoff, kf_error *err) {
    KF_TRY(read_side_layer(f, layer, err));
    const size_t cb = head_chunk_bytes(&f->hdr);
    for (int hd = h0; hd < h1; hd++) {
        XXH3_state_t st;
        XXH3_128bits_reset(&st);
        unsigned char *kd = (unsigned char *)k + (size_t)(hd - hoff) * cb, *vd = (unsigned char *)v + (size_t)(hd - hoff) * cb;
        const bool last = hd == h1 - 1;
        KF_TRY(read_head_chunk(f, DS_KEYS, layer, hd, last ? f->chunkbuf : kd, &st, err));
        if (last)
            memcpy(kd, f->chunkbuf, cb);
        KF_TRY(read_head_chunk(f, DS_VALUES, layer, hd, last ? f->chunkbuf : vd, &st, err));
        if (last)
            memcpy(vd, f->chunkbuf, cb);
        uint8_t d[16];
        kvf_head_digest_finish(&f->hdr, layer, hd, &st, f->beta, f->u, f->pos, f->hm, d);
        if (memcmp(d, f->digests + ((size_t)layer * (size_t)f->hdr.kv_heads + (size_t)hd) * 16, 16) != 0)
            return kf_fail(err, KF_ERR_FORMAT,
                           "%s: layer %d head %d does not match its digest (chunks swapped, missing, zeroed or "
                           "altered): the file is damaged",
                           f->path, layer, hd);
    }
    return KF_OK;
}

/* Heads [h0, h1) of one layer (keys and values into k and v, [C, kv_heads, head_dim], each head
 * in its place; either NULL: not copied), through the head-major scratch f->hk, f->hv. */
static kf_status read_heads(kvf_file *f, int layer, int h0, int h1, void *k, void *v, kf_error *err) {
    const size_t cb = head_chunk_bytes(&f->hdr), n = cb * (size_t)f->hdr.kv_heads + 4;
    if ((!f->hk && !(f->hk = malloc(n))) || (!f->hv && !(f->hv = malloc(n))))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a layer (%lld slots)", f->path,
                       (long long)f->hdr.n_tokens);
    KF_TRY(read_heads_hm(f, layer, h0, h1, f->hk, f->hv, h0, err));
    if (k)
        heads_to_tokens(&f->hdr, h0, h1, f->hk, k);
    if (v)
        heads_to_tokens(&f->hdr, h0, h1, f->hv, v);
    return KF_OK;
}

/* The arguments of a heads read are in range; the read buffers allocated. */
static kf_status heads_read_begin(kvf_file *f, int layer, int h0, int h1, const void *keys_raw,
                                  const void *values_raw, kf_error *err) {
    if (!f || !keys_raw || !values_raw || layer < 0 || layer >= f->hdr.n_layers || h0 < 0 || h0 >= h1 ||
        h1 > f->hdr.kv_heads)
        return kf_fail(err, KF_ERR_INVALID, "%s: bad read of layer %d heads [%d, %d) (the file has %d x %d)",
                       f ? f->path : "kvf", layer, h0, h1, f ? f->hdr.n_layers : 0, f ? f->hdr.kv_heads : 0);
    return alloc_buffers(f, err);
}

kf_status kvf_read_heads_hm(kvf_file *f, int layer, int h0, int h1, void *keys_raw, void *values_raw,
                            kf_error *err) {
    KF_TRY(heads_read_begin(f, layer, h0, h1, keys_raw, values_raw, err));
    return read_heads_hm(f, layer, h0, h1, keys_raw, values_raw, 0, err);
}

kf_status kvf_read_heads_raw(kvf_file *f, int layer, int h0, int h1, void *keys_raw, void *values_raw,
                             kf_error *err) {
    KF_TRY(heads_read_begin(f, layer, h0, h1, keys_raw, values_raw, err));
    if (keys_raw == f->kbuf || values_raw == f->vbuf || keys_raw == f->vbuf || values_raw == f->kbuf)
        return kf_fail(err, KF_ERR_INVALID, "%s: kvf_read_heads_raw into the file's own buffers", f->path);
    return read_heads(f, layer, h0, h1, keys_raw, values_raw, err);
}

kf_status kvf_read_layer_all(kvf_file *f, int layer, void *keys_raw, void *values_raw, float *beta, float *u,
                             int32_t *positions, uint8_t *head_method, kf_error *err) {
    if (!f || layer < 0 || layer >= f->hdr.n_layers)
        return kf_fail(err, KF_ERR_INVALID, "%s: bad read of layer %d (the file has %d)", f ? f->path : "kvf", layer,
                       f ? f->hdr.n_layers : 0);
    KF_TRY(alloc_buffers(f, err));
    if (!keys_raw)
        KF_TRY(layer_buffer(f, &f->kbuf, err));
    if (!values_raw)
        KF_TRY(layer_buffer(f, &f->vbuf, err));
    void *k = keys_raw ? keys_raw : f->kbuf, *v = values_raw ? values_raw : f->vbuf;
    if (k == f->kbuf || v == f->vbuf) { /* their contents are being overwritten */
        f->pending_layer = -1;
        f->block_layer = -1;
    }
    KF_TRY(read_heads(f, layer, 0, f->hdr.kv_heads, k, v, err));
    const size_t H = (size_t)f->hdr.kv_heads, C = (size_t)f->hdr.n_tokens, D = (size_t)f->hdr.head_dim;
    if (beta)
        memcpy(beta, f->beta, H * C * 4);
    if (u)
        memcpy(u, f->u, H * D * 4);
    if (positions)
        memcpy(positions, f->pos, H * C * 4);
    if (head_method)
        memcpy(head_method, f->hm, H);
    return KF_OK;
}

static kf_status check_args(kvf_file *f, int layer, kvf_which which, const void *out, kf_error *err) {
    if (!f || !out || layer < 0 || layer >= f->hdr.n_layers || (which != KVF_KEYS && which != KVF_VALUES))
        return kf_fail(err, KF_ERR_INVALID, "%s: bad read of layer %d (the file has %d)", f ? f->path : "kvf", layer,
                       f ? f->hdr.n_layers : 0);
    return KF_OK;
}

kf_status kvf_read_layer_raw(kvf_file *f, int layer, kvf_which which, void *out, kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    const size_t bytes = layer_n(&f->hdr) * kf_dtype_size(f->hdr.dtype);
    if (f->pending_layer == layer && f->pending_which == which) {
        memcpy(out, which == KVF_KEYS ? f->kbuf : f->vbuf, bytes);
        f->pending_layer = -1;
        return KF_OK;
    }
    f->pending_layer = -1;
    const bool keys = which == KVF_KEYS;
    KF_TRY(kvf_read_layer_all(f, layer, keys ? out : NULL, keys ? NULL : out, NULL, NULL, NULL, NULL, err));
    f->pending_layer = layer;
    f->pending_which = keys ? KVF_VALUES : KVF_KEYS;
    return KF_OK;
}

kf_status kvf_read_layer(kvf_file *f, int layer, kvf_which which, float *out, kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    const kvf_header *h = &f->hdr;
    if (h->dtype == KF_DTYPE_F32)
        return kvf_read_layer_raw(f, layer, which, out, err);
    KF_TRY(layer_buffer(f, &f->conv, err));
    KF_TRY(kvf_read_layer_raw(f, layer, which, f->conv, err));
    kf_convert_to_f32(out, f->conv, h->dtype, layer_n(h));
    return KF_OK;
}

kf_status kvf_read_block_raw(kvf_file *f, int layer, int64_t block, kvf_which which, void *out, int *n_tokens,
                             kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    if (block < 0 || block >= kvf_n_blocks(f))
        return kf_fail(err, KF_ERR_INVALID, "%s: block %lld out of range (the file has %lld)", f->path,
                       (long long)block, (long long)kvf_n_blocks(f));
    if (f->block_layer != layer) { /* a chunk holds every slot of one head: the whole layer, verified */
        KF_TRY(kvf_read_layer_all(f, layer, NULL, NULL, NULL, NULL, NULL, NULL, err));
        f->block_layer = layer;
    }
    const size_t row = row_bytes(&f->hdr);
    int64_t nt = f->hdr.n_tokens - block * KVF_BLOCK;
    nt = nt > KVF_BLOCK ? KVF_BLOCK : nt;
    const unsigned char *src = (const unsigned char *)(which == KVF_KEYS ? f->kbuf : f->vbuf);
    memcpy(out, src + (size_t)block * KVF_BLOCK * row, (size_t)nt * row);
    if (n_tokens)
        *n_tokens = (int)nt;
    return KF_OK;
}

kf_status kvf_read_block(kvf_file *f, int layer, int64_t block, kvf_which which, float *out, int *n_tokens,
                         kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    KF_TRY(alloc_buffers(f, err));
    int nt;
    KF_TRY(layer_buffer(f, &f->conv, err));
    KF_TRY(kvf_read_block_raw(f, layer, block, which, f->conv, &nt, err));
    kf_convert_to_f32(out, f->conv, f->hdr.dtype, (size_t)nt * (size_t)f->hdr.kv_heads * (size_t)f->hdr.head_dim);
    if (n_tokens)
        *n_tokens = nt;
    return KF_OK;
}

/* beta, u, positions, head_method: one layer [kv_heads, n] or all [n_layers, kv_heads, n] */
static kf_status read_side(kvf_file *f, int which, int layer, void *out, kf_error *err) {
    if (!f || !out || layer < KVF_ALL_LAYERS || layer >= f->hdr.n_layers)
        return kf_fail(err, KF_ERR_INVALID, "%s: bad read of %s, layer %d", f ? f->path : "kvf", kDsNames[which],
                       layer);
    const size_t H = (size_t)f->hdr.kv_heads, C = (size_t)f->hdr.n_tokens, D = (size_t)f->hdr.head_dim;
    const size_t n = which == DS_U ? H * D * 4 : which == DS_HM ? H : H * C * 4;
    const void *src = NULL;
    const int l0 = layer == KVF_ALL_LAYERS ? 0 : layer, l1 = layer == KVF_ALL_LAYERS ? f->hdr.n_layers : layer + 1;
    for (int l = l0; l < l1; l++) {
        KF_TRY(read_side_layer(f, l, err));
        src = which == DS_BETA  ? (const void *)f->beta
              : which == DS_U   ? (const void *)f->u
              : which == DS_POS ? (const void *)f->pos
                                : (const void *)f->hm;
        memcpy((char *)out + (size_t)(l - l0) * n, src, n);
    }
    return KF_OK;
}

kf_status kvf_read_beta(kvf_file *f, int layer, float *out, kf_error *err) {
    return read_side(f, DS_BETA, layer, out, err);
}
kf_status kvf_read_u(kvf_file *f, int layer, float *out, kf_error *err) {
    return read_side(f, DS_U, layer, out, err);
}
kf_status kvf_read_positions(kvf_file *f, int layer, int32_t *out, kf_error *err) {
    return read_side(f, DS_POS, layer, out, err);
}
kf_status kvf_read_head_methods(kvf_file *f, uint8_t *out, kf_error *err) {
    return read_side(f, DS_HM, KVF_ALL_LAYERS, out, err);
}

kf_status kvf_verify(kvf_file *f, kf_error *err) {
    for (int l = 0; l < f->hdr.n_layers; l++)
        KF_TRY(kvf_read_layer_all(f, l, NULL, NULL, NULL, NULL, NULL, NULL, err));
    return KF_OK;
}
