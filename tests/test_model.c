/* The forward pass against golden tensors written by transformers (tests/data/FIXTURES.md):
 * hidden states and K/V per layer, logits of the last 16 positions, argmax everywhere; the
 * same logits for every chunk size; a forked document reproducing a fresh prefill. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compactor/engine.h"
#include "compactor/model.h"
#include "compactor/refq.h"
#include "formats/kvf.h"
#include "kernels/base/convert.h"
#include "formats/safetensors.h"
#include "test_util.h"

typedef struct {
    kf_backend *b;
    kf_model *m;
    kf_st_set golden;
    int32_t *ids; /* [T] */
    int T;
} fixture;

static fixture fx_qwen, fx_llama;

/* Golden tensor as a fresh fp32 (or int64 -> int32) buffer. */
static float *golden_f32(const fixture *f, const char *name, size_t *n) {
    const kf_st_tensor *t = kf_st_find(&f->golden, name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_EQUAL_FATAL(t->dtype, KF_DTYPE_F32);
    float *x = malloc(t->nbytes);
    memcpy(x, t->data, t->nbytes);
    *n = (size_t)t->numel;
    return x;
}

static int fixture_open(fixture *f, const char *dir) {
    memset(f, 0, sizeof *f);
    kf_error err = {0};
    char path[4096];
    f->b = kf_backend_cpu_create();
    if (kf_model_load(&f->m, kf_test_data(dir), f->b, &err) != KF_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    snprintf(path, sizeof path, "%s/golden.safetensors", kf_test_data(dir));
    if (kf_st_open_file(&f->golden, path, &err) != KF_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    const kf_st_tensor *t = kf_st_find(&f->golden, "input_ids");
    if (!t || t->dtype != KF_DTYPE_I64)
        return -1;
    f->T = (int)t->numel;
    f->ids = malloc(sizeof(int32_t) * (size_t)f->T);
    for (int i = 0; i < f->T; i++) {
        int64_t v;
        memcpy(&v, (const char *)t->data + 8 * i, 8);
        f->ids[i] = (int32_t)v;
    }
    return 0;
}

static int fixture_close(fixture *f) {
    kf_st_close(&f->golden);
    kf_model_free(f->m);
    if (f->b)
        f->b->destroy(f->b);
    free(f->ids);
    return 0;
}

static int init_qwen(void) { return fixture_open(&fx_qwen, "hf-qwen3-tiny"); }
static int clean_qwen(void) { return fixture_close(&fx_qwen); }
static int init_llama(void) { return fixture_open(&fx_llama, "hf-llama3-tiny-random"); }
static int clean_llama(void) { return fixture_close(&fx_llama); }

/* Full prefill with every capture; compares against the golden tensors. */
static void check_golden(fixture *f) {
    const kf_hfconfig *c = kf_model_config(f->m);
    const int T = f->T, L = c->n_layers, H = c->hidden_size, V = c->vocab_size;
    const int kvh = c->n_kv_heads, hd = c->head_dim;
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, T, &err), KF_OK);

    int32_t *rows = malloc(sizeof(int32_t) * T);
    for (int i = 0; i < T; i++)
        rows[i] = i;
    float **hidden = calloc((size_t)L + 1, sizeof *hidden);
    for (int l = 0; l <= L; l++)
        hidden[l] = malloc(sizeof(float) * (size_t)T * H);
    float *logits = malloc(sizeof(float) * (size_t)T * V);
    kf_forward_args fa = {.ids = f->ids, .n_tokens = T, .chunk = 64, .logit_rows = rows, .n_logit_rows = T,
                          .logits = logits, .capture_rows = rows, .n_capture_rows = T, .hidden = hidden};
    kf_status st = kf_model_forward(f->m, &a, &seq, &fa, &err);
    if (st != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    CU_ASSERT_EQUAL(seq.len, T);

    char name[64];
    size_t n;
    for (int l = 0; l <= L; l++) {
        snprintf(name, sizeof name, "hidden.%d", l);
        float *ref = golden_f32(f, name, &n);
        CU_ASSERT_EQUAL_FATAL(n, (size_t)T * H);
        double rel = kf_max_abs_diff(hidden[l], ref, n) / kf_max_abs(ref, n);
        printf("\n    %s: max rel error %.2e", name, rel);
        CU_ASSERT(rel < 1e-4);
        free(ref);
    }
    float *k = malloc(sizeof(float) * (size_t)T * kvh * hd), *v = malloc(sizeof(float) * (size_t)T * kvh * hd);
    float *kt = malloc(sizeof(float) * (size_t)T * kvh * hd), *vt = malloc(sizeof(float) * (size_t)T * kvh * hd);
    for (int l = 0; l < L; l++) {
        CU_ASSERT_EQUAL_FATAL(kf_seq_read_kv(&a, &seq, l, 0, T, k, v, &err), KF_OK);
        /* ours [T, kvh, hd] -> golden's [kvh, T, hd] */
        for (int t = 0; t < T; t++)
            for (int h = 0; h < kvh; h++) {
                memcpy(kt + ((size_t)h * T + t) * hd, k + ((size_t)t * kvh + h) * hd, sizeof(float) * hd);
                memcpy(vt + ((size_t)h * T + t) * hd, v + ((size_t)t * kvh + h) * hd, sizeof(float) * hd);
            }
        snprintf(name, sizeof name, "k.%d", l);
        float *kref = golden_f32(f, name, &n);
        snprintf(name, sizeof name, "v.%d", l);
        float *vref = golden_f32(f, name, &n);
        double ek = kf_max_abs_diff(kt, kref, n) / kf_max_abs(kref, n);
        double ev = kf_max_abs_diff(vt, vref, n) / kf_max_abs(vref, n);
        printf("\n    k.%d: %.2e  v.%d: %.2e", l, ek, l, ev);
        CU_ASSERT(ek < 1e-4);
        CU_ASSERT(ev < 1e-4);
        free(kref);
        free(vref);
    }
    float *lref = golden_f32(f, "logits_last16", &n);
    CU_ASSERT_EQUAL_FATAL(n, (size_t)16 * V);
    double el = kf_max_abs_diff(logits + (size_t)(T - 16) * V, lref, n);
    printf("\n    logits_last16: max abs error %.2e\n", el);
    CU_ASSERT(el < 1e-3);
    const kf_st_tensor *am = kf_st_find(&f->golden, "argmax");
    CU_ASSERT_PTR_NOT_NULL_FATAL(am);
    int mismatches = 0;
    for (int t = 0; t < T; t++) {
        int64_t want;
        memcpy(&want, (const char *)am->data + 8 * t, 8);
        const float *row = logits + (size_t)t * V;
        int arg = 0;
        for (int i = 1; i < V; i++)
            if (row[i] > row[arg])
                arg = i;
        mismatches += arg != want;
    }
    CU_ASSERT_EQUAL(mismatches, 0);

    free(lref);
    free(k);
    free(v);
    free(kt);
    free(vt);
    for (int l = 0; l <= L; l++)
        free(hidden[l]);
    free(hidden);
    free(logits);
    free(rows);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
}

static void test_qwen_golden(void) { check_golden(&fx_qwen); }
static void test_llama_golden(void) { check_golden(&fx_llama); }

/* Logits of every position for one chunk size. */
static float *all_logits(fixture *f, int chunk) {
    const int T = f->T, V = kf_model_config(f->m)->vocab_size;
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, T, &err), KF_OK);
    int32_t *rows = malloc(sizeof(int32_t) * T);
    for (int i = 0; i < T; i++)
        rows[i] = i;
    float *logits = malloc(sizeof(float) * (size_t)T * V);
    kf_forward_args fa = {.ids = f->ids, .n_tokens = T, .chunk = chunk, .logit_rows = rows, .n_logit_rows = T,
                          .logits = logits};
    CU_ASSERT_EQUAL(kf_model_forward(f->m, &a, &seq, &fa, &err), KF_OK);
    free(rows);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    return logits;
}

