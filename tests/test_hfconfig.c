/* config.json parsing: the two fixtures, legacy and transformers-5 RoPE forms, defaults, every
 * refusal (status and message), and the RoPE inverse frequencies the config leads to. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/hfconfig.h"
#include "kernels/backend.h"
#include "test_util.h"

#define NAME "test/config.json"

/* A legacy-form Llama 3 config (rope_theta + rope_scaling), as most hub checkpoints have it. */
static const char kLlamaLegacy[] =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"vocab_size\":1000,"
    "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":8,"
    "\"num_key_value_heads\":2,\"head_dim\":8,\"rms_norm_eps\":1e-5,\"hidden_act\":\"silu\","
    "\"max_position_embeddings\":131072,\"rope_theta\":500000.0,"
    "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,"
    "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192},"
    "\"bos_token_id\":128000,\"eos_token_id\":[128001,128008,128009],\"tie_word_embeddings\":false,"
    "\"attention_bias\":false,\"mlp_bias\":false,\"torch_dtype\":\"bfloat16\"}";

/* A minimal Qwen3 config. */
static const char kQwen3[] =
    "{\"model_type\":\"qwen3\",\"vocab_size\":3200,\"hidden_size\":256,\"intermediate_size\":768,"
    "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
    "\"rms_norm_eps\":1e-6,\"rope_theta\":1000000.0,\"rope_scaling\":null,\"tie_word_embeddings\":true,"
    "\"use_sliding_window\":false,\"eos_token_id\":3199}";

static json_t *load_json(const char *text) {
    json_error_t e;
    json_t *j = json_loads(text, 0, &e);
    CU_ASSERT_PTR_NOT_NULL_FATAL(j);
    return j;
}

/* Parses a JSON object (consumed). */
static kf_status parse_obj(kf_hfconfig *cfg, json_t *obj, kf_error *err) {
    char *text = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    kf_status st = kf_hfconfig_parse(cfg, text, strlen(text), NAME, err);
    free(text);
    return st;
}

#define ASSERT_AT(cond, line) CU_assertImplementation((cond), (line), #cond, __FILE__, "", CU_FALSE)

static void expect_fail_text_at(const char *text, kf_status code, const char *kw1, const char *kw2, unsigned line) {
    kf_hfconfig cfg;
    kf_error err = {0};
    kf_status st = kf_hfconfig_parse(&cfg, text, strlen(text), NAME, &err);
    int ok = st == code && strstr(err.msg, NAME) && (!kw1 || strstr(err.msg, kw1)) && (!kw2 || strstr(err.msg, kw2));
    if (!ok)
        fprintf(stderr, "\n    line %u: status %s (want %s), message: %s\n", line, kf_status_name(st),
                kf_status_name(code), err.msg);
    ASSERT_AT(st == code, line);
    ASSERT_AT(strstr(err.msg, NAME) != NULL, line);
    if (kw1)
        ASSERT_AT(strstr(err.msg, kw1) != NULL, line);
    if (kw2)
        ASSERT_AT(strstr(err.msg, kw2) != NULL, line);
}

/* Refusal of obj (consumed). */
static void expect_fail_at(json_t *obj, kf_status code, const char *kw1, const char *kw2, unsigned line) {
    char *text = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    expect_fail_text_at(text, code, kw1, kw2, line);
    free(text);
}
#define EXPECT_FAIL(obj, code, kw1, kw2) expect_fail_at((obj), (code), (kw1), (kw2), __LINE__)
#define EXPECT_FAIL_TEXT(text, code, kw1, kw2) expect_fail_text_at((text), (code), (kw1), (kw2), __LINE__)

/* The legacy llama config with one field set (value consumed) or, when value is NULL, removed. */
static json_t *llama_with(const char *key, json_t *value) {
    json_t *j = load_json(kLlamaLegacy);
    if (value)
        json_object_set_new(j, key, value);
    else
        json_object_del(j, key);
    return j;
}

static json_t *qwen_with(const char *key, json_t *value) {
    json_t *j = load_json(kQwen3);
    if (value)
        json_object_set_new(j, key, value);
    else
        json_object_del(j, key);
    return j;
}

/* ---- fixtures -------------------------------------------------------------------------- */

