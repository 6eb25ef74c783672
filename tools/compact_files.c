/* compact_files.c — the files of `kvfold compact`'s documents (compact_files.h). */
#include "tools/compact_files.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "compactor/cache_io.h"
#include "compactor/recipe.h"
#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/doc_chat.h"

#define CMD "compact"
#define STALE_TEMP_S 3600.0 /* a temporary file older than this is a killed writer's */

void job_doc_free(job_doc *d) {
    free(d->files);
    free(d->ids);
    free(d->instr);
    for (int i = 0; i < d->n_probes; i++)
        free((void *)d->probes[i].ids);
    free(d->probes);
}


job_doc *doc_list_add(doc_list *l) {
    if (l->n == l->cap) {
        const int cap = l->cap ? l->cap * 2 : 64;
        job_doc *g = realloc(l->docs, sizeof *g * (size_t)cap);
        if (!g)
            return NULL;
        l->docs = g;
        l->cap = cap;
    }
    job_doc *d = &l->docs[l->n++];
    memset(d, 0, sizeof *d);
    return d;
}

/* The progress line on a terminal is redrawn in place; messages first clear it. */
int compact_tty;
void compact_clear_line(void) {
    if (compact_tty)
        fputs("\r\033[K", stderr);
}

/* A document's message; its source, name and message (paths, ids) escaped. */
void doc_fail(const char *source, const char *name, const char *msg) {
    compact_clear_line();
    if (name && *name)
        fprintf(stderr, "kvfold " CMD ": %s (%s): %s\n", KF_ESC(source), KF_ESC(name), KF_ESC(msg));
    else
        fprintf(stderr, "kvfold " CMD ": %s: %s\n", KF_ESC(source), KF_ESC(msg));
}

/* The lock file of path, opened without following a symlink: created exclusively when new, else
 * the existing one, which must be a regular file. The descriptor, or -1 with the cause in err. */
static int open_lock(const char *lock, char *err, size_t err_len) {
    for (int tries = 0; tries < 100; tries++) {
        int fd = open(lock, O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
        if (fd < 0 && errno == EEXIST) {
            fd = open(lock, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC); /* another worker's */
            if (fd < 0 && errno == ENOENT)
                continue; /* its holder removed it meanwhile: create it again */
        }
        if (fd < 0 && errno != ELOOP && errno != EISDIR && errno != ENXIO) {
            snprintf(err, err_len, "cannot create the lock file %.900s: %s", lock, strerror(errno));
            return -1;
        }
        struct stat sb;
        if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
            snprintf(err, err_len,
                     "the lock file %.900s is not a regular file (a symbolic link, directory, FIFO or device): "
                     "refused; remove it",
                     lock);
            if (fd >= 0)
                close(fd);
            return -1;
        }
        return fd;
    }
    snprintf(err, err_len, "cannot create the lock file %.900s: removed again on every try", lock);
    return -1;
}

/* Claims a document for this worker: an flock on <path>.lock. 1: claimed (*fd holds it), 0: another
 * worker holds it, -1: error (its cause in err). */
static int claim(const char *path, int *fd, char *err, size_t err_len) {
    char lock[PATH_MAX + 8];
    snprintf(lock, sizeof lock, "%s.lock", path);
    if ((*fd = open_lock(lock, err, err_len)) < 0)
        return -1;
    if (flock(*fd, LOCK_EX | LOCK_NB) == 0)
        return 1;
    const int e = errno;
    close(*fd);
    *fd = -1;
    if (e == EWOULDBLOCK)
        return 0;
    snprintf(err, err_len, "cannot lock %.900s: %s", lock, strerror(e));
    return -1;
}

/* The file is in place (or the work failed): drop the lock file while still holding it, so a
 * worker that opened it meanwhile finds the finished file when it gets the lock. */
static void unclaim(const char *path, int fd) {
    char lock[PATH_MAX + 8];
    snprintf(lock, sizeof lock, "%s.lock", path);
    unlink(lock);
    close(fd);
}


/* What the file of variant var of d must be to be skipped: its whole identity, not its name alone
 * (a file copied over another's name, or a header at odds with it, is compacted again). */
static kvf_identity file_identity(const job_doc *d, const job_file *f, const kf_compact_variant *var,
                                  const file_ids *ids) {
    return (kvf_identity){ids->fp, d->digest, f->recipe, var->method, var->budget, ids->dtype, d->n};
}

/* Whether the file f stands for (identity want) is already there and valid: KF_OK; nothing there:
 * KF_ERR_NOTFOUND; a file that cannot stand for it: reported once and marked to be replaced. */
