/* compact_options.h — the option rows shared by the commands that compact or prefill (compact,
 * eval quality, bench compact, logits, bench prefill, bench attention), as tables (options.h).
 *
 * The rows of the compaction write into a cli_compact_opts (cli_quality.h): a command embeds one
 * and lists the groups it takes with that member's offset, e.g.
 *   {"Compaction", cli_quality_rows, OFF(eval_opts, q)}
 * The prefill rows write into a kf_quoka_params (cli_prefill_defaults()); the --weights row sets
 * the process's choice (cli_weights()); the progress rows write into a cli_progress_opts. */
#ifndef KF_TOOLS_COMPACT_OPTIONS_H
#define KF_TOOLS_COMPACT_OPTIONS_H

#include "tools/options.h"

/* --head-choice, --value-ridge, --ridge-to, --beta-fit, --val-frac, --refit, --choice-margin */
extern const cli_opt cli_choice_rows[];
/* --refq-dtype, --arena-dtype */
extern const cli_opt cli_refq_dtype_rows[];
extern const cli_opt cli_arena_dtype_rows[];
/* --queries, --repeat-fraction, --repeat-spans */
extern const cli_opt cli_refq_source_rows[];
/* --lambda, --chunk (the prefill's chunk) and --max-queries */
extern const cli_opt cli_lambda_rows[];
extern const cli_opt cli_chunk_rows[];
extern const cli_opt cli_max_queries_rows[];
/* --prefill, --quoka-nq, --quoka-budget, --quoka-sinks into a kf_quoka_params */
extern const cli_opt cli_prefill_rows[];
/* --quoka-repeat, --quoka-margin (QUOKA for the repeat prefill too) */
extern const cli_opt cli_quoka_repeat_rows[];
/* --weights (no struct: base 0) */
extern const cli_opt cli_weights_rows[];
/* --progress-interval, -q/--quiet into a cli_progress_opts */
typedef struct {
    double interval; /* seconds between log lines (CLI_PROGRESS_DEFAULT_S) */
    int quiet;
} cli_progress_opts;
extern const cli_opt cli_progress_rows[];

#endif
