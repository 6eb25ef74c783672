/* kvfold eval quality — compaction quality on a records-style evaluation set. */
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compactor/evaluate.h"
#include "formats/budgets.h"
#include "tools/cli.h"
#include "tools/commands.h"

static const char kHelp[] =
    "Usage: kvfold eval quality --model DIR --docs FILE.jsonl [options]\n"
    "\n"
    "Compact every document with every (method, budget) and measure against the full context:\n"
    "  kl_repeat  mean KL(full || compacted) over the teacher-forced repeat continuation\n"
    "  kl_answer  the same over each question's answer tokens\n"
    "  copy_acc   teacher-forced copy accuracy of the repeat continuation\n"
    "  qa_em      exact match of greedy answers\n"
    "  lse_err    per-head mean |log-sum-exp error| of the compacted block on held-out queries\n"
    "  out_err    per-head relative attention-output error with the question appended\n"
    "Held-out queries are those of the evaluated questions; they are never used for fitting.\n"
    "\n"
    "The JSONL lines carry ids, repeat_instruction_ids and questions[] with question_ids and\n"
    "answer_ids (tests/data/records-dev.jsonl).\n"
    "\n"
    "Options:\n"
    "  --model DIR          model directory\n"
    "  --docs FILE          evaluation documents (JSONL)\n"
    "  --budgets LIST       kept fractions (default 0.25,0.1)\n"
    "  --methods LIST       keep,drop,am,fold (default all four)\n"
    "  --probes N           add N probe questions per document about records that are not\n"
    "                       evaluated (question + answer, built from the document's record lines)\n"
    "  --fold-queries W     all | probes: the queries the fold direction u is fitted on (default all)\n"
    "  --lambda X           fold ridge, relative to tr(Sigma)/d (default 0.01)\n"
    "  --per-head FILE      also write every head's lse_err, out_err and var(q.u) as TSV rows\n"
    "  --head-budgets FILE  per-head shares in AM's JSON form {\"L<layer>H<head>\": share}; C is set\n"
    "                       by the largest head, am pads the others with slots of bias -inf\n"
    "  --max-queries N      pooled reference queries per KV head (default 50000)\n"
    "  --limit N            only the first N documents\n"
    "  --chunk N            prefill chunk size (default 512)\n"
    CLI_PREFILL_HELP
    "                       (QUOKA applies to the compaction's document prefill; the full-context\n"
    "                       reference is always dense)\n"
    "  --format tsv|table   output format (default table)\n"
    "  -h, --help           show this help\n";

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

