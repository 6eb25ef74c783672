/* AM's targets fused into the CPU attention (kf_attn_targets, kernels/backend.h) against
 * kf_am_targets_compute (compactor/am.c) and an fp64 reference, on random inputs: a prefix before
 * the block, a block spanning several key blocks and a partial last page, GQA (several query heads
 * per KV head), the queries in several chunks (the score summed across the calls), target rows a
 * subset of each chunk, some of them also with their attention over their own prompt (the keys
 * from N_PAST on: the validation's appended block). Outputs are poisoned (NaN) first; one thread
 * and a pool of 3 give the same bits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/am.h"
#include "compactor/compact.h"
#include "compactor/model.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/pool.h"
#include "test_util.h"

static kf_pool *g_pool;

/* max(e, |v|), a NaN (an output left poisoned) counting as infinite (fmax would drop it) */
static double worse(double e, double v) {
    return isnan(v) ? INFINITY : fmax(e, fabs(v));
}

/* a block of 600 keys after 37 (three key blocks of the kernel, partial pages at both ends), then
 * 63 more history keys; 230 queries in chunks of 180 (two tiles of 170 + 10 queries) and 50 */
enum { KVH = 2, REP = 3, NH = KVH * REP, HD = 16, N_PRE = 37, N_BLK = 600, N_PAST = 700, N_Q = 230, CHUNK = 180 };

/* The case: keys/values in token order [N_PAST + N_Q, KVH, HD] and in a scrambled paged pool. */
typedef struct {
    float *keys, *vals, *pool, *q; /* q [N_Q, NH, HD] */
    int32_t pages[64];
    kf_paged_kv kv;
    int32_t rows[N_Q];             /* target rows (query indices), ascending */
    int n_rows;
    int32_t slot[N_Q];             /* [n_rows] target row k's own-prompt slot, -1: none */
    int n_slots;
} fixture;

static void fixture_init(fixture *f) {
    const int n_keys = N_PAST + N_Q, n_pages = (n_keys + 15) / 16, pool_pages = 64;
    const size_t row = (size_t)KVH * HD, page_stride = 2 * 16 * row + 8;
    f->keys = malloc(sizeof(float) * n_keys * row);
    f->vals = malloc(sizeof(float) * n_keys * row);
    f->q = malloc(sizeof(float) * N_Q * NH * HD);
    f->pool = calloc((size_t)pool_pages * page_stride, sizeof(float));
    kf_test_fill_uniform(f->keys, (size_t)n_keys * row, 21, -2, 2);
    kf_test_fill_uniform(f->vals, (size_t)n_keys * row, 22, -1, 1);
    kf_test_fill_uniform(f->q, (size_t)N_Q * NH * HD, 23, -2, 2);
    for (int p = 0; p < n_pages; p++)
        f->pages[p] = (p * 37 + 5) % pool_pages; /* 37 is prime to 64: distinct pages */
    f->kv = (kf_paged_kv){.k = f->pool, .v = f->pool + 16 * row, .page_stride = page_stride, .kv_heads = KVH,
                          .head_dim = HD};
    kf_cpu_kv_store(&f->kv, f->pages, 0, n_keys, f->keys, f->vals);
    f->n_rows = 0;
    for (int i = 0; i < N_Q; i++)
        if (i % 3 != 1 || i == N_Q - 1)
            f->rows[f->n_rows++] = i;
    f->n_slots = 0;
    for (int k = 0; k < f->n_rows; k++) /* the held-out rows: about two in five, the first and last */
        f->slot[k] = k % 5 == 0 || k % 5 == 3 || k == f->n_rows - 1 ? f->n_slots++ : -1;
}

static void fixture_free(fixture *f) {
    free(f->keys);
    free(f->vals);
    free(f->q);
    free(f->pool);
}

