/* kvf_read.c — opening, validating and reading kvf cache files (see kvf.h for the format). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "formats/kvf_internal.h"

enum { DS_KEYS, DS_VALUES, DS_BETA, DS_U, DS_POS, N_DS };
static const char *const kDsNames[N_DS] = {"keys", "values", "beta", "u", "positions"};

struct kvf_file {
    char *path;
    hid_t f;
    hid_t ds[N_DS];
    hid_t etype;     /* keys/values element type in memory (== the file's) */
    kvf_header hdr;
    void *scratch;   /* [C, kv_heads, head_dim] in dtype, for conversions and diagnosis */
    /* for read_direct: which of keys/values have exactly the [fletcher32] pipeline; one stored
     * chunk (data + sum) for the last chunk of a read */
    bool direct[2];
    unsigned char *chunkbuf;
};

void kvf_close(kvf_file *f) {
    if (!f)
        return;
    for (int i = 0; i < N_DS; i++)
        if (f->ds[i] >= 0)
            H5Dclose(f->ds[i]);
    if (f->etype >= 0)
        H5Tclose(f->etype);
    if (f->f >= 0)
        H5Fclose(f->f);
    free(f->scratch);
    free(f->chunkbuf);
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

/* ---- attributes ---- */

static kf_status open_attr(kvf_file *f, const char *name, H5T_class_t cls, hid_t *a, kf_error *err) {
    if (H5Aexists(f->f, name) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: missing attribute '%s'", f->path, name);
    }
    *a = H5Aopen(f->f, name, H5P_DEFAULT);
    hid_t t = *a >= 0 ? H5Aget_type(*a) : -1, s = *a >= 0 ? H5Aget_space(*a) : -1;
    bool ok = t >= 0 && s >= 0 && H5Tget_class(t) == cls && H5Sget_simple_extent_npoints(s) == 1;
    if (t >= 0)
        H5Tclose(t);
    if (s >= 0)
        H5Sclose(s);
    if (!ok) {
        if (*a >= 0)
            H5Aclose(*a);
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: attribute '%s' is not a %s scalar", f->path, name,
                       cls == H5T_STRING ? "string" : cls == H5T_INTEGER ? "integer" : "real");
    }
    return KF_OK;
}

static kf_status read_str(kvf_file *f, const char *name, char *out, size_t n, kf_error *err) {
    hid_t a = -1;
    KF_TRY(open_attr(f, name, H5T_STRING, &a, err));
    hid_t ft = H5Aget_type(a), mt = H5Tcopy(H5T_C_S1);
    herr_t rc = -1;
    H5Tset_cset(mt, H5Tget_cset(ft)); /* HDF5 does not convert between ASCII and UTF-8 */
    bool too_long = false;
    if (H5Tis_variable_str(ft) > 0) {
        char *s = NULL;
        if (H5Tset_size(mt, H5T_VARIABLE) >= 0 && (rc = H5Aread(a, mt, &s)) >= 0) {
            too_long = !s || strlen(s) >= n;
            snprintf(out, n, "%s", s ? s : "");
        }
        if (rc < 0)
            kvf_h5_capture();
        if (s)
            H5free_memory(s);
    } else {
        size_t sz = H5Tget_size(ft);
        char *buf = calloc(1, sz + 1);
        if (buf && H5Tset_size(mt, sz + 1) >= 0 && H5Tset_strpad(mt, H5T_STR_NULLTERM) >= 0 &&
            (rc = H5Aread(a, mt, buf)) >= 0) {
            too_long = strlen(buf) >= n;
            snprintf(out, n, "%s", buf);
        }
        if (rc < 0)
            kvf_h5_capture();
        free(buf);
    }
    H5Tclose(mt);
    H5Tclose(ft);
    H5Aclose(a);
    if (rc < 0) {
        char m[256];
        kvf_h5_take_error(m, sizeof m, NULL, NULL);
        return kf_fail(err, KF_ERR_FORMAT, "%s: cannot read attribute '%s': %s", f->path, name, m);
    }
    if (too_long)
        return kf_fail(err, KF_ERR_FORMAT, "%s: attribute '%s' is longer than %zu bytes", f->path, name, n - 1);
    return KF_OK;
}