static void test_fixture_qwen3(void) {
    kf_hfconfig c;
    kf_error err = {0};
    kf_status st = kf_hfconfig_load(&c, kf_test_data("hf-qwen3-tiny/config.json"), &err);
    if (st != KF_OK)
        fprintf(stderr, "\n    %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    CU_ASSERT_EQUAL(c.arch, KF_ARCH_QWEN3);
    CU_ASSERT_STRING_EQUAL(c.model_type, "qwen3");
    CU_ASSERT_EQUAL(c.vocab_size, 3200);
    CU_ASSERT_EQUAL(c.hidden_size, 256);
    CU_ASSERT_EQUAL(c.intermediate_size, 768);
    CU_ASSERT_EQUAL(c.n_layers, 4);
    CU_ASSERT_EQUAL(c.n_heads, 4);
    CU_ASSERT_EQUAL(c.n_kv_heads, 2);
    CU_ASSERT_EQUAL(c.head_dim, 64);
    CU_ASSERT_DOUBLE_EQUAL(c.rms_eps, 1e-6, 1e-18);
    CU_ASSERT_EQUAL(c.tie_word_embeddings, 1);
    CU_ASSERT_EQUAL(c.max_position_embeddings, 4096);
    CU_ASSERT_EQUAL(c.has_qk_norm, 1);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_DEFAULT); /* rope_scaling: null */
    CU_ASSERT_EQUAL(c.rope.theta, 10000.0);
    CU_ASSERT_EQUAL(c.rope.factor, 1.0);
    CU_ASSERT_EQUAL(c.bos_token_id, 3199);
    CU_ASSERT_EQUAL(c.n_eos, 1);
    CU_ASSERT_EQUAL(c.eos_token_ids[0], 3199);
    CU_ASSERT_STRING_EQUAL(c.dtype, "bfloat16"); /* torch_dtype */
    CU_ASSERT_STRING_EQUAL(kf_rope_type_name(c.rope.type), "default");
}

static void test_fixture_llama3(void) {
    kf_hfconfig c;
    kf_error err = {0};
    kf_status st = kf_hfconfig_load(&c, kf_test_data("hf-llama3-tiny-random/config.json"), &err);
    if (st != KF_OK)
        fprintf(stderr, "\n    %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    CU_ASSERT_EQUAL(c.arch, KF_ARCH_LLAMA);
    CU_ASSERT_STRING_EQUAL(c.model_type, "llama");
    CU_ASSERT_EQUAL(c.vocab_size, 3200);
    CU_ASSERT_EQUAL(c.hidden_size, 64);
    CU_ASSERT_EQUAL(c.intermediate_size, 160);
    CU_ASSERT_EQUAL(c.n_layers, 2);
    CU_ASSERT_EQUAL(c.n_heads, 4);
    CU_ASSERT_EQUAL(c.n_kv_heads, 2);
    CU_ASSERT_EQUAL(c.head_dim, 16);
    CU_ASSERT_DOUBLE_EQUAL(c.rms_eps, 1e-5, 1e-17);
    CU_ASSERT_EQUAL(c.tie_word_embeddings, 0);
    CU_ASSERT_EQUAL(c.max_position_embeddings, 1024);
    CU_ASSERT_EQUAL(c.has_qk_norm, 0);
    /* transformers 5: rope_parameters */
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LLAMA3);
    CU_ASSERT_STRING_EQUAL(kf_rope_type_name(c.rope.type), "llama3");
    CU_ASSERT_EQUAL(c.rope.theta, 500000.0);
    CU_ASSERT_EQUAL(c.rope.factor, 8.0);
    CU_ASSERT_EQUAL(c.rope.low_freq_factor, 1.0);
    CU_ASSERT_EQUAL(c.rope.high_freq_factor, 4.0);
    CU_ASSERT_EQUAL(c.rope.original_max_position, 64.0);
    CU_ASSERT_EQUAL(c.bos_token_id, 3199);
    CU_ASSERT_EQUAL(c.n_eos, 1);
    CU_ASSERT_EQUAL(c.eos_token_ids[0], 3199);
    CU_ASSERT_STRING_EQUAL(c.dtype, "bfloat16"); /* "dtype", the transformers-5 key */
}

/* ---- accepted variants ----------------------------------------------------------------- */

static void test_legacy_llama3(void) {
    kf_hfconfig c;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_hfconfig_parse(&c, kLlamaLegacy, strlen(kLlamaLegacy), NAME, &err), KF_OK);
    CU_ASSERT_EQUAL(c.arch, KF_ARCH_LLAMA);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LLAMA3);
    CU_ASSERT_EQUAL(c.rope.theta, 500000.0);
    CU_ASSERT_EQUAL(c.rope.factor, 8.0);
    CU_ASSERT_EQUAL(c.rope.low_freq_factor, 1.0);
    CU_ASSERT_EQUAL(c.rope.high_freq_factor, 4.0);
    CU_ASSERT_EQUAL(c.rope.original_max_position, 8192.0);
    CU_ASSERT_EQUAL(c.max_position_embeddings, 131072);
    CU_ASSERT_EQUAL(c.head_dim, 8);
    CU_ASSERT_EQUAL(c.n_kv_heads, 2);
    /* eos_token_id as a list */
    CU_ASSERT_EQUAL(c.bos_token_id, 128000);
    CU_ASSERT_EQUAL(c.n_eos, 3);
    CU_ASSERT_EQUAL(c.eos_token_ids[0], 128001);
    CU_ASSERT_EQUAL(c.eos_token_ids[1], 128008);
    CU_ASSERT_EQUAL(c.eos_token_ids[2], 128009);
    CU_ASSERT_STRING_EQUAL(c.dtype, "bfloat16");

    /* the older key "type" instead of "rope_type" */
    json_t *j = load_json(kLlamaLegacy);
    json_t *rs = json_object_get(j, "rope_scaling");
    json_object_del(rs, "rope_type");
    json_object_set_new(rs, "type", json_string("llama3"));
    json_object_set_new(rs, "factor", json_real(32.0));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LLAMA3);
    CU_ASSERT_EQUAL(c.rope.factor, 32.0);
    CU_ASSERT_EQUAL(c.rope.theta, 500000.0);

    /* integers where numbers are expected are fine */
    j = load_json(kLlamaLegacy);
    rs = json_object_get(j, "rope_scaling");
    json_object_set_new(rs, "factor", json_integer(8));
    json_object_set_new(j, "rope_theta", json_integer(500000));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.factor, 8.0);
    CU_ASSERT_EQUAL(c.rope.theta, 500000.0);

    /* the same rope in the transformers-5 form: rope_theta inside rope_parameters */
    j = load_json(kLlamaLegacy);
    rs = json_deep_copy(json_object_get(j, "rope_scaling"));
    json_object_set_new(rs, "rope_theta", json_real(250000.0));
    json_object_del(j, "rope_scaling");
    json_object_del(j, "rope_theta");
    json_object_set_new(j, "rope_parameters", rs);
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LLAMA3);
    CU_ASSERT_EQUAL(c.rope.theta, 250000.0);
    CU_ASSERT_EQUAL(c.rope.original_max_position, 8192.0);
}