/* Pooled rows of KV head g as kf_refq lays them out: row j * n_rows + k = head g*REP + j, row k. */
typedef struct {
    float *m, *y, *Y; /* [NH, n_rows], [NH, n_rows], [NH, n_rows, HD] */
    double *score;    /* [KVH, N_BLK] */
    float *out;       /* [N_Q, NH, HD] attention output */
    float *am, *ay, *aY; /* [NH, n_slots], [NH, n_slots], [NH, n_slots, HD]: over the own prompt */
} results;

static void results_poison(results *r, int n_rows, int n_slots) {
    const size_t n = (size_t)NH * n_rows, na = (size_t)NH * n_slots;
    r->am = realloc(r->am, sizeof(float) * na);
    r->ay = realloc(r->ay, sizeof(float) * na);
    r->aY = realloc(r->aY, sizeof(float) * na * HD);
    for (size_t i = 0; i < na; i++)
        r->am[i] = r->ay[i] = NAN;
    for (size_t i = 0; i < na * HD; i++)
        r->aY[i] = NAN;
    r->m = realloc(r->m, sizeof(float) * n);
    r->y = realloc(r->y, sizeof(float) * n);
    r->Y = realloc(r->Y, sizeof(float) * n * HD);
    r->score = realloc(r->score, sizeof(double) * KVH * N_BLK);
    r->out = realloc(r->out, sizeof(float) * N_Q * NH * HD);
    for (size_t i = 0; i < n; i++)
        r->m[i] = r->y[i] = NAN;
    for (size_t i = 0; i < n * HD; i++)
        r->Y[i] = NAN;
    for (size_t i = 0; i < (size_t)N_Q * NH * HD; i++)
        r->out[i] = NAN;
    for (int i = 0; i < KVH * N_BLK; i++)
        r->score[i] = 0.25; /* the op adds to it */
}

static void results_free(results *r) {
    free(r->m);
    free(r->y);
    free(r->Y);
    free(r->score);
    free(r->out);
    free(r->am);
    free(r->ay);
    free(r->aY);
}

/* The queries in chunks of CHUNK, each over the keys before it and its own (causal); with own 1,
 * the slotted rows' attention over the keys from N_PAST on too; 2: those keys first, no slots. */
static int run_fused(const fixture *f, kf_pool *pool, int rms, int own, results *r) {
    kf_cpu_attn_scratch s = {.pool = pool};
    int rc = 0, k0 = 0;
    for (int c0 = 0; c0 < N_Q && rc == 0; c0 += CHUNK) {
        const int n = N_Q - c0 < CHUNK ? N_Q - c0 : CHUNK;
        int k1 = k0;
        while (k1 < f->n_rows && f->rows[k1] < c0 + n)
            k1++;
        kf_attn_targets t = {.blk0 = N_PRE, .blk1 = N_PRE + N_BLK, .rows = f->rows + k0, .n_rows = k1 - k0,
                             .row_base = c0, .m = r->m + k0, .y = r->y + k0, .Y = r->Y + (size_t)k0 * HD,
                             .row_stride = 1, .head_stride = (size_t)f->n_rows, .score = r->score,
                             .score_stride = N_BLK, .score_rms = rms};
        if (own == 1)
            t.app0 = N_PAST, t.app_slot = f->slot + k0, t.am = r->am, t.ay = r->ay, t.aY = r->aY,
            t.app_head_stride = (size_t)f->n_slots;
        else if (own == 2)
            t.app0 = N_PAST; /* the own keys first, no row's part asked for */
        kf_attn_args a = {.q = f->q + (size_t)c0 * NH * HD, .q_stride = NH * HD, .out = r->out + (size_t)c0 * NH * HD,
                          .out_stride = NH * HD, .n_q = n, .n_heads = NH, .n_keys = N_PAST + c0 + n,
                          .pages = f->pages, .kv = f->kv, .scale = 1.0f / sqrtf(HD), .targets = &t};
        rc = kf_cpu_attention(&s, &a);
        k0 = k1;
    }
    kf_cpu_attn_scratch_free(&s);
    return rc;
}

