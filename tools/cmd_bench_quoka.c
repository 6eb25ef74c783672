/* kvfold bench attention / bench quoka — QUOKA against dense attention, measured in the same run:
 * speed of one chunk's attention over long histories, and accuracy of whole prefills on the
 * records model's repeat prompts. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/compact_options.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fill_uniform(float *x, size_t n, unsigned long long seed) {
    unsigned long long s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)((double)(s >> 40) / (double)(1ULL << 24)) * 2.0f - 1.0f;
    }
}

/* ---- bench attention ------------------------------------------------------------------ */

typedef struct {
    const char *hist_text;
    long long chunk, nh, kvh, hd, repeat;
    kf_quoka_params qp;
} attn_opts;

#define A(field) OFF(attn_opts, field)
#define COUNT_ROW(nm, a, field, d, h) \
    {nm, 0, OPT_LLONG, a, field, .lo = 1, .hi = 1 << 24, .must = "must be a positive integer", .def = d, .help = h}
static const cli_opt kAttnRows[] = {
    {"history", 0, OPT_STR, "P[,P...]", A(hist_text), .def = "4096,16384,65536", .help = "history lengths"},
    COUNT_ROW("chunk", "C", A(chunk), "512", "queries in the chunk"),
    COUNT_ROW("heads", "H", A(nh), "4", "query heads (4: the records/hf-qwen3-tiny shape)"),
    COUNT_ROW("kv-heads", "G", A(kvh), "2", "KV heads"),
    COUNT_ROW("head-dim", "D", A(hd), "64", "head dimension"),
    COUNT_ROW("repeat", "R", A(repeat), "3", "timed runs"),
    {0}};

const cli_command cli_bench_attention_command = {
    .name = "bench attention",
    .usage = "kvfold bench attention [--history LIST] [--chunk C] [--heads H] [--kv-heads G]\n"
             "                              [--head-dim D] [--quoka-budget B] [--quoka-nq N] [--repeat R]\n",
    .about = "One chunk of C queries attending to a history of P keys plus its own C keys (causal), on\n"
             "random data, through the CPU backend: dense attention against QUOKA (selection + sparse\n"
             "attention, the same driver the prefill uses), median of R runs after a warm-up, in the same\n"
             "run. Prints a table and one 'ratio <P> <dense/quoka>' line per history for scripts.\n",
    .groups = (const cli_group[]){{NULL, kAttnRows, 0}, {"QUOKA", cli_prefill_rows, A(qp)}, {0}},
    .exit_status = "  0  measured\n"
                   "  1  out of memory or a failed run\n"
                   "  2  usage errors\n",
    .example = "  kvfold bench attention --history 2048,8192 --chunk 64 --quoka-budget 256\n",
};

static double median_time(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return t[n / 2];
}