static kf_status read_num(kvf_file *f, const char *name, bool real, void *out, kf_error *err) {
    hid_t a = -1;
    KF_TRY(open_attr(f, name, real ? H5T_FLOAT : H5T_INTEGER, &a, err));
    herr_t rc = H5Aread(a, real ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64, out);
    if (rc < 0)
        kvf_h5_capture();
    H5Aclose(a);
    if (rc < 0) {
        char m[256];
        kvf_h5_take_error(m, sizeof m, NULL, NULL);
        return kf_fail(err, KF_ERR_FORMAT, "%s: cannot read attribute '%s': %s", f->path, name, m);
    }
    return KF_OK;
}

static kf_status read_int(kvf_file *f, const char *name, int64_t lo, int64_t hi, int64_t *out, kf_error *err) {
    KF_TRY(read_num(f, name, false, out, err));
    if (*out < lo || *out > hi)
        return kf_fail(err, KF_ERR_FORMAT, "%s: attribute '%s' = %lld is out of range [%lld, %lld]", f->path, name,
                       (long long)*out, (long long)lo, (long long)hi);
    return KF_OK;
}

static kf_status read_header(kvf_file *f, kf_error *err) {
    kvf_header *h = &f->hdr;
    char s[128];
    int64_t v;
    if (H5Aexists(f->f, "format") <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: not a kvfold cache file (an HDF5 file without a 'format' attribute)",
                       f->path);
    }
    KF_TRY(read_str(f, "format", s, sizeof s, err));
    if (strcmp(s, KVF_FORMAT_NAME) != 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: not a kvfold cache file (format '%s', expected '%s')", f->path, s,
                       KVF_FORMAT_NAME);
    KF_TRY(read_num(f, "version", false, &v, err));
    if (v != KVF_VERSION)
        return kf_fail(err, KF_ERR_UNSUPPORTED,
                       "%s: kvf version %lld is not supported (this kvfold %s reads version %d); rebuild the cache "
                       "or use a matching kvfold",
                       f->path, (long long)v, KVFOLD_VERSION, KVF_VERSION);
    h->version = (int)v;
    KF_TRY(read_str(f, "creator", h->creator, sizeof h->creator, err));
    KF_TRY(read_str(f, "model_fingerprint", h->model_fingerprint, sizeof h->model_fingerprint, err));
    KF_TRY(read_str(f, "tokenizer_digest", h->tokenizer_digest, sizeof h->tokenizer_digest, err));
    KF_TRY(read_str(f, "document_digest", h->document_digest, sizeof h->document_digest, err));
    KF_TRY(read_int(f, "n_doc_tokens", 1, INT64_MAX, &h->n_doc_tokens, err));
    KF_TRY(read_int(f, "n_tokens", 1, (int64_t)1 << 31, &h->n_tokens, err));
    KF_TRY(read_str(f, "method", s, sizeof s, err));
    if (kvf_method_parse(s, &h->method) != 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: unknown method '%s' (keep, drop, am, fold)", f->path, s);
    KF_TRY(read_num(f, "budget", true, &h->budget, err));
    KF_TRY(read_num(f, "lambda", true, &h->lambda, err));
    KF_TRY(read_str(f, "rope_frame", s, sizeof s, err));
    if (strcmp(s, "compacted") == 0)
        h->rope_frame = KVF_FRAME_COMPACTED;
    else if (strcmp(s, "original") == 0)
        h->rope_frame = KVF_FRAME_ORIGINAL;
    else
        return kf_fail(err, KF_ERR_FORMAT, "%s: unknown rope_frame '%s' (compacted, original)", f->path, s);
    KF_TRY(read_str(f, "placeholder", h->placeholder, sizeof h->placeholder, err));
    KF_TRY(read_str(f, "dtype", s, sizeof s, err));
    if (strcmp(s, "bfloat16") == 0 || strcmp(s, "float16") == 0 || strcmp(s, "float32") == 0)
        kvf_dtype_parse(s, &h->dtype);
    else
        return kf_fail(err, KF_ERR_FORMAT, "%s: unknown dtype '%s' (bfloat16, float16, float32)", f->path, s);
    KF_TRY(read_int(f, "n_layers", 1, 4096, &v, err));
    h->n_layers = (int)v;
    KF_TRY(read_int(f, "kv_heads", 1, 4096, &v, err));
    h->kv_heads = (int)v;
    KF_TRY(read_int(f, "head_dim", 1, 65536, &v, err));
    h->head_dim = (int)v;
    KF_TRY(read_int(f, "block_size", 1, 1 << 20, &v, err));
    h->block_size = (int)v;
    return kvf_header_check(h, f->path, err);
}

