/* kvfold compact — the offline job: documents in, one kvf cache file per document out. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "compactor/cache_io.h"
#include "compactor/compact.h"
#include "compactor/prefix_plan.h"
#include "compactor/recipe.h"
#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/cli_quality.h"
#include "tools/commands.h"
#include "tools/doc_chat.h"
#include "tools/doc_input.h"
#include "tools/manifest.h"
#include "tools/progress.h"

#define CMD "compact"
#define DEFAULT_INSTRUCTION "Repeat the previous context verbatim.\n"
#define DEFAULT_CHAT_INSTRUCTION "Repeat the previous context verbatim." /* a user turn's content */
#define DEFAULT_ROOT "kvf-cache"
/* Writers' temporary files (kvf_write: <file>.tmp-<pid>-<hex>) older than this are a killed
 * writer's and are removed when a job starts. A live writer's temporary file exists only inside
 * kvf_write, whose every write refreshes its mtime; the longest stretch without one is the final
 * fsync and rename (seconds, minutes on a slow shared filesystem). An hour leaves a wide margin for
 * that and for clock skew between the machines that share a root, so a concurrent writer's file is
 * never taken; the price is that a killed writer's file can outlive it by up to an hour. */
#define STALE_TEMP_S 3600.0

static const char kHelp[] =
    "Usage: kvfold compact --model DIR [options] FILE...\n"
    "       kvfold compact --model DIR [options] --manifest DOCS.jsonl [--shard i/N]\n"
    "\n"
    "Compacts each document's KV cache and writes one kvf file per document to\n"
    "  ROOT/<model fingerprint>/<document digest>.<method>-<budget>.<recipe>.kvf\n"
    "(content-addressed: <recipe> is the first 16 hex digits of the digest of every setting that\n"
    "changes the bytes: method, budget, lambda, dtype, repeat instruction, probes, query cap, seed,\n"
    "QUOKA and prefill chunk, head budgets, the beta fit, value ridge and per-head choice\n"
    "settings, the reference queries' dtype, the file format's version; compactor/recipe.h).\n"
    "A document whose file already exists with the same recipe and whose every checksum and\n"
    "payload digest hold is skipped, so the job can be rerun or resumed.\n"
    "Files appear atomically (temporary name, fsync, rename); several workers may run on the same\n"
    "manifest and root at once (also on different machines sharing the root): a document being\n"
    "compacted holds an flock on '<file>.lock' and the others pass it by ('busy'). A failed write\n"
    "(a full disk, a file size limit, any I/O error) leaves no partial file and counts the document\n"
    "as failed. Temporary files of killed writers older than an hour are removed when a job starts.\n"
    "\n"
    "Documents:\n"
    "  FILE...              text files, one document each (UTF-8, tokenized with the model's\n"
    "                       tokenizer.json, with its special tokens such as a BOS); always text,\n"
    "                       also when it looks like JSON: token ids come from a --manifest line\n"
    "                       (\"ids\"). Named by the file name in messages\n"
    "  --manifest FILE      JSONL, one document per line: \"ids\" (token ids) or \"text\"; optional\n"
    "                       \"id\" (a name for messages), \"probes\" (a list of question-like prompts,\n"
    "                       each a text or a list of ids), \"repeat_instruction_ids\" or\n"
    "                       \"repeat_instruction\" (overrides --repeat-instruction). Blank lines are\n"
    "                       ignored. A bad line (not JSON, empty, ids outside the vocabulary, too\n"
    "                       long for the model, longer than --max-line-bytes, holding a NUL byte,\n"
    "                       too large for memory) is reported as FILE:LINE, counted as failed,\n"
    "                       and the job goes on with the next line. A device is refused (exit 2)\n"
    "  --max-line-bytes N   the longest line read from --manifest and --probes-from (default\n"
    "                       67108864, 64 MiB: a document of millions of tokens)\n"
    "  --shard i/N          only the documents whose 0-based line number in the manifest (or\n"
    "                       position among the FILE arguments) modulo N equals i: the N shards\n"
    "                       i = 0..N-1 cover the input exactly once, whatever runs where\n"
    "                       (Slurm: --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)\n"
    "\n"
    "Compaction:\n"
    "  --model DIR          model directory (config.json, safetensors, tokenizer.json)\n"
    "  --method M[,M...]    keep, drop, am or fold (default fold)\n"
    "  --budget B[,B...]    kept fraction of each document, in (0, 1] (default 0.1). Several\n"
    "                       methods or budgets write one file per (method, budget) and document,\n"
    "                       each the file a run with that single pair writes; the prefill,\n"
    "                       reference queries and targets are computed once per document\n"
    "  --out ROOT           root directory of the cache files (default " DEFAULT_ROOT ")\n"
    "  --repeat-instruction TEXT\n"
    "                       the instruction between the document and its repeat, whose queries\n"
    "                       drive the compaction (default \"Repeat the previous context verbatim.\\n\";\n"
    "                       for a chat model pass its chat-template form of that request, or --chat)\n"
    "  --chat               through the model's chat template (tokenizer_config.json): each document\n"
    "                       is the content of the first user turn (text rendered by the template;\n"
    "                       ids follow the template's beginning), the repeat instruction a second\n"
    "                       user turn's content (default \"" DEFAULT_CHAT_INSTRUCTION "\") and the\n"
    "                       repeat the assistant's turn, each probe a second user turn's content\n"
    "                       followed by the generation prompt. The file records the template's\n"
    "                       digest and the ids around the document (kvfold inspect; kvfold ask\n"
    "                       --chat). A model without a chat template is a usage error\n"
    "  --probes-from FILE   extra probe prompts for every document: one JSON value per line, a\n"
    "                       string (text) or a list of token ids (read whole before any work: a\n"
    "                       file that cannot be read, a line that cannot be parsed, is too long or\n"
    "                       holds a NUL byte is a usage error and nothing is compacted)\n"
    "  --lambda X           fold ridge, relative to tr(Sigma)/d (default 0.01)\n"
    "  --max-queries N      pooled reference queries per KV head (default 50000)\n"
    "  --chunk N            prefill chunk size (default 512)\n"
    "  --dtype T            bf16, f16 or f32 in the file (default: the model's torch_dtype, else bf16)\n"
    CLI_QUALITY_HELP
    CLI_PREFILL_HELP
    "\n"
    "Prefix sharing (Quail): the documents are compacted in sorted token order; a document that\n"
    "begins like its predecessor takes the whole 16-token pages of the common prefix from it\n"
    "instead of prefilling them again (QUOKA prefill: whole chunks, so chunk boundaries stay put).\n"
    "The last token is always computed; sharing is used only when the estimated compute saved\n"
    "exceeds the extra KV kept. The summary reports tokens computed against tokens without sharing.\n"
    "  --no-share           prefill every document whole\n"
    "\n"
    "Output: progress on stderr, the summary on stdout (done, skipped, busy, failed, tokens,\n"
    "compression, time). On a terminal the progress is one line redrawn in place: the document\n"
    "(i/N), its stage (prefill tokens i/n; repeat layer i/L, the reference sources' tokens through\n"
    "it; solve layer i/L, its KV heads solved), the time its compaction has left (the forwards at\n"
    "the rate measured so far, the layers still to solve at their measured time) and the run's.\n"
    "Otherwise (a log) a line per stage as it ends (every prefill chunk, repeat layer and solve\n"
    "layer, at most one every --progress-interval seconds) and one per file written. The exit\n"
    "status is 1 when any document failed, 2 for usage errors (including a --manifest or\n"
    "--probes-from that cannot be read).\n"
    CLI_PROGRESS_HELP
    "  -q, --quiet          no progress: only errors and the summary\n"
    "  -h, --help           show this help\n";

