/* options.c — parsing, validation and --help generated from a command's option rows (options.h). */
#include "tools/options.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"

#define HELP_COL 23   /* where the help text starts */
#define HELP_WIDTH 99 /* the widest help line */
enum { ID_HELP = 0x7000, ID_ROW = 0x8000 }; /* getopt_long ids: ID_ROW + the row's index */

/* A row with the offset of its group's struct in the command's. */
typedef struct {
    const cli_opt *o;
    size_t base;
} flat_row;

/* Every row of cmd in order into out [max]; their count. */
static int flatten(const cli_command *cmd, flat_row *out, int max) {
    int n = 0;
    for (const cli_group *g = cmd->groups; g && g->rows; g++)
        for (const cli_opt *o = g->rows; o->name && n < max; o++)
            out[n++] = (flat_row){o, g->base};
    return n;
}

#define MAX_ROWS 160 /* rows of one command, old spellings included (compact has about 40) */

const cli_opt *cli_opts_find(const cli_command *cmd, const char *name) {
    for (const cli_group *g = cmd->groups; g && g->rows; g++)
        for (const cli_opt *o = g->rows; o->name; o++)
            if (strcmp(o->name, name) == 0)
                return o->type == OPT_ALIAS ? cli_opts_find(cmd, o->target) : o;
    return NULL;
}

static int find_row(const flat_row *rows, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(rows[i].o->name, name) == 0)
            return i;
    return -1;
}

/* ---- values ---- */

static int parse_real(const char *arg, double *x) {
    char *end;
    errno = 0;
    *x = strtod(arg, &end);
    return end == arg || *end || errno || isnan(*x) ? -1 : 0;
}

static int in_range(const cli_opt *o, double x) {
    return (o->open_lo ? x > o->lo : x >= o->lo) && x <= o->hi;
}

/* The index of arg among o->choices "a|b|c", or -1. */
static int choice_index(const cli_opt *o, const char *arg) {
    const size_t len = strlen(arg);
    int i = 0;
    for (const char *p = o->choices; *p; i++) {
        const size_t w = strcspn(p, "|");
        if (w == len && strncmp(p, arg, w) == 0)
            return i;
        p += w + (p[w] == '|');
    }
    return -1;
}

/* "is a, b or c" from "a|b|c" into buf. */
static void choices_text(const cli_opt *o, char *buf, size_t len) {
    size_t at = (size_t)snprintf(buf, len, "is ");
    for (const char *p = o->choices; *p && at < len;) {
        const size_t w = strcspn(p, "|");
        const int last = p[w] == 0, first = p == o->choices;
        at += (size_t)snprintf(buf + at, len - at, "%s%.*s", first ? "" : last ? " or " : ", ", (int)w, p);
        p += w + !last;
    }
}

/* The usage error for a bad value: the row's wording, else one from its type. */
static int bad_value(const char *cmd, const cli_opt *o, const char *arg, const char *why) {
    char text[256];
    if (why && *why) /* the setter's whole reason (a conflict with another option) */
        return cli_usage_error(cmd, "--%s %s", o->name, why);
    if (o->must)
        snprintf(text, sizeof text, "%s", o->must);
    else if (o->type == OPT_CHOICE)
        choices_text(o, text, sizeof text);
    else if (o->type == OPT_REAL)
        snprintf(text, sizeof text, "must be a number in %s%g, %g]", o->open_lo ? "(" : "[", o->lo, o->hi);
    else
        snprintf(text, sizeof text, "must be a whole number from %.0f to %.0f", o->lo, o->hi);
    return cli_usage_error(cmd, "--%s %s, not '%s'", o->name, text, arg);
}