/* ---- datasets ---- */

static void dims_text(char *buf, size_t n, int rank, const hsize_t *d) {
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < rank && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, "%s%llu", i ? ", " : "", (unsigned long long)d[i]);
}

static kf_status open_dataset(kvf_file *f, int which, kf_error *err) {
    const kvf_header *h = &f->hdr;
    const char *name = kDsNames[which];
    const hsize_t L = (hsize_t)h->n_layers, C = (hsize_t)h->n_tokens, H = (hsize_t)h->kv_heads,
                  D = (hsize_t)h->head_dim;
    hsize_t want[4], chunk[4];
    int rank = 3;
    hid_t want_t;
    switch (which) {
    case DS_KEYS:
    case DS_VALUES:
        rank = 4;
        memcpy(want, (hsize_t[]){L, C, H, D}, sizeof want);
        memcpy(chunk, (hsize_t[]){1, KVF_BLOCK, H, D}, sizeof chunk);
        want_t = H5Tcopy(f->etype);
        break;
    case DS_U:
        memcpy(want, (hsize_t[]){L, H, D}, 3 * sizeof(hsize_t));
        want_t = H5Tcopy(H5T_IEEE_F32LE);
        break;
    case DS_BETA:
        memcpy(want, (hsize_t[]){L, H, C}, 3 * sizeof(hsize_t));
        want_t = H5Tcopy(H5T_IEEE_F32LE);
        break;
    default:
        memcpy(want, (hsize_t[]){L, H, C}, 3 * sizeof(hsize_t));
        want_t = H5Tcopy(H5T_STD_I32LE);
        break;
    }
    kf_status st = KF_OK;
    hid_t d = -1, t = -1, s = -1, p = -1;
    char m[256], got_s[96], want_s[96];
    if (H5Lexists(f->f, name, H5P_DEFAULT) <= 0) {
        st = kf_fail(err, KF_ERR_FORMAT, "%s: missing dataset '%s'", f->path, name);
        goto out;
    }
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    if (dapl >= 0 && which <= DS_VALUES)
        H5Pset_chunk_cache(dapl, 0, 0, 1.0); /* each chunk is read once: no cache copies */
    d = dapl >= 0 ? H5Dopen2(f->f, name, dapl) : -1;
    if (d < 0)
        kvf_h5_capture();
    if (dapl >= 0)
        H5Pclose(dapl);
    if (d < 0 || (t = H5Dget_type(d)) < 0 || (s = H5Dget_space(d)) < 0 ||
        (p = H5Dget_create_plist(d)) < 0) {
        kvf_h5_take_error(m, sizeof m, NULL, NULL);
        st = kf_fail(err, KF_ERR_FORMAT, "%s: cannot open dataset '%s': %s", f->path, name, m);
        goto out;
    }
    if (H5Tequal(t, want_t) <= 0) {
        st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' does not hold %s elements", f->path, name,
                     which <= DS_VALUES ? kvf_dtype_name(h->dtype) : which == DS_POS ? "int32" : "float32");
        goto out;
    }
    hsize_t got[8];
    int r = H5Sget_simple_extent_ndims(s);
    if (r != rank || H5Sget_simple_extent_dims(s, got, NULL) != rank ||
        memcmp(got, want, sizeof(hsize_t) * (size_t)rank) != 0) {
        if (r > 0 && r <= 8)
            H5Sget_simple_extent_dims(s, got, NULL);
        dims_text(got_s, sizeof got_s, r > 0 && r <= 8 ? r : 0, got);
        dims_text(want_s, sizeof want_s, rank, want);
        st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' has shape [%s], the header implies [%s]", f->path, name,
                     got_s, want_s);
        goto out;
    }
    unsigned flags = 0, cd[8];
    size_t ncd = 8;
    char fname[32];
    unsigned fcfg;
    if (H5Pget_filter_by_id2(p, H5Z_FILTER_FLETCHER32, &flags, &ncd, cd, sizeof fname, fname, &fcfg) < 0) {
        H5Eclear2(H5E_DEFAULT);
        st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' has no Fletcher32 checksums", f->path, name);
        goto out;
    }
    if (rank == 4) {
        hsize_t gc[4];
        if (H5Pget_layout(p) != H5D_CHUNKED || H5Pget_chunk(p, 4, gc) != 4 || memcmp(gc, chunk, sizeof gc) != 0) {
            dims_text(want_s, sizeof want_s, 4, chunk);
            st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' is not chunked in [%s] blocks", f->path, name, want_s);
            goto out;
        }
        char ds_dtype[32];
        hid_t a = H5Aexists(d, "dtype") > 0 ? H5Aopen(d, "dtype", H5P_DEFAULT) : -1;
        ds_dtype[0] = 0;
        if (a >= 0) {
            hid_t mt = H5Tcopy(H5T_C_S1), at = H5Aget_type(a);
            char *v = NULL;
            H5Tset_size(mt, H5T_VARIABLE);
            H5Tset_cset(mt, H5Tget_cset(at));
            H5Tclose(at);
            if (H5Aread(a, mt, &v) >= 0 && v)
                snprintf(ds_dtype, sizeof ds_dtype, "%s", v);
            if (v)
                H5free_memory(v);
            H5Tclose(mt);
            H5Aclose(a);
        }
        H5Eclear2(H5E_DEFAULT);
        if (strcmp(ds_dtype, kvf_dtype_name(h->dtype)) != 0) {
            st = kf_fail(err, KF_ERR_FORMAT, "%s: dataset '%s' has dtype attribute '%s', the file says '%s'", f->path,
                         name, ds_dtype, kvf_dtype_name(h->dtype));
            goto out;
        }
    }
    if (which <= DS_VALUES) {
        /* read_direct skips HDF5's pipeline, so only where it is exactly [fletcher32] */
        unsigned fl2 = 0;
        size_t n0 = 0;
        f->direct[which] =
            H5Pget_nfilters(p) == 1 && H5Pget_filter2(p, 0, &fl2, &n0, NULL, 0, NULL, NULL) == H5Z_FILTER_FLETCHER32;
        H5Eclear2(H5E_DEFAULT);
    }
    f->ds[which] = d;
    d = -1;