static kf_status file_found(const job_doc *d, job_file *f, const kvf_identity *want) {
    kf_error e = {0};
    const kf_status st = kvf_check_existing(f->path, want, &e);
    if (st != KF_OK && st != KF_ERR_NOTFOUND && !f->replaced) {
        char msg[sizeof e.msg + 64];
        snprintf(msg, sizeof msg, "%s: compacting it again", e.msg);
        doc_fail(d->source, d->name, msg);
        f->replaced = 1;
    }
    return st;
}

/* Each variant's recipe and path, and whether a valid file is already there; 0 when some file is
 * to compute, 1 when none is (d skipped), -1 when a path cannot be made (d failed, reported). */
int doc_files(job_doc *d, const kf_compact_params *dp, const kf_compact_variant *vars, int n_vars,
              const file_ids *ids) {
    int todo = 0;
    for (int v = 0; v < n_vars; v++) {
        job_file *f = &d->files[v];
        kf_compact_params vp = *dp;
        vp.method = vars[v].method;
        vp.budget = vars[v].budget;
        kf_recipe_digest(&vp, ids->dtype, ids->n_head_budgets, f->recipe);
        kf_error e = {0};
        if (kvf_cache_path(ids->root, ids->fp, d->digest, vp.method, vp.budget, f->recipe, true,
                           f->path, sizeof f->path, &e) != KF_OK) {
            doc_fail(d->source, d->name, e.msg);
            d->state = ST_FAILED;
            return -1;
        }
        const kvf_identity want = file_identity(d, f, &vars[v], ids);
        f->state = file_found(d, f, &want) == KF_OK ? ST_SKIPPED : ST_TODO;
        todo += f->state == ST_TODO;
    }
    if (!todo)
        d->state = ST_SKIPPED;
    return todo ? 0 : 1;
}

int any_file(const job_doc *d, int n_vars, int state) {
    for (int v = 0; v < n_vars; v++)
        if (d->files[v].state == state)
            return 1;
    return 0;
}

/* Claims every file still to compute: those another worker holds become ST_BUSY, those now valid
 * ST_SKIPPED; the number claimed (left ST_TODO with their lock), or -1 with err when a lock file
 * cannot be created (nothing left claimed). */
int claim_files(job_doc *d, const kf_compact_variant *vars, int n_vars, const file_ids *ids, char *err,
                size_t err_len) {
    int n = 0;
    for (int v = 0; v < n_vars; v++) {
        job_file *f = &d->files[v];
        if (f->state != ST_TODO)
            continue;
        const int c = claim(f->path, &f->fd, err, err_len);
        if (c < 0) {
            for (int u = 0; u < v; u++)
                if (d->files[u].state == ST_TODO)
                    unclaim(d->files[u].path, d->files[u].fd);
            return -1;
        }
        const kvf_identity want = file_identity(d, f, &vars[v], ids);
        if (c == 0 || file_found(d, f, &want) == KF_OK) {
            if (c > 0)
                unclaim(f->path, f->fd);
            f->state = c ? ST_SKIPPED : ST_BUSY;
            continue;
        }
        n++;
    }
    return n;
}

/* Writes the claimed files' caches cc (in variant order; st: their compaction's status), frees
 * them and releases every claim; the first failure. */
kf_status write_files(job_doc *d, int n_vars, kf_compacted *cc, kf_status st, const file_ids *ids,
                      const char *tokenizer_digest, const struct doc_chat *chat, kf_error *e) {
    kf_status first = st;
    for (int v = 0, i = 0; v < n_vars; v++) {
        job_file *f = &d->files[v];
        if (f->state != ST_TODO)
            continue;
        kf_status fs = st;
        kf_error we = {0};
        if (st == KF_OK) {
            kvf_cache kc;
            kf_compacted_to_kvf(&cc[i], &kc);
            kc.hdr.dtype = ids->dtype;
            snprintf(kc.hdr.model_fingerprint, sizeof kc.hdr.model_fingerprint, "%s", ids->fp);
            snprintf(kc.hdr.tokenizer_digest, sizeof kc.hdr.tokenizer_digest, "%s", tokenizer_digest);
            snprintf(kc.hdr.document_digest, sizeof kc.hdr.document_digest, "%s", d->digest);
            snprintf(kc.hdr.recipe_digest, sizeof kc.hdr.recipe_digest, "%s", f->recipe);
            if (chat) /* a chat cache: its template's digest and the ids around the document */
                doc_chat_record(chat, &kc.hdr);
            fs = kvf_write(f->path, &kc, &we);
            f->C = cc[i].C;
            kf_compacted_free(&cc[i++]);
        }
        unclaim(f->path, f->fd);
        f->state = fs == KF_OK ? ST_DONE : ST_FAILED;
        if (first == KF_OK && fs != KF_OK) {
            first = fs;
            *e = we;
        }
    }
    return first;
}

static int make_dirs(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, 0777) && errno != EEXIST)
                return -1;
            *p = '/';
        }
    return mkdir(buf, 0777) && errno != EEXIST ? -1 : 0;
}

