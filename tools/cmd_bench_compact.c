/* kvfold bench compact — where the time of one compaction goes. */
#include <cblas.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "compactor/compact.h"
#include "compactor/compact_flops.h"
#include "tools/cli.h"
#include "tools/cli_quality.h"
#include "tools/compact_options.h"
#include "tools/commands.h"

#define CMD "bench compact"

/* The formula's prediction for a document of n tokens and an instruction of n_instr, by term. */
static void print_peak(const kf_hfconfig *c, const kf_compact_params *base, int n, int n_instr, kf_dtype weights) {
    static const int32_t kNone[8] = {0};
    kf_compact_params p = *base;
    if (p.repeat_instruction.n == 0) /* --predict-only without --docs: the length is what counts */
        p.repeat_instruction = (kf_prompt){kNone, n_instr};
    kf_mem_shape sh;
    kf_mem_peak t;
    kf_compact_mem_shape(c, &p, 0, n, 0, openblas_get_num_threads(), &sh);
    sh.weights_bf16 = weights == KF_DTYPE_BF16;
    kf_compact_peak_bytes(c, &sh, &t);
    printf("  %-34s %8.3f GB (weights %.3f, arena %.3f, queries %.3f, targets %.3f, forward %.3f, solve %.3f, "
           "output %.3f, base %.3f; R %lld, t %lld)\n",
           "predicted peak", t.total / 1e9, t.weights / 1e9, t.arena / 1e9, t.queries / 1e9, t.targets / 1e9,
           t.forward / 1e9, t.solve / 1e9, t.output / 1e9, t.base / 1e9, (long long)sh.R, (long long)sh.t);
}

/* The forwards' FLOPs of a document of n tokens (instruction as print_peak); targets: the backend
 * fuses AM's targets into the attention. */
static kf_compact_flops count_flops(const kf_hfconfig *c, const kf_compact_params *base, int n, int n_instr,
                                    int targets) {
    kf_compact_params p = *base;
    if (p.repeat_instruction.n == 0) /* the count reads the instruction's length only */
        p.repeat_instruction = (kf_prompt){NULL, n_instr};
    kf_compact_flops f;
    kf_compact_flops_count(c, &p, 0, n, 0, targets, &f);
    return f;
}

/* GFLOP with 3 significant digits or more: 2221, 35.2, 1.25 */
static int gflop_decimals(double flop) {
    return flop < 1e10 ? 2 : (flop < 1e11 ? 1 : 0);
}

/* The FLOP and floor lines; returns the floor in units of the prefill (P). */
static double print_flops(const kf_compact_flops *f) {
    const double pre = kf_flops_total(&f->prefill), rep = kf_flops_total(&f->repeat);
    printf("FLOP: prefill %.*f GFLOP, repeat %.*f GFLOP (%.2f P)\n", gflop_decimals(pre), pre / 1e9,
           gflop_decimals(rep), rep / 1e9, rep / pre);
    printf("  %-34s %8.2f P\n", "floor (prefill + repeat)", 1 + rep / pre);
    return 1 + rep / pre;
}