static void test_linear_and_default_rope(void) {
    kf_hfconfig c;
    kf_error err = {0};
    json_t *j = llama_with("rope_scaling", load_json("{\"type\":\"linear\",\"factor\":2.5}"));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LINEAR);
    CU_ASSERT_STRING_EQUAL(kf_rope_type_name(c.rope.type), "linear");
    CU_ASSERT_EQUAL(c.rope.factor, 2.5);
    CU_ASSERT_EQUAL(c.rope.theta, 500000.0);

    j = llama_with("rope_parameters", load_json("{\"rope_type\":\"linear\",\"factor\":4,\"rope_theta\":10000}"));
    json_object_del(j, "rope_scaling");
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LINEAR);
    CU_ASSERT_EQUAL(c.rope.factor, 4.0);
    CU_ASSERT_EQUAL(c.rope.theta, 10000.0);

    /* explicit default */
    j = llama_with("rope_scaling", load_json("{\"rope_type\":\"default\"}"));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_DEFAULT);
    CU_ASSERT_EQUAL(c.rope.factor, 1.0);
    CU_ASSERT_EQUAL(c.rope.theta, 500000.0);

    /* transformers-5 default: theta only inside rope_parameters */
    j = llama_with("rope_parameters", load_json("{\"rope_type\":\"default\",\"rope_theta\":1000000.0}"));
    json_object_del(j, "rope_scaling");
    json_object_del(j, "rope_theta");
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_DEFAULT);
    CU_ASSERT_EQUAL(c.rope.theta, 1000000.0);

    /* no rope keys at all: theta 10000 */
    j = llama_with("rope_scaling", NULL);
    json_object_del(j, "rope_theta");
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_DEFAULT);
    CU_ASSERT_EQUAL(c.rope.theta, 10000.0);

    /* qwen3 with rope_scaling null and its own theta */
    CU_ASSERT_EQUAL_FATAL(kf_hfconfig_parse(&c, kQwen3, strlen(kQwen3), NAME, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_DEFAULT);
    CU_ASSERT_EQUAL(c.rope.theta, 1000000.0);
    CU_ASSERT_EQUAL(c.has_qk_norm, 1);
    CU_ASSERT_EQUAL(c.tie_word_embeddings, 1);
    CU_ASSERT_EQUAL(c.bos_token_id, -1); /* absent */
    CU_ASSERT_STRING_EQUAL(c.dtype, "");
}

