/* compact_options.c — the option rows shared by the commands that compact or prefill. */
#include "tools/compact_options.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/arena.h"
#include "tools/cli.h"
#include "tools/cli_quality.h"

#define Q(field) OFF(cli_compact_opts, p.field)

static const int kOnOff[] = {KF_CHOICE_ON, KF_CHOICE_OFF};
static const int kAllTrain[] = {1, 0, 2};

const cli_opt cli_choice_rows[] = {
    {"head-choice", 0, OPT_CHOICE, "C", Q(choice.head_choice), .choices = "on|off", .values = kOnOff,
     .def = "on for am, fold", .recipe = "head_choice",
     .help = "on: each KV head takes the method, drop or keep, by held-out error; or off"},
    {"value-ridge", 0, OPT_REAL, "A", Q(solver.value_ridge), .lo = 0, .hi = 1e6, .must = "must be a non-negative number",
     .def = "0: plain least squares", .recipe = "value_ridge",
     .help = "value refits' ridge without the choice, A tr(X^T X) / t"},
    {"ridge-to", 0, OPT_CHOICE, "T", Q(solver.ridge_to), .choices = "zero|orig", .def = "orig", .recipe = "ridge_to",
     .help = "the ridge pulls towards orig (the keys' values) or zero"},
    {"beta-fit", 0, OPT_CHOICE, "F", Q(solver.beta_fit), .choices = "am|box", .def = "am", .recipe = "beta_fit",
     .help = "am (least squares, two gradient steps) or box (converged)"},
    {"val-frac", 0, OPT_REAL, "F", Q(choice.val_frac), .lo = 0, .hi = 0.9, .must = "must be a fraction in [0, 0.9]",
     .def = "0.2", .recipe = "val_frac", .help = "share of reference positions held out for the choice"},
    {"val-rows", 0, OPT_REAL, "N", Q(choice.val_rows), .lo = 0, .hi = 1e6, .must = "must be a non-negative number",
     .def = "0.2", .recipe = "val_rows",
     .help = "held-out rows the choice scores on, per document token (at least 512; 0: all; the refit takes all)"},
    {"refit-rows", 0, OPT_REAL, "N", Q(choice.refit_rows), .lo = 0, .hi = 1e6, .must = "must be a non-negative number",
     .def = "8", .recipe = "refit_rows",
     .help = "training rows per kept key in the refit (at least 2048; 0: all)"},
    {"refit", 0, OPT_CHOICE, "all|train|values", Q(choice.refit_all), .choices = "all|train|values",
     .values = kAllTrain, .def = "values", .recipe = "refit_all",
     .help = "the winner refitted on all queries, kept as validated, or its values alone refitted"},
    {"choice-margin", 0, OPT_REAL, "M", Q(choice.choice_margin), .lo = 0, .hi = 10, .def = "0.5", .recipe = "choice_margin",
     .help = "am/fold win a head when 1 + M times better than drop, keep"},
    {0}};

const cli_opt cli_refq_dtype_rows[] = {
    {"refq-dtype", 0, OPT_CHOICE, "T", Q(run.refq_bf16), .choices = "f32|bf16", .def = "f32",
     .recipe = "refq_bf16",
     .help = "reference queries in f32 or bf16 (half the memory)"},
    {0}};

static int set_arena_dtype(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)err, (void)n;
    return kf_arena_dtype_parse(arg, (kf_dtype *)((char *)ctx + o->off));
}

const cli_opt cli_arena_dtype_rows[] = {
    {"arena-dtype", 0, OPT_FN, "T", Q(run.arena_dtype), .set = set_arena_dtype, .must = "is f32 or bf16",
     .def = "f32", .recipe = "arena_dtype",
     .help = "the KV arena in f32 or bf16 (half the memory; CPU backend)"},
    {0}};

/* --queries: a partial repeat with no repeat is refused whichever comes first. */
static int set_queries(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o;
    kf_compact_params *p = &((cli_compact_opts *)ctx)->p;
    if (strcmp(arg, "repeat") && strcmp(arg, "context") && strcmp(arg, "both"))
        return -1;
    p->no_repeat = strcmp(arg, "context") == 0;
    p->use_context_queries = strcmp(arg, "repeat") != 0;
    const int partial = p->repeat_fraction > 0 && p->repeat_fraction < 1;
    if (p->no_repeat && (partial || p->repeat_spans))
        return snprintf(err, n, "context has no repeat: --repeat-fraction and --repeat-spans do not apply"), -1;
    return 0;
}

/* --repeat-fraction and --repeat-spans: a value in range, and a repeat to apply to. */
static int set_repeat(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    kf_compact_params *p = &((cli_compact_opts *)ctx)->p;
    char *end;
    const double x = strtod(arg, &end);
    const int spans = o->off == Q(repeat_spans);
    if (end == arg || *end || (spans ? !(x >= 1 && x <= KF_REPEAT_SPANS_MAX && x == (int)x) : !(x > 0 && x <= 1)))
        return -1;
    if (p->no_repeat)
        return snprintf(err, n, "does not apply: --queries context has no repeat"), -1;
    if (spans)
        p->repeat_spans = (int)x;
    else
        p->repeat_fraction = x;
    return 0;
}