/* The root must take files before any work starts. */
int compact_check_root(const char *root) {
    if (make_dirs(root)) {
        cli_error(CMD, "cannot create the output root %s: %s", root, strerror(errno));
        return -1;
    }
    struct stat st;
    if (stat(root, &st) || !S_ISDIR(st.st_mode)) {
        cli_error(CMD, "the output root %s is not a directory", root);
        return -1;
    }
    char probe[PATH_MAX];
    snprintf(probe, sizeof probe, "%s/.kvfold-write-test-XXXXXX", root);
    const int fd = mkstemp(probe);
    if (fd < 0) {
        cli_error(CMD, "cannot write to the output root %s: %s", root, strerror(errno));
        return -1;
    }
    close(fd);
    unlink(probe);
    return 0;
}

static void report_stale(void *ctx, const char *path, double age_s) {
    if (!*(const int *)ctx)
        fprintf(stderr, "[compact] removing a killed writer's temporary file (%.1f h old): %s\n", age_s / 3600,
                KF_ESC(path));
}
void compact_clean_stale_temps(const char *dir, int quiet) {
    kf_error e = {0};
    const kf_status st = kvf_clean_temps(dir, STALE_TEMP_S, false, report_stale, &quiet, NULL, &e);
    if (st != KF_OK && st != KF_ERR_NOTFOUND) /* no directory yet: nothing to clean */
        cli_error(CMD, "warning: %s", e.msg);
}

/* One comma-separated list item of --method or --budget (0), or -1 (reported). */
static int parse_method(const char *tok, kf_method *m) {
    return kf_method_parse(tok, m) ? (cli_usage_error(CMD, "--method is keep, drop, am or fold, not '%s'", tok), -1) : 0;
}

static int parse_budget(const char *tok, double *b) {
    char *end;
    errno = 0;
    *b = strtod(tok, &end);
    if (end == tok || *end || errno || !(*b > 0 && *b <= 1))
        return cli_usage_error(CMD, "--budget must be a fraction in (0, 1], not '%s'", tok), -1;
    return 0;
}

/* The next item of a comma-separated list at *p (cut in place); NULL at the end. An empty item
 * ("0.5,,0.1", a leading or trailing comma) is returned as "" for the caller to refuse. */
static char *next_item(char **p) {
    if (!*p)
        return NULL;
    char *item = *p, *comma = strchr(item, ',');
    *p = comma ? comma + 1 : NULL;
    if (comma)
        *comma = 0;
    return item;
}

/* --method and --budget lists: every (method, budget) pair into v [MAX_VARIANTS], methods outer;
 * their count, or -1 (reported). */
int compact_parse_variants(const char *methods_s, const char *budgets_s, kf_compact_variant *v) {
    kf_method ms[MAX_VARIANTS];
    double bs[MAX_VARIANTS];
    int nm = 0, nb = 0;
    char buf[1024], *p = buf;
    snprintf(buf, sizeof buf, "%s", methods_s);
    for (char *tok; (tok = next_item(&p));) {
        if (nm == MAX_VARIANTS)
            return cli_usage_error(CMD, "--method: at most %d", MAX_VARIANTS), -1;
        if (!*tok)
            return cli_usage_error(CMD, "--method '%s' has an empty item", methods_s), -1;
        if (parse_method(tok, &ms[nm++]))
            return -1;
    }
    snprintf(buf, sizeof buf, "%s", budgets_s);
    p = buf;
    for (char *tok; (tok = next_item(&p));) {
        if (nb == MAX_VARIANTS)
            return cli_usage_error(CMD, "--budget: at most %d", MAX_VARIANTS), -1;
        if (!*tok)
            return cli_usage_error(CMD, "--budget '%s' has an empty item", budgets_s), -1;
        if (parse_budget(tok, &bs[nb++]))
            return -1;
    }
    if (nm == 0)
        return cli_usage_error(CMD, "--method is keep, drop, am or fold, not '%s'", methods_s), -1;
    if (nb == 0)
        return cli_usage_error(CMD, "--budget must be a fraction in (0, 1], not '%s'", budgets_s), -1;
    if (nm * nb > MAX_VARIANTS)
        return cli_usage_error(CMD, "at most %d (method, budget) pairs, not %d", MAX_VARIANTS, nm * nb), -1;
    for (int i = 0; i < nm * nb; i++) {
        v[i] = (kf_compact_variant){ms[i / nb], bs[i % nb]};
        for (int j = 0; j < i; j++)
            if (v[j].method == v[i].method && v[j].budget == v[i].budget)
                return cli_usage_error(CMD, "(method, budget) %s %g given twice", kf_method_name(v[i].method),
                                       v[i].budget), -1;
    }
    return nm * nb;
}
