/* kvfold eval quality — compaction quality on a records-style evaluation set. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/evaluate.h"
#include "formats/budgets.h"
#include "tools/cli.h"
#include "tools/cli_quality.h"
#include "tools/compact_options.h"
#include "tools/commands.h"
#include "tools/doc_chat.h"
#include "tools/progress.h"

typedef struct {
    int32_t *ids;
    int n;
} idvec;

static int json_ids(json_t *arr, idvec *out) {
    out->n = 0;
    out->ids = NULL;
    if (!json_is_array(arr) || json_array_size(arr) == 0)
        return -1;
    out->ids = malloc(sizeof(int32_t) * json_array_size(arr));
    if (!out->ids)
        return -1;
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            free(out->ids);
            out->ids = NULL;
            return -1;
        }
        out->ids[out->n++] = (int32_t)json_integer_value(v);
    }
    return 0;
}

typedef enum { PROBE_QA = 0, PROBE_QUESTION = 1 } probe_form;

typedef struct {
    idvec doc, instr;
    idvec *q, *a;
    int n_qa;
    idvec *probes;
    int n_probes;
    int n_prefix; /* --chat: doc's first n_prefix ids are the template's beginning */
} eval_doc;

static void eval_doc_free(eval_doc *d) {
    free(d->doc.ids);
    free(d->instr.ids);
    for (int i = 0; i < d->n_qa; i++) {
        free(d->q[i].ids);
        free(d->a[i].ids);
    }
    for (int i = 0; i < d->n_probes; i++)
        free(d->probes[i].ids);
    free(d->q);
    free(d->a);
    free(d->probes);
    memset(d, 0, sizeof *d);
}

/* The token that opens the document's record lines: the one before an evaluated answer
 * [name value... newline] that stands at the start of a line of the document. Found from the
 * records themselves, wherever they stand (a document may open with prose). -1: none found. */
static int32_t record_marker(const eval_doc *d, int32_t nl) {
    const int32_t *x = d->doc.ids;
    for (int k = 0; k < d->n_qa; k++) {
        const idvec *a = &d->a[k];
        if (a->n < 2 || a->ids[a->n - 1] != nl)
            continue;
        for (int i = 1; i + a->n <= d->doc.n; i++)
            if ((i == 1 || x[i - 2] == nl) && memcmp(x + i, a->ids, sizeof(int32_t) * a->n) == 0)
                return x[i - 1];
    }
    return -1;
}

/* The name an evaluated question asks about (the answer token before the fact), or -1. */
static int32_t asked_name(const eval_doc *d, int k) {
    const kf_qa qa = {{d->q[k].ids, d->q[k].n}, {d->a[k].ids, d->a[k].n}};
    const int fr = kf_qa_fact_row(&qa);
    return fr > 0 ? d->a[k].ids[fr - 1] : -1;
}

/* One probe from a record line [marker name value... nl] at doc[i..j]: the template question
 * with the name in its slot, followed (form qa) by the record's answer [name value... nl]. */
static int add_probe(eval_doc *d, const idvec *tq, int slot, int i, int j, probe_form form) {
    const int n_ans = j - i; /* name, value..., newline */
    idvec *p = &d->probes[d->n_probes];
    p->n = tq->n + (form == PROBE_QA ? n_ans : 0);
    p->ids = malloc(sizeof(int32_t) * (size_t)p->n);
    if (!p->ids)
        return -1;
    memcpy(p->ids, tq->ids, sizeof(int32_t) * tq->n);
    p->ids[slot] = d->doc.ids[i + 1];
    if (form == PROBE_QA)
        memcpy(p->ids + tq->n, d->doc.ids + i + 1, sizeof(int32_t) * n_ans);
    d->n_probes++;
    return 0;
}

/* Probes: the first evaluated question's template asked about records that no evaluated question
 * asks about. Record lines are found from the evaluated answers (record_marker); values may span
 * several tokens up to the line's end. A document without a template or a found record line gets
 * none (the caller counts and reports it). */
