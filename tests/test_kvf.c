/* The kvf cache file: round trips of every method and dtype, the conversions, paths and digests,
 * and refusals with the cause named (another model, truncation, a flipped byte inside a chunk, an
 * unknown version, a missing dataset, a killed writer's temporary file); concurrent writers of one
 * name never expose a partial file. */
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "compactor/fingerprint.h"
#include "compactor/model.h"
#include "formats/kvf.h"
#include "formats/kvf_internal.h"
#include "test_util.h"

static const char kFp[] = "0123456789abcdef0123456789abcdef";
static const char kOtherFp[] = "fedcba9876543210fedcba9876543210";

/* A synthetic cache with owned buffers. */
typedef struct {
    kvf_cache c;
    float *keys, *values, *beta, *u; /* [L, C, H, D] x2, [L, H, C], [L, H, D] */
    int32_t *pos;                    /* [L, H, C] */
} synth;

static void synth_make(synth *s, int L, int H, int D, int64_t C, kf_dtype dt, kf_method m, uint64_t seed) {
    memset(s, 0, sizeof *s);
    kvf_header *h = &s->c.hdr;
    kvf_header_init(h);
    memcpy(h->model_fingerprint, kFp, sizeof kFp);
    int32_t ids[3] = {(int32_t)seed, 2, 3};
    kvf_document_digest(ids, 3, h->document_digest);
    h->n_doc_tokens = m == KF_METHOD_KEEP ? C : 4 * C;
    h->n_tokens = C;
    h->method = m;
    h->budget = m == KF_METHOD_KEEP ? 1.0 : 0.25;
    h->lambda = m == KF_METHOD_FOLD ? 0.5 : 0;
    h->dtype = dt;
    h->n_layers = L;
    h->kv_heads = H;
    h->head_dim = D;
    snprintf(h->creator, sizeof h->creator, "kvfold seed-%llu", (unsigned long long)seed);
    size_t nkv = (size_t)L * (size_t)C * (size_t)H * (size_t)D, nb = (size_t)L * (size_t)H * (size_t)C,
           nu = (size_t)L * (size_t)H * (size_t)D;
    s->keys = malloc(nkv * 4);
    s->values = malloc(nkv * 4);
    s->beta = malloc(nb * 4);
    s->u = malloc(nu * 4);
    s->pos = malloc(nb * 4);
    kf_test_fill_uniform(s->keys, nkv, seed, -3, 3);
    kf_test_fill_uniform(s->values, nkv, seed + 1, -1, 1);
    kf_test_fill_uniform(s->beta, nb, seed + 2, -2, 2);
    kf_test_fill_uniform(s->u, nu, seed + 3, -1, 1);
    for (size_t i = 0; i < nb; i++)
        s->pos[i] = (i % 7 == 6) ? -1 : (int32_t)((i * 13) % (size_t)h->n_doc_tokens);
    s->c.keys = s->keys;
    s->c.values = s->values;
    s->c.beta = s->beta;
    s->c.u = s->u;
    s->c.positions = s->pos;
}

static void synth_free(synth *s) {
    free(s->keys);
    free(s->values);
    free(s->beta);
    free(s->u);
    free(s->pos);
}

/* |got - want| within the dtype's rounding (f32: exact). */
static int close_enough(kf_dtype dt, const float *got, const float *want, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double tol = dt == KF_DTYPE_F32    ? 0
                     : dt == KF_DTYPE_BF16 ? fabs(want[i]) * 0x1p-8
                                           : fmax(fabs(want[i]) * 0x1p-11, 0x1p-25);
        if (fabs((double)got[i] - want[i]) > tol)
            return 0;
    }
    return 1;
}

/* KVF_TEST_VERBOSE=1 prints each refusal's message, to read them. */
static void show(const kf_error *err) {
    if (getenv("KVF_TEST_VERBOSE"))
        fprintf(stderr, "\n    refusal: %s", err->msg);
}

static char g_path[4096];

static const char *cache_file(const char *dirname, const synth *s) {
    const kvf_header *h = &s->c.hdr;
    kf_error err = {0};
    const char *root = kf_test_make_dir(dirname);
    char rootcopy[1024];
    snprintf(rootcopy, sizeof rootcopy, "%s", root);
    kf_status st = kvf_cache_path(rootcopy, h->model_fingerprint, h->document_digest, h->method, h->budget, h->recipe_digest, true, g_path,
                                  sizeof g_path, &err);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    return g_path;
}