/* fp64: query i, head h over the block -> m, y, Y, p [N_BLK]; over all its keys -> out [HD]. */
static void ref_row(const fixture *f, int i, int h, double *m, double *y, double *Y, double *p, double *out) {
    const int g = h / REP, n_vis = N_PAST + i + 1;
    const double scale = 1.0 / sqrt((double)HD);
    double *z = malloc(sizeof(double) * n_vis);
    double bm = -INFINITY, am = -INFINITY;
    for (int j = 0; j < n_vis; j++) {
        double dot = 0;
        for (int d = 0; d < HD; d++)
            dot += (double)f->q[((size_t)i * NH + h) * HD + d] * f->keys[((size_t)j * KVH + g) * HD + d];
        z[j] = dot * scale;
        am = fmax(am, z[j]);
        if (j >= N_PRE && j < N_PRE + N_BLK)
            bm = fmax(bm, z[j]);
    }
    double by = 0, ay = 0;
    for (int j = 0; j < n_vis; j++) {
        ay += exp(z[j] - am);
        if (j >= N_PRE && j < N_PRE + N_BLK)
            by += exp(z[j] - bm);
    }
    *m = bm, *y = by;
    for (int d = 0; d < HD; d++)
        Y[d] = out[d] = 0;
    for (int j = 0; j < n_vis; j++) {
        const float *v = f->vals + ((size_t)j * KVH + g) * HD;
        const double wa = exp(z[j] - am) / ay;
        for (int d = 0; d < HD; d++)
            out[d] += wa * v[d];
        if (j >= N_PRE && j < N_PRE + N_BLK) {
            const double wb = exp(z[j] - bm) / by;
            p[j - N_PRE] = wb;
            for (int d = 0; d < HD; d++)
                Y[d] += wb * v[d];
        }
    }
    free(z);
}

/* fp64: query i, head h over its own prompt, keys [N_PAST, N_PAST + i] -> m, y, Y. */
static void ref_own(const fixture *f, int i, int h, double *m, double *y, double *Y) {
    const int g = h / REP;
    double z[N_Q], mx = -INFINITY, sum = 0;
    for (int j = 0; j <= i; j++) {
        double dot = 0;
        for (int d = 0; d < HD; d++)
            dot += (double)f->q[((size_t)i * NH + h) * HD + d] * f->keys[((size_t)(N_PAST + j) * KVH + g) * HD + d];
        z[j] = dot / sqrt((double)HD);
        mx = fmax(mx, z[j]);
    }
    for (int d = 0; d < HD; d++)
        Y[d] = 0;
    for (int j = 0; j <= i; j++)
        sum += exp(z[j] - mx);
    for (int j = 0; j <= i; j++)
        for (int d = 0; d < HD; d++)
            Y[d] += exp(z[j] - mx) / sum * f->vals[((size_t)(N_PAST + j) * KVH + g) * HD + d];
    *m = mx, *y = sum;
}

/* The own-prompt results against fp64. */
static void check_own_vs_fp64(const fixture *f, const results *r) {
    double e_m = 0, e_y = 0, e_Y = 0, m, y, Y[HD];
    for (int k = 0; k < f->n_rows; k++)
        for (int h = 0; h < NH && f->slot[k] >= 0; h++) {
            ref_own(f, f->rows[k], h, &m, &y, Y);
            const size_t at = (size_t)h * f->n_slots + f->slot[k];
            e_m = worse(e_m, (r->am[at] - m));
            e_y = worse(e_y, (r->ay[at] - y) / y);
            for (int d = 0; d < HD; d++)
                e_Y = worse(e_Y, (r->aY[at * HD + d] - Y[d]));
        }
    CU_ASSERT(e_m < 1e-5 && e_y < 1e-5 && e_Y < 1e-5);
    if (!(e_m < 1e-5 && e_y < 1e-5 && e_Y < 1e-5))
        printf("\n    own prompt vs fp64: m %.2e y %.2e Y %.2e\n", e_m, e_y, e_Y);
}

