/* kvfold — the command line. One subcommand per file (tools/cmd_*.c). */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "kernels/cpu/solve_ops.h"
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
    {"chat-template", "render a conversation with the model's chat template (as apply_chat_template)", cmd_chat_template},
    {"eval", "measure compaction quality against the full context (eval quality)", cmd_eval},
    {"bench", "benchmarks (prefill, attention, quoka, compact, kvf, tokenize)", cmd_bench},
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
        fprintf(out, "  %-14s %s\n", kCommands[i].name, kCommands[i].summary);
    fprintf(out,
            "\n"
            "Run 'kvfold <command> --help' for a command's options. Options are spelled the same in every\n"
            "command (--method, --budget, --format, --quoka-*); old spellings still work for one release and\n"
            "print a note naming the new one.\n"
            "Models are Hugging Face directories (config.json + model.safetensors) of type qwen3 or llama.\n"
            "\n"
            "Environment:\n"
            "  OMP_NUM_THREADS, OPENBLAS_NUM_THREADS  threads (default: all cores)\n"
            "  KVFOLD_THREADS           threads of the CPU backend (default: OpenBLAS's); no result\n"
            "                           depends on the number of threads\n"
            "  OPENBLAS_THREAD_TIMEOUT  how long OpenBLAS's idle threads spin, 2^N cycles; kvfold sets 4\n"
            "                           (the shortest) when it is unset, and runs itself again to apply it\n"
            "  OPENBLAS_CORETYPE        OpenBLAS's kernels; when unset and OpenBLAS falls back to its SSE3\n"
            "                           ones (Prescott) on an AVX-512 CPU, kvfold sets SkylakeX and runs\n"
            "                           itself again (3-5x faster GEMMs, the same bytes for any thread count);\n"
            "                           set it to keep another choice ('kvfold --version' shows the kernels)\n"
            "\n"
            "Exit status:\n"
            "  0  success; 1  a failure the message names; 2  usage errors\n"
            "\n"
            "Example:\n"
            "  kvfold compact --model Qwen3-0.6B --budget 0.1 report.txt\n"
            "  kvfold ask kvf-cache/<fingerprint>/<digest>.fold-0.1.<recipe>.kvf --model Qwen3-0.6B 'Who?'\n");
}

/* OpenBLAS's worker threads spin after each BLAS call for 2^OPENBLAS_THREAD_TIMEOUT cycles
 * (default 2^28) before they sleep; on a machine with few cores they take those cycles from
 * kvfold's own threads (the attention's and the solve's pools run between BLAS calls): bench
 * compact at 2k tokens ran 5-9% faster with the shortest spin (4, OpenBLAS's minimum). Nothing to
 * do without worker threads (one thread, or the OpenMP build). 1 when the variable was set.
 * Why: docs/decisions/openblas-spin.md. */
static int openblas_short_spin(void) {
    if (getenv("OPENBLAS_THREAD_TIMEOUT") || getenv("GOTO_THREAD_TIMEOUT"))
        return 0;
    if (openblas_get_parallel() != OPENBLAS_THREAD || openblas_get_num_threads() < 2)
        return 0;
    return setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1) == 0;
}

/* The kernels for this CPU when OpenBLAS fell back to its oldest x86-64 ones: "Prescott" (SSE3) is
 * what a DYNAMIC_ARCH build picks for a CPU newer than itself (Debian bookworm's 0.3.21 on AVX-512
 * Zen 4 and recent Xeons), and its GEMMs run 3-5x slower than the AVX-512 ones. Only SkylakeX: the
 * CPU backend keeps a row's bits independent of the thread count under those kernels and the
 * default ones (kernels/cpu/matmul.c), not under Haswell's. NULL: keep OpenBLAS's choice. */
static const char *openblas_better_core(void) {
    const char *core = openblas_get_corename();
    if (!core || strcasecmp(core, "prescott") != 0)
        return NULL;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return "SkylakeX";
#endif
    return NULL;
}

/* OpenBLAS reads OPENBLAS_CORETYPE and OPENBLAS_THREAD_TIMEOUT once, when the library is loaded
 * (before main), and has no setter: so the CLI sets what it wants and runs itself again, once. A
 * variable set is the marker: a value of the user's own wins (OPENBLAS_CORETYPE=Prescott keeps the
 * library's choice), and when the re-exec fails the command goes on with OpenBLAS's defaults.
 * Why: docs/decisions/openblas-spin.md, docs/decisions/openblas-kernels.md. */
static void openblas_tune(char **argv) {
    int changed = 0;
    const char *core = getenv("OPENBLAS_CORETYPE") ? NULL : openblas_better_core();
    if (core && setenv("OPENBLAS_CORETYPE", core, 1) == 0)
        changed = 1;
    changed |= openblas_short_spin();
    if (!changed)
        return;
    fflush(NULL);
    execv("/proc/self/exe", argv); /* returns only on failure: go on as we are */
}

int main(int argc, char **argv) {
    openblas_tune(argv);
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
        printf("blas: OpenBLAS, %s kernels, %d threads\n", openblas_get_corename(), openblas_get_num_threads());
        printf("solve: the values' normal equations through %s\n",
               kf_cpu_gram_bf16_fast() ? "AVX-512 BF16" : "ssyrk and sgemm");
        return KF_EXIT_OK;
    }
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(argv[1], kCommands[i].name) == 0)
            return kCommands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "kvfold: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return KF_EXIT_USAGE;
}
