/* kvf_write.c — writing a kvf cache file: built in memory with HDF5's core driver (every chunk
 * written directly with its Fletcher32 sum), then written out with plain write() calls under a
 * temporary name, fsynced, renamed and the directory fsynced (see kvf.h for the format).
 *
 * HDF5 never touches the disk here: when HDF5's own file I/O fails (a full disk), H5Fclose fails
 * and leaves a file ID whose state is already freed, which HDF5 then closes again at exit and
 * crashes. Our write loop reports the errno instead and removes the temporary file. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "formats/kvf_internal.h"
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

/* ---- attributes ---- */

/* A scalar attribute `name` of file type ftype, written from val (memory type mtype). */
static herr_t attr_scalar(hid_t loc, const char *name, hid_t ftype, hid_t mtype, const void *val) {
    hid_t s = H5Screate(H5S_SCALAR), a = -1;
    herr_t rc = -1;
    if (s >= 0 && (a = H5Acreate2(loc, name, ftype, s, H5P_DEFAULT, H5P_DEFAULT)) >= 0)
        rc = H5Awrite(a, mtype, val);
    if (rc < 0)
        kvf_h5_capture();
    if (a >= 0)
        H5Aclose(a);
    if (s >= 0)
        H5Sclose(s);
    return rc;
}

/* A NUL-terminated UTF-8 string attribute of exactly val's length. */
static herr_t attr_str(hid_t loc, const char *name, const char *val) {
    hid_t t = H5Tcopy(H5T_C_S1);
    herr_t rc = -1;
    if (t >= 0 && H5Tset_size(t, strlen(val) + 1) >= 0 && H5Tset_strpad(t, H5T_STR_NULLTERM) >= 0 &&
        H5Tset_cset(t, H5T_CSET_UTF8) >= 0)
        rc = attr_scalar(loc, name, t, t, val);
    else
        kvf_h5_capture();
    if (t >= 0)
        H5Tclose(t);
    return rc;
}