/* The fused results against fp64 (targets, score, attention output). */
static void check_vs_fp64(const fixture *f, const results *r, int rms) {
    double *score = calloc((size_t)KVH * N_BLK, sizeof(double)), p[N_BLK], Y[HD], out[HD], m, y;
    double e_m = 0, e_y = 0, e_Y = 0, e_out = 0, e_s = 0;
    int k = 0;
    for (int i = 0; i < N_Q; i++) {
        const int target = k < f->n_rows && f->rows[k] == i;
        for (int h = 0; h < NH; h++) {
            ref_row(f, i, h, &m, &y, Y, p, out);
            for (int d = 0; d < HD; d++)
                e_out = worse(e_out, (r->out[((size_t)i * NH + h) * HD + d] - out[d]));
            if (!target)
                continue;
            const size_t at = (size_t)h * f->n_rows + k;
            e_m = worse(e_m, (r->m[at] - m));
            e_y = worse(e_y, (r->y[at] - y) / y);
            for (int d = 0; d < HD; d++)
                e_Y = worse(e_Y, (r->Y[at * HD + d] - Y[d]));
            for (int j = 0; j < N_BLK; j++)
                score[(size_t)(h / REP) * N_BLK + j] += rms ? p[j] * p[j] : p[j];
        }
        k += target;
    }
    for (int j = 0; j < KVH * N_BLK; j++)
        e_s = worse(e_s, (r->score[j] - 0.25 - score[j]) / fmax(score[j], 1e-30));
    CU_ASSERT(e_m < 1e-5 && e_y < 1e-5 && e_Y < 1e-5 && e_out < 1e-5 && e_s < 1e-5);
    if (!(e_m < 1e-5 && e_y < 1e-5 && e_Y < 1e-5 && e_out < 1e-5 && e_s < 1e-5))
        printf("\n    vs fp64 (rms %d): m %.2e y %.2e Y %.2e out %.2e score %.2e\n", rms, e_m, e_y, e_Y, e_out, e_s);
    free(score);
}

/* The fused results against kf_am_targets_compute on the same pooled rows of each KV head. */
static void check_vs_am(const fixture *f, const results *r, int rms) {
    const int R = REP * f->n_rows;
    float *q = malloc(sizeof(float) * R * HD);
    double e_m = 0, e_y = 0, e_Y = 0, e_s = 0;
    for (int g = 0; g < KVH; g++) {
        for (int jh = 0; jh < REP; jh++)
            for (int k = 0; k < f->n_rows; k++)
                memcpy(q + ((size_t)jh * f->n_rows + k) * HD, f->q + ((size_t)f->rows[k] * NH + g * REP + jh) * HD,
                       sizeof(float) * HD);
        const size_t row = (size_t)KVH * HD;
        kf_am_head h = {.k = f->keys + N_PRE * row + (size_t)g * HD, .k_stride = row,
                        .v = f->vals + N_PRE * row + (size_t)g * HD, .v_stride = row, .T = N_BLK, .q = q, .R = R,
                        .d = HD, .scale = 1.0f / sqrtf(HD)};
        kf_am_targets tg;
        kf_error err;
        CU_ASSERT_EQUAL_FATAL(kf_am_targets_compute(&h, rms ? KF_SCORE_RMS : KF_SCORE_MEAN, &tg, &err), KF_OK);
        const size_t base = (size_t)g * R; /* the KV head's rows in r: heads g*REP .. are adjacent */
        for (int i = 0; i < R; i++) {
            e_m = worse(e_m, (r->m[base + i] - tg.m[i]));
            e_y = worse(e_y, (r->y[base + i] - tg.y[i]) / tg.y[i]);
            for (int d = 0; d < HD; d++)
                e_Y = worse(e_Y, (r->Y[(base + i) * HD + d] - tg.Y[(size_t)i * HD + d]));
        }
        for (int j = 0; j < N_BLK; j++) {
            const double s = r->score[(size_t)g * N_BLK + j] - 0.25;
            const double fused = rms ? sqrt(s / R) : s / R;
            e_s = worse(e_s, (fused - tg.score[j]) / tg.score[j]);
        }
        kf_am_targets_free(&tg);
    }
    CU_ASSERT(e_m < 1e-5 && e_y < 1e-5 && e_Y < 1e-5 && e_s < 1e-5);
    if (!(e_m < 1e-5 && e_y < 1e-5 && e_Y < 1e-5 && e_s < 1e-5))
        printf("\n    vs am (rms %d): m %.2e y %.2e Y %.2e score %.2e\n", rms, e_m, e_y, e_Y, e_s);
    free(q);
}

