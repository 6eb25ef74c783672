/* weights.h — the storage of a checkpoint's weights in a backend (kf_weights: its choices are
 * described in model.h, where kf_model_opts takes one) and the checkpoint's own checks. */
#ifndef KF_WEIGHTS_H
#define KF_WEIGHTS_H

#include "formats/hfconfig.h"
#include "formats/safetensors.h"
#include "kernels/backend.h"

typedef enum { KF_WEIGHTS_AUTO = 0, KF_WEIGHTS_F32 = 1, KF_WEIGHTS_BF16 = 2 } kf_weights;

/* "auto", "fp32" (or "f32"), "bf16": 0, or -1 for anything else. */
int kf_weights_parse(const char *s, kf_weights *out);
const char *kf_weights_name(kf_weights w);
/* The storage dtype `w` gives the checkpoint in dir on a backend that can store both fp32 and bf16
 * (the CPU's), reading only the safetensors headers (for predictions: nothing is loaded); with no
 * checkpoint in dir (a config alone), c's dtype stands for every tensor's ("bfloat16": BF16). */
kf_status kf_weights_resolve(const char *dir, const kf_hfconfig *c, kf_weights w, kf_dtype *out, kf_error *err);
/* The dtype `w` stores the checkpoint st in (AUTO: bf16 when every tensor is BF16, else fp32). */
kf_dtype kf_weights_dtype(const kf_st_set *st, kf_weights w);
/* The backend's weight dtype set as `w` asks for st, before any weight is uploaded; a backend whose
 * dtype is fixed keeps it under AUTO, and F32 or BF16 it cannot store is KF_ERR_UNSUPPORTED. */
kf_status kf_weights_apply(kf_backend *b, const kf_st_set *st, const char *dir, kf_weights w, kf_error *err);
/* A checkpoint with more layers than config.json's num_hidden_layers is KF_ERR_MISMATCH. */
kf_status kf_checkpoint_check_layers(const kf_st_set *st, int n_layers, const char *dir, kf_error *err);
/* The model fingerprint's digest (model.h: kf_model_fingerprint caches it): the parsed config's
 * numbers, then every tensor's name, dtype, shape and bytes in name order; out gets 32 hex digits
 * (left untouched when out of memory). */
void kf_weights_digest(const kf_hfconfig *c, kf_st_set *st, char out[33]);

#endif