out:
    if (p >= 0)
        H5Pclose(p);
    if (s >= 0)
        H5Sclose(s);
    if (t >= 0)
        H5Tclose(t);
    if (d >= 0)
        H5Dclose(d);
    H5Tclose(want_t);
    return st;
}

static size_t chunk_bytes(const kvf_file *f) {
    return (size_t)KVF_BLOCK * (size_t)f->hdr.kv_heads * (size_t)f->hdr.head_dim * kvf_dtype_size(f->hdr.dtype);
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
    f->f = f->etype = -1;
    for (int i = 0; i < N_DS; i++)
        f->ds[i] = -1;
    hid_t fapl = kvf_h5_fapl();
    f->f = fapl < 0 ? -1 : H5Fopen(path, H5F_ACC_RDONLY, fapl);
    if (f->f < 0)
        kvf_h5_capture();
    if (fapl >= 0)
        H5Pclose(fapl);
    kf_status st = KF_OK;
    if (f->f < 0) {
        char m[300];
        bool truncated;
        kvf_h5_take_error(m, sizeof m, NULL, &truncated);
        if (truncated)
            st = kf_fail(err, KF_ERR_FORMAT, "%s: truncated file, %lld bytes (HDF5: %s)", path, (long long)sb.st_size, m);
        else
            st = kf_fail(err, KF_ERR_FORMAT, "%s: not an HDF5 file, or damaged (%lld bytes; HDF5: %s)", path,
                         (long long)sb.st_size, m);
        goto fail;
    }
    if ((st = read_header(f, err)) != KF_OK)
        goto fail;
    if ((f->etype = kvf_h5_type(f->hdr.dtype)) < 0) {
        st = kf_fail(err, KF_ERR_NOMEM, "%s: cannot make the element type", path);
        goto fail;
    }
    for (int i = 0; i < N_DS; i++)
        if ((st = open_dataset(f, i, err)) != KF_OK)
            goto fail;
    const size_t layer_bytes = (size_t)f->hdr.n_tokens * (size_t)f->hdr.kv_heads * (size_t)f->hdr.head_dim *
                               kvf_dtype_size(f->hdr.dtype);
    if (!(f->scratch = malloc(layer_bytes)) || !(f->chunkbuf = malloc(chunk_bytes(f) + 4))) {
        st = kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a layer (%zu bytes)", path, layer_bytes);
        goto fail;
    }
    *out = f;
    return KF_OK;
fail:
    H5Eclear2(H5E_DEFAULT);
    kvf_close(f);
    return st;
}

