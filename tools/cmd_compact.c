/* kvfold compact — the offline job: documents in, one kvf cache file per document out. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "compactor/cache_io.h"
#include "compactor/compact.h"
#include "compactor/prefix_plan.h"
#include "compactor/recipe.h"
#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/cli_quality.h"
#include "tools/compact_files.h"
#include "tools/compact_options.h"
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

static kf_dtype model_dtype(const kf_hfconfig *cfg) {
    kf_dtype d;
    return kvf_dtype_parse(cfg->dtype, &d) == 0 ? d : KF_DTYPE_BF16;
}

/* ---- the command line ---- */

/* kvfold compact's options as given. */
typedef struct {
    const char *model_dir, *root, *manifest, *probes_from, *instruction, *methods_s, *budgets_s;
    long long shard_i, shard_n;
    long long max_line;                    /* --max-line-bytes */
    int no_share, dtype_given, chat;
    kf_dtype dtype;
    cli_progress_opts pr;                  /* --progress-interval, --quiet */
    cli_compact_opts q;                    /* the compaction's parameters (shared with eval quality) */
    kf_compact_variant vars[MAX_VARIANTS]; /* [n_vars] (method, budget) pairs, methods outer */
    int n_vars;
    char **files;                          /* [n_files] the FILE arguments */
    int n_files;
} compact_opts;

/* --shard i/N */
static int set_shard(void *ctx, const cli_opt *o, const char *s, char *err, size_t n) {
    (void)o, (void)err, (void)n;
    compact_opts *c = ctx;
    char *end;
    errno = 0;
    const long long i = strtoll(s, &end, 10);
    if (end == s || *end != '/' || errno)
        return -1;
    const char *q = end + 1;
    const long long N = strtoll(q, &end, 10);
    if (end == q || *end || errno || N < 1 || i < 0 || i >= N)
        return -1;
    c->shard_i = i, c->shard_n = N;
    return 0;
}

/* --repeat-instruction: checked here, as documents with their own instruction never tokenize it */
static int set_instruction(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o;
    if (!*arg)
        return snprintf(err, n, "must not be empty"), -1;
    ((compact_opts *)ctx)->instruction = arg;
    return 0;
}

static int set_dtype(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o, (void)err, (void)n;
    compact_opts *c = ctx;
    c->dtype_given = 1;
    return kvf_dtype_parse(arg, &c->dtype) ? -1 : 0;
}

#define C(field) OFF(compact_opts, field)
static const cli_opt kDocRows[] = {
    {"manifest", 0, OPT_STR, "FILE", C(manifest),
     .help = "JSONL, one document a line: \"ids\" or \"text\", optional \"id\", \"probes\", "
             "\"repeat_instruction\" (docs/compact.md); a bad line fails alone"},
    {"max-line-bytes", 0, OPT_LLONG, "N", C(max_line), .lo = 2, .hi = 1099511627776.0,
     .must = "must be a byte count from 2 to 2^40", .def = "64 MiB",
     .help = "the longest line of --manifest and --probes-from"},
    {"shard", 0, OPT_FN, "i/N", 0, .set = set_shard, .must = "is i/N with 0 <= i < N",
     .help = "the documents whose 0-based line (or FILE position) modulo N is i: N shards cover the "
             "input once (docs/batch.md)"},
    {0}};