int cmd_bench_attention(int argc, char **argv) {
    const char *cmd = "bench attention";
    attn_opts o = {.hist_text = "4096,16384,65536", .chunk = 512, .nh = 4, .kvh = 2, .hd = 64, .repeat = 3,
                   .qp = kf_quoka_params_default()};
    int first;
    const int prc = cli_opts_parse(&cli_bench_attention_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first != argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[first]);
    const char *hist_text = o.hist_text;
    const long long chunk = o.chunk, nh = o.nh, kvh = o.kvh, hd = o.hd, repeat = o.repeat;
    kf_quoka_params qp = o.qp;
    if (nh % kvh || hd > KF_MAX_HEAD_DIM)
        return cli_usage_error(cmd, "--heads must be a multiple of --kv-heads and --head-dim at most %d",
                               KF_MAX_HEAD_DIM);
    qp.mode = KF_PREFILL_QUOKA;
    kf_error err = {0};
    if (kf_quoka_params_check(&qp, &err) != KF_OK)
        return cli_usage_error(cmd, "%s", err.msg);
    int32_t *hist;
    int n_hist;
    char msg[128];
    if (cli_parse_ids(hist_text, &hist, &n_hist, msg, sizeof msg))
        return cli_usage_error(cmd, "--history: %s", msg);

    kf_backend *b = kf_backend_cpu_create();
    if (!b) {
        free(hist);
        cli_error(cmd, "out of memory");
        return KF_EXIT_FAIL;
    }
    char desc[160];
    printf("chunk %lld queries, heads %lld/%lld, head_dim %lld, %s, median of %lld\n", chunk, nh, kvh, hd,
           kf_quoka_describe(&qp, desc, sizeof desc), repeat);
    printf("%10s %12s %12s %12s %10s\n", "history", "dense ms", "quoka ms", "select ms", "ratio");
    int rc = KF_EXIT_OK;
    double *t = malloc(sizeof(double) * (size_t)(repeat + 1) * 3);
    for (int hi = 0; hi < n_hist && rc == KF_EXIT_OK; hi++) {
        const int P = hist[hi], nk = P + (int)chunk, n_pages = (nk + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
        const size_t row = (size_t)kvh * hd, block = (size_t)KF_PAGE_TOKENS * row;
        float *pool = malloc(sizeof(float) * (size_t)n_pages * 2 * block);      /* [pages, K|V, 16, kvh, hd] */
        float *q = malloc(sizeof(float) * (size_t)chunk * nh * hd);             /* [chunk, nh, hd] */
        float *out = malloc(sizeof(float) * (size_t)chunk * nh * hd);           /* [chunk, nh, hd] */
        int32_t *pages = malloc(sizeof(int32_t) * (size_t)n_pages);
        if (!pool || !q || !out || !pages || !t) {
            cli_error(cmd, "out of memory for a history of %d keys", P);
            rc = KF_EXIT_FAIL;
        } else {
            fill_uniform(pool, (size_t)n_pages * 2 * block, (unsigned long long)P);
            fill_uniform(q, (size_t)chunk * nh * hd, 7);
            for (int p = 0; p < n_pages; p++)
                pages[p] = p;
            kf_attn_args at = {.q = q, .q_stride = (size_t)(nh * hd), .out = out, .out_stride = (size_t)(nh * hd),
                               .n_q = (int)chunk, .n_heads = (int)nh, .n_keys = nk, .pages = pages,
                               .kv = {.k = pool, .v = pool + block, .page_stride = 2 * block,
                                      .kv_heads = (int)kvh, .head_dim = (int)hd},
                               .scale = 1.0f / sqrtf((float)hd)};
            kf_quoka_ws ws;
            if (kf_quoka_ws_init(&ws, b, &qp, (int)kvh, nk, &err) != KF_OK) {
                cli_error(cmd, "%s", err.msg);
                rc = KF_EXIT_FAIL;
            } else {
                double *td = t, *tq = t + repeat + 1, *ts = t + 2 * (repeat + 1);
                const int budget = kf_quoka_budget(&qp, P);
                kf_quoka_select_args sel = {.q = q, .q_stride = at.q_stride, .n_q = at.n_q, .n_heads = at.n_heads,
                                            .n_hist = P, .pages = pages, .kv = at.kv, .n_keep = qp.n_q,
                                            .budget = budget, .n_sink = qp.n_sink, .out_idx = ws.idx,
                                            .idx_stride = ws.cap};
                for (int r = 0; r <= repeat; r++) { /* run 0 is the warm-up */
                    double t0 = cli_now();
                    b->attention(b, &at);
                    td[r] = cli_now() - t0;
                    t0 = cli_now();
                    kf_quoka_attention(&ws, &at);
                    tq[r] = cli_now() - t0;
                    t0 = cli_now();
                    b->quoka_select(b, &sel);
                    ts[r] = cli_now() - t0;
                }
                if (b->take_error(b)) {
                    cli_error(cmd, "the backend ran out of memory");
                    rc = KF_EXIT_FAIL;
                } else {
                    const double d = median_time(td + 1, (int)repeat), s = median_time(tq + 1, (int)repeat),
                                 sl = median_time(ts + 1, (int)repeat);
                    printf("%10d %12.2f %12.2f %12.2f %9.2fx%s\n", P, d * 1e3, s * 1e3, sl * 1e3, d / s,
                           ws.n_sparse ? "" : "  (history fits the budget: dense)");
                    printf("ratio %d %.3f\n", P, d / s);
                    fflush(stdout);
                }
                kf_quoka_ws_free(&ws);
            }
        }
        free(pool);
        free(q);
        free(out);
        free(pages);
    }
    free(t);
    free(hist);
    b->destroy(b);
    return rc;
}

/* ---- bench quoka (accuracy) ----------------------------------------------------------- */

typedef struct {
    const char *dir, *docs, *lines_text, *chunks_text, *budgets_text;
    long long max_docs, nq, sinks, margin;
} quoka_opts;

#define Q(field) OFF(quoka_opts, field)
static const cli_opt kQuokaRows[] = {
    {"model", 0, OPT_STR, "DIR", Q(dir), .help = "the records model (tests/data/records-qwen3)"},
    {"docs", 0, OPT_STR, "FILE", Q(docs), .help = "records JSONL (tests/data/records-dev.jsonl)"},
    {"lines", 0, OPT_STR, "N[,N...]", Q(lines_text), .def = "128,256", .help = "use documents with these line counts"},
    {"max-docs", 0, OPT_LLONG, "N", Q(max_docs), .lo = 1, .hi = 1 << 24, .must = "must be a positive integer",
     .def = "4", .help = "at most N documents"},
    {"chunk", 0, OPT_STR, "C[,C...]", Q(chunks_text), .def = "128,512", .help = "prefill chunk sizes"},
    {"chunks", 0, OPT_ALIAS, .target = "chunk"},
    {"quoka-budget", 0, OPT_STR, "B[,B...]", Q(budgets_text), .def = "128,256,512,1024",
     .help = "history keys kept per KV head (B_KV), counts"},
    {"budgets", 0, OPT_ALIAS, .target = "quoka-budget"},
    {"quoka-nq", 0, OPT_LLONG, "N", Q(nq), .lo = 1, .hi = 1 << 24, .must = "must be a positive integer", .def = "16",
     .help = "queries kept per head to choose keys"},
    {"quoka-sinks", 0, OPT_LLONG, "N", Q(sinks), .lo = 0, .hi = 1 << 24, .must = "must be an integer >= 0",
     .def = "4", .help = "always-kept first tokens of the sinks variant"},
    {"sinks", 0, OPT_ALIAS, .target = "quoka-sinks"},
    {"margin", 0, OPT_LLONG, "M", Q(margin), .lo = 0, .hi = 1 << 24, .must = "must be an integer >= 0", .def = "16",
     .help = "margin of the aligned window"},
    {0}};

const cli_command cli_bench_quoka_command = {
    .name = "bench quoka",
    .usage = "kvfold bench quoka --model DIR --docs FILE [--lines LIST] [--max-docs N] [--chunk LIST]\n"
             "                          [--quoka-budget LIST] [--quoka-nq N] [--quoka-sinks N] [--margin M]\n",
    .about = "Accuracy of QUOKA prefill against dense prefill on repeat prompts <doc><instruction><doc>\n"
             "built from a records JSONL file (fields ids, repeat_instruction_ids, lines), all in one run.\n"
             "For each chunk size and budget, three variants: plain QUOKA, with the first --quoka-sinks\n"
             "tokens always kept, and with the aligned window (the copy's source span +- --margin tokens,\n"
             "added to the selection during the copy). Reports, averaged over documents:\n"
             "  kl_doc / kl_copy   mean KL(dense || quoka) of next-token distributions over positions that\n"
             "                     predict the document / the copy (positions in the first chunks, whose\n"
             "                     history fits the budget, count with KL 0)\n"
             "  agree              top-1 agreement with dense over those positions\n"
             "  copy_acc           teacher-forced copy accuracy (argmax = next copy token); dense's in the header\n",
    .groups = (const cli_group[]){{NULL, kQuokaRows, 0}, {0}},
    .exit_status = "  0  measured\n"
                   "  1  the documents or the model cannot be used, or a prefill failed\n"
                   "  2  usage errors\n",
    .example = "  kvfold bench quoka --model records-qwen3 --docs records-dev.jsonl --quoka-budget 256,1024\n",
};

typedef struct {
    double kl_doc, kl_copy, agree, acc;
} metrics;

static int argmax(const float *x, int n) {
    int a = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[a])
            a = i;
    return a;
}