static herr_t attr_i64(hid_t loc, const char *name, int64_t v) {
    return attr_scalar(loc, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

static herr_t attr_f64(hid_t loc, const char *name, double v) {
    return attr_scalar(loc, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}

static herr_t write_attrs(hid_t f, const kvf_header *h, const char *payload_digest) {
    herr_t rc = 0;
    rc |= attr_str(f, "format", KVF_FORMAT_NAME);
    rc |= attr_i64(f, "version", KVF_VERSION);
    rc |= attr_str(f, "creator", h->creator);
    rc |= attr_str(f, "model_fingerprint", h->model_fingerprint);
    rc |= attr_str(f, "tokenizer_digest", h->tokenizer_digest);
    rc |= attr_str(f, "document_digest", h->document_digest);
    rc |= attr_str(f, "recipe_digest", h->recipe_digest);
    rc |= attr_str(f, "payload_digest", payload_digest);
    rc |= attr_i64(f, "n_doc_tokens", h->n_doc_tokens);
    rc |= attr_i64(f, "n_tokens", h->n_tokens);
    rc |= attr_str(f, "method", kvf_method_attr(h->method));
    rc |= attr_f64(f, "budget", h->budget);
    rc |= attr_f64(f, "lambda", h->lambda);
    rc |= attr_str(f, "rope_frame", kvf_rope_frame_name(h->rope_frame));
    rc |= attr_str(f, "placeholder", h->placeholder);
    rc |= attr_str(f, "dtype", kvf_dtype_attr(h->dtype));
    rc |= attr_i64(f, "n_layers", h->n_layers);
    rc |= attr_i64(f, "kv_heads", h->kv_heads);
    rc |= attr_i64(f, "head_dim", h->head_dim);
    rc |= attr_i64(f, "block_size", h->block_size);
    if (h->chat_template_digest[0]) { /* optional: a bare-text cache's attributes stay as they were */
        rc |= attr_str(f, "chat_template_digest", h->chat_template_digest);
        rc |= attr_str(f, "chat_prefix_ids", h->chat_prefix_ids);
        rc |= attr_str(f, "chat_question_prefix_ids", h->chat_question_prefix_ids);
        rc |= attr_str(f, "chat_question_suffix_ids", h->chat_question_suffix_ids);
    }
    return rc < 0 ? -1 : 0;
}

/* A chunked dataset with Fletcher32 sums (maxdims NULL: fixed at dims). */
static hid_t make_dataset(hid_t f, const char *name, hid_t ftype, int rank, const hsize_t *dims, const hsize_t *maxdims,
                          const hsize_t *chunk) {
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE), space = H5Screate_simple(rank, dims, maxdims), d = -1;
    if (dcpl >= 0 && space >= 0 && H5Pset_chunk(dcpl, rank, chunk) >= 0 && H5Pset_fletcher32(dcpl) >= 0 &&
        H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER) >= 0 && H5Pset_obj_track_times(dcpl, 0) >= 0)
        d = H5Dcreate2(f, name, ftype, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (d < 0)
        kvf_h5_capture();
    if (space >= 0)
        H5Sclose(space);
    if (dcpl >= 0)
        H5Pclose(dcpl);
    return d;
}

/* Stores n bytes of data (+ room for 4 more in buf) as the chunk at coord, with the Fletcher32 sum
 * HDF5's filter would append (little-endian). */
static herr_t put_chunk(hid_t d, const hsize_t *coord, unsigned char *buf, size_t n) {
    const uint32_t sum = kvf_fletcher32(buf, n);
    for (int b = 0; b < 4; b++)
        buf[n + (size_t)b] = (unsigned char)(sum >> (8 * b));
    herr_t rc = H5Dwrite_chunk(d, H5P_DEFAULT, 0, coord, n + 4, buf);
    if (rc < 0)
        kvf_h5_capture();
    return rc;
}

typedef struct {
    const char *path;
    kf_error *err;
} wctx;

static kf_status h5fail(wctx *w, const char *what) {
    char m[300];
    kvf_h5_take_error(m, sizeof m, NULL, NULL);
    return kf_fail(w->err, KF_ERR_IO, "%s: cannot %s: %s", w->path, what, m);
}

enum { W_KEYS, W_VALUES, W_BETA, W_U, W_POS, W_HM, W_N };

/* Per-layer buffers of the writer. */
typedef struct {
    unsigned char *chunk; /* one stored chunk: the largest of a K/V block and a side layer, + 4 */
    float *zeros;         /* [H, max(C, D)] */
    int32_t *ident;       /* [H, C] slot j -> j */
    uint8_t *hm;          /* [H] */
} wbufs;

/* Head hd of layer l's keys (i = 0) or values (1), [C, head_dim], into chunk in dtype (converted
 * from fp32, round to nearest even, or copied as given), refused when not finite. */
static kf_status head_kv(const kvf_cache *c, int i, int l, size_t hd, unsigned char *chunk, wctx *w) {
    const kvf_header *h = &c->hdr;
    const size_t H = (size_t)h->kv_heads, D = (size_t)h->head_dim, C = (size_t)h->n_tokens;
    const size_t esz = kf_dtype_size(h->dtype);
    const float *src = i ? c->values : c->keys;
    const void *raw = i ? c->values_raw : c->keys_raw;
    for (size_t t = 0; t < C; t++) {
        const size_t at = (((size_t)l * C + t) * H + hd) * D; /* element offset of [l, t, hd, 0] */
        if (src)
            kf_convert_from_f32(chunk + t * D * esz, h->dtype, src + at, D);
        else
            memcpy(chunk + t * D * esz, (const char *)raw + at * esz, D * esz);
    }
    const int64_t bad = kvf_first_nonfinite(h->dtype, chunk, C * D);
    if (bad < 0)
        return KF_OK;
    return kf_fail(w->err, KF_ERR_INVALID, "%s: %s of layer %d, slot %lld, head %zu %s in %s", w->path,
                   i ? "values" : "keys", l, (long long)((size_t)bad / D), hd,
                   src ? "is not finite or overflows" : "is not finite", kf_dtype_name(h->dtype));
}

/* Writes one layer: one K and one V chunk per head (each converted, checked, hashed and summed
 * while in cache) and the side chunks; the head digests into digests ([kv_heads, 16]). */
static kf_status write_layer(hid_t ds[W_N], const kvf_cache *c, int l, wbufs *b, uint8_t *digests, wctx *w) {
    const kvf_header *h = &c->hdr;
    const size_t H = (size_t)h->kv_heads, C = (size_t)h->n_tokens, D = (size_t)h->head_dim;
    const size_t cb = C * D * kf_dtype_size(h->dtype); /* bytes of one (layer, head) chunk */
    const float *beta = c->beta ? c->beta + (size_t)l * H * C : b->zeros;
    const float *u = c->u ? c->u + (size_t)l * H * D : b->zeros;
    const int32_t *pos = c->positions ? c->positions + (size_t)l * H * C : b->ident;
    const uint8_t *hm = c->head_method ? c->head_method + (size_t)l * H : b->hm;
    if (kvf_check_side(h, w->path, l, beta, u, pos, hm, w->err) != KF_OK) {
        if (w->err)
            w->err->code = KF_ERR_INVALID;
        return KF_ERR_INVALID;
    }
    char what[64];
    for (size_t hd = 0; hd < H; hd++) {
        XXH3_state_t st;
        XXH3_128bits_reset(&st);
        for (int i = 0; i < 2; i++) {
            KF_TRY(head_kv(c, i, l, hd, b->chunk, w));
            kvf_hash_update(&st, b->chunk, cb);
            const hsize_t coord[4] = {(hsize_t)l, 0, hd, 0};
            if (put_chunk(ds[i], coord, b->chunk, cb) < 0) {
                snprintf(what, sizeof what, "write %s of layer %d head %zu", i ? "values" : "keys", l, hd);
                return h5fail(w, what);
            }
        }
        kvf_head_digest_finish(h, l, (int)hd, &st, beta, u, pos, hm, digests + hd * 16);
    }
    const struct {
        const void *p;
        size_t n;
    } side[4] = {{beta, H * C * 4}, {u, H * D * 4}, {pos, H * C * 4}, {hm, H}};
    for (int i = 0; i < 4; i++) {
        const hsize_t coord[3] = {(hsize_t)l, 0, 0};
        memcpy(b->chunk, side[i].p, side[i].n);
        if (put_chunk(ds[W_BETA + i], coord, b->chunk, side[i].n) < 0) {
            snprintf(what, sizeof what, "write the side data of layer %d", l);
            return h5fail(w, what);
        }
    }
    return KF_OK;
}

static kf_status wbufs_init(wbufs *b, const kvf_cache *c, wctx *w) {
    const kvf_header *h = &c->hdr;
    const size_t H = (size_t)h->kv_heads, C = (size_t)h->n_tokens, D = (size_t)h->head_dim;
    const size_t esz = kf_dtype_size(h->dtype), blk = C * D * esz; /* one (layer, head) chunk */
    size_t big = blk > H * C * 4 ? blk : H * C * 4;
    big = big > H * D * 4 ? big : H * D * 4;
    memset(b, 0, sizeof *b);
    if (!(b->chunk = malloc(big + 4)) || !(b->zeros = calloc(H * (C > D ? C : D), sizeof(float))) ||
        !(b->ident = malloc(H * C * sizeof(int32_t))) || !(b->hm = malloc(H)))
        return kf_fail(w->err, KF_ERR_NOMEM, "%s: out of memory for a layer (%zu slots)", w->path, C);
    for (size_t r = 0; r < H; r++)
        for (size_t j = 0; j < C; j++)
            b->ident[r * C + j] = (int32_t)j;
    memset(b->hm, (int)h->method, H);
    return KF_OK;
}

static void wbufs_free(wbufs *b) {
    free(b->chunk);
    free(b->zeros);
    free(b->ident);
    free(b->hm);
}

static kf_status write_contents(hid_t f, const kvf_cache *c, wctx *w) {
    const kvf_header *h = &c->hdr;
    const hsize_t L = (hsize_t)h->n_layers, C = (hsize_t)h->n_tokens, H = (hsize_t)h->kv_heads,
                  D = (hsize_t)h->head_dim;
    const hsize_t kvd[4] = {L, C, H, D}, kvc[4] = {1, C, 1, D};
    const hsize_t bd[3] = {L, H, C}, bc[3] = {1, H, C}, ud[3] = {L, H, D}, uc[3] = {1, H, D};
    const hsize_t hd[2] = {L, H}, hc[2] = {1, H}, dd[3] = {L, H, 16};
    hid_t ds[W_N] = {-1, -1, -1, -1, -1, -1}, dig = -1, et = kvf_h5_type(h->dtype);
    uint8_t *digests = calloc((size_t)(L * H) * 16 + 4, 1); /* [L, H, 16] + room for the chunk sum */
    wbufs b;
    kf_status st = wbufs_init(&b, c, w);
    if (st == KF_OK && (!digests || et < 0))
        st = kf_fail(w->err, KF_ERR_NOMEM, "%s: out of memory", w->path);
    if (st == KF_OK) {
        ds[W_KEYS] = make_dataset(f, "keys", et, 4, kvd, NULL, kvc);
        ds[W_VALUES] = make_dataset(f, "values", et, 4, kvd, NULL, kvc);
        ds[W_BETA] = make_dataset(f, "beta", H5T_IEEE_F32LE, 3, bd, NULL, bc);
        ds[W_U] = make_dataset(f, "u", H5T_IEEE_F32LE, 3, ud, NULL, uc);
        ds[W_POS] = make_dataset(f, "positions", H5T_STD_I32LE, 3, bd, NULL, bc);
        ds[W_HM] = make_dataset(f, "head_method", H5T_STD_U8LE, 2, hd, NULL, hc);
        dig = make_dataset(f, "head_digest", H5T_STD_U8LE, 3, dd, NULL, dd);
        for (int i = 0; i < W_N && st == KF_OK; i++)
            if (ds[i] < 0 || dig < 0 || (i < 2 && attr_str(ds[i], "dtype", kvf_dtype_attr(h->dtype)) < 0))
                st = h5fail(w, "create the datasets");
    }
    for (int l = 0; l < (int)L && st == KF_OK; l++)
        st = write_layer(ds, c, l, &b, digests + (size_t)l * H * 16, w);
    char payload[KVF_DIGEST_LEN + 1];
    if (st == KF_OK) {
        kvf_payload_digest(digests, (int)L, (int)H, payload);
        const hsize_t zero[3] = {0, 0, 0};
        if (put_chunk(dig, zero, digests, (size_t)(L * H) * 16) < 0)
            st = h5fail(w, "write the head digests");
    }
    if (st == KF_OK && write_attrs(f, h, payload) < 0)
        st = h5fail(w, "write attributes");
    for (int i = 0; i < W_N; i++)
        if (ds[i] >= 0)
            H5Dclose(ds[i]);
    if (dig >= 0)
        H5Dclose(dig);
    if (et >= 0)
        H5Tclose(et);
    wbufs_free(&b);
    free(digests);
    return st;
}

/* The core driver's buffer, kept past H5Fclose: the file image as HDF5 left it when it closed the
 * file (H5Fget_file_image on an open file of superblock 3 gives an image HDF5 1.10.8 cannot read).
 * Every allocation of the driver comes through these callbacks. */
typedef struct {
    void *mem;
    size_t size;
    bool closed;
} core_image;

static void *img_malloc(size_t size, H5FD_file_image_op_t op, void *udata) {
    (void)op;
    core_image *ci = udata;
    void *p = calloc(1, size ? size : 1); /* zeros: any byte HDF5 leaves unwritten is deterministic */
    if (p && !ci->mem) {
        ci->mem = p;
        ci->size = size;
    }
    return p;
}
static void *img_memcpy(void *dest, const void *src, size_t size, H5FD_file_image_op_t op, void *udata) {
    (void)op;
    (void)udata;
    return memcpy(dest, src, size);
}
static void *img_realloc(void *ptr, size_t size, H5FD_file_image_op_t op, void *udata) {
    (void)op;
    core_image *ci = udata;
    if (!ptr)
        return img_malloc(size, op, udata);
    void *p = realloc(ptr, size ? size : 1);
    if (p && ptr == ci->mem && size > ci->size)
        memset((char *)p + ci->size, 0, size - ci->size);
    if (p && ptr == ci->mem) {
        ci->mem = p;
        ci->size = size;
    }
    return p;
}
static herr_t img_free(void *ptr, H5FD_file_image_op_t op, void *udata) {
    core_image *ci = udata;
    if (ptr && ptr == ci->mem && op == H5FD_FILE_IMAGE_OP_FILE_CLOSE)
        ci->closed = true; /* ours now */
    else
        free(ptr);
    return 0;
}
static void *udata_copy(void *udata) {
    return udata;
}
static herr_t udata_free(void *udata) {
    (void)udata;
    return 0;
}

/* The file's bytes, built in memory: *image (malloc'd) of *size bytes. name is the in-memory file's
 * name: one that does not exist (HDF5's core driver reads an existing file of that name into
 * memory first, even with H5F_ACC_TRUNC, and bytes of it survived into the image). */
static kf_status build_image(const kvf_cache *c, const char *name, void **image, size_t *size, wctx *w) {
    const kvf_header *h = &c->hdr;
    /* the core driver grows by this much: about the whole file, so it does not grow in steps */
    const double est =
        (double)kvf_kv_bytes(h) * 1.02 + 16.0 * h->n_layers * h->kv_heads * (double)h->n_tokens + (1 << 20);
    core_image ci = {0};
    H5FD_file_image_callbacks_t cb = {img_malloc, img_memcpy, img_realloc, img_free, udata_copy, udata_free, &ci};
    /* no timestamps in the root group's header (the datasets' are off in make_dataset): the same
     * cache gives the same bytes */
    hid_t fcpl = H5Pcreate(H5P_FILE_CREATE), fapl = H5Pcreate(H5P_FILE_ACCESS), f = -1;
    if (fcpl >= 0 && fapl >= 0 && H5Pset_obj_track_times(fcpl, 0) >= 0 &&
        H5Pset_fapl_core(fapl, est < 1e12 ? (size_t)est : (size_t)1 << 30, 0) >= 0 &&
        H5Pset_file_image_callbacks(fapl, &cb) >= 0 &&
        H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST) >= 0)
        f = H5Fcreate(name, H5F_ACC_TRUNC, fcpl, fapl);
    if (f < 0)
        kvf_h5_capture();
    if (fcpl >= 0)
        H5Pclose(fcpl);
    if (fapl >= 0)
        H5Pclose(fapl);
    if (f < 0)
        return h5fail(w, "create the file in memory");
    kf_status st = write_contents(f, c, w);
    if (H5Fclose(f) < 0 && st == KF_OK) /* memory only: not expected to fail */
        st = h5fail(w, "close the file in memory");
    /* the end of file from the superblock (version 2+, 8-byte addresses: bytes 28..35) */
    const unsigned char *m = ci.mem;
    uint64_t eof = 0;
    for (int b = 0; ci.closed && ci.size >= 48 && b < 8; b++)
        eof |= (uint64_t)m[28 + b] << (8 * b);
    if (st == KF_OK && (!ci.closed || ci.size < 48 || m[8] < 2 || m[9] != 8 || eof < 48 || eof > ci.size))
        st = kf_fail(w->err, KF_ERR_IO, "%s: HDF5 left no complete file image in memory", w->path);
    if (st != KF_OK) {
        if (ci.closed)
            free(ci.mem);
        return st;
    }
    *image = ci.mem;
    *size = (size_t)eof;
    return KF_OK;
}

/* ---- to disk ---- */

static int fsync_path(const char *path, int flags) {
    int fd = open(path, flags | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}

/* Creates tmp (exclusively, never through a symlink) with the bytes, fsynced; on failure removes
 * it: -1 with errno. */
static int write_file(const char *tmp, const void *bytes, size_t n) {
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    const char *p = bytes;
    int rc = 0;
    off_t at = 0;
    /* 64 KiB pieces: a writer stopped midway (a signal, tests/slurm/stall.c) leaves a partial
     * temporary file, as a real one would; the syscalls cost nothing next to the copies */
    while (n > 0 && rc == 0) {
        ssize_t k = pwrite(fd, p, n > ((size_t)1 << 16) ? (size_t)1 << 16 : n, at);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            rc = -1;
            break;
        }
        p += k;
        at += k;
        n -= (size_t)k;
    }
    if (rc == 0)
        rc = fsync(fd);
    int e = errno;
    if (close(fd) != 0 && rc == 0) {
        rc = -1;
        e = errno;
    }
    if (rc != 0) {
        unlink(tmp);
        errno = e;
    }
    return rc;
}

/* <path>.tmp-<pid>-<16 hex>: unique per process and call, recognizable by kvf_is_temp_name */
static char *temp_name(const char *path) {
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        rnd = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ (uint64_t)(uintptr_t)&ts;
    }
    size_t tl = strlen(path) + 64;
    char *tmp = malloc(tl);
    if (tmp)
        snprintf(tmp, tl, "%s.tmp-%ld-%016llx", path, (long)getpid(), (unsigned long long)rnd);
    return tmp;
}