static void test_fused_targets(void) {
    fixture f;
    fixture_init(&f);
    for (int c = 0; c < 4; c++) {
        const int rms = c & 1, own = c >> 1;
        results one = {0}, three = {0};
        results_poison(&one, f.n_rows, f.n_slots);
        results_poison(&three, f.n_rows, f.n_slots);
        CU_ASSERT_EQUAL_FATAL(run_fused(&f, NULL, rms, own, &one), 0);
        CU_ASSERT_EQUAL_FATAL(run_fused(&f, g_pool, rms, own, &three), 0);
        check_vs_fp64(&f, &one, rms);
        check_vs_am(&f, &one, rms);
        if (own) {
            check_own_vs_fp64(&f, &one);
            results none = {0}; /* no slots, the same order of sums: the same output */
            results_poison(&none, f.n_rows, f.n_slots);
            CU_ASSERT_EQUAL_FATAL(run_fused(&f, g_pool, rms, 2, &none), 0);
            CU_ASSERT(memcmp(one.out, none.out, sizeof(float) * N_Q * NH * HD) == 0);
            CU_ASSERT(memcmp(one.Y, none.Y, sizeof(float) * (size_t)NH * f.n_rows * HD) == 0);
            CU_ASSERT(isnan(none.am[0]) && isnan(none.aY[0]));
            results_free(&none);
            const size_t na = (size_t)NH * f.n_slots;
            CU_ASSERT(memcmp(one.am, three.am, sizeof(float) * na) == 0 &&
                      memcmp(one.ay, three.ay, sizeof(float) * na) == 0 &&
                      memcmp(one.aY, three.aY, sizeof(float) * na * HD) == 0);
        }
        /* any thread count: the same bits */
        const size_t n = (size_t)NH * f.n_rows;
        CU_ASSERT(memcmp(one.m, three.m, sizeof(float) * n) == 0 && memcmp(one.y, three.y, sizeof(float) * n) == 0);
        CU_ASSERT(memcmp(one.Y, three.Y, sizeof(float) * n * HD) == 0);
        CU_ASSERT(memcmp(one.score, three.score, sizeof(double) * KVH * N_BLK) == 0);
        CU_ASSERT(memcmp(one.out, three.out, sizeof(float) * N_Q * NH * HD) == 0);
        results_free(&one);
        results_free(&three);
    }
    fixture_free(&f);
}

/* A block that reaches into the chunk, a bias, or rows out of order: refused (-1). */
static void test_bad_targets_refused(void) {
    fixture f;
    fixture_init(&f);
    results r = {0};
    results_poison(&r, f.n_rows, f.n_slots);
    kf_cpu_attn_scratch s = {.pool = g_pool};
    kf_attn_targets t = {.blk0 = N_PAST - 10, .blk1 = N_PAST + 1, .rows = f.rows, .n_rows = 4, .m = r.m, .y = r.y,
                         .Y = r.Y, .row_stride = 1, .head_stride = 4, .score = r.score, .score_stride = N_BLK};
    kf_attn_args a = {.q = f.q, .q_stride = NH * HD, .out = r.out, .out_stride = NH * HD, .n_q = 8, .n_heads = NH,
                      .n_keys = N_PAST + 8, .pages = f.pages, .kv = f.kv, .scale = 0.25f, .targets = &t};
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), -1);
    t.blk1 = N_PAST; /* the whole block in the past: fine */
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), 0);
    int32_t bad[2] = {3, 2};
    t.rows = bad, t.n_rows = 2;
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), -1);
    t.rows = f.rows, t.n_rows = 4;
    float bias[KVH] = {0};
    a.bias = bias, a.bias_len = 1, a.bias_stride = 1;
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), -1);
    a.bias = NULL;
    t.app0 = N_PAST + 1, t.app_slot = f.slot, t.am = r.am, t.ay = r.ay, t.aY = r.aY; /* own prompt inside the chunk */
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), -1);
    t.app0 = N_PAST - 10; /* before the block's end */
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), -1);
    t.app0 = N_PAST, t.aY = NULL;
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), -1);
    t.aY = r.aY;
    CU_ASSERT_EQUAL(kf_cpu_attention(&s, &a), 0);
    kf_cpu_attn_scratch_free(&s);
    results_free(&r);
    fixture_free(&f);
}