static void build_probes(eval_doc *d, int want, probe_form form) {
    d->probes = calloc((size_t)(want ? want : 1), sizeof *d->probes);
    if (!d->probes || d->n_qa == 0 || want == 0)
        return;
    const idvec *tq = &d->q[0], *ta = &d->a[0];
    const int32_t name0 = asked_name(d, 0);
    int slot = -1;
    for (int i = 0; i < tq->n && slot < 0; i++)
        slot = tq->ids[i] == name0 ? i : -1;
    if (slot < 0 || ta->n < 2)
        return;
    const int32_t nl = ta->ids[ta->n - 1], marker = record_marker(d, nl);
    if (marker < 0)
        return;
    const int32_t *x = d->doc.ids;
    for (int i = 0; i + 3 < d->doc.n && d->n_probes < want; i++) {
        if (x[i] != marker || (i > 0 && x[i - 1] != nl) || x[i + 1] == nl)
            continue;
        int j = i + 2;
        while (j < d->doc.n && j - i <= 16 && x[j] != nl)
            j++;
        if (j >= d->doc.n || x[j] != nl || j == i + 2)
            continue; /* no value, or not a line */
        int asked = 0;
        for (int k = 0; k < d->n_qa; k++)
            asked |= asked_name(d, k) == x[i + 1];
        if (!asked && add_probe(d, tq, slot, i, j, form) != 0)
            return;
    }
}

/* ids replaced by wrap's turn around them; -1 when out of memory. */
static int chat_wrap(const doc_chat *c, int (*wrap)(const doc_chat *, const int32_t *, int, int32_t **, int *),
                     idvec *v) {
    int32_t *w = NULL;
    int n = 0;
    if (wrap(c, v->ids, v->n, &w, &n))
        return -1;
    free(v->ids);
    v->ids = w;
    v->n = n;
    return 0;
}

/* --chat: the document after the template's beginning, the instruction and questions as user turns. */
static int chat_doc(const doc_chat *c, eval_doc *d) {
    int bad = chat_wrap(c, doc_chat_document_ids, &d->doc) || chat_wrap(c, doc_chat_instruction, &d->instr);
    for (int i = 0; i < d->n_qa && !bad; i++)
        bad = chat_wrap(c, doc_chat_question, &d->q[i]);
    d->n_prefix = c->n_prefix;
    return bad ? -1 : 0;
}

static int parse_doc(const char *line, int lineno, const char *path, int want_probes, probe_form form,
                     const doc_chat *chat, eval_doc *d) {
    memset(d, 0, sizeof *d);
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    if (!o) {
        cli_error("eval quality", "%s:%d: not JSON: %s", path, lineno, jerr.text);
        return -1;
    }
    int rc = -1;
    json_t *qs = json_object_get(o, "questions");
    if (json_ids(json_object_get(o, "ids"), &d->doc) || json_ids(json_object_get(o, "repeat_instruction_ids"), &d->instr) ||
        !json_is_array(qs)) {
        cli_error("eval quality", "%s:%d: needs ids, repeat_instruction_ids and questions", path, lineno);
        goto out;
    }
    d->q = calloc(json_array_size(qs) + 1, sizeof *d->q);
    d->a = calloc(json_array_size(qs) + 1, sizeof *d->a);
    size_t i;
    json_t *qa;
    json_array_foreach(qs, i, qa) {
        if (json_ids(json_object_get(qa, "question_ids"), &d->q[d->n_qa]) ||
            json_ids(json_object_get(qa, "answer_ids"), &d->a[d->n_qa])) {
            cli_error("eval quality", "%s:%d: question %zu needs question_ids and answer_ids", path, lineno, i);
            goto out;
        }
        d->n_qa++;
    }
    if (chat && chat_doc(chat, d)) {
        cli_error("eval quality", "%s:%d: out of memory", path, lineno);
        goto out;
    }
    build_probes(d, want_probes, form);
    rc = 0;
out:
    json_decref(o);
    if (rc)
        eval_doc_free(d);
    return rc;
}

static int parse_list(const char *text, double *out, int max) {
    int n = 0;
    char *copy = strdup(text), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        out[n] = strtod(tok, &end);
        if (*end || !(out[n] > 0 && out[n] <= 1)) {
            free(copy);
            return -1;
        }
        n++;
    }
    free(copy);
    return n;
}

/* One row of the table: a (method, budget), or the uncompacted cache (full). Averages are over
 * the documents whose compaction and measurement succeeded (n_ok); the others are counted. */
typedef struct {
    int full;             /* 1: the uncompacted cache, method and budget unused */
    kf_method method;
    double budget;
    kf_quality sum;
    double var_gain;
    int n_ok, n_failed;
    long long fallbacks;  /* fold heads compacted as drop (no fold direction) */
    long long restarts;   /* beta fits restarted from w = 1 */
    long long heads[4];   /* (layer, KV head) pairs per kf_method, summed over documents */
} eval_row;

typedef struct {
    int n_read, n_unreadable, n_no_ref, n_no_probes;
    long long probes_built;
    int no_probe_lines[8]; /* the first few documents without probes (JSONL line numbers) */
} eval_counts;

