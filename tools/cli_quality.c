/* cli_quality.c — the compaction's parameters from the command line (cli_quality.h). */
#include "tools/cli_quality.h"

void cli_compact_opts_init(cli_compact_opts *o) {
    o->p = kf_compact_params_default();
    o->prefill = cli_prefill_defaults();
}

int cli_compact_opts_check(const cli_compact_opts *o, const char *cmd) {
    if (o->p.run.quoka_repeat && o->prefill.mode != KF_PREFILL_QUOKA)
        return cli_usage_error(cmd, "--quoka-repeat needs --prefill quoka");
    return CLI_CONTINUE;
}

kf_compact_params cli_compact_params(const cli_compact_opts *o) {
    kf_compact_params p = o->p;
    p.run.quoka = cli_prefill_params(&o->prefill);
    return p;
}