static void write_ok(const char *path, const synth *s) {
    kf_error err = {0};
    kf_status st = kvf_write(path, &s->c, &err);
    if (st != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
}

static kvf_file *open_ok(const char *path) {
    kf_error err = {0};
    kvf_file *f = NULL;
    kf_status st = kvf_open(path, &f, &err);
    if (st != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    return f;
}

/* Every layer, block, and side dataset equals what was written. Returns 1 when all match. */
static int check_contents(kvf_file *f, const synth *s) {
    const kvf_header *h = &s->c.hdr;
    const int L = h->n_layers, H = h->kv_heads, D = h->head_dim;
    const int64_t C = h->n_tokens;
    const size_t ln = (size_t)C * (size_t)H * (size_t)D, row = (size_t)H * (size_t)D;
    float *buf = malloc(ln * 4), *blk = malloc(KVF_BLOCK * row * 4), *side = malloc((size_t)L * H * (C + D) * 4);
    uint16_t *raw = malloc(ln * 2);
    kf_error err = {0};
    int ok = 1;
    for (int l = 0; l < L && ok; l++)
        for (int w = 0; w < 2 && ok; w++) {
            const float *want = (w ? s->values : s->keys) + (size_t)l * ln;
            kvf_which which = w ? KVF_VALUES : KVF_KEYS;
            ok &= kvf_read_layer(f, l, which, buf, &err) == KF_OK && close_enough(h->dtype, buf, want, ln);
            if (h->dtype != KF_DTYPE_F32) {
                ok &= kvf_read_layer_raw(f, l, which, raw, &err) == KF_OK;
                for (size_t i = 0; i < ln && ok; i++)
                    ok &= raw[i] == (h->dtype == KF_DTYPE_BF16 ? kf_f32_to_bf16(want[i]) : kf_f32_to_f16(want[i]));
            }
            for (int64_t b = 0; b < kvf_n_blocks(f) && ok; b++) {
                int nt = -1;
                ok &= kvf_read_block(f, l, b, which, blk, &nt, &err) == KF_OK;
                ok &= nt == (C - b * 16 < 16 ? (int)(C - b * 16) : 16);
                ok &= memcmp(blk, buf + (size_t)b * 16 * row, (size_t)nt * row * 4) == 0;
            }
        }
    const size_t nb = (size_t)L * H * (size_t)C, nu = (size_t)L * H * (size_t)D;
    ok &= kvf_read_beta(f, KVF_ALL_LAYERS, side, &err) == KF_OK && memcmp(side, s->beta, nb * 4) == 0;
    ok &= kvf_read_u(f, KVF_ALL_LAYERS, side, &err) == KF_OK && memcmp(side, s->u, nu * 4) == 0;
    ok &= kvf_read_positions(f, KVF_ALL_LAYERS, (int32_t *)side, &err) == KF_OK && memcmp(side, s->pos, nb * 4) == 0;
    ok &= kvf_read_beta(f, L - 1, side, &err) == KF_OK &&
          memcmp(side, s->beta + (size_t)(L - 1) * H * (size_t)C, (size_t)H * (size_t)C * 4) == 0;
    if (!ok && err.msg[0])
        fprintf(stderr, "check_contents: %s\n", err.msg);
    free(buf);
    free(blk);
    free(side);
    free(raw);
    return ok;
}

/* ---- conversions, names, paths ---- */

static void test_conversions(void) {
    CU_ASSERT_EQUAL(kf_f32_to_f16(1.0f), 0x3c00);
    CU_ASSERT_EQUAL(kf_f32_to_f16(-2.0f), 0xc000);
    CU_ASSERT_EQUAL(kf_f32_to_f16(65504.0f), 0x7bff);
    CU_ASSERT_EQUAL(kf_f32_to_f16(65519.0f), 0x7bff);
    CU_ASSERT_EQUAL(kf_f32_to_f16(65520.0f), 0x7c00);
    CU_ASSERT_EQUAL(kf_f32_to_f16(0x1p-24f), 0x0001);
    CU_ASSERT_EQUAL(kf_f32_to_f16(0x1p-25f), 0x0000); /* tie to even */
    CU_ASSERT_EQUAL(kf_f32_to_f16(0x1.8p-25f), 0x0001);
    CU_ASSERT_EQUAL(kf_f32_to_f16(0x1.ffcp-15f), 0x0400);    /* rounds up into the normals */
    CU_ASSERT_EQUAL(kf_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
    CU_ASSERT_EQUAL(kf_f32_to_f16(1.0f + 0x1.8p-10f), 0x3c02);
    CU_ASSERT_EQUAL(kf_f32_to_f16(-0.0f), 0x8000);
    CU_ASSERT_EQUAL(kf_f32_to_f16(INFINITY), 0x7c00);
    CU_ASSERT((kf_f32_to_f16(NAN) & 0x7c00) == 0x7c00 && (kf_f32_to_f16(NAN) & 0x3ff) != 0);
    CU_ASSERT_EQUAL(kf_f32_to_bf16(1.0f), 0x3f80);
    CU_ASSERT_EQUAL(kf_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); /* tie to even */
    CU_ASSERT_EQUAL(kf_f32_to_bf16(1.0f + 0x1.8p-7f), 0x3f82);
    CU_ASSERT(isnan(kf_bf16_to_f32(kf_f32_to_bf16(NAN))));
    int bad16 = 0, badbf = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        float x = kf_f16_to_f32((uint16_t)b);
        if (!isnan(x) && kf_f32_to_f16(x) != b)
            bad16++;
        float y = kf_bf16_to_f32((uint16_t)b);
        if (!isnan(y) && kf_f32_to_bf16(y) != b)
            badbf++;
    }
    CU_ASSERT_EQUAL(bad16, 0);
    CU_ASSERT_EQUAL(badbf, 0);
    CU_ASSERT_EQUAL(kf_f16_to_f32(0x0001), 0x1p-24f);
    CU_ASSERT_EQUAL(kf_f16_to_f32(0x7bff), 65504.0f);
}

static void test_names_paths_digests(void) {
    char b[32], p[4096], d1[33], d2[33], d3[33];
    kvf_format_budget(0.1, b, sizeof b);
    CU_ASSERT_STRING_EQUAL(b, "0.1");
    kvf_format_budget(0.25, b, sizeof b);
    CU_ASSERT_STRING_EQUAL(b, "0.25");
    kvf_format_budget(1.0, b, sizeof b);
    CU_ASSERT_STRING_EQUAL(b, "1");
    kvf_format_budget(1.0 / 3, b, sizeof b);
    CU_ASSERT_EQUAL(strtod(b, NULL), 1.0 / 3);
    int32_t ids[4] = {1, 2, 3, 0};
    kvf_document_digest(ids, 3, d1);
    kvf_document_digest(ids, 4, d2); /* an extra token 0 changes the digest */
    kvf_document_digest(ids, 3, d3);
    CU_ASSERT_EQUAL(strlen(d1), 32);
    CU_ASSERT_STRING_NOT_EQUAL(d1, d2);
    CU_ASSERT_STRING_EQUAL(d1, d3);
    const char *root = kf_test_make_dir("paths");
    char rootcopy[1024];
    snprintf(rootcopy, sizeof rootcopy, "%s/deep/root/", root);
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kvf_cache_path(rootcopy, kFp, d1, KF_METHOD_FOLD, 0.1, kOtherFp, true, p, sizeof p, &err),
                          KF_OK);
    char want[4096];
    snprintf(want, sizeof want, "%s/deep/root/%s/%s.fold-0.1.fedcba9876543210.kvf", root, kFp, d1);
    CU_ASSERT_STRING_EQUAL(p, want);
    struct stat sb;
    snprintf(want, sizeof want, "%s/deep/root/%s", root, kFp);
    CU_ASSERT(stat(want, &sb) == 0 && S_ISDIR(sb.st_mode));
    CU_ASSERT_EQUAL(kvf_cache_path(root, "nothex", d1, KF_METHOD_AM, 0.1, kFp, false, p, sizeof p, &err),
                    KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "nothex"));
    CU_ASSERT(kvf_is_temp_name("/a/b/x.fold-0.1.kvf.tmp-123-0123456789abcdef"));
    CU_ASSERT(!kvf_is_temp_name("/a/b/x.fold-0.1.kvf"));
    CU_ASSERT(!kvf_is_temp_name("x.tmp-12-0123456789abcde"));
    CU_ASSERT(!kvf_is_temp_name("x.tmp-12-0123456789abcdef.kvf"));
    kf_method m;
    kf_dtype dt;
    CU_ASSERT(kf_method_parse("am", &m) == 0 && m == KF_METHOD_AM);
    CU_ASSERT(kf_method_parse("xx", &m) != 0);
    CU_ASSERT(kvf_dtype_parse("bf16", &dt) == 0 && dt == KF_DTYPE_BF16);
    CU_ASSERT(kvf_dtype_parse("float16", &dt) == 0 && dt == KF_DTYPE_F16);
}

/* ---- round trips ---- */

static void test_round_trip_every_method_and_dtype(void) {
    static const kf_dtype dts[] = {KF_DTYPE_BF16, KF_DTYPE_F16, KF_DTYPE_F32};
    int cases = 0;
    for (int m = KF_METHOD_KEEP; m <= KF_METHOD_FOLD; m++)
        for (int di = 0; di < 3; di++) {
            int64_t C = (m + di) % 2 ? 37 : 5; /* partial last block; a single short block */
            synth s;
            synth_make(&s, 3, 2, 8, C, dts[di], (kf_method)m, 100 + (uint64_t)(m * 3 + di));
            const char *path = cache_file("rt", &s);
            write_ok(path, &s);
            CU_ASSERT(kvf_exists_valid(path, kFp, NULL));
            kvf_file *f = open_ok(path);
            const kvf_header *h = kvf_file_header(f), *w = &s.c.hdr;
            CU_ASSERT_EQUAL(h->version, KVF_VERSION);
            CU_ASSERT_STRING_EQUAL(h->model_fingerprint, w->model_fingerprint);
            CU_ASSERT_STRING_EQUAL(h->document_digest, w->document_digest);
            CU_ASSERT_STRING_EQUAL(h->tokenizer_digest, "");
            CU_ASSERT_STRING_EQUAL(h->creator, w->creator);
            CU_ASSERT_STRING_EQUAL(h->placeholder, w->placeholder);
            CU_ASSERT(h->method == w->method && h->dtype == w->dtype && h->rope_frame == w->rope_frame);
            CU_ASSERT(h->n_doc_tokens == w->n_doc_tokens && h->n_tokens == C && h->block_size == 16);
            CU_ASSERT(h->budget == w->budget && h->lambda == w->lambda);
            CU_ASSERT(h->n_layers == 3 && h->kv_heads == 2 && h->head_dim == 8);
            CU_ASSERT(check_contents(f, &s));
            kf_error err = {0};
            CU_ASSERT_EQUAL(kvf_verify(f, &err), KF_OK);
            CU_ASSERT_EQUAL(kvf_check_model(f, kFp, 3, 2, 8, &err), KF_OK);
            kvf_close(f);
            synth_free(&s);
            cases++;
        }
    CU_ASSERT_EQUAL(cases, 12);
}