const cli_opt cli_refq_source_rows[] = {
    {"queries", 0, OPT_FN, "S", OFF(cli_compact_opts, p), .set = set_queries, .must = "is repeat, context or both",
     .def = "repeat", .recipe = "use_context_queries",
     .help = "repeat (the document after the instruction), context (its own: cheapest, no "
             "per-head choice) or both; probes are added to each"},
    {"repeat-fraction", 0, OPT_FN, "F", Q(repeat_fraction), .set = set_repeat,
     .must = "must be a fraction in (0, 1]", .def = "1", .recipe = "repeat_fraction",
     .help = "repeat a share F of the document in --repeat-spans runs (docs/performance.md)"},
    {"repeat-spans", 0, OPT_FN, "K", Q(repeat_spans), .set = set_repeat,
     .must = "must be a whole number from 1 to 64", .def = "4", .recipe = "repeat_spans",
     .help = "runs of a partial repeat, 1 to 64"},
    {0}};

const cli_opt cli_lambda_rows[] = {
    {"lambda", 0, OPT_REAL, "X", Q(solver.lambda_rel), .lo = 0, .hi = DBL_MAX, .def = "0.01", .recipe = "lambda_rel",
     .must = "must be a finite non-negative number", .help = "fold ridge, relative to tr(Sigma)/d"},
    {0}};

static int set_int64(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)err, (void)n;
    long long v;
    if (cli_parse_int(arg, (long long)o->lo, (long long)o->hi, &v))
        return -1;
    *(int64_t *)((char *)ctx + o->off) = v;
    return 0;
}

const cli_opt cli_max_queries_rows[] = {
    {"max-queries", 0, OPT_FN, "N", Q(solver.max_queries), .set = set_int64, .lo = 1, .hi = 1099511627776.0,
     .must = "must be a positive count", .def = "50000", .recipe = "max_queries",
     .help = "pooled reference queries per KV head"},
    {0}};

const cli_opt cli_chunk_rows[] = {
    {"chunk", 0, OPT_INT, "N", Q(run.chunk), .lo = 1, .hi = 1 << 24, .must = "must be a positive count", .def = "512",
     .recipe = "chunk", .help = "prefill chunk size in tokens"},
    {0}};

const cli_opt cli_quoka_repeat_rows[] = {
    {"quoka-repeat", 0, OPT_FLAG, NULL, Q(run.quoka_repeat), .recipe = "quoka_repeat",
     .help = "with --prefill quoka, the repeat prefill too (the copy's source span kept in its selection)"},
    {"quoka-margin", 0, OPT_INT, "N", Q(run.quoka_margin), .lo = -1, .hi = 1 << 20,
     .must = "must be an integer >= -1", .def = "16", .recipe = "quoka_margin",
     .help = "the repeat's aligned window: the copy's source span +- N tokens (-1: none)"},
    {0}};

#define P(field) OFF(kf_quoka_params, field)
static const int kPrefillModes[] = {KF_PREFILL_DENSE, KF_PREFILL_QUOKA};

/* --quoka-budget: a count of keys, or a fraction of the history when it has a point. */
static int set_quoka_budget(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o;
    kf_quoka_params *p = ctx;
    if (strchr(arg, '.')) {
        char *end;
        const double f = strtod(arg, &end);
        if (end == arg || *end || !(f > 0.0 && f <= 1.0))
            return snprintf(err, n, "with a point is a fraction of the history in (0, 1], not '%s'", arg), -1;
        p->budget_frac = f;
        return 0;
    }
    long long v;
    if (cli_parse_int(arg, 1, INT32_MAX, &v))
        return -1;
    p->budget = (int)v;
    p->budget_frac = 0;
    return 0;
}

const cli_opt cli_prefill_rows[] = {
    {"prefill", 0, OPT_CHOICE, "MODE", P(mode), .choices = "dense|quoka", .values = kPrefillModes, .def = "dense",
     .recipe = "quoka",
     .help = "dense, or quoka: attention over the history's keys queries choose"},
    {"quoka-nq", 0, OPT_INT, "N", P(n_q), .lo = 1, .hi = 1 << 20, .must = "must be a positive integer",
     .def = "16", .recipe = "quoka", .help = "queries kept per head to choose keys"},
    {"quoka-budget", 0, OPT_FN, "B", 0, .set = set_quoka_budget,
     .must = "must be a key count >= 1 or a fraction like 0.25", .def = "1024", .recipe = "quoka",
     .help = "history keys kept per KV head: a count, or a fraction like 0.25"},
    {"quoka-sinks", 0, OPT_INT, "N", P(n_sink), .lo = 0, .hi = 1 << 20, .must = "must be an integer >= 0",
     .def = "0", .recipe = "quoka", .help = "always keep the first N tokens"},
    {0}};

static int set_weights(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)ctx, (void)o, (void)err, (void)n;
    return cli_weights_set(arg);
}

const cli_opt cli_weights_rows[] = {
    {"weights", 0, OPT_FN, "W", 0, .set = set_weights, .must = "is auto, bf16 or fp32", .def = "auto",
     .help = "the weights in memory: auto (as stored), bf16 or fp32"},
    {0}};

const cli_opt cli_progress_rows[] = {
    {"progress-interval", 0, OPT_REAL, "S", OFF(cli_progress_opts, interval), .lo = 0, .hi = 1e6, .def = "10",
     .must = "must be a number of seconds, 0 or more",
     .help = "off a terminal, a progress line every S seconds at most"},
    {"quiet", 'q', OPT_FLAG, NULL, OFF(cli_progress_opts, quiet),
     .help = "no progress: only errors and the results"},
    {0}};