enum { ST_TODO, ST_SKIPPED, ST_BUSY, ST_DONE, ST_FAILED };
#define MAX_VARIANTS 16

/* One output file of a document: one (method, budget) variant. */
typedef struct {
    char path[PATH_MAX];
    char recipe[KVF_DIGEST_LEN + 1]; /* kf_recipe_digest of this file's parameters */
    int state;                       /* ST_TODO (to compute; claimed in the compact pass), ST_SKIPPED, ... */
    int fd;                          /* the lock while claimed */
    int replaced;                    /* a file was there that could not stand for this one */
    int64_t C;
} job_file;

typedef struct {
    char source[PATH_MAX + 32]; /* "docs.jsonl:12" or the text file's path */
    char name[128];             /* "id" or the file name */
    char digest[KVF_DIGEST_LEN + 1]; /* kvf_document_digest of ids, from the identity pass */
    int32_t *ids;               /* [n] */
    int n;
    int32_t *instr;             /* [n_instr] this document's repeat instruction, or NULL: the default */
    int n_instr;
    kf_prompt *probes;          /* [n_probes] (ids owned) */
    int n_probes;
    job_file *files;            /* [n_variants], or NULL before the identity pass */
    int state;
} job_doc;

static void job_doc_free(job_doc *d) {
    free(d->files);
    free(d->ids);
    free(d->instr);
    for (int i = 0; i < d->n_probes; i++)
        free((void *)d->probes[i].ids);
    free(d->probes);
}

typedef struct {
    job_doc *docs;
    int n, cap;
    int n_failed_input; /* lines or files that never became documents */
} doc_list;

