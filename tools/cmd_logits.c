/* kvfold logits — run the model over token ids and print the most likely next tokens. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"
#include "tools/commands.h"

static const char kHelp[] =
    "Usage: kvfold logits --model DIR --ids 1,2,3 [--top K] [--chunk N] [--json] [--prefill dense|quoka]\n"
    "\n"
    "Prefill the token ids (chunked, through the paged KV arena) and print the K most likely\n"
    "next tokens after the last one, with logits and probabilities.\n"
    "\n"
    "Options:\n"
    "  --model DIR   Hugging Face model directory (qwen3 or llama)\n"
    "  --ids LIST    token ids separated by commas or spaces; '-' reads them from stdin (at most\n"
    "                the model's max_position_embeddings: longer is a usage error, exit 2)\n"
    "  --top K       how many tokens to show (default 5)\n"
    "  --chunk N     prefill chunk size in tokens (default 512)\n"
    "  --json        print one JSON object instead of a table\n"
    CLI_DEVICE_HELP
    "  -h, --help    show this help\n"
    "\n"
    "Prefill attention:\n" CLI_PREFILL_HELP;

static char *read_stdin(void) {
    size_t len = 0, cap = 4096;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    for (size_t got; (got = fread(buf + len, 1, cap - len - 1, stdin)) > 0;) {
        len += got;
        if (cap - len - 1 == 0) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    buf[len] = 0;
    return buf;
}

int cmd_logits(int argc, char **argv) {
    static const struct option opts[] = {{"help", no_argument, 0, 'h'},      {"model", required_argument, 0, 'm'},
                                         {"ids", required_argument, 0, 'i'}, {"top", required_argument, 0, 't'},
                                         {"chunk", required_argument, 0, 'c'}, {"json", no_argument, 0, 'j'},
                                         {"device", required_argument, 0, 'd'}, CLI_PREFILL_OPTIONS,
                                         {0, 0, 0, 0}};
    const char *model_dir = NULL, *ids_text = NULL, *device = NULL;
    long long top = 5, chunk = 0;
    int json = 0;
    kf_quoka_params prefill = cli_prefill_defaults();
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (c) {
        case 'h': fputs(kHelp, stdout); return KF_EXIT_OK;
        case 'd': device = optarg; break;
        case 'm': model_dir = optarg; break;
        case 'i': ids_text = optarg; break;
        case 'j': json = 1; break;
        case 't':
            if (cli_parse_int(optarg, 1, 1 << 20, &top))
                return cli_usage_error("logits", "--top must be a positive integer, not '%s'", optarg);
            break;
        case 'c':
            if (cli_parse_int(optarg, 1, 1 << 20, &chunk))
                return cli_usage_error("logits", "--chunk must be a positive integer, not '%s'", optarg);
            break;
        default: {
            const int r = cli_prefill_option("logits", c, optarg, &prefill);
            if (r < 0)
                return KF_EXIT_USAGE;
            if (r == 0)
                return cli_usage_error("logits", "bad option");
        }
        }
    }
    if (optind != argc)
        return cli_usage_error("logits", "unexpected argument '%s'", argv[optind]);
    if (!model_dir || !ids_text)
        return cli_usage_error("logits", "--model and --ids are required");

    char *stdin_text = NULL;
    if (strcmp(ids_text, "-") == 0) {
        stdin_text = read_stdin();
        if (!stdin_text) {
            cli_error("logits", "cannot read ids from stdin");
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
        return cli_usage_error("logits", "--ids: %s", msg);

    kf_backend *b;
    kf_model *m = cli_load_model_on("logits", model_dir, device, &b);
    if (!m) {
        free(ids);
        return KF_EXIT_FAIL;
    }
    const int V = kf_model_config(m)->vocab_size, max_pos = kf_model_config(m)->max_position_embeddings;
    if (max_pos > 0 && n > max_pos) { /* RoPE past the trained positions: outputs that mean nothing */
        free(ids);
        kf_model_free(m);
        b->destroy(b);
        return cli_usage_error("logits", "--ids: %d tokens run past the model's %d positions (max_position_embeddings)",
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
        cli_error("logits", "out of memory");
        goto out_model;
    }
    if (kf_model_arena(m, &arena, n, &err) != KF_OK) {
        cli_error("logits", "%s", err.msg);
        goto out_model;
    }
    kf_forward_args fa = {.ids = ids, .n_tokens = n, .chunk = (int)chunk, .logit_rows = &last, .n_logit_rows = 1,
                          .logits = logits, .quoka = cli_prefill_params(&prefill)};
    if (kf_model_forward(m, &arena, &seq, &fa, &err) != KF_OK) {
        cli_error("logits", "%s", err.msg);
        goto out_arena;
    }
    /* top-K by repeated selection (K is small) and a log-sum-exp for probabilities */
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (int i = 0; i < V; i++)
        sum += exp(logits[i] - mx);
    const double lse = mx + log(sum);
    int *best = malloc(sizeof(int) * (size_t)top);
    char *taken = calloc((size_t)V, 1);
    if (!best || !taken) {
        free(best);
        free(taken);
        cli_error("logits", "out of memory");
        goto out_arena;
    }
    for (int k = 0; k < top; k++) {
        int arg = -1;
        for (int i = 0; i < V; i++)
            if (!taken[i] && (arg < 0 || logits[i] > logits[arg]))
                arg = i;
        best[k] = arg;
        taken[arg] = 1;
    }
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
    free(best);
    free(taken);
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