static void test_raw_input_and_defaults(void) {
    synth s;
    synth_make(&s, 2, 1, 4, 20, KF_DTYPE_BF16, KF_METHOD_KEEP, 7);
    size_t n = 2 * 20 * 4;
    uint16_t *rk = malloc(n * 2), *rv = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        rk[i] = kf_f32_to_bf16(s.keys[i]);
        rv[i] = kf_f32_to_bf16(s.values[i]);
    }
    s.c.keys = s.c.values = NULL;
    s.c.keys_raw = rk;
    s.c.values_raw = rv;
    s.c.beta = s.c.u = NULL;
    s.c.positions = NULL;
    snprintf(s.c.hdr.tokenizer_digest, sizeof s.c.hdr.tokenizer_digest, "%s", kOtherFp);
    const char *path = cache_file("raw", &s);
    write_ok(path, &s);
    kvf_file *f = open_ok(path);
    uint16_t *back = malloc(20 * 4 * 2);
    float beta[20], pos_f[20];
    int32_t pos[20];
    kf_error err = {0};
    CU_ASSERT_EQUAL(kvf_read_layer_raw(f, 1, KVF_VALUES, back, &err), KF_OK);
    CU_ASSERT(memcmp(back, rv + 80, 160) == 0);
    CU_ASSERT_EQUAL(kvf_read_beta(f, 1, beta, &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_read_u(f, 0, pos_f, &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_read_positions(f, 1, pos, &err), KF_OK);
    int zeros = 1, ident = 1;
    for (int j = 0; j < 20; j++) {
        zeros &= beta[j] == 0;
        ident &= pos[j] == j;
    }
    for (int j = 0; j < 4; j++)
        zeros &= pos_f[j] == 0;
    CU_ASSERT(zeros && ident);
    CU_ASSERT_STRING_EQUAL(kvf_file_header(f)->tokenizer_digest, kOtherFp);
    /* bad arguments are statuses */
    CU_ASSERT_EQUAL(kvf_read_layer_raw(f, 2, KVF_KEYS, back, &err), KF_ERR_INVALID);
    CU_ASSERT_EQUAL(kvf_read_block_raw(f, 0, 2, KVF_KEYS, back, NULL, &err), KF_ERR_INVALID);
    kvf_close(f);
    /* writer refusals */
    synth bad;
    synth_make(&bad, 1, 1, 4, 4, KF_DTYPE_F32, KF_METHOD_AM, 8);
    bad.c.hdr.model_fingerprint[3] = 'X';
    CU_ASSERT_EQUAL(kvf_write(path, &bad.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "model_fingerprint"));
    CU_ASSERT(kvf_exists_valid(path, NULL, NULL)); /* the earlier file is untouched */
    synth_free(&bad);
    free(rk);
    free(rv);
    free(back);
    synth_free(&s);
}

/* ---- refusals ---- */

static char *slurp(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    fseek(fp, 0, SEEK_END);
    *n = (size_t)ftell(fp);
    rewind(fp);
    char *b = malloc(*n + 1);
    CU_ASSERT_EQUAL_FATAL(fread(b, 1, *n, fp), *n);
    fclose(fp);
    return b;
}

static kf_status open_status(const char *path, kf_error *err) {
    kvf_file *f = NULL;
    kf_status st = kvf_open(path, &f, err);
    kvf_close(f);
    return st;
}

static void test_refuses_another_model(void) {
    synth s;
    synth_make(&s, 2, 2, 8, 16, KF_DTYPE_BF16, KF_METHOD_FOLD, 11);
    const char *path = cache_file("model", &s);
    write_ok(path, &s);
    kvf_file *f = open_ok(path);
    kf_error err = {0};
    CU_ASSERT_EQUAL(kvf_check_model(f, kOtherFp, 2, 2, 8, &err), KF_ERR_MISMATCH);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, kFp));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, kOtherFp));
    show(&err);
    CU_ASSERT_EQUAL(kvf_check_model(f, kFp, 2, 4, 8, &err), KF_ERR_MISMATCH);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "kv heads"));
    CU_ASSERT_EQUAL(kvf_check_model(f, kFp, -1, -1, -1, &err), KF_OK);
    kvf_close(f);
    CU_ASSERT(!kvf_exists_valid(path, kOtherFp, NULL));
    synth_free(&s);
}

static void test_refuses_truncated_file(void) {
    synth s;
    synth_make(&s, 2, 2, 8, 40, KF_DTYPE_F16, KF_METHOD_AM, 12);
    const char *path = cache_file("trunc", &s);
    write_ok(path, &s);
    size_t n;
    char *bytes = slurp(path, &n);
    const size_t cuts[] = {n - 1, n - 100, n / 2, 600, 8, 0};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "cut-%zu.kvf", i);
        const char *t = kf_test_write_file(name, bytes, cuts[i]);
        kf_error err = {0};
        kf_status st = open_status(t, &err);
        show(&err);
        CU_ASSERT_EQUAL(st, KF_ERR_FORMAT);
        if (cuts[i] > 600)
            CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, ": truncated file"));
        if (st != KF_ERR_FORMAT || (cuts[i] > 600 && !strstr(err.msg, ": truncated file")))
            fprintf(stderr, "cut %zu of %zu: %s\n", cuts[i], n, err.msg);
        CU_ASSERT(!kvf_exists_valid(t, NULL, NULL));
    }
    free(bytes);
    synth_free(&s);
}