static job_doc *doc_list_add(doc_list *l) {
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
static int g_tty;
static void clear_line(void) {
    if (g_tty)
        fputs("\r\033[K", stderr);
}

/* A document's message; its source, name and message (paths, ids) escaped. */
static void doc_fail(const char *source, const char *name, const char *msg) {
    clear_line();
    if (name && *name)
        fprintf(stderr, "kvfold " CMD ": %s (%s): %s\n", KF_ESC(source), KF_ESC(name), KF_ESC(msg));
    else
        fprintf(stderr, "kvfold " CMD ": %s: %s\n", KF_ESC(source), KF_ESC(msg));
}

/* One manifest line into d; 0, or -1 with the reason in err. */
static int chat_turns(const doc_chat *c, job_doc *d, char *err, size_t err_len);
static int parse_line(doc_text *t, const char *line, job_doc *d, char *err, size_t err_len) {
    manifest_doc md;
    int rc = manifest_parse_line(t, line, &md, err, err_len);
    memcpy(d->name, md.name, sizeof d->name);
    d->ids = md.ids;
    d->n = md.n;
    d->instr = md.instr;
    d->n_instr = md.n_instr;
    d->probes = md.probes;
    d->n_probes = md.n_probes;
    if (rc == 0 && t->chat)
        rc = chat_turns(t->chat, d, err, err_len);
    return rc;
}

/* ids replaced by the user turn around them (wrap: doc_chat_question or doc_chat_instruction). */
static int wrap_turn(const doc_chat *c, int (*wrap)(const doc_chat *, const int32_t *, int, int32_t **, int *),
                     int32_t **ids, int *n) {
    int32_t *w = NULL;
    int nw = 0;
    if (wrap(c, *ids, *n, &w, &nw))
        return -1;
    free(*ids);
    *ids = w;
    *n = nw;
    return 0;
}

/* A manifest document's own instruction and probes as the chat's user turns. */
static int chat_turns(const doc_chat *c, job_doc *d, char *err, size_t err_len) {
    int bad = d->instr && wrap_turn(c, doc_chat_instruction, &d->instr, &d->n_instr);
    for (int i = 0; i < d->n_probes && !bad; i++)
        bad = wrap_turn(c, doc_chat_question, (int32_t **)&d->probes[i].ids, &d->probes[i].n);
    if (bad)
        snprintf(err, err_len, "out of memory");
    return bad ? -1 : 0;
}

/* Checks that apply to ids from anywhere: length against the model. */
static int check_doc(const kf_hfconfig *cfg, const job_doc *d, char *err, size_t err_len) {
    if (d->n < 1) {
        snprintf(err, err_len, "empty document");
        return -1;
    }
    if (cfg->max_position_embeddings > 0 && d->n > cfg->max_position_embeddings) {
        snprintf(err, err_len, "%d tokens: too long for the model (max_position_embeddings %d)", d->n,
                 cfg->max_position_embeddings);
        return -1;
    }
    return 0;
}

/* mkdir -p */
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
static int check_root(const char *root) {
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

static int parse_shard(const char *s, long long *i, long long *n) {
    char *end;
    errno = 0;
    *i = strtoll(s, &end, 10);
    if (end == s || *end != '/' || errno)
        return -1;
    const char *q = end + 1;
    *n = strtoll(q, &end, 10);
    if (end == q || *end || errno || *n < 1 || *i < 0 || *i >= *n)
        return -1;
    return 0;
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

/* Opens the file an option names (--manifest, --probes-from) for reading; one that cannot be opened,
 * a directory (which fopen accepts) or a device (/dev/zero: one endless line) is a usage error:
 * prints it and returns NULL. Files and pipes are read. */
static FILE *open_input(const char *opt, const char *path) {
    FILE *f = fopen(path, "r");
    struct stat st;
    const char *why = NULL;
    if (f && fstat(fileno(f), &st) == 0 && (S_ISDIR(st.st_mode) || S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))) {
        why = S_ISDIR(st.st_mode) ? strerror(EISDIR) : "a device, not a file or a pipe";
        fclose(f);
        f = NULL;
    }
    if (!f)
        cli_usage_error(CMD, "%s %s: cannot read: %s", opt, path, why ? why : strerror(errno));
    return f;
}

/* Removes killed writers' temporary files under dir (the model's directory of the root). */
static void report_stale(void *ctx, const char *path, double age_s) {
    if (!*(const int *)ctx)
        fprintf(stderr, "[compact] removing a killed writer's temporary file (%.1f h old): %s\n", age_s / 3600,
                KF_ESC(path));
}
static void clean_stale_temps(const char *dir, int quiet) {
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
static int parse_variants(const char *methods_s, const char *budgets_s, kf_compact_variant *v) {
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

static kvf_dtype model_dtype(const kf_hfconfig *cfg) {
    kvf_dtype d;
    return kvf_dtype_parse(cfg->dtype, &d) == 0 ? d : KVF_BF16;
}

/* What names a document's files and goes into their headers. */
typedef struct {
    const char *root, *fp; /* cache root, model fingerprint */
    kvf_dtype dtype;
    int64_t n_head_budgets;
} file_ids;

/* What the file of variant var of d must be to be skipped: its whole identity, not its name alone
 * (a file copied over another's name, or a header at odds with it, is compacted again). */
static kvf_identity file_identity(const job_doc *d, const job_file *f, const kf_compact_variant *var,
                                  const file_ids *ids) {
    return (kvf_identity){ids->fp, d->digest, f->recipe, kf_method_to_kvf(var->method), var->budget, ids->dtype, d->n};
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
static int doc_files(job_doc *d, const kf_compact_params *dp, const kf_compact_variant *vars, int n_vars,
                     const file_ids *ids) {
    int todo = 0;
    for (int v = 0; v < n_vars; v++) {
        job_file *f = &d->files[v];
        kf_compact_params vp = *dp;
        vp.method = vars[v].method;
        vp.budget = vars[v].budget;
        kf_recipe_digest(&vp, ids->dtype, ids->n_head_budgets, f->recipe);
        kf_error e = {0};
        if (kvf_cache_path(ids->root, ids->fp, d->digest, kf_method_to_kvf(vp.method), vp.budget, f->recipe, true,
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

static int any_file(const job_doc *d, int n_vars, int state) {
    for (int v = 0; v < n_vars; v++)
        if (d->files[v].state == state)
            return 1;
    return 0;
}

/* Claims every file still to compute: those another worker holds become ST_BUSY, those now valid
 * ST_SKIPPED; the number claimed (left ST_TODO with their lock), or -1 with err when a lock file
 * cannot be created (nothing left claimed). */
static int claim_files(job_doc *d, const kf_compact_variant *vars, int n_vars, const file_ids *ids, char *err,
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
static kf_status write_files(job_doc *d, int n_vars, kf_compacted *cc, kf_status st, const file_ids *ids,
                             const char *tokenizer_digest, const doc_chat *chat, kf_error *e) {
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
            if (chat)
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

/* ---- the command line ---- */

/* kvfold compact's options as given. */
typedef struct {
    const char *model_dir, *root, *manifest, *probes_from, *instruction, *methods_s, *budgets_s;
    long long shard_i, shard_n;
    long long max_line;                    /* --max-line-bytes */
    int share, quiet, dtype_given, chat;
    double progress_interval;              /* --progress-interval: seconds between log lines */
    kvf_dtype dtype;
    cli_compact_opts q;                    /* the compaction's parameters (shared with eval quality) */
    kf_compact_variant vars[MAX_VARIANTS]; /* [n_vars] (method, budget) pairs, methods outer */
    int n_vars;
    char **files;                          /* [n_files] the FILE arguments */
    int n_files;
} compact_opts;

static const struct option kOpts[] = {
    {"help", no_argument, 0, 'h'},
    {"model", required_argument, 0, 'm'},
    {"method", required_argument, 0, 'M'},
    {"budget", required_argument, 0, 'b'},
    {"out", required_argument, 0, 'o'},
    {"manifest", required_argument, 0, 'f'},
    {"shard", required_argument, 0, 's'},
    {"repeat-instruction", required_argument, 0, 'r'},
    {"probes-from", required_argument, 0, 'p'},
    {"dtype", required_argument, 0, 't'},
    {"no-share", no_argument, 0, 'S'},
    {"quiet", no_argument, 0, 'q'},
    CLI_PROGRESS_OPTION,
    {"max-line-bytes", required_argument, 0, 'L'},
    {"chat", no_argument, 0, 'c'},
    CLI_COMPACT_OPTIONS,
    {0, 0, 0, 0}};

/* One option into o: CLI_CONTINUE, or the exit status (--help, a bad value). */
static int compact_option(void *ctx, int c, const char *arg) {
    compact_opts *o = ctx;
    switch (c) {
    case 'h': fputs(kHelp, stdout); return KF_EXIT_OK;
    case 'm': o->model_dir = arg; break;
    case 'M': o->methods_s = arg; break;
    case 'b': o->budgets_s = arg; break;
    case 'o': o->root = arg; break;
    case 'f': o->manifest = arg; break;
    case 's':
        if (parse_shard(arg, &o->shard_i, &o->shard_n))
            return cli_usage_error(CMD, "--shard is i/N with 0 <= i < N, not '%s'", arg);
        break;
    case 'r':
        if (!*arg) /* checked here: documents with their own instruction never tokenize it */
            return cli_usage_error(CMD, "--repeat-instruction must not be empty");
        o->instruction = arg;
        break;
    case 'p': o->probes_from = arg; break;
    case 't':
        if (kvf_dtype_parse(arg, &o->dtype))
            return cli_usage_error(CMD, "--dtype is bf16, f16 or f32, not '%s'", arg);
        o->dtype_given = 1;
        break;
    case 'S': o->share = 0; break;
    case 'q': o->quiet = 1; break;
    case 'c': o->chat = 1; break;
    case CLI_OPT_PROGRESS_INTERVAL:
        if (cli_progress_interval(CMD, arg, &o->progress_interval))
            return KF_EXIT_USAGE;
        break;
    case 'L':
        if (cli_parse_int(arg, 2, 1LL << 40, &o->max_line))
            return cli_usage_error(CMD, "--max-line-bytes must be a byte count from 2 to 2^40, not '%s'", arg);
        break;
    default: return cli_compact_option_or(CMD, c, arg, &o->q, "unknown option");
    }
    return CLI_CONTINUE;
}

/* After the options: the variants, then what is required; CLI_CONTINUE or the usage status. */
static int compact_validate(compact_opts *o) {
    if ((o->n_vars = parse_variants(o->methods_s, o->budgets_s, o->vars)) < 0)
        return KF_EXIT_USAGE;
    o->q.p.method = o->vars[0].method;
    o->q.p.budget = o->vars[0].budget;
    if (!o->model_dir)
        return cli_usage_error(CMD, "--model DIR is required");
    if (!o->manifest && o->n_files == 0)
        return cli_usage_error(CMD, "no documents: give text FILEs or --manifest DOCS.jsonl");
    if (o->manifest && o->n_files)
        return cli_usage_error(CMD, "give text FILEs or --manifest, not both");
    return CLI_CONTINUE;
}

static int compact_parse(int argc, char **argv, compact_opts *o) {
    *o = (compact_opts){.root = DEFAULT_ROOT, .instruction = DEFAULT_INSTRUCTION, .methods_s = "fold",
                        .budgets_s = "0.1", .shard_n = 1, .share = 1, .dtype = KVF_BF16,
                        .progress_interval = CLI_PROGRESS_DEFAULT_S,
                        .max_line = MANIFEST_MAX_LINE_DEFAULT};
    cli_compact_opts_init(&o->q);
    const int rc = cli_parse_options(argc, argv, "hq", kOpts, compact_option, o);
    if (rc != CLI_CONTINUE)
        return rc;
    o->files = argv + optind;
    o->n_files = argc - optind;
    return compact_validate(o);
}

/* ---- the job ---- */

/* One run: what the options opened and loaded, the documents, the plan, the tallies. The stages
 * return CLI_CONTINUE or the exit status to stop with; rc is the status of a run that goes on. */
typedef struct {
    const compact_opts *o;
    kf_compact_params base;  /* the options' parameters, the first variant's method and budget */
    int rc;
    FILE *mf, *pf;           /* --manifest, --probes-from until read */
    kf_backend *backend;
    kf_model *m;
    const kf_hfconfig *cfg;
    const char *fp;          /* the model's fingerprint */
    kvf_dtype dtype;         /* of the files */
    doc_text text;
    doc_chat chat;           /* --chat: the template's pieces (text.chat points here) */
    const char *tok_digest;  /* tokenizer.json's, "" when the model has none */
    double t_start;
    doc_list docs;
    kf_prompt *extra_probes; /* [n_extra] --probes-from's (ids owned) */
    int n_extra;
    kf_prompt *probes;       /* one document's probes (not owned; grown as needed) */
    int32_t *def_instr;      /* [n_def_instr] --repeat-instruction, tokenized when first needed */
    int n_def_instr;
    int n_todo;              /* documents with a file to compute */
    int64_t todo_tokens;
    int32_t *todo;           /* [n_todo] -> docs index */
    kf_prefix_plan plan;     /* over todo */
    int sharing;
    kf_arena arena;          /* one for the run: the kept predecessor, the document, its sources */
    cli_progress pg;         /* the run's progress on stderr (tools/progress.h) */
    kf_seq prev;             /* the predecessor's pages, kept when the next document shares them */
    int prev_k;              /* plan index whose pages prev holds, or -1 */
    int64_t computed, c_total, d_total, doc_tokens; /* d_total: over files */
    int n_done, n_busy;
    int n_replaced;          /* files written over one that could not stand for them */
} compact_job;

static void job_free(compact_job *j) {
    kf_prefix_plan_free(&j->plan);
    free(j->todo);
    free(j->def_instr);
    for (int i = 0; i < j->docs.n; i++)
        job_doc_free(&j->docs.docs[i]);
    free(j->docs.docs);
    for (int i = 0; i < j->n_extra; i++)
        free((void *)j->extra_probes[i].ids);
    free(j->extra_probes);
    free(j->probes);
    doc_text_free(&j->text);
    doc_chat_free(&j->chat);
    if (j->mf)
        fclose(j->mf);
    if (j->pf)
        fclose(j->pf);
    kf_model_free(j->m);
    if (j->backend)
        j->backend->destroy(j->backend);
}

/* base with d's repeat instruction and probes (its own, then --probes-from's) in j->probes;
 * -1 when out of memory. */
static int doc_params(compact_job *j, const job_doc *d, kf_compact_params *p) {
    *p = j->base;
    p->repeat_instruction =
        d->instr ? (kf_prompt){d->instr, d->n_instr} : (kf_prompt){j->def_instr, j->n_def_instr};
    kf_prompt *g = realloc(j->probes, sizeof *g * (size_t)(d->n_probes + j->n_extra + 1));
    if (!g)
        return -1;
    j->probes = g;
    for (int i = 0; i < d->n_probes; i++)
        g[i] = d->probes[i];
    for (int i = 0; i < j->n_extra; i++)
        g[d->n_probes + i] = j->extra_probes[i];
    p->probes = g;
    p->n_probes = d->n_probes + j->n_extra;
    return 0;
}

/* Inputs that cannot be read are usage errors, found before any work; then the root (one that
 * cannot take files stops the job before any work), the model, stale temporary files. */
static int job_open(compact_job *j) {
    const compact_opts *o = j->o;
    if (o->manifest && !(j->mf = open_input("--manifest", o->manifest)))
        return KF_EXIT_USAGE;
    if (o->probes_from && !(j->pf = open_input("--probes-from", o->probes_from)))
        return KF_EXIT_USAGE;
    /* a file size limit (RLIMIT_FSIZE) fails the write with EFBIG like a full disk, instead of
     * killing the job with SIGXFSZ before its summary */
    signal(SIGXFSZ, SIG_IGN);
    if (check_root(o->root) || !(j->m = cli_load_model(CMD, o->model_dir, &j->backend)))
        return KF_EXIT_FAIL;
    j->cfg = kf_model_config(j->m);
    j->fp = kf_model_fingerprint(j->m);
    j->dtype = o->dtype_given ? o->dtype : model_dtype(j->cfg);
    doc_text_init(&j->text, o->model_dir, j->cfg->vocab_size);
    j->tok_digest = doc_text_digest(&j->text); /* every file names its tokenizer, ids documents too */
    char err[1024];
    if (o->chat && doc_chat_open(&j->chat, &j->text, err, sizeof err))
        return cli_usage_error(CMD, "--chat: %s: %s", o->model_dir, err);
    if (o->chat) {
        j->text.chat = &j->chat;
        j->base.chat_template = j->chat.digest;
    }
    j->t_start = cli_now();
    char model_root[PATH_MAX];
    snprintf(model_root, sizeof model_root, "%s/%s", o->root, j->fp);
    clean_stale_temps(model_root, o->quiet);
    return CLI_CONTINUE;
}

/* ---- this shard's documents ---- */

/* One line of --probes-from into j->extra_probes; -1 when it is not a probe (reported). */
static int add_extra_probe(compact_job *j, const char *line, int lineno) {
    json_error_t jerr;
    json_t *v = json_loads(line, JSON_DECODE_ANY, &jerr);
    int32_t *ids = NULL;
    int n = 0, rc = 0;
    char err[1024];
    kf_prompt *g = realloc(j->extra_probes, sizeof *g * (size_t)(j->n_extra + 1));
    if (g)
        j->extra_probes = g;
    if (!v || !g || doc_json_prompt(&j->text, v, &ids, &n, err, sizeof err)) {
        cli_error(CMD, "%s:%d: %s", j->o->probes_from, lineno, v ? err : "not JSON (a string or a list of ids)");
        rc = -1;
    } else {
        if (j->text.chat && wrap_turn(j->text.chat, doc_chat_question, &ids, &n)) {
            cli_error(CMD, "out of memory");
            free(ids);
            rc = -1;
        } else
            j->extra_probes[j->n_extra++] = (kf_prompt){ids, n};
    }
    json_decref(v);
    return rc;
}

/* --probes-from: the probes added to every document, read whole (or refused) before any work. */
static int read_extra_probes(compact_job *j) {
    char *line = NULL, err[256];
    size_t cap = 0, len = 0;
    int lineno = 0, ok = 1;
    for (int why; ok && (why = manifest_read_line(j->pf, (size_t)j->o->max_line, &line, &cap, &len)) != LINE_EOF;) {
        lineno++;
        if (why != LINE_OK) {
            manifest_line_error(why, len, (size_t)j->o->max_line, err, sizeof err);
            cli_error(CMD, "%s:%d: %s", j->o->probes_from, lineno, err);
            ok = 0;
        } else if (line[strspn(line, " \t\r\n")] != 0) {
            ok = add_extra_probe(j, line, lineno) == 0;
        }
    }
    if (ok && ferror(j->pf)) {
        cli_error(CMD, "--probes-from %s: cannot read: %s", j->o->probes_from, strerror(errno));
        ok = 0;
    }
    free(line);
    fclose(j->pf);
    j->pf = NULL;
    return ok ? CLI_CONTINUE : KF_EXIT_USAGE; /* the option's file is unusable: nothing is compacted */
}

/* --manifest: this shard's lines; a bad line fails its document (reported), the job goes on. */
static int read_manifest(compact_job *j) {
    const compact_opts *o = j->o;
    char *line = NULL, err[1024];
    size_t cap = 0, len = 0;
    int rc = CLI_CONTINUE, why;
    for (long long lineno = 1; (why = manifest_read_line(j->mf, (size_t)o->max_line, &line, &cap, &len)) != LINE_EOF;
         lineno++) {
        if ((lineno - 1) % o->shard_n != o->shard_i || (why == LINE_OK && line[strspn(line, " \t\r\n")] == 0))
            continue;
        job_doc *d = doc_list_add(&j->docs);
        if (!d) {
            cli_error(CMD, "out of memory");
            rc = KF_EXIT_FAIL;
            break;
        }
        snprintf(d->source, sizeof d->source, "%s:%lld", o->manifest, lineno);
        if (why != LINE_OK) /* this line is lost, the next ones are read */
            manifest_line_error(why, len, (size_t)o->max_line, err, sizeof err);
        if (why != LINE_OK || parse_line(&j->text, line, d, err, sizeof err) || check_doc(j->cfg, d, err, sizeof err)) {
            doc_fail(d->source, d->name, err);
            d->state = ST_FAILED;
        }
    }
    free(line);
    if (rc == CLI_CONTINUE && ferror(j->mf)) { /* an I/O error is not the end of the manifest */
        cli_error(CMD, "--manifest %s: cannot read: %s", o->manifest, strerror(errno));
        rc = KF_EXIT_FAIL;
    }
    fclose(j->mf);
    j->mf = NULL;
    return rc;
}

/* The FILE arguments of this shard; one that cannot be read fails its document (reported). */
static int read_files(compact_job *j) {
    const compact_opts *o = j->o;
    char err[1024];
    for (int a = 0; a < o->n_files; a++) {
        if (a % o->shard_n != o->shard_i)
            continue;
        job_doc *d = doc_list_add(&j->docs);
        if (!d) { /* the documents read so far are still compacted */
            cli_error(CMD, "out of memory");
            j->rc = KF_EXIT_FAIL;
            break;
        }
        const char *path = o->files[a], *base_name = strrchr(path, '/');
        snprintf(d->source, sizeof d->source, "%s", path);
        snprintf(d->name, sizeof d->name, "%s", base_name ? base_name + 1 : path);
        if (doc_read_text(&j->text, path, &d->ids, &d->n, err, sizeof err) || check_doc(j->cfg, d, err, sizeof err)) {
            clear_line();
            cli_error(CMD, "%s", err);
            d->state = ST_FAILED;
        }
    }
    return CLI_CONTINUE;
}

/* ---- the plan ---- */

/* --repeat-instruction's ids (with --chat, a user turn's content: the default without its newline). */
static int default_instruction(compact_job *j, char *err, size_t err_len) {
    const char *s = j->o->chat && !strcmp(j->o->instruction, DEFAULT_INSTRUCTION) ? DEFAULT_CHAT_INSTRUCTION
                                                                                   : j->o->instruction;
    if (doc_tokenize(&j->text, s, strlen(s), 0, &j->def_instr, &j->n_def_instr, err, err_len))
        return -1;
    if (j->text.chat && wrap_turn(j->text.chat, doc_chat_instruction, &j->def_instr, &j->n_def_instr)) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    return 0;
}

/* Identity and existing files: each document's files (recipe, path, a valid one already there);
 * counts the documents left to compute. */
static int plan_files(compact_job *j) {
    const compact_opts *o = j->o;
    char err[1024];
    for (int i = 0; i < j->docs.n; i++) {
        job_doc *d = &j->docs.docs[i];
        if (d->state != ST_TODO)
            continue;
        if (!d->instr && !j->def_instr && default_instruction(j, err, sizeof err)) {
            cli_error(CMD, "--repeat-instruction: %s", err);
            return KF_EXIT_USAGE;
        }
        kvf_document_digest(d->ids, d->n, d->digest);
        kf_compact_params dp;
        if (!(d->files = calloc((size_t)o->n_vars, sizeof *d->files)) || doc_params(j, d, &dp)) {
            cli_error(CMD, "out of memory");
            return KF_EXIT_FAIL;
        }
        const file_ids ids = {o->root, j->fp, j->dtype, (int64_t)j->cfg->n_layers * j->cfg->n_kv_heads};
        if (doc_files(d, &dp, o->vars, o->n_vars, &ids) == 0) {
            j->n_todo++;
            j->todo_tokens += d->n;
        }
    }
    return CLI_CONTINUE;
}

/* The prefix-sharing plan over the documents to compute (j->todo in its order). */
static int plan_sharing(compact_job *j) {
    const int32_t **seqs = malloc(sizeof *seqs * (size_t)(j->n_todo + 1)); /* [n_todo] */
    int64_t *lens = malloc(sizeof(int64_t) * (size_t)(j->n_todo + 1));   /* [n_todo] */
    j->todo = malloc(sizeof(int32_t) * (size_t)(j->n_todo + 1));
    int rc = CLI_CONTINUE;
    if (!j->todo || !seqs || !lens) {
        cli_error(CMD, "out of memory");
        rc = KF_EXIT_FAIL;
    } else {
        j->n_todo = 0;
        for (int i = 0; i < j->docs.n; i++)
            if (j->docs.docs[i].state == ST_TODO) {
                seqs[j->n_todo] = j->docs.docs[i].ids;
                lens[j->n_todo] = j->docs.docs[i].n;
                j->todo[j->n_todo++] = i;
            }
        const int chunk_eff = j->base.chunk > 0 ? j->base.chunk : KF_DEFAULT_CHUNK;
        /* QUOKA chooses keys per chunk: share whole chunks so every chunk starts where it would */
        const int granule = j->base.quoka ? chunk_eff : KF_PAGE_TOKENS;
        const kf_hfconfig *cfg = j->cfg;
        const double kv_bytes = 2.0 * cfg->n_layers * cfg->n_kv_heads * cfg->head_dim * sizeof(float);
        /* CPU estimates; the decision is not sensitive to them (compute saved per token is ~1,000x the
         * bandwidth cost of keeping its KV for any transformer) */
        const kf_prefix_cost cost = {.flops_per_token = 2.0 * (double)kf_model_n_params(j->m), .flops_per_s = 5e10,
                                     .kv_bytes_per_token = kv_bytes, .bytes_per_s = 1e10, .writes_kv = 1};
        kf_error e = {0};
        if (kf_prefix_plan_build(seqs, lens, j->n_todo,
                                 j->o->share && granule % KF_PAGE_TOKENS == 0 ? granule : KF_PAGE_TOKENS, &cost,
                                 &j->plan, &e) != KF_OK) {
            cli_error(CMD, "%s", e.msg);
            rc = KF_EXIT_FAIL;
        }
        j->sharing = j->o->share && j->plan.enabled && !j->base.use_context_queries; /* those need the whole context */
    }
    free(seqs);
    free(lens);
    return rc;
}

/* One arena for the run, as large as the largest (kept predecessor, document and its sources). */
static int plan_arena(compact_job *j) {
    int64_t need = 0, prev_len = 0;
    for (int k = 0; k < j->n_todo; k++) {
        const job_doc *d = &j->docs.docs[j->todo[j->plan.order[k]]];
        kf_compact_params dp;
        if (doc_params(j, d, &dp)) {
            cli_error(CMD, "out of memory");
            return KF_EXIT_FAIL;
        }
        const int64_t pages =
            kf_pages_for(j->sharing ? prev_len : 0) + kf_compact_arena_pages(&dp, d->n, d->n - j->chat.n_prefix) + 1;
        need = pages > need ? pages : need;
        prev_len = d->n;
    }
    kf_error e = {0};
    if (j->n_todo > 0 && kf_model_arena_dtype(j->m, &j->arena, need * KF_PAGE_TOKENS, j->base.arena_dtype, &e) != KF_OK) {
        cli_error(CMD, "%s", e.msg);
        return KF_EXIT_FAIL;
    }
    return CLI_CONTINUE;
}

/* ---- one document ---- */

/* A document none of whose files this worker claimed: failed (err), or skipped / busy. */
static void doc_passed_by(compact_job *j, job_doc *d, int claimed, const char *err) {
    if (claimed < 0) {
        doc_fail(d->source, d->name, err);
        d->state = ST_FAILED;
    } else { /* done or being done by another worker */
        const int busy = any_file(d, j->o->n_vars, ST_BUSY);
        d->state = busy ? ST_BUSY : ST_SKIPPED;
        j->n_busy += busy;
    }
    kf_seq_release(&j->arena, &j->prev);
    j->prev_k = -1;
    j->pg.finished++;
    j->pg.tokens_total -= d->n;
}

/* Prepares the document at plan position k once (on its predecessor's pages when they are still
 * held) and solves every claimed variant into cc; keeps its pages in j->prev when the next
 * document shares them. *shared: the tokens taken from the predecessor. */
static kf_status doc_solve(compact_job *j, int k, const job_doc *d, const kf_compact_params *p, kf_compacted *cc,
                           int64_t *shared, kf_error *e) {
    const kf_prefix_plan *plan = &j->plan;
    const int pi = plan->order[k], pred = plan->pred[pi];
    const int parent_ok = j->sharing && plan->shared[pi] > 0 && pred >= 0 && pred == j->prev_k;
    const int next_shares = j->sharing && k + 1 < j->n_todo && plan->shared[plan->order[k + 1]] > 0;
    *shared = parent_ok ? plan->shared[pi] : 0;
    kf_seq cur;
    kf_seq_init(&cur);
    kf_compact_reuse reuse = {.arena = &j->arena, .parent = parent_ok ? &j->prev : NULL, .shared = *shared,
                              .keep = next_shares ? &cur : NULL};
    const int n_pre = j->chat.n_prefix; /* the chat template's beginning: in the cache verbatim */
    kf_prompt pre = {d->ids, n_pre}, doc = {d->ids + n_pre, d->n - n_pre};
    kf_compact_variant cv[MAX_VARIANTS]; /* [nv] the claimed files' variants */
    int nv = 0;
    for (int v = 0; v < j->o->n_vars; v++)
        if (d->files[v].state == ST_TODO)
            cv[nv++] = j->o->vars[v];
    kf_compact_prep *prep = NULL; /* one prefill, one set of queries and targets for every file */
    kf_status st = kf_compact_prepare(j->m, &reuse, n_pre ? &pre : NULL, &doc, NULL, p, cv, nv, &prep, e);
    if (st == KF_OK)
        st = kf_compact_solve(prep, cv, nv, cc, e);
    kf_compact_prep_free(prep, st == KF_OK ? reuse.keep : NULL);
    kf_seq_release(&j->arena, &j->prev); /* the child holds what it took */
    j->prev_k = -1;
    if (st == KF_OK && next_shares) {
        j->prev = cur;
        j->prev_k = pi;
    }
    return st;
}

/* A document whose files are written: its counts, and a log line per file off a terminal. */
static void doc_done(compact_job *j, job_doc *d, int64_t shared, double t_doc) {
    d->state = ST_DONE;
    j->n_done++;
    j->computed += d->n - shared;
    j->doc_tokens += d->n;
    j->pg.tokens_done += d->n;
    for (int v = 0; v < j->o->n_vars; v++) {
        const job_file *f = &d->files[v];
        if (f->state != ST_DONE)
            continue;
        j->d_total += d->n;
        j->c_total += f->C;
        j->n_replaced += f->replaced;
        if (!g_tty && !j->o->quiet)
            fprintf(stderr, "[compact] %d/%d %s%s%s%s: %d -> %lld tokens, shared %lld, %.2f s -> %s\n",
                    j->pg.finished, j->pg.total, KF_ESC(d->source), d->name[0] ? " (" : "", KF_ESC(d->name),
                    d->name[0] ? ")" : "", d->n, (long long)f->C, (long long)shared, cli_now() - t_doc,
                    KF_ESC(f->path));
    }
}

/* The document at plan position k: claim its files, prepare once, solve every claimed variant,
 * write the files. CLI_CONTINUE, or KF_EXIT_FAIL when the run cannot go on. */
static int compact_doc(compact_job *j, int k) {
    job_doc *d = &j->docs.docs[j->todo[j->plan.order[k]]];
    cli_progress_doc(&j->pg, d->source, d->name, d->n);
    const double t_doc = cli_now();
    char err[1024];
    const file_ids ids = {j->o->root, j->fp, j->dtype, 0};
    const int claimed = claim_files(d, j->o->vars, j->o->n_vars, &ids, err, sizeof err);
    if (claimed <= 0) {
        doc_passed_by(j, d, claimed, err);
        return CLI_CONTINUE;
    }
    kf_compact_params p;
    if (doc_params(j, d, &p)) {
        cli_error(CMD, "out of memory");
        return KF_EXIT_FAIL;
    }
    if (!j->o->quiet) /* not part of the recipe: set after doc_params */
        p.progress = cli_progress_fn, p.progress_user = &j->pg;
    kf_compacted cc[MAX_VARIANTS]; /* the claimed files' caches, in variant order */
    kf_error e = {0};
    int64_t shared = 0;
    kf_status st = doc_solve(j, k, d, &p, cc, &shared, &e);
    st = write_files(d, j->o->n_vars, cc, st, &ids, j->tok_digest, j->text.chat, &e);
    j->pg.finished++;
    if (st != KF_OK) {
        doc_fail(d->source, d->name, e.msg);
        d->state = ST_FAILED;
        j->pg.tokens_total -= d->n;
        return CLI_CONTINUE;
    }
    doc_done(j, d, shared, t_doc);
    return CLI_CONTINUE;
}

/* Every document of the plan, in its order. */
static void compact_all(compact_job *j) {
    cli_progress_start(&j->pg, "[compact]", j->n_todo, j->todo_tokens, j->o->quiet, j->o->progress_interval);
    kf_seq_init(&j->prev);
    j->prev_k = -1;
    for (int k = 0; k < j->n_todo; k++)
        if (compact_doc(j, k) != CLI_CONTINUE) {
            j->rc = KF_EXIT_FAIL;
            break;
        }
    kf_seq_release(&j->arena, &j->prev);
    if (j->arena.storage)
        kf_arena_free(&j->arena);
    cli_progress_end(&j->pg);
}

/* ---- the summary ---- */

static void print_tokens(const compact_job *j) {
    const compact_opts *o = j->o;
    const double d_total = (double)j->d_total, c_total = (double)j->c_total;
    if (o->n_vars == 1)
        printf("tokens: %lld document tokens -> %lld cached (C/D %.3f, %.2fx smaller), %s %s, budget %g\n",
               (long long)j->d_total, (long long)j->c_total, c_total / d_total, d_total / c_total,
               kf_method_name(j->base.method), kvf_dtype_name(j->dtype), j->base.budget);
    else
        printf("tokens: %lld document tokens -> %lld cached over %d files per document (C/D %.3f), "
               "methods %s, budgets %s, %s\n",
               (long long)j->d_total, (long long)j->c_total, o->n_vars, c_total / d_total, o->methods_s,
               o->budgets_s, kvf_dtype_name(j->dtype));
    printf("prefix sharing: %lld tokens computed, %lld without sharing (%s)\n", (long long)j->computed,
           (long long)j->doc_tokens,
           !o->share ? "off: --no-share" : j->sharing ? "on" : j->plan.saved_s > 0 ? "off: does not pay" : "nothing shared");
}

static void print_summary(compact_job *j) {
    const compact_opts *o = j->o;
    int n_skipped = 0, n_bad = 0;
    for (int i = 0; i < j->docs.n; i++) {
        n_skipped += j->docs.docs[i].state == ST_SKIPPED;
        n_bad += j->docs.docs[i].state == ST_FAILED;
    }
    const double el = cli_now() - j->t_start;
    printf("compact: %d documents (shard %lld/%lld): %d done, %d skipped (valid file exists), %d busy (another "
           "worker), %d failed; %d file%s replaced (damaged, or not the file its name says)\n",
           j->docs.n, o->shard_i, o->shard_n, j->n_done, n_skipped, j->n_busy, n_bad, j->n_replaced,
           j->n_replaced == 1 ? "" : "s");
    if (j->n_done > 0)
        print_tokens(j);
    printf("time: %.2f s (%.0f document tokens/s), files under %s\n", el, el > 0 ? j->doc_tokens / el : 0,
           KF_ESC(o->root));
    if (fflush(stdout) != 0) /* now: the summary must not wait for exit (nor fail silently) */
        cli_error(CMD, "cannot write the summary: %s", strerror(errno));
    if (n_bad > 0 || ferror(stdout))
        j->rc = KF_EXIT_FAIL;
}

/* The stages in order; the exit status. */
static int compact_run(compact_job *j) {
    int rc = job_open(j);
    if (rc == CLI_CONTINUE && j->pf)
        rc = read_extra_probes(j);
    if (rc == CLI_CONTINUE)
        rc = j->mf ? read_manifest(j) : read_files(j);
    if (rc == CLI_CONTINUE)
        rc = plan_files(j);
    if (rc == CLI_CONTINUE)
        rc = plan_sharing(j);
    if (rc == CLI_CONTINUE)
        rc = plan_arena(j);
    if (rc != CLI_CONTINUE)
        return rc;
    compact_all(j);
    print_summary(j);
    return j->rc;
}

int cmd_compact(int argc, char **argv) {
    compact_opts o;
    const int rc = compact_parse(argc, argv, &o);
    if (rc != CLI_CONTINUE)
        return rc;
    g_tty = isatty(2) && !o.quiet;
    compact_job j = {.o = &o, .base = cli_compact_params(&o.q), .rc = KF_EXIT_OK};
    const int status = compact_run(&j);
    job_free(&j);
    return status;
}