static void log_softmax(const float *x, int n, double *out) {
    double mx = -INFINITY, s = 0;
    for (int i = 0; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++)
        s += exp(x[i] - mx);
    const double lse = mx + log(s);
    for (int i = 0; i < n; i++)
        out[i] = x[i] - lse;
}

/* Positions p < nd - 1 predict the document, p >= nd + ni - 1 the copy. */
static metrics compare(const float *dense, const float *test, const int32_t *ids, int n, int nd, int ni, int V,
                       double *lp, double *lq) {
    metrics m = {0};
    int n_doc = 0, n_copy = 0, agree = 0;
    for (int p = 0; p < n - 1; p++) {
        const int in_doc = p < nd - 1, in_copy = p >= nd + ni - 1;
        if (!in_doc && !in_copy)
            continue;
        const float *x = dense + (size_t)p * V, *y = test + (size_t)p * V;
        log_softmax(x, V, lp);
        log_softmax(y, V, lq);
        double kl = 0;
        for (int i = 0; i < V; i++)
            kl += exp(lp[i]) * (lp[i] - lq[i]);
        const int ay = argmax(y, V);
        agree += argmax(x, V) == ay;
        if (in_doc) {
            m.kl_doc += kl;
            n_doc++;
        } else {
            m.kl_copy += kl;
            m.acc += ay == ids[p + 1];
            n_copy++;
        }
    }
    m.kl_doc /= n_doc > 0 ? n_doc : 1;
    m.kl_copy /= n_copy > 0 ? n_copy : 1;
    m.acc /= n_copy > 0 ? n_copy : 1;
    m.agree = (double)agree / (n_doc + n_copy > 0 ? n_doc + n_copy : 1);
    return m;
}

