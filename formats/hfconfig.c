#include "formats/hfconfig.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kf_rope_type_name(kf_rope_type t) {
    switch (t) {
    case KF_ROPE_TYPE_DEFAULT: return "default";
    case KF_ROPE_TYPE_LINEAR: return "linear";
    case KF_ROPE_TYPE_LLAMA3: return "llama3";
    }
    return "?";
}

/* Reads an integer field; absent -> *out = dflt unless required. */
static kf_status get_int(json_t *o, const char *key, int required, long long lo, long long hi, int dflt, int *out,
                         const char *name, kf_error *err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required)
            return kf_fail(err, KF_ERR_FORMAT, "%s: missing required field '%s'", name, key);
        *out = dflt;
        return KF_OK;
    }
    if (!json_is_integer(v))
        return kf_fail(err, KF_ERR_FORMAT, "%s: field '%s' must be an integer", name, key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return kf_fail(err, KF_ERR_FORMAT, "%s: field '%s' = %lld is out of range [%lld, %lld]", name, key, x, lo,
                       hi);
    *out = (int)x;
    return KF_OK;
}

static kf_status get_num(json_t *o, const char *key, int required, double dflt, double *out, const char *name,
                         kf_error *err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required)
            return kf_fail(err, KF_ERR_FORMAT, "%s: missing required field '%s'", name, key);
        *out = dflt;
        return KF_OK;
    }
    if (!json_is_number(v))
        return kf_fail(err, KF_ERR_FORMAT, "%s: field '%s' must be a number", name, key);
    *out = json_number_value(v);
    return KF_OK;
}

static kf_status get_bool(json_t *o, const char *key, int dflt, int *out, const char *name, kf_error *err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        *out = dflt;
        return KF_OK;
    }
    if (!json_is_boolean(v))
        return kf_fail(err, KF_ERR_FORMAT, "%s: field '%s' must be true or false", name, key);
    *out = json_is_true(v);
    return KF_OK;
}

/* rope: an object holding rope_type/type and its parameters (rope_scaling or rope_parameters). */
static kf_status parse_rope(kf_hfconfig *cfg, json_t *rope, const char *where, const char *name, kf_error *err) {
    json_t *jt = json_object_get(rope, "rope_type");
    if (!jt)
        jt = json_object_get(rope, "type");
    const char *type = "default";
    if (jt && !json_is_null(jt)) {
        if (!json_is_string(jt))
            return kf_fail(err, KF_ERR_FORMAT, "%s: %s.rope_type must be a string", name, where);
        type = json_string_value(jt);
    }
    if (strcmp(type, "default") == 0) {
        cfg->rope.type = KF_ROPE_TYPE_DEFAULT;
    } else if (strcmp(type, "linear") == 0) {
        cfg->rope.type = KF_ROPE_TYPE_LINEAR;
        KF_TRY(get_num(rope, "factor", 1, 1.0, &cfg->rope.factor, name, err));
    } else if (strcmp(type, "llama3") == 0) {
        cfg->rope.type = KF_ROPE_TYPE_LLAMA3;
        KF_TRY(get_num(rope, "factor", 1, 1.0, &cfg->rope.factor, name, err));
        KF_TRY(get_num(rope, "low_freq_factor", 1, 1.0, &cfg->rope.low_freq_factor, name, err));
        KF_TRY(get_num(rope, "high_freq_factor", 1, 4.0, &cfg->rope.high_freq_factor, name, err));
        KF_TRY(get_num(rope, "original_max_position_embeddings", 1, 8192, &cfg->rope.original_max_position, name,
                       err));
        if (!(cfg->rope.high_freq_factor > cfg->rope.low_freq_factor) || cfg->rope.original_max_position <= 0)
            return kf_fail(err, KF_ERR_FORMAT,
                           "%s: llama3 rope needs high_freq_factor > low_freq_factor and a positive "
                           "original_max_position_embeddings",
                           name);
    } else if (strcmp(type, "yarn") == 0 || strcmp(type, "dynamic") == 0 || strcmp(type, "longrope") == 0 ||
               strcmp(type, "su") == 0) {
        return kf_fail(err, KF_ERR_UNSUPPORTED,
                       "%s: rope type '%s' is not implemented yet (supported: default, linear, llama3)", name, type);
    } else {
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: unknown rope type '%s' (supported: default, linear, llama3)",
                       name, type);
    }
    /* a scaling factor stretches positions; below 1 (or tiny: found by fuzz_hfconfig) the inverse
     * frequencies divided by it can overflow to infinity */
    if ((cfg->rope.type != KF_ROPE_TYPE_DEFAULT) && !(cfg->rope.factor >= 1))
        return kf_fail(err, KF_ERR_FORMAT, "%s: %s.factor must be at least 1, not %g", name, where, cfg->rope.factor);
    json_t *th = json_object_get(rope, "rope_theta");
    if (th && !json_is_null(th)) {
        if (!json_is_number(th))
            return kf_fail(err, KF_ERR_FORMAT, "%s: %s.rope_theta must be a number", name, where);
        cfg->rope.theta = json_number_value(th);
    }
    return KF_OK;
}

