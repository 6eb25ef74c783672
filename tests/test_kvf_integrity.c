/* The kvf file against damage and crafted input: every case version 1 accepted although wrong
 * (chunks swapped between layers, a chunk stored with filter mask 1, a never-written chunk, an
 * all-zero chunk with a valid sum, NaN values or beta, positions outside [0, D), C > D, budget
 * above 1, huge claimed shapes in a small file, D = INT64_MAX, invalid UTF-8, a version-1 file,
 * variable-length strings) is refused with its cause named; hundreds of seeded 1-3 byte flips of a
 * fresh file (metadata included) each end as a clear refusal or a byte-identical read; a full disk
 * (RLIMIT_FSIZE) leaves no file and no HDF5 state that crashes at exit; the recipe identity and
 * head methods round-trip; the skip check reads the sums. */
#include <errno.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "compactor/recipe.h"
#include "formats/kvf.h"
#include "formats/kvf_internal.h"
#include "test_util.h"

static const char kFp[] = "0123456789abcdef0123456789abcdef";

/* LeakSanitizer: HDF5 1.10.8 itself leaks a few bytes on some damaged object headers (in
 * H5Aexists -> H5O_protect, seen under valgrind too); kvfold's own allocations stay checked. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) {
    return "leak:libhdf5_serial.so\n";
}

static const char kRecipe[] = "aaaabbbbccccddddeeeeffff00001111";

typedef struct {
    kvf_cache c;
    float *keys, *values, *beta, *u; /* [L, C, H, D] x2, [L, H, C], [L, H, D] */
    int32_t *pos;                    /* [L, H, C] */
    uint8_t *hm;                     /* [L, H] */
} synth;

static void synth_make(synth *s, int L, int H, int D, int64_t C, kf_dtype dt, uint64_t seed) {
    memset(s, 0, sizeof *s);
    kvf_header *h = &s->c.hdr;
    kvf_header_init(h);
    memcpy(h->model_fingerprint, kFp, sizeof kFp);
    memcpy(h->recipe_digest, kRecipe, sizeof kRecipe);
    int32_t ids[2] = {(int32_t)seed, 7};
    kvf_document_digest(ids, 2, h->document_digest);
    h->n_doc_tokens = 3 * C;
    h->n_tokens = C;
    h->method = KF_METHOD_AM;
    h->budget = 1.0 / 3;
    h->dtype = dt;
    h->n_layers = L;
    h->kv_heads = H;
    h->head_dim = D;
    const size_t nkv = (size_t)L * C * H * D, nb = (size_t)L * H * C, nu = (size_t)L * H * D;
    s->keys = malloc(nkv * 4);
    s->values = malloc(nkv * 4);
    s->beta = malloc(nb * 4);
    s->u = malloc(nu * 4);
    s->pos = malloc(nb * 4);
    s->hm = malloc((size_t)L * H);
    kf_test_fill_uniform(s->keys, nkv, seed, -3, 3);
    kf_test_fill_uniform(s->values, nkv, seed + 1, -1, 1);
    kf_test_fill_uniform(s->beta, nb, seed + 2, -2, 2);
    kf_test_fill_uniform(s->u, nu, seed + 3, -1, 1);
    for (size_t i = 0; i < nb; i++) {
        s->pos[i] = (i % 5 == 4) ? -1 : (int32_t)((i * 7) % (size_t)h->n_doc_tokens);
        if (s->pos[i] < 0)
            s->beta[i] = -INFINITY; /* AM's padding slot */
    }
    for (size_t i = 0; i < (size_t)L * H; i++)
        s->hm[i] = (uint8_t)(i % 3 == 2 ? KF_METHOD_DROP : KF_METHOD_AM);
    s->c.keys = s->keys;
    s->c.values = s->values;
    s->c.beta = s->beta;
    s->c.u = s->u;
    s->c.positions = s->pos;
    s->c.head_method = s->hm;
}

static void synth_free(synth *s) {
    free(s->keys);
    free(s->values);
    free(s->beta);
    free(s->u);
    free(s->pos);
    free(s->hm);
}

static void show(const kf_error *err) {
    if (getenv("KVF_TEST_VERBOSE"))
        fprintf(stderr, "\n    refusal: %s", err->msg);
}

/* A fresh file of s under dir; returns its path (static). */
static const char *fresh(const char *dir, const synth *s) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/c.kvf", kf_test_make_dir(dir));
    kf_error err = {0};
    kf_status st = kvf_write(path, &s->c, &err);
    if (st != KF_OK)
        fprintf(stderr, "%s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    return path;
}

/* kvf_open then kvf_verify: the first failure, or KF_OK. */
static kf_status open_verify(const char *path, kf_error *err) {
    kvf_file *f = NULL;
    kf_status st = kvf_open(path, &f, err);
    if (st == KF_OK)
        st = kvf_verify(f, err);
    kvf_close(f);
    show(err);
    return st;
}