/* --predict-only: config.json and the instruction's length, nothing else. */
static int predict(const char *dir, const char *docs, int n, const kf_compact_params *p) {
    int n_instr = 8;
    FILE *f = docs ? fopen(docs, "r") : NULL;
    char *line = NULL;
    size_t cap = 0;
    if (f && getline(&line, &cap, f) > 0) {
        json_t *o = json_loads(line, 0, NULL);
        const json_t *ri = json_object_get(o, "repeat_instruction_ids");
        n_instr = json_is_array(ri) ? (int)json_array_size(ri) : n_instr;
        json_decref(o);
    }
    free(line);
    if (f)
        fclose(f);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    kf_hfconfig c;
    kf_error err = {0};
    kf_dtype wdt;
    if (kf_hfconfig_load(&c, path, &err) != KF_OK || kf_weights_resolve(dir, &c, cli_weights(), &wdt, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
        return KF_EXIT_FAIL;
    }
    printf("predict %d tokens, %s, budget %g, instruction %d tokens, %d threads%s, %s weights\n", n,
           kf_method_name(p->method), p->budget, n_instr, openblas_get_num_threads(),
           p->run.arena_dtype == KF_DTYPE_BF16 ? ", bf16 arena" : "", wdt == KF_DTYPE_BF16 ? "bf16" : "fp32");
    print_peak(&c, p, n, n_instr, wdt);
    const kf_compact_flops fl = count_flops(&c, p, n, n_instr, 1);
    print_flops(&fl);
    return KF_EXIT_OK;
}

typedef struct {
    const char *dir, *docs;
    long long want; /* document tokens */
    int predict_only;
    cli_compact_opts q; /* the compaction's parameters (shared with compact and eval quality) */
} bench_opts;

static int set_method(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o, (void)err, (void)n;
    return kf_method_parse(arg, &((cli_compact_opts *)ctx)->p.method) ? -1 : 0;
}

#define B(field) OFF(bench_opts, field)
static const cli_opt kBenchRows[] = {
    {"model", 0, OPT_STR, "DIR", B(dir), .help = "model directory"},
    {"docs", 0, OPT_STR, "FILE", B(docs), .help = "JSONL documents (tests/data/records-dev.jsonl)"},
    {"tokens", 0, OPT_LLONG, "N", B(want), .lo = 16, .hi = 1 << 24, .must = "must be from 16 to 16777216 (2^24)",
     .def = "4000", .help = "document length"},
    {"budget", 0, OPT_REAL, "B", B(q.p.budget), .lo = 0, .open_lo = 1, .hi = 1, .must = "must be in (0, 1]",
     .def = "0.1", .help = "kept fraction"},
    {"method", 0, OPT_FN, "M", B(q), .set = set_method, .must = "is keep, drop, am or fold", .def = "fold",
     .help = "keep, drop, am or fold"},
    {"predict-only", 0, OPT_FLAG, NULL, B(predict_only),
     .help = "print the predicted peak only (no weights loaded, nothing compacted; the safetensors headers "
             "are read for --weights auto; --arena-dtype counts too)"},
    {0}};

static const cli_group kGroups[] = {
    {NULL, kBenchRows, 0},
    {NULL, cli_max_queries_rows, B(q)},
    {NULL, cli_refq_dtype_rows, B(q)},
    {NULL, cli_arena_dtype_rows, B(q)},
    {NULL, cli_weights_rows, 0},
    {"Reference queries", cli_refq_source_rows, B(q)},
    {"Prefill (the floor stays the dense forwards')", cli_prefill_rows, B(q.prefill)},
    {NULL, cli_quoka_repeat_rows, B(q)},
    {0}};

const cli_command cli_bench_compact_command = {
    .name = CMD,
    .usage = "kvfold bench compact --model DIR --docs FILE.jsonl [--tokens N] [--budget B] [--method M]\n",
    .about = "Builds one document of about N tokens by concatenating the documents of a records-style JSONL\n"
             "file (fields ids and repeat_instruction_ids), compacts it once, and prints the time of each\n"
             "stage: prefill, repeat prefill (reference queries), selection, beta fit, value fit, fold and the\n"
             "per-head choice, with the ratio of selection + choice + beta + values + fold to the prefill; the\n"
             "FLOPs of the forwards no solve avoids (compactor/compact_flops.h: the document's prefill and the\n"
             "repeat, probes included, as the code runs them), their sum as the floor in units of the prefill\n"
             "(P) and the total time over the floor; then the peak memory the formula of compactor/compact.h\n"
             "predicts (by term), each solve workspace's declared size and the most of it a head used, and\n"
             "the process's measured peak resident set (getrusage ru_maxrss, the whole process: loading the\n"
             "model included).\n"
             "With --predict-only only config.json (and the checkpoint's header) is read: the prediction for a\n"
             "document of N tokens (the repeat instruction's length from --docs when given, else 8 tokens)\n"
             "and its FLOPs (counted with the CPU backend's fused targets).\n",
    .groups = kGroups,
    .exit_status = "  0  measured (or predicted)\n"
                   "  1  the documents, the model or the compaction failed (reported)\n"
                   "  2  usage errors\n",
    .example = "  kvfold bench compact --model records-qwen3 --docs records-dev.jsonl --tokens 2048\n",
};

static int bench_parse(int argc, char **argv, bench_opts *o) {
    *o = (bench_opts){.want = 4000};
    cli_compact_opts_init(&o->q);
    int first;
    int rc = cli_opts_parse(&cli_bench_compact_command, argc, argv, o, &first);
    if (rc != CLI_CONTINUE || (rc = cli_compact_opts_check(&o->q, CMD)) != CLI_CONTINUE)
        return rc;
    if (!o->dir || (!o->docs && !o->predict_only) || first != argc)
        return cli_usage_error(CMD, "--model and --docs are required");
    return CLI_CONTINUE;
}

/* The document: the first `want` ids of the JSONL lines in turn, and the first line's repeat
 * instruction (instr [64]); -1 when there are not enough (reported). */
static int read_doc(const char *docs, long long want, int32_t **ids_out, int *n_out, int32_t *instr, int *n_instr) {
    FILE *f = fopen(docs, "r");
    if (!f) {
        cli_error(CMD, "%s: cannot open", docs);
        return -1;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)want); /* [want] */
    int n = 0, lineno = 0;
    char *line = NULL;
    size_t cap = 0;
    *n_instr = 0;
    while (n < want && ids && getline(&line, &cap, f) > 0) {
        lineno++;
        json_t *o = json_loads(line, 0, NULL);
        json_t *arr = json_object_get(o, "ids"), *ri = json_object_get(o, "repeat_instruction_ids");
        if (!json_is_array(arr)) {
            cli_error(CMD, "%s:%d: no ids array", docs, lineno);
            json_decref(o);
            continue;
        }
        size_t i;
        json_t *v;
        json_array_foreach(arr, i, v) {
            if (n < want && json_is_integer(v))
                ids[n++] = (int32_t)json_integer_value(v);
        }
        if (!*n_instr && json_is_array(ri))
            json_array_foreach(ri, i, v) {
                if (*n_instr < 64 && json_is_integer(v))
                    instr[(*n_instr)++] = (int32_t)json_integer_value(v);
            }
        json_decref(o);
    }
    free(line);
    fclose(f);
    if (!ids || n < want || !*n_instr) {
        cli_error(CMD, "%s: only %d tokens (need %lld) or no repeat_instruction_ids", docs, n, want);
        free(ids);
        return -1;
    }
    *ids_out = ids;
    *n_out = n;
    return 0;
}