static void test_defaults(void) {
    kf_hfconfig c;
    kf_error err = {0};
    /* head_dim defaults to hidden_size / num_attention_heads */
    json_t *j = llama_with("head_dim", NULL);
    json_object_set_new(j, "hidden_size", json_integer(128));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.head_dim, 16);
    j = llama_with("head_dim", json_null());
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.head_dim, 8);
    /* num_key_value_heads defaults to num_attention_heads (plain MHA) */
    j = llama_with("num_key_value_heads", NULL);
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.n_kv_heads, 8);
    /* optional fields absent */
    j = llama_with("tie_word_embeddings", NULL);
    json_object_del(j, "max_position_embeddings");
    json_object_del(j, "hidden_act");
    json_object_del(j, "attention_bias");
    json_object_del(j, "mlp_bias");
    json_object_del(j, "torch_dtype");
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.tie_word_embeddings, 0);
    CU_ASSERT_EQUAL(c.max_position_embeddings, 0);
    CU_ASSERT_STRING_EQUAL(c.dtype, "");
    CU_ASSERT_EQUAL(c.has_qk_norm, 0);
    /* bos null, eos absent */
    j = llama_with("bos_token_id", json_null());
    json_object_del(j, "eos_token_id");
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.bos_token_id, -1);
    CU_ASSERT_EQUAL(c.n_eos, 0);
    /* eos as a single integer, and eos null */
    j = llama_with("eos_token_id", json_integer(7));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.n_eos, 1);
    CU_ASSERT_EQUAL(c.eos_token_ids[0], 7);
    j = llama_with("eos_token_id", json_null());
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.n_eos, 0);
    /* more eos ids than KF_MAX_EOS: the first KF_MAX_EOS are kept */
    j = llama_with("eos_token_id", load_json("[1,2,3,4,5,6,7,8,9,10]"));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.n_eos, KF_MAX_EOS);
    CU_ASSERT_EQUAL(c.eos_token_ids[KF_MAX_EOS - 1], KF_MAX_EOS);
    /* "dtype" is preferred over "torch_dtype" */
    j = llama_with("dtype", json_string("float32"));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_STRING_EQUAL(c.dtype, "float32");
    /* silu explicitly; false flags explicitly; unknown extra keys ignored */
    j = qwen_with("hidden_act", json_string("silu"));
    json_object_set_new(j, "attention_bias", json_false());
    json_object_set_new(j, "something_new", load_json("{\"x\":[1,2]}"));
    CU_ASSERT_EQUAL_FATAL(parse_obj(&c, j, &err), KF_OK);
    CU_ASSERT_EQUAL(c.arch, KF_ARCH_QWEN3);
}

/* ---- refusals -------------------------------------------------------------------------- */

static void test_refuse_model_type(void) {
    EXPECT_FAIL(llama_with("model_type", json_string("mistral")), KF_ERR_UNSUPPORTED, "'mistral'", "not supported");
    EXPECT_FAIL(llama_with("model_type", json_string("qwen2")), KF_ERR_UNSUPPORTED, "'qwen2'", NULL);
    EXPECT_FAIL(llama_with("model_type", json_string("")), KF_ERR_UNSUPPORTED, "''", NULL);
    EXPECT_FAIL(llama_with("model_type", NULL), KF_ERR_FORMAT, "missing", "model_type");
    EXPECT_FAIL(llama_with("model_type", json_integer(3)), KF_ERR_FORMAT, "model_type", "string");
}

static void test_refuse_missing_fields(void) {
    static const char *required[] = {"vocab_size",        "hidden_size",         "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads", "rms_norm_eps"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        char quoted[64];
        snprintf(quoted, sizeof quoted, "'%s'", required[i]);
        EXPECT_FAIL(llama_with(required[i], NULL), KF_ERR_FORMAT, "missing", quoted);
        EXPECT_FAIL(llama_with(required[i], json_null()), KF_ERR_FORMAT, "missing", quoted);
    }
}

static void test_refuse_wrong_types(void) {
    EXPECT_FAIL(llama_with("hidden_size", json_string("64")), KF_ERR_FORMAT, "'hidden_size'", "integer");
    EXPECT_FAIL(llama_with("num_hidden_layers", json_real(2.5)), KF_ERR_FORMAT, "'num_hidden_layers'", "integer");
    EXPECT_FAIL(llama_with("vocab_size", json_real(1000.0)), KF_ERR_FORMAT, "'vocab_size'", "integer");
    EXPECT_FAIL(llama_with("num_key_value_heads", json_true()), KF_ERR_FORMAT, "'num_key_value_heads'", "integer");
    EXPECT_FAIL(llama_with("head_dim", load_json("[8]")), KF_ERR_FORMAT, "'head_dim'", "integer");
    EXPECT_FAIL(llama_with("rms_norm_eps", json_string("1e-5")), KF_ERR_FORMAT, "'rms_norm_eps'", "number");
    EXPECT_FAIL(llama_with("tie_word_embeddings", json_string("yes")), KF_ERR_FORMAT, "'tie_word_embeddings'",
                "true or false");
    EXPECT_FAIL(llama_with("tie_word_embeddings", json_integer(1)), KF_ERR_FORMAT, "'tie_word_embeddings'", NULL);
    EXPECT_FAIL(llama_with("rope_theta", json_string("500000")), KF_ERR_FORMAT, "'rope_theta'", "number");
    EXPECT_FAIL(llama_with("rope_scaling", json_string("llama3")), KF_ERR_FORMAT, "'rope_scaling'", "object");
    EXPECT_FAIL(llama_with("rope_parameters", load_json("[1]")), KF_ERR_FORMAT, "'rope_parameters'", "object");
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":3}")), KF_ERR_FORMAT, "rope_scaling", "rope_type");
    EXPECT_FAIL(llama_with("rope_parameters", load_json("{\"rope_type\":\"default\",\"rope_theta\":\"1e4\"}")),
                KF_ERR_FORMAT, "rope_parameters", "rope_theta");
    EXPECT_FAIL(llama_with("hidden_act", json_integer(1)), KF_ERR_FORMAT, "'hidden_act'", "string");
    EXPECT_FAIL(llama_with("bos_token_id", json_string("<s>")), KF_ERR_FORMAT, "bos_token_id", "integer");
    EXPECT_FAIL(llama_with("eos_token_id", load_json("[1,\"</s>\"]")), KF_ERR_FORMAT, "eos_token_id[1]", NULL);
    EXPECT_FAIL(llama_with("eos_token_id", load_json("{\"id\":1}")), KF_ERR_FORMAT, "eos_token_id", "list");
    EXPECT_FAIL(llama_with("attention_bias", json_string("false")), KF_ERR_FORMAT, "'attention_bias'", NULL);
}