static void check_chunk_sizes(fixture *f) {
    /* Tolerance: 1e-5, relative to the largest logit where that exceeds 1. OpenBLAS's sgemm sums in an order that
     * depends on the number of rows of the call (measured: rows of the same 258x768x256 product
     * differ in their last bits when split into calls of 1, 7, 16 or 64 rows), and Qwen's
     * residual stream reaches ~3000, so fp32 rounding alone moves hf-qwen3-tiny's logits (max
     * ~19) by a few 1e-5 absolute between chunkings; llama3-tiny stays below 1e-6 absolute. */
    const size_t n = (size_t)f->T * kf_model_config(f->m)->vocab_size;
    float *whole = all_logits(f, f->T);
    const double scale = kf_max_abs(whole, n);
    const int chunks[] = {1, 7, 16, 64};
    for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
        float *x = all_logits(f, chunks[i]);
        double d = kf_max_abs_diff(x, whole, n);
        printf("\n    chunk %d vs whole: %.2e absolute, %.2e relative to max |logit| %.1f", chunks[i], d, d / scale,
               scale);
        CU_ASSERT(d < 1e-5 * fmax(1.0, scale));
        free(x);
    }
    printf("\n");
    free(whole);
}

static void test_qwen_chunks(void) { check_chunk_sizes(&fx_qwen); }
static void test_llama_chunks(void) { check_chunk_sizes(&fx_llama); }

/* Prefill a prefix, fork it at a length inside a page, continue both; the fork's logits equal a
 * fresh prefill's, and the parent is unaffected by the fork's writes. */
static void test_fork_reproduces_fresh_prefill(void) {
    fixture *f = &fx_qwen;
    const int T = f->T, V = kf_model_config(f->m)->vocab_size;
    const int split = 101; /* inside page 6 */
    kf_arena a;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, 3 * T, &err), KF_OK);
    float *fresh = all_logits(f, 32);

    kf_seq parent, child;
    kf_seq_init(&parent);
    kf_forward_args fa = {.ids = f->ids, .n_tokens = split, .chunk = 32};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &parent, &fa, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &parent, split, &child, &err), KF_OK);

    /* the parent continues with different tokens: it must not disturb the child's view */
    int32_t other[40];
    for (int i = 0; i < 40; i++)
        other[i] = (f->ids[i] + 17) % V;
    kf_forward_args fp = {.ids = other, .n_tokens = 40, .chunk = 16};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &parent, &fp, &err), KF_OK);

    const int rest = T - split;
    int32_t *rows = malloc(sizeof(int32_t) * rest);
    for (int i = 0; i < rest; i++)
        rows[i] = i;
    float *logits = malloc(sizeof(float) * (size_t)rest * V);
    kf_forward_args fc = {.ids = f->ids + split, .n_tokens = rest, .chunk = 32, .logit_rows = rows,
                          .n_logit_rows = rest, .logits = logits};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &child, &fc, &err), KF_OK);
    double d = kf_max_abs_diff(logits, fresh + (size_t)split * V, (size_t)rest * V);
    printf("\n    fork vs fresh prefill: %.2e\n", d);
    CU_ASSERT(d < 1e-4);

    /* rewind the child inside a page and redo the tail: same logits again */
    CU_ASSERT_EQUAL_FATAL(kf_seq_truncate(&a, &child, split + 30, &err), KF_OK);
    kf_forward_args fr = {.ids = f->ids + split + 30, .n_tokens = rest - 30, .chunk = 7, .logit_rows = rows,
                          .n_logit_rows = rest - 30, .logits = logits};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &child, &fr, &err), KF_OK);
    d = kf_max_abs_diff(logits, fresh + (size_t)(split + 30) * V, (size_t)(rest - 30) * V);
    CU_ASSERT(d < 1e-4);

    free(rows);
    free(logits);
    free(fresh);
    kf_seq_release(&a, &child);
    kf_seq_release(&a, &parent);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
}

