/* kvfold bench — benchmark commands. They print rates; drivers in tools/ put them next to a
 * baseline measured in the same run (never timed tests). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "formats/safetensors.h"
#include "tools/bench_weights.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/compact_options.h"

const cli_command cli_bench_command = {
    .name = "bench",
    .usage = "kvfold bench <what> [options]\n",
    .about = "  prefill    tokens/s of a chunked prefill of random token ids\n"
             "  kvf        cache file write/read GB/s against plain fwrite/fread of the same bytes\n"
             "  tokenize   encoding MB/s (tools/bench-tokenize.sh compares with the JavaScript tokenizer)\n"
             "  compact    the time of each compaction stage on a records document\n"
             "  attention  one chunk's attention over long histories: dense against QUOKA, as a ratio\n"
             "  quoka      QUOKA's accuracy against dense prefill on repeat prompts (KL, copy accuracy)\n"
             "\n"
             "Run 'kvfold bench <what> --help' for options. tools/bench-prefill.sh compares the prefill\n"
             "with a PyTorch implementation of the same model in the same run.\n",
    .exit_status = "  that of the benchmark; 2 for an unknown benchmark\n",
    .example = "  kvfold bench prefill --model Qwen3-0.6B --tokens 2048\n",
};

int cmd_bench(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        cli_opts_help(&cli_bench_command, argc < 2 ? stderr : stdout);
        return argc < 2 ? KF_EXIT_USAGE : KF_EXIT_OK;
    }
    if (strcmp(argv[1], "prefill") == 0)
        return cmd_bench_prefill(argc - 1, argv + 1);
    if (strcmp(argv[1], "kvf") == 0)
        return cmd_bench_kvf(argc - 1, argv + 1);
    if (strcmp(argv[1], "tokenize") == 0)
        return cmd_bench_tokenize(argc - 1, argv + 1);
    if (strcmp(argv[1], "compact") == 0)
        return cmd_bench_compact(argc - 1, argv + 1);
    if (strcmp(argv[1], "attention") == 0)
        return cmd_bench_attention(argc - 1, argv + 1);
    if (strcmp(argv[1], "quoka") == 0)
        return cmd_bench_quoka(argc - 1, argv + 1);
    return cli_usage_error("bench", "unknown benchmark '%s'", argv[1]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The bench prefill clock: wall time (default), or with --clock cpu the process's CPU time, which
 * on a shared machine with one thread (OPENBLAS_NUM_THREADS=1) counts the work and not the wait
 * for a core. Two threads waiting on each other would count their spinning too. */
static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static double (*g_now)(void) = cli_now;

/* ---- GEMM accounting: the backend's matmul wrapped to time every call ----------------------
 * Each call is closed by a 4-byte download so that a device backend's queue is drained and the
 * time is the GEMM's own (on the CPU that download is a 4-byte memcpy). */
typedef void (*matmul_fn)(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M,
                          int N, int K, int accumulate);
static struct {
    matmul_fn inner;
    double seconds, flops;
} g_mm;

static void timed_matmul(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M, int N,
                         int K, int accumulate) {
    float sink;
    const double t0 = g_now();
    g_mm.inner(b, y, ldy, x, ldx, w, M, N, K, accumulate);
    b->download(b, &sink, y, sizeof sink);
    g_mm.seconds += g_now() - t0;
    g_mm.flops += 2.0 * M * N * K;
}

/* The same for the backend's attention: seconds, and the FLOPs of QK^T and PV over the keys
 * each query sees (n_past + i + 1 for query i). QUOKA's sparse attention does not go through
 * here. */
typedef void (*attention_fn)(kf_backend *b, const kf_attn_args *a);
static struct {
    attention_fn inner;
    double seconds, flops;
} g_at;

static void timed_attention(kf_backend *b, const kf_attn_args *a) {
    float sink;
    const double t0 = g_now();
    g_at.inner(b, a);
    b->download(b, &sink, a->out, sizeof sink);
    g_at.seconds += g_now() - t0;
    const double n_past = (double)a->n_keys - a->n_q, nq = a->n_q;
    g_at.flops += 4.0 * a->kv.head_dim * a->n_heads * (nq * n_past + nq * (nq + 1) / 2);
}