static void test_refuse_out_of_range(void) {
    EXPECT_FAIL(llama_with("hidden_size", json_integer(0)), KF_ERR_FORMAT, "'hidden_size'", "out of range");
    EXPECT_FAIL(llama_with("hidden_size", json_integer(-64)), KF_ERR_FORMAT, "'hidden_size'", "-64");
    EXPECT_FAIL(llama_with("num_hidden_layers", json_integer(0)), KF_ERR_FORMAT, "'num_hidden_layers'", "out of range");
    EXPECT_FAIL(llama_with("vocab_size", json_integer(1LL << 40)), KF_ERR_FORMAT, "'vocab_size'", "out of range");
    EXPECT_FAIL(llama_with("num_attention_heads", json_integer(100000)), KF_ERR_FORMAT, "'num_attention_heads'",
                "out of range");
    EXPECT_FAIL(llama_with("num_key_value_heads", json_integer(0)), KF_ERR_FORMAT, "'num_key_value_heads'",
                "out of range");
    EXPECT_FAIL(llama_with("intermediate_size", json_integer(1LL << 31)), KF_ERR_FORMAT, "'intermediate_size'",
                "out of range");
    EXPECT_FAIL(llama_with("head_dim", json_integer(1)), KF_ERR_FORMAT, "'head_dim'", "out of range");
    EXPECT_FAIL(llama_with("head_dim", json_integer(7)), KF_ERR_FORMAT, "head_dim 7", "even");
    EXPECT_FAIL(llama_with("max_position_embeddings", json_integer(-1)), KF_ERR_FORMAT, "'max_position_embeddings'",
                "out of range");
    EXPECT_FAIL(llama_with("rms_norm_eps", json_real(0.0)), KF_ERR_FORMAT, "rms_norm_eps", "positive");
    EXPECT_FAIL(llama_with("rms_norm_eps", json_real(-1e-5)), KF_ERR_FORMAT, "rms_norm_eps", "positive");
    EXPECT_FAIL(llama_with("rope_theta", json_real(0.0)), KF_ERR_FORMAT, "rope_theta", "at least 1");
    EXPECT_FAIL(llama_with("rope_theta", json_integer(-10000)), KF_ERR_FORMAT, "rope_theta", "at least 1");
    /* heads not a multiple of kv heads, or fewer heads than kv heads */
    EXPECT_FAIL(llama_with("num_key_value_heads", json_integer(3)), KF_ERR_FORMAT, "multiple", "(3)");
    EXPECT_FAIL(llama_with("num_key_value_heads", json_integer(16)), KF_ERR_FORMAT, "multiple", "(16)");
    /* head_dim defaulted from hidden / heads must still be usable */
    json_t *j = llama_with("head_dim", NULL);
    json_object_set_new(j, "hidden_size", json_integer(4)); /* 4 / 8 = 0 */
    EXPECT_FAIL(j, KF_ERR_FORMAT, "head_dim", NULL);
    j = llama_with("head_dim", NULL);
    json_object_set_new(j, "hidden_size", json_integer(72)); /* 72 / 8 = 9: odd */
    EXPECT_FAIL(j, KF_ERR_FORMAT, "head_dim 9", "even");
    j = llama_with("head_dim", NULL);
    json_object_set_new(j, "hidden_size", json_integer(8 * 4098)); /* 4098 > 4096 (found by fuzz_hfconfig) */
    EXPECT_FAIL(j, KF_ERR_FORMAT, "head_dim 4098", "out of range");
}