static void expect_refusal(const char *path, const char *words) {
    kf_error err = {0};
    kf_status st = open_verify(path, &err);
    CU_ASSERT_NOT_EQUAL(st, KF_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, words));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
    if (st == KF_OK || !strstr(err.msg, words))
        fprintf(stderr, "\n  expected a refusal naming '%s', got %d: %s\n", words, (int)st, err.msg);
    CU_ASSERT(!kvf_exists_valid(path, NULL, NULL));
}

/* ---- editing files with HDF5 directly (metadata stays consistent: only kvf's checks see it) ---- */

static hid_t edit_open(const char *path) {
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_file_locking(fapl, 0, 1);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, fapl);
    H5Pclose(fapl);
    CU_ASSERT_FATAL(f >= 0);
    return f;
}

static void set_i64(const char *path, const char *name, int64_t v) {
    hid_t f = edit_open(path), a = H5Aopen(f, name, H5P_DEFAULT);
    CU_ASSERT(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    H5Aclose(a);
    H5Fclose(f);
}

static void set_f64(const char *path, const char *name, double v) {
    hid_t f = edit_open(path), a = H5Aopen(f, name, H5P_DEFAULT);
    CU_ASSERT(H5Awrite(a, H5T_NATIVE_DOUBLE, &v) >= 0);
    H5Aclose(a);
    H5Fclose(f);
}

/* Replaces a string attribute by bytes (fixed-length UTF-8, or variable-length). */
static void set_str(const char *path, const char *name, const char *bytes, int variable) {
    hid_t f = edit_open(path);
    CU_ASSERT(H5Adelete(f, name) >= 0);
    hid_t t = H5Tcopy(H5T_C_S1), s = H5Screate(H5S_SCALAR);
    H5Tset_size(t, variable ? H5T_VARIABLE : strlen(bytes) + 1);
    H5Tset_cset(t, H5T_CSET_UTF8);
    hid_t a = H5Acreate2(f, name, t, s, H5P_DEFAULT, H5P_DEFAULT);
    CU_ASSERT(H5Awrite(a, t, variable ? (const void *)&bytes : (const void *)bytes) >= 0);
    H5Aclose(a);
    H5Sclose(s);
    H5Tclose(t);
    H5Fclose(f);
}

/* The stored bytes (data + sum) of one chunk into buf; returns their count. */
static size_t chunk_get(hid_t d, const hsize_t *coord, unsigned char *buf) {
    hsize_t size = 0;
    uint32_t mask = 0;
    CU_ASSERT_FATAL(H5Dget_chunk_storage_size(d, coord, &size) >= 0 && size > 4);
    CU_ASSERT_FATAL(H5Dread_chunk(d, H5P_DEFAULT, coord, &mask, buf) >= 0);
    return (size_t)size;
}

/* Stores data (n bytes) at coord with a valid Fletcher32 sum and the given filter mask. */
static void chunk_put(hid_t d, const hsize_t *coord, unsigned char *buf, size_t n, uint32_t mask) {
    const uint32_t sum = kvf_fletcher32(buf, n);
    for (int b = 0; b < 4; b++)
        buf[n + (size_t)b] = (unsigned char)(sum >> (8 * b));
    CU_ASSERT(H5Dwrite_chunk(d, H5P_DEFAULT, mask, coord, n + 4, buf) >= 0);
}

/* ---- crafted files ---- */

/* Swaps the stored chunks (n bytes each, sum included) at x and y of dataset name in the file at
 * path, through a and b [n]. */
static void swap_chunks(const char *path, const char *name, const hsize_t *x, const hsize_t *y, size_t n,
                        unsigned char *a, unsigned char *b) {
    hid_t f = edit_open(path), d = H5Dopen2(f, name, H5P_DEFAULT);
    CU_ASSERT_EQUAL(chunk_get(d, x, a), n);
    CU_ASSERT_EQUAL(chunk_get(d, y, b), n);
    CU_ASSERT(H5Dwrite_chunk(d, H5P_DEFAULT, 0, x, n, b) >= 0);
    CU_ASSERT(H5Dwrite_chunk(d, H5P_DEFAULT, 0, y, n, a) >= 0);
    H5Dclose(d);
    H5Fclose(f);
}

static void test_swapped_zeroed_masked_chunks(void) {
    synth s;
    synth_make(&s, 3, 2, 8, 40, KF_DTYPE_BF16, 1);
    const size_t cb = 40 * 8 * 2; /* one (layer, head) chunk: [C, head_dim] bf16 */
    unsigned char *a = malloc(cb + 8), *b = malloc(cb + 8);
    const hsize_t c0[4] = {0, 0, 1, 0}, c1[4] = {1, 0, 1, 0}, h0[4] = {0, 0, 0, 0};

    /* keys of head 1 of layers 0 and 1 swapped: each chunk keeps its valid sum */
    const char *p = fresh("swap", &s);
    swap_chunks(p, "keys", c0, c1, cb + 4, a, b);
    expect_refusal(p, "layer 0 head 1 does not match its digest");

    /* values of heads 0 and 1 of layer 0 swapped */
    p = fresh("swaph", &s);
    swap_chunks(p, "values", h0, c0, cb + 4, a, b);
    expect_refusal(p, "layer 0 head 0 does not match its digest");

    /* an all-zero chunk: Fletcher32 of zeros is 0, so the sum holds */
    p = fresh("zero", &s);
    hid_t f = edit_open(p), d = H5Dopen2(f, "values", H5P_DEFAULT);
    memset(a, 0, cb + 4);
    CU_ASSERT(H5Dwrite_chunk(d, H5P_DEFAULT, 0, c1, cb + 4, a) >= 0);
    H5Dclose(d);
    H5Fclose(f);
    expect_refusal(p, "layer 1 head 1 does not match its digest");

    /* a NaN inside a chunk whose sum is valid (bf16 0x7fc0) */
    p = fresh("nan", &s);
    f = edit_open(p);
    d = H5Dopen2(f, "values", H5P_DEFAULT);
    chunk_get(d, c0, a);
    a[70] = 0xc0, a[71] = 0x7f;
    chunk_put(d, c0, a, cb, 0);
    H5Dclose(d);
    H5Fclose(f);
    expect_refusal(p, "values of layer 0, slot 4, head 1 is NaN or infinite");
    free(a);
    free(b);
    synth_free(&s);
}

/* A copy of dataset name (beta, u, positions, head_method: no attributes) with every chunk copied
 * as stored, except the chunk at skip: left out (drop) or stored with filter mask skip_mask. */
static void redo_chunk(const char *path, const char *name, const hsize_t *skip, uint32_t skip_mask, int drop) {
    hid_t f = edit_open(path), d = H5Dopen2(f, name, H5P_DEFAULT);
    hid_t t = H5Dget_type(d), sp = H5Dget_space(d), dcpl = H5Dget_create_plist(d);
    hsize_t n = 0;
    CU_ASSERT_FATAL(H5Dget_num_chunks(d, sp, &n) >= 0);
    CU_ASSERT(H5Lmove(f, name, f, "old", H5P_DEFAULT, H5P_DEFAULT) >= 0);
    hid_t nd = H5Dcreate2(f, name, t, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    CU_ASSERT_FATAL(nd >= 0);
    unsigned char *buf = malloc(1 << 20);
    int rank = H5Sget_simple_extent_ndims(sp);
    for (hsize_t i = 0; i < n; i++) {
        hsize_t off[4], size;
        unsigned mask;
        haddr_t addr;
        H5Dget_chunk_info(d, sp, i, off, &mask, &addr, &size);
        const int hit = memcmp(off, skip, sizeof(hsize_t) * (size_t)rank) == 0;
        if (hit && drop)
            continue;
        uint32_t m2;
        H5Dread_chunk(d, H5P_DEFAULT, off, &m2, buf);
        if (hit)
            m2 = skip_mask;
        CU_ASSERT(H5Dwrite_chunk(nd, H5P_DEFAULT, m2, off, size, buf) >= 0);
    }
    free(buf);
    H5Pclose(dcpl);
    H5Sclose(sp);
    H5Tclose(t);
    H5Dclose(d);
    H5Dclose(nd);
    H5Ldelete(f, "old", H5P_DEFAULT);
    H5Fclose(f);
}

static void test_never_written_chunks(void) {
    synth s;
    synth_make(&s, 2, 2, 8, 33, KF_DTYPE_F16, 2);
    const char *p = fresh("absent-pos", &s);
    const hsize_t lay1[3] = {1, 0, 0};
    redo_chunk(p, "positions", lay1, 0, 1);
    expect_refusal(p, "positions, layer 1 was never written");
    p = fresh("absent-beta", &s);
    const hsize_t lay0[3] = {0, 0, 0};
    redo_chunk(p, "beta", lay0, 0, 1);
    expect_refusal(p, "beta, layer 0 was never written");
    /* a chunk stored with filter mask 1 (HDF5's pipeline would skip its checksum), bytes intact */
    p = fresh("mask", &s);
    redo_chunk(p, "u", lay1, 1, 0);
    expect_refusal(p, "u, layer 1 is stored with filter mask 1");
    synth_free(&s);
}

static void test_bad_values(void) {
    synth s;
    synth_make(&s, 2, 2, 8, 20, KF_DTYPE_F32, 3);
    /* a position equal to D in a valid chunk */
    const char *p = fresh("pos-range", &s);
    hid_t f = edit_open(p), d = H5Dopen2(f, "positions", H5P_DEFAULT);
    int32_t buf[2 * 20 + 1];
    const hsize_t c1[3] = {1, 0, 0};
    chunk_get(d, c1, (unsigned char *)buf);
    buf[3] = (int32_t)s.c.hdr.n_doc_tokens;
    chunk_put(d, c1, (unsigned char *)buf, sizeof(int32_t) * 40, 0);
    H5Dclose(d);
    H5Fclose(f);
    expect_refusal(p, "position 60 of layer 1, head 0, slot 3 is outside [0, D = 60)");
    /* NaN beta in a slot that is not padding */
    p = fresh("beta-nan", &s);
    f = edit_open(p);
    d = H5Dopen2(f, "beta", H5P_DEFAULT);
    float fb[41];
    chunk_get(d, c1, (unsigned char *)fb);
    fb[0] = NAN;
    chunk_put(d, c1, (unsigned char *)fb, sizeof(float) * 40, 0);
    H5Dclose(d);
    H5Fclose(f);
    expect_refusal(p, "beta nan of layer 1, head 0, slot 0 is not finite");
    /* the writer refuses the same values */
    kf_error err = {0};
    char path[1024];
    snprintf(path, sizeof path, "%s/w.kvf", kf_test_make_dir("writer-refuses"));
    s.values[5] = INFINITY;
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "values of layer 0, slot 0, head 0 is not finite"));
    s.values[5] = 0;
    s.pos[0] = -2;
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "outside [0, D"));
    s.pos[0] = 0;
    s.beta[0] = -INFINITY; /* -inf only in padding */
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
    s.beta[0] = 0;
    s.hm[1] = 4;
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "head_method 4"));
    s.hm[1] = 0;
    synth f16;
    synth_make(&f16, 1, 1, 4, 4, KF_DTYPE_F16, 4);
    f16.keys[2] = 70000.0f; /* overflows float16 */
    CU_ASSERT_EQUAL(kvf_write(path, &f16.c, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "overflows"));
    CU_ASSERT(access(path, F_OK) != 0);
    synth_free(&f16);
    synth_free(&s);
}