static kf_status check_cache(const char *path, const kvf_cache *c, kf_error *err) {
    if (kvf_is_temp_name(path))
        return kf_fail(err, KF_ERR_INVALID, "%s: the name of a temporary file cannot be a cache's name", path);
    if (c->hdr.version != KVF_VERSION)
        return kf_fail(err, KF_ERR_INVALID, "%s: header version %d (this kvfold writes version %d)", path,
                       c->hdr.version, KVF_VERSION);
    if (kvf_header_check(&c->hdr, path, err) != KF_OK) {
        if (err)
            err->code = KF_ERR_INVALID;
        return KF_ERR_INVALID;
    }
    if ((!c->keys && !c->keys_raw) || (!c->values && !c->values_raw))
        return kf_fail(err, KF_ERR_INVALID, "%s: the cache has no keys or no values", path);
    return KF_OK;
}

kf_status kvf_write(const char *path, const kvf_cache *c, kf_error *err) {
    kvf_h5_quiet();
    if (!path || !*path || !c)
        return kf_fail(err, KF_ERR_INVALID, "kvf_write: no path or cache");
    KF_TRY(check_cache(path, c, err));
    wctx w = {.path = path, .err = err};
    void *image = NULL;
    size_t size = 0;
    char *tmp = temp_name(path), *dircopy = strdup(path);
    kf_status st = KF_OK;
    if (!tmp || !dircopy)
        st = kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    else if (access(tmp, F_OK) == 0)
        st = kf_fail(err, KF_ERR_IO, "%s: the temporary name %s is taken", path, tmp);
    else
        st = build_image(c, tmp, &image, &size, &w);
    if (st != KF_OK)
        ;
    else if (write_file(tmp, image, size) != 0)
        st = kf_fail(err, KF_ERR_IO, "%s: cannot write %s (%zu bytes): %s", path, tmp, size, strerror(errno));
    else if (rename(tmp, path) != 0) {
        st = kf_fail(err, KF_ERR_IO, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
        unlink(tmp);
    } else if (fsync_path(dirname(dircopy), O_RDONLY | O_DIRECTORY) != 0) {
        /* the rename itself is durable once the directory is synced */
        st = kf_fail(err, KF_ERR_IO, "%s: cannot fsync its directory: %s", path, strerror(errno));
    }
    free(image);
    free(tmp);
    free(dircopy);
    return st;
}
