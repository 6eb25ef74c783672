/* kvfold logits — run the model over token ids and print the most likely next tokens. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/compact_options.h"

#define CMD "logits"

typedef struct {
    const char *model_dir, *ids_text, *device;
    int top, chunk, format; /* format: 0 text, 1 json */
    kf_quoka_params prefill;
} logits_opts;

#define L(field) OFF(logits_opts, field)
static const cli_opt kRows[] = {
    {"model", 0, OPT_STR, "DIR", L(model_dir), .help = "Hugging Face model directory (qwen3 or llama)"},
    {"ids", 0, OPT_STR, "LIST", L(ids_text),
     .help = "token ids separated by commas or spaces; '-' reads them from stdin (at most the model's "
             "max_position_embeddings: longer is a usage error, exit 2)"},
    {"top", 0, OPT_INT, "K", L(top), .lo = 1, .hi = 1 << 20, .must = "must be a positive integer", .def = "5",
     .help = "how many tokens to show"},
    {"chunk", 0, OPT_INT, "N", L(chunk), .lo = 1, .hi = 1 << 20, .must = "must be a positive integer",
     .def = "512", .help = "prefill chunk size in tokens"},
    {"format", 0, OPT_CHOICE, "text|json", L(format), .choices = "text|json", .def = "text",
     .help = "text (a table) or json (one JSON object)"},
    {"json", 0, OPT_ALIAS, .target = "format", .fixed = "json"},
    {"device", 0, OPT_STR, "DEV", L(device), .def = "cpu",
     .help = "cpu, cuda or cuda:N (builds with the CUDA backend)"},
    {0}};

static const cli_group kGroups[] = {
    {NULL, kRows, 0},
    {"Prefill attention", cli_prefill_rows, L(prefill)},
    {0}};

const cli_command cli_logits_command = {
    .name = CMD,
    .usage = "kvfold logits --model DIR --ids 1,2,3 [--top K] [--chunk N] [--format text|json]\n"
             "                     [--device DEV] [--prefill dense|quoka]\n",
    .about = "Prefill the token ids (chunked, through the paged KV arena) and print the K most likely\n"
             "next tokens after the last one, with logits and probabilities.\n",
    .groups = kGroups,
    .exit_status = "  0  printed\n"
                   "  1  the model cannot be loaded or the forward failed\n"
                   "  2  usage errors (bad ids, more tokens than the model's positions)\n",
    .example = "  kvfold logits --model records-qwen3 --ids 1,2,3 --top 3 --format json\n",
};

static int logits_parse(int argc, char **argv, logits_opts *o) {
    *o = (logits_opts){.top = 5, .prefill = cli_prefill_defaults()};
    int first;
    const int rc = cli_opts_parse(&cli_logits_command, argc, argv, o, &first);
    if (rc != CLI_CONTINUE)
        return rc;
    if (first != argc)
        return cli_usage_error(CMD, "unexpected argument '%s'", argv[first]);
    if (!o->model_dir || !o->ids_text)
        return cli_usage_error(CMD, "--model and --ids are required");
    return CLI_CONTINUE;
}

/* The K largest of logits [V], in order, into best [K] (K is small: repeated selection). */
static int top_k(const float *logits, int V, int K, int *best) {
    char *taken = calloc((size_t)V, 1);
    if (!taken)
        return -1;
    for (int k = 0; k < K; k++) {
        int arg = -1;
        for (int i = 0; i < V; i++)
            if (!taken[i] && (arg < 0 || logits[i] > logits[arg]))
                arg = i;
        best[k] = arg;
        taken[arg] = 1;
    }
    free(taken);
    return 0;
}

static void print_top(const float *logits, int V, const int *best, int top, int n, int json) {
    double mx = -INFINITY, sum = 0; /* a log-sum-exp for the probabilities */
    for (int i = 0; i < V; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (int i = 0; i < V; i++)
        sum += exp(logits[i] - mx);
    const double lse = mx + log(sum);
    if (json) {
        printf("{\"position\": %d, \"n_tokens\": %d, \"top\": [", n - 1, n);
        for (int k = 0; k < top; k++)
            printf("%s{\"id\": %d, \"logit\": %.6f, \"prob\": %.6g}", k ? ", " : "", best[k], logits[best[k]],
                   exp(logits[best[k]] - lse));
        printf("]}\n");
    } else {
        printf("%d tokens; next-token prediction after position %d:\n", n, n - 1);
        printf("  rank       id        logit      prob\n");
        for (int k = 0; k < top; k++)
            printf("  %4d %8d %12.4f %9.4f\n", k + 1, best[k], logits[best[k]], exp(logits[best[k]] - lse));
    }
}

int cmd_logits(int argc, char **argv) {
    logits_opts o;
    const int prc = logits_parse(argc, argv, &o);
    if (prc != CLI_CONTINUE)
        return prc;
    const char *ids_text = o.ids_text;
    int top = o.top;
    char *stdin_text = NULL;
    if (strcmp(ids_text, "-") == 0) {
        size_t len;
        stdin_text = cli_read_all(stdin, &len);
        if (!stdin_text) {
            cli_error(CMD, "cannot read ids from stdin");
            return KF_EXIT_FAIL;
        }
        ids_text = stdin_text;
    }
    int32_t *ids;
    int n;
    char msg[128];
    int bad = cli_parse_ids(ids_text, &ids, &n, msg, sizeof msg);
    free(stdin_text);
    if (bad)
        return cli_usage_error(CMD, "--ids: %s", msg);

    kf_backend *b;
    kf_model *m = cli_load_model_on(CMD, o.model_dir, o.device, &b);
    if (!m) {
        free(ids);
        return KF_EXIT_FAIL;
    }
    const int V = kf_model_config(m)->vocab_size, max_pos = kf_model_config(m)->max_position_embeddings;
    if (max_pos > 0 && n > max_pos) { /* RoPE past the trained positions: outputs that mean nothing */
        free(ids);
        kf_model_free(m);
        b->destroy(b);
        return cli_usage_error(CMD, "--ids: %d tokens run past the model's %d positions (max_position_embeddings)",
                               n, max_pos);
    }
    if (top > V)
        top = V;
    int rc = KF_EXIT_FAIL;
    kf_arena arena;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    float *logits = malloc(sizeof(float) * (size_t)V);
    int32_t last = n - 1;
    if (!logits) {
        cli_error(CMD, "out of memory");
        goto out_model;
    }
    if (kf_model_arena(m, &arena, n, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
        goto out_model;
    }
    kf_forward_args fa = {.ids = ids, .n_tokens = n, .chunk = o.chunk, .logit_rows = &last, .n_logit_rows = 1,
                          .logits = logits, .quoka = cli_prefill_params(&o.prefill)};
    if (kf_model_forward(m, &arena, &seq, &fa, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
        goto out_arena;
    }
    int *best = malloc(sizeof(int) * (size_t)top); /* [top] */
    if (!best || top_k(logits, V, top, best)) {
        free(best);
        cli_error(CMD, "out of memory");
        goto out_arena;
    }
    print_top(logits, V, best, top, n, o.format == 1);
    free(best);
    rc = KF_EXIT_OK;
out_arena:
    kf_seq_release(&arena, &seq);
    kf_arena_free(&arena);
out_model:
    free(logits);
    free(ids);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}