/* One value into its field: CLI_CONTINUE or KF_EXIT_USAGE (reported). */
static int set_value(const char *cmd, const cli_opt *o, void *ctx, const char *arg) {
    char *field = (char *)ctx + o->off;
    double x = 0;
    char why[256] = "";
    switch (o->type) {
    case OPT_FLAG: *(int *)field = o->ival ? o->ival : 1; return CLI_CONTINUE;
    case OPT_STR: *(const char **)field = arg; return CLI_CONTINUE;
    case OPT_INT:
    case OPT_LLONG:
    {
        long long v;
        if (cli_parse_int(arg, (long long)o->lo, (long long)o->hi, &v))
            return bad_value(cmd, o, arg, NULL);
        if (o->type == OPT_INT)
            *(int *)field = (int)v;
        else
            *(long long *)field = v;
        return CLI_CONTINUE;
    }
    case OPT_REAL:
        if (parse_real(arg, &x) || !in_range(o, x))
            return bad_value(cmd, o, arg, NULL);
        *(double *)field = x;
        return CLI_CONTINUE;
    case OPT_CHOICE: {
        const int i = choice_index(o, arg);
        if (i < 0)
            return bad_value(cmd, o, arg, NULL);
        *(int *)field = o->values ? o->values[i] : i;
        return CLI_CONTINUE;
    }
    case OPT_FN:
        if (o->set(ctx, o, arg, why, sizeof why))
            return bad_value(cmd, o, arg, why);
        return CLI_CONTINUE;
    case OPT_ALIAS: break;
    }
    return KF_EXIT_USAGE;
}

/* ---- parsing ---- */

/* getopt_long's tables for rows: long options (+ --help) into lo, short ones into so. */
static void getopt_tables(const flat_row *rows, int n, struct option *lo, char *so) {
    int k = 0, s = 0;
    so[s++] = 'h';
    for (int i = 0; i < n; i++) {
        const cli_opt *o = rows[i].o;
        int has_arg = o->type == OPT_FLAG ? no_argument : required_argument;
        if (o->type == OPT_ALIAS) { /* takes a value when its target does, unless it fixes one */
            const int ti = find_row(rows, n, o->target);
            const int flag = ti >= 0 && rows[ti].o->type == OPT_FLAG;
            has_arg = o->fixed || flag ? no_argument : required_argument;
        }
        lo[k++] = (struct option){o->name, has_arg, 0, ID_ROW + i};
        if (o->short_name) {
            so[s++] = o->short_name;
            if (has_arg == required_argument)
                so[s++] = ':';
        }
    }
    lo[k++] = (struct option){"help", no_argument, 0, ID_HELP};
    lo[k] = (struct option){0, 0, 0, 0};
    so[s] = 0;
}

/* The row of a short option's character, or -1. */
static int short_row(const flat_row *rows, int n, int c) {
    for (int i = 0; i < n; i++)
        if (rows[i].o->short_name == c)
            return i;
    return -1;
}

/* Row i's value (an alias: after its note, as its target's). */
static int take(const cli_command *cmd, const flat_row *rows, int n, int i, void *ctx, const char *arg) {
    const cli_opt *o = rows[i].o;
    if (o->type == OPT_ALIAS) {
        const int t = find_row(rows, n, o->target);
        if (cli_before_message)
            cli_before_message();
        fprintf(stderr, "kvfold %s: note: --%s%s%s is now --%s%s%s (the old spelling goes in the next release)\n",
                cmd->name, o->name, arg && !o->fixed ? " " : "", arg && !o->fixed ? arg : "", o->target,
                o->fixed ? " " : "", o->fixed ? o->fixed : "");
        if (t < 0)
            return cli_usage_error(cmd->name, "--%s: no option --%s", o->name, o->target);
        return take(cmd, rows, n, t, ctx, o->fixed ? o->fixed : arg);
    }
    return set_value(cmd->name, o, (char *)ctx + rows[i].base, arg);
}

int cli_opts_parse(const cli_command *cmd, int argc, char **argv, void *ctx, int *first) {
    flat_row rows[MAX_ROWS];
    const int n = flatten(cmd, rows, MAX_ROWS);
    struct option lo[MAX_ROWS + 2];
    char so[2 * MAX_ROWS + 2];
    getopt_tables(rows, n, lo, so);
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, so, lo, NULL)) != -1;) {
        int rc;
        if (c == 'h' || c == ID_HELP) {
            cli_opts_help(cmd, stdout);
            return KF_EXIT_OK;
        } else if (c >= ID_ROW && c < ID_ROW + n) {
            rc = take(cmd, rows, n, c - ID_ROW, ctx, optarg);
        } else if (c != '?' && c != ':' && short_row(rows, n, c) >= 0) {
            rc = take(cmd, rows, n, short_row(rows, n, c), ctx, optarg);
        } else { /* getopt_long named the option already */
            rc = cli_usage_error(cmd->name, "unknown option or missing value");
        }
        if (rc != CLI_CONTINUE)
            return rc;
    }
    *first = optind;
    return CLI_CONTINUE;
}

