/* cli.h — shared helpers of the kvfold command line: messages, argument parsing, loading. */
#ifndef KF_CLI_H
#define KF_CLI_H

#include <getopt.h>
#include <stdint.h>
#include <stdio.h>

#include "compactor/model.h"
#include "compactor/quoka.h"
#include "formats/error.h"

enum { KF_EXIT_OK = 0, KF_EXIT_FAIL = 1, KF_EXIT_USAGE = 2 };
/* A stage's result when the command goes on (the others are exit statuses). */
enum { CLI_CONTINUE = -1 };

/* NULL, or called before a message on stderr: clears a line drawn in place (tools/progress.c). */
extern void (*cli_before_message)(void);
/* "kvfold <cmd>: message" on stderr, the message escaped (formats/escape.h: control characters,
 * invalid UTF-8 and bidirectional controls made visible), so quoted ids and paths cannot forge lines. */
void cli_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints the usage error and a pointer to --help; returns KF_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Parses "1,2,3" (ids separated by one comma and/or whitespace; an empty item such as "1,,2" or a
 * comma at either end is refused). Returns 0, or -1 with a message in err. */
int cli_parse_ids(const char *text, int32_t **ids, int *n, char *err, size_t err_len);
/* Parses a positive integer option value; returns 0 or -1. */
int cli_parse_int(const char *text, long long lo, long long hi, long long *out);

/* Creates the CPU backend and loads the model; prints the error and returns NULL on failure. */
kf_model *cli_load_model(const char *cmd, const char *dir, kf_backend **backend);
/* The same on a named device: NULL or "cpu", or "cuda" / "cuda:N" (builds with the CUDA backend;
 * elsewhere an error saying so). */
kf_model *cli_load_model_on(const char *cmd, const char *dir, const char *device, kf_backend **backend);
#define CLI_DEVICE_HELP "  --device DEV  cpu (default), cuda or cuda:N (builds with the CUDA backend)\n"

/* --weights auto|bf16|fp32: how cli_load_model stores the model's weights (kf_weights; one
 * choice for the process). Append CLI_WEIGHTS_OPTION to the table, pass unknown option ids to
 * cli_weights_option (1 handled, 0 not --weights, -1 bad value: a usage error was printed). */
/* getopt_long ids of the shared options, one block each so that two never meet in one table:
 * 0x1000 prefill (below), 0x1100 compaction (cli_quality.h), 0x1200 weights, 0x1300 progress
 * (progress.h). */
enum { CLI_OPT_WEIGHTS = 0x1200 };
#define CLI_WEIGHTS_OPTION {"weights", required_argument, 0, CLI_OPT_WEIGHTS}
#define CLI_WEIGHTS_HELP                                                                               \
    "  --weights W          the weights in memory: auto (default: bf16 for a bf16 checkpoint, else\n" \
    "                       fp32), bf16 (2 bytes per parameter; the GEMMs widen them to fp32, the\n" \
    "                       activations stay fp32) or fp32 (4 bytes; CPU backend)\n"
int cli_weights_option(const char *cmd, int opt, const char *arg);
kf_weights cli_weights(void);
int cli_weights_set(const char *arg); /* 0, or -1 when arg is not auto, bf16 or fp32 */

double cli_now(void); /* monotonic seconds */

/* One option (getopt_long's id and optarg) into a command's options ctx: CLI_CONTINUE, or the exit
 * status to stop with (--help, a bad value). */
typedef int (*cli_option_fn)(void *ctx, int opt, const char *arg);
/* getopt_long over argv from the first argument, each option to fn in turn: CLI_CONTINUE once
 * all are taken (optind is then the first operand), or the first status fn returned. */
int cli_parse_options(int argc, char **argv, const char *shortopts, const struct option *opts, cli_option_fn fn,
                      void *ctx);

/* Prefill options shared by every command that prefills (logits, bench prefill, compact):
 *   --prefill dense|quoka  --quoka-nq N  --quoka-budget N|0.x  --quoka-sinks N
 * Append CLI_PREFILL_OPTIONS to the command's getopt_long table, start from
 * cli_prefill_defaults(), pass unknown option ids to cli_prefill_option, print
 * CLI_PREFILL_HELP in --help, and hand cli_prefill_params(&p) to kf_forward_args.quoka. */
enum { CLI_OPT_PREFILL = 0x1000, CLI_OPT_QUOKA_NQ, CLI_OPT_QUOKA_BUDGET, CLI_OPT_QUOKA_SINKS };
#define CLI_PREFILL_OPTIONS                                                                            \
    {"prefill", required_argument, 0, CLI_OPT_PREFILL}, {"quoka-nq", required_argument, 0, CLI_OPT_QUOKA_NQ}, \
        {"quoka-budget", required_argument, 0, CLI_OPT_QUOKA_BUDGET},                                  \
        {"quoka-sinks", required_argument, 0, CLI_OPT_QUOKA_SINKS}
#define CLI_PREFILL_HELP                                                                               \
    "  --prefill MODE       dense (default) or quoka: sparse attention over a query-chosen subset of\n" \
    "                       the history once it is longer than the budget (chunks still see all of\n"  \
    "                       their own keys; nothing is evicted)\n"                                     \
    "  --quoka-nq N         queries kept per head to choose keys (default 16)\n"                       \
    "  --quoka-budget B     history keys kept per KV head: a count (default 1024) or a fraction of\n"  \
    "                       the history such as 0.25\n"                                                \
    "  --quoka-sinks N      always keep the first N tokens (default 0)\n"

kf_quoka_params cli_prefill_defaults(void); /* dense, with QUOKA's defaults for when it is chosen */
/* 1: handled; 0: not a prefill option; -1: bad value (usage error printed). */
int cli_prefill_option(const char *cmd, int opt, const char *arg, kf_quoka_params *p);
/* NULL for dense, else p (for kf_forward_args.quoka). */
const kf_quoka_params *cli_prefill_params(const kf_quoka_params *p);

/* All of f (a pipe too) in a malloc'd, NUL-terminated buffer; *len its bytes (the NUL not
 * counted). NULL when out of memory or on a read error. */
char *cli_read_all(FILE *f, size_t *len);

#endif
