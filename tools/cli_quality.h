/* cli_quality.h — the compaction's options shared by `compact`, `eval quality` and `bench compact`.
 *
 * A command keeps a cli_compact_opts (cli_compact_opts_init), appends CLI_COMPACT_OPTIONS (or
 * the single rows it takes) to its getopt_long table, ends its option switch with
 * `default: return cli_compact_option_or(...)`, prints CLI_QUALITY_HELP (and the others' help) in
 * --help, and compacts with cli_compact_params(). A new compaction flag is one row in
 * CLI_QUALITY_OPTIONS or CLI_COMPACT_OPTIONS, one case in cli_quality_option or
 * cli_compact_option, and its help line: every command that lists the row takes it.
 */
#ifndef KF_CLI_QUALITY_H
#define KF_CLI_QUALITY_H

#include "compactor/compact.h"
#include "tools/cli.h"

enum { CLI_OPT_HEAD_CHOICE = 0x1100, CLI_OPT_VALUE_RIDGE, CLI_OPT_RIDGE_TO, CLI_OPT_BETA_FIT, CLI_OPT_VAL_FRAC, CLI_OPT_REFIT, CLI_OPT_MARGIN, CLI_OPT_REFQ_DTYPE,
       CLI_OPT_ARENA_DTYPE, CLI_OPT_REPEAT_FRACTION, CLI_OPT_REPEAT_SPANS, CLI_OPT_QUERIES, CLI_OPT_LAMBDA,
       CLI_OPT_MAX_QUERIES, CLI_OPT_CHUNK };
/* The reference queries' sources (also in `bench compact`, which has no other quality option). */
#define CLI_REFQ_SOURCE_OPTIONS                                                                              \
    {"repeat-fraction", required_argument, 0, CLI_OPT_REPEAT_FRACTION},                                      \
        {"repeat-spans", required_argument, 0, CLI_OPT_REPEAT_SPANS}, {"queries", required_argument, 0, CLI_OPT_QUERIES}
#define CLI_REFQ_SOURCE_HELP                                                                                 \
    "  --queries S          the reference queries' source: repeat (the document repeated after the\n"     \
    "                       instruction; default), context (the document's own queries from its\n"       \
    "                       prefill, no repeat: cheapest, all of them held for every layer; no rows\n"   \
    "                       are held out, so no per-head choice: every head uses the method) or both\n" \
    "                       (probes, when given, are added to each)\n"                                    \
    "  --repeat-fraction F  the repeat covers a share F in (0, 1] of the document (default 1): F below\n"  \
    "                       1 takes --repeat-spans runs of the document, one per equal stratum, at\n"     \
    "                       offsets drawn from the seed, each after the instruction (its cost scales\n"   \
    "                       about with F, but it loses facts outside the spans: docs/performance.md)\n" \
    "  --repeat-spans K     how many runs a partial repeat takes, 1 to 64 (default 4)\n"
#define CLI_QUALITY_OPTIONS                                                                                   \
    {"head-choice", required_argument, 0, CLI_OPT_HEAD_CHOICE},                                              \
        {"value-ridge", required_argument, 0, CLI_OPT_VALUE_RIDGE},                                          \
        {"ridge-to", required_argument, 0, CLI_OPT_RIDGE_TO}, {"beta-fit", required_argument, 0, CLI_OPT_BETA_FIT}, \
        {"val-frac", required_argument, 0, CLI_OPT_VAL_FRAC}, {"refit", required_argument, 0, CLI_OPT_REFIT},         \
        {"choice-margin", required_argument, 0, CLI_OPT_MARGIN}, {"refq-dtype", required_argument, 0, CLI_OPT_REFQ_DTYPE}, \
        {"arena-dtype", required_argument, 0, CLI_OPT_ARENA_DTYPE}, \
        CLI_REFQ_SOURCE_OPTIONS