static void test_refuse_rope(void) {
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"yarn\",\"factor\":4.0,"
                                                     "\"original_max_position_embeddings\":32768}")),
                KF_ERR_UNSUPPORTED, "yarn", "not implemented");
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"type\":\"yarn\",\"factor\":4.0}")), KF_ERR_UNSUPPORTED,
                "'yarn'", NULL);
    EXPECT_FAIL(llama_with("rope_parameters", load_json("{\"rope_type\":\"yarn\",\"factor\":4.0}")), KF_ERR_UNSUPPORTED,
                "'yarn'", NULL);
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"type\":\"dynamic\",\"factor\":2.0}")), KF_ERR_UNSUPPORTED,
                "'dynamic'", NULL);
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"longrope\"}")), KF_ERR_UNSUPPORTED, "'longrope'",
                NULL);
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"spiral\",\"factor\":2.0}")), KF_ERR_UNSUPPORTED,
                "unknown rope type", "'spiral'");
    /* llama3 and linear parameters */
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"llama3\",\"low_freq_factor\":1,"
                                                     "\"high_freq_factor\":4,"
                                                     "\"original_max_position_embeddings\":8192}")),
                KF_ERR_FORMAT, "missing", "'factor'");
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,"
                                                     "\"high_freq_factor\":4}")),
                KF_ERR_FORMAT, "missing", "'original_max_position_embeddings'");
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":4,"
                                                     "\"high_freq_factor\":4,"
                                                     "\"original_max_position_embeddings\":8192}")),
                KF_ERR_FORMAT, "high_freq_factor > low_freq_factor", NULL);
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,"
                                                     "\"high_freq_factor\":4,"
                                                     "\"original_max_position_embeddings\":0}")),
                KF_ERR_FORMAT, "original_max_position_embeddings", NULL);
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"rope_type\":\"llama3\",\"factor\":0,\"low_freq_factor\":1,"
                                                     "\"high_freq_factor\":4,"
                                                     "\"original_max_position_embeddings\":8192}")),
                KF_ERR_FORMAT, "rope_scaling.factor", "at least 1");
    /* a tiny factor made the inverse frequencies infinite (found by fuzz_hfconfig) */
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"type\":\"linear\",\"factor\":1e-310}")), KF_ERR_FORMAT,
                "factor", "at least 1");
    EXPECT_FAIL(llama_with("rope_theta", json_real(0.5)), KF_ERR_FORMAT, "rope_theta must be at least 1", NULL);
    EXPECT_FAIL(llama_with("rope_theta", json_real(1e-320)), KF_ERR_FORMAT, "rope_theta", NULL);
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"type\":\"linear\"}")), KF_ERR_FORMAT, "missing", "'factor'");
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"type\":\"linear\",\"factor\":-2}")), KF_ERR_FORMAT, "factor",
                "at least 1");
    EXPECT_FAIL(llama_with("rope_scaling", load_json("{\"type\":\"linear\",\"factor\":\"2\"}")), KF_ERR_FORMAT,
                "'factor'", "number");
}

static void test_refuse_unsupported_features(void) {
    EXPECT_FAIL(llama_with("attention_bias", json_true()), KF_ERR_UNSUPPORTED, "attention_bias", "not supported");
    EXPECT_FAIL(llama_with("mlp_bias", json_true()), KF_ERR_UNSUPPORTED, "mlp_bias", "not supported");
    EXPECT_FAIL(qwen_with("use_sliding_window", json_true()), KF_ERR_UNSUPPORTED, "use_sliding_window", NULL);
    EXPECT_FAIL(llama_with("hidden_act", json_string("gelu")), KF_ERR_UNSUPPORTED, "'gelu'", "silu");
    EXPECT_FAIL(qwen_with("hidden_act", json_string("gelu_pytorch_tanh")), KF_ERR_UNSUPPORTED, "'gelu_pytorch_tanh'",
                NULL);
}

static void test_refuse_not_json(void) {
    EXPECT_FAIL_TEXT("{\"model_type\": \"llama\",", KF_ERR_FORMAT, "not valid JSON", NULL);
    EXPECT_FAIL_TEXT("model_type = llama", KF_ERR_FORMAT, "not valid JSON", NULL);
    EXPECT_FAIL_TEXT("", KF_ERR_FORMAT, "not valid JSON", NULL);
    EXPECT_FAIL_TEXT("[{\"model_type\": \"llama\"}]", KF_ERR_FORMAT, "not a JSON object", NULL);
    EXPECT_FAIL_TEXT("{\"model_type\":\"llama\",\"model_type\":\"qwen3\"}", KF_ERR_FORMAT, "duplicate", NULL);
    /* a length shorter than the text: only the prefix is parsed */
    kf_hfconfig c;
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_hfconfig_parse(&c, kLlamaLegacy, 20, NAME, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "not valid JSON"));
}

static void test_load_files(void) {
    kf_hfconfig c;
    kf_error err = {0};
    char path[512];
    /* round trip through a file */
    snprintf(path, sizeof path, "%s", kf_test_write_file("config.json", kLlamaLegacy, strlen(kLlamaLegacy)));
    CU_ASSERT_EQUAL_FATAL(kf_hfconfig_load(&c, path, &err), KF_OK);
    CU_ASSERT_EQUAL(c.rope.type, KF_ROPE_TYPE_LLAMA3);
    /* a big file (over the loader's first 8 KiB buffer) */
    size_t n = strlen(kLlamaLegacy) + 20000;
    char *big = malloc(n + 1);
    memcpy(big, kLlamaLegacy, strlen(kLlamaLegacy) - 1);
    size_t off = strlen(kLlamaLegacy) - 1;
    off += (size_t)sprintf(big + off, ",\"pad\":\"");
    while (off < n - 2)
        big[off++] = 'x';
    big[off++] = '"';
    big[off++] = '}';
    snprintf(path, sizeof path, "%s", kf_test_write_file("big-config.json", big, off));
    free(big);
    CU_ASSERT_EQUAL(kf_hfconfig_load(&c, path, &err), KF_OK);
    CU_ASSERT_EQUAL(c.vocab_size, 1000);
    /* errors name the path */
    snprintf(path, sizeof path, "%s", kf_test_write_file("bad-config.json", "{\"model_type\":", 14));
    CU_ASSERT_EQUAL(kf_hfconfig_load(&c, path, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "not valid JSON"));
    snprintf(path, sizeof path, "%s", kf_test_write_file("gemma-config.json", "{\"model_type\":\"gemma\"}", 22));
    CU_ASSERT_EQUAL(kf_hfconfig_load(&c, path, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "'gemma'"));
    /* missing file, directory */
    snprintf(path, sizeof path, "%s/no-such-config.json", kf_test_make_dir("cfgdir"));
    CU_ASSERT_EQUAL(kf_hfconfig_load(&c, path, &err), KF_ERR_IO);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "cannot open"));
    snprintf(path, sizeof path, "%s", kf_test_make_dir("cfgdir"));
    CU_ASSERT_EQUAL(kf_hfconfig_load(&c, path, &err), KF_ERR_IO);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
}