typedef struct {
    kf_model *m;
    const doc_chat *chat;        /* --chat, or NULL */
    const char *docs;
    kf_compact_params base;
    FILE *per_head;
    double *head_lse, *head_out; /* [n_layers * kv_heads] */
    cli_progress *pg;            /* the run's progress on stderr */
} eval_ctx;

/* Measures one row's cache c (computed by the caller, or NULL when its compaction failed with
 * cerr) on one document; frees c. */
static void eval_row_measure(const eval_ctx *x, eval_row *row, const kf_reference *ref, kf_compacted *c,
                             const kf_error *cerr, int lineno) {
    kf_quality q;
    kf_error err = cerr ? *cerr : (kf_error){0};
    kf_status rc = c ? kf_quality_measure(x->m, ref, c, &q, x->head_lse, x->head_out, &err) : KF_ERR_INVALID;
    if (rc != KF_OK) {
        if (c)
            kf_compacted_free(c);
        cli_error("eval quality", "%s:%d: %s %g: %s", x->docs, lineno, row->full ? "full" : kf_method_name(row->method),
                  row->full ? 1.0 : row->budget, err.msg);
        row->n_failed++;
        return;
    }
    kf_quality_add(&row->sum, &q);
    row->n_ok++;
    const int n_heads = c->n_layers * c->kv_heads;
    for (int h = 0; x->per_head && h < n_heads; h++)
        fprintf(x->per_head, "%d\t%s\t%g\t%d\t%d\t%.5f\t%.5f\t%.5f\n", lineno,
                row->full ? "full" : kf_method_name(row->method), row->full ? 1.0 : row->budget, h / c->kv_heads,
                h % c->kv_heads, x->head_lse[h], x->head_out[h], c->var_gain[h]);
    row->var_gain += c->stats.mean_var_gain;
    row->fallbacks += c->stats.fold_fallback_heads;
    row->restarts += c->stats.solver.beta_restarts;
    int counts[4];
    kf_compacted_head_counts(c, counts);
    for (int i = 0; i < 4; i++)
        row->heads[i] += counts[i];
    kf_compacted_free(c);
}

/* Every compacted row of one document from one prefill, one set of reference queries and one
 * set of targets (kf_compact_prepare, then kf_compact_solve for all the (method, budget) rows);
 * outs [n_rows] (the full row's entry unused). 0, or -1 with err when the compaction failed. */
static int eval_compact_rows(const eval_ctx *x, const eval_row *rows, int n_rows, const eval_doc *d,
                             const kf_prompt *pr, kf_compacted *outs, kf_error *err) {
    kf_compact_variant *v = calloc((size_t)n_rows, sizeof *v);
    kf_compacted *tmp = calloc((size_t)n_rows, sizeof *tmp);
    int n = 0;
    for (int r = 0; v && r < n_rows; r++)
        if (!rows[r].full)
            v[n++] = (kf_compact_variant){rows[r].method, rows[r].budget};
    kf_prompt pre = {d->doc.ids, d->n_prefix}, doc = {d->doc.ids + d->n_prefix, d->doc.n - d->n_prefix};
    kf_compact_params p = x->base;
    p.repeat_instruction = (kf_prompt){d->instr.ids, d->instr.n};
    p.probes = pr;
    p.n_probes = d->n_probes;
    kf_compact_prep *prep = NULL;
    kf_status rc = !v || !tmp ? kf_fail(err, KF_ERR_NOMEM, "out of memory") : KF_OK;
    if (rc == KF_OK && n > 0 && (rc = kf_compact_prepare(x->m, NULL, d->n_prefix ? &pre : NULL, &doc, NULL, &p, v, n, &prep, err)) ==
                                  KF_OK)
        rc = kf_compact_solve(prep, v, n, tmp, err);
    kf_compact_prep_free(prep, NULL);
    for (int r = 0, i = 0; rc == KF_OK && r < n_rows; r++)
        if (!rows[r].full)
            outs[r] = tmp[i++];
    free(v);
    free(tmp);
    return rc == KF_OK ? 0 : -1;
}

