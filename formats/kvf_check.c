/* kvf_check.c — whether an open kvf file is the one a caller wants: its identity (document,
 * recipe, method, budget, dtype, model), its model's shape, its positions. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "formats/kvf_internal.h"

bool kvf_exists_valid(const char *path, const char *model_fp, const char *recipe_digest) {
    const kvf_identity want = {model_fp, NULL, recipe_digest, -1, 0, -1, -1};
    return kvf_check_existing(path, &want, NULL) == KF_OK;
}

/* One string field of the identity: KF_ERR_MISMATCH naming it when it differs. */
static kf_status same_str(const kvf_file *f, const char *field, const char *have, const char *want, kf_error *err) {
    if (want && strcmp(have, want) != 0)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: holds %s %s, not %s", f->path, field, have, want);
    return KF_OK;
}

kf_status kvf_check_identity(const kvf_file *f, const kvf_identity *want, kf_error *err) {
    const kvf_header *h = &f->hdr;
    KF_TRY(same_str(f, "document", h->document_digest, want->document_digest, err));
    if (want->n_doc_tokens >= 0 && h->n_doc_tokens != want->n_doc_tokens)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: holds a document of %lld tokens, not %lld", f->path,
                       (long long)h->n_doc_tokens, (long long)want->n_doc_tokens);
    if (want->method >= 0 && (int)h->method != want->method)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: holds method %s, not %s", f->path, kf_method_name(h->method),
                       kf_method_name((kf_method)want->method));
    if (want->budget != 0 && h->budget != want->budget)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: holds budget %.17g, not %.17g", f->path, h->budget, want->budget);
    if (want->dtype >= 0 && (int)h->dtype != want->dtype)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: holds %s, not %s", f->path, kf_dtype_name(h->dtype),
                       kf_dtype_name((kf_dtype)want->dtype));
    KF_TRY(same_str(f, "recipe", h->recipe_digest, want->recipe_digest, err));
    return same_str(f, "model", h->model_fingerprint, want->model_fingerprint, err);
}

kf_status kvf_check_existing(const char *path, const kvf_identity *want, kf_error *err) {
    struct stat sb;
    if (lstat(path, &sb) != 0 && errno == ENOENT)
        return kf_fail(err, KF_ERR_NOTFOUND, "%s: no file", path);
    kvf_file *f;
    KF_TRY(kvf_open(path, &f, err));
    kf_status st = kvf_check_identity(f, want, err);
    if (st == KF_OK)
        st = kvf_check_name(path, &f->hdr, err);
    if (st == KF_OK)
        st = kvf_verify(f, err);
    kvf_close(f);
    return st;
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

kf_status kvf_check_positions(const kvf_file *f, int64_t max_positions, kf_error *err) {
    if (max_positions > 0 && f->hdr.n_doc_tokens > max_positions)
        return kf_fail(err, KF_ERR_MISMATCH,
                       "%s: a document of D = %lld tokens (C = %lld) is longer than the model's "
                       "%lld positions",
                       f->path, (long long)f->hdr.n_doc_tokens, (long long)f->hdr.n_tokens, (long long)max_positions);
    return KF_OK;
}

/* ---- data ---- */

/* Heads [h0, h1) of one layer head-major, head h's chunk at k + (h - hoff) * chunk bytes (and v);
 * the layer's side data into f->beta, u, pos, hm; each head checked against its head digest. A
 * chunk's sum spills into the next head's place; the last head's goes through f->chunkbuf, so
 * nothing past head h1 - 1 is written. */
