/* fingerprint.h — a cache of model fingerprints, so that a model's weights are hashed once.
 *
 * kf_model_fingerprint hashes every weight byte (seconds to minutes on large models); the result
 * is kept in a small text file keyed by what would change it:
 *
 *   kvfold-fingerprint 2
 *   dir <realpath of the model directory>
 *   file <name> <size> <mtime in ns> <inode> <ctime in ns>
 *   ...                                   config.json, model.safetensors.index.json when present,
 *                                         then each weight file the loader opened, in its order
 *   fingerprint <32 hex digits>
 *
 * The weight files are the loader's choice (kf_st_open_dir: the index's shards when there is an
 * index, else model.safetensors), so an index added beside model.safetensors changes the key; the
 * ctime changes with any write to a file, even one that restores its mtime. The vLLM connector
 * reads the same file (kvfold.fingerprint) and makes the same checks.
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

#include "kernels/base/error.h"

#define KF_FINGERPRINT_FILE ".kvfold-fingerprint"

/* Computes the fingerprint into out (32 hex digits); leaves out empty on failure. */
typedef void (*kf_fingerprint_fn)(void *ctx, char out[33]);

/* out = dir's fingerprint from a matching cache entry (*hit = true) or from compute() (then
 * stored; *hit = false). files: the weight files' paths [n_files]. hit may be NULL. Fails only when
 * compute() gives nothing. */
kf_status kf_fingerprint_cached(const char *dir, const char *const *files, int n_files, kf_fingerprint_fn compute,
                                void *ctx, char out[33], bool *hit, kf_error *err);

#endif