/* Reference and every row for one parsed document; 0, or -1 when the reference failed. */
static int eval_document(const eval_ctx *x, eval_row *rows, int n_rows, const eval_doc *d, int lineno) {
    kf_qa *qa = calloc((size_t)(d->n_qa ? d->n_qa : 1), sizeof *qa);
    kf_prompt *pr = calloc((size_t)(d->n_probes ? d->n_probes : 1), sizeof *pr);
    kf_compacted *outs = calloc((size_t)n_rows, sizeof *outs); /* [n_rows] */
    kf_reference *ref = NULL;
    kf_error err = {0};
    int rc = -1;
    cli_progress_note(x->pg, "reference");
    if (!qa || !pr || !outs) {
        cli_error("eval quality", "%s:%d: out of memory", x->docs, lineno);
        goto out;
    }
    for (int i = 0; i < d->n_qa; i++)
        qa[i] = (kf_qa){{d->q[i].ids, d->q[i].n}, {d->a[i].ids, d->a[i].n}};
    for (int i = 0; i < d->n_probes; i++)
        pr[i] = (kf_prompt){d->probes[i].ids, d->probes[i].n};
    kf_prompt doc = {d->doc.ids, d->doc.n}, instr = {d->instr.ids, d->instr.n};
    if (kf_reference_build_ex(x->m, &doc, d->n_prefix, &instr, qa, d->n_qa, &ref, &err) != KF_OK) {
        cli_error("eval quality", "%s:%d: %s", x->docs, lineno, err.msg);
        goto out;
    }
    kf_error cerr = {0};
    cli_progress_note(x->pg, "compaction");
    const int compacted = eval_compact_rows(x, rows, n_rows, d, pr, outs, &cerr) == 0;
    for (int r = 0; r < n_rows; r++) {
        kf_error ferr = {0};
        if (rows[r].full)
            cli_progress_note(x->pg, "measure full (%d/%d)", r + 1, n_rows);
        else
            cli_progress_note(x->pg, "measure %s %g (%d/%d)", kf_method_name(rows[r].method), rows[r].budget, r + 1,
                              n_rows);
        if (rows[r].full)
            eval_row_measure(x, &rows[r], ref, kf_reference_full_cache(ref, &outs[r], &ferr) == KF_OK ? &outs[r] : NULL,
                             &ferr, lineno);
        else
            eval_row_measure(x, &rows[r], ref, compacted ? &outs[r] : NULL, &cerr, lineno);
    }
    rc = 0;
out:
    kf_reference_free(ref);
    free(outs);
    free(qa);
    free(pr);
    return rc;
}

static void print_table(eval_row *rows, int n_rows, int tsv, const eval_counts *n) {
    if (tsv)
        printf("method\tbudget\tkl_repeat\tkl_answer\tcopy_acc\tqa_em\tlse_err\tout_err\tfact_acc\tdocs\tfailed\t"
               "fold_fallbacks\tbeta_restarts\theads_keep\theads_drop\theads_am\theads_fold\tdocs_without_probes\n");
    else
        printf("%-6s %6s %9s %9s %8s %6s %7s %7s %8s %8s %5s %6s %6s %8s %s\n", "method", "budget", "kl_repeat",
               "kl_answer", "copy_acc", "qa_em", "lse_err", "out_err", "var(q.u)", "fact_acc", "docs", "failed",
               "fb>drop", "restarts", "heads keep/drop/am/fold");
    for (int r = 0; r < n_rows; r++) {
        eval_row *w = &rows[r];
        kf_quality *s = &w->sum;
        kf_quality_mean(s, w->n_ok);
        const char *name = w->full ? "full" : kf_method_name(w->method);
        const double budget = w->full ? 1.0 : w->budget, vg = w->n_ok ? w->var_gain / w->n_ok : 0;
        if (tsv)
            printf("%s\t%g\t%.4f\t%.4f\t%.4f\t%.4f\t%.4f\t%.4f\t%.4f\t%d\t%d\t%lld\t%lld\t%lld\t%lld\t%lld\t%lld\t%d\n",
                   name, budget, s->kl_repeat, s->kl_answer, s->copy_acc, s->qa_em, s->lse_err, s->out_err,
                   s->fact_acc, w->n_ok, w->n_failed, w->fallbacks, w->restarts, w->heads[0], w->heads[1],
                   w->heads[2], w->heads[3], n->n_no_probes);
        else
            printf("%-6s %6g %9.4f %9.4f %8.4f %6.4f %7.4f %7.4f %8.4f %8.4f %5d %6d %6lld %8lld %lld/%lld/%lld/%lld\n",
                   name, budget, s->kl_repeat, s->kl_answer, s->copy_acc, s->qa_em, s->lse_err, s->out_err, vg,
                   s->fact_acc, w->n_ok, w->n_failed, w->fallbacks, w->restarts, w->heads[0], w->heads[1],
                   w->heads[2], w->heads[3]);
    }
}