static void test_refuses_flipped_byte_in_a_chunk(void) {
    synth s;
    synth_make(&s, 4, 2, 8, 50, KF_DTYPE_BF16, KF_METHOD_FOLD, 13);
    const char *path = cache_file("flip", &s);
    write_ok(path, &s);
    /* where HDF5 put the chunk of keys for layer 3, head 1 (all 50 slots) */
    hid_t fid = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(fid, "keys", H5P_DEFAULT);
    hsize_t coord[4] = {3, 0, 1, 0};
    unsigned mask = 0;
    haddr_t addr = 0;
    hsize_t size = 0;
    CU_ASSERT_FATAL(H5Dget_chunk_info_by_coord(d, coord, &mask, &addr, &size) >= 0);
    H5Dclose(d);
    H5Fclose(fid);
    CU_ASSERT_EQUAL_FATAL(size, 50 * 8 * 2 + 4); /* [C, head_dim] bf16 + the Fletcher32 sum */
    FILE *fp = fopen(path, "r+b");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    fseek(fp, (long)addr + 37, SEEK_SET);
    int c = fgetc(fp);
    fseek(fp, (long)addr + 37, SEEK_SET);
    fputc(c ^ 0x10, fp);
    fclose(fp);

    kvf_file *f = open_ok(path); /* metadata is intact */
    float *buf = malloc(50 * 2 * 8 * 4);
    kf_error err = {0};
    CU_ASSERT_EQUAL(kvf_read_layer(f, 3, KVF_KEYS, buf, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "checksum mismatch in keys, layer 3 head 1"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
    show(&err);
    memset(&err, 0, sizeof err);
    /* a block holds every head: the whole layer is read and refused, for any block */
    CU_ASSERT_EQUAL(kvf_read_block(f, 3, 0, KVF_KEYS, buf, NULL, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "checksum mismatch in keys, layer 3 head 1"));
    int nt = 0;
    CU_ASSERT_EQUAL(kvf_read_block(f, 2, 3, KVF_KEYS, buf, &nt, &err), KF_OK); /* layer 2 is fine */
    CU_ASSERT_EQUAL(nt, 2);
    /* a rank serving head 0 reads only head 0's chunks, verified by head 0's digest */
    uint16_t *k = malloc(50 * 2 * 8 * 2), *v = malloc(50 * 2 * 8 * 2); /* [C, H, D] bf16 */
    const int64_t before = kvf_kv_bytes_read(f);
    CU_ASSERT_EQUAL(kvf_read_heads_raw(f, 3, 0, 1, k, v, &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_kv_bytes_read(f) - before, 2 * (50 * 8 * 2 + 4));
    CU_ASSERT_EQUAL(k[(7 * 2 + 0) * 8 + 5], kf_f32_to_bf16(s.keys[((3 * 50 + 7) * 2 + 0) * 8 + 5]));
    CU_ASSERT_EQUAL(v[(49 * 2 + 0) * 8 + 7], kf_f32_to_bf16(s.values[((3 * 50 + 49) * 2 + 0) * 8 + 7]));
    /* head-major, in place: head 0 at [0], nothing written past it (its sum goes aside) */
    memset(k, 0xab, 50 * 2 * 8 * 2);
    memset(v, 0xab, 50 * 2 * 8 * 2);
    CU_ASSERT_EQUAL(kvf_read_heads_hm(f, 3, 0, 1, k, v, &err), KF_OK);
    CU_ASSERT_EQUAL(k[7 * 8 + 5], kf_f32_to_bf16(s.keys[((3 * 50 + 7) * 2 + 0) * 8 + 5]));
    CU_ASSERT_EQUAL(v[49 * 8 + 7], kf_f32_to_bf16(s.values[((3 * 50 + 49) * 2 + 0) * 8 + 7]));
    CU_ASSERT(k[50 * 8] == 0xabab && v[50 * 8] == 0xabab && k[50 * 8 + 1] == 0xabab);
    CU_ASSERT_EQUAL(kvf_read_heads_hm(f, 2, 1, 2, k, v, &err), KF_OK); /* head 1 at [1], head 0 kept */
    CU_ASSERT_EQUAL(k[50 * 8 + 9 * 8 + 2], kf_f32_to_bf16(s.keys[((2 * 50 + 9) * 2 + 1) * 8 + 2]));
    CU_ASSERT_EQUAL(k[7 * 8 + 5], kf_f32_to_bf16(s.keys[((3 * 50 + 7) * 2 + 0) * 8 + 5]));
    CU_ASSERT_EQUAL(kvf_read_heads_raw(f, 3, 1, 2, k, v, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "checksum mismatch in keys, layer 3 head 1"));
    CU_ASSERT_EQUAL(kvf_read_heads_raw(f, 3, 1, 3, k, v, &err), KF_ERR_INVALID);
    free(k);
    free(v);
    /* a full read of layer 3 reads its keys too; layer 2 is fine */
    CU_ASSERT_EQUAL(kvf_read_layer(f, 3, KVF_VALUES, buf, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "checksum mismatch in keys, layer 3 head 1"));
    CU_ASSERT_EQUAL(kvf_read_layer(f, 2, KVF_VALUES, buf, &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_verify(f, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "checksum mismatch"));
    kvf_close(f);
    free(buf);
    synth_free(&s);
}

/* kvf_fletcher32 against what HDF5's filter stores: each case is one chunk of a uint8 dataset,
 * read back raw with H5Dread_chunk (data then the 4-byte sum). */
static void test_fletcher32_matches_hdf5(void) {
    enum { BIG = 300001 }; /* odd, and past the folding points of both implementations */
    unsigned char *big = malloc(BIG + 4);
    CU_ASSERT_PTR_NOT_NULL_FATAL(big);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < BIG; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        big[i] = (unsigned char)x;
    }
    static unsigned char ones[BIG];
    memset(ones, 0xff, sizeof ones);
    static const unsigned char ffff[2] = {0xff, 0xff}, zeros[64] = {0}, one[3] = {1, 2, 3};
    const struct {
        const unsigned char *p;
        size_t n;
    } cases[] = {{big, 4096}, {big, 4097}, {big, BIG}, {ones, BIG}, {ones, 1000},
                 {ffff, 2},   {zeros, 64}, {one, 3},   {one, 1},    {big + 1, 32768}};
    const char *path = kf_test_write_file("fletcher.h5", "", 0);
    hid_t fid = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    CU_ASSERT_FATAL(fid >= 0);
    unsigned char *raw = malloc(BIG + 8);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        hsize_t n = cases[c].n, zero = 0;
        hid_t sp = H5Screate_simple(1, &n, NULL), dcpl = H5Pcreate(H5P_DATASET_CREATE);
        H5Pset_chunk(dcpl, 1, &n);
        H5Pset_fletcher32(dcpl);
        char name[16];
        snprintf(name, sizeof name, "d%zu", c);
        hid_t d = H5Dcreate2(fid, name, H5T_NATIVE_UCHAR, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
        CU_ASSERT_FATAL(d >= 0);
        CU_ASSERT(H5Dwrite(d, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, cases[c].p) >= 0);
        H5Dflush(d);
        hsize_t stored = 0;
        uint32_t mask = 1;
        CU_ASSERT(H5Dget_chunk_storage_size(d, &zero, &stored) >= 0);
        CU_ASSERT_EQUAL_FATAL(stored, n + 4);
        CU_ASSERT_FATAL(H5Dread_chunk(d, H5P_DEFAULT, &zero, &mask, raw) >= 0);
        CU_ASSERT_EQUAL(mask, 0);
        CU_ASSERT(memcmp(raw, cases[c].p, n) == 0);
        const unsigned char *t = raw + n;
        uint32_t stored_sum = (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
        uint32_t mine = kvf_fletcher32(cases[c].p, n);
        CU_ASSERT_EQUAL(mine, stored_sum);
        if (mine != stored_sum)
            fprintf(stderr, "case %zu (%llu bytes): HDF5 stored %08x, kvf_fletcher32 %08x\n", c, (unsigned long long)n,
                    stored_sum, mine);
        H5Dclose(d);
        H5Pclose(dcpl);
        H5Sclose(sp);
    }
    H5Fclose(fid);
    free(raw);
    free(big);
}

/* The direct chunk reads against HDF5's H5Dread of the same slots, into buffers of the exact size
 * (the sanitizer build sees any write past them): a tiny row (one bf16) with a one-slot last block,
 * whose chunk sum must not spill into out, and an ordinary shape. */
static void test_direct_reads_match_h5dread(void) {
    const struct {
        int H, D;
        int64_t C;
        kf_dtype dt;
    } shapes[] = {
        {1, 1, 17, KF_DTYPE_BF16}, {1, 1, 33, KF_DTYPE_F16}, {2, 8, 37, KF_DTYPE_F32}, {1, 2, 16, KF_DTYPE_BF16}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        synth s;
        synth_make(&s, 2, shapes[k].H, shapes[k].D, shapes[k].C, shapes[k].dt, KF_METHOD_AM, 300 + k);
        const char *path = cache_file("direct", &s);
        write_ok(path, &s);
        const size_t row = (size_t)shapes[k].H * (size_t)shapes[k].D * kf_dtype_size(shapes[k].dt),
                     lb = (size_t)shapes[k].C * row;
        unsigned char *want = malloc(lb), *got = malloc(lb), *blk = malloc(16 * row);
        hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
        H5Pset_file_locking(fapl, 0, 1); /* as kvf_open, which the same process does too */
        hid_t fid = H5Fopen(path, H5F_ACC_RDONLY, fapl);
        H5Pclose(fapl);
        kvf_file *f = open_ok(path);
        for (int w = 0; w < 2; w++)
            for (int l = 0; l < 2; l++) {
                hid_t d = H5Dopen2(fid, w ? "values" : "keys", H5P_DEFAULT), t = H5Dget_type(d);
                hid_t fs = H5Dget_space(d);
                hsize_t start[4] = {(hsize_t)l, 0, 0, 0},
                        count[4] = {1, (hsize_t)shapes[k].C, (hsize_t)shapes[k].H, (hsize_t)shapes[k].D};
                hid_t ms = H5Screate_simple(4, count, NULL);
                H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL);
                CU_ASSERT(H5Dread(d, t, ms, fs, H5P_DEFAULT, want) >= 0);
                H5Sclose(ms);
                H5Sclose(fs);
                H5Tclose(t);
                H5Dclose(d);
                kf_error err = {0};
                kvf_which which = w ? KVF_VALUES : KVF_KEYS;
                CU_ASSERT_EQUAL(kvf_read_layer_raw(f, l, which, got, &err), KF_OK);
                CU_ASSERT(memcmp(got, want, lb) == 0);
                for (int64_t b = 0; b < kvf_n_blocks(f); b++) {
                    int nt = 0;
                    CU_ASSERT_EQUAL(kvf_read_block_raw(f, l, b, which, blk, &nt, &err), KF_OK);
                    CU_ASSERT(nt == (shapes[k].C - 16 * b < 16 ? shapes[k].C - 16 * b : 16));
                    CU_ASSERT(memcmp(blk, want + (size_t)b * 16 * row, (size_t)nt * row) == 0);
                }
            }
        kf_error err = {0};
        CU_ASSERT_EQUAL(kvf_verify(f, &err), KF_OK);
        kvf_close(f);
        H5Fclose(fid);
        free(want);
        free(got);
        free(blk);
        synth_free(&s);
    }
}

/* Edits a valid file with HDF5 directly. */
static const char *edited_copy(const char *dirname, int what) {
    synth s;
    synth_make(&s, 2, 2, 8, 16, KF_DTYPE_F32, KF_METHOD_AM, 14);
    const char *path = cache_file(dirname, &s);
    write_ok(path, &s);
    synth_free(&s);
    hid_t fid = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(fid >= 0);
    if (what == 0) {
        hid_t a = H5Aopen(fid, "version", H5P_DEFAULT);
        int64_t v = 3;
        CU_ASSERT(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
        H5Aclose(a);
    } else if (what == 1) {
        CU_ASSERT(H5Ldelete(fid, "u", H5P_DEFAULT) >= 0);
    } else if (what == 2) {
        CU_ASSERT(H5Adelete(fid, "document_digest") >= 0);
    } else {
        hid_t a = H5Aopen(fid, "n_tokens", H5P_DEFAULT);
        int64_t v = 17;
        CU_ASSERT(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
        H5Aclose(a);
    }
    H5Fclose(fid);
    return path;
}

static void test_refuses_unknown_version_and_missing_parts(void) {
    kf_error err = {0};
    CU_ASSERT_EQUAL(open_status(edited_copy("version", 0), &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "kvf version 3 is not supported"));
    show(&err);
    CU_ASSERT_EQUAL(open_status(edited_copy("missing", 1), &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "missing dataset 'u'"));
    show(&err);
    CU_ASSERT_EQUAL(open_status(edited_copy("noattr", 2), &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "missing attribute 'document_digest'"));
    show(&err);
    CU_ASSERT_EQUAL(open_status(edited_copy("shape", 3), &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "dataset 'keys' has shape [2, 16, 2, 8], the header implies [2, 17, 2, 8]"));
    show(&err);
    const char *junk = kf_test_write_file("junk.kvf", "not hdf5 at all, just text\n", 28);
    CU_ASSERT_EQUAL(open_status(junk, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "junk.kvf"));
    show(&err);
    CU_ASSERT_EQUAL(open_status("/nonexistent/x.kvf", &err), KF_ERR_NOTFOUND);
    /* an HDF5 file that is not a cache */
    char other[1024];
    snprintf(other, sizeof other, "%s/plain.h5", kf_test_make_dir("plain"));
    hid_t fid = H5Fcreate(other, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(fid);
    CU_ASSERT_EQUAL(open_status(other, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "not a kvfold cache file"));
    show(&err);
}

/* ---- killed writers and concurrent writers ---- */

static void count_temp(void *ctx, const char *path, double age) {
    (void)path;
    (void)age;
    ++*(int *)ctx;
}

static void test_killed_writer_leaves_only_a_temp_file(void) {
    /* a complete file under a temporary name is still never a cache */
    synth s;
    synth_make(&s, 2, 2, 8, 16, KF_DTYPE_BF16, KF_METHOD_FOLD, 15);
    const char *p = cache_file("killed", &s);
    char final[4096], tmp[4200];
    snprintf(final, sizeof final, "%s", p);
    snprintf(tmp, sizeof tmp, "%s.tmp-4242-0123456789abcdef", final);
    kf_error err = {0};
    CU_ASSERT_EQUAL(kvf_write(tmp, &s.c, &err), KF_ERR_INVALID); /* never written under a temp name */
    CU_ASSERT(access(tmp, F_OK) != 0);
    write_ok(final, &s);
    CU_ASSERT_EQUAL(rename(final, tmp), 0);
    CU_ASSERT(!kvf_exists_valid(final, NULL, NULL));
    CU_ASSERT(!kvf_exists_valid(tmp, NULL, NULL));
    CU_ASSERT_EQUAL(open_status(tmp, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "temporary"));
    show(&err);
    char root[1024];
    snprintf(root, sizeof root, "%s", kf_test_make_dir("killed"));
    int n = 0, seen = 0;
    CU_ASSERT_EQUAL(kvf_clean_temps(root, 3600, false, NULL, NULL, &n, &err), KF_OK);
    CU_ASSERT_EQUAL(n, 0); /* too young */
    CU_ASSERT_EQUAL(kvf_clean_temps(root, 0, true, count_temp, &seen, &n, &err), KF_OK);
    CU_ASSERT(n == 1 && seen == 1 && access(tmp, F_OK) == 0); /* dry run */
    CU_ASSERT_EQUAL(kvf_clean_temps(root, 0, false, NULL, NULL, &n, &err), KF_OK);
    CU_ASSERT(n == 1 && access(tmp, F_OK) != 0);
    synth_free(&s);

    /* a real writer killed while its temporary file exists */
    synth big;
    synth_make(&big, 8, 8, 64, 1024, KF_DTYPE_F32, KF_METHOD_FOLD, 16); /* 33 MB of keys and values */
    int killed_midway = 0;
    for (int attempt = 0; attempt < 5 && !killed_midway; attempt++) {
        char fin[4096];
        snprintf(fin, sizeof fin, "%s/killed-%d.kvf", root, attempt);
        pid_t pid = fork();
        CU_ASSERT_FATAL(pid >= 0);
        if (pid == 0) {
            kf_error e = {0};
            _exit(kvf_write(fin, &big.c, &e) == KF_OK ? 0 : 1);
        }
        int found = 0;
        for (int spin = 0; spin < 20000 && !found; spin++) {
            int c2 = 0;
            kvf_clean_temps(root, -1e9, true, count_temp, &c2, NULL, NULL);
            found = c2 > 0;
            if (!found)
                usleep(100);
        }
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        if (found && WIFSIGNALED(status)) {
            killed_midway = 1;
            CU_ASSERT(access(fin, F_OK) != 0); /* the final name never appeared */
            CU_ASSERT(!kvf_exists_valid(fin, NULL, NULL));
            CU_ASSERT_EQUAL(kvf_clean_temps(root, 0, false, NULL, NULL, &n, &err), KF_OK);
            CU_ASSERT_EQUAL(n, 1);
        }
        unlink(fin);
    }
    CU_ASSERT(killed_midway);
    synth_free(&big);
}

static void test_concurrent_writers_never_expose_a_partial_file(void) {
    enum { N_WRITES = 12 };
    synth s[2];
    synth_make(&s[0], 4, 2, 32, 200, KF_DTYPE_BF16, KF_METHOD_FOLD, 21);
    synth_make(&s[1], 4, 2, 32, 200, KF_DTYPE_BF16, KF_METHOD_FOLD, 22);
    /* same name for both: same fingerprint, digest, method and budget */
    memcpy(s[1].c.hdr.document_digest, s[0].c.hdr.document_digest, sizeof s[0].c.hdr.document_digest);
    char path[4096];
    snprintf(path, sizeof path, "%s", cache_file("concurrent", &s[0]));
    pid_t pids[2];
    for (int i = 0; i < 2; i++) {
        pids[i] = fork();
        CU_ASSERT_FATAL(pids[i] >= 0);
        if (pids[i] == 0) {
            int bad = 0;
            for (int r = 0; r < N_WRITES; r++) {
                kf_error e = {0};
                bad |= kvf_write(path, &s[i].c, &e) != KF_OK;
            }
            _exit(bad);
        }
    }
    int observed = 0, bad = 0, done = 0, status[2] = {0, 0}, exited[2] = {0, 0};
    while (done < 2) {
        kvf_file *f = NULL;
        kf_error err = {0};
        if (access(path, F_OK) == 0) {
            if (kvf_open(path, &f, &err) != KF_OK) {
                fprintf(stderr, "observation %d: %s\n", observed, err.msg);
                bad++;
            } else {
                const char *ph = kvf_file_header(f)->creator;
                int who = strcmp(ph, "kvfold seed-21") == 0 ? 0 : strcmp(ph, "kvfold seed-22") == 0 ? 1 : -1;
                if (who < 0 || !check_contents(f, &s[who]))
                    bad++;
                kvf_close(f);
                observed++;
            }
        }
        for (int i = 0; i < 2; i++)
            if (!exited[i] && waitpid(pids[i], &status[i], WNOHANG) == pids[i]) {
                exited[i] = 1;
                done++;
            }
    }
    for (int i = 0; i < 2; i++)
        CU_ASSERT(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0);
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(observed > 0);
    CU_ASSERT(kvf_exists_valid(path, kFp, NULL));
    int n = -1;
    char root[1024];
    snprintf(root, sizeof root, "%s", kf_test_make_dir("concurrent"));
    CU_ASSERT_EQUAL(kvf_clean_temps(root, -1e9, true, NULL, NULL, &n, NULL), KF_OK);
    CU_ASSERT_EQUAL(n, 0); /* no writer left a temporary file */
    fprintf(stderr, "  (%d observations of the final name, all complete)\n", observed);
    synth_free(&s[0]);
    synth_free(&s[1]);
}

/* A reader beside a writer that renames complete files of two sizes over one name (hard links of
 * two finished files: the name flips thousands of times a second): every open sees one whole file,
 * never one file's header against the other's size. */
static void test_rename_over_the_name_never_looks_truncated(void) {
    enum { N_LOADS = 10000 };
    synth s[2];
    synth_make(&s[0], 2, 1, 16, 16, KF_DTYPE_BF16, KF_METHOD_FOLD, 31);
    synth_make(&s[1], 2, 1, 16, 160, KF_DTYPE_BF16, KF_METHOD_FOLD, 32);
    char root[1024], src[2][1100], path[1100], tmp[1100];
    snprintf(root, sizeof root, "%s", kf_test_make_dir("renamed"));
    for (int i = 0; i < 2; i++) {
        snprintf(src[i], sizeof src[i], "%s/src%d.kvf", root, i);
        write_ok(src[i], &s[i]);
    }
    snprintf(path, sizeof path, "%s/name.kvf", root);
    snprintf(tmp, sizeof tmp, "%s/next.kvf", root);
    CU_ASSERT_EQUAL_FATAL(link(src[0], path), 0);
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) { /* the writer, until killed: a rename every 20 us or so, leaving the reader a core */
        for (unsigned i = 1;; i++) {
            if (link(src[i % 2], tmp) != 0 || rename(tmp, path) != 0)
                _exit(1);
            usleep(20);
        }
    }
    int bad = 0, seen[2] = {0, 0};
    for (int i = 0; i < N_LOADS; i++) {
        kvf_file *f = NULL;
        kf_error err = {0};
        kf_status st = kvf_open(path, &f, &err);
        if (st == KF_OK)
            st = kvf_verify(f, &err);
        if (st != KF_OK) {
            if (bad++ < 3)
                fprintf(stderr, "\n    load %d: %s", i, err.msg);
        } else {
            seen[kvf_file_header(f)->n_tokens == 160]++;
        }
        kvf_close(f);
    }
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    CU_ASSERT(WIFSIGNALED(status)); /* the writer was still renaming */
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(seen[0] > 0 && seen[1] > 0);
    fprintf(stderr, "  (%d loads: %d of the short file, %d of the long one, %d failed)\n", N_LOADS, seen[0], seen[1],
            bad);
    synth_free(&s[0]);
    synth_free(&s[1]);
}

/* h5py (python3-h5py, required: a missing h5py fails the test) reads the file: attributes
 * (fixed-length strings come back as bytes), bf16 as uint16, f16 as float16, head_method and
 * layer_digest. */
static void test_h5py_reads_the_file(void) {
    int have = system("/usr/bin/python3 -c 'import h5py' >/dev/null 2>&1");
    if (have != 0)
        fprintf(stderr, "  /usr/bin/python3 cannot import h5py: install python3-h5py\n");
    CU_ASSERT_EQUAL_FATAL(have, 0);
    for (int dt = KF_DTYPE_BF16; dt <= KF_DTYPE_F16; dt++) {
        synth s;
        synth_make(&s, 2, 2, 8, 20, (kf_dtype)dt, KF_METHOD_FOLD, 30 + (uint64_t)dt);
        char path[4096];
        snprintf(path, sizeof path, "%s", cache_file(dt == KF_DTYPE_BF16 ? "h5py-bf16" : "h5py-f16", &s));
        write_ok(path, &s);
        float want = dt == KF_DTYPE_BF16 ? kf_bf16_to_f32(kf_f32_to_bf16(s.keys[1 * 20 * 16 + 5 * 16 + 3]))
                                         : kf_f16_to_f32(kf_f32_to_f16(s.keys[1 * 20 * 16 + 5 * 16 + 3]));
        char cmd[8192];
        snprintf(cmd, sizeof cmd,
                 "/usr/bin/python3 - <<'EOF'\n"
                 "import h5py, numpy as np, sys\n"
                 "f = h5py.File('%s', 'r')\n"
                 "a = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}\n"
                 "assert a['format'] == 'kvfold-kvf' and a['version'] == 2 and a['method'] == 'fold', a\n"
                 "assert len(a['payload_digest']) == 32 and len(a['recipe_digest']) == 32, a\n"
                 "assert f['head_method'].shape == (2, 2) and (f['head_method'][:] == 3).all()\n"
                 "assert f['head_digest'].shape == (2, 2, 16)\n"
                 "k = f['keys']\n"
                 "assert k.shape == (2, 20, 2, 8) and k.chunks == (1, 20, 1, 8), (k.shape, k.chunks)\n"
                 "assert k.attrs['dtype'].decode() == a['dtype'] == '%s'\n"
                 "x = k[1, 5, 0, 3]\n"
                 "if a['dtype'] == 'bfloat16':\n"
                 "    assert k.dtype == np.uint16, k.dtype\n"
                 "    x = np.array([int(x) << 16], dtype=np.uint32).view(np.float32)[0]\n"
                 "else:\n"
                 "    assert k.dtype == np.float16, k.dtype\n"
                 "assert float(x) == float.fromhex('%a'), (float(x), '%a')\n"
                 "assert f['positions'].dtype == np.int32 and f['beta'].shape == (2, 2, 20)\n"
                 "EOF\n",
                 path, kf_dtype_name((kf_dtype)dt), (double)want, (double)want);
        CU_ASSERT_EQUAL(system(cmd), 0);
        synth_free(&s);
    }
}

/* ---- the model fingerprint cache ---- */

static int g_computed;
static void fake_compute(void *ctx, char out[33]) {
    g_computed++;
    snprintf(out, 33, "%s", (const char *)ctx);
}

static void copy_file(const char *from, const char *to_rel) {
    size_t n;
    char *b = slurp(from, &n);
    kf_test_write_file(to_rel, b, n);
    free(b);
}

static void test_fingerprint_cache(void) {
    char dir[1024], weights[1100], cached[1100], xdg[1024], path[1100];
    snprintf(dir, sizeof dir, "%s", kf_test_make_dir("fpmodel"));
    snprintf(path, sizeof path, "%s/config.json", kf_test_data("hf-qwen3-tiny"));
    copy_file(path, "fpmodel/config.json");
    snprintf(path, sizeof path, "%s/model.safetensors", kf_test_data("hf-qwen3-tiny"));
    copy_file(path, "fpmodel/model.safetensors");
    snprintf(weights, sizeof weights, "%s/model.safetensors", dir);
    snprintf(cached, sizeof cached, "%s/" KF_FINGERPRINT_FILE, dir);

    /* the model computes once and leaves the cache in its (writable) directory */
    kf_backend *b = kf_backend_cpu_create();
    kf_model *m = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, dir, b, &err), KF_OK);
    char fp[33];
    snprintf(fp, sizeof fp, "%s", kf_model_fingerprint(m));
    kf_model_free(m);
    CU_ASSERT_EQUAL(strlen(fp), 32);
    size_t n;
    char *text = slurp(cached, &n);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, fp));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "file model.safetensors "));
    free(text);

    /* a hit gives the same fingerprint without computing */
    const char *files[1] = {weights};
    char out[33];
    bool hit = false;
    g_computed = 0;
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir, files, 1, fake_compute, "ffffffffffffffffffffffffffffffff", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(hit && g_computed == 0);
    CU_ASSERT_STRING_EQUAL(out, fp);

    /* touching a weight file invalidates it */
    struct timespec ts[2] = {{.tv_sec = 1700000000, .tv_nsec = 5}, {.tv_sec = 1700000000, .tv_nsec = 5}};
    CU_ASSERT_EQUAL(utimensat(AT_FDCWD, weights, ts, 0), 0);
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir, files, 1, fake_compute, "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(!hit && g_computed == 1);
    CU_ASSERT_STRING_EQUAL(out, "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee");
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir, files, 1, fake_compute, "dddddddddddddddddddddddddddddddd", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(hit && g_computed == 1);
    CU_ASSERT_STRING_EQUAL(out, "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee");
    /* so does touching config.json; a fresh model recomputes the real value */
    snprintf(path, sizeof path, "%s/config.json", dir);
    CU_ASSERT_EQUAL(utimensat(AT_FDCWD, path, ts, 0), 0);
    CU_ASSERT_EQUAL_FATAL(kf_model_load(&m, dir, b, &err), KF_OK);
    CU_ASSERT_STRING_EQUAL(kf_model_fingerprint(m), fp);
    kf_model_free(m);
    b->destroy(b);

    /* a directory that cannot take the file (here: the name is taken by a directory, which stops
     * root too) falls back to $XDG_CACHE_HOME/kvfold/fingerprints */
    char dir2[1024];
    snprintf(dir2, sizeof dir2, "%s", kf_test_make_dir("fpmodel-ro"));
    copy_file(weights, "fpmodel-ro/model.safetensors");
    snprintf(path, sizeof path, "%s/config.json", dir);
    copy_file(path, "fpmodel-ro/config.json");
    snprintf(path, sizeof path, "%s/" KF_FINGERPRINT_FILE, dir2);
    CU_ASSERT_EQUAL(mkdir(path, 0755), 0);
    snprintf(xdg, sizeof xdg, "%s", kf_test_make_dir("xdg"));
    char *old_xdg = getenv("XDG_CACHE_HOME") ? strdup(getenv("XDG_CACHE_HOME")) : NULL;
    setenv("XDG_CACHE_HOME", xdg, 1);
    snprintf(weights, sizeof weights, "%s/model.safetensors", dir2);
    g_computed = 0;
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir2, files, 1, fake_compute, "cccccccccccccccccccccccccccccccc", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(!hit && g_computed == 1);
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir2, files, 1, fake_compute, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(hit && g_computed == 1);
    CU_ASSERT_STRING_EQUAL(out, "cccccccccccccccccccccccccccccccc");
    snprintf(path, sizeof path, "%s/kvfold/fingerprints", xdg);
    struct stat sb;
    CU_ASSERT(stat(path, &sb) == 0 && S_ISDIR(sb.st_mode));
    if (old_xdg) {
        setenv("XDG_CACHE_HOME", old_xdg, 1);
        free(old_xdg);
    } else {
        unsetenv("XDG_CACHE_HOME");
    }
}