/* The (N, K) of a layer's seven projections. */
static int layer_shapes(const kf_hfconfig *c, int n_out[7], int k_in[7]) {
    const int H = c->hidden_size, I = c->intermediate_size, QD = c->n_heads * c->head_dim,
              KD = c->n_kv_heads * c->head_dim;
    const int n[7] = {QD, KD, KD, H, I, I, H}, k[7] = {H, H, H, QD, H, H, I};
    memcpy(n_out, n, sizeof n);
    memcpy(k_in, k, sizeof k);
    return 7;
}

/* Useful FLOPs of a prefill of n tokens on top of ctx context tokens: projections, causal
 * attention (QK^T and PV over the keys each query sees: the ctx context keys and its own causal
 * part) and the lm_head rows. */
static void prefill_flops(const kf_hfconfig *c, long long n, long long ctx, int logit_rows, double *proj, double *attn,
                          double *head) {
    int N[7], K[7];
    double per_tok = 0;
    for (int i = 0, s = layer_shapes(c, N, K); i < s; i++)
        per_tok += 2.0 * N[i] * K[i];
    *proj = per_tok * (double)n * c->n_layers;
    *attn = 4.0 * c->head_dim * c->n_heads * ((double)n * ctx + (double)n * (n + 1) / 2) * c->n_layers;
    *head = 2.0 * c->hidden_size * (double)c->vocab_size * logit_rows;
}

typedef struct {
    void *w[7];   /* [N_i, K_i] each, backend weight storage */
    float *x, *y; /* [M, max K], [M, max N] */
    int N[7], K[7], M;
} peak_bufs;

static void peak_free(kf_backend *b, peak_bufs *p) {
    for (int i = 0; i < 7; i++)
        if (p->w[i])
            b->free(b, p->w[i]);
    if (p->x)
        b->free(b, p->x);
    if (p->y)
        b->free(b, p->y);
}

/* Buffers for the machine's sgemm peak at the model's shapes: one layer's seven projections
 * with M = the chunk, distinct weights per shape as in the model. 0, or -1 when out of memory. */
static int peak_init(kf_backend *b, const kf_hfconfig *c, int M, peak_bufs *p) {
    memset(p, 0, sizeof *p);
    p->M = M;
    layer_shapes(c, p->N, p->K);
    size_t maxn = 0, maxk = 0, maxw = 0;
    for (int i = 0; i < 7; i++) {
        maxn = (size_t)p->N[i] > maxn ? (size_t)p->N[i] : maxn;
        maxk = (size_t)p->K[i] > maxk ? (size_t)p->K[i] : maxk;
        maxw = (size_t)p->N[i] * p->K[i] > maxw ? (size_t)p->N[i] * p->K[i] : maxw;
    }
    float *host = malloc(sizeof(float) * (maxw > maxk * M ? maxw : maxk * M)); /* [max(N K, M K)] */
    int ok = host != NULL;
    for (size_t i = 0; ok && i < (maxw > maxk * M ? maxw : maxk * M); i++)
        host[i] = 0.01f * (float)((i * 2654435761u) % 200) - 1.0f;
    for (int i = 0; ok && i < 7; i++) {
        p->w[i] = b->alloc(b, (size_t)p->N[i] * p->K[i] * kf_dtype_size(b->weight_dtype));
        if ((ok = p->w[i] != NULL))
            b->upload_weight(b, p->w[i], host, KF_DTYPE_F32, (size_t)p->N[i] * p->K[i]);
    }
    if (ok) {
        p->x = b->alloc(b, sizeof(float) * maxk * M);
        p->y = b->alloc(b, sizeof(float) * maxn * M);
        ok = p->x && p->y;
    }
    if (ok)
        b->upload(b, p->x, host, sizeof(float) * maxk * M);
    free(host);
    if (!ok)
        peak_free(b, p);
    return ok ? 0 : -1;
}

/* GFLOP/s of the plain GEMM (the backend's matmul: kernels/cpu/matmul.c on the CPU) over the model's
 * shapes, after one warm-up pass, for at least min_s seconds. */