/* The footer says what the table is made of: documents, failures, probes as built. */
static void print_footer(const eval_counts *n, long long probes, probe_form form, double seconds) {
    printf("%d documents read, %d not evaluated (unreadable %d, reference failed %d); each row averages the "
           "documents counted in its docs column (failed compactions are left out)\n",
           n->n_read, n->n_unreadable + n->n_no_ref, n->n_unreadable, n->n_no_ref);
    const int n_eval = n->n_read - n->n_unreadable - n->n_no_ref;
    if (probes == 0)
        printf("probes: none\n");
    else {
        printf("probes: up to %lld per document (%s), %.1f built on average, %d documents without probes", probes,
               form == PROBE_QA ? "question + answer" : "question only",
               n_eval ? (double)n->probes_built / n_eval : 0.0, n->n_no_probes);
        for (int i = 0; i < n->n_no_probes && i < 8; i++)
            printf("%s%d", i ? ", " : " (lines ", n->no_probe_lines[i]);
        printf("%s\n", n->n_no_probes > 8 ? ", ...)" : n->n_no_probes ? ")" : "");
    }
    printf("%.1f s\n", seconds);
}

/* --method: keep, drop, am, fold and full (the uncompacted cache, one row). */
static int parse_rows(const char *methods_s, const double *budgets, int n_budgets, eval_row **out) {
    eval_row *rows = calloc((size_t)(5 * n_budgets + 1), sizeof *rows);
    int n = 0, seen = 0;
    char *copy = strdup(methods_s), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); rows && tok; tok = strtok_r(NULL, ",", &save)) {
        kf_method m;
        const int full = strcmp(tok, "full") == 0;
        if ((!full && kf_method_parse(tok, &m) != 0) || (seen & (1 << (full ? 4 : (int)m)))) {
            cli_usage_error("eval quality", "--method: full, keep, drop, am or fold, each once, not '%s'", tok);
            free(copy);
            free(rows);
            return -1;
        }
        seen |= 1 << (full ? 4 : (int)m);
        for (int bi = 0; bi < (full ? 1 : n_budgets); bi++)
            rows[n++] = (eval_row){.full = full, .method = full ? KF_METHOD_KEEP : m, .budget = full ? 1 : budgets[bi]};
    }
    free(copy);
    *out = rows;
    return rows ? n : -1;
}

/* --probes-out: the probes as built, one JSON line per document {"line": N, "probes": [[ids]]}. */
static void write_probes(FILE *f, const eval_doc *d, int lineno) {
    fprintf(f, "{\"line\": %d, \"probes\": [", lineno);
    for (int i = 0; i < d->n_probes; i++) {
        fputs(i ? ", [" : "[", f);
        for (int j = 0; j < d->probes[i].n; j++)
            fprintf(f, j ? ", %d" : "%d", d->probes[i].ids[j]);
        fputc(']', f);
    }
    fputs("]}\n", f);
}

/* Reads, evaluates and counts every document (up to limit); returns the exit status of the
 * documents (KF_EXIT_FAIL when any could not be read, measured or compacted). */
static int eval_documents(const eval_ctx *x, FILE *f, FILE *probes_f, eval_row *rows, int n_rows, int limit,
                          int probes, probe_form form, eval_counts *n) {
    size_t cap = 0;
    char *line = NULL;
    int lineno = 0, rc = KF_EXIT_OK;
    const double t0 = cli_now();
    const char *base = strrchr(x->docs, '/') ? strrchr(x->docs, '/') + 1 : x->docs;
    char source[256];
    while (n->n_read < limit && getline(&line, &cap, f) > 0) {
        lineno++;
        if (line[strspn(line, " \t\r\n")] == 0)
            continue;
        n->n_read++;
        snprintf(source, sizeof source, "%s:%d", base, lineno);
        cli_progress_doc(x->pg, source, "", 0);
        eval_doc d;
        if (parse_doc(line, lineno, x->docs, probes, form, x->chat, &d) != 0) {
            n->n_unreadable++;
            rc = KF_EXIT_FAIL;
            continue;
        }
        if (probes_f)
            write_probes(probes_f, &d, lineno);
        if (eval_document(x, rows, n_rows, &d, lineno) != 0) {
            n->n_no_ref++;
            rc = KF_EXIT_FAIL;
        } else {
            n->probes_built += d.n_probes;
            if (probes > 0 && d.n_probes == 0) {
                cli_progress_clear(x->pg);
                fprintf(stderr, "[eval] %s:%d: no probes (no record line found from the questions)\n", x->docs,
                        lineno);
                if (n->n_no_probes < 8)
                    n->no_probe_lines[n->n_no_probes] = lineno;
                n->n_no_probes++;
            }
        }
        x->pg->finished++;
        if (!x->pg->tty && !x->pg->quiet)
            fprintf(stderr, "[eval] %d documents, %.0f s\n", n->n_read, cli_now() - t0);
        eval_doc_free(&d);
    }
    cli_progress_end(x->pg);
    free(line);
    for (int r = 0; r < n_rows; r++)
        rc = rows[r].n_failed ? KF_EXIT_FAIL : rc;
    return rc;
}