/* Queries captured at the pool's strides (kf_refq_capture_dst) land where kf_refq_rows reads them:
 * row j * n_pos + p of KV head g is query head g * G + j of the p-th captured row, bit for bit the
 * default [rows, n_heads, head_dim] capture; the pool's other positions are not written. */
static void test_capture_into_refq_pool(void) {
    fixture *f = &fx_qwen;
    const kf_hfconfig *c = kf_model_config(f->m);
    const int L = c->n_layers, nh = c->n_heads, kvh = c->n_kv_heads, hd = c->head_dim, G = nh / kvh;
    enum { N_ROWS = 5, N_POS = 9, FIRST = 3 };
    const int32_t rows[N_ROWS] = {0, 17, 40, 41, 90};
    kf_error err = {0};
    kf_refq rq;
    CU_ASSERT_EQUAL_FATAL(kf_refq_init(&rq, L, kvh, hd, G, N_POS, 0, &err), KF_OK);
    const size_t pool = (size_t)L * kvh * rq.R * hd;
    for (size_t i = 0; i < pool; i++)
        rq.q[i] = -7.0f;
    float **flat = calloc((size_t)L, sizeof *flat), **dst = calloc((size_t)L, sizeof *dst);
    for (int l = 0; l < L; l++) {
        flat[l] = malloc(sizeof(float) * N_ROWS * nh * hd);
        dst[l] = kf_refq_capture_dst(&rq, l, FIRST);
    }
    for (int pass = 0; pass < 2; pass++) {
        kf_arena a;
        kf_seq seq;
        kf_seq_init(&seq);
        CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, 100, &err), KF_OK);
        kf_forward_args fa = {.ids = f->ids, .n_tokens = 100, .chunk = 32, .capture_rows = rows,
                              .n_capture_rows = N_ROWS, .queries = pass ? dst : flat};
        if (pass)
            fa.queries_row_stride = (size_t)hd, fa.queries_head_stride = kf_refq_head_stride(&rq);
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &seq, &fa, &err), KF_OK);
        kf_seq_release(&a, &seq);
        kf_arena_free(&a);
    }
    int bad = 0, untouched = 1;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < kvh; g++)
            for (int j = 0; j < G; j++)
                for (int p = 0; p < N_POS; p++) {
                    const float *got = kf_refq_rows(&rq, l, g) + ((size_t)j * N_POS + p) * hd;
                    if (p < FIRST || p >= FIRST + N_ROWS) {
                        for (int e = 0; e < hd; e++)
                            untouched &= got[e] == -7.0f;
                        continue;
                    }
                    const float *want = flat[l] + ((size_t)(p - FIRST) * nh + g * G + j) * hd;
                    bad += memcmp(got, want, sizeof(float) * hd) != 0;
                }
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(untouched);

    /* a pool holding one layer (the compaction's): every layer captures into the same slot, so
     * after the forward it holds the last layer's rows, read with the model's layer index */
    kf_refq r1;
    CU_ASSERT_EQUAL(kf_refq_init_held(&r1, L, 0, kvh, hd, G, N_POS, 0, &err), KF_ERR_INVALID);
    CU_ASSERT_EQUAL_FATAL(kf_refq_init_held(&r1, L, 1, kvh, hd, G, N_POS, 0, &err), KF_OK);
    float **dst1 = calloc((size_t)L, sizeof *dst1);
    for (int l = 0; l < L; l++)
        dst1[l] = kf_refq_capture_dst(&r1, l, FIRST);
    CU_ASSERT_PTR_EQUAL(dst1[0], dst1[L - 1]);
    {
        kf_arena a1;
        kf_seq s1;
        kf_seq_init(&s1);
        CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a1, 100, &err), KF_OK);
        kf_forward_args f1 = {.ids = f->ids, .n_tokens = 100, .chunk = 32, .capture_rows = rows,
                              .n_capture_rows = N_ROWS, .queries = dst1, .queries_row_stride = (size_t)hd,
                              .queries_head_stride = kf_refq_head_stride(&r1)};
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a1, &s1, &f1, &err), KF_OK);
        kf_seq_release(&a1, &s1);
        kf_arena_free(&a1);
    }
    int bad1 = 0;
    for (int g = 0; g < kvh; g++)
        for (int j = 0; j < G; j++)
            for (int p = FIRST; p < FIRST + N_ROWS; p++)
                bad1 += memcmp(kf_refq_rows(&r1, L - 1, g) + ((size_t)j * N_POS + p) * hd,
                               flat[L - 1] + ((size_t)(p - FIRST) * nh + g * G + j) * hd, sizeof(float) * hd) != 0;
    CU_ASSERT_EQUAL(bad1, 0);
    CU_ASSERT_PTR_EQUAL(kf_refq_rows(&r1, 0, 1), kf_refq_rows(&r1, L - 1, 1));
    free(dst1);
    kf_refq_free(&r1);

    /* a bf16 pool: every value the fp32 capture's rounded to nearest even (formats/kvf's rounding) */
    kf_refq rh;
    CU_ASSERT_EQUAL_FATAL(kf_refq_init(&rh, L, kvh, hd, G, N_POS, 1, &err), KF_OK);
    CU_ASSERT(rh.q == NULL && rh.qh != NULL);
    uint16_t **dsth = calloc((size_t)L, sizeof *dsth);
    for (int l = 0; l < L; l++)
        dsth[l] = kf_refq_capture_dst_bf16(&rh, l, FIRST);
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, 100, &err), KF_OK);
    kf_forward_args fh = {.ids = f->ids, .n_tokens = 100, .chunk = 32, .capture_rows = rows, .n_capture_rows = N_ROWS,
                          .queries_bf16 = dsth, .queries_row_stride = (size_t)hd,
                          .queries_head_stride = kf_refq_head_stride(&rh)};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &seq, &fh, &err), KF_OK);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    float *wide = malloc(sizeof(float) * (size_t)rh.R * hd); /* [R, hd] */
    int bad_h = 0, exact = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < kvh; g++) {
            const float *got = kf_refq_head(&rh, l, g, wide);
            for (int j = 0; j < G; j++)
                for (int p = FIRST; p < FIRST + N_ROWS; p++)
                    for (int e = 0; e < hd; e++) {
                        const float want = flat[l][((size_t)(p - FIRST) * nh + g * G + j) * hd + e];
                        const float r = kf_bf16_to_f32(kf_f32_to_bf16(want));
                        bad_h += memcmp(&got[((size_t)j * N_POS + p) * hd + e], &r, sizeof r) != 0;
                        exact += r == want;
                    }
        }
    CU_ASSERT_EQUAL(bad_h, 0);
    CU_ASSERT(exact < L * nh * N_ROWS * hd / 2); /* the rounding did happen */
    free(wide);
    free(dsth);
    kf_refq_free(&rh);
    for (int l = 0; l < L; l++)
        free(flat[l]);
    free(flat), free(dst);
    kf_refq_free(&rq);
}

