/* cache_io.h — a compacted cache (kf_compacted) to and from the kvf file (formats/kvf.h). */
#ifndef KF_CACHE_IO_H
#define KF_CACHE_IO_H

#include "compactor/compact.h"
#include "formats/kvf.h"

/* A kvf_cache pointing into c's buffers (fp32; kvf_write converts to out->hdr.dtype): shape, D, C,
 * method, budget, lambda (fold only), rope frame, per-head methods. The caller fills the identity
 * (model fingerprint, tokenizer digest, document digest, recipe digest) and may change the dtype
 * (default bf16). */
void kf_compacted_to_kvf(const kf_compacted *c, kvf_cache *out);

/* Reads a whole file into out (keys and values converted to fp32, every layer checked against its
 * digest), so kf_compacted_attach can put it in an arena. out->head_method is always filled.
 * Files keep no prefix/suffix split: n_prefix = n_suffix = 0, t = C. */
kf_status kf_compacted_load(kvf_file *f, kf_compacted *out, kf_error *err);

#endif