static double peak_measure(kf_backend *b, peak_bufs *p, double min_s) {
    double flops = 0, t0 = 0;
    float sink;
    for (int pass = 0;; pass++) {
        if (pass == 1) {
            b->download(b, &sink, p->y, sizeof sink);
            t0 = g_now();
        }
        for (int i = 0; i < 7; i++) {
            b->matmul(b, p->y, (size_t)p->N[i], p->x, (size_t)p->K[i], p->w[i], p->M, p->N[i], p->K[i], 0);
            flops += pass ? 2.0 * p->M * p->N[i] * p->K[i] : 0;
        }
        b->download(b, &sink, p->y, sizeof sink);
        if (pass >= 1 && g_now() - t0 >= min_s)
            return flops / (g_now() - t0) * 1e-9;
    }
}

typedef struct {
    double seconds, gemm_s, gemm_flops, attn_s, attn_flops, peak; /* one timed run */
} prefill_run;

/* The context: ctx tokens prefilled once into seq before the runs. Returns the status. */
static kf_status prefill_context(kf_model *m, kf_arena *arena, kf_seq *seq, const int32_t *ids, long long ctx,
                                 long long chunk, kf_error *err) {
    kf_forward_args fa = {.ids = ids, .n_tokens = (int)ctx, .chunk = (int)chunk};
    return ctx > 0 ? kf_model_forward(m, arena, seq, &fa, err) : KF_OK;
}

/* The prefill runs: one warm-up, then `repeat` timed ones, each between two peak measurements
 * (their mean is the run's peak) so that both see about the same load. Returns 0, or -1 with err
 * set. */
static int prefill_runs(kf_model *m, kf_backend *b, peak_bufs *pk, const int32_t *ids, long long n, long long ctx,
                        long long chunk, const kf_quoka_params *qp, float *logits, long long repeat, prefill_run *runs,
                        kf_error *err) {
    kf_arena arena;
    if (kf_model_arena(m, &arena, ctx + n, err) != KF_OK)
        return -1;
    int32_t last = (int32_t)n - 1;
    g_mm.inner = b->matmul;
    g_at.inner = b->attention;
    double peak_before = 0;
    kf_seq seq;
    kf_seq_init(&seq);
    if (prefill_context(m, &arena, &seq, ids, ctx, chunk, err) != KF_OK) {
        kf_seq_release(&arena, &seq);
        kf_arena_free(&arena);
        return -1;
    }
    for (long long r = 0; r <= repeat; r++) {
        prefill_run *run = &runs[r];
        if (r == 1)
            peak_before = peak_measure(b, pk, 0.3);
        kf_forward_args fa = {.ids = ids + ctx, .n_tokens = (int)n, .chunk = (int)chunk, .logit_rows = &last,
                              .n_logit_rows = 1, .logits = logits, .quoka = qp};
        g_mm.seconds = g_mm.flops = g_at.seconds = g_at.flops = 0;
        b->matmul = timed_matmul;
        b->attention = timed_attention;
        const double t0 = g_now();
        kf_status st = kf_model_forward(m, &arena, &seq, &fa, err);
        run->seconds = g_now() - t0;
        b->matmul = g_mm.inner;
        b->attention = g_at.inner;
        run->gemm_s = g_mm.seconds;
        run->gemm_flops = g_mm.flops;
        run->attn_s = g_at.seconds;
        run->attn_flops = g_at.flops;
        if (st == KF_OK)
            st = kf_seq_truncate(&arena, &seq, ctx, err);
        if (st != KF_OK) {
            kf_seq_release(&arena, &seq);
            kf_arena_free(&arena);
            return -1;
        }
        if (r == 0)
            continue;
        const double peak_after = peak_measure(b, pk, 0.3);
        run->peak = 0.5 * (peak_before + peak_after);
        peak_before = peak_after;
        fprintf(stderr, "  run %lld: %.4f s, sgemm peak %.1f GFLOP/s (mean of before and after)\n", r, run->seconds,
                run->peak);
    }
    kf_seq_release(&arena, &seq);
    kf_arena_free(&arena);
    return 0;
}

/* Per-run figures of the report: rates (GFLOP/s) and ratios. */
enum { F_GEMM, F_WHOLE, F_ATTN, F_GEMM_R, F_WHOLE_R, F_ATTN_R, F_GEMM_SHARE, F_ATTN_SHARE, F_WHOLE_G, F_ATTN_G, F_N };

