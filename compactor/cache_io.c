#include "compactor/cache_io.h"

#include <stdlib.h>
#include <string.h>

void kf_compacted_to_kvf(const kf_compacted *c, kvf_cache *out) {
    memset(out, 0, sizeof *out);
    kvf_header_init(&out->hdr);
    out->hdr.n_doc_tokens = c->D;
    out->hdr.n_tokens = c->C;
    out->hdr.method = c->method;
    out->hdr.budget = c->budget;
    out->hdr.lambda = c->method == KF_METHOD_FOLD ? c->lambda_rel : 0;
    out->hdr.rope_frame = c->rotated ? KVF_FRAME_COMPACTED : KVF_FRAME_ORIGINAL;
    out->hdr.n_layers = c->n_layers;
    out->hdr.kv_heads = c->kv_heads;
    out->hdr.head_dim = c->head_dim;
    out->keys = c->keys;
    out->values = c->values;
    out->beta = c->beta;
    out->u = c->u;
    out->positions = c->positions;
    /* a head_method byte is the head's kf_method (formats/kvf.h) */
    out->head_method = c->head_method;
}

/* Every layer through kvf_read_layer_all (checked against its digest), keys and values converted
 * to fp32 through raw [C, kv_heads, head_dim] buffers. */
static kf_status load_layers(kvf_file *f, kf_compacted *out, kf_error *err) {
    const kvf_header *h = kvf_file_header(f);
    const size_t per_layer = (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim;
    const size_t HC = (size_t)h->kv_heads * (size_t)h->n_tokens, HD = (size_t)h->kv_heads * (size_t)h->head_dim;
    void *kraw = malloc(per_layer * kf_dtype_size(h->dtype)), *vraw = malloc(per_layer * kf_dtype_size(h->dtype));
    kf_status rc = KF_OK;
    if (!kraw || !vraw)
        rc = kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a layer", kvf_file_path(f));
    for (int l = 0; l < h->n_layers && rc == KF_OK; l++) {
        rc = kvf_read_layer_all(f, l, kraw, vraw, out->beta + (size_t)l * HC, out->u + (size_t)l * HD,
                                out->positions + (size_t)l * HC, out->head_method + (size_t)l * h->kv_heads, err);
        if (rc == KF_OK) {
            kf_convert_to_f32(out->keys + (size_t)l * per_layer, kraw, h->dtype, per_layer);
            kf_convert_to_f32(out->values + (size_t)l * per_layer, vraw, h->dtype, per_layer);
        }
    }
    free(kraw);
    free(vraw);
    return rc;
}

kf_status kf_compacted_load(kvf_file *f, kf_compacted *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    const kvf_header *h = kvf_file_header(f);
    const int L = h->n_layers, H = h->kv_heads, d = h->head_dim;
    const int64_t C = h->n_tokens;
    const size_t per_layer = (size_t)C * H * d;
    out->n_layers = L;
    out->kv_heads = H;
    out->head_dim = d;
    out->D = h->n_doc_tokens;
    out->C = C;
    out->t = C;
    out->method = h->method;
    out->budget = h->budget;
    out->lambda_rel = h->lambda;
    out->rotated = h->rope_frame == KVF_FRAME_COMPACTED;
    out->keys = malloc(sizeof(float) * per_layer * L);
    out->values = malloc(sizeof(float) * per_layer * L);
    out->beta = malloc(sizeof(float) * (size_t)L * H * C);
    out->u = malloc(sizeof(float) * (size_t)L * H * d);
    out->positions = malloc(sizeof(int32_t) * (size_t)L * H * C);
    out->head_method = malloc((size_t)L * H);
    kf_status rc = KF_OK;
    if (!out->keys || !out->values || !out->beta || !out->u || !out->positions || !out->head_method)
        rc = kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a cache of %lld tokens", kvf_file_path(f), (long long)C);
    if (rc == KF_OK)
        rc = load_layers(f, out, err);
    if (rc != KF_OK)
        kf_compacted_free(out);
    return rc;
}
