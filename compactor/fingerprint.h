/* fingerprint.h — a cache of model fingerprints, so that a model's weights are hashed once.
 *
 * kf_model_fingerprint hashes every weight byte (seconds to minutes on large models); the result
 * is kept in a small text file keyed by what would change it:
 *
 *   kvfold-fingerprint 2
 *   dir <realpath of the model directory>
 *   files <number of weight files>
 *   file <name> <size> <mtime in ns> <inode> <ctime in ns>
 *   ...                                   config.json, model.safetensors.index.json when present,
 *                                         then each weight file, in the order given
 * (the inode and ctime: weights rewritten in place with size and mtime kept are hashed again)
 *   fingerprint <32 hex digits>
 *
 * Where: <dir>/.kvfold-fingerprint when the directory is writable, else
 * $XDG_CACHE_HOME/kvfold/fingerprints/<xxh3-64 of the realpath> (default ~/.cache/kvfold/...).
 * Both are looked up; an entry is used only when every key line matches, otherwise the
 * fingerprint is recomputed and stored again. Writes are atomic (temporary name + rename) and
 * best effort: failing to store only means hashing again next time.
 */
#ifndef KF_FINGERPRINT_H
#define KF_FINGERPRINT_H

#include <stdbool.h>

#include "formats/error.h"

#define KF_FINGERPRINT_FILE ".kvfold-fingerprint"

/* Computes the fingerprint into out (32 hex digits); leaves out empty on failure. */
typedef void (*kf_fingerprint_fn)(void *ctx, char out[33]);

/* out = dir's fingerprint from a matching cache entry (*hit = true) or from compute() (then
 * stored; *hit = false). files: the weight files' paths [n_files]. hit may be NULL. Fails only when
 * compute() gives nothing. */
kf_status kf_fingerprint_cached(const char *dir, const char *const *files, int n_files, kf_fingerprint_fn compute,
                                void *ctx, char out[33], bool *hit, kf_error *err);

#endif