static void test_bad_attributes(void) {
    synth s;
    synth_make(&s, 2, 2, 8, 20, KF_DTYPE_BF16, 5);
    const char *p = fresh("c-gt-d", &s);
    set_i64(p, "n_doc_tokens", 19); /* C = 20 > D */
    expect_refusal(p, "attribute 'n_tokens' = 20 is out of range [1, 19]");
    p = fresh("budget", &s);
    set_f64(p, "budget", 1.5);
    expect_refusal(p, "budget 1.5 must be in (0, 1]");
    p = fresh("lambda", &s);
    set_f64(p, "lambda", NAN);
    expect_refusal(p, "lambda nan must be finite");
    p = fresh("dmax", &s);
    set_i64(p, "n_doc_tokens", INT64_MAX);
    expect_refusal(p, "attribute 'n_doc_tokens' = 9223372036854775807 is out of range");
    p = fresh("layers", &s);
    set_i64(p, "n_layers", 4096);
    expect_refusal(p, "the header claims 4096 layers");
    p = fresh("big-c", &s);
    set_i64(p, "n_doc_tokens", (int64_t)1 << 21);
    set_i64(p, "n_tokens", (int64_t)1 << 21);
    expect_refusal(p, "the header claims 2 layers x 2097152 slots");
    p = fresh("big-chunk", &s); /* one (layer, head) chunk of C x head_dim bf16 = 2^20 x 2^16 x 2 bytes >= 4 GiB */
    set_i64(p, "n_doc_tokens", (int64_t)1 << 20);
    set_i64(p, "n_tokens", (int64_t)1 << 20);
    set_i64(p, "head_dim", 65536);
    expect_refusal(p, "x C 1048576 is too large for one chunk");
    p = fresh("utf8", &s);
    set_str(p, "placeholder", "ok\xff\xfe", 0);
    expect_refusal(p, "attribute 'placeholder' is not printable UTF-8");
    p = fresh("ctrl", &s);
    set_str(p, "creator", "kvfold \x1b[2J", 0);
    expect_refusal(p, "attribute 'creator' is not printable UTF-8");
    p = fresh("vlen", &s);
    set_str(p, "creator", "kvfold 0.0.1", 1);
    expect_refusal(p, "attribute 'creator' is not a fixed-length UTF-8 string");
    p = fresh("v1", &s);
    set_i64(p, "version", 1);
    expect_refusal(p, "kvf version 1 is no longer read");
    expect_refusal(p, "recompact the document");
    p = fresh("extlink", &s);
    {
        hid_t f = edit_open(p);
        H5Lmove(f, "u", f, "u_moved", H5P_DEFAULT, H5P_DEFAULT);
        CU_ASSERT(H5Lcreate_external("/etc/hostname", "/u", f, "u", H5P_DEFAULT, H5P_DEFAULT) >= 0);
        H5Fclose(f);
    }
    expect_refusal(p, "dataset 'u' is a link");
    p = fresh("payload", &s);
    set_str(p, "payload_digest", "00000000000000000000000000000000", 0);
    expect_refusal(p, "the head digests give payload digest");
    synth_free(&s);
}