/* ---- RoPE inverse frequencies ---------------------------------------------------------- */

/* Llama 3 scaling written in terms of frequencies rather than wavelengths (Meta's
 * apply_scaling): a frequency above high_freq_factor / orig cycles per token is kept, one below
 * low_freq_factor / orig is divided by factor, and between the two the result moves linearly in
 * orig * freq / (2 pi) from freq / factor to freq. */
static double llama3_ref(double base, double factor, double low, double high, double orig) {
    const double cycles = orig * base / (2.0 * M_PI); /* rotations over the original context */
    if (cycles > high)
        return base;
    if (cycles < low)
        return base / factor;
    const double t = (cycles - low) / (high - low);
    return base / factor + t * (base - base / factor);
}

static void check_rel(double got, double want, const char *what, int i) {
    double rel = fabs(got - want) / fabs(want);
    if (!(rel < 1e-12))
        fprintf(stderr, "\n    %s[%d]: got %.17g want %.17g\n", what, i, got, want);
    CU_ASSERT(rel < 1e-12);
}

static void test_rope_default_linear(void) {
    const int hd = 16;
    double def[8], lin[8];
    kf_rope_spec s = {.kind = KF_ROPE_DEFAULT, .theta = 10000.0, .factor = 1.0};
    kf_rope_inv_freq(&s, hd, def);
    for (int i = 0; i < hd / 2; i++)
        check_rel(def[i], exp(-log(10000.0) * (2.0 * i) / hd), "default", i);
    CU_ASSERT_EQUAL(def[0], 1.0);
    CU_ASSERT_DOUBLE_EQUAL(def[4], 0.01, 1e-15); /* 10000^(-8/16) */
    s.kind = KF_ROPE_LINEAR;
    s.factor = 4.0;
    kf_rope_inv_freq(&s, hd, lin);
    for (int i = 0; i < hd / 2; i++)
        check_rel(lin[i], def[i] / 4.0, "linear", i);
    /* default ignores factor */
    s.kind = KF_ROPE_DEFAULT;
    kf_rope_inv_freq(&s, hd, lin);
    for (int i = 0; i < hd / 2; i++)
        CU_ASSERT_EQUAL(lin[i], def[i]);
}

/* Checks kf_rope_inv_freq's llama3 branch for one configuration; returns counts of the high,
 * medium and low frequency bands. */
static void check_llama3(int hd, double theta, double factor, double low, double high, double orig, int *n_high,
                         int *n_med, int *n_low) {
    double *got = malloc(sizeof(double) * (size_t)hd / 2), *def = malloc(sizeof(double) * (size_t)hd / 2);
    kf_rope_spec s = {.kind = KF_ROPE_LLAMA3,
                      .theta = theta,
                      .factor = factor,
                      .low_freq_factor = low,
                      .high_freq_factor = high,
                      .original_max_pos = orig};
    kf_rope_inv_freq(&s, hd, got);
    kf_rope_spec d = {.kind = KF_ROPE_DEFAULT, .theta = theta};
    kf_rope_inv_freq(&d, hd, def);
    *n_high = *n_med = *n_low = 0;
    for (int i = 0; i < hd / 2; i++) {
        double base = pow(theta, -(double)(2 * i) / hd);
        check_rel(def[i], base, "default", i);
        check_rel(got[i], llama3_ref(base, factor, low, high, orig), "llama3", i);
        double cycles = orig * base / (2.0 * M_PI);
        if (cycles > high) {
            (*n_high)++;
            CU_ASSERT_EQUAL(got[i], def[i]); /* unchanged, bit for bit */
        } else if (cycles < low) {
            (*n_low)++;
            check_rel(got[i], def[i] / factor, "llama3 low", i);
        } else {
            (*n_med)++;
            CU_ASSERT(got[i] > def[i] / factor && got[i] < def[i]);
        }
        if (i > 0)
            CU_ASSERT(got[i] < got[i - 1]); /* still decreasing */
    }
    free(got);
    free(def);
}