/* Waits until the coarse clock that stamps file times has moved, so the next change of a file
 * gets a ctime of its own (a wait for an event, nothing timed is asserted). */
static void next_clock_tick(void) {
    struct timespec t0, t;
    clock_gettime(CLOCK_REALTIME_COARSE, &t0);
    do {
        nanosleep(&(struct timespec){0, 1000000}, NULL);
        clock_gettime(CLOCK_REALTIME_COARSE, &t);
    } while (t.tv_sec == t0.tv_sec && t.tv_nsec == t0.tv_nsec);
}

/* Weights rewritten in place with their size and mtime kept (a byte changed, then the mtime set
 * back): the cache entry no longer matches, the fingerprint is computed again. */
static void test_fingerprint_cache_weights_changed_in_place(void) {
    char dir[1024], weights[1100], path[1100];
    snprintf(dir, sizeof dir, "%s", kf_test_make_dir("fpmodel-inplace"));
    snprintf(path, sizeof path, "%s/config.json", kf_test_data("hf-qwen3-tiny"));
    copy_file(path, "fpmodel-inplace/config.json");
    snprintf(path, sizeof path, "%s/model.safetensors", kf_test_data("hf-qwen3-tiny"));
    copy_file(path, "fpmodel-inplace/model.safetensors");
    snprintf(weights, sizeof weights, "%s/model.safetensors", dir);
    const char *files[1] = {weights};
    char out[33];
    bool hit = true;
    kf_error err = {0};
    g_computed = 0;
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir, files, 1, fake_compute, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(!hit && g_computed == 1);
    struct stat before, after;
    CU_ASSERT_EQUAL_FATAL(stat(weights, &before), 0);
    next_clock_tick();
    int fd = open(weights, O_RDWR);
    CU_ASSERT_FATAL(fd >= 0);
    unsigned char byte = 0;
    CU_ASSERT_EQUAL(pread(fd, &byte, 1, before.st_size - 1), 1);
    byte ^= 0x01;
    CU_ASSERT_EQUAL(pwrite(fd, &byte, 1, before.st_size - 1), 1);
    close(fd);
    const struct timespec keep[2] = {before.st_atim, before.st_mtim};
    CU_ASSERT_EQUAL(utimensat(AT_FDCWD, weights, keep, 0), 0);
    CU_ASSERT_EQUAL_FATAL(stat(weights, &after), 0);
    CU_ASSERT(after.st_size == before.st_size && after.st_mtim.tv_sec == before.st_mtim.tv_sec &&
              after.st_mtim.tv_nsec == before.st_mtim.tv_nsec); /* what the old key saw: unchanged */
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir, files, 1, fake_compute, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(!hit && g_computed == 2);
    CU_ASSERT_STRING_EQUAL(out, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb");
    /* a weight file replaced by another (a new inode) with the same size and mtime */
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s.new", weights);
    size_t n;
    char *bytes = slurp(weights, &n);
    FILE *f = fopen(tmp, "wb");
    CU_ASSERT_FATAL(f && fwrite(bytes, 1, n, f) == n);
    fclose(f);
    free(bytes);
    CU_ASSERT_EQUAL(utimensat(AT_FDCWD, tmp, keep, 0), 0);
    CU_ASSERT_EQUAL(rename(tmp, weights), 0);
    CU_ASSERT_EQUAL(kf_fingerprint_cached(dir, files, 1, fake_compute, "cccccccccccccccccccccccccccccccc", out, &hit, &err),
                    KF_OK);
    CU_ASSERT(!hit && g_computed == 3);
}

/* ---- identity: a file must be what its name and the job say ---- */

static void test_identity_and_name(void) {
    synth a, b;
    synth_make(&a, 2, 2, 8, 5, KF_DTYPE_BF16, KF_METHOD_FOLD, 31);
    synth_make(&b, 2, 2, 8, 5, KF_DTYPE_BF16, KF_METHOD_FOLD, 32); /* another document, same recipe */
    char path_a[4096], path_b[4096];
    snprintf(path_a, sizeof path_a, "%s", cache_file("ident", &a));
    snprintf(path_b, sizeof path_b, "%s", cache_file("ident", &b));
    const kvf_header *ha = &a.c.hdr;
    const kvf_identity want_a = {kFp,        ha->document_digest, ha->recipe_digest, KF_METHOD_FOLD,
                                 ha->budget, KF_DTYPE_BF16,       ha->n_doc_tokens};
    kf_error err = {0};
    CU_ASSERT_EQUAL(kvf_check_existing(path_a, &want_a, &err), KF_ERR_NOTFOUND);
    write_ok(path_a, &b); /* document B under A's name */
    CU_ASSERT(!kvf_exists_valid(path_a, kFp, ha->recipe_digest)); /* model and recipe pass, the name does not */
    CU_ASSERT_EQUAL(kvf_check_existing(path_a, &want_a, &err), KF_ERR_MISMATCH);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "holds document"));
    kvf_file *f = open_ok(path_a);
    CU_ASSERT_EQUAL(kvf_check_name(path_a, kvf_file_header(f), &err), KF_ERR_MISMATCH);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "the document differs"));
    CU_ASSERT_EQUAL(kvf_check_name(path_b, kvf_file_header(f), &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_check_name("/some/where/renamed.kvf", kvf_file_header(f), &err), KF_OK); /* no claim */
    kvf_close(f);
    write_ok(path_a, &a);
    CU_ASSERT_EQUAL(kvf_check_existing(path_a, &want_a, &err), KF_OK);
    /* each field of the identity on its own */
    kvf_identity w = want_a;
    w.method = KF_METHOD_AM;
    CU_ASSERT(kvf_check_existing(path_a, &w, &err) == KF_ERR_MISMATCH && strstr(err.msg, "method fold, not am"));
    w = want_a;
    w.budget = 0.5;
    CU_ASSERT(kvf_check_existing(path_a, &w, &err) == KF_ERR_MISMATCH && strstr(err.msg, "budget"));
    w = want_a;
    w.dtype = KF_DTYPE_F32;
    CU_ASSERT(kvf_check_existing(path_a, &w, &err) == KF_ERR_MISMATCH && strstr(err.msg, "float32"));
    w = want_a;
    w.n_doc_tokens = ha->n_doc_tokens + 1;
    CU_ASSERT(kvf_check_existing(path_a, &w, &err) == KF_ERR_MISMATCH && strstr(err.msg, "tokens"));
    w = want_a;
    w.recipe_digest = "aaaabbbbccccddddeeeeffff00001112";
    CU_ASSERT(kvf_check_existing(path_a, &w, &err) == KF_ERR_MISMATCH && strstr(err.msg, "recipe"));
    w = want_a;
    w.model_fingerprint = kOtherFp;
    CU_ASSERT(kvf_check_existing(path_a, &w, &err) == KF_ERR_MISMATCH && strstr(err.msg, "model"));
    /* a header whose method is not its name's (the recipe digest kept) */
    a.c.hdr.method = KF_METHOD_AM;
    a.c.hdr.lambda = 0;
    write_ok(path_a, &a);
    f = open_ok(path_a);
    CU_ASSERT(kvf_check_name(path_a, kvf_file_header(f), &err) == KF_ERR_MISMATCH && strstr(err.msg, "method differs"));
    kvf_close(f);
    CU_ASSERT_EQUAL(kvf_check_existing(path_a, &want_a, &err), KF_ERR_MISMATCH);
    synth_free(&a);
    synth_free(&b);
}

