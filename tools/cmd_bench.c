/* kvfold bench — benchmark commands. They print rates; drivers in tools/ put them next to a
 * baseline measured in the same run (never timed tests). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"
#include "tools/commands.h"

static const char kBenchHelp[] =
    "Usage: kvfold bench <what> [options]\n"
    "\n"
    "  prefill    tokens/s of a chunked prefill of random token ids\n"
    "  kvf        cache file write/read GB/s against plain fwrite/fread of the same bytes\n"
    "  tokenize   encoding MB/s (tools/bench-tokenize.sh compares with the JavaScript tokenizer)\n"
    "  compact    the time of each compaction stage on a records document\n"
    "  attention  one chunk's attention over long histories: dense against QUOKA, as a ratio\n"
    "  quoka      QUOKA's accuracy against dense prefill on repeat prompts (KL, copy accuracy)\n"
    "\n"
    "Run 'kvfold bench <what> --help' for options. tools/bench-prefill.sh compares the prefill\n"
    "with a PyTorch implementation of the same model in the same run.\n";

int cmd_bench(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fputs(kBenchHelp, argc < 2 ? stderr : stdout);
        return argc < 2 ? KF_EXIT_USAGE : KF_EXIT_OK;
    }
    if (strcmp(argv[1], "prefill") == 0)
        return cmd_bench_prefill(argc - 1, argv + 1);
    if (strcmp(argv[1], "kvf") == 0)
        return cmd_bench_kvf(argc - 1, argv + 1);
    if (strcmp(argv[1], "tokenize") == 0)
        return cmd_bench_tokenize(argc - 1, argv + 1);
    if (strcmp(argv[1], "compact") == 0)
        return cmd_bench_compact(argc - 1, argv + 1);
    if (strcmp(argv[1], "attention") == 0)
        return cmd_bench_attention(argc - 1, argv + 1);
    if (strcmp(argv[1], "quoka") == 0)
        return cmd_bench_quoka(argc - 1, argv + 1);
    return cli_usage_error("bench", "unknown benchmark '%s'", argv[1]);
}

static const char kPrefillHelp[] =
    "Usage: kvfold bench prefill --model DIR --tokens N [--chunk C] [--repeat R] [--seed S]\n"
    "                            [--prefill dense|quoka] [--quoka-budget B] ...\n"
    "\n"
    "Prefill N random token ids (fixed seed) into a fresh paged arena, R times after one warm-up,\n"
    "and print the median time and tokens/s. Only the last position's logits are computed, as in\n"
    "a compaction prefill.\n"
    "\n"
    "Options:\n"
    "  --model DIR   model directory\n"
    "  --tokens N    prompt length (default 512)\n"
    "  --chunk C     chunk size (default 512)\n"
    "  --repeat R    timed runs (default 3)\n"
    "  --seed S      seed of the token ids (default 1)\n"
    CLI_DEVICE_HELP
    "  -h, --help    show this help\n"
    "\n"
    "Prefill attention:\n" CLI_PREFILL_HELP
    "\n"
    "Last line: 'tokens_per_s <value>' for scripts. tools/bench-quoka.sh compares dense and QUOKA\n"
    "prefill in the same run.\n";

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int cmd_bench_prefill(int argc, char **argv) {
    static const struct option opts[] = {{"help", no_argument, 0, 'h'},        {"model", required_argument, 0, 'm'},
                                         {"tokens", required_argument, 0, 'n'}, {"chunk", required_argument, 0, 'c'},
                                         {"repeat", required_argument, 0, 'r'}, {"seed", required_argument, 0, 's'},
                                         {"device", required_argument, 0, 'd'}, CLI_PREFILL_OPTIONS,
                                         {0, 0, 0, 0}};
    const char *dir = NULL, *device = NULL;
    long long n = 512, chunk = 0, repeat = 3, seed = 1;
    kf_quoka_params prefill = cli_prefill_defaults();
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        long long *dst = NULL;
        switch (c) {
        case 'h': fputs(kPrefillHelp, stdout); return KF_EXIT_OK;
        case 'm': dir = optarg; continue;
        case 'd': device = optarg; continue;
        case 'n': dst = &n; break;
        case 'c': dst = &chunk; break;
        case 'r': dst = &repeat; break;
        case 's': dst = &seed; break;
        default: {
            const int r = cli_prefill_option("bench prefill", c, optarg, &prefill);
            if (r < 0)
                return KF_EXIT_USAGE;
            if (r == 0)
                return cli_usage_error("bench prefill", "bad option");
            continue;
        }
        }
        if (cli_parse_int(optarg, 1, 1 << 24, dst))
            return cli_usage_error("bench prefill", "option value '%s' must be a positive integer", optarg);
    }
    if (!dir || optind != argc)
        return cli_usage_error("bench prefill", "--model is required");
    kf_backend *b;
    kf_model *m = cli_load_model_on("bench prefill", dir, device, &b);
    if (!m)
        return KF_EXIT_FAIL;
    const int V = kf_model_config(m)->vocab_size;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    float *logits = malloc(sizeof(float) * (size_t)V);
    double *times = malloc(sizeof(double) * (size_t)(repeat + 1));
    int rc = KF_EXIT_FAIL;
    kf_arena arena;
    kf_error err = {0};
    if (!ids || !logits || !times) {
        cli_error("bench prefill", "out of memory");
        goto out;
    }
    unsigned long long state = (unsigned long long)seed * 6364136223846793005ULL + 1442695040888963407ULL;
    for (long long i = 0; i < n; i++) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = (int32_t)((state >> 33) % (unsigned long long)V);
    }
    if (kf_model_arena(m, &arena, n, &err) != KF_OK) {
        cli_error("bench prefill", "%s", err.msg);
        goto out;
    }
    int32_t last = (int32_t)n - 1;
    for (long long r = 0; r <= repeat; r++) {
        kf_seq seq;
        kf_seq_init(&seq);
        kf_forward_args fa = {.ids = ids, .n_tokens = (int)n, .chunk = (int)chunk, .logit_rows = &last,
                              .n_logit_rows = 1, .logits = logits, .quoka = cli_prefill_params(&prefill)};
        double t0 = cli_now();
        kf_status st = kf_model_forward(m, &arena, &seq, &fa, &err);
        times[r] = cli_now() - t0;
        kf_seq_release(&arena, &seq);
        if (st != KF_OK) {
            cli_error("bench prefill", "%s", err.msg);
            kf_arena_free(&arena);
            goto out;
        }
        if (r > 0)
            fprintf(stderr, "  run %lld: %.4f s\n", r, times[r]);
    }
    kf_arena_free(&arena);
    qsort(times + 1, (size_t)repeat, sizeof(double), cmp_double);
    const double med = times[1 + repeat / 2];
    char desc[160];
    printf("prefill %lld tokens (chunk %lld, %s): median %.4f s over %lld runs\n", n,
           chunk ? chunk : KF_DEFAULT_CHUNK, kf_quoka_describe(cli_prefill_params(&prefill), desc, sizeof desc), med,
           repeat);
    printf("tokens_per_s %.1f\n", (double)n / med);
    rc = KF_EXIT_OK;
out:
    free(ids);
    free(logits);
    free(times);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}