/* Medians over the timed runs, and the ratios to the peak measured next to each run. */
static void prefill_report(const kf_hfconfig *c, long long n, long long ctx, long long chunk, const char *desc,
                           const prefill_run *runs, int repeat) {
    double proj, attn, head;
    prefill_flops(c, n, ctx, 1, &proj, &attn, &head);
    const double total = proj + attn + head;
    double t[repeat], pk[repeat], f[F_N][repeat], lo[F_N], hi[F_N], med[F_N];
    for (int r = 0; r < repeat; r++) {
        const prefill_run *x = &runs[r + 1];
        t[r] = x->seconds;
        pk[r] = x->peak;
        f[F_GEMM][r] = x->gemm_flops / x->gemm_s * 1e-9;
        f[F_WHOLE][r] = total / x->seconds * 1e-9;
        f[F_ATTN][r] = x->attn_s > 0 ? x->attn_flops / x->attn_s * 1e-9 : 0;
        f[F_GEMM_R][r] = f[F_GEMM][r] / x->peak;
        f[F_WHOLE_R][r] = f[F_WHOLE][r] / x->peak;
        f[F_ATTN_R][r] = f[F_ATTN][r] / x->peak;
        f[F_GEMM_SHARE][r] = x->gemm_s / x->seconds;
        f[F_ATTN_SHARE][r] = x->attn_s / x->seconds;
        f[F_WHOLE_G][r] = f[F_WHOLE][r] / f[F_GEMM][r];
        f[F_ATTN_G][r] = f[F_ATTN][r] / f[F_GEMM][r];
    }
    for (int i = 0; i < F_N; i++) {
        lo[i] = hi[i] = f[i][0];
        for (int r = 1; r < repeat; r++) {
            lo[i] = f[i][r] < lo[i] ? f[i][r] : lo[i];
            hi[i] = f[i][r] > hi[i] ? f[i][r] : hi[i];
        }
        med[i] = median(f[i], repeat); /* sorts f[i]: lo and hi are taken first */
    }
    const double tmed = median(t, repeat);
    if (ctx > 0)
        printf("prefill %lld tokens on top of %lld context tokens (chunk %lld, %s): median %.4f s over %d runs\n", n,
               ctx, chunk, desc, tmed, repeat);
    else
        printf("prefill %lld tokens (chunk %lld, %s): median %.4f s over %d runs\n", n, chunk, desc, tmed, repeat);
    printf("work: %.1f GFLOP = projections %.1f + attention %.1f (dense%s) + lm_head %.2f\n", total * 1e-9,
           proj * 1e-9, attn * 1e-9, ctx > 0 ? ", context + causal" : " causal", head * 1e-9);
    printf("sgemm peak (backend matmul, one layer's shapes, M = %lld): median %.1f GFLOP/s\n", chunk < n ? chunk : n,
           median(pk, repeat));
    if (med[F_ATTN] > 0) /* none when QUOKA's sparse attention ran every chunk */
        printf("attention: median %.1f GFLOP/s, %.2f of the peak (runs %.2f-%.2f), %.2f of the GEMMs' own rate; "
               "%.0f%% of the prefill's time\n",
               med[F_ATTN], med[F_ATTN_R], lo[F_ATTN_R], hi[F_ATTN_R], med[F_ATTN_G], 100 * med[F_ATTN_SHARE]);
    printf("gemm-only: median %.1f GFLOP/s, %.2f of the peak (runs %.2f-%.2f); %.0f%% of the prefill's time\n",
           med[F_GEMM], med[F_GEMM_R], lo[F_GEMM_R], hi[F_GEMM_R], 100 * med[F_GEMM_SHARE]);
    printf("whole prefill: median %.1f GFLOP/s, %.2f of the peak (runs %.2f-%.2f)\n", med[F_WHOLE], med[F_WHOLE_R],
           lo[F_WHOLE_R], hi[F_WHOLE_R]);
    /* GEMM time and the rest interleave at the millisecond, so this ratio sees one load: on a
     * shared machine it is steadier than the ratios to a peak measured beside the run */
    printf("whole prefill / its own GEMM rate: median %.2f (runs %.2f-%.2f)\n", med[F_WHOLE_G], lo[F_WHOLE_G],
           hi[F_WHOLE_G]);
    printf("peak_ratio %.3f\n", med[F_WHOLE_R]);
    printf("tokens_per_s %.1f\n", (double)n / tmed);
}