/* creator and placeholder: C1 controls and bidirectional overrides are refused on write (and by
 * readers, the same check); placeholder has one value. */
static void test_header_strings_refused(void) {
    synth s;
    synth_make(&s, 1, 1, 8, 3, KF_DTYPE_F32, KF_METHOD_KEEP, 41);
    const char *path = cache_file("strings", &s);
    kf_error err = {0};
    const char *creators[] = {"kvfold \xc2\x9b" "31m", "kvfold \xe2\x80\xae" "1.0", "kvfold\x1b[2J"};
    for (int i = 0; i < 3; i++) {
        snprintf(s.c.hdr.creator, sizeof s.c.hdr.creator, "%s", creators[i]);
        CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "creator or placeholder"));
    }
    kvf_header_init(&s.c.hdr);
    synth_free(&s);
    synth_make(&s, 1, 1, 8, 3, KF_DTYPE_F32, KF_METHOD_KEEP, 41);
    snprintf(s.c.hdr.placeholder, sizeof s.c.hdr.placeholder, "free-form");
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "placeholder 'free-form' is not \"digest\""));
    CU_ASSERT(access(path, F_OK) != 0); /* nothing written */
    synth_free(&s);
}

/* The chat record (optional attributes): read back as written, "" in a file without it, and bad
 * values refused by the writer. */