/* A file as kvfold 0.1 (format version 1) wrote it: HDF5's default (earliest) format, no metadata
 * checksums, variable-length strings. The message says to recompact. */
static void test_version_1_file(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/v1.kvf", kf_test_make_dir("v1-real"));
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t t = H5Tcopy(H5T_C_S1), s = H5Screate(H5S_SCALAR);
    H5Tset_size(t, H5T_VARIABLE);
    const char *fmt = KVF_FORMAT_NAME;
    hid_t a = H5Acreate2(f, "format", t, s, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, t, &fmt);
    H5Aclose(a);
    int64_t v = 1;
    a = H5Acreate2(f, "version", H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Sclose(s);
    H5Tclose(t);
    H5Fclose(f);
    kf_error err = {0};
    CU_ASSERT_EQUAL(open_verify(path, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "recompact"));
    /* version 2 in the same old layout: no metadata checksums */
    f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    a = H5Aopen(f, "version", H5P_DEFAULT);
    v = 2;
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Fclose(f);
    CU_ASSERT_EQUAL(open_verify(path, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "without HDF5 metadata checksums"));
}

/* ---- seeded flips of a fresh file ---- */

static uint64_t g_rng;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return g_rng;
}

typedef struct {
    kvf_header h;
    unsigned char *bytes; /* every layer: keys, values (raw), beta, u, positions, head methods */
    size_t n;
} snapshot;