/* ---- the command line ---- */

#define CMD "eval quality"

/* kvfold eval quality's options as given. */
typedef struct {
    const char *model_dir, *docs, *methods_s, *budgets_s, *head_budgets, *per_head_path, *probes_out;
    long long probes, limit;
    int tsv, chat;
    cli_progress_opts pr;  /* --progress-interval, --quiet */
    int form;              /* probe_form */
    cli_compact_opts q;    /* the compaction's parameters (shared with compact); QUOKA: its document prefill */
} eval_opts;

#define E(field) OFF(eval_opts, field)
static const int kFoldQueries[] = {KF_FOLD_ON_ALL, KF_FOLD_ON_PROBES};
static const int kForms[] = {PROBE_QA, PROBE_QUESTION};

static const cli_opt kEvalRows[] = {
    {"model", 0, OPT_STR, "DIR", E(model_dir), .help = "model directory"},
    {"docs", 0, OPT_STR, "FILE", E(docs), .help = "evaluation documents (JSONL)"},
    {"budget", 0, OPT_STR, "B[,B...]", E(budgets_s), .def = "0.25,0.1", .help = "kept fractions"},
    {"budgets", 0, OPT_ALIAS, .target = "budget"},
    {"method", 0, OPT_STR, "M[,M...]", E(methods_s), .def = "all five",
     .help = "full, keep, drop, am or fold; full is the uncompacted cache"},
    {"methods", 0, OPT_ALIAS, .target = "method"},
    {"probes", 0, OPT_LLONG, "N", E(probes), .lo = 0, .hi = 100000, .must = "must be a count",
     .help = "add up to N probe questions per document about records that are not evaluated, built from the "
             "document's record lines wherever they stand (found from the evaluated answers); documents "
             "without any are counted"},
    {"probe-form", 0, OPT_CHOICE, "F", E(form), .choices = "qa|question", .values = kForms, .def = "qa",
     .help = "qa (question + the record's answer) or question (question only)"},
    {"probes-out", 0, OPT_STR, "FILE", E(probes_out), .help = "write the probes as built, one JSON line per document"},
    {"fold-queries", 0, OPT_CHOICE, "W", E(q.p.solver.fold_queries), .choices = "all|probes", .values = kFoldQueries,
     .def = "all", .help = "all | probes: the queries the fold direction u is fitted on"},
    {"per-head", 0, OPT_STR, "FILE", E(per_head_path),
     .help = "also write every head's lse_err, out_err and var(q.u) as TSV rows"},
    {"head-budgets", 0, OPT_STR, "FILE", E(head_budgets),
     .help = "per-head shares in AM's JSON form {\"L<layer>H<head>\": share}; C is set by the largest head, am "
             "pads the others with slots of bias -inf"},
    {"limit", 0, OPT_LLONG, "N", E(limit), .lo = 1, .hi = 1 << 30, .must = "must be a positive count",
     .help = "only the first N documents"},
    {"format", 0, OPT_CHOICE, "table|tsv", E(tsv), .choices = "table|tsv", .def = "table",
     .help = "a table, or tab-separated values with a header row"},
    {"chat", 0, OPT_FLAG, NULL, E(chat),
     .help = "through the model's chat template, as kvfold compact --chat: the document's ids follow the "
             "template's beginning (kept verbatim in every cache), the repeat instruction is a second user turn's "
             "content and the repeat the assistant's turn, each question (and probe) a user turn's content "
             "followed by the generation prompt, its answer the assistant's"},
    {0}};

static const cli_group kGroups[] = {
    {NULL, kEvalRows, 0},
    {"Compaction", cli_lambda_rows, E(q)},
    {NULL, cli_max_queries_rows, E(q)},
    {NULL, cli_chunk_rows, E(q)},
    {NULL, cli_choice_rows, E(q)},
    {NULL, cli_refq_dtype_rows, E(q)},
    {NULL, cli_arena_dtype_rows, E(q)},
    {"Reference queries", cli_refq_source_rows, E(q)},
    {"Prefill (of the compaction's document; the full-context reference is always dense)", cli_prefill_rows,
     E(q.prefill)},
    {NULL, cli_quoka_repeat_rows, E(q)},
    {NULL, cli_weights_rows, 0},
    {"Progress", cli_progress_rows, E(pr)},
    {0}};

