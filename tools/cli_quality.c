#include "tools/cli_quality.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"

static int number(const char *arg, double lo, double hi, double *out) {
    char *end;
    *out = strtod(arg, &end);
    return end != arg && !*end && *out >= lo && *out <= hi ? 0 : -1;
}

/* --queries, --repeat-fraction, --repeat-spans; a partial repeat with no repeat is refused
 * whichever comes first. */
static int refq_source_option(const char *cmd, int opt, const char *arg, kf_compact_params *p) {
    const int partial = p->repeat_fraction > 0 && p->repeat_fraction < 1;
    if (opt == CLI_OPT_QUERIES) {
        if (strcmp(arg, "repeat") && strcmp(arg, "context") && strcmp(arg, "both"))
            return cli_usage_error(cmd, "--queries is repeat, context or both, not '%s'", arg), -1;
        p->no_repeat = strcmp(arg, "context") == 0;
        p->use_context_queries = strcmp(arg, "repeat") != 0;
        if (p->no_repeat && (partial || p->repeat_spans))
            return cli_usage_error(cmd, "--queries context has no repeat: --repeat-fraction and --repeat-spans "
                                        "do not apply"), -1;
        return 1;
    }
    double x;
    if (opt == CLI_OPT_REPEAT_FRACTION && (number(arg, 0, 1, &x) || !(x > 0)))
        return cli_usage_error(cmd, "--repeat-fraction must be a fraction in (0, 1], not '%s'", arg), -1;
    if (opt == CLI_OPT_REPEAT_SPANS && (number(arg, 1, KF_REPEAT_SPANS_MAX, &x) || x != (int)x))
        return cli_usage_error(cmd, "--repeat-spans must be a whole number from 1 to %d, not '%s'",
                               KF_REPEAT_SPANS_MAX, arg), -1;
    if (p->no_repeat)
        return cli_usage_error(cmd, "%s does not apply: --queries context has no repeat",
                               opt == CLI_OPT_REPEAT_SPANS ? "--repeat-spans" : "--repeat-fraction"), -1;
    if (opt == CLI_OPT_REPEAT_FRACTION)
        p->repeat_fraction = x;
    else
        p->repeat_spans = (int)x;
    return 1;
}

int cli_quality_option(const char *cmd, int opt, const char *arg, kf_compact_params *p) {
    switch (opt) {
    case CLI_OPT_HEAD_CHOICE:
        if (strcmp(arg, "on") && strcmp(arg, "off"))
            return cli_usage_error(cmd, "--head-choice is on or off, not '%s'", arg), -1;
        p->head_choice = strcmp(arg, "on") == 0 ? KF_CHOICE_ON : KF_CHOICE_OFF;
        return 1;
    case CLI_OPT_VALUE_RIDGE:
        if (number(arg, 0, 1e6, &p->value_ridge))
            return cli_usage_error(cmd, "--value-ridge must be a non-negative number, not '%s'", arg), -1;
        return 1;
    case CLI_OPT_RIDGE_TO:
        if (strcmp(arg, "zero") && strcmp(arg, "orig"))
            return cli_usage_error(cmd, "--ridge-to is zero or orig, not '%s'", arg), -1;
        p->ridge_to = strcmp(arg, "zero") == 0 ? KF_RIDGE_TO_ZERO : KF_RIDGE_TO_ORIG;
        return 1;
    case CLI_OPT_BETA_FIT:
        if (strcmp(arg, "am") && strcmp(arg, "box"))
            return cli_usage_error(cmd, "--beta-fit is am or box, not '%s'", arg), -1;
        p->beta_fit = strcmp(arg, "box") == 0 ? KF_BETA_BOX : KF_BETA_AM;
        return 1;
    case CLI_OPT_VAL_FRAC:
        if (number(arg, 0, 0.9, &p->val_frac))
            return cli_usage_error(cmd, "--val-frac must be a fraction in [0, 0.9], not '%s'", arg), -1;
        return 1;
    case CLI_OPT_REFIT:
        if (strcmp(arg, "all") && strcmp(arg, "train"))
            return cli_usage_error(cmd, "--refit is all or train, not '%s'", arg), -1;
        p->refit_all = strcmp(arg, "all") == 0;
        return 1;
    case CLI_OPT_MARGIN:
        if (number(arg, 0, 10, &p->choice_margin))
            return cli_usage_error(cmd, "--choice-margin must be a number in [0, 10], not '%s'", arg), -1;
        return 1;
    case CLI_OPT_REFQ_DTYPE:
        if (strcmp(arg, "f32") && strcmp(arg, "bf16"))
            return cli_usage_error(cmd, "--refq-dtype is f32 or bf16, not '%s'", arg), -1;
        p->refq_bf16 = strcmp(arg, "bf16") == 0;
        return 1;
    case CLI_OPT_ARENA_DTYPE:
        if (kf_arena_dtype_parse(arg, &p->arena_dtype))
            return cli_usage_error(cmd, "--arena-dtype is f32 or bf16, not '%s'", arg), -1;
        return 1;
    case CLI_OPT_REPEAT_FRACTION:
    case CLI_OPT_REPEAT_SPANS:
    case CLI_OPT_QUERIES: return refq_source_option(cmd, opt, arg, p);
    default: return 0;
    }
}

void cli_compact_opts_init(cli_compact_opts *o) {
    o->p = kf_compact_params_default();
    o->prefill = cli_prefill_defaults();
}

int cli_compact_option(const char *cmd, int opt, const char *arg, cli_compact_opts *o) {
    long long v;
    switch (opt) {
    case CLI_OPT_LAMBDA:
        if (number(arg, 0, DBL_MAX, &o->p.lambda_rel)) /* inf would fail every fold */
            return cli_usage_error(cmd, "--lambda must be a finite non-negative number, not '%s'", arg), -1;
        return 1;
    case CLI_OPT_MAX_QUERIES:
        if (cli_parse_int(arg, 1, 1LL << 40, &v))
            return cli_usage_error(cmd, "--max-queries must be a positive count, not '%s'", arg), -1;
        o->p.max_queries = v;
        return 1;
    case CLI_OPT_CHUNK:
        if (cli_parse_int(arg, 1, 1 << 24, &v))
            return cli_usage_error(cmd, "--chunk must be a positive count, not '%s'", arg), -1;
        o->p.chunk = (int)v;
        return 1;
    default: {
        int r = cli_quality_option(cmd, opt, arg, &o->p);
        r = r ? r : cli_prefill_option(cmd, opt, arg, &o->prefill);
        return r ? r : cli_weights_option(cmd, opt, arg);
    }
    }
}

int cli_compact_option_or(const char *cmd, int opt, const char *arg, cli_compact_opts *o, const char *unknown) {
    const int r = cli_compact_option(cmd, opt, arg, o);
    if (r < 0)
        return KF_EXIT_USAGE;
    return r > 0 ? CLI_CONTINUE : cli_usage_error(cmd, "%s", unknown);
}

kf_compact_params cli_compact_params(const cli_compact_opts *o) {
    kf_compact_params p = o->p;
    p.quoka = cli_prefill_params(&o->prefill);
    return p;
}