/* Everything a reader gets from the file; KF_OK or the refusal. */
static kf_status read_all(const char *path, snapshot *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    kvf_file *f = NULL;
    KF_TRY(kvf_open(path, &f, err));
    out->h = *kvf_file_header(f);
    const kvf_header *h = &out->h;
    const size_t H = (size_t)h->kv_heads, C = (size_t)h->n_tokens, D = (size_t)h->head_dim;
    const size_t kv = C * H * D * kf_dtype_size(h->dtype), per = 2 * kv + H * C * 8 + H * D * 4 + H;
    out->n = per * (size_t)h->n_layers;
    out->bytes = calloc(out->n, 1);
    kf_status st = out->bytes ? KF_OK : KF_ERR_NOMEM;
    for (int l = 0; l < h->n_layers && st == KF_OK; l++) {
        unsigned char *p = out->bytes + (size_t)l * per;
        st = kvf_read_layer_all(f, l, p, p + kv, (float *)(p + 2 * kv), (float *)(p + 2 * kv + H * C * 4),
                                (int32_t *)(p + 2 * kv + H * C * 4 + H * D * 4), p + 2 * kv + H * C * 8 + H * D * 4,
                                err);
    }
    kvf_close(f);
    return st;
}

static int same_header(const kvf_header *a, const kvf_header *b) {
    return !strcmp(a->creator, b->creator) && !strcmp(a->model_fingerprint, b->model_fingerprint) &&
           !strcmp(a->tokenizer_digest, b->tokenizer_digest) && !strcmp(a->document_digest, b->document_digest) &&
           !strcmp(a->recipe_digest, b->recipe_digest) && !strcmp(a->payload_digest, b->payload_digest) &&
           a->n_doc_tokens == b->n_doc_tokens && a->n_tokens == b->n_tokens && a->method == b->method &&
           a->budget == b->budget && a->lambda == b->lambda && a->rope_frame == b->rope_frame &&
           !strcmp(a->placeholder, b->placeholder) && a->dtype == b->dtype && a->n_layers == b->n_layers &&
           a->kv_heads == b->kv_heads && a->head_dim == b->head_dim && a->block_size == b->block_size;
}