bool kvf_exists_valid(const char *path, const char *model_fp) {
    kvf_file *f;
    if (kvf_open(path, &f, NULL) != KF_OK)
        return false;
    bool ok = !model_fp || strcmp(f->hdr.model_fingerprint, model_fp) == 0;
    kvf_close(f);
    return ok;
}

kf_status kvf_check_model(const kvf_file *f, const char *model_fp, int n_layers, int kv_heads, int head_dim,
                          kf_error *err) {
    const kvf_header *h = &f->hdr;
    if (model_fp && strcmp(h->model_fingerprint, model_fp) != 0)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: written for model %s, not for this model %s", f->path,
                       h->model_fingerprint, model_fp);
    if ((n_layers >= 0 && n_layers != h->n_layers) || (kv_heads >= 0 && kv_heads != h->kv_heads) ||
        (head_dim >= 0 && head_dim != h->head_dim))
        return kf_fail(err, KF_ERR_MISMATCH,
                       "%s: holds %d layers x %d kv heads x head_dim %d, the model has %d x %d x %d", f->path,
                       h->n_layers, h->kv_heads, h->head_dim, n_layers, kv_heads, head_dim);
    return KF_OK;
}

/* ---- data ---- */

/* Reads slots [t0, t0 + nt) of one layer of keys/values into buf (raw dtype). */
static herr_t read_slab(kvf_file *f, int which, int layer, int64_t t0, int64_t nt, void *buf) {
    const kvf_header *h = &f->hdr;
    hsize_t start[4] = {(hsize_t)layer, (hsize_t)t0, 0, 0};
    hsize_t count[4] = {1, (hsize_t)nt, (hsize_t)h->kv_heads, (hsize_t)h->head_dim};
    hid_t fs = H5Dget_space(f->ds[which]), ms = H5Screate_simple(3, count + 1, NULL);
    herr_t rc = -1;
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        rc = H5Dread(f->ds[which], f->etype, ms, fs, H5P_DEFAULT, buf);
    if (rc < 0)
        kvf_h5_capture();
    if (ms >= 0)
        H5Sclose(ms);
    if (fs >= 0)
        H5Sclose(fs);
    return rc;
}

/* Reads blocks [b0, b1) of one layer into out (raw dtype, slot b0 * 16 first) past HDF5's filter
 * pipeline, whose per-chunk cost is several times the read itself: H5Dread_chunk gives the stored
 * bytes (data, then the 4-byte sum) and the Fletcher32 check is done here. A chunk lands straight
 * in out, its sum spilling into the next chunk's place (checked before that chunk is read); the
 * last one, whose sum would fall past out, goes through chunkbuf. Returns false whenever anything
 * is not as expected (a filter skipped, an odd size, a bad sum): the caller then reads through
 * H5Dread, which reports what is wrong in its usual words. Only out and chunkbuf are touched. */
