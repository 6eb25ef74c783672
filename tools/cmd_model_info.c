/* kvfold model-info DIR — what a model directory holds, without running it. */
#include <stdio.h>
#include <string.h>

#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/commands.h"

typedef struct {
    int no_fingerprint;
} info_opts;

static const cli_opt kRows[] = {
    {"no-fingerprint", 0, OPT_FLAG, NULL, OFF(info_opts, no_fingerprint),
     .help = "skip hashing the weights (faster on large models)"},
    {0}};

const cli_command cli_model_info_command = {
    .name = "model-info",
    .usage = "kvfold model-info [--no-fingerprint] DIR\n",
    .about = "Load a Hugging Face model directory (config.json and model.safetensors, or a sharded\n"
             "model.safetensors.index.json), check every tensor, and print the architecture, sizes,\n"
             "RoPE parameters, parameter count, KV bytes per token and the model fingerprint (a digest\n"
             "of the configuration, the tensor index and every weight byte; cache files record it).\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .exit_status = "  0  the model loaded and every tensor checked\n"
                   "  1  the directory cannot be loaded (the message names the file and the cause)\n"
                   "  2  usage errors\n",
    .example = "  kvfold model-info Qwen3-0.6B\n",
};

int cmd_model_info(int argc, char **argv) {
    info_opts o = {0};
    int first;
    const int rc = cli_opts_parse(&cli_model_info_command, argc, argv, &o, &first);
    if (rc != CLI_CONTINUE)
        return rc;
    if (first != argc - 1)
        return cli_usage_error("model-info", "expected one model directory");
    kf_backend *b;
    kf_model *m = cli_load_model("model-info", argv[first], &b);
    if (!m)
        return KF_EXIT_FAIL;
    const kf_hfconfig *c = kf_model_config(m);
    printf("model        %s\n", KF_ESC(kf_model_dir(m)));
    printf("type         %s\n", c->model_type);
    printf("layers       %d\n", c->n_layers);
    printf("hidden       %d (intermediate %d)\n", c->hidden_size, c->intermediate_size);
    printf("heads        %d query, %d kv (GQA %d:1), head_dim %d\n", c->n_heads, c->n_kv_heads,
           c->n_heads / c->n_kv_heads, c->head_dim);
    printf("vocab        %d%s\n", c->vocab_size, c->tie_word_embeddings ? " (tied embeddings)" : "");
    printf("rms_eps      %g\n", c->rms_eps);
    printf("rope         %s theta %g", kf_rope_type_name(c->rope.type), c->rope.theta);
    if (c->rope.type == KF_ROPE_TYPE_LINEAR)
        printf(" factor %g", c->rope.factor);
    else if (c->rope.type == KF_ROPE_TYPE_LLAMA3)
        printf(" factor %g low %g high %g original_max %g", c->rope.factor, c->rope.low_freq_factor,
               c->rope.high_freq_factor, c->rope.original_max_position);
    printf("\n");
    printf("max position %d\n", c->max_position_embeddings);
    printf("dtype        %s\n", c->dtype[0] ? c->dtype : "(unspecified)");
    printf("parameters   %lld\n", (long long)kf_model_n_params(m));
    printf("kv bytes     %lld per token (fp32 arena), %lld in bf16\n",
           (long long)c->n_layers * 2 * c->n_kv_heads * c->head_dim * 4,
           (long long)c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2);
    printf("bos/eos      %d /", c->bos_token_id);
    for (int i = 0; i < c->n_eos; i++)
        printf(" %d", c->eos_token_ids[i]);
    printf("\n");
    if (!o.no_fingerprint)
        printf("fingerprint  %s\n", kf_model_fingerprint(m));
    kf_model_free(m);
    b->destroy(b);
    return KF_EXIT_OK;
}