static void test_seeded_flips(void) {
    const int n_flips = getenv("KVF_FLIPS") ? atoi(getenv("KVF_FLIPS")) : 600;
    synth s;
    synth_make(&s, 2, 2, 8, 21, KF_DTYPE_BF16, 6);
    char path[1024];
    snprintf(path, sizeof path, "%s", fresh("flips", &s));
    snapshot want;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(read_all(path, &want, &err), KF_OK);
    FILE *fp = fopen(path, "rb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    fseek(fp, 0, SEEK_END);
    const size_t n = (size_t)ftell(fp);
    rewind(fp);
    unsigned char *orig = malloc(n), *cur = malloc(n);
    CU_ASSERT_EQUAL_FATAL(fread(orig, 1, n, fp), n);
    fclose(fp);
    char flipped[1100];
    snprintf(flipped, sizeof flipped, "%s/f.kvf", kf_test_make_dir("flips-out"));
    g_rng = 0x2545f4914f6cdd1dull;
    int refused = 0, identical = 0, wrong = 0;
    for (int i = 0; i < n_flips; i++) {
        memcpy(cur, orig, n);
        const int k = 1 + (int)(rnd() % 3);
        size_t at[3];
        for (int j = 0; j < k; j++) {
            at[j] = (size_t)(rnd() % n);
            cur[at[j]] ^= (unsigned char)(1 + rnd() % 255);
        }
        FILE *o = fopen(flipped, "wb");
        CU_ASSERT_FATAL(o && fwrite(cur, 1, n, o) == n);
        fclose(o);
        snapshot got;
        err.msg[0] = 0;
        kf_status st = read_all(flipped, &got, &err);
        if (st != KF_OK && err.msg[0] && strstr(err.msg, flipped))
            refused++;
        else if (st == KF_OK && same_header(&got.h, &want.h) && got.n == want.n &&
                 !memcmp(got.bytes, want.bytes, n < got.n ? n : got.n) && !memcmp(got.bytes, want.bytes, got.n))
            identical++;
        else {
            wrong++;
            fprintf(stderr, "\n  flip %d (%d bytes at %zu...): status %d, %s", i, k, at[0], (int)st, err.msg);
        }
        free(got.bytes);
    }
    fprintf(stderr, "  (%d flips of a %zu-byte file: %d refused, %d read identically, %d wrong)\n", n_flips, n, refused,
            identical, wrong);
    CU_ASSERT_EQUAL(wrong, 0);
    CU_ASSERT(refused > n_flips / 2);
    free(orig);
    free(cur);
    free(want.bytes);
    synth_free(&s);
}

/* ---- identity, head methods, the skip check ---- */

static void test_identity_and_head_methods(void) {
    synth s;
    synth_make(&s, 3, 4, 8, 17, KF_DTYPE_F16, 7);
    const char *p = fresh("identity", &s);
    char path[1024];
    snprintf(path, sizeof path, "%s", p);
    CU_ASSERT(kvf_exists_valid(path, kFp, kRecipe));
    CU_ASSERT(!kvf_exists_valid(path, kFp, "aaaabbbbccccddddeeeeffff00001112"));
    CU_ASSERT(kvf_exists_valid(path, NULL, NULL));
    kvf_file *f = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kvf_open(path, &f, &err), KF_OK);
    CU_ASSERT_STRING_EQUAL(kvf_file_header(f)->recipe_digest, kRecipe);
    uint8_t hm[12];
    CU_ASSERT_EQUAL(kvf_read_head_methods(f, hm, &err), KF_OK);
    CU_ASSERT(memcmp(hm, s.hm, 12) == 0);
    CU_ASSERT_EQUAL(kvf_check_positions(f, 51, &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_check_positions(f, 50, &err), KF_ERR_MISMATCH);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "longer than the model's 50 positions"));
    kvf_close(f);
    /* NULL head_method: every head gets hdr.method */
    s.c.head_method = NULL;
    p = fresh("identity-null", &s);
    CU_ASSERT_EQUAL_FATAL(kvf_open(p, &f, &err), KF_OK);
    CU_ASSERT_EQUAL(kvf_read_head_methods(f, hm, &err), KF_OK);
    int all = 1;
    for (int i = 0; i < 12; i++)
        all &= hm[i] == KF_METHOD_AM;
    CU_ASSERT(all);
    kvf_close(f);
    /* one flipped data byte: the skip check reads the sums */
    hid_t h5 = edit_open(path), d = H5Dopen2(h5, "values", H5P_DEFAULT);
    hsize_t size;
    haddr_t addr;
    unsigned mask;
    const hsize_t c[4] = {2, 16, 0, 0};
    CU_ASSERT(H5Dget_chunk_info_by_coord(d, c, &mask, &addr, &size) >= 0);
    H5Dclose(d);
    H5Fclose(h5);
    FILE *fp = fopen(path, "r+b");
    fseek(fp, (long)addr + 3, SEEK_SET);
    int ch = fgetc(fp);
    fseek(fp, (long)addr + 3, SEEK_SET);
    fputc(ch ^ 1, fp);
    fclose(fp);
    CU_ASSERT(!kvf_exists_valid(path, kFp, kRecipe));
    /* rewriting the damaged file gives exactly the bytes of a fresh write elsewhere (HDF5's core
     * driver once read the old file of the same name into its image) */
    s.c.head_method = s.hm;
    kf_error e2 = {0};
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &e2), KF_OK);
    CU_ASSERT(kvf_exists_valid(path, kFp, kRecipe));
    char other[1024];
    snprintf(other, sizeof other, "%s/again.kvf", kf_test_make_dir("identity-again"));
    CU_ASSERT_EQUAL(kvf_write(other, &s.c, &e2), KF_OK);
    FILE *x = fopen(path, "rb"), *y = fopen(other, "rb");
    int same = x && y;
    for (int cx = 0, cy = 0; same && (cx != EOF || cy != EOF);)
        same = (cx = fgetc(x)) == (cy = fgetc(y));
    if (x)
        fclose(x);
    if (y)
        fclose(y);
    CU_ASSERT(same);
    synth_free(&s);
}

