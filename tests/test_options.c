/* The command line's option tables (tools/options.h): a synthetic table parsed as getopt_long
 * would (values, ranges, choices, setters, short options, old spellings with their note), the
 * usage errors naming the option and the value, and every command's --help: the four sections
 * in order, every row of its table (old spellings too), no line wider than 100 columns, and the
 * recipe fields its rows name present in compactor/recipe.c. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"
#include "tools/cli.h"
#include "tools/commands.h"

typedef struct {
    const char *name;
    int n, flag, mode;
    double frac;
    long long big;
} demo_opts;

static int set_name(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o;
    if (strcmp(arg, "bad") == 0)
        return snprintf(err, n, "does not take 'bad' (a setter's reason)"), -1;
    ((demo_opts *)ctx)->name = arg;
    return 0;
}

static const int kModes[] = {7, 9};
#define D(f) OFF(demo_opts, f)
static const cli_opt kDemo[] = {
    {"count", 'c', OPT_INT, "N", D(n), .lo = 1, .hi = 10, .help = "a count"},
    {"flag", 0, OPT_FLAG, NULL, D(flag), .ival = 3, .help = "a flag"},
    {"mode", 0, OPT_CHOICE, "M", D(mode), .choices = "low|high", .values = kModes, .help = "a choice"},
    {"frac", 0, OPT_REAL, "F", D(frac), .lo = 0, .open_lo = 1, .hi = 1, .help = "a fraction"},
    {"big", 0, OPT_LLONG, "N", D(big), .lo = 0, .hi = 1099511627776.0, .help = "a large count"},
    {"name", 0, OPT_FN, "S", 0, .set = set_name, .must = "is a name", .help = "a name"},
    {"counts", 0, OPT_ALIAS, .target = "count"},
    {"high", 0, OPT_ALIAS, .target = "mode", .fixed = "high"},
    {0}};
static const cli_command kDemoCmd = {.name = "demo", .usage = "kvfold demo [options] X\n",
                                     .groups = (const cli_group[]){{NULL, kDemo, 0}, {0}},
                                     .exit_status = "  0  ok\n", .example = "  kvfold demo\n"};

/* Parses the NULL-terminated args (argv[0] "demo") into o with stderr captured in err [4096]. */
static int parse(demo_opts *o, char *err, const char *first, ...) {
    char *argv[32] = {"demo"};
    int argc = 1;
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a && argc < 31; a = va_arg(ap, const char *))
        argv[argc++] = (char *)a;
    va_end(ap);
    *o = (demo_opts){0};
    fflush(stderr);
    const int saved = dup(2);
    FILE *cap = tmpfile();
    dup2(fileno(cap), 2);
    int at = -1;
    const int rc = cli_opts_parse(&kDemoCmd, argc, argv, o, &at);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(cap);
    const size_t n = fread(err, 1, 4095, cap);
    err[n] = 0;
    fclose(cap);
    return rc == CLI_CONTINUE ? at : -rc; /* the first operand, or minus the exit status */
}

static void test_values(void) {
    demo_opts o;
    char err[4096];
    CU_ASSERT_EQUAL(parse(&o, err, "-c", "4", "--flag", "--mode", "high", "--frac", "0.5", "X", "--big",
                          "1099511627776", "--name", "n1", NULL), 12); /* X permuted last */
    CU_ASSERT_EQUAL(o.n, 4);
    CU_ASSERT_EQUAL(o.flag, 3);
    CU_ASSERT_EQUAL(o.mode, 9);
    CU_ASSERT_DOUBLE_EQUAL(o.frac, 0.5, 0);
    CU_ASSERT_EQUAL(o.big, 1099511627776LL);
    CU_ASSERT_STRING_EQUAL(o.name, "n1");
    CU_ASSERT_STRING_EQUAL(err, "");
    CU_ASSERT_EQUAL(parse(&o, err, "--count=10", "--mode", "low", NULL), 4);
    CU_ASSERT_EQUAL(o.n, 10);
    CU_ASSERT_EQUAL(o.mode, 7);
}

/* A bad value: exit 2, one message naming the option and the value, then the pointer to --help. */
static void expect_error(const char *opt, const char *val, const char *want) {
    demo_opts o;
    char err[4096];
    CU_ASSERT_EQUAL(parse(&o, err, opt, val, NULL), -KF_EXIT_USAGE);
    if (!strstr(err, want))
        fprintf(stderr, "\nwanted '%s' in:\n%s", want, err);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, want));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "Try 'kvfold demo --help'."));
}

static void test_errors(void) {
    expect_error("--count", "11", "kvfold demo: --count must be a whole number from 1 to 10, not '11'");
    expect_error("--count", "2.5", "--count must be a whole number from 1 to 10, not '2.5'");
    expect_error("-c", "x", "--count must be a whole number from 1 to 10, not 'x'");
    expect_error("--mode", "mid", "--mode is low or high, not 'mid'");
    expect_error("--frac", "0", "--frac must be a number in (0, 1], not '0'");
    expect_error("--frac", "nan", "--frac must be a number in (0, 1], not 'nan'");
    expect_error("--big", "1099511627777", "--big must be a whole number from 0 to 1099511627776, not '1099511627777'");
    expect_error("--name", "bad", "--name does not take 'bad' (a setter's reason)");
    expect_error("--nope", "1", "unrecognized option '--nope'");
}

