/* kvf_read_header.c — a kvf file's header attributes read and checked one by one (kvf.h has the
 * format): each present, of its type and within its bounds, or an error naming the file and the
 * attribute. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/kvf_internal.h"

static kf_status open_attr(kvf_file *f, const char *name, hid_t want, size_t max_len, hid_t *a, size_t *len,
                           kf_error *err) {
    if (H5Aexists(f->f, name) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: missing attribute '%s'", f->path, name);
    }
    *a = H5Aopen(f->f, name, H5P_DEFAULT);
    hid_t t = *a >= 0 ? H5Aget_type(*a) : -1, s = *a >= 0 ? H5Aget_space(*a) : -1;
    bool ok = t >= 0 && s >= 0 && H5Sget_simple_extent_type(s) == H5S_SCALAR;
    const char *what = want < 0 ? "fixed-length UTF-8 string" : "scalar of the documented type";
    if (ok && want < 0) {
        ok = H5Tget_class(t) == H5T_STRING && H5Tis_variable_str(t) == 0 && H5Tget_cset(t) == H5T_CSET_UTF8 &&
             H5Tget_strpad(t) == H5T_STR_NULLTERM;
        *len = ok ? H5Tget_size(t) : 0;
        ok = ok && *len >= 1 && *len <= max_len + 1;
    } else if (ok) {
        ok = H5Tequal(t, want) > 0;
    }
    if (t >= 0)
        H5Tclose(t);
    if (s >= 0)
        H5Sclose(s);
    if (!ok) {
        if (*a >= 0)
            H5Aclose(*a);
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: attribute '%s' is not a %s%s", f->path, name, what,
                       want < 0 ? " of the allowed length" : "");
    }
    return KF_OK;
}

static kf_status attr_read_fail(kvf_file *f, const char *name, kf_error *err) {
    char m[256];
    kvf_h5_take_error(m, sizeof m, NULL, NULL);
    return kf_fail(err, KF_ERR_FORMAT, "%s: cannot read attribute '%s': %s", f->path, name, m);
}

/* A fixed-length string attribute into out[n] (n - 1 bytes at most), UTF-8 without controls. */
kf_status kvf_attr_read_str(kvf_file *f, const char *name, char *out, size_t n, kf_error *err) {
    hid_t a = -1;
    size_t len = 0;
    KF_TRY(open_attr(f, name, -1, n - 1, &a, &len, err));
    char *buf = malloc(len); /* len <= n */
    hid_t mt = buf ? H5Tcopy(H5T_C_S1) : -1;
    herr_t rc = -1;
    if (mt >= 0 && H5Tset_size(mt, len) >= 0 && H5Tset_strpad(mt, H5T_STR_NULLTERM) >= 0 &&
        H5Tset_cset(mt, H5T_CSET_UTF8) >= 0)
        rc = H5Aread(a, mt, buf);
    if (rc < 0)
        kvf_h5_capture();
    if (mt >= 0)
        H5Tclose(mt);
    H5Aclose(a);
    if (!buf)
        return kf_fail(err, KF_ERR_NOMEM, "%s: attribute '%s': out of memory", f->path, name);
    if (rc < 0) {
        free(buf);
        return attr_read_fail(f, name, err);
    }
    buf[len - 1] = 0;
    const bool clean = kvf_is_clean_utf8(buf);
    if (clean)
        memcpy(out, buf, len);
    free(buf);
    return clean ? KF_OK : kf_fail(err, KF_ERR_FORMAT, "%s: attribute '%s' is not printable UTF-8", f->path, name);
}

/* An optional string attribute: "" when the file has none. */
static kf_status read_opt_str(kvf_file *f, const char *name, char *out, size_t n, kf_error *err) {
    out[0] = 0;
    const htri_t there = H5Aexists(f->f, name);
    if (there < 0)
        H5Eclear2(H5E_DEFAULT);
    return there > 0 ? kvf_attr_read_str(f, name, out, n, err) : KF_OK;
}

static kf_status read_num(kvf_file *f, const char *name, bool real, void *out, kf_error *err) {
    hid_t a = -1;
    KF_TRY(open_attr(f, name, real ? H5T_IEEE_F64LE : H5T_STD_I64LE, 0, &a, NULL, err));
    herr_t rc = H5Aread(a, real ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64, out);
    if (rc < 0)
        kvf_h5_capture();
    H5Aclose(a);
    return rc < 0 ? attr_read_fail(f, name, err) : KF_OK;
}

static kf_status read_int(kvf_file *f, const char *name, int64_t lo, int64_t hi, int64_t *out, kf_error *err) {
    KF_TRY(read_num(f, name, false, out, err));
    if (*out < lo || *out > hi)
        return kf_fail(err, KF_ERR_FORMAT, "%s: attribute '%s' = %lld is out of range [%lld, %lld]", f->path, name,
                       (long long)*out, (long long)lo, (long long)hi);
    return KF_OK;
}

/* The version before anything else: a version-1 file has variable-length strings, which are not
 * read at all. */