static const cli_opt kCompactRows[] = {
    {"model", 0, OPT_STR, "DIR", C(model_dir), .help = "model directory (config.json, safetensors, tokenizer.json)"},
    {"method", 0, OPT_STR, "M[,M...]", C(methods_s), .def = "fold", .recipe = "method",
     .help = "keep, drop, am or fold"},
    {"budget", 0, OPT_STR, "B[,B...]", C(budgets_s), .def = "0.1", .recipe = "budget",
     .help = "kept fraction in (0, 1]; a file per (method, budget), one prefill per document"},
    {"out", 0, OPT_STR, "ROOT", C(root), .def = DEFAULT_ROOT, .help = "root directory of the cache files"},
    {"repeat-instruction", 0, OPT_FN, "TEXT", 0, .set = set_instruction, .recipe = "repeat_instruction",
     .def = "\"Repeat the previous context verbatim.\\n\"",
     .help = "between the document and its repeat (a chat model: its chat-template form, or --chat)"},
    {"probes-from", 0, OPT_STR, "FILE", C(probes_from), .recipe = "probe",
     .help = "extra probes for every document: a JSON string or list of ids a line"},
    {"dtype", 0, OPT_FN, "T", 0, .set = set_dtype, .must = "is bf16, f16 or f32", .recipe = "dtype",
     .def = "the model's torch_dtype, else bf16", .help = "bf16, f16 or f32 in the file"},
    {"chat", 0, OPT_FLAG, NULL, C(chat), .recipe = "chat_template",
     .help = "through the model's chat template (tokenizer_config.json): each document is the content of the "
             "first user turn (text rendered by the template; ids follow the template's beginning), the repeat "
             "instruction a second user turn's content (default \"" DEFAULT_CHAT_INSTRUCTION "\") and the repeat "
             "the assistant's turn, each probe a second user turn's content followed by the generation prompt. "
             "The file records the template's digest and the ids around the document (kvfold inspect; kvfold "
             "ask --chat). A model without a chat template is a usage error"},
    {0}};

static const cli_opt kShareRows[] = {
    {"no-share", 0, OPT_FLAG, NULL, C(no_share),
     .help = "no prefix sharing between documents (docs/compact.md)"},
    {0}};

static const cli_group kGroups[] = {
    {"Documents", kDocRows, 0},
    {"Compaction", kCompactRows, 0},
    {NULL, cli_lambda_rows, C(q)},
    {NULL, cli_max_queries_rows, C(q)},
    {NULL, cli_chunk_rows, C(q)},
    {NULL, kShareRows, 0},
    {"Solver (docs/decisions/per-head-choice.md)", cli_choice_rows, C(q)},
    {NULL, cli_refq_dtype_rows, C(q)},
    {NULL, cli_arena_dtype_rows, C(q)},
    {"Reference queries", cli_refq_source_rows, C(q)},
    {"Prefill", cli_prefill_rows, C(q.prefill)},
    {NULL, cli_quoka_repeat_rows, C(q)},
    {NULL, cli_weights_rows, 0},
    {"Progress", cli_progress_rows, C(pr)},
    {0}};

const cli_command cli_compact_command = {
    .name = CMD,
    .usage = "kvfold compact --model DIR [options] FILE...\n"
             "       kvfold compact --model DIR [options] --manifest DOCS.jsonl [--shard i/N]\n",
    .about = "Compacts each document (a text FILE, or a manifest line) into one kvf file per (method, budget):\n"
             "  ROOT/<model fingerprint>/<document digest>.<method>-<budget>.<recipe>.kvf\n"
             "A valid file already there is skipped, so a job can be rerun or resumed; several workers may\n"
             "share a manifest and a root. Details: docs/compact.md.\n",
    .groups = kGroups,
    .lists_recipe = 1,
    .notes = "Progress goes to stderr, the summary (done, skipped, busy, failed, tokens, time) to stdout.\n",
    .exit_status = "  0  every document compacted or skipped\n"
                   "  1  a document failed (reported; the others are compacted), or the model cannot be loaded\n"
                   "  2  usage errors, including a --manifest or --probes-from that cannot be read\n",
    .example = "  kvfold compact --model Qwen3-0.6B --method am,fold --budget 0.1 --out kvf-cache report.txt\n",
};