static int suite_init(void) {
    g_pool = kf_pool_create(3);
    return g_pool ? 0 : -1;
}

static int suite_clean(void) {
    kf_pool_destroy(g_pool);
    return 0;
}

/* ---- through the compactor: fused targets (the CPU backend) against the solve computing them all
 * (the backend's attn_targets cleared, as on CUDA), on records-qwen3 with a prefix, a probe and
 * the context's own queries (rows that are never fused: the mixed path) ---- */

static kf_backend *g_b;
static kf_model *g_m;
static int32_t g_doc[4096];
static int g_doc_n;

static int init_model(void) {
    if (kf_test_model_open("records-qwen3", &g_b, &g_m))
        return -1;
    g_doc_n = kf_test_records_ids(2, g_doc, 4096); /* doc1-1 of records-dev.jsonl */
    return g_doc_n > 300 ? 0 : -1;
}

static int clean_model(void) {
    return kf_test_model_close(g_b, g_m);
}

static void compare_compactions(int context_queries) {
    static const int32_t kInstr[] = {260, 263, 270, 275, 46, 10}; /* "Repeat the records above.\n" */
    static const int32_t kQuestion[] = {81, 58, 1541, 63, 10, 65, 58}; /* "Q: rake?\nA:" */
    kf_error err = {0};
    const kf_prompt pre = {g_doc, 5}, doc = {g_doc + 5, 250}, probe = {kQuestion, 7};
    kf_compact_params p = kf_compact_params_default();
    p.method = KF_METHOD_FOLD, p.budget = 0.25, p.solver.max_queries = 2000;
    p.repeat_instruction = (kf_prompt){kInstr, 6};
    p.probes = &probe, p.n_probes = 1;
    p.use_context_queries = context_queries;
    kf_compacted fused, computed;
    CU_ASSERT_EQUAL_FATAL(kf_compact(g_m, &pre, &doc, NULL, &p, &fused, &err), KF_OK);
    g_b->attn_targets = 0;
    const kf_status rc = kf_compact(g_m, &pre, &doc, NULL, &p, &computed, &err);
    g_b->attn_targets = 1;
    CU_ASSERT_EQUAL_FATAL(rc, KF_OK);
    CU_ASSERT_FATAL(fused.C == computed.C && fused.stats.n_queries == computed.stats.n_queries);
    const size_t np = (size_t)fused.n_layers * fused.kv_heads * fused.C;
    const size_t n = (size_t)fused.n_layers * fused.C * fused.kv_heads * fused.head_dim;
    size_t same = 0;
    for (size_t i = 0; i < np; i++)
        same += fused.positions[i] == computed.positions[i];
    const double dk = kf_max_abs_diff(fused.keys, computed.keys, n) / kf_max_abs(computed.keys, n);
    const double dv = kf_max_abs_diff(fused.values, computed.values, n) / kf_max_abs(computed.values, n);
    /* the same compaction but for the order of sums: not bit for bit (else the fused path did
     * not run), the same keys kept, keys and values within 1e-3 of their largest */
    CU_ASSERT(memcmp(fused.values, computed.values, sizeof(float) * n) != 0);
    CU_ASSERT_EQUAL(same, np);
    CU_ASSERT(dk < 1e-3 && dv < 1e-3);
    printf("\n    context queries %d: %zu of %zu kept positions equal, keys %.2e values %.2e (relative)\n",
           context_queries, same, np, dk, dv);
    kf_compacted_free(&fused);
    kf_compacted_free(&computed);
}

