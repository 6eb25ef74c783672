/* options.h — a command's options as one table: one row per option, from which the parsing,
 * the --help text and the validation are generated (the style of git's parse-options).
 *
 * A row names the option, its value's type and range, where the value goes (an offset into the
 * command's options struct), its default as --help shows it, its help text, and, when the option
 * changes the bytes of a kvf file, the recipe field it sets (compactor/recipe.c). Adding an option
 * is one row. An old spelling is a row of type OPT_ALIAS: it is parsed as its target (with a fixed
 * value when it was a flag: --json is --format json) after a one-line note on stderr.
 *
 *   static const cli_opt kRows[] = {
 *       {"top", 0, OPT_INT, "K", OFF(logits_opts, top), .lo = 1, .hi = 1 << 20, .def = "5",
 *        .help = "how many tokens to show"},
 *       {0}};
 */
#ifndef KF_TOOLS_OPTIONS_H
#define KF_TOOLS_OPTIONS_H

#include <stddef.h>
#include <stdio.h>

typedef enum {
    OPT_FLAG,   /* no value: stores .ival into an int (1 when .ival is 0) */
    OPT_STR,    /* const char *: the argument as given */
    OPT_INT,    /* int in [lo, hi] */
    OPT_LLONG,  /* long long in [lo, hi] */
    OPT_REAL,   /* double in [lo, hi] (lo excluded with .open_lo) */
    OPT_CHOICE, /* one of .choices "a|b|c": stores its index (or .values[index]) into an int */
    OPT_FN,     /* .set parses and stores; cross-option checks go here */
    OPT_ALIAS,  /* an old spelling of .target (a flag when .fixed is set: the target's value) */
} cli_opt_type;

typedef struct cli_opt cli_opt;
/* A setter: the value into ctx (the struct the row's group points at); 0, or -1 with err ""
 * (the usage error is then "--NAME <.must>, not 'ARG'") or the whole reason after the option's
 * name ("does not apply: --queries context has no repeat"). */
typedef int (*cli_opt_setter)(void *ctx, const cli_opt *o, const char *arg, char *err, size_t err_len);

struct cli_opt {
    const char *name;   /* long name without the dashes; NULL ends a table */
    char short_name;    /* 'q', or 0 */
    cli_opt_type type;
    const char *arg;    /* the value's name in --help ("N", "DIR"); NULL for a flag */
    size_t off;         /* offsetof the field in the group's struct */
    double lo, hi;      /* OPT_INT, OPT_LLONG, OPT_REAL: the accepted range */
    int open_lo;        /* OPT_REAL: lo itself refused */
    int ival;           /* OPT_FLAG: the value stored (0 means 1) */
    const char *choices;/* OPT_CHOICE: "a|b|c" */
    const int *values;  /* OPT_CHOICE: the value stored for each choice (NULL: the index) */
    cli_opt_setter set; /* OPT_FN */
    const char *must;   /* the error's wording: "--NAME <must>, not 'ARG'" (NULL: from the type) */
    const char *def;    /* the default as --help shows it, or NULL */
    const char *help;   /* one paragraph; --help wraps it */
    const char *recipe; /* the recipe field the option sets (compactor/recipe.c), or NULL */
    const char *target; /* OPT_ALIAS: the new spelling's name */
    const char *fixed;  /* OPT_ALIAS of a flag: the target's value */
};

#define OFF(type, field) offsetof(type, field)

/* One section of a command's options: a title ("Compaction"), its rows, and the offset of the
 * struct they write into within the command's options struct (0: the struct itself). */
typedef struct {
    const char *title;
    const cli_opt *rows;
    size_t base;
} cli_group;

/* A command: its name in messages ("eval quality"), the help's sections, its option groups
 * (ending with {0}). Every help has the same sections: usage, the description, options, exit
 * status, example. */
typedef struct {
    const char *name;
    const char *usage;  /* the lines after "Usage: " (each "kvfold ...") */
    const char *about;  /* what the command does (preformatted, may be NULL) */
    const cli_group *groups;
    const char *notes;  /* after the options (preformatted, may be NULL) */
    int lists_recipe;   /* the help marks the rows that set a recipe field (a command that writes files) */
    const char *exit_status; /* preformatted */
    const char *example;     /* preformatted */
} cli_command;

/* Parses argv (argv[0] the command's name) into ctx by cmd's tables: CLI_CONTINUE with *first
 * the first operand, KF_EXIT_OK after --help (printed on stdout), or KF_EXIT_USAGE after a
 * usage error naming the option and the value. */
int cli_opts_parse(const cli_command *cmd, int argc, char **argv, void *ctx, int *first);
/* The whole --help text of cmd. */
void cli_opts_help(const cli_command *cmd, FILE *out);
/* The row of the option called name (an alias's target), or NULL. */
const cli_opt *cli_opts_find(const cli_command *cmd, const char *name);
/* Writes "--a (field_a), --b (field_b), ..." for the rows of cmd that set a recipe field. */
void cli_opts_recipe_list(const cli_command *cmd, FILE *out);

#endif