#define CLI_QUALITY_HELP                                                                                      \
    "  --head-choice on|off per (layer, KV head) choose the method, drop or keep (and the fold's\n"           \
    "                       lambda and the refit's Tikhonov alpha from small grids) by output error\n"      \
    "                       on a held-out split of the reference queries (default: on for am, fold)\n"         \
    "  --value-ridge A      Tikhonov alpha of the value refits without per-head choice:\n"                 \
    "                       mu = A * tr(X^T X) / t (default 0: plain least squares)\n"                     \
    "  --ridge-to T         orig (the kept keys' original values, default) or zero\n"                      \
    "  --beta-fit F         am (least squares, clamp, two projected-gradient steps; default) or box\n"    \
    "                       (the same start driven to convergence inside [e^-3, e^3])\n"                   \
    "  --val-frac F         share of the reference positions held out for the choice (default 0.2)\n"   \
    "  --refit all|train    after the choice, refit the winner on all the queries (default) or keep\n"   \
    "                       the fit on the training rows that was validated\n"                         \
    "  --choice-margin M    am or fold is chosen for a head only when its validation error is\n"       \
    "                       below drop's and keep's by the factor 1 + M (default 0.5)\n"            \
    "  --refq-dtype f32|bf16 reference queries stored in fp32 (default) or bf16 (half their memory;\n"   \
    "                       the solve widens each head's rows back to fp32)\n"                        \
    CLI_ARENA_DTYPE_HELP CLI_REFQ_SOURCE_HELP CLI_WEIGHTS_HELP
/* --arena-dtype's help (also bench compact's) */
#define CLI_ARENA_DTYPE_HELP                                                                                  \
    "  --arena-dtype f32|bf16 the paged KV arena of the compaction (the context's K/V, the sources')\n"      \
    "                       in fp32 (default) or bf16 (half its memory; K/V rounded to bf16 as the\n"     \
    "                       prefill stores them, widened to fp32 by the attention; CPU backend only)\n"

/* 1: handled (p updated), 0: not a quality option, -1: bad value (a usage error was printed). */
int cli_quality_option(const char *cmd, int opt, const char *arg, kf_compact_params *p);

/* Single rows for the commands that take some of the options only (bench compact). */
#define CLI_OPTION_REFQ_DTYPE {"refq-dtype", required_argument, 0, CLI_OPT_REFQ_DTYPE}
#define CLI_OPTION_ARENA_DTYPE {"arena-dtype", required_argument, 0, CLI_OPT_ARENA_DTYPE}
#define CLI_OPTION_LAMBDA {"lambda", required_argument, 0, CLI_OPT_LAMBDA}
#define CLI_OPTION_MAX_QUERIES {"max-queries", required_argument, 0, CLI_OPT_MAX_QUERIES}
#define CLI_OPTION_CHUNK {"chunk", required_argument, 0, CLI_OPT_CHUNK}

/* Every option that sets the compaction's parameters, as `compact` and `eval quality` take them:
 * the quality options, --lambda, --max-queries, --chunk, the prefill options and --weights (tools/cli.h). */
#define CLI_COMPACT_OPTIONS                                                                                  \
    CLI_QUALITY_OPTIONS, CLI_OPTION_LAMBDA, CLI_OPTION_MAX_QUERIES, CLI_OPTION_CHUNK, CLI_PREFILL_OPTIONS, \
        CLI_WEIGHTS_OPTION

/* The compaction's parameters as the command line sets them. */
typedef struct {
    kf_compact_params p;     /* p.quoka is set by cli_compact_params */
    kf_quoka_params prefill; /* --prefill and the QUOKA options */
} cli_compact_opts;

/* kf_compact_params_default() and cli_prefill_defaults(). */
void cli_compact_opts_init(cli_compact_opts *o);
/* Any option of CLI_COMPACT_OPTIONS: 1 handled, 0 not one of them, -1 bad value (a usage error
 * naming the flag was printed). */
int cli_compact_option(const char *cmd, int opt, const char *arg, cli_compact_opts *o);
/* The last case of a command's option switch: an option of CLI_COMPACT_OPTIONS, else the usage
 * error `unknown` (the command's wording). CLI_CONTINUE or KF_EXIT_USAGE. */
int cli_compact_option_or(const char *cmd, int opt, const char *arg, cli_compact_opts *o, const char *unknown);
/* The parameters to compact with (quoka points into o: o must outlive them). */
kf_compact_params cli_compact_params(const cli_compact_opts *o);

#endif