static kf_status parse_token_ids(kf_hfconfig *cfg, json_t *root, const char *name, kf_error *err) {
    json_t *b = json_object_get(root, "bos_token_id");
    cfg->bos_token_id = -1;
    if (b && !json_is_null(b)) {
        if (!json_is_integer(b))
            return kf_fail(err, KF_ERR_FORMAT, "%s: bos_token_id must be an integer", name);
        cfg->bos_token_id = (int)json_integer_value(b);
    }
    json_t *e = json_object_get(root, "eos_token_id");
    cfg->n_eos = 0;
    if (!e || json_is_null(e))
        return KF_OK;
    if (json_is_integer(e)) {
        cfg->eos_token_ids[cfg->n_eos++] = (int)json_integer_value(e);
        return KF_OK;
    }
    if (!json_is_array(e))
        return kf_fail(err, KF_ERR_FORMAT, "%s: eos_token_id must be an integer or a list", name);
    size_t i;
    json_t *x;
    json_array_foreach(e, i, x) {
        if (!json_is_integer(x))
            return kf_fail(err, KF_ERR_FORMAT, "%s: eos_token_id[%zu] must be an integer", name, i);
        if (cfg->n_eos < KF_MAX_EOS)
            cfg->eos_token_ids[cfg->n_eos++] = (int)json_integer_value(x);
    }
    return KF_OK;
}