static void test_chat_record(void) {
    synth s;
    synth_make(&s, 1, 1, 8, 3, KF_DTYPE_F32, KF_METHOD_KEEP, 43);
    const char *path = cache_file("chat", &s);
    write_ok(path, &s);
    kvf_file *f = open_ok(path);
    const kvf_header *h = kvf_file_header(f);
    CU_ASSERT_STRING_EQUAL(h->chat_template_digest, "");
    CU_ASSERT_STRING_EQUAL(h->chat_question_suffix_ids, "");
    kvf_close(f);
    snprintf(s.c.hdr.chat_template_digest, sizeof s.c.hdr.chat_template_digest, "%s", kOtherFp);
    snprintf(s.c.hdr.chat_prefix_ids, sizeof s.c.hdr.chat_prefix_ids, "128000,128006,882,128007,271");
    snprintf(s.c.hdr.chat_question_prefix_ids, sizeof s.c.hdr.chat_question_prefix_ids, "7");
    snprintf(s.c.hdr.chat_question_suffix_ids, sizeof s.c.hdr.chat_question_suffix_ids, "2147483647,0");
    write_ok(path, &s);
    f = open_ok(path);
    h = kvf_file_header(f);
    CU_ASSERT_STRING_EQUAL(h->chat_template_digest, kOtherFp);
    CU_ASSERT_STRING_EQUAL(h->chat_prefix_ids, "128000,128006,882,128007,271");
    CU_ASSERT_STRING_EQUAL(h->chat_question_prefix_ids, "7");
    CU_ASSERT_STRING_EQUAL(h->chat_question_suffix_ids, "2147483647,0");
    int32_t ids[8];
    CU_ASSERT_EQUAL(kvf_parse_ids(h->chat_prefix_ids, ids, 8), 5);
    CU_ASSERT_EQUAL(ids[0], 128000);
    CU_ASSERT_EQUAL(ids[4], 271);
    CU_ASSERT_EQUAL(kvf_parse_ids(h->chat_prefix_ids, ids, 4), -1); /* more than cap */
    kvf_close(f);
    kf_error err = {0};
    const char *bad[] = {"1,,2", ",1", "1,", "2147483648", "-1", "1 2", "x"};
    for (int i = 0; i < 7; i++) {
        snprintf(s.c.hdr.chat_question_suffix_ids, sizeof s.c.hdr.chat_question_suffix_ids, "%s", bad[i]);
        CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "chat_question_suffix_ids"));
    }
    s.c.hdr.chat_template_digest[0] = 0; /* ids without a template */
    snprintf(s.c.hdr.chat_question_suffix_ids, sizeof s.c.hdr.chat_question_suffix_ids, "1");
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "without a chat_template_digest"));
    synth_free(&s);
}

