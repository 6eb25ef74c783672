/* progress.c — the progress of compact and eval quality on stderr (progress.h). */
#include "tools/progress.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "formats/escape.h"
#include "tools/cli.h"

/* On a terminal a step's end is always drawn; what happens inside a step at most this often. */
#define REDRAW_S 0.1

static int g_drawn; /* a line is drawn in place: a message clears it first (cli_before_message) */

static void clear_drawn(void) {
    if (g_drawn)
        fputs("\r\033[K", stderr);
    g_drawn = 0;
}

void cli_progress_start(cli_progress *pg, const char *tag, int n_docs, int64_t tokens, int quiet, double interval) {
    *pg = (cli_progress){.total = n_docs, .tokens_total = tokens, .t0 = cli_now(), .tty = !quiet && isatty(2),
                         .quiet = quiet, .interval = interval, .tag = tag};
    pg->t_log = pg->t0;
    if (pg->tty)
        cli_before_message = clear_drawn;
}

void cli_progress_end(cli_progress *pg) {
    clear_drawn();
    if (cli_before_message == clear_drawn)
        cli_before_message = NULL;
    pg->tty = 0;
}

static void fmt_duration(double s, char *out, size_t n) {
    if (!(s >= 0) || s > 1e7)
        snprintf(out, n, "?");
    else if (s < 60)
        snprintf(out, n, "%.0fs", s);
    else if (s < 3600)
        snprintf(out, n, "%dm%02ds", (int)s / 60, (int)s % 60);
    else
        snprintf(out, n, "%dh%02dm", (int)s / 3600, (int)s % 3600 / 60);
}

/* Seconds the document's compaction has left, or -1 before a forward has been measured. */
static double doc_left(const cli_progress *pg) {
    const kf_progress *p = &pg->last;
    if (!pg->steps || pg->t_fwd <= 0 || p->fwd_done <= 0 || p->n_layers < 1)
        return -1;
    const double rate = p->fwd_done / pg->t_fwd; /* forward FLOPs per second */
    double solved = 0;                           /* layers solved, the one in progress by its heads */
    if (p->stage == KF_STAGE_SOLVE)
        solved = p->layer + (p->total > 0 ? (double)p->done / p->total : 0);
    else if (p->stage == KF_STAGE_REPEAT)
        solved = p->layer;
    const double per_layer = solved > 0 ? pg->t_solve / solved : p->fwd_sources / p->n_layers / rate;
    return (p->fwd_total - p->fwd_done) / rate + (p->n_layers - solved) * per_layer;
}

/* Seconds the run has left: this document's, then the rest at the rate of the run so far (tokens,
 * or documents when their tokens are not known: then a document holds more than its compaction,
 * and the finished ones' mean time is the measure once there are any); -1: nothing to go by. */
static double run_left(const cli_progress *pg, double left) {
    const double now = cli_now(), el = now - pg->t0;
    const int by_tokens = pg->tokens_total > 0;
    if (!by_tokens && pg->total <= 0)
        return -1;
    if (!by_tokens && pg->finished > 0) {
        const double rest = (pg->total - pg->finished) * (pg->t_doc - pg->t0) / pg->finished - (now - pg->t_doc);
        return rest > left ? rest : left > 0 ? left : 0;
    }
    const double all = by_tokens ? (double)pg->tokens_total : pg->total;
    double through = by_tokens ? (double)pg->tokens_done : pg->finished; /* units finished */
    if (left < 0) /* no estimate for this document: the finished ones' rate */
        return through > 0 ? (all - through) * el / through : -1;
    through += by_tokens ? (double)pg->doc_tokens : 1;
    return through > 0 ? left + (all > through ? all - through : 0) * (el + left) / through : -1;
}

/* The document's step: the command's note, or the library's latest. */
static void step_text(const cli_progress *pg, char *s, size_t n) {
    const kf_progress *p = &pg->last;
    if (pg->note[0])
        snprintf(s, n, "%s", pg->note);
    else if (!pg->steps)
        snprintf(s, n, "starting");
    else if (p->stage == KF_STAGE_PREFILL)
        snprintf(s, n, "prefill %lld/%lld tokens", (long long)p->done, (long long)p->total);
    else
        snprintf(s, n, "%s layer %d/%d, %lld/%lld %s", kf_stage_name(p->stage), p->layer + 1, p->n_layers,
                 (long long)p->done, (long long)p->total, p->stage == KF_STAGE_SOLVE ? "heads" : "tokens");
}

/* "i/N": the document's place in the run ("i" when the run's count is not known). */
static void doc_at(const cli_progress *pg, char *s, size_t n) {
    if (pg->total > 0)
        snprintf(s, n, "%d/%d", pg->finished + 1, pg->total);
    else
        snprintf(s, n, "%d", pg->finished + 1);
}

