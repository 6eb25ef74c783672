/* hfconfig.h — the parts of a Hugging Face config.json that kvfold needs.
 *
 * Supported model types: "qwen3" (Qwen3ForCausalLM) and "llama" (Llama 3 family).
 * Anything else is refused by name (KF_ERR_UNSUPPORTED).
 *
 * Fields read (required unless a default is given):
 *   model_type, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
 *   num_attention_heads, num_key_value_heads (default num_attention_heads),
 *   head_dim (default hidden_size / num_attention_heads), rms_norm_eps,
 *   tie_word_embeddings (default false), max_position_embeddings (default 0 = unknown),
 *   hidden_act (must be "silu" when present), attention_bias / mlp_bias (must be false),
 *   use_sliding_window (qwen3; must be false), bos_token_id / eos_token_id (int, list or null),
 *   torch_dtype or dtype (informational).
 *
 * RoPE comes in two forms, both accepted:
 *   legacy (most hub checkpoints):  "rope_theta": 1e6, "rope_scaling": null | {"rope_type"|"type": ...}
 *   transformers 5:                 "rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}
 * rope types: "default", "linear" (factor), "llama3" (factor, low_freq_factor, high_freq_factor,
 * original_max_position_embeddings). "yarn", "dynamic", "longrope" are recognised and refused.
 */
#ifndef KF_HFCONFIG_H
#define KF_HFCONFIG_H

#include <stddef.h>

#include "kernels/base/error.h"

typedef enum { KF_ARCH_QWEN3 = 0, KF_ARCH_LLAMA = 1 } kf_arch;

typedef enum { KF_ROPE_TYPE_DEFAULT = 0, KF_ROPE_TYPE_LINEAR = 1, KF_ROPE_TYPE_LLAMA3 = 2 } kf_rope_type;

#define KF_MAX_EOS 8

typedef struct {
    kf_arch arch;
    char model_type[32];
    int vocab_size;
    int hidden_size;
    int intermediate_size;
    int n_layers;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    double rms_eps;
    int tie_word_embeddings;
    int max_position_embeddings;
    int has_qk_norm; /* qwen3: per-head RMSNorm of q and k before RoPE */
    struct {
        kf_rope_type type;
        double theta;
        double factor;               /* linear, llama3 */
        double low_freq_factor;      /* llama3 */
        double high_freq_factor;     /* llama3 */
        double original_max_position; /* llama3 */
    } rope;
    int bos_token_id;                /* -1 when absent */
    int eos_token_ids[KF_MAX_EOS];
    int n_eos;
    char dtype[16];                  /* "bfloat16", ... or "" */
} kf_hfconfig;

/* Parse config.json text; name is used in messages (usually the path). */
kf_status kf_hfconfig_parse(kf_hfconfig *cfg, const char *text, size_t len, const char *name, kf_error *err);
/* Read and parse a config.json file. */
kf_status kf_hfconfig_load(kf_hfconfig *cfg, const char *path, kf_error *err);

const char *kf_rope_type_name(kf_rope_type t);

#endif