static void test_recipe_digest(void) {
    kf_compact_params p = kf_compact_params_default();
    int32_t instr[3] = {5, 6, 7}, probe[2] = {9, 10};
    p.repeat_instruction = (kf_prompt){instr, 3};
    char base[33], d[33];
    kf_recipe_digest(&p, KF_DTYPE_BF16, 4, base);
    CU_ASSERT_EQUAL(strlen(base), 32);
    kf_recipe_digest(&p, KF_DTYPE_BF16, 4, d);
    CU_ASSERT_STRING_EQUAL(d, base); /* deterministic */
    int changed = 0, cases = 0;
#define DIFFERS(stmt)                                                                                                  \
    do {                                                                                                               \
        kf_compact_params q = p;                                                                                       \
        kf_dtype dt = KF_DTYPE_BF16;                                                                                   \
        stmt;                                                                                                          \
        kf_recipe_digest(&q, dt, 4, d);                                                                                \
        cases++;                                                                                                       \
        if (strcmp(d, base) != 0)                                                                                      \
            changed++;                                                                                                 \
        else                                                                                                           \
            fprintf(stderr, "\n  recipe digest unchanged by: %s", #stmt);                                              \
    } while (0)
    kf_quoka_params qk = kf_quoka_params_default(), qk2 = qk;
    qk2.budget++;
    kf_prompt pr = {probe, 2};
    float hb[4] = {0.25f, 0.25f, 0.25f, 0.25f};
    DIFFERS(q.method = KF_METHOD_AM);
    DIFFERS(q.budget = 0.2);
    DIFFERS(q.solver.lambda_rel = 0.02);
    DIFFERS(dt = KF_DTYPE_F16);
    DIFFERS(instr[2] = 8);
    DIFFERS(q.probes = &pr; q.n_probes = 1);
    DIFFERS(q.solver.max_queries = 100);
    DIFFERS(q.solver.seed = 1);
    DIFFERS(q.solver.score = (kf_score_method)1);
    DIFFERS(q.solver.fold_queries = KF_FOLD_ON_PROBES);
    DIFFERS(q.use_context_queries = 1);
    DIFFERS(q.run.quoka = &qk);
    DIFFERS(q.solver.head_budgets = hb);
    DIFFERS(q.solver.max_head_ratio = 0.5);
    DIFFERS(q.run.chunk = 64);
    DIFFERS(q.run.quoka_repeat = 1);
    DIFFERS(q.run.quoka_margin = 8);
    DIFFERS(q.solver.beta_fit = KF_BETA_BOX);
    DIFFERS(q.solver.value_ridge = 0.01);
    DIFFERS(q.solver.ridge_to = KF_RIDGE_TO_ZERO);
    DIFFERS(q.choice.head_choice = KF_CHOICE_OFF);
    DIFFERS(q.choice.val_frac = 0.3);
    DIFFERS(q.choice.choice_margin = 0.2);
    DIFFERS(q.choice.refit_all = 0);
    DIFFERS(q.run.refq_bf16 = 1);
    instr[2] = 7;
    CU_ASSERT_EQUAL(changed, cases);
    /* two QUOKA settings differ from each other */
    char d1[33], d2[33];
    kf_compact_params q = p;
    q.run.quoka = &qk;
    kf_recipe_digest(&q, KF_DTYPE_BF16, 4, d1);
    q.run.quoka = &qk2;
    kf_recipe_digest(&q, KF_DTYPE_BF16, 4, d2);
    CU_ASSERT_STRING_NOT_EQUAL(d1, d2);
#undef DIFFERS
}

/* ---- a full disk ---- */

/* In a child limited to a small file size (RLIMIT_FSIZE, SIGXFSZ ignored: write() fails with
 * EFBIG, as on a full disk): kvf_write fails with the cause, leaves no file (final or
 * temporary), and the child exits through exit() so that HDF5's atexit cleanup runs (a leaked
 * file handle crashed there). */
static void test_full_disk(void) {
    synth s;
    synth_make(&s, 4, 4, 64, 300, KF_DTYPE_F32, 8); /* ~1.2 MB */
    char dir[1024], path[1100];
    snprintf(dir, sizeof dir, "%s", kf_test_make_dir("full-disk"));
    snprintf(path, sizeof path, "%s/c.kvf", dir);
    fflush(NULL);
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit r = {200000, 200000};
        setrlimit(RLIMIT_FSIZE, &r);
        kf_error err = {0};
        int bad = 0;
        for (int i = 0; i < 3; i++) { /* a few times: no state is left between attempts */
            kf_status st = kvf_write(path, &s.c, &err);
            bad |= st != KF_ERR_IO || !strstr(err.msg, strerror(EFBIG)) || !strstr(err.msg, path);
            if (i == 0 && getenv("KVF_TEST_VERBOSE"))
                fprintf(stderr, "\n    refusal: %s", err.msg);
        }
        bad |= access(path, F_OK) == 0;
        int n = -1;
        kvf_clean_temps(dir, -1e9, true, NULL, NULL, &n, NULL);
        bad |= n != 0;
        exit(bad ? 3 : 0); /* exit(), not _exit(): HDF5's atexit handler runs */
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CU_ASSERT(WIFEXITED(status));
    CU_ASSERT_EQUAL(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0);
    if (!WIFEXITED(status))
        fprintf(stderr, "\n  the child died of signal %d", WTERMSIG(status));
    /* the same write without the limit works, and is read back */
    kf_error err = {0};
    CU_ASSERT_EQUAL(kvf_write(path, &s.c, &err), KF_OK);
    CU_ASSERT(kvf_exists_valid(path, kFp, kRecipe));
    synth_free(&s);
}


/* The head and payload digests against libxxhash's one-shot XXH3-128 of the bytes kvf.h lists
 * (an independent computation: kvfold streams them, with AVX2 where it can). */
static void test_digests_match_the_spec(void) {
    synth s;
    synth_make(&s, 2, 4, 64, 40, KF_DTYPE_BF16, 9);
    const char *p = fresh("digest-spec", &s);
    const size_t L = 2, H = 4, D = 64, C = 40;
    const size_t per = 2 * C * D * 2 + C * 4 + D * 4 + C * 4 + 1 + 16;
    unsigned char *buf = malloc(per), digests[2 * 4 * 16];
    for (size_t l = 0; l < L; l++)
        for (size_t h = 0; h < H; h++) {
            unsigned char *q = buf;
            for (int w = 0; w < 2; w++) /* keys[l, :, h, :] then values[l, :, h, :] */
                for (size_t t = 0; t < C; t++)
                    for (size_t i = 0; i < D; i++, q += 2) {
                        uint16_t b = kf_f32_to_bf16((w ? s.values : s.keys)[((l * C + t) * H + h) * D + i]);
                        memcpy(q, &b, 2);
                    }
            memcpy(q, s.beta + (l * H + h) * C, C * 4), q += C * 4;
            memcpy(q, s.u + (l * H + h) * D, D * 4), q += D * 4;
            memcpy(q, s.pos + (l * H + h) * C, C * 4), q += C * 4;
            *q++ = s.hm[l * H + h];
            for (int b = 0; b < 8; b++)
                *q++ = (unsigned char)((uint64_t)l >> (8 * b));
            for (int b = 0; b < 8; b++)
                *q++ = (unsigned char)((uint64_t)h >> (8 * b));
            XXH128_canonical_t c;
            XXH128_canonicalFromHash(&c, XXH3_128bits(buf, per));
            memcpy(digests + 16 * (l * H + h), c.digest, 16);
        }
    hid_t f = edit_open(p), d = H5Dopen2(f, "head_digest", H5P_DEFAULT);
    unsigned char stored[2 * 4 * 16];
    CU_ASSERT(H5Dread(d, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, stored) >= 0);
    H5Dclose(d);
    H5Fclose(f);
    CU_ASSERT(memcmp(stored, digests, sizeof digests) == 0);
    unsigned char all[2 * 4 * 16 + 16] = {0};
    memcpy(all, digests, sizeof digests);
    all[sizeof digests] = 2;     /* L as uint64 LE */
    all[sizeof digests + 8] = 4; /* kv_heads as uint64 LE */
    XXH128_hash_t ph = XXH3_128bits(all, sizeof all);
    char want[33];
    snprintf(want, sizeof want, "%016llx%016llx", (unsigned long long)ph.high64, (unsigned long long)ph.low64);
    kvf_file *kf = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kvf_open(p, &kf, &err), KF_OK);
    CU_ASSERT_STRING_EQUAL(kvf_file_header(kf)->payload_digest, want);
    kvf_close(kf);
    free(buf);
    synth_free(&s);
}

static CU_TestInfo tests[] = {
    {"head and payload digests follow kvf.h (libxxhash one-shot)", test_digests_match_the_spec},
    {"swapped, zeroed, mask-1 and NaN chunks are refused", test_swapped_zeroed_masked_chunks},
    {"never-written chunks are refused", test_never_written_chunks},
    {"bad values: positions, beta, writer refusals", test_bad_values},
    {"bad attributes: C > D, budget, lambda, D, huge shapes, UTF-8, version 1", test_bad_attributes},
    {"a version-1 file says to recompact", test_version_1_file},
    {"seeded flips: refused or byte-identical", test_seeded_flips},
    {"recipe identity, head methods, the skip check reads the sums", test_identity_and_head_methods},
    {"recipe digest covers every field", test_recipe_digest},
    {"a full disk leaves no file and no crash at exit", test_full_disk},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"kvf integrity", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) {
    return kf_test_main(suites);
}
