/* progress.h — the progress of a command over its documents, on stderr (compact, eval quality).
 *
 * On a terminal one line redrawn in place ("\r\033[K"): the document's stage (prefill tokens,
 * repeat layer i/L, solve layer i/L with its heads) with the time its compaction has left, then
 * the run's time left. Off a terminal (a log) one line per step's end (a prefill chunk, a repeat
 * layer, a solve layer), at most one every `interval` seconds (0: every one). Quiet: nothing.
 *
 * The document's time left: the forwards' FLOPs still to run (kf_progress.fwd_*) at the rate
 * measured so far, plus the layers still to solve at the solve's measured seconds per layer
 * (before the first is measured: a layer of the sources' forward). */
#ifndef KF_TOOLS_PROGRESS_H
#define KF_TOOLS_PROGRESS_H

#include <stdint.h>

#include "compactor/progress.h"

typedef struct {
    /* the run, kept by the command */
    int total, finished;              /* documents to compute (0: not known), and done or given up */
    int64_t tokens_total, tokens_done; /* their tokens (0 total: documents are the measure) */
    double t0;
    /* settings */
    int tty, quiet;
    double interval;  /* off a terminal: seconds between lines (0: every step) */
    const char *tag;  /* "[compact]" */
    /* the document */
    char label[192];  /* "source (name)" in log lines */
    char name[64];    /* the name, else the source, on a terminal */
    int64_t doc_tokens;
    double t_doc, t_last, t_fwd, t_solve, t_draw, t_log;
    kf_progress last; /* the library's latest call */
    int steps;        /* the library's calls for this document so far */
    char note[128];   /* the command's own stage ("reference", ...), or "" */
} cli_progress;

#define CLI_PROGRESS_DEFAULT_S 10.0 /* --progress-interval (tools/compact_options.h) */

/* A run of n_docs documents (0: not known) of `tokens` tokens in all (0: not known), its log lines
 * tagged `tag` ("[compact]"); on a terminal, cli_error clears the line until cli_progress_end. */
void cli_progress_start(cli_progress *pg, const char *tag, int n_docs, int64_t tokens, int quiet, double interval);
/* A document of `tokens` tokens starts: where it comes from ("docs.jsonl:3") and its name ("" if none). */
void cli_progress_doc(cli_progress *pg, const char *source, const char *name, int64_t tokens);
/* kf_compact_params.progress (user: the cli_progress). */
void cli_progress_fn(void *user, const kf_progress *p);
/* The command's own stage of the document (printf format), shown like the library's steps. */
void cli_progress_note(cli_progress *pg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Clears the terminal's line before a message (nothing off a terminal); cli_error does it itself. */
void cli_progress_clear(const cli_progress *pg);
/* The run is over: the line cleared, messages no longer clear it. */
void cli_progress_end(cli_progress *pg);

#endif