static kf_status parse_root(kf_hfconfig *cfg, json_t *root, const char *name, kf_error *err) {
    if (!json_is_object(root))
        return kf_fail(err, KF_ERR_FORMAT, "%s: not a JSON object", name);
    json_t *mt = json_object_get(root, "model_type");
    if (!mt)
        return kf_fail(err, KF_ERR_FORMAT, "%s: missing required field 'model_type'", name);
    if (!json_is_string(mt))
        return kf_fail(err, KF_ERR_FORMAT, "%s: field 'model_type' must be a string", name);
    const char *type = json_string_value(mt);
    if (strcmp(type, "qwen3") == 0) {
        cfg->arch = KF_ARCH_QWEN3;
        cfg->has_qk_norm = 1;
    } else if (strcmp(type, "llama") == 0) {
        cfg->arch = KF_ARCH_LLAMA;
    } else {
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: model type '%s' is not supported (supported: qwen3, llama)",
                       name, type);
    }
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", type);

    const long long big = 1LL << 30;
    KF_TRY(get_int(root, "vocab_size", 1, 1, big, 0, &cfg->vocab_size, name, err));
    KF_TRY(get_int(root, "hidden_size", 1, 1, 1 << 20, 0, &cfg->hidden_size, name, err));
    KF_TRY(get_int(root, "intermediate_size", 1, 1, 1 << 22, 0, &cfg->intermediate_size, name, err));
    KF_TRY(get_int(root, "num_hidden_layers", 1, 1, 4096, 0, &cfg->n_layers, name, err));
    KF_TRY(get_int(root, "num_attention_heads", 1, 1, 4096, 0, &cfg->n_heads, name, err));
    KF_TRY(get_int(root, "num_key_value_heads", 0, 1, 4096, cfg->n_heads, &cfg->n_kv_heads, name, err));
    KF_TRY(get_int(root, "head_dim", 0, 2, 4096, cfg->hidden_size / cfg->n_heads, &cfg->head_dim, name, err));
    KF_TRY(get_int(root, "max_position_embeddings", 0, 0, big, 0, &cfg->max_position_embeddings, name, err));
    KF_TRY(get_num(root, "rms_norm_eps", 1, 0, &cfg->rms_eps, name, err));
    KF_TRY(get_bool(root, "tie_word_embeddings", 0, &cfg->tie_word_embeddings, name, err));
    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                       name, cfg->n_heads, cfg->n_kv_heads);
    if (cfg->head_dim < 2 || cfg->head_dim > 4096) /* only the default hidden_size / heads gets here */
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: head_dim %d (hidden_size %d / num_attention_heads %d) is out of range [2, 4096]; set head_dim",
                       name, cfg->head_dim, cfg->hidden_size, cfg->n_heads);
    if (cfg->head_dim % 2 != 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: head_dim %d must be even for RoPE", name, cfg->head_dim);
    if (!(cfg->rms_eps > 0))
        return kf_fail(err, KF_ERR_FORMAT, "%s: rms_norm_eps must be positive", name);

    int flag;
    KF_TRY(get_bool(root, "attention_bias", 0, &flag, name, err));
    if (flag)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: attention_bias = true is not supported", name);
    KF_TRY(get_bool(root, "mlp_bias", 0, &flag, name, err));
    if (flag)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: mlp_bias = true is not supported", name);
    KF_TRY(get_bool(root, "use_sliding_window", 0, &flag, name, err));
    if (flag)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: use_sliding_window = true is not supported", name);
    json_t *act = json_object_get(root, "hidden_act");
    if (act && !json_is_null(act)) {
        if (!json_is_string(act))
            return kf_fail(err, KF_ERR_FORMAT, "%s: field 'hidden_act' must be a string", name);
        if (strcmp(json_string_value(act), "silu") != 0)
            return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: hidden_act '%s' is not supported (only silu)", name,
                           json_string_value(act));
    }

    /* RoPE: transformers 5 form first, then the legacy keys. */
    cfg->rope.type = KF_ROPE_TYPE_DEFAULT;
    cfg->rope.theta = 10000.0;
    cfg->rope.factor = 1.0;
    json_t *legacy_theta = json_object_get(root, "rope_theta");
    if (legacy_theta && !json_is_null(legacy_theta)) {
        if (!json_is_number(legacy_theta))
            return kf_fail(err, KF_ERR_FORMAT, "%s: field 'rope_theta' must be a number", name);
        cfg->rope.theta = json_number_value(legacy_theta);
    }
    json_t *params = json_object_get(root, "rope_parameters");
    json_t *scaling = json_object_get(root, "rope_scaling");
    if (params && !json_is_null(params)) {
        if (!json_is_object(params))
            return kf_fail(err, KF_ERR_FORMAT, "%s: field 'rope_parameters' must be an object", name);
        KF_TRY(parse_rope(cfg, params, "rope_parameters", name, err));
    } else if (scaling && !json_is_null(scaling)) {
        if (!json_is_object(scaling))
            return kf_fail(err, KF_ERR_FORMAT, "%s: field 'rope_scaling' must be an object or null", name);
        KF_TRY(parse_rope(cfg, scaling, "rope_scaling", name, err));
    }
    /* theta^(-2i/d) stays within [1/theta, 1]: finite for any theta >= 1 (a base below 1 is no RoPE) */
    if (!(cfg->rope.theta >= 1))
        return kf_fail(err, KF_ERR_FORMAT, "%s: rope_theta must be at least 1, not %g", name, cfg->rope.theta);

    KF_TRY(parse_token_ids(cfg, root, name, err));
    json_t *dt = json_object_get(root, "dtype");
    if (!json_is_string(dt))
        dt = json_object_get(root, "torch_dtype");
    if (json_is_string(dt))
        snprintf(cfg->dtype, sizeof cfg->dtype, "%s", json_string_value(dt));
    return KF_OK;
}

kf_status kf_hfconfig_parse(kf_hfconfig *cfg, const char *text, size_t len, const char *name, kf_error *err) {
    memset(cfg, 0, sizeof *cfg);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return kf_fail(err, KF_ERR_FORMAT, "%s: not valid JSON (line %d, column %d: %s)", name, jerr.line,
                       jerr.column, jerr.text);
    kf_status rc = parse_root(cfg, root, name, err);
    json_decref(root);
    return rc;
}

kf_status kf_hfconfig_load(kf_hfconfig *cfg, const char *path, kf_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return kf_fail(err, KF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 > cap) {
            cap = cap ? cap * 2 : 8192;
            if (cap > (64u << 20)) {
                free(buf);
                fclose(f);
                return kf_fail(err, KF_ERR_FORMAT, "%s: larger than 64 MB; not a config.json", path);
            }
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
            }
            buf = nb;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return kf_fail(err, KF_ERR_IO, "%s: read error", path);
    }
    kf_status rc = kf_hfconfig_parse(cfg, buf, len, path, err);
    free(buf);
    return rc;
}
