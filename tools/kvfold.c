/* kvfold — the command line. One subcommand per file (tools/cmd_*.c). */
#include <stdio.h>
#include <string.h>

#include "tools/cli.h"
#include "tools/commands.h"

typedef struct {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv);
} command;

static const command kCommands[] = {
    {"model-info", "show a model directory's configuration, size and fingerprint", cmd_model_info},
    {"logits", "run the model over token ids and show the top next tokens", cmd_logits},
    {"compact", "compact documents into kvf cache files (the offline job; --manifest, --shard)", cmd_compact},
    {"inspect", "show a kvf cache file: header, sizes, per-layer and per-head statistics", cmd_inspect},
    {"verify", "check a kvf cache file: checksums, model fingerprint, KL against the full context", cmd_verify},
    {"ask", "answer a question from a kvf cache file (greedy, through the paged engine)", cmd_ask},
    {"tokenize", "encode text to token ids (or decode ids) with the model's tokenizer", cmd_tokenize},
    {"eval", "measure compaction quality against the full context (eval quality)", cmd_eval},
    {"bench", "benchmarks (prefill, attention, quoka, tokenize)", cmd_bench},
};
#define N_COMMANDS (sizeof kCommands / sizeof kCommands[0])

static void usage(FILE *out) {
    fprintf(out,
            "kvfold %s — compacted KV caches for long documents\n"
            "\n"
            "Usage: kvfold <command> [options]\n"
            "\n"
            "Commands:\n",
            KVFOLD_VERSION);
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(out, "  %-12s %s\n", kCommands[i].name, kCommands[i].summary);
    fprintf(out,
            "\n"
            "Run 'kvfold <command> --help' for a command's options.\n"
            "Models are Hugging Face directories (config.json + model.safetensors) of type qwen3 or llama.\n"
            "Threads: OMP_NUM_THREADS and OPENBLAS_NUM_THREADS (default: all cores).\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return KF_EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return KF_EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("kvfold %s\n", KVFOLD_VERSION);
        return KF_EXIT_OK;
    }
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(argv[1], kCommands[i].name) == 0)
            return kCommands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "kvfold: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return KF_EXIT_USAGE;
}