/* ---- the layer-major forward (kf_model_forward_layers) ---- */

enum { LM_CTX = 70, LM_PASSES = 3 };

/* What one pass produced: logits of every row, hidden states and queries at its capture rows. */
typedef struct {
    float *logits;    /* [n, V] */
    float **hidden;   /* [L + 1] -> [n_rows, H] */
    float **q;        /* [L] -> [n_rows, nh * hd] (pass 1: NULL, bf16 instead) */
    uint16_t **qh;    /* [L] -> [n_rows, nh * hd] */
    kf_forward_args args;
} lm_out;

static const int32_t kLmRows[] = {0, 5, 16, 17, 23};
enum { LM_ROWS = 5 };

/* Pass i's arguments: 0 on a fork of the context (chunk 16, fp32 queries, hidden, logits), 1 on
 * another fork (other tokens, chunk 7, bf16 queries, QUOKA with a small budget), 2 a fresh document
 * (chunk 32). */
static void lm_args(const fixture *f, int i, int32_t *other, int32_t *logit_rows, kf_quoka_params *qk, lm_out *o) {
    const kf_hfconfig *c = kf_model_config(f->m);
    const size_t L = (size_t)c->n_layers, H = (size_t)c->hidden_size, QD = (size_t)c->n_heads * c->head_dim;
    const int V = c->vocab_size;
    const int n = i == 0 ? 60 : i == 1 ? 25 : 50;
    memset(o, 0, sizeof *o);
    o->logits = malloc(sizeof(float) * (size_t)n * V);
    o->hidden = calloc(L + 1, sizeof *o->hidden);
    for (size_t l = 0; l <= L; l++)
        o->hidden[l] = malloc(sizeof(float) * LM_ROWS * H);
    if (i == 1) {
        o->qh = calloc(L, sizeof *o->qh);
        for (size_t l = 0; l < L; l++)
            o->qh[l] = malloc(sizeof(uint16_t) * LM_ROWS * QD);
    } else {
        o->q = calloc(L, sizeof *o->q);
        for (size_t l = 0; l < L; l++)
            o->q[l] = malloc(sizeof(float) * LM_ROWS * QD);
    }
    for (int r = 0; r < n; r++)
        logit_rows[r] = r;
    for (int t = 0; t < 25; t++)
        other[t] = (f->ids[t] + 31) % V;
    o->args = (kf_forward_args){.ids = i == 0 ? f->ids + LM_CTX : i == 1 ? other : f->ids + 100, .n_tokens = n,
                                .chunk = i == 0 ? 16 : i == 1 ? 7 : 32, .logit_rows = logit_rows, .n_logit_rows = n,
                                .logits = o->logits, .capture_rows = kLmRows, .n_capture_rows = LM_ROWS,
                                .queries = o->q, .queries_bf16 = o->qh, .hidden = o->hidden};
    if (i == 1) {
        *qk = kf_quoka_params_default();
        qk->budget = 12, qk->n_q = 4;
        o->args.quoka = qk;
    }
}

static void lm_free(const fixture *f, lm_out *o) {
    const int L = kf_model_config(f->m)->n_layers;
    for (int l = 0; l <= L; l++) {
        free(o->hidden[l]);
        if (l < L && o->q)
            free(o->q[l]);
        if (l < L && o->qh)
            free(o->qh[l]);
    }
    free(o->hidden), free(o->q), free(o->qh), free(o->logits);
}

/* The context (chunk-major), and the passes' documents: forks of it for 0 and 1, a fresh one for 2. */
static void lm_docs(const fixture *f, kf_arena *a, kf_seq *ctx, kf_seq *seqs) {
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, a, 800, &err), KF_OK);
    kf_seq_init(ctx);
    kf_forward_args fa = {.ids = f->ids, .n_tokens = LM_CTX, .chunk = 32};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, a, ctx, &fa, &err), KF_OK);
    for (int i = 0; i < LM_PASSES; i++) {
        kf_seq_init(&seqs[i]);
        if (i < 2)
            CU_ASSERT_EQUAL_FATAL(kf_seq_fork(a, ctx, LM_CTX, &seqs[i], &err), KF_OK);
    }
}

/* One layer of a document's keys and values, [len, kvh * hd] each, side by side. */
static float *lm_layer_kv(const fixture *f, const kf_arena *a, const kf_seq *s, int l, int64_t len) {
    const kf_hfconfig *c = kf_model_config(f->m);
    const size_t row = (size_t)c->n_kv_heads * c->head_dim;
    float *kv = malloc(sizeof(float) * 2 * (size_t)len * row);
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_seq_read_kv(a, s, l, 0, len, kv, kv + (size_t)len * row, &err), KF_OK);
    return kv;
}