static void test_compaction_fused_vs_computed(void) {
    compare_compactions(0);
    compare_compactions(1);
}

/* A forward's own prompts that start inside the block or the call, or lack buffers: refused with
 * KF_ERR_INVALID naming the cause; the same call with them in place runs. */
static void test_forward_own_refused(void) {
    const kf_hfconfig *c = kf_model_config(g_m);
    const int L = c->n_layers, NQ = 8, n_head = c->n_heads, hd = c->head_dim;
    kf_arena a;
    kf_seq seq;
    kf_seq_init(&seq);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_arena(g_m, &a, 64, &err), KF_OK);
    kf_forward_args pre = {.ids = g_doc, .n_tokens = 20};
    CU_ASSERT_EQUAL_FATAL(kf_model_forward(g_m, &a, &seq, &pre, &err), KF_OK);
    int32_t rows[8] = {0, 1, 2, 3, 4, 5, 6, 7}, slot[8] = {0, -1, 1, -1, 2, -1, 3, -1};
    float *buf = calloc((size_t)L * 4 * NQ * n_head * (hd + 1), sizeof(float));
    double *score = calloc((size_t)L * c->n_kv_heads * 8, sizeof(double));
    float *m[64], *y[64], *Y[64], *am[64], *ay[64], *aY[64];
    double *sc[64];
    for (int l = 0; l < L; l++) {
        float *b = buf + (size_t)l * 4 * NQ * n_head * (hd + 1);
        m[l] = b, y[l] = b + NQ * n_head, Y[l] = b + 2 * NQ * n_head, am[l] = Y[l] + NQ * n_head * hd;
        ay[l] = am[l] + NQ * n_head, aY[l] = ay[l] + NQ * n_head, sc[l] = score + (size_t)l * c->n_kv_heads * 8;
    }
    kf_forward_targets ft = {.blk0 = 2, .blk1 = 10, .m = m, .y = y, .Y = Y, .row_stride = (size_t)n_head,
                             .head_stride = 1, .score = sc, .score_stride = 8, .app0 = 5, .app_slot = slot,
                             .am = am, .ay = ay, .aY = aY, .app_head_stride = 1};
    kf_forward_args fa = {.ids = g_doc + 20, .n_tokens = NQ, .capture_rows = rows, .n_capture_rows = NQ, .targets = &ft};
    kf_seq fork;
    const int app0[4] = {5, 21, 20, 20};
    for (int i = 0; i < 4; i++) {
        ft.app0 = app0[i], ft.aY = i == 2 ? NULL : aY;
        CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &seq, 20, &fork, &err), KF_OK);
        const kf_status rc = kf_model_forward(g_m, &a, &fork, &fa, &err);
        CU_ASSERT_EQUAL(rc, i == 3 ? KF_OK : KF_ERR_INVALID);
        CU_ASSERT(i == 3 || strstr(err.msg, "own prompts from key") != NULL);
        kf_seq_release(&a, &fork);
    }
    CU_ASSERT(isfinite(aY[0][0]) && ay[0][0] > 0); /* the run that went through wrote its rows */
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    free(buf);
    free(score);
}

static CU_TestInfo model_tests[] = {
    {"kf_compact: fused targets = computed ones (but for the order of sums)", test_compaction_fused_vs_computed},
    {"a forward's own prompts out of place are refused", test_forward_own_refused},
    CU_TEST_INFO_NULL,
};

static CU_TestInfo tests[] = {
    {"fused targets = kf_am_targets_compute = fp64 (chunks, GQA, prefix, pool, own prompts)", test_fused_targets},
    {"targets the kernel cannot give are refused", test_bad_targets_refused},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"attention targets", suite_init, suite_clean, NULL, NULL, tests},
                                {"compaction on records-qwen3", init_model, clean_model, NULL, NULL, model_tests},
                                CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