typedef struct {
    int32_t *ids; /* [n] the repeat prompt */
    int n, nd, ni;
    char id[64];
} prompt;

static int in_list(const int32_t *list, int n, int v) {
    for (int i = 0; i < n; i++)
        if (list[i] == v)
            return 1;
    return 0;
}

/* Repeat prompts of up to max documents whose line count is in lines[]. */
static int load_prompts(const char *cmd, const char *path, const int32_t *lines, int n_lines, int max, prompt **out,
                        int *n_out) {
    FILE *f = fopen(path, "r");
    if (!f) {
        cli_error(cmd, "cannot open %s", path);
        return -1;
    }
    *out = calloc((size_t)max, sizeof **out);
    *n_out = 0;
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, bad = 0;
    while (*out && *n_out < max && getline(&line, &cap, f) > 0) {
        lineno++;
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        json_t *ids = o ? json_object_get(o, "ids") : NULL, *ins = o ? json_object_get(o, "repeat_instruction_ids") : NULL;
        json_t *nl = o ? json_object_get(o, "lines") : NULL, *id = o ? json_object_get(o, "id") : NULL;
        if (!json_is_array(ids) || !json_is_array(ins) || !json_is_integer(nl)) {
            cli_error(cmd, "%s:%d: not a records document (ids, repeat_instruction_ids, lines)", path, lineno);
            json_decref(o);
            bad = 1;
            break;
        }
        if (in_list(lines, n_lines, (int)json_integer_value(nl))) {
            prompt *p = &(*out)[(*n_out)++];
            p->nd = (int)json_array_size(ids);
            p->ni = (int)json_array_size(ins);
            p->n = 2 * p->nd + p->ni;
            p->ids = malloc(sizeof(int32_t) * (size_t)p->n);
            snprintf(p->id, sizeof p->id, "%s", json_is_string(id) ? json_string_value(id) : "?");
            if (!p->ids) {
                json_decref(o);
                bad = 1;
                break;
            }
            for (int i = 0; i < p->nd; i++)
                p->ids[i] = p->ids[p->nd + p->ni + i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
            for (int i = 0; i < p->ni; i++)
                p->ids[p->nd + i] = (int32_t)json_integer_value(json_array_get(ins, (size_t)i));
        }
        json_decref(o);
    }
    free(line);
    fclose(f);
    if (!*out) {
        cli_error(cmd, "out of memory");
        return -1;
    }
    return bad ? -1 : 0;
}

/* All-row logits of a prefill. */
static int run_prefill(kf_model *m, const prompt *p, int chunk, const kf_quoka_params *qp, const int32_t *rows,
                       float *logits, kf_error *err) {
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    if (kf_model_arena(m, &a, p->n, err) != KF_OK)
        return -1;
    kf_forward_args fa = {.ids = p->ids, .n_tokens = p->n, .chunk = chunk, .logit_rows = rows, .n_logit_rows = p->n,
                          .logits = logits, .quoka = qp};
    kf_status st = kf_model_forward(m, &a, &seq, &fa, err);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    return st == KF_OK ? 0 : -1;
}

int cmd_bench_quoka(int argc, char **argv) {
    const char *cmd = "bench quoka";
    quoka_opts o = {.lines_text = "128,256", .chunks_text = "128,512", .budgets_text = "128,256,512,1024",
                    .max_docs = 4, .nq = 16, .sinks = 4, .margin = 16};
    int first;
    const int prc = cli_opts_parse(&cli_bench_quoka_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (!o.dir || !o.docs || first != argc)
        return cli_usage_error(cmd, "--model and --docs are required");
    const char *dir = o.dir, *docs = o.docs, *lines_text = o.lines_text, *chunks_text = o.chunks_text,
               *budgets_text = o.budgets_text;
    const long long max_docs = o.max_docs, nq = o.nq, sinks = o.sinks, margin = o.margin;
    int32_t *lines = NULL, *chunks = NULL, *budgets = NULL;
    int n_lines = 0, n_chunks = 0, n_budgets = 0;
    char msg[128];
    if (cli_parse_ids(lines_text, &lines, &n_lines, msg, sizeof msg) ||
        cli_parse_ids(chunks_text, &chunks, &n_chunks, msg, sizeof msg) ||
        cli_parse_ids(budgets_text, &budgets, &n_budgets, msg, sizeof msg)) {
        free(lines);
        free(chunks);
        return cli_usage_error(cmd, "bad list: %s", msg);
    }
    prompt *ps = NULL;
    int n_ps = 0;
    kf_backend *b = NULL;
    kf_model *m = NULL;
    int rc = KF_EXIT_FAIL;
    float *dense = NULL, *test = NULL;
    double *lp = NULL, *lq = NULL, *acc = NULL, dense_acc = 0;
    int32_t *rows = NULL;
    if (load_prompts(cmd, docs, lines, n_lines, (int)max_docs, &ps, &n_ps) != 0)
        goto out;
    if (n_ps == 0) {
        cli_error(cmd, "no document in %s has a line count in {%s}", docs, lines_text);
        goto out;
    }
    m = cli_load_model(cmd, dir, &b);
    if (!m)
        goto out;
    const int V = kf_model_config(m)->vocab_size;
    int max_n = 0;
    for (int i = 0; i < n_ps; i++)
        max_n = ps[i].n > max_n ? ps[i].n : max_n;
    enum { N_VAR = 3 };
    static const char *var_name[N_VAR] = {"plain", "sinks", "window"};
    const size_t n_cells = (size_t)n_chunks * n_budgets * N_VAR;
    dense = malloc(sizeof(float) * (size_t)max_n * V);
    test = malloc(sizeof(float) * (size_t)max_n * V);
    lp = malloc(sizeof(double) * (size_t)V);
    lq = malloc(sizeof(double) * (size_t)V);
    rows = malloc(sizeof(int32_t) * (size_t)max_n);
    acc = calloc(n_cells * 4, sizeof(double)); /* [chunk, budget, variant, metric] sums over documents */
    if (!dense || !test || !lp || !lq || !rows || !acc) {
        cli_error(cmd, "out of memory");
        goto out;
    }
    for (int i = 0; i < max_n; i++)
        rows[i] = i;
    printf("QUOKA vs dense prefill on %d repeat prompt(s) of %s (N_Q %lld):\n", n_ps, KF_ESC(docs), nq);
    kf_error err = {0};
    int n_dense_acc = 0;
    for (int d = 0; d < n_ps; d++) {
        const prompt *p = &ps[d];
        fprintf(stderr, "  %s: %d tokens (document %d, instruction %d)\n", p->id, p->n, p->nd, p->ni);
        for (int ci = 0; ci < n_chunks; ci++) {
            if (run_prefill(m, p, chunks[ci], NULL, rows, dense, &err)) {
                cli_error(cmd, "%s", err.msg);
                goto out;
            }
            metrics self = compare(dense, dense, p->ids, p->n, p->nd, p->ni, V, lp, lq);
            dense_acc += self.acc;
            n_dense_acc++;
            for (int bi = 0; bi < n_budgets; bi++)
                for (int v = 0; v < N_VAR; v++) {
                    kf_quoka_params qp = kf_quoka_params_default();
                    qp.n_q = (int)nq;
                    qp.budget = budgets[bi];
                    if (v == 1)
                        qp.n_sink = (int)sinks;
                    if (v == 2) {
                        qp.align_start = p->nd + p->ni;
                        qp.align_shift = p->nd + p->ni;
                        qp.align_margin = (int)margin;
                    }
                    if (run_prefill(m, p, chunks[ci], &qp, rows, test, &err)) {
                        cli_error(cmd, "%s", err.msg);
                        goto out;
                    }
                    metrics r = compare(dense, test, p->ids, p->n, p->nd, p->ni, V, lp, lq);
                    double *cell = acc + (((size_t)ci * n_budgets + bi) * N_VAR + v) * 4;
                    cell[0] += r.kl_doc;
                    cell[1] += r.kl_copy;
                    cell[2] += r.agree;
                    cell[3] += r.acc;
                }
        }
    }
    printf("dense copy accuracy %.3f\n", dense_acc / n_dense_acc);
    printf("%6s %7s %8s %8s %8s %7s %9s\n", "chunk", "budget", "variant", "kl_doc", "kl_copy", "agree", "copy_acc");
    for (int ci = 0; ci < n_chunks; ci++)
        for (int bi = 0; bi < n_budgets; bi++)
            for (int v = 0; v < N_VAR; v++) {
                const double *cell = acc + (((size_t)ci * n_budgets + bi) * N_VAR + v) * 4;
                printf("%6d %7d %8s %8.3f %8.3f %7.3f %9.3f\n", chunks[ci], budgets[bi], var_name[v], cell[0] / n_ps,
                       cell[1] / n_ps, cell[2] / n_ps, cell[3] / n_ps);
            }
    rc = KF_EXIT_OK;
out:
    for (int i = 0; i < n_ps; i++)
        free(ps[i].ids);
    free(ps);
    free(dense);
    free(test);
    free(lp);
    free(lq);
    free(rows);
    free(acc);
    free(lines);
    free(chunks);
    free(budgets);
    if (m)
        kf_model_free(m);
    if (b)
        b->destroy(b);
    return rc;
}