/* After the options: the variants, then what is required; CLI_CONTINUE or the usage status. */
static int compact_validate(compact_opts *o) {
    if ((o->n_vars = compact_parse_variants(o->methods_s, o->budgets_s, o->vars)) < 0)
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
                        .budgets_s = "0.1", .shard_n = 1, .dtype = KF_DTYPE_BF16,
                        .pr = {.interval = CLI_PROGRESS_DEFAULT_S}, .max_line = MANIFEST_MAX_LINE_DEFAULT};
    cli_compact_opts_init(&o->q);
    int first;
    int rc = cli_opts_parse(&cli_compact_command, argc, argv, o, &first);
    if (rc != CLI_CONTINUE || (rc = cli_compact_opts_check(&o->q, CMD)) != CLI_CONTINUE)
        return rc;
    o->files = argv + first;
    o->n_files = argc - first;
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
    kf_dtype dtype;         /* of the files */
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
    if (compact_check_root(o->root) || !(j->m = cli_load_model(CMD, o->model_dir, &j->backend)))
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
    compact_clean_stale_temps(model_root, o->pr.quiet);
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
            compact_clear_line();
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
        const int chunk_eff = j->base.run.chunk > 0 ? j->base.run.chunk : KF_DEFAULT_CHUNK;
        /* QUOKA chooses keys per chunk: share whole chunks so every chunk starts where it would */
        const int granule = j->base.run.quoka ? chunk_eff : KF_PAGE_TOKENS;
        const kf_hfconfig *cfg = j->cfg;
        const double kv_bytes = 2.0 * cfg->n_layers * cfg->n_kv_heads * cfg->head_dim * sizeof(float);
        /* CPU estimates; the decision is not sensitive to them (compute saved per token is ~1,000x the
         * bandwidth cost of keeping its KV for any transformer) */
        const kf_prefix_cost cost = {.flops_per_token = 2.0 * (double)kf_model_n_params(j->m), .flops_per_s = 5e10,
                                     .kv_bytes_per_token = kv_bytes, .bytes_per_s = 1e10, .writes_kv = 1};
        kf_error e = {0};
        if (kf_prefix_plan_build(seqs, lens, j->n_todo,
                                 !j->o->no_share && granule % KF_PAGE_TOKENS == 0 ? granule : KF_PAGE_TOKENS, &cost,
                                 &j->plan, &e) != KF_OK) {
            cli_error(CMD, "%s", e.msg);
            rc = KF_EXIT_FAIL;
        }
        j->sharing = !j->o->no_share && j->plan.enabled && !j->base.use_context_queries; /* those need the whole context */
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
    if (j->n_todo > 0 && kf_model_arena_dtype(j->m, &j->arena, need * KF_PAGE_TOKENS, j->base.run.arena_dtype, &e) != KF_OK) {
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
        if (!compact_tty && !j->o->pr.quiet)
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
    if (!j->o->pr.quiet) /* not part of the recipe: set after doc_params */
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
    cli_progress_start(&j->pg, "[compact]", j->n_todo, j->todo_tokens, j->o->pr.quiet, j->o->pr.interval);
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
               kf_method_name(j->base.method), kf_dtype_name(j->dtype), j->base.budget);
    else
        printf("tokens: %lld document tokens -> %lld cached over %d files per document (C/D %.3f), "
               "methods %s, budgets %s, %s\n",
               (long long)j->d_total, (long long)j->c_total, o->n_vars, c_total / d_total, o->methods_s,
               o->budgets_s, kf_dtype_name(j->dtype));
    printf("prefix sharing: %lld tokens computed, %lld without sharing (%s)\n", (long long)j->computed,
           (long long)j->doc_tokens,
           o->no_share ? "off: --no-share" : j->sharing ? "on" : j->plan.saved_s > 0 ? "off: does not pay" : "nothing shared");
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
    compact_tty = isatty(2) && !o.pr.quiet;
    compact_job j = {.o = &o, .base = cli_compact_params(&o.q), .rc = KF_EXIT_OK};
    const int status = compact_run(&j);
    job_free(&j);
    return status;
}