const cli_command cli_eval_command = {
    .name = CMD,
    .usage = "kvfold eval quality --model DIR --docs FILE.jsonl [options]\n",
    .about = "Compact every document with every (method, budget) and measure against the full context:\n"
             "  kl_repeat  mean KL(full || compacted) over the teacher-forced repeat continuation\n"
             "  kl_answer  the same over each question's answer tokens\n"
             "  copy_acc   teacher-forced copy accuracy of the repeat continuation\n"
             "  qa_em      exact match of greedy answers\n"
             "  lse_err    per-head mean |log-sum-exp error| of the compacted block on held-out queries\n"
             "  out_err    per-head relative attention-output error with the question appended\n"
             "  fact_acc   teacher-forced accuracy of the recalled fact: the answer token after the name\n"
             "Then the counts: docs (documents averaged in the row), failed (compactions or measurements that\n"
             "failed: reported, left out of the averages), fold heads compacted as drop, beta fits restarted\n"
             "from w = 1, heads per method, documents without probes. The row `full` is the uncompacted\n"
             "cache measured the same way (KL 0: a sanity check).\n"
             "Every question (and every probe) runs alone on top of the document: one question per context.\n"
             "Held-out queries are those of the evaluated questions; they are never used for fitting.\n"
             "\n"
             "The JSONL lines carry ids, repeat_instruction_ids and questions[] with question_ids and\n"
             "answer_ids (tests/data/records-dev.jsonl).\n",
    .groups = kGroups,
    .notes = "Progress on stderr: on a terminal one line redrawn in place (the document, its stage: reference,\n"
             "prefill tokens, repeat layer i/L, solve layer i/L with its KV heads, measure; the time its\n"
             "compaction and the run have left); otherwise a line per stage and one per document.\n",
    .exit_status = "  0  every document read, compacted and measured\n"
                   "  1  a document could not be read, compacted or measured (reported; left out of the\n"
                   "     averages), no documents, or the model cannot be loaded\n"
                   "  2  usage errors\n",
    .example = "  kvfold eval quality --model records-qwen3 --docs records-dev.jsonl --method am,fold \\\n"
               "      --budget 0.1 --format tsv\n",
};

/* The options, then the required ones and the rows (*rows, *n_rows: every (method, budget) and
 * full); CLI_CONTINUE or the exit status. */
static int eval_parse(int argc, char **argv, eval_opts *o, eval_row **rows, int *n_rows) {
    *o = (eval_opts){.methods_s = "full,keep,drop,am,fold", .budgets_s = "0.25,0.1", .limit = 1 << 30,
                     .form = PROBE_QA, .pr = {.interval = CLI_PROGRESS_DEFAULT_S}};
    cli_compact_opts_init(&o->q);
    int first;
    int rc = cli_opts_parse(&cli_eval_command, argc, argv, o, &first);
    if (rc != CLI_CONTINUE || (rc = cli_compact_opts_check(&o->q, CMD)) != CLI_CONTINUE)
        return rc;
    if (!o->model_dir || !o->docs || first != argc)
        return cli_usage_error(CMD, "--model and --docs are required");
    double budgets[16];
    const int n_budgets = parse_list(o->budgets_s, budgets, 16);
    if (n_budgets <= 0)
        return cli_usage_error(CMD, "--budget: fractions in (0, 1] separated by commas, not '%s'", o->budgets_s);
    *n_rows = parse_rows(o->methods_s, budgets, n_budgets, rows);
    return *n_rows < 0 ? KF_EXIT_USAGE : CLI_CONTINUE;
}

/* ---- the run ---- */

/* What a run opens: the documents, the model, the head budgets, the outputs. */
typedef struct {
    eval_ctx x;
    FILE *f, *probes_f;
    kf_backend *b;
    cli_progress pg;
    float *shares; /* [n_layers, kv_heads] --head-budgets */
    doc_text text; /* --chat: the model's tokenizer and template */
    doc_chat chat;
} eval_files;

static void eval_close(eval_files *r) {
    if (r->x.per_head)
        fclose(r->x.per_head);
    if (r->probes_f)
        fclose(r->probes_f);
    free(r->x.head_lse);
    free(r->x.head_out);
    free(r->shares);
    doc_chat_free(&r->chat);
    doc_text_free(&r->text);
    if (r->f)
        fclose(r->f);
    kf_model_free(r->x.m);
    if (r->b)
        r->b->destroy(r->b);
}