typedef struct {
    const fixture *f;
    const kf_arena *a, *ref_a;
    const kf_seq *seqs, *ref_seqs;
    int calls, kv_bad, stop_at;
} lm_hook_ctx;

/* In on_layer(l) every pass's layer l is in the arena, equal to the chunk-major forward's. */
static kf_status lm_on_layer(void *ctx, int l, kf_error *err) {
    lm_hook_ctx *h = ctx;
    const kf_hfconfig *c = kf_model_config(h->f->m);
    const size_t row = (size_t)c->n_kv_heads * c->head_dim;
    h->kv_bad += l != h->calls++;
    for (int i = 0; i < LM_PASSES; i++) {
        const int64_t len = h->ref_seqs[i].len;
        float *got = lm_layer_kv(h->f, h->a, &h->seqs[i], l, len), *want = lm_layer_kv(h->f, h->ref_a, &h->ref_seqs[i], l, len);
        h->kv_bad += memcmp(got, want, sizeof(float) * 2 * (size_t)len * row) != 0;
        free(got), free(want);
    }
    if (l == h->stop_at)
        return kf_fail(err, KF_ERR_INVALID, "stop at layer %d", l);
    return KF_OK;
}

static int lm_same(const fixture *f, const lm_out *x, const lm_out *y) {
    const kf_hfconfig *c = kf_model_config(f->m);
    const int L = c->n_layers, H = c->hidden_size, QD = c->n_heads * c->head_dim;
    int bad = memcmp(x->logits, y->logits, sizeof(float) * (size_t)x->args.n_tokens * c->vocab_size) != 0;
    for (int l = 0; l <= L; l++) {
        bad += memcmp(x->hidden[l], y->hidden[l], sizeof(float) * LM_ROWS * H) != 0;
        if (l < L && x->q)
            bad += memcmp(x->q[l], y->q[l], sizeof(float) * LM_ROWS * QD) != 0;
        if (l < L && x->qh)
            bad += memcmp(x->qh[l], y->qh[l], sizeof(uint16_t) * LM_ROWS * QD) != 0;
    }
    return bad;
}

/* Three passes run layer-major (two forks of a context, one fresh document; chunks 16, 7 and 32;
 * fp32 and bf16 query captures, hidden states, logits, QUOKA on one) give bit for bit the K/V,
 * captures and logits of kf_model_forward run on each in turn; the hook sees each layer once, in
 * order, already in the arena; a hook's failure stops the forward with its status. */
static void test_layer_major_forward(void) {
    fixture *f = &fx_qwen;
    const int L = kf_model_config(f->m)->n_layers;
    int32_t other[2][25], lrows[2][LM_PASSES][60];
    kf_quoka_params qk[2];
    lm_out ref[LM_PASSES], got[LM_PASSES];
    kf_arena ra, a;
    kf_seq rctx, ctx, rseq[LM_PASSES], seq[LM_PASSES];
    kf_error err = {0};
    lm_docs(f, &ra, &rctx, rseq);
    lm_docs(f, &a, &ctx, seq);
    kf_forward_pass passes[LM_PASSES];
    for (int i = 0; i < LM_PASSES; i++) {
        lm_args(f, i, other[0], lrows[0][i], &qk[0], &ref[i]);
        lm_args(f, i, other[1], lrows[1][i], &qk[1], &got[i]);
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &ra, &rseq[i], &ref[i].args, &err), KF_OK);
        passes[i] = (kf_forward_pass){&seq[i], &got[i].args};
    }
    lm_hook_ctx hc = {f, &a, &ra, seq, rseq, 0, 0, -1};
    double pass_s[LM_PASSES] = {0};
    const kf_layer_hook hook = {.on_layer = lm_on_layer, .ctx = &hc, .pass_s = pass_s};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward_layers(f->m, &a, passes, LM_PASSES, &hook, &err), KF_OK);
    CU_ASSERT_EQUAL(hc.calls, L);
    CU_ASSERT_EQUAL(hc.kv_bad, 0);
    for (int i = 0; i < LM_PASSES; i++) {
        CU_ASSERT_EQUAL(seq[i].len, rseq[i].len);
        CU_ASSERT_EQUAL(lm_same(f, &ref[i], &got[i]), 0);
        CU_ASSERT(pass_s[i] > 0);
    }
    int kv_bad = 0; /* the context is untouched by its forks */
    for (int l = 0; l < L; l++) {
        float *x = lm_layer_kv(f, &a, &ctx, l, LM_CTX), *y = lm_layer_kv(f, &ra, &rctx, l, LM_CTX);
        kv_bad += memcmp(x, y, sizeof(float) * 2 * LM_CTX * kf_model_config(f->m)->n_kv_heads *
                                    kf_model_config(f->m)->head_dim) != 0;
        free(x), free(y);
    }
    CU_ASSERT_EQUAL(kv_bad, 0);

    /* a hook failing at layer 1: its status, no layer after it, the documents' lengths unchanged */
    kf_seq more[LM_PASSES];
    for (int i = 0; i < LM_PASSES; i++) {
        CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &seq[i], seq[i].len, &more[i], &err), KF_OK);
        passes[i].seq = &more[i];
    }
    lm_hook_ctx stop = {f, &a, &a, more, more, 0, 0, 1};
    const kf_layer_hook hs = {.on_layer = lm_on_layer, .ctx = &stop};
    CU_ASSERT_EQUAL(kf_model_forward_layers(f->m, &a, passes, LM_PASSES, &hs, &err), KF_ERR_INVALID);
    CU_ASSERT_STRING_EQUAL(err.msg, "stop at layer 1");
    CU_ASSERT_EQUAL(stop.calls, 2);
    for (int i = 0; i < LM_PASSES; i++) {
        CU_ASSERT_EQUAL(more[i].len, seq[i].len);
        kf_seq_release(&a, &more[i]);
        kf_seq_release(&a, &seq[i]);
        kf_seq_release(&ra, &rseq[i]);
        lm_free(f, &ref[i]);
        lm_free(f, &got[i]);
    }
    kf_seq_release(&a, &ctx);
    kf_seq_release(&ra, &rctx);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
    kf_arena_free(&ra);
}