static bool read_direct(kvf_file *f, int which, int layer, int64_t b0, int64_t b1, void *out) {
    if (!f->direct[which])
        return false;
    const size_t cb = chunk_bytes(f), row = cb / KVF_BLOCK;
    const hid_t d = f->ds[which];
    for (int64_t b = b0; b < b1; b++) {
        hsize_t coord[4] = {(hsize_t)layer, (hsize_t)(b * KVF_BLOCK), 0, 0}, size = 0;
        uint32_t mask = 1;
        int64_t nt = f->hdr.n_tokens - b * KVF_BLOCK, next_nt = nt - KVF_BLOCK;
        nt = nt < KVF_BLOCK ? nt : KVF_BLOCK;
        /* aside when the sum has no room in out: the last chunk, or one before a tiny last block */
        const bool aside = b == b1 - 1 || (size_t)(next_nt < KVF_BLOCK ? next_nt : KVF_BLOCK) * row < 4;
        unsigned char *dst = aside ? f->chunkbuf : (unsigned char *)out + (size_t)(b - b0) * cb;
        /* the size first: H5Dread_chunk writes the whole stored chunk */
        if (H5Dget_chunk_storage_size(d, coord, &size) < 0 || size != cb + 4 ||
            H5Dread_chunk(d, H5P_DEFAULT, coord, &mask, dst) < 0 || mask != 0) {
            H5Eclear2(H5E_DEFAULT);
            return false;
        }
        const unsigned char *t = dst + cb;
        if (kvf_fletcher32(dst, cb) !=
            ((uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24))
            return false;
        if (aside)
            memcpy((unsigned char *)out + (size_t)(b - b0) * cb, f->chunkbuf, (size_t)nt * row);
    }
    return true;
}

static kf_status block_error(kvf_file *f, int which, int layer, int64_t b, const char *m, bool checksum,
                             kf_error *err) {
    int64_t t0 = b * KVF_BLOCK, t1 = t0 + KVF_BLOCK;
    if (t1 > f->hdr.n_tokens)
        t1 = f->hdr.n_tokens;
    if (checksum)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: checksum mismatch in %s, layer %d block %lld (slots %lld..%lld): the file is damaged",
                       f->path, kDsNames[which], layer, (long long)b, (long long)t0, (long long)(t1 - 1));
    return kf_fail(err, KF_ERR_IO, "%s: cannot read %s, layer %d block %lld: %s", f->path, kDsNames[which], layer,
                   (long long)b, m);
}

static kf_status check_args(kvf_file *f, int layer, kvf_which which, const void *out, kf_error *err) {
    if (!f || !out || layer < 0 || layer >= f->hdr.n_layers || (which != KVF_KEYS && which != KVF_VALUES))
        return kf_fail(err, KF_ERR_INVALID, "%s: bad read of layer %d (the file has %d)", f ? f->path : "kvf", layer,
                       f ? f->hdr.n_layers : 0);
    return KF_OK;
}

kf_status kvf_read_layer_raw(kvf_file *f, int layer, kvf_which which, void *out, kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    const int ds = which == KVF_KEYS ? DS_KEYS : DS_VALUES;
    if (read_direct(f, ds, layer, 0, kvf_n_blocks(f), out) || read_slab(f, ds, layer, 0, f->hdr.n_tokens, out) >= 0)
        return KF_OK;
    char m[300];
    bool checksum;
    kvf_h5_take_error(m, sizeof m, &checksum, NULL);
    /* find the damaged block for the message */
    for (int64_t b = 0; b < kvf_n_blocks(f); b++) {
        int64_t nt = f->hdr.n_tokens - b * KVF_BLOCK;
        if (read_slab(f, ds, layer, b * KVF_BLOCK, nt < KVF_BLOCK ? nt : KVF_BLOCK, f->scratch) < 0) {
            kvf_h5_take_error(m, sizeof m, &checksum, NULL);
            return block_error(f, ds, layer, b, m, checksum, err);
        }
    }
    return kf_fail(err, KF_ERR_IO, "%s: cannot read %s of layer %d: %s", f->path, kDsNames[ds], layer, m);
}

