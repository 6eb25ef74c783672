/* kvf_write.c — writing a kvf cache file atomically: temporary name, fsync, rename, fsync of the
 * directory (see kvf.h for the format). */
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

static herr_t attr_str(hid_t loc, const char *name, const char *val) {
    hid_t t = H5Tcopy(H5T_C_S1), s = H5Screate(H5S_SCALAR), a = -1;
    herr_t rc = -1;
    if (t >= 0 && s >= 0 && H5Tset_size(t, H5T_VARIABLE) >= 0 && H5Tset_cset(t, H5T_CSET_UTF8) >= 0 &&
        (a = H5Acreate2(loc, name, t, s, H5P_DEFAULT, H5P_DEFAULT)) >= 0)
        rc = H5Awrite(a, t, &val);
    if (rc < 0)
        kvf_h5_capture();
    if (a >= 0)
        H5Aclose(a);
    if (s >= 0)
        H5Sclose(s);
    if (t >= 0)
        H5Tclose(t);
    return rc;
}

static herr_t attr_num(hid_t loc, const char *name, hid_t ftype, hid_t mtype, const void *val) {
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

static herr_t attr_i64(hid_t loc, const char *name, int64_t v) {
    return attr_num(loc, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

static herr_t attr_f64(hid_t loc, const char *name, double v) {
    return attr_num(loc, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}

static herr_t write_attrs(hid_t f, const kvf_header *h) {
    herr_t rc = 0;
    rc |= attr_str(f, "format", KVF_FORMAT_NAME);
    rc |= attr_i64(f, "version", KVF_VERSION);
    rc |= attr_str(f, "creator", h->creator);
    rc |= attr_str(f, "model_fingerprint", h->model_fingerprint);
    rc |= attr_str(f, "tokenizer_digest", h->tokenizer_digest);
    rc |= attr_str(f, "document_digest", h->document_digest);
    rc |= attr_i64(f, "n_doc_tokens", h->n_doc_tokens);
    rc |= attr_i64(f, "n_tokens", h->n_tokens);
    rc |= attr_str(f, "method", kvf_method_name(h->method));
    rc |= attr_f64(f, "budget", h->budget);
    rc |= attr_f64(f, "lambda", h->lambda);
    rc |= attr_str(f, "rope_frame", kvf_rope_frame_name(h->rope_frame));
    rc |= attr_str(f, "placeholder", h->placeholder);
    rc |= attr_str(f, "dtype", kvf_dtype_name(h->dtype));
    rc |= attr_i64(f, "n_layers", h->n_layers);
    rc |= attr_i64(f, "kv_heads", h->kv_heads);
    rc |= attr_i64(f, "head_dim", h->head_dim);
    rc |= attr_i64(f, "block_size", h->block_size);
    return rc < 0 ? -1 : 0;
}

/* A chunked dataset with Fletcher32 sums; maxdims lets a 16-token chunk exceed a short C. */
static hid_t make_dataset(hid_t f, const char *name, hid_t ftype, int rank, const hsize_t *dims,
                          const hsize_t *maxdims, const hsize_t *chunk) {
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE), space = H5Screate_simple(rank, dims, maxdims), d = -1;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    /* whole chunks are written once: a chunk cache would only add copies */
    if (dcpl >= 0 && space >= 0 && dapl >= 0 && H5Pset_chunk(dcpl, rank, chunk) >= 0 && H5Pset_fletcher32(dcpl) >= 0 &&
        H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER) >= 0 && H5Pset_obj_track_times(dcpl, 0) >= 0 &&
        H5Pset_chunk_cache(dapl, 0, 0, 1.0) >= 0)
        d = H5Dcreate2(f, name, ftype, space, H5P_DEFAULT, dcpl, dapl);
    if (dapl >= 0)
        H5Pclose(dapl);
    if (d < 0)
        kvf_h5_capture();
    if (space >= 0)
        H5Sclose(space);
    if (dcpl >= 0)
        H5Pclose(dcpl);
    return d;
}

/* Writes buf (mtype) into the [layer, 0..] slab of a rank-4 or rank-3 dataset. */
static herr_t write_layer(hid_t d, hid_t mtype, int rank, const hsize_t *dims, int layer, const void *buf) {
    hsize_t start[4] = {(hsize_t)layer, 0, 0, 0}, count[4];
    memcpy(count, dims, sizeof(hsize_t) * (size_t)rank);
    count[0] = 1;
    hid_t fs = H5Dget_space(d), ms = H5Screate_simple(rank - 1, dims + 1, NULL);
    herr_t rc = -1;
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        rc = H5Dwrite(d, mtype, ms, fs, H5P_DEFAULT, buf);
    if (rc < 0)
        kvf_h5_capture();
    if (ms >= 0)
        H5Sclose(ms);
    if (fs >= 0)
        H5Sclose(fs);
    return rc;
}

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

typedef struct {
    const char *path;
    kf_error *err;
} wctx;

static kf_status h5fail(wctx *w, const char *what) {
    char m[300];
    kvf_h5_take_error(m, sizeof m, NULL, NULL);
    return kf_fail(w->err, KF_ERR_IO, "%s: cannot %s: %s", w->path, what, m);
}

static kf_status write_contents(hid_t f, const kvf_cache *c, wctx *w) {
    const kvf_header *h = &c->hdr;
    const int L = h->n_layers, H = h->kv_heads, D = h->head_dim; /* D: head_dim here */
    const int64_t C = h->n_tokens;
    const size_t layer_n = (size_t)C * (size_t)H * (size_t)D, esz = kvf_dtype_size(h->dtype);
    if (write_attrs(f, h) < 0)
        return h5fail(w, "write attributes");

    kf_status st = KF_OK;
    hid_t ftype = kvf_h5_type(h->dtype), s = H5Screate(H5S_SCALAR);
    hid_t kv[2] = {-1, -1};
    void *conv = NULL; /* [C, kv_heads, head_dim] in dtype */
    const hsize_t dims[4] = {(hsize_t)L, (hsize_t)C, (hsize_t)H, (hsize_t)D};
    const hsize_t maxd[4] = {(hsize_t)L, (hsize_t)((C + KVF_BLOCK - 1) / KVF_BLOCK * KVF_BLOCK), (hsize_t)H,
                             (hsize_t)D};
    const hsize_t chunk[4] = {1, KVF_BLOCK, (hsize_t)H, (hsize_t)D};
    static const char *const names[2] = {"keys", "values"};
    const float *src[2] = {c->keys, c->values};
    const void *raw[2] = {c->keys_raw, c->values_raw};
    if (ftype < 0 || s < 0) {
        st = h5fail(w, "make the element type");
        goto out;
    }
    for (int i = 0; i < 2 && st == KF_OK; i++) {
        kv[i] = make_dataset(f, names[i], ftype, 4, dims, maxd, chunk);
        if (kv[i] < 0 || attr_str(kv[i], "dtype", kvf_dtype_name(h->dtype)) < 0) {
            st = h5fail(w, names[i][0] == 'k' ? "create dataset keys" : "create dataset values");
            goto out;
        }
        if (src[i] && h->dtype != KVF_F32 && !conv && !(conv = malloc(layer_n * esz))) {
            st = kf_fail(w->err, KF_ERR_NOMEM, "%s: out of memory for a layer (%zu values)", w->path, layer_n);
            goto out;
        }
        for (int l = 0; l < L; l++) {
            const void *buf;
            if (!src[i]) {
                buf = (const char *)raw[i] + (size_t)l * layer_n * esz;
            } else if (h->dtype == KVF_F32) {
                buf = src[i] + (size_t)l * layer_n;
            } else {
                kvf_convert_to(h->dtype, src[i] + (size_t)l * layer_n, conv, layer_n);
                buf = conv;
            }
            if (write_layer(kv[i], ftype, 4, dims, l, buf) < 0) {
                char what[64];
                snprintf(what, sizeof what, "write %s of layer %d", names[i], l);
                st = h5fail(w, what);
                goto out;
            }
        }
    }

    /* per-head side data, one layer per chunk */
    const size_t side_n = (size_t)L * (size_t)H * (size_t)(C > D ? C : D);
    float *zeros = NULL;
    int32_t *ident = NULL;
    if ((!c->beta || !c->u) && !(zeros = calloc(side_n, sizeof(float))))
        st = kf_fail(w->err, KF_ERR_NOMEM, "%s: out of memory", w->path);
    if (st == KF_OK && !c->positions) {
        if (!(ident = malloc(sizeof(int32_t) * side_n)))
            st = kf_fail(w->err, KF_ERR_NOMEM, "%s: out of memory", w->path);
        else
            for (size_t r = 0; r < (size_t)L * (size_t)H; r++)
                for (int64_t j = 0; j < C; j++)
                    ident[r * (size_t)C + (size_t)j] = (int32_t)j;
    }
    const hsize_t bdims[3] = {(hsize_t)L, (hsize_t)H, (hsize_t)C}, bchunk[3] = {1, (hsize_t)H, (hsize_t)C};
    const hsize_t udims[3] = {(hsize_t)L, (hsize_t)H, (hsize_t)D}, uchunk[3] = {1, (hsize_t)H, (hsize_t)D};
    const struct {
        const char *name;
        hid_t ftype, mtype;
        const hsize_t *dims, *chunk;
        const void *data;
    } side[3] = {
        {"beta", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, bdims, bchunk, c->beta ? (const void *)c->beta : zeros},
        {"u", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, udims, uchunk, c->u ? (const void *)c->u : zeros},
        {"positions", H5T_STD_I32LE, H5T_NATIVE_INT32, bdims, bchunk,
         c->positions ? (const void *)c->positions : ident},
    };
    for (int i = 0; i < 3 && st == KF_OK; i++) {
        hid_t d = make_dataset(f, side[i].name, side[i].ftype, 3, side[i].dims, NULL, side[i].chunk);
        if (d < 0 || H5Dwrite(d, side[i].mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, side[i].data) < 0) {
            kvf_h5_capture();
            char what[64];
            snprintf(what, sizeof what, "write dataset %s", side[i].name);
            st = h5fail(w, what);
        }
        if (d >= 0)
            H5Dclose(d);
    }
    free(zeros);
    free(ident);
out:
    free(conv);
    for (int i = 0; i < 2; i++)
        if (kv[i] >= 0)
            H5Dclose(kv[i]);
    if (s >= 0)
        H5Sclose(s);
    if (ftype >= 0)
        H5Tclose(ftype);
    return st;
}

kf_status kvf_write(const char *path, const kvf_cache *c, kf_error *err) {
    kvf_h5_quiet();
    if (!path || !*path || !c)
        return kf_fail(err, KF_ERR_INVALID, "kvf_write: no path or cache");
    if (kvf_is_temp_name(path))
        return kf_fail(err, KF_ERR_INVALID, "%s: the name of a temporary file cannot be a cache's name", path);
    if (c->hdr.version != KVF_VERSION)
        return kf_fail(err, KF_ERR_INVALID, "%s: header version %d (this kvfold writes version %d)", path,
                       c->hdr.version, KVF_VERSION);
    kf_status st = kvf_header_check(&c->hdr, path, err);
    if (st != KF_OK) {
        if (err)
            err->code = KF_ERR_INVALID;
        return KF_ERR_INVALID;
    }
    if ((!c->keys && !c->keys_raw) || (!c->values && !c->values_raw))
        return kf_fail(err, KF_ERR_INVALID, "%s: the cache has no keys or no values", path);

    /* <path>.tmp-<pid>-<16 hex>: unique per process and call, recognizable by kvf_is_temp_name */
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        rnd = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ (uint64_t)(uintptr_t)&ts;
    }
    size_t tl = strlen(path) + 64;
    char *tmp = malloc(tl), *dircopy = strdup(path);
    if (!tmp || !dircopy) {
        free(tmp);
        free(dircopy);
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    }
    snprintf(tmp, tl, "%s.tmp-%ld-%016llx", path, (long)getpid(), (unsigned long long)rnd);
    const char *dir = dirname(dircopy);

    wctx w = {.path = path, .err = err};
    hid_t fapl = kvf_h5_fapl();
    hid_t f = fapl < 0 ? -1 : H5Fcreate(tmp, H5F_ACC_EXCL, H5P_DEFAULT, fapl);
    if (f < 0)
        kvf_h5_capture();
    if (fapl >= 0)
        H5Pclose(fapl);
    if (f < 0) {
        char m[300];
        kvf_h5_take_error(m, sizeof m, NULL, NULL);
        st = kf_fail(err, KF_ERR_IO, "%s: cannot create the temporary file %s: %s", path, tmp, m);
        free(tmp); /* not ours to unlink: H5F_ACC_EXCL failed or nothing was created */
        free(dircopy);
        return st;
    }
    st = write_contents(f, c, &w);
    if (H5Fclose(f) < 0 && st == KF_OK)
        st = h5fail(&w, "close the file");
    if (st != KF_OK)
        goto fail;
    if (fsync_path(tmp, O_RDONLY) != 0) {
        st = kf_fail(err, KF_ERR_IO, "%s: cannot fsync %s: %s", path, tmp, strerror(errno));
        goto fail;
    }
    if (rename(tmp, path) != 0) {
        st = kf_fail(err, KF_ERR_IO, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
        goto fail;
    }
    /* the rename itself is durable once the directory is synced */
    if (fsync_path(dir, O_RDONLY | O_DIRECTORY) != 0) {
        st = kf_fail(err, KF_ERR_IO, "%s: cannot fsync directory %s: %s", path, dir, strerror(errno));
        free(tmp);
        free(dircopy);
        return st;
    }
    free(tmp);
    free(dircopy);
    return KF_OK;
fail:
    unlink(tmp);
    free(tmp);
    free(dircopy);
    return st;
}
