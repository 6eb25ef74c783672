/* weights.c — how a checkpoint's weights are stored in a backend (kf_weights, model.h), and the
 * checkpoint checks that come before loading them. */
#include "compactor/weights.h"
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

/* A checkpoint with more layers than config.json's num_hidden_layers is refused: running only the
 * first ones would silently compute another model. */
kf_status kf_checkpoint_check_layers(const kf_st_set *st, int n_layers, const char *dir, kf_error *err) {
    for (size_t i = 0; i < st->n_tensors; i++) {
        const char *name = st->tensors[i].name;
        int layer = -1, used = 0;
        if (sscanf(name, "model.layers.%d.%n", &layer, &used) == 1 && used > 0 && layer >= n_layers)
            return kf_fail(err, KF_ERR_MISMATCH,
                           "%s: the checkpoint holds layer %d (tensor '%s') but config.json's num_hidden_layers "
                           "is %d: refused (the extra layers would be ignored)",
                           dir, layer, name, n_layers);
    }
    return KF_OK;
}

int kf_weights_parse(const char *s, kf_weights *out) {
    if (strcmp(s, "auto") == 0)
        *out = KF_WEIGHTS_AUTO;
    else if (strcmp(s, "fp32") == 0 || strcmp(s, "f32") == 0)
        *out = KF_WEIGHTS_F32;
    else if (strcmp(s, "bf16") == 0)
        *out = KF_WEIGHTS_BF16;
    else
        return -1;
    return 0;
}

const char *kf_weights_name(kf_weights w) {
    return w == KF_WEIGHTS_F32 ? "fp32" : (w == KF_WEIGHTS_BF16 ? "bf16" : "auto");
}

/* AUTO's test: every tensor of the checkpoint is BF16. */
static int all_bf16(const kf_st_set *st) {
    for (size_t i = 0; i < st->n_tensors; i++)
        if (st->tensors[i].dtype != KF_DTYPE_BF16)
            return 0;
    return st->n_tensors > 0;
}

kf_dtype kf_weights_dtype(const kf_st_set *st, kf_weights w) {
    if (w == KF_WEIGHTS_AUTO)
        return all_bf16(st) ? KF_DTYPE_BF16 : KF_DTYPE_F32;
    return w == KF_WEIGHTS_BF16 ? KF_DTYPE_BF16 : KF_DTYPE_F32;
}

kf_status kf_weights_resolve(const char *dir, const kf_hfconfig *c, kf_weights w, kf_dtype *out, kf_error *err) {
    kf_st_set st;
    const kf_status rc = kf_st_open_dir(&st, dir, err);
    if (rc == KF_ERR_NOTFOUND) { /* a config alone */
        const int bf16 = w == KF_WEIGHTS_BF16 || (w == KF_WEIGHTS_AUTO && strcmp(c->dtype, "bfloat16") == 0);
        *out = bf16 ? KF_DTYPE_BF16 : KF_DTYPE_F32;
        return KF_OK;
    }
    KF_TRY(rc);
    *out = kf_weights_dtype(&st, w);
    kf_st_close(&st);
    return KF_OK;
}

kf_status kf_weights_apply(kf_backend *b, const kf_st_set *st, const char *dir, kf_weights w, kf_error *err) {
    const kf_dtype want = kf_weights_dtype(st, w);
    if (want == b->weight_dtype)
        return KF_OK;
    if (b->set_weight_dtype && b->set_weight_dtype(b, want) == 0)
        return KF_OK;
    if (w == KF_WEIGHTS_AUTO) /* a fixed dtype: the backend's own */
        return KF_OK;
    return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: the %s backend cannot store weights in %s", dir, b->name,
                   kf_weights_name(w));
}

void kf_weights_digest(const kf_hfconfig *c, kf_st_set *set, char out[33]) {
    XXH3_state_t *st = XXH3_createState();
    if (!st)
        return;
    XXH3_128bits_reset(st);
    /* the parsed config, as the numbers that shape the computation */
    char cfgtxt[512];
    int n = snprintf(cfgtxt, sizeof cfgtxt, "%s v%d h%d i%d l%d qh%d kvh%d hd%d eps%.9g tie%d rope%d/%.9g/%.9g/%.9g/%.9g/%.9g",
                     c->model_type, c->vocab_size, c->hidden_size, c->intermediate_size, c->n_layers, c->n_heads,
                     c->n_kv_heads, c->head_dim, c->rms_eps, c->tie_word_embeddings, (int)c->rope.type, c->rope.theta,
                     c->rope.factor, c->rope.low_freq_factor, c->rope.high_freq_factor, c->rope.original_max_position);
    XXH3_128bits_update(st, cfgtxt, (size_t)n);
    /* the tensor index (sorted by name) and every weight byte */
    for (size_t i = 0; i < set->n_tensors; i++) {
        const kf_st_tensor *t = &set->tensors[i];
        XXH3_128bits_update(st, t->name, strlen(t->name) + 1);
        XXH3_128bits_update(st, kf_st_dtype_name(t->dtype), strlen(kf_st_dtype_name(t->dtype)) + 1);
        XXH3_128bits_update(st, t->shape, sizeof(int64_t) * (size_t)t->ndim);
        XXH3_128bits_update(st, t->data, t->nbytes);
        kf_st_release_pages(set, t);
    }
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
}