/* n token ids in [0, V) from the seed (a fixed LCG: the same ids on every machine). */
static void random_ids(int32_t *ids, long long n, long long seed, int V) {
    unsigned long long state = (unsigned long long)seed * 6364136223846793005ULL + 1442695040888963407ULL;
    for (long long i = 0; i < n; i++) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = (int32_t)((state >> 33) % (unsigned long long)V);
    }
}

/* --compare-weights: dense, no context, on the CPU. */
static int bench_compare_weights(const char *dir, const char *device, long long n, long long chunk, long long repeat,
                                 long long seed, long long ctx, const kf_quoka_params *prefill) {
    if ((device && strcmp(device, "cpu")) || ctx > 0 || prefill->mode != KF_PREFILL_DENSE)
        return cli_usage_error("bench prefill", "--compare-weights runs a dense prefill without --context on the cpu");
    char *path = kf_st_dir_file(dir, "config.json");
    kf_hfconfig c;
    kf_error err = {0};
    if (!path || kf_hfconfig_load(&c, path, &err) != KF_OK) {
        free(path);
        cli_error("bench prefill", "%s", path ? err.msg : "out of memory");
        return KF_EXIT_FAIL;
    }
    free(path);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n); /* [n] */
    if (!ids) {
        cli_error("bench prefill", "out of memory");
        return KF_EXIT_FAIL;
    }
    random_ids(ids, n, seed, c.vocab_size);
    const int rc = bench_weights_compare(dir, ids, n, chunk ? chunk : KF_DEFAULT_CHUNK, (int)repeat, g_now);
    free(ids);
    return rc;
}

typedef struct {
    const char *dir, *device;
    long long n, chunk, repeat, seed, ctx;
    int compare, cpu_clock;
    kf_quoka_params prefill;
} prefill_opts;

#define P(field) OFF(prefill_opts, field)
static const cli_opt kPrefillRows[] = {
    {"model", 0, OPT_STR, "DIR", P(dir), .help = "model directory"},
    {"tokens", 0, OPT_LLONG, "N", P(n), .lo = 1, .hi = 1 << 24, .must = "must be a positive integer",
     .def = "512", .help = "prompt length"},
    {"context", 0, OPT_LLONG, "P", P(ctx), .lo = 0, .hi = 1 << 24, .must = "must be a count of tokens",
     .def = "0", .help = "tokens already in the arena before the timed prefill"},
    {"clock", 0, OPT_CHOICE, "C", P(cpu_clock), .choices = "wall|cpu", .def = "wall",
     .help = "wall, or cpu: the process's CPU time, for a loaded machine with OPENBLAS_NUM_THREADS=1 "
             "(spinning threads would count)"},
    {"chunk", 0, OPT_LLONG, "N", P(chunk), .lo = 1, .hi = 1 << 24, .must = "must be a positive integer",
     .def = "512", .help = "prefill chunk size in tokens"},
    {"repeat", 0, OPT_LLONG, "R", P(repeat), .lo = 1, .hi = 1000, .must = "must be from 1 to 1000", .def = "3",
     .help = "timed runs"},
    {"seed", 0, OPT_LLONG, "S", P(seed), .lo = 1, .hi = 1 << 24, .must = "must be a positive integer",
     .def = "1", .help = "seed of the token ids"},
    {"compare-weights", 0, OPT_FLAG, NULL, P(compare),
     .help = "instead: the same prefill with bf16 and with fp32 weights (the model loaded twice, R runs of "
             "each alternated after a warm-up): medians, the speed ratio pair by pair, the GEMMs' own ratio "
             "and the logits' largest difference; last line 'weights_speed_ratio <bf16 / fp32 speed>' (CPU "
             "backend; --clock applies)"},
    {"device", 0, OPT_STR, "DEV", P(device), .def = "cpu", .help = "cpu, cuda or cuda:N (builds with the CUDA backend)"},
    {0}};