static int clean(void) {
    H5close();
    return 0;
}

static CU_TestInfo tests[] = {
    {"f16/bf16 conversions round to nearest even", test_conversions},
    {"names, budgets, paths, digests", test_names_paths_digests},
    {"round trip of every method and dtype", test_round_trip_every_method_and_dtype},
    {"raw input, default side data, bad arguments", test_raw_input_and_defaults},
    {"refuses another model's file", test_refuses_another_model},
    {"refuses a truncated file", test_refuses_truncated_file},
    {"refuses a flipped byte inside a chunk", test_refuses_flipped_byte_in_a_chunk},
    {"Fletcher32 sums match HDF5's filter", test_fletcher32_matches_hdf5},
    {"direct chunk reads match H5Dread", test_direct_reads_match_h5dread},
    {"refuses unknown version, missing dataset/attribute, bad shape", test_refuses_unknown_version_and_missing_parts},
    {"a killed writer leaves only a temporary file", test_killed_writer_leaves_only_a_temp_file},
    {"concurrent writers never expose a partial file", test_concurrent_writers_never_expose_a_partial_file},
    {"a rename over the name never makes a complete file look truncated", test_rename_over_the_name_never_looks_truncated},
    {"h5py reads the file", test_h5py_reads_the_file},
    {"identity: every field, and the name against the header", test_identity_and_name},
    {"creator and placeholder: control characters and free-form values refused", test_header_strings_refused},
    {"chat record: read back, absent in older files, bad values refused", test_chat_record},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo fp_tests[] = {
    {"cache hit, invalidation by mtime, fallback to XDG_CACHE_HOME", test_fingerprint_cache},
    {"weights changed in place (size and mtime kept) or replaced: computed again",
     test_fingerprint_cache_weights_changed_in_place},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"kvf", NULL, NULL, NULL, NULL, tests},
                                {"model fingerprint cache", NULL, clean, NULL, NULL, fp_tests},
                                CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