/* ---- help ---- */

/* text wrapped at HELP_WIDTH, its lines after the first indented to indent; col: where the
 * first starts. */
static void wrap(FILE *out, const char *text, int col, int indent) {
    int fresh = 1; /* nothing on this line yet */
    for (const char *p = text; *p;) {
        while (*p == ' ')
            p++;
        const size_t w = strcspn(p, " ");
        if (!w)
            break;
        if (!fresh && col + 1 + (int)w > HELP_WIDTH) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
            fresh = 1;
        }
        if (!fresh) {
            fputc(' ', out);
            col++;
        }
        fwrite(p, 1, w, out);
        col += (int)w;
        p += w;
        fresh = 0;
    }
    fputc('\n', out);
}

static void row_help(FILE *out, const cli_command *cmd, const cli_opt *o) {
    const char mark = cmd->lists_recipe && o->recipe ? '*' : ' ';
    char flag[64], text[2048];
    snprintf(flag, sizeof flag, "%s%c%s--%s%s%s", o->short_name ? "-" : "", o->short_name ? o->short_name : ' ',
             o->short_name ? ", " : "", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    const char *f = o->short_name ? flag : flag + 1;
    int at = snprintf(text, sizeof text, "%s", o->help ? o->help : "");
    if (o->def)
        at += snprintf(text + at, sizeof text - (size_t)at, " (default %s)", o->def);
    const char *sep = " (old spelling: ";
    for (const cli_group *g = cmd->groups; g && g->rows; g++)
        for (const cli_opt *a = g->rows; a->name; a++)
            if (a->type == OPT_ALIAS && strcmp(a->target, o->name) == 0 && at < (int)sizeof text) {
                at += snprintf(text + at, sizeof text - (size_t)at, "%s--%s%s%s", sep, a->name,
                               a->fixed ? " = --" : "", a->fixed ? o->name : "");
                if (a->fixed)
                    at += snprintf(text + at, sizeof text - (size_t)at, " %s", a->fixed);
                sep = ", ";
            }
    if (*sep == ',' && at < (int)sizeof text)
        snprintf(text + at, sizeof text - (size_t)at, ")");
    if (2 + strlen(f) > HELP_COL - 1) /* at least one space before the text */
        fprintf(out, "%c %s\n%*s", mark, f, HELP_COL, "");
    else
        fprintf(out, "%c %-*s", mark, HELP_COL - 2, f);
    wrap(out, text, HELP_COL, HELP_COL);
}

static int has_recipe(const cli_command *cmd) {
    for (const cli_group *g = cmd->groups; g && g->rows; g++)
        for (const cli_opt *o = g->rows; o->name; o++)
            if (o->recipe)
                return 1;
    return 0;
}

void cli_opts_help(const cli_command *cmd, FILE *out) {
    fprintf(out, "Usage: %s", cmd->usage);
    if (cmd->about)
        fprintf(out, "\n%s", cmd->about);
    fprintf(out, "\nOptions:\n%s", cmd->lists_recipe && has_recipe(cmd)
                                       ? "(* marks those that change the file's bytes: part of its recipe)\n"
                                       : "");
    for (const cli_group *g = cmd->groups; g && g->rows; g++) {
        if (g->title)
            fprintf(out, "%s%s:\n", g == cmd->groups ? "" : "\n", g->title);
        for (const cli_opt *o = g->rows; o->name; o++)
            if (o->type != OPT_ALIAS)
                row_help(out, cmd, o);
    }
    fprintf(out, "  -h, --help           show this help\n");
    if (cmd->notes)
        fprintf(out, "\n%s", cmd->notes);
    fprintf(out, "\nExit status:\n%s", cmd->exit_status);
    fprintf(out, "\nExample:\n%s", cmd->example);
}

void cli_opts_recipe_list(const cli_command *cmd, FILE *out) {
    const char *sep = "";
    for (const cli_group *g = cmd->groups; g && g->rows; g++)
        for (const cli_opt *o = g->rows; o->name; o++)
            if (o->recipe && o->type != OPT_ALIAS) {
                fprintf(out, "%s--%s (%s)", sep, o->name, o->recipe);
                sep = ", ";
            }
}