const cli_command cli_bench_prefill_command = {
    .name = "bench prefill",
    .usage = "kvfold bench prefill --model DIR --tokens N [--context P] [--chunk C] [--repeat R]\n"
             "                            [--seed S] [--prefill dense|quoka] [--quoka-budget B] ...\n",
    .about = "Prefill N random token ids (fixed seed) into a fresh paged arena, R times after one warm-up,\n"
             "and print the median time and tokens/s. Only the last position's logits are computed, as in\n"
             "a compaction prefill. Before and after each timed run, the machine's sgemm peak is measured\n"
             "on the model's own shapes (one layer's seven projections, M = the chunk, through the\n"
             "backend's matmul: on the CPU, single-threaded cblas_sgemm calls over the threads' columns,\n"
             "on tiles of widened weights with bf16 weights);\n"
             "the report gives the GFLOP/s of the prefill's GEMMs alone and of the whole prefill\n"
             "(projections + causal attention + lm_head) as ratios to the mean of the two peaks around\n"
             "each run (medians over the runs, and their range), and the whole prefill's rate over its own\n"
             "GEMMs' rate, the figure least moved by other load.\n"
             "The backend's attention calls are timed too: their GFLOP/s (each query over the keys it\n"
             "sees) against the same peak. With --context P, P other random tokens are prefilled first\n"
             "(untimed, once) and every timed run prefills the N tokens on top of them (the repeat prefill\n"
             "of a compaction: each query also attends to the P context keys), then rewinds to P.\n",
    .groups = (const cli_group[]){{NULL, kPrefillRows, 0}, {NULL, cli_weights_rows, 0},
                                  {"Prefill attention", cli_prefill_rows, P(prefill)}, {0}},
    .notes = "Last lines: 'peak_ratio <whole prefill / sgemm peak>' and 'tokens_per_s <value>' for scripts.\n"
             "tools/bench-quoka.sh compares dense and QUOKA prefill in the same run.\n",
    .exit_status = "  0  measured\n"
                   "  1  the model cannot be loaded or a prefill failed\n"
                   "  2  usage errors\n",
    .example = "  kvfold bench prefill --model Qwen3-0.6B --tokens 2048 --context 8192 --repeat 5\n",
};

int cmd_bench_prefill(int argc, char **argv) {
    prefill_opts o = {.n = 512, .repeat = 3, .seed = 1, .prefill = cli_prefill_defaults()};
    int first;
    const int prc = cli_opts_parse(&cli_bench_prefill_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (!o.dir || first != argc)
        return cli_usage_error("bench prefill", "--model is required");
    g_now = o.cpu_clock ? cpu_now : cli_now;
    const char *dir = o.dir, *device = o.device;
    long long n = o.n, chunk = o.chunk;
    const long long repeat = o.repeat, seed = o.seed, ctx = o.ctx;
    const kf_quoka_params prefill = o.prefill;
    if (o.compare)
        return bench_compare_weights(dir, device, n, chunk, repeat, seed, ctx, &prefill);
    kf_backend *b;
    kf_model *m = cli_load_model_on("bench prefill", dir, device, &b);
    if (!m)
        return KF_EXIT_FAIL;
    const kf_hfconfig *c = kf_model_config(m);
    const int V = c->vocab_size;
    if (!chunk)
        chunk = KF_DEFAULT_CHUNK;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(ctx + n));          /* [context + n] */
    float *logits = malloc(sizeof(float) * (size_t)V);                    /* [vocab] */
    prefill_run *runs = calloc((size_t)(repeat + 1), sizeof *runs);       /* [repeat + 1] */
    peak_bufs pk;
    int have_pk = 0, rc = KF_EXIT_FAIL;
    kf_error err = {0};
    if (!ids || !logits || !runs || !(have_pk = peak_init(b, c, (int)(chunk < n ? chunk : n), &pk) == 0)) {
        cli_error("bench prefill", "out of memory");
        goto out;
    }
    random_ids(ids, ctx + n, seed, V);
    const kf_quoka_params *qp = cli_prefill_params(&prefill);
    if (prefill_runs(m, b, &pk, ids, n, ctx, chunk, qp, logits, repeat, runs, &err) != 0) {
        cli_error("bench prefill", "%s", err.msg);
        goto out;
    }
    char desc[160];
    prefill_report(c, n, ctx, chunk, kf_quoka_describe(qp, desc, sizeof desc), runs, (int)repeat);
    rc = KF_EXIT_OK;
out:
    if (have_pk)
        peak_free(b, &pk);
    free(ids);
    free(logits);
    free(runs);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}