/* ---- the last layer's unread output is not computed ---- */

/* The backend's matmul and attention, counted (the fixture's backend, wrapped for one test). */
static void (*real_matmul)(kf_backend *, float *, size_t, const float *, size_t, const void *, int, int, int, int);
static void (*real_attention)(kf_backend *, const kf_attn_args *);
static int n_matmul, n_attention;

static void counted_matmul(kf_backend *b, float *y, size_t ldy, const float *x, size_t ldx, const void *w, int M,
                           int N, int K, int acc) {
    n_matmul++;
    real_matmul(b, y, ldy, x, ldx, w, M, N, K, acc);
}

static void counted_attention(kf_backend *b, const kf_attn_args *a) {
    n_attention++;
    real_attention(b, a);
}

/* One 40-token fork of the context (chunk 16: 3 chunks), layer-major or chunk-major, capturing every
 * layer's queries at kLmRows and, when last_hidden, the final-norm hidden state there; the matmuls
 * and attentions it ran in *mm and *at, its queries into q [L][LM_ROWS * QD]. */
static void unread_pass(fixture *f, kf_arena *a, const kf_seq *ctx, kf_seq *s, int layer_major, float *last_hidden,
                        float **q, int *mm, int *at) {
    const int L = kf_model_config(f->m)->n_layers;
    float **hidden = calloc((size_t)L + 1, sizeof *hidden);
    hidden[L] = last_hidden;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(a, ctx, LM_CTX, s, &err), KF_OK);
    const kf_forward_args fa = {.ids = f->ids + 100, .n_tokens = 40, .chunk = 16, .capture_rows = kLmRows,
                                .n_capture_rows = LM_ROWS, .queries = q, .hidden = last_hidden ? hidden : NULL};
    const kf_forward_pass ps = {s, &fa};
    n_matmul = n_attention = 0;
    const kf_status rc = layer_major ? kf_model_forward_layers(f->m, a, &ps, 1, NULL, &err)
                                     : kf_model_forward(f->m, a, s, &fa, &err);
    CU_ASSERT_EQUAL(rc, KF_OK);
    *mm = n_matmul, *at = n_attention;
    free(hidden);
}

/* A forward whose last layer's output nobody reads (no final hidden state, no logits: the sources
 * of reference queries, a prefill) runs no o_proj, MLP or attention there (7 matmuls a layer: q, k,
 * v, o, gate, up, down), layer-major or not; its queries and K/V are those of a forward that reads
 * the output. */
static void test_unread_output_skipped(void) {
    fixture *f = &fx_qwen;
    const kf_hfconfig *c = kf_model_config(f->m);
    const int L = c->n_layers, QD = c->n_heads * c->head_dim, chunks = 3;
    kf_arena a;
    kf_seq ctx, s[3];
    lm_docs(f, &a, &ctx, s);
    for (int i = 0; i < 3; i++) /* lm_docs' forks: unread_pass makes its own */
        kf_seq_release(&a, &s[i]);
    real_matmul = f->b->matmul, real_attention = f->b->attention;
    f->b->matmul = counted_matmul, f->b->attention = counted_attention;
    float *q[3][8], *hid = malloc(sizeof(float) * LM_ROWS * c->hidden_size);
    CU_ASSERT_FATAL(L <= 8);
    for (int i = 0; i < 3; i++)
        for (int l = 0; l < L; l++)
            q[i][l] = malloc(sizeof(float) * LM_ROWS * QD);
    int mm[3], at[3];
    unread_pass(f, &a, &ctx, &s[0], 1, hid, q[0], &mm[0], &at[0]);
    unread_pass(f, &a, &ctx, &s[1], 1, NULL, q[1], &mm[1], &at[1]);
    unread_pass(f, &a, &ctx, &s[2], 0, NULL, q[2], &mm[2], &at[2]);
    f->b->matmul = real_matmul, f->b->attention = real_attention;
    CU_ASSERT_EQUAL(mm[0], chunks * 7 * L);
    CU_ASSERT_EQUAL(at[0], chunks * L);
    for (int i = 1; i < 3; i++) {
        CU_ASSERT_EQUAL(mm[i], chunks * (7 * L - 4));
        CU_ASSERT_EQUAL(at[i], chunks * (L - 1));
        int bad = 0;
        for (int l = 0; l < L; l++) {
            bad += memcmp(q[i][l], q[0][l], sizeof(float) * LM_ROWS * QD) != 0;
            float *x = lm_layer_kv(f, &a, &s[i], l, s[0].len), *y = lm_layer_kv(f, &a, &s[0], l, s[0].len);
            bad += memcmp(x, y, sizeof(float) * 2 * (size_t)s[0].len * c->n_kv_heads * c->head_dim) != 0;
            free(x), free(y);
        }
        CU_ASSERT_EQUAL(bad, 0);
    }
    for (int i = 0; i < 3; i++) {
        for (int l = 0; l < L; l++)
            free(q[i][l]);
        kf_seq_release(&a, &s[i]);
    }
    free(hid);
    kf_seq_release(&a, &ctx);
    kf_arena_free(&a);
}

/* Teacher-forced decoding, one token per call through a plan: the logits of a full prefill, and
 * after the prompt not one buffer allocated; a longer chunk and more logit rows grow it once each. */