/* The floor (the forwards' FLOPs, f) against the measured times: the floor in units of the prefill
 * (P), the total over it and the rates the forwards reached. */
static void print_floor(const kf_compact_flops *f, const kf_compact_stats *s, double total) {
    const double pre = kf_flops_total(&f->prefill), rep = kf_flops_total(&f->repeat), floor_p = print_flops(f);
    printf("  %-34s %8.2f\n", "total / floor", total / s->prefill_s / floor_p);
    printf("FLOP rate: prefill %.1f GFLOP/s, repeat %.1f GFLOP/s\n", pre / 1e9 / s->prefill_s,
           s->refq_s > 0 ? rep / 1e9 / s->refq_s : 0.0);
}

/* The stage times of one compaction that took total seconds. */
static void print_stages(const kf_compacted *c, const kf_compact_params *p, int n, double total) {
    const kf_compact_stats *s = &c->stats;
    const double work = s->select_s + s->choice_s + s->beta_s + s->values_s + s->fold_s;
    printf("compact %d tokens, %s, budget %g -> C = %lld, %lld queries per KV head%s\n", n, kf_method_name(p->method),
           p->budget, (long long)c->C, (long long)s->n_queries, p->run.arena_dtype == KF_DTYPE_BF16 ? ", bf16 arena" : "");
    printf("  %-34s %8.3f s\n", "prefill (document)", s->prefill_s);
    printf("  %-34s %8.3f s\n", "repeat prefill (reference queries)", s->refq_s);
    /* the solve's stages run on several threads at once (one KV head each): their lines are
     * thread-seconds; the solve's wall time is what the whole job spends after the forwards */
    printf("  %-34s %8.3f s (thread-seconds)\n", "selection (scores + top-t)", s->select_s);
    printf("  %-34s %8.3f s (thread-seconds)\n", "beta fit", s->beta_s);
    printf("  %-34s %8.3f s (thread-seconds)\n", "value fit", s->values_s);
    printf("  %-34s %8.3f s (thread-seconds)\n", "fold (direction, key shift)", s->fold_s);
    printf("  %-34s %8.3f s (thread-seconds)\n", "per-head choice (validation)", s->choice_s);
    printf("  %-34s %8.3f s\n", "solve (wall)", total - s->prefill_s - s->refq_s);
    printf("  %-34s %8.3f s\n", "total", total);
    printf("ratio (selection + choice + beta + values + fold) / prefill = %.2f (thread-seconds)\n",
           work / s->prefill_s);
    printf("ratio total / prefill = %.2f (target <= 2.5)\n", total / s->prefill_s);
}