/* Opens everything o names; 0, or -1 (reported; -2: a usage error). */
static int eval_open(const eval_opts *o, eval_files *r) {
    eval_ctx *x = &r->x;
    *r = (eval_files){.x = {.docs = o->docs, .base = cli_compact_params(&o->q)}};
    if (!(r->f = fopen(o->docs, "r"))) {
        cli_error("eval quality", "%s: cannot open", o->docs);
        return -1;
    }
    if (!(x->m = cli_load_model("eval quality", o->model_dir, &r->b)))
        return -1;
    const kf_hfconfig *cfg = kf_model_config(x->m);
    const int n_heads = cfg->n_layers * cfg->n_kv_heads;
    doc_text_init(&r->text, o->model_dir, cfg->vocab_size);
    char err[1024];
    if (o->chat && doc_chat_open(&r->chat, &r->text, err, sizeof err)) {
        cli_usage_error("eval quality", "--chat: %s: %s", o->model_dir, err);
        return -2;
    }
    if (o->chat) {
        x->chat = &r->chat;
        x->base.chat_template = r->chat.digest;
    }
    if (o->head_budgets) {
        kf_error berr = {0};
        r->shares = malloc(sizeof(float) * (size_t)n_heads);
        if (!r->shares || kf_head_budgets_load(o->head_budgets, cfg->n_layers, cfg->n_kv_heads, r->shares, &berr) != KF_OK) {
            cli_error("eval quality", "%s", r->shares ? berr.msg : "out of memory");
            return -1;
        }
        x->base.solver.head_budgets = r->shares;
    }
    x->head_lse = calloc((size_t)n_heads, sizeof(double));
    x->head_out = calloc((size_t)n_heads, sizeof(double));
    if ((o->per_head_path && !(x->per_head = fopen(o->per_head_path, "w"))) ||
        (o->probes_out && !(r->probes_f = fopen(o->probes_out, "w")))) {
        cli_error("eval quality", "%s: cannot write", x->per_head || !o->per_head_path ? o->probes_out : o->per_head_path);
        return -1;
    }
    if (x->per_head)
        fprintf(x->per_head, "line\tmethod\tbudget\tlayer\tkv_head\tlse_err\tout_err\tvar_gain\n");
    return 0;
}

/* The documents a run will read: non-blank lines, at most limit; 0 when f cannot be read twice. */
static int count_docs(FILE *f, int limit) {
    long long n = 0;
    int c, blank = 1;
    if (fseek(f, 0, SEEK_CUR) != 0) /* a pipe: it can be read once only */
        return 0;
    while ((c = getc(f)) != EOF) {
        if (c == '\n') {
            n += !blank;
            blank = 1;
        } else if (!strchr(" \t\r", c))
            blank = 0;
    }
    n += !blank;
    if (fseek(f, 0, SEEK_SET) != 0)
        return 0;
    clearerr(f);
    return n < limit ? (int)n : limit;
}

/* Evaluates every document and prints the table; the exit status. */
static int eval_run(const eval_opts *o, eval_row *rows, int n_rows) {
    eval_files r;
    int rc = KF_EXIT_FAIL;
    const int opened = eval_open(o, &r);
    if (opened == -2)
        rc = KF_EXIT_USAGE; /* --chat on a model without a chat template */
    if (opened == 0) {
        eval_counts n = {0};
        const double t0 = cli_now();
        cli_progress_start(&r.pg, "[eval]", count_docs(r.f, (int)o->limit), 0, o->pr.quiet, o->pr.interval);
        r.x.pg = &r.pg;
        if (!o->pr.quiet)
            r.x.base.progress = cli_progress_fn, r.x.base.progress_user = &r.pg;
        rc = eval_documents(&r.x, r.f, r.probes_f, rows, n_rows, (int)o->limit, (int)o->probes, (probe_form)o->form, &n);
        if (n.n_read == 0) {
            cli_error("eval quality", "%s: no documents", o->docs);
            rc = KF_EXIT_FAIL;
        } else {
            print_table(rows, n_rows, o->tsv, &n);
            if (!o->tsv)
                print_footer(&n, o->probes, (probe_form)o->form, cli_now() - t0);
        }
    }
    eval_close(&r);
    return rc;
}

int cmd_eval(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        cli_opts_help(&cli_eval_command, argc < 2 ? stderr : stdout);
        return argc < 2 ? KF_EXIT_USAGE : KF_EXIT_OK;
    }
    if (strcmp(argv[1], "quality") != 0)
        return cli_usage_error("eval", "unknown evaluation '%s' (try 'kvfold eval quality')", argv[1]);
    eval_opts o;
    eval_row *rows = NULL;
    int n_rows = 0;
    int rc = eval_parse(argc - 1, argv + 1, &o, &rows, &n_rows);
    if (rc == CLI_CONTINUE)
        rc = eval_run(&o, rows, n_rows);
    free(rows);
    return rc;
}