static void test_plan_reused_by_decoding(void) {
    fixture *f = &fx_qwen;
    const kf_hfconfig *c = kf_model_config(f->m);
    const int V = c->vocab_size, P = 40, steps = 20, more = 50;
    CU_ASSERT_FATAL(f->T >= P + steps + more);
    float *fresh = all_logits(f, 32); /* [T, V] */
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, f->T, &err), KF_OK);
    kf_forward_plan *plan;
    CU_ASSERT_EQUAL_FATAL(kf_forward_plan_create(&plan, f->m, 0, 0, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_forward_plan_size(plan, f->m), 0);

    float *logits = malloc(sizeof(float) * (size_t)32 * V);
    int32_t rows[more];
    for (int i = 0; i < more; i++)
        rows[i] = i;
    int32_t last = P - 1;
    kf_forward_args fa = {.ids = f->ids, .n_tokens = P, .logit_rows = &last, .n_logit_rows = 1, .logits = logits,
                          .plan = plan};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &seq, &fa, &err), KF_OK);
    CU_ASSERT(kf_max_abs_diff(logits, fresh + (size_t)(P - 1) * V, V) < 1e-4);
    const int64_t allocs = kf_forward_plan_allocs(plan);
    CU_ASSERT_EQUAL(allocs, 2); /* chunk buffers, logit buffers */
    CU_ASSERT_EQUAL(kf_forward_plan_size(plan, f->m), kf_forward_plan_bytes(c, P, 1));
    double worst = 0;
    for (int i = P; i < P + steps; i++) {
        kf_forward_args fs = {.ids = f->ids + i, .n_tokens = 1, .logit_rows = rows, .n_logit_rows = 1,
                              .logits = logits, .plan = plan};
        CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &seq, &fs, &err), KF_OK);
        worst = fmax(worst, kf_max_abs_diff(logits, fresh + (size_t)i * V, V));
    }
    printf("\n    decoding through a plan vs a full prefill: %.2e\n", worst);
    CU_ASSERT(worst < 1e-4);
    CU_ASSERT_EQUAL(kf_forward_plan_allocs(plan), allocs);

    /* 50 tokens in one chunk with 50 logit rows: both parts grow once, logit rows capped at 32 */
    kf_forward_args fm = {.ids = f->ids + P + steps, .n_tokens = more, .chunk = more, .logit_rows = rows + more - 32,
                          .n_logit_rows = 32, .logits = logits, .plan = plan};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(f->m, &a, &seq, &fm, &err), KF_OK);
    CU_ASSERT(kf_max_abs_diff(logits, fresh + (size_t)(P + steps + more - 32) * V, (size_t)32 * V) < 1e-4);
    CU_ASSERT_EQUAL(kf_forward_plan_allocs(plan), allocs + 2);
    CU_ASSERT_EQUAL(kf_forward_plan_size(plan, f->m), kf_forward_plan_bytes(c, more, 32));

    /* a plan belongs to its model */
    kf_model *other;
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&other, kf_test_data("hf-llama3-tiny-random"), f->b, &err), KF_OK);
    kf_arena oa;
    kf_seq os;
    kf_seq_init(&os);
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(other, &oa, 16, &err), KF_OK);
    kf_forward_args fo = {.ids = f->ids, .n_tokens = 4, .plan = plan};
    CU_ASSERT_EQUAL(kf_model_forward(other, &oa, &os, &fo, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "another model"));
    kf_arena_free(&oa);
    kf_model_free(other);

    kf_forward_plan_free(plan);
    free(logits);
    free(fresh);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
}

/* The engine's greedy decoding: the next token of a full prefill first; every forward on the
 * engine's plan (a freshly loaded model never makes its own), untouched after the document's
 * prefill. */
static void test_engine_greedy_allocates_nothing(void) {
    fixture *f = &fx_qwen;
    const int V = kf_model_config(f->m)->vocab_size, D = 40, Q = 5;
    float *fresh = all_logits(f, 32);
    int32_t expect = 0;
    for (int i = 1; i < V; i++)
        expect = fresh[(size_t)(D + Q - 1) * V + i] > fresh[(size_t)(D + Q - 1) * V + expect] ? i : expect;
    kf_model *m;
    kf_engine e;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, kf_test_data("hf-qwen3-tiny"), f->b, &err), KF_OK);
    kf_prompt doc = {.ids = f->ids, .n = D}, q = {.ids = f->ids + D, .n = Q};
    CU_ASSERT_EQUAL_FATAL(kf_engine_from_document(&e, m, &doc, 64, &err), KF_OK);
    const int64_t allocs = kf_forward_plan_allocs(e.plan);
    int32_t out[12];
    int n = 0;
    CU_ASSERT_EQUAL_FATAL(kf_engine_greedy(&e, m, &q, 12, NULL, 0, NULL, NULL, out, &n, &err), KF_OK);
    CU_ASSERT_EQUAL(n, 12);
    CU_ASSERT_EQUAL(out[0], expect);
    CU_ASSERT_EQUAL(kf_forward_plan_allocs(e.plan), allocs);
    CU_ASSERT_PTR_NULL(kf_model_plan(m));
    kf_engine_free(&e);
    kf_model_free(m);
    free(fresh);
}

/* Bad arguments are statuses, not crashes. */
static void test_forward_rejects_bad_input(void) {
    fixture *f = &fx_qwen;
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(f->m, &a, 32, &err), KF_OK);
    int32_t bad[3] = {1, 3200, 2};
    kf_forward_args fa = {.ids = bad, .n_tokens = 3};
    CU_ASSERT_EQUAL(kf_model_forward(f->m, &a, &seq, &fa, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "3200"));
    int32_t ok[3] = {1, 2, 3};
    int32_t row = 5;
    float logits[4];
    kf_forward_args fb = {.ids = ok, .n_tokens = 3, .logit_rows = &row, .n_logit_rows = 1, .logits = logits};
    CU_ASSERT_EQUAL(kf_model_forward(f->m, &a, &seq, &fb, &err), KF_ERR_INVALID);
    /* too long for the arena: out of pages, the document unchanged */
    int32_t *many = calloc(1000, sizeof(int32_t));
    kf_forward_args fc = {.ids = many, .n_tokens = 1000};
    CU_ASSERT_EQUAL(kf_model_forward(f->m, &a, &seq, &fc, &err), KF_ERR_NOSPACE);
    CU_ASSERT_EQUAL(seq.len, 0);
    free(many);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
}