kf_status kvf_read_version(kvf_file *f, kf_error *err) {
    if (H5Aexists(f->f, "version") <= 0 || H5Aexists(f->f, "format") <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return kf_fail(err, KF_ERR_FORMAT, "%s: not a kvfold cache file (an HDF5 file without 'format' and 'version')",
                       f->path);
    }
    int64_t v;
    KF_TRY(read_num(f, "version", false, &v, err));
    if (v == 1)
        return kf_fail(err, KF_ERR_UNSUPPORTED,
                       "%s: kvf version 1 is no longer read (it lacks metadata checksums, the payload digest and the "
                       "recipe identity): recompact the document with this kvfold (%s, version %d)",
                       f->path, KVFOLD_VERSION, KVF_VERSION);
    if (v != KVF_VERSION)
        return kf_fail(err, KF_ERR_UNSUPPORTED,
                       "%s: kvf version %lld is not supported (this kvfold %s reads version %d); rebuild the cache "
                       "or use a matching kvfold",
                       f->path, (long long)v, KVFOLD_VERSION, KVF_VERSION);
    f->hdr.version = (int)v;
    return KF_OK;
}

kf_status kvf_read_format(kvf_file *f, kf_error *err) {
    char s[32];
    KF_TRY(kvf_attr_read_str(f, "format", s, sizeof s, err));
    if (strcmp(s, KVF_FORMAT_NAME) != 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: not a kvfold cache file (format '%s', expected '%s')", f->path, s,
                       KVF_FORMAT_NAME);
    return KF_OK;
}

static kf_status read_enum(kvf_file *f, const char *name, const char *const *names, int n, int *out, kf_error *err) {
    char s[32];
    KF_TRY(kvf_attr_read_str(f, name, s, sizeof s, err));
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = i;
            return KF_OK;
        }
    return kf_fail(err, KF_ERR_FORMAT, "%s: unknown %s '%s'", f->path, name, s);
}

kf_status kvf_read_header(kvf_file *f, kf_error *err) {
    kvf_header *h = &f->hdr;
    static const char *const frames[] = {"compacted", "original"};
    int64_t v;
    int e;
    KF_TRY(kvf_attr_read_str(f, "creator", h->creator, sizeof h->creator, err));
    KF_TRY(kvf_attr_read_str(f, "model_fingerprint", h->model_fingerprint, sizeof h->model_fingerprint, err));
    KF_TRY(kvf_attr_read_str(f, "tokenizer_digest", h->tokenizer_digest, sizeof h->tokenizer_digest, err));
    KF_TRY(kvf_attr_read_str(f, "document_digest", h->document_digest, sizeof h->document_digest, err));
    KF_TRY(kvf_attr_read_str(f, "recipe_digest", h->recipe_digest, sizeof h->recipe_digest, err));
    KF_TRY(kvf_attr_read_str(f, "payload_digest", h->payload_digest, sizeof h->payload_digest, err));
    if (!kvf_is_hex(h->payload_digest, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_FORMAT, "%s: payload_digest '%s' is not %d lowercase hex digits", f->path,
                       h->payload_digest, KVF_DIGEST_LEN);
    KF_TRY(read_int(f, "n_doc_tokens", 1, INT32_MAX, &h->n_doc_tokens, err));
    KF_TRY(read_int(f, "n_tokens", 1, h->n_doc_tokens, &h->n_tokens, err));
    KF_TRY(read_enum(f, "method", kvf_method_attrs, KVF_N_METHODS, &e, err));
    h->method = (kf_method)e;
    KF_TRY(read_num(f, "budget", true, &h->budget, err));
    KF_TRY(read_num(f, "lambda", true, &h->lambda, err));
    KF_TRY(read_enum(f, "rope_frame", frames, 2, &e, err));
    h->rope_frame = (kvf_rope_frame)e;
    KF_TRY(kvf_attr_read_str(f, "placeholder", h->placeholder, sizeof h->placeholder, err));
    KF_TRY(read_enum(f, "dtype", kvf_dtype_attrs, KVF_N_DTYPES, &e, err));
    h->dtype = kvf_dtype_of_attr[e];
    KF_TRY(read_int(f, "n_layers", 1, 4096, &v, err));
    h->n_layers = (int)v;
    KF_TRY(read_int(f, "kv_heads", 1, 4096, &v, err));
    h->kv_heads = (int)v;
    KF_TRY(read_int(f, "head_dim", 1, 65536, &v, err));
    h->head_dim = (int)v;
    KF_TRY(read_int(f, "block_size", 1, 1 << 20, &v, err));
    h->block_size = (int)v;
    KF_TRY(read_opt_str(f, "chat_template_digest", h->chat_template_digest, sizeof h->chat_template_digest, err));
    KF_TRY(read_opt_str(f, "chat_prefix_ids", h->chat_prefix_ids, sizeof h->chat_prefix_ids, err));
    KF_TRY(read_opt_str(f, "chat_question_prefix_ids", h->chat_question_prefix_ids,
                        sizeof h->chat_question_prefix_ids, err));
    KF_TRY(read_opt_str(f, "chat_question_suffix_ids", h->chat_question_suffix_ids,
                        sizeof h->chat_question_suffix_ids, err));
    return kvf_header_check(h, f->path, err);
}