kf_status kvf_read_layer(kvf_file *f, int layer, kvf_which which, float *out, kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    const kvf_header *h = &f->hdr;
    if (h->dtype == KVF_F32)
        return kvf_read_layer_raw(f, layer, which, out, err);
    KF_TRY(kvf_read_layer_raw(f, layer, which, f->scratch, err));
    kvf_convert_from(h->dtype, f->scratch, out, (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim);
    return KF_OK;
}

kf_status kvf_read_block_raw(kvf_file *f, int layer, int64_t block, kvf_which which, void *out, int *n_tokens,
                             kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    if (block < 0 || block >= kvf_n_blocks(f))
        return kf_fail(err, KF_ERR_INVALID, "%s: block %lld out of range (the file has %lld)", f->path,
                       (long long)block, (long long)kvf_n_blocks(f));
    const int ds = which == KVF_KEYS ? DS_KEYS : DS_VALUES;
    int64_t nt = f->hdr.n_tokens - block * KVF_BLOCK;
    if (nt > KVF_BLOCK)
        nt = KVF_BLOCK;
    if (!read_direct(f, ds, layer, block, block + 1, out) && read_slab(f, ds, layer, block * KVF_BLOCK, nt, out) < 0) {
        char m[300];
        bool checksum;
        kvf_h5_take_error(m, sizeof m, &checksum, NULL);
        return block_error(f, ds, layer, block, m, checksum, err);
    }
    if (n_tokens)
        *n_tokens = (int)nt;
    return KF_OK;
}

kf_status kvf_read_block(kvf_file *f, int layer, int64_t block, kvf_which which, float *out, int *n_tokens,
                         kf_error *err) {
    KF_TRY(check_args(f, layer, which, out, err));
    int nt;
    KF_TRY(kvf_read_block_raw(f, layer, block, which, f->hdr.dtype == KVF_F32 ? (void *)out : f->scratch, &nt, err));
    if (f->hdr.dtype != KVF_F32)
        kvf_convert_from(f->hdr.dtype, f->scratch, out, (size_t)nt * (size_t)f->hdr.kv_heads * (size_t)f->hdr.head_dim);
    if (n_tokens)
        *n_tokens = nt;
    return KF_OK;
}

/* beta, u, positions: one layer [kv_heads, n] or all [n_layers, kv_heads, n] */
static kf_status read_side(kvf_file *f, int which, int layer, hid_t mtype, void *out, kf_error *err) {
    if (!f || !out || layer < KVF_ALL_LAYERS || layer >= f->hdr.n_layers)
        return kf_fail(err, KF_ERR_INVALID, "%s: bad read of %s, layer %d", f ? f->path : "kvf", kDsNames[which],
                       layer);
    hid_t d = f->ds[which];
    herr_t rc;
    if (layer == KVF_ALL_LAYERS) {
        rc = H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out);
    } else {
        hsize_t dims[3];
        hid_t fs = H5Dget_space(d);
        H5Sget_simple_extent_dims(fs, dims, NULL);
        hsize_t start[3] = {(hsize_t)layer, 0, 0}, count[3] = {1, dims[1], dims[2]};
        hid_t ms = H5Screate_simple(2, count + 1, NULL);
        rc = -1;
        if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
            rc = H5Dread(d, mtype, ms, fs, H5P_DEFAULT, out);
        if (rc < 0)
            kvf_h5_capture();
        if (ms >= 0)
            H5Sclose(ms);
        if (fs >= 0)
            H5Sclose(fs);
    }
    if (rc >= 0)
        return KF_OK;
    char m[300];
    bool checksum;
    kvf_h5_take_error(m, sizeof m, &checksum, NULL);
    if (checksum)
        return kf_fail(err, KF_ERR_FORMAT, "%s: checksum mismatch in %s%s: the file is damaged", f->path,
                       kDsNames[which], layer == KVF_ALL_LAYERS ? "" : ", one layer");
    return kf_fail(err, KF_ERR_IO, "%s: cannot read %s: %s", f->path, kDsNames[which], m);
}

kf_status kvf_read_beta(kvf_file *f, int layer, float *out, kf_error *err) {
    return read_side(f, DS_BETA, layer, H5T_NATIVE_FLOAT, out, err);
}
kf_status kvf_read_u(kvf_file *f, int layer, float *out, kf_error *err) {
    return read_side(f, DS_U, layer, H5T_NATIVE_FLOAT, out, err);
}
kf_status kvf_read_positions(kvf_file *f, int layer, int32_t *out, kf_error *err) {
    return read_side(f, DS_POS, layer, H5T_NATIVE_INT32, out, err);
}

kf_status kvf_verify(kvf_file *f, kf_error *err) {
    const kvf_header *h = &f->hdr;
    for (int l = 0; l < h->n_layers; l++)
        for (int w = 0; w < 2; w++)
            KF_TRY(kvf_read_layer_raw(f, l, w ? KVF_VALUES : KVF_KEYS, f->scratch, err));
    size_t n = (size_t)h->n_layers * (size_t)h->kv_heads *
               (size_t)(h->n_tokens > h->head_dim ? h->n_tokens : h->head_dim);
    void *buf = malloc(n * 4);
    if (!buf)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", f->path);
    kf_status st = kvf_read_beta(f, KVF_ALL_LAYERS, buf, err);
    if (st == KF_OK)
        st = kvf_read_u(f, KVF_ALL_LAYERS, buf, err);
    if (st == KF_OK)
        st = kvf_read_positions(f, KVF_ALL_LAYERS, buf, err);
    free(buf);
    return st;
}