static void test_old_spellings(void) {
    demo_opts o;
    char err[4096];
    CU_ASSERT_EQUAL(parse(&o, err, "--counts", "5", "--high", NULL), 4);
    CU_ASSERT_EQUAL(o.n, 5);
    CU_ASSERT_EQUAL(o.mode, 9);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "kvfold demo: note: --counts 5 is now --count (the old spelling goes"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "kvfold demo: note: --high is now --mode high"));
    /* the old spelling's value is checked as the new one's, and the error names the new one */
    CU_ASSERT_EQUAL(parse(&o, err, "--counts", "0", NULL), -KF_EXIT_USAGE);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "--count must be a whole number from 1 to 10, not '0'"));
}

/* The help of cmd in a malloc'd string. */
static char *help_text(const cli_command *cmd) {
    FILE *f = tmpfile();
    cli_opts_help(cmd, f);
    rewind(f);
    size_t len;
    char *text = cli_read_all(f, &len);
    fclose(f);
    return text;
}

/* "\n<title>\n" at the start of a line, after `after`; the position or NULL. */
static const char *section(const char *text, const char *after, const char *title) {
    char want[64];
    snprintf(want, sizeof want, "\n%s\n", title);
    const char *p = strstr(after ? after : text, want);
    return p;
}

/* "--name" as a word of text: after a space or the line's start, before a space, '=' or the end. */
static int names_option(const char *text, const char *name) {
    char want[80];
    snprintf(want, sizeof want, "--%s", name);
    for (const char *p = text; (p = strstr(p, want)); p++) {
        const char after = p[strlen(want)];
        if ((p == text || p[-1] == ' ' || p[-1] == '\n') && (after == ' ' || after == '\n' || after == '=' ||
                                                              after == ',' || after == ')' || !after))
            return 1;
    }
    return 0;
}

static char *read_source(const char *rel) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", KF_SOURCE_DIR, rel);
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    size_t len;
    char *s = cli_read_all(f, &len);
    fclose(f);
    return s;
}

static const cli_command *const kCommands[] = {
    &cli_compact_command, &cli_eval_command, &cli_bench_compact_command, &cli_logits_command,
    &cli_model_info_command, &cli_tokenize_command, &cli_chat_template_command, &cli_inspect_command,
    &cli_ask_command, &cli_verify_command, &cli_bench_command, &cli_bench_prefill_command,
    &cli_bench_attention_command, &cli_bench_quoka_command, &cli_bench_kvf_command,
    &cli_bench_tokenize_command, &kDemoCmd};

/* One command's help: usage, options, exit status, example in that order; every row named; the
 * widest line at most 100 columns. */
static void check_help(const cli_command *cmd) {
    char *h = help_text(cmd);
    char usage[80];
    snprintf(usage, sizeof usage, "Usage: kvfold %s", cmd->name);
    CU_ASSERT_EQUAL(strncmp(h, usage, strlen(usage)), 0);
    const char *opts = section(h, NULL, "Options:"), *ex = section(h, opts, "Exit status:"),
               *eg = section(h, ex, "Example:");
    if (!opts || !ex || !eg)
        fprintf(stderr, "\n%s: a section is missing or out of order\n", cmd->name);
    CU_ASSERT(opts && ex && eg && eg[strlen("\nExample:\n")] != 0);
    for (const cli_group *g = cmd->groups; g && g->rows; g++)
        for (const cli_opt *o = g->rows; o->name; o++) {
            if (!names_option(h, o->name))
                fprintf(stderr, "\n%s --help does not name --%s\n", cmd->name, o->name);
            CU_ASSERT(names_option(h, o->name));
            CU_ASSERT(o->type == OPT_ALIAS ? cli_opts_find(cmd, o->target) != NULL : o->help && *o->help);
        }
    for (const char *line = h; *line;) {
        const size_t w = strcspn(line, "\n");
        if (w > 100)
            fprintf(stderr, "\n%s --help: a line of %zu columns\n", cmd->name, w);
        CU_ASSERT(w <= 100);
        line += w + (line[w] != 0);
    }
    free(h);
}

static void test_every_help(void) {
    for (size_t i = 0; i < sizeof kCommands / sizeof kCommands[0]; i++)
        check_help(kCommands[i]);
}

/* Every recipe field a row names is one compactor/recipe.c digests; compact marks those rows. */
static void test_recipe_fields(void) {
    char *recipe = read_source("compactor/recipe.c");
    CU_ASSERT_PTR_NOT_NULL_FATAL(recipe);
    int n = 0;
    for (const cli_group *g = cli_compact_command.groups; g->rows; g++)
        for (const cli_opt *o = g->rows; o->name; o++) {
            if (!o->recipe)
                continue;
            char want[80];
            snprintf(want, sizeof want, "\"%s\"", o->recipe);
            if (!strstr(recipe, want))
                fprintf(stderr, "\n--%s: recipe field %s is not in compactor/recipe.c\n", o->name, o->recipe);
            CU_ASSERT_PTR_NOT_NULL(strstr(recipe, want));
            n++;
        }
    CU_ASSERT(n >= 20); /* method, budget, lambda, dtype, the solver's, QUOKA's, ... */
    char *h = help_text(&cli_compact_command);
    CU_ASSERT_PTR_NOT_NULL(strstr(h, "\n* --lambda X "));
    CU_ASSERT_PTR_NOT_NULL(strstr(h, "\n  --out ROOT "));
    free(h);
    free(recipe);
}

static CU_TestInfo tests[] = {
    {"values of every type, short options, operands permuted", test_values},
    {"bad values: the option, the value and --help named", test_errors},
    {"old spellings: a note, then the new option's value and checks", test_old_spellings},
    {"every command's help: four sections, every row, 100 columns", test_every_help},
    {"recipe fields named by compact's rows are digested", test_recipe_fields},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"options", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