/* The process's measured peak against the model's weights (in the dtype they are held in). */
static void print_measured_peak(kf_model *m) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    const double measured = (double)ru.ru_maxrss * 1024;
    printf("  %-34s %8.3f GB (getrusage ru_maxrss)\n", "measured peak", measured / 1e9);
    const double w = (double)kf_model_weight_bytes(m);
    printf("measured peak / %s weights (%.3f GB) = %.2f; target 1.5 x weights + 1 GB = %.3f GB\n",
           kf_model_weight_dtype(m) == KF_DTYPE_BF16 ? "bf16" : "fp32", w / 1e9, measured / w, (1.5 * w + 1e9) / 1e9);
}

/* Loads the model, compacts the document once and reports. */
static int bench_run(const bench_opts *o, kf_compact_params *p) {
    int32_t *ids = NULL, instr[64]; /* [n] the document, [n_instr] its repeat instruction */
    int n = 0, n_instr = 0;
    if (read_doc(o->docs, o->want, &ids, &n, instr, &n_instr))
        return KF_EXIT_FAIL;
    kf_backend *b;
    kf_model *m = cli_load_model(CMD, o->dir, &b);
    if (!m) {
        free(ids);
        return KF_EXIT_FAIL;
    }
    p->repeat_instruction = (kf_prompt){instr, n_instr};
    kf_prompt doc = {ids, n};
    kf_compacted c;
    kf_error err = {0};
    const double t0 = cli_now();
    int rc = KF_EXIT_OK;
    if (kf_compact(m, NULL, &doc, NULL, p, &c, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
        rc = KF_EXIT_FAIL;
    } else {
        const double total = cli_now() - t0;
        print_stages(&c, p, n, total);
        const kf_forward_args dense = {0};
        const kf_compact_flops f =
            count_flops(kf_model_config(m), p, n, n_instr, kf_model_targets_supported(m, &dense));
        print_floor(&f, &c.stats, total);
        print_peak(kf_model_config(m), p, n, n_instr, kf_model_weight_dtype(m));
        printf("  %-34s %8.3f GB, %.3f GB used at most\n", "solve workspace (each, declared)", c.stats.ws_bytes / 1e9,
               c.stats.ws_peak / 1e9);
        print_measured_peak(m);
        kf_compacted_free(&c);
    }
    free(ids);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}

int cmd_bench_compact(int argc, char **argv) {
    bench_opts o;
    const int rc = bench_parse(argc, argv, &o);
    if (rc != CLI_CONTINUE)
        return rc;
    kf_compact_params p = cli_compact_params(&o.q);
    return o.predict_only ? predict(o.dir, o.docs, (int)o.want, &p) : bench_run(&o, &p);
}