typedef struct {
    idvec doc, instr;
    idvec *q, *a;
    int n_qa;
    idvec *probes;
    int n_probes;
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

/* Probes: the first question's template with the name of a record that no evaluated question
 * asks about, followed by that record's answer. Record lines are "- <name> <value>\n": the
 * answer's first token is the name slot in the question. */
static void build_probes(eval_doc *d, int want) {
    d->probes = calloc((size_t)(want ? want : 1), sizeof *d->probes);
    if (!d->probes || d->n_qa == 0 || want == 0)
        return;
    const idvec *tq = &d->q[0], *ta = &d->a[0];
    int slot = -1;
    for (int i = 0; i < tq->n; i++)
        if (tq->ids[i] == ta->ids[0])
            slot = i;
    if (slot < 0 || ta->n < 2)
        return;
    const int32_t dash = d->doc.ids[0], nl = ta->ids[ta->n - 1];
    for (int i = 0; i + 3 < d->doc.n && d->n_probes < want; i++) {
        if (d->doc.ids[i] != dash || d->doc.ids[i + 3] != nl || (i > 0 && d->doc.ids[i - 1] != nl))
            continue;
        const int32_t name = d->doc.ids[i + 1], value = d->doc.ids[i + 2];
        int asked = 0;
        for (int k = 0; k < d->n_qa; k++)
            asked |= d->a[k].ids[0] == name;
        if (asked)
            continue;
        idvec *p = &d->probes[d->n_probes];
        p->n = tq->n + 3;
        p->ids = malloc(sizeof(int32_t) * (size_t)p->n);
        if (!p->ids)
            return;
        memcpy(p->ids, tq->ids, sizeof(int32_t) * tq->n);
        p->ids[slot] = name;
        p->ids[tq->n] = name, p->ids[tq->n + 1] = value, p->ids[tq->n + 2] = nl;
        d->n_probes++;
    }
}

static int parse_doc(const char *line, int lineno, const char *path, int want_probes, eval_doc *d) {
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
    build_probes(d, want_probes);
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

int cmd_eval(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fputs(kHelp, argc < 2 ? stderr : stdout);
        return argc < 2 ? KF_EXIT_USAGE : KF_EXIT_OK;
    }
    if (strcmp(argv[1], "quality") != 0)
        return cli_usage_error("eval", "unknown evaluation '%s' (try 'kvfold eval quality')", argv[1]);
    argc--, argv++;
    static const struct option opts[] = {
        {"help", no_argument, 0, 'h'},          {"model", required_argument, 0, 'm'},
        {"docs", required_argument, 0, 'd'},    {"budgets", required_argument, 0, 'b'},
        {"methods", required_argument, 0, 'M'}, {"probes", required_argument, 0, 'p'},
        {"format", required_argument, 0, 'f'},  {"limit", required_argument, 0, 'l'},
        {"fold-queries", required_argument, 0, 'F'}, {"lambda", required_argument, 0, 'L'},
        {"max-queries", required_argument, 0, 'Q'}, {"chunk", required_argument, 0, 'c'},
        {"head-budgets", required_argument, 0, 'H'}, {"per-head", required_argument, 0, 'P'},
        CLI_PREFILL_OPTIONS, {0, 0, 0, 0}};
    const char *head_budgets = NULL, *per_head_path = NULL;
    const char *model_dir = NULL, *docs = NULL, *methods_s = "keep,drop,am,fold", *budgets_s = "0.25,0.1";
    long long probes = 0, limit = 1 << 30, maxq = 50000;
    int tsv = 0;
    kf_compact_params base = kf_compact_params_default();
    kf_quoka_params prefill = cli_prefill_defaults();
    long long chunk = 0;
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (c) {
        case 'h': fputs(kHelp, stdout); return KF_EXIT_OK;
        case 'm': model_dir = optarg; break;
        case 'd': docs = optarg; break;
        case 'b': budgets_s = optarg; break;
        case 'M': methods_s = optarg; break;
        case 'p':
            if (cli_parse_int(optarg, 0, 100000, &probes))
                return cli_usage_error("eval quality", "--probes must be a count, not '%s'", optarg);
            break;
        case 'l':
            if (cli_parse_int(optarg, 1, 1 << 30, &limit))
                return cli_usage_error("eval quality", "--limit must be a positive count, not '%s'", optarg);
            break;
        case 'Q':
            if (cli_parse_int(optarg, 1, 1LL << 40, &maxq))
                return cli_usage_error("eval quality", "--max-queries must be a positive count, not '%s'", optarg);
            break;
        case 'f':
            if (strcmp(optarg, "tsv") && strcmp(optarg, "table"))
                return cli_usage_error("eval quality", "--format is tsv or table, not '%s'", optarg);
            tsv = strcmp(optarg, "tsv") == 0;
            break;
        case 'F':
            if (strcmp(optarg, "all") && strcmp(optarg, "probes"))
                return cli_usage_error("eval quality", "--fold-queries is all or probes, not '%s'", optarg);
            base.fold_queries = strcmp(optarg, "probes") == 0 ? KF_FOLD_ON_PROBES : KF_FOLD_ON_ALL;
            break;
        case 'L': {
            char *end;
            base.lambda_rel = strtod(optarg, &end);
            if (*end || !(base.lambda_rel >= 0))
                return cli_usage_error("eval quality", "--lambda must be a non-negative number, not '%s'", optarg);
            break;
        }
        case 'H': head_budgets = optarg; break;
        case 'P': per_head_path = optarg; break;
        case 'c':
            if (cli_parse_int(optarg, 1, 1 << 24, &chunk))
                return cli_usage_error("eval quality", "--chunk must be a positive count, not '%s'", optarg);
            break;
        default: {
            const int r = cli_prefill_option("eval quality", c, optarg, &prefill);
            if (r < 0)
                return KF_EXIT_USAGE;
            if (r == 0)
                return cli_usage_error("eval quality", "bad option");
        }
        }
    }
    base.quoka = cli_prefill_params(&prefill); /* the compaction's document prefill */
    base.chunk = (int)chunk;
    if (!model_dir || !docs || optind != argc)
        return cli_usage_error("eval quality", "--model and --docs are required");
    base.max_queries = maxq;
    double budgets[16];
    const int n_budgets = parse_list(budgets_s, budgets, 16);
    if (n_budgets <= 0)
        return cli_usage_error("eval quality", "--budgets: fractions in (0, 1] separated by commas, not '%s'", budgets_s);
    kf_method methods[4];
    int n_methods = 0;
    {
        char *copy = strdup(methods_s), *save = NULL;
        for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            if (n_methods == 4 || kf_method_parse(tok, &methods[n_methods]) != 0) {
                free(copy);
                return cli_usage_error("eval quality", "--methods: keep, drop, am or fold, not '%s'", tok);
            }
            n_methods++;
        }
        free(copy);
    }
    FILE *f = fopen(docs, "r");
    if (!f) {
        cli_error("eval quality", "%s: cannot open", docs);
        return KF_EXIT_FAIL;
    }
    kf_backend *b;
    kf_model *m = cli_load_model("eval quality", model_dir, &b);
    if (!m) {
        fclose(f);
        return KF_EXIT_FAIL;
    }
    float *shares = NULL;
    if (head_budgets) {
        const kf_hfconfig *cfg = kf_model_config(m);
        kf_error berr = {0};
        shares = malloc(sizeof(float) * (size_t)cfg->n_layers * cfg->n_kv_heads);
        if (!shares || kf_head_budgets_load(head_budgets, cfg->n_layers, cfg->n_kv_heads, shares, &berr) != KF_OK) {
            cli_error("eval quality", "%s", shares ? berr.msg : "out of memory");
            free(shares);
            fclose(f);
            kf_model_free(m);
            b->destroy(b);
            return KF_EXIT_FAIL;
        }
        base.head_budgets = shares;
    }
    /* per-head diagnostics, one TSV row per (document, method, budget, layer, KV head) */
    const int n_heads = kf_model_config(m)->n_layers * kf_model_config(m)->n_kv_heads;
    double *head_lse = calloc((size_t)n_heads, sizeof(double)), *head_out = calloc((size_t)n_heads, sizeof(double));
    FILE *per_head = per_head_path ? fopen(per_head_path, "w") : NULL;
    if (per_head_path && !per_head) {
        cli_error("eval quality", "%s: cannot write", per_head_path);
        free(head_lse);
        free(head_out);
        free(shares);
        fclose(f);
        kf_model_free(m);
        b->destroy(b);
        return KF_EXIT_FAIL;
    }
    if (per_head)
        fprintf(per_head, "line\tmethod\tbudget\tlayer\tkv_head\tlse_err\tout_err\tvar_gain\n");
    const int n_cfg = n_methods * n_budgets;
    kf_quality *sum = calloc((size_t)n_cfg, sizeof *sum);
    double *var_gain = calloc((size_t)n_cfg, sizeof *var_gain);
    int *fallbacks = calloc((size_t)n_cfg, sizeof *fallbacks);
    size_t cap = 0;
    char *line = NULL;
    int lineno = 0, n_docs = 0, rc = KF_EXIT_OK;
    const int tty = isatty(2);
    const double t0 = cli_now();
    while (n_docs < limit && getline(&line, &cap, f) > 0) {
        lineno++;
        if (line[strspn(line, " \t\r\n")] == 0)
            continue;
        eval_doc d;
        if (parse_doc(line, lineno, docs, (int)probes, &d) != 0) {
            rc = KF_EXIT_FAIL;
            continue;
        }
        kf_qa *qa = calloc((size_t)(d.n_qa ? d.n_qa : 1), sizeof *qa);
        kf_prompt *pr = calloc((size_t)(d.n_probes ? d.n_probes : 1), sizeof *pr);
        for (int i = 0; i < d.n_qa; i++)
            qa[i] = (kf_qa){{d.q[i].ids, d.q[i].n}, {d.a[i].ids, d.a[i].n}};
        for (int i = 0; i < d.n_probes; i++)
            pr[i] = (kf_prompt){d.probes[i].ids, d.probes[i].n};
        kf_prompt doc = {d.doc.ids, d.doc.n}, instr = {d.instr.ids, d.instr.n};
        kf_reference *ref = NULL;
        kf_error err = {0};
        if (kf_reference_build(m, &doc, &instr, qa, d.n_qa, &ref, &err) != KF_OK) {
            cli_error("eval quality", "%s:%d: %s", docs, lineno, err.msg);
            rc = KF_EXIT_FAIL;
        }
        for (int mi = 0; ref && mi < n_methods; mi++)
            for (int bi = 0; bi < n_budgets; bi++) {
                kf_compact_params p = base;
                p.method = methods[mi];
                p.budget = budgets[bi];
                p.repeat_instruction = instr;
                p.probes = pr;
                p.n_probes = d.n_probes;
                kf_compacted c;
                kf_quality q;
                if (kf_compact(m, NULL, &doc, NULL, &p, &c, &err) != KF_OK ||
                    kf_quality_measure(m, ref, &c, &q, head_lse, head_out, &err) != KF_OK) {
                    cli_error("eval quality", "%s:%d: %s", docs, lineno, err.msg);
                    rc = KF_EXIT_FAIL;
                    continue;
                }
                kf_quality_add(&sum[mi * n_budgets + bi], &q);
                for (int h = 0; per_head && h < n_heads; h++)
                    fprintf(per_head, "%d\t%s\t%g\t%d\t%d\t%.5f\t%.5f\t%.5f\n", lineno, kf_method_name(methods[mi]),
                            budgets[bi], h / c.kv_heads, h % c.kv_heads, head_lse[h], head_out[h], c.var_gain[h]);
                var_gain[mi * n_budgets + bi] += c.stats.mean_var_gain;
                fallbacks[mi * n_budgets + bi] += c.stats.fold_fallback_heads;
                kf_compacted_free(&c);
            }
        kf_reference_free(ref);
        n_docs++;
        fprintf(stderr, tty ? "\r[eval] %d documents, %.0f s   " : "[eval] %d documents, %.0f s\n", n_docs,
                cli_now() - t0);
        free(qa);
        free(pr);
        eval_doc_free(&d);
    }
    if (tty)
        fputc('\n', stderr);
    free(line);
    fclose(f);
    if (n_docs == 0) {
        cli_error("eval quality", "%s: no documents", docs);
        rc = KF_EXIT_FAIL;
    } else {
        if (tsv)
            printf("method\tbudget\tkl_repeat\tkl_answer\tcopy_acc\tqa_em\tlse_err\tout_err\n");
        else
            printf("%-6s %7s %10s %10s %9s %7s %8s %8s %9s\n", "method", "budget", "kl_repeat", "kl_answer",
                   "copy_acc", "qa_em", "lse_err", "out_err", "var(q.u)");
        for (int mi = 0; mi < n_methods; mi++)
            for (int bi = 0; bi < n_budgets; bi++) {
                kf_quality *s = &sum[mi * n_budgets + bi];
                kf_quality_mean(s, n_docs);
                if (tsv)
                    printf("%s\t%g\t%.4f\t%.4f\t%.4f\t%.4f\t%.4f\t%.4f\n", kf_method_name(methods[mi]), budgets[bi],
                           s->kl_repeat, s->kl_answer, s->copy_acc, s->qa_em, s->lse_err, s->out_err);
                else
                    printf("%-6s %7g %10.4f %10.4f %9.4f %7.4f %8.4f %8.4f %9.4f\n", kf_method_name(methods[mi]),
                           budgets[bi], s->kl_repeat, s->kl_answer, s->copy_acc, s->qa_em, s->lse_err, s->out_err,
                           var_gain[mi * n_budgets + bi] / n_docs);
            }
        if (!tsv)
            printf("%d documents, %lld probes each (at most), %.1f s\n", n_docs, probes, cli_now() - t0);
    }
    if (per_head)
        fclose(per_head);
    free(head_lse);
    free(head_out);
    free(shares);
    free(sum);
    free(var_gain);
    free(fallbacks);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}
