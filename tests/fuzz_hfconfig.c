/* fuzz_hfconfig — libFuzzer target for the config.json parser (formats/hfconfig.c).
 *
 *   cmake --build build-fuzz --target fuzz_hfconfig    (configured as for fuzz_tokenizer)
 *   tests/fuzz_seeds.py build-fuzz/seeds
 *   build-fuzz/tests/fuzz_hfconfig -max_total_time=30 -max_len=4096 CORPUS build-fuzz/seeds/hfconfig
 *
 * Besides "no crash, no sanitizer report": a refusal carries a message naming the file; an accepted
 * config keeps the promises a model load relies on: dimensions within the parser's bounds, heads a
 * multiple of KV heads, an even head_dim, a finite positive rms_norm_eps, NUL-terminated strings, at
 * most KF_MAX_EOS EOS ids, and RoPE parameters whose inverse frequencies are finite and positive.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/hfconfig.h"
#include "kernels/backend.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail(const char *what, const kf_hfconfig *c) {
    fprintf(stderr, "fuzz_hfconfig: accepted a config with %s (model_type %.32s)\n", what, c->model_type);
    abort();
}

static void check_config(const kf_hfconfig *c) {
    if (!memchr(c->model_type, 0, sizeof c->model_type) || !memchr(c->dtype, 0, sizeof c->dtype))
        fail("an unterminated string", c);
    if (strcmp(c->model_type, "qwen3") != 0 && strcmp(c->model_type, "llama") != 0)
        fail("an unsupported model_type", c);
    if (c->vocab_size < 1 || c->hidden_size < 1 || c->intermediate_size < 1 || c->n_layers < 1 || c->n_heads < 1 ||
        c->n_kv_heads < 1 || c->max_position_embeddings < 0)
        fail("a non-positive dimension", c);
    if (c->n_heads % c->n_kv_heads != 0)
        fail("heads not a multiple of KV heads", c);
    if (c->head_dim < 2 || c->head_dim % 2 != 0 || c->head_dim > 4096)
        fail("a bad head_dim", c);
    if (!(c->rms_eps > 0) || !isfinite(c->rms_eps))
        fail("a bad rms_norm_eps", c);
    if (c->n_eos < 0 || c->n_eos > KF_MAX_EOS)
        fail("too many EOS ids", c);
    if (!(c->rope.theta > 0) || !isfinite(c->rope.theta) || !(c->rope.factor > 0) || !isfinite(c->rope.factor))
        fail("a bad rope_theta or factor", c);
    kf_rope_spec spec = {.kind = (kf_rope_kind)c->rope.type, .theta = c->rope.theta, .factor = c->rope.factor,
                         .low_freq_factor = c->rope.low_freq_factor, .high_freq_factor = c->rope.high_freq_factor,
                         .original_max_pos = c->rope.original_max_position};
    double *f = malloc(sizeof(double) * (size_t)(c->head_dim / 2)); /* [head_dim / 2] */
    kf_rope_inv_freq(&spec, c->head_dim, f);
    for (int i = 0; i < c->head_dim / 2; i++)
        if (!(f[i] > 0) || !isfinite(f[i])) {
            fprintf(stderr, "inv_freq[%d] = %g\n", i, f[i]);
            fail("RoPE inverse frequencies that are not finite and positive", c);
        }
    free(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kf_hfconfig c;
    kf_error err = {0};
    const kf_status st = kf_hfconfig_parse(&c, (const char *)data, size, "fuzz/config.json", &err);
    if (st != KF_OK) {
        if (!strstr(err.msg, "fuzz/config.json")) {
            fprintf(stderr, "fuzz_hfconfig: refusal %d does not name the file: %s\n", st, err.msg);
            abort();
        }
        return 0;
    }
    check_config(&c);
    return 0;
}