/* The line's width on the terminal (80 when it does not say). */
static int columns(void) {
    struct winsize ws;
    return ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 10 ? ws.ws_col : 80;
}

/* "i/N name: step, ETA t | run ETA t", cut at the terminal's width (the run's part goes first). */
static void draw(cli_progress *pg, double now) {
    char step[160], left[32], run[32], line[512];
    step_text(pg, step, sizeof step);
    const double dl = pg->note[0] ? -1 : doc_left(pg);
    fmt_duration(dl, left, sizeof left);
    fmt_duration(run_left(pg, dl), run, sizeof run);
    char at[32];
    doc_at(pg, at, sizeof at);
    int n = snprintf(line, sizeof line, "%s %s: %s%s%s", at, pg->name, step, pg->note[0] ? "" : ", ETA ",
                     pg->note[0] ? "" : left);
    n = n < (int)sizeof line ? n : (int)sizeof line - 1;
    if (pg->total != 1)
        n += snprintf(line + n, sizeof line - (size_t)n, " | run ETA %s", run);
    n = n < (int)sizeof line ? n : (int)sizeof line - 1;
    const int cols = columns() - 1; /* a wrapped line would not be redrawn in place */
    if (n > cols) {
        n = cols;
        while (n > 0 && ((unsigned char)line[n] & 0xc0) == 0x80) /* not inside a UTF-8 character */
            n--;
    }
    fprintf(stderr, "\r\033[K%.*s", n, line);
    fflush(stderr);
    g_drawn = 1;
    pg->t_draw = now;
}

static void log_line(cli_progress *pg, double now) {
    char step[160], el[32], left[32], run[32];
    step_text(pg, step, sizeof step);
    const double dl = pg->note[0] ? -1 : doc_left(pg);
    fmt_duration(now - pg->t_doc, el, sizeof el);
    fmt_duration(dl, left, sizeof left);
    fmt_duration(run_left(pg, dl), run, sizeof run);
    char at[32];
    doc_at(pg, at, sizeof at);
    fprintf(stderr, "%s %s %s: %s; %s", pg->tag, at, pg->label, step, el);
    if (!pg->note[0])
        fprintf(stderr, ", ETA %s", left);
    if (pg->total != 1)
        fprintf(stderr, " (run ETA %s)", run);
    fputc('\n', stderr);
    pg->t_log = now;
}

void cli_progress_doc(cli_progress *pg, const char *source, const char *name, int64_t tokens) {
    /* escaped (formats/escape.h): a manifest's ids and paths cannot act on the terminal */
    char src[160], nm[160];
    kf_escape(source, src, sizeof src);
    kf_escape(name, nm, sizeof nm);
    snprintf(pg->label, sizeof pg->label, "%.90s%s%.90s%s", src, *nm ? " (" : "", nm, *nm ? ")" : "");
    snprintf(pg->name, sizeof pg->name, "%.63s", *nm ? nm : src);
    pg->doc_tokens = tokens;
    pg->t_doc = pg->t_last = cli_now();
    pg->t_fwd = pg->t_solve = 0;
    pg->steps = 0;
    pg->note[0] = 0;
    if (pg->tty)
        draw(pg, pg->t_doc);
}

void cli_progress_fn(void *user, const kf_progress *p) {
    cli_progress *pg = user;
    const double now = cli_now(), dt = now - pg->t_last;
    pg->t_last = now; /* the time since the last call went into this step */
    if (p->stage == KF_STAGE_SOLVE)
        pg->t_solve += dt;
    else
        pg->t_fwd += dt;
    pg->last = *p;
    pg->steps++;
    pg->note[0] = 0;
    const int step_end = p->stage == KF_STAGE_PREFILL || p->done == p->total;
    if (pg->tty && (step_end || now - pg->t_draw >= REDRAW_S))
        draw(pg, now);
    else if (!pg->tty && !pg->quiet && step_end && (pg->interval <= 0 || now - pg->t_log >= pg->interval))
        log_line(pg, now);
}

void cli_progress_note(cli_progress *pg, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pg->note, sizeof pg->note, fmt, ap);
    va_end(ap);
    const double now = cli_now();
    pg->t_last = now; /* the command's own work is not the compaction's */
    if (pg->tty)
        draw(pg, now);
    else if (!pg->quiet && (pg->interval <= 0 || now - pg->t_log >= pg->interval))
        log_line(pg, now);
}

void cli_progress_clear(const cli_progress *pg) {
    if (pg->tty)
        clear_drawn();
}