static void test_rope_llama3(void) {
    int nh, nm, nl;
    /* the hf-llama3-tiny-random config: head_dim 16, theta 5e5, factor 8, 1/4, orig 64 */
    check_llama3(16, 500000.0, 8.0, 1.0, 4.0, 64.0, &nh, &nm, &nl);
    CU_ASSERT_EQUAL(nh, 1);
    CU_ASSERT_EQUAL(nm, 1);
    CU_ASSERT_EQUAL(nl, 6);
    /* anchors computed outside C (Python, transformers' wavelength formulation) */
    double f[8];
    kf_rope_spec s = {.kind = KF_ROPE_LLAMA3,
                      .theta = 500000.0,
                      .factor = 8.0,
                      .low_freq_factor = 1.0,
                      .high_freq_factor = 4.0,
                      .original_max_pos = 64.0};
    kf_rope_inv_freq(&s, 16, f);
    check_rel(f[0], 1.0, "anchor", 0);
    check_rel(f[1], 0.0794030091792082, "anchor", 1);
    check_rel(f[2], 0.004700753866357992, "anchor", 2);
    check_rel(f[7], 1.2891731721515574e-06, "anchor", 7);

    /* Llama 3.1 8B: head_dim 128, orig 8192 */
    check_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192.0, &nh, &nm, &nl);
    CU_ASSERT(nh > 0 && nm > 0 && nl > 0);
    CU_ASSERT_EQUAL(nh + nm + nl, 64);
    double g[64];
    s.original_max_pos = 8192.0;
    kf_rope_inv_freq(&s, 128, g);
    check_rel(g[20], 0.016560440080994446, "anchor", 20);
    check_rel(g[30], 0.0013718935677611381, "anchor", 30);
    check_rel(g[35], 9.556212353964683e-05, "anchor", 35);
    check_rel(g[63], 3.068925988914511e-07, "anchor", 63);

    /* Llama 3.2 style: factor 32 */
    check_llama3(64, 500000.0, 32.0, 1.0, 4.0, 8192.0, &nh, &nm, &nl);
    CU_ASSERT(nh > 0 && nm > 0 && nl > 0);
}

/* The config's rope fields flow into kf_rope_spec unchanged (as compactor/model.c does). */
static void test_rope_from_config(void) {
    kf_hfconfig c;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_hfconfig_load(&c, kf_test_data("hf-llama3-tiny-random/config.json"), &err), KF_OK);
    CU_ASSERT_EQUAL((int)KF_ROPE_TYPE_DEFAULT, (int)KF_ROPE_DEFAULT);
    CU_ASSERT_EQUAL((int)KF_ROPE_TYPE_LINEAR, (int)KF_ROPE_LINEAR);
    CU_ASSERT_EQUAL((int)KF_ROPE_TYPE_LLAMA3, (int)KF_ROPE_LLAMA3);
    kf_rope_spec s = {.kind = (kf_rope_kind)c.rope.type,
                      .theta = c.rope.theta,
                      .factor = c.rope.factor,
                      .low_freq_factor = c.rope.low_freq_factor,
                      .high_freq_factor = c.rope.high_freq_factor,
                      .original_max_pos = c.rope.original_max_position};
    double f[8];
    CU_ASSERT_EQUAL_FATAL(c.head_dim, 16);
    kf_rope_inv_freq(&s, c.head_dim, f);
    check_rel(f[1], 0.0794030091792082, "config", 1);
    check_rel(f[3], 0.0009115830921521386, "config", 3);
}

static CU_TestInfo fixture_tests[] = {
    {"hf-qwen3-tiny/config.json", test_fixture_qwen3},
    {"hf-llama3-tiny-random/config.json (rope_parameters)", test_fixture_llama3},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo variant_tests[] = {
    {"legacy llama3 rope_scaling (rope_type and type)", test_legacy_llama3},
    {"linear and default rope", test_linear_and_default_rope},
    {"defaults: head_dim, kv heads, eos list, bos null", test_defaults},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo refusal_tests[] = {
    {"unknown or missing model type", test_refuse_model_type},
    {"missing required fields", test_refuse_missing_fields},
    {"wrong JSON types", test_refuse_wrong_types},
    {"out-of-range values", test_refuse_out_of_range},
    {"unsupported and malformed rope", test_refuse_rope},
    {"attention_bias, mlp_bias, sliding window, gelu", test_refuse_unsupported_features},
    {"not JSON, not an object", test_refuse_not_json},
    {"kf_hfconfig_load: files and errors", test_load_files},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo rope_tests[] = {
    {"default and linear inverse frequencies", test_rope_default_linear},
    {"llama3 inverse frequencies", test_rope_llama3},
    {"config to rope spec", test_rope_from_config},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"fixtures", NULL, NULL, NULL, NULL, fixture_tests},
    {"variants", NULL, NULL, NULL, NULL, variant_tests},
    {"refusals", NULL, NULL, NULL, NULL, refusal_tests},
    {"rope", NULL, NULL, NULL, NULL, rope_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) {
    return kf_test_main(suites);
}
