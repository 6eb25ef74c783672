/* cli_quality.h — the compaction's parameters as the command line sets them, shared by `compact`,
 * `eval quality` and `bench compact`. Their option rows are in tools/compact_options.h: a new
 * compaction flag is one row there, and every command that lists its group takes it. */
#ifndef KF_CLI_QUALITY_H
#define KF_CLI_QUALITY_H

#include "compactor/compact.h"
#include "tools/cli.h"

typedef struct {
    kf_compact_params p;     /* p.run.quoka is set by cli_compact_params */
    kf_quoka_params prefill; /* --prefill and the QUOKA options */
} cli_compact_opts;

/* kf_compact_params_default() and cli_prefill_defaults(). */
void cli_compact_opts_init(cli_compact_opts *o);
/* The options that only apply together: CLI_CONTINUE, or a usage error of cmd (reported). */
int cli_compact_opts_check(const cli_compact_opts *o, const char *cmd);
/* The parameters to compact with (quoka points into o: o must outlive them). */
kf_compact_params cli_compact_params(const cli_compact_opts *o);

#endif