/* Model directories with defects: a clear status naming the file. */
static void test_load_rejects_bad_directories(void) {
    kf_backend *b = kf_backend_cpu_create();
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_model_load(&m, kf_test_data("no-such-model"), b, &err), KF_ERR_IO);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "config.json"));
    CU_ASSERT_PTR_NULL(m);
    /* the llama config with the qwen weights: shapes disagree */
    const char *dir = kf_test_make_dir("mixed-model");
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s", kf_test_data("hf-llama3-tiny-random/config.json"));
    FILE *in = fopen(src, "rb");
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf, in);
    fclose(in);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    FILE *out = fopen(dst, "wb");
    fwrite(buf, 1, n, out);
    fclose(out);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    snprintf(src, sizeof src, "%s", kf_test_data("hf-qwen3-tiny/model.safetensors"));
    CU_ASSERT_EQUAL(symlink(src, dst), 0);
    CU_ASSERT_EQUAL(kf_model_load(&m, dir, b, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "shape"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "model.embed_tokens.weight"));
    b->destroy(b);
}

/* A copy of hf-qwen3-tiny in a temp directory whose model.safetensors has the BF16 pattern bits
 * at element `at` of tensor `name`; returns the directory (static buffer). */
static const char *patched_model(const char *dirname, const char *name, int64_t at, uint16_t bits) {
    static char dir[2048];
    snprintf(dir, sizeof dir, "%s", kf_test_make_dir(dirname));
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s", kf_test_data("hf-qwen3-tiny/config.json"));
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    CU_ASSERT_EQUAL(symlink(src, dst), 0);
    snprintf(src, sizeof src, "%s", kf_test_data("hf-qwen3-tiny/model.safetensors"));
    kf_st_set set = {0};
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_st_open_file(&set, src, &err), KF_OK);
    const kf_st_tensor *t = kf_st_find(&set, name);
    CU_ASSERT_FATAL(t != NULL && t->dtype == KF_DTYPE_BF16 && at < t->numel);
    const size_t size = set.files[0].size, off = (size_t)((const char *)t->data - (const char *)set.files[0].map);
    unsigned char *bytes = malloc(size);
    memcpy(bytes, set.files[0].map, size);
    kf_st_close(&set);
    memcpy(bytes + off + (size_t)at * 2, &bits, 2); /* little-endian host */
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    FILE *f = fopen(dst, "wb");
    CU_ASSERT_FATAL(f != NULL);
    CU_ASSERT_EQUAL(fwrite(bytes, 1, size, f), size);
    fclose(f);
    free(bytes);
    return dir;
}

/* Weights with NaN or an infinity are refused at load, naming the tensor and the element; the
 * largest finite BF16 value is accepted (only the exponent pattern of NaN/Inf is refused). */
static void test_load_rejects_nonfinite_weights(void) {
    kf_backend *b = kf_backend_cpu_create();
    kf_model *m = NULL;
    kf_error err = {0};
    const struct {
        const char *tensor;
        int64_t at;
        uint16_t bits;
        const char *what;
    } cases[] = {
        {"model.layers.1.self_attn.k_proj.weight", 37, 0x7fc0, "holds NaN at element 37 of"},
        {"model.norm.weight", 0, 0x7f80, "holds an infinity at element 0 of"},
        {"model.embed_tokens.weight", 5000, 0xff80, "holds an infinity at element 5000 of"},
        {"model.layers.0.mlp.down_proj.weight", 1, 0xffff, "holds NaN at element 1 of"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char name[32];
        snprintf(name, sizeof name, "nonfinite-%zu", c);
        const char *dir = patched_model(name, cases[c].tensor, cases[c].at, cases[c].bits);
        memset(&err, 0, sizeof err);
        CU_ASSERT_EQUAL(kf_model_load(&m, dir, b, &err), KF_ERR_FORMAT);
        CU_ASSERT_PTR_NULL(m);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, cases[c].tensor));
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, cases[c].what));
        if (!strstr(err.msg, cases[c].what))
            fprintf(stderr, "message: %s\n", err.msg);
    }
    const char *dir = patched_model("finite-max", "model.norm.weight", 3, 0x7f7f);
    CU_ASSERT_EQUAL(kf_model_load(&m, dir, b, &err), KF_OK);
    kf_model_free(m);
    b->destroy(b);
}

static CU_TestInfo qwen_tests[] = {
    {"golden tensors (hf-qwen3-tiny)", test_qwen_golden},
    {"chunk sizes 1, 7, 16, 64, whole", test_qwen_chunks},
    {"fork and rewind reproduce a fresh prefill", test_fork_reproduces_fresh_prefill},
    {"queries captured straight into the reference-query pool (all layers, one layer)", test_capture_into_refq_pool},
    {"layer-major forward: bit-identical to kf_model_forward", test_layer_major_forward},
    {"the last layer's unread output is not computed", test_unread_output_skipped},
    {"bad forward arguments", test_forward_rejects_bad_input},
    {"decoding through a plan allocates nothing", test_plan_reused_by_decoding},
    {"engine greedy: no allocation per token", test_engine_greedy_allocates_nothing},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo llama_tests[] = {
    {"golden tensors (hf-llama3-tiny-random, llama3 rope)", test_llama_golden},
    {"chunk sizes 1, 7, 16, 64, whole", test_llama_chunks},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo load_tests[] = {
    {"bad model directories", test_load_rejects_bad_directories},
    {"NaN or infinite weights refused with the tensor's name", test_load_rejects_nonfinite_weights},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"qwen3", init_qwen, clean_qwen, NULL, NULL, qwen_tests},
    {"llama3", init_llama, clean_llama, NULL, NULL, llama_tests},
    {"load", NULL, NULL, NULL, NULL, load_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
