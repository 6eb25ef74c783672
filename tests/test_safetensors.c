/* The safetensors reader: valid files built byte by byte (every field checked), the real
 * fixture, every class of malformed file (status and message), sharded checkpoints through
 * kf_st_open_dir, and a deterministic mutation loop that must never crash the reader. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "formats/safetensors.h"
#include "test_util.h"

/* ---- building files -------------------------------------------------------------------- */

/* u64 LE header length, the header bytes, the data bytes, in a fresh malloc'd buffer. */
static unsigned char *st_bytes(uint64_t hlen, const char *json, const void *data, size_t dlen, size_t *n) {
    size_t jl = strlen(json);
    *n = 8 + jl + dlen;
    unsigned char *b = malloc(*n ? *n : 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(b + 8, json, jl);
    if (dlen)
        memcpy(b + 8 + jl, data, dlen);
    return b;
}

/* Writes a safetensors file under the test temp dir, header length = strlen(json); the path is
 * copied into out. */
static void write_st(char *out, size_t outsz, const char *fname, const char *json, const void *data, size_t dlen) {
    size_t n;
    unsigned char *b = st_bytes(strlen(json), json, data, dlen, &n);
    snprintf(out, outsz, "%s", kf_test_write_file(fname, b, n));
    free(b);
}

/* The same with an explicit header length (which may lie). */
static void write_st_hlen(char *out, size_t outsz, const char *fname, uint64_t hlen, const char *json, const void *data,
                          size_t dlen) {
    size_t n;
    unsigned char *b = st_bytes(hlen, json, data, dlen, &n);
    snprintf(out, outsz, "%s", kf_test_write_file(fname, b, n));
    free(b);
}

/* A data section of n bytes with a recognisable pattern. */
static unsigned char kData[4096];
static void init_data(void) {
    for (size_t i = 0; i < sizeof kData; i++)
        kData[i] = (unsigned char)(i * 7 + 1);
}

/* ---- checking failures ----------------------------------------------------------------- */

#define ASSERT_AT(cond, line) CU_assertImplementation((cond), (line), #cond, __FILE__, "", CU_FALSE)

/* Opens path as one file and expects code with a message naming the file and containing kw. */
static void expect_file_fail_at(const char *path, kf_status code, const char *kw, unsigned line) {
    kf_st_set set;
    kf_error err = {0};
    kf_status st = kf_st_open_file(&set, path, &err);
    int ok = st == code && strstr(err.msg, path) && (!kw || strstr(err.msg, kw));
    if (!ok)
        fprintf(stderr, "\n    line %u: status %s (want %s), message: %s\n", line, kf_status_name(st),
                kf_status_name(code), err.msg);
    ASSERT_AT(st == code, line);
    ASSERT_AT(strstr(err.msg, path) != NULL, line);
    if (kw)
        ASSERT_AT(strstr(err.msg, kw) != NULL, line);
    if (st == KF_OK)
        kf_st_close(&set);
    else /* a failed open leaves nothing behind */
        ASSERT_AT(set.n_tensors == 0 && set.tensors == NULL && set.n_files == 0 && set.files == NULL, line);
}
#define EXPECT_FILE_FAIL(path, code, kw) expect_file_fail_at((path), (code), (kw), __LINE__)

/* Builds a file from json + kData[0..dlen) and expects it refused. */
static void expect_header_fail_at(const char *json, size_t dlen, kf_status code, const char *kw, unsigned line) {
    char path[512];
    write_st(path, sizeof path, "bad.safetensors", json, kData, dlen);
    expect_file_fail_at(path, code, kw, line);
}
#define EXPECT_HEADER_FAIL(json, dlen, code, kw) expect_header_fail_at((json), (dlen), (code), (kw), __LINE__)

/* Two keywords: the tensor name and the defect. */
static void expect_header_fail2_at(const char *json, size_t dlen, kf_status code, const char *kw1, const char *kw2,
                                   unsigned line) {
    char path[512];
    write_st(path, sizeof path, "bad.safetensors", json, kData, dlen);
    expect_file_fail_at(path, code, kw1, line);
    kf_st_set set;
    kf_error err = {0};
    if (kf_st_open_file(&set, path, &err) == KF_OK)
        kf_st_close(&set);
    ASSERT_AT(strstr(err.msg, kw2) != NULL, line);
}
#define EXPECT_HEADER_FAIL2(json, dlen, code, kw1, kw2)                                                                \
    expect_header_fail2_at((json), (dlen), (code), (kw1), (kw2), __LINE__)

/* ---- valid files ----------------------------------------------------------------------- */

/* BF16 [2,3] @0..12, F16 [4] @12..20, F32 [2,2] @20..36, I64 [3] @36..60, F32 [0,5] @60..60,
 * F32 scalar [] @60..64; with __metadata__ and the header padded with spaces (as writers do). */
static const char kValidJson[] = "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"hello\"},"
                                 "\"b.f16\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[12,20]},"
                                 "\"a.bf16\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
                                 "\"d.i64\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[36,60]},"
                                 "\"c.f32\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[20,36]},"
                                 "\"e.empty\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[60,60]},"
                                 "\"f.scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[60,64]}}      ";
#define VALID_DLEN 64

static unsigned char valid_data[VALID_DLEN];

static void make_valid_data(void) {
    memcpy(valid_data, kData, VALID_DLEN);
    const int64_t ints[3] = {-5, 1LL << 40, 7};
    memcpy(valid_data + 36, ints, sizeof ints); /* little-endian host */
    const float f[4] = {1.5f, -2.0f, 0.25f, 1e30f};
    memcpy(valid_data + 20, f, sizeof f);
    const float s = 3.0f;
    memcpy(valid_data + 60, &s, 4);
}

static void check_tensor(const kf_st_set *set, const char *name, kf_dtype dt, int ndim, const int64_t *shape,
                         int64_t numel, size_t begin, size_t end) {
    const kf_st_tensor *t = kf_st_find(set, name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_STRING_EQUAL(t->name, name);
    CU_ASSERT_EQUAL(t->dtype, dt);
    CU_ASSERT_EQUAL(t->ndim, ndim);
    for (int d = 0; d < ndim; d++)
        CU_ASSERT_EQUAL(t->shape[d], shape[d]);
    CU_ASSERT_EQUAL(t->numel, numel);
    CU_ASSERT_EQUAL(t->nbytes, end - begin);
    CU_ASSERT_EQUAL(t->nbytes, (size_t)numel * kf_dtype_size(dt));
    CU_ASSERT_EQUAL(t->file, 0);
    const kf_st_file *f = &set->files[0];
    const unsigned char *base = (const unsigned char *)f->map + 8 + f->header_len;
    CU_ASSERT_PTR_EQUAL(t->data, base + begin);
    if (end > begin)
        CU_ASSERT_EQUAL(memcmp(t->data, valid_data + begin, end - begin), 0);
}

static void test_valid_file(void) {
    char path[512];
    write_st(path, sizeof path, "valid.safetensors", kValidJson, valid_data, VALID_DLEN);
    kf_st_set set;
    kf_error err = {0};
    kf_status st = kf_st_open_file(&set, path, &err);
    if (st != KF_OK)
        fprintf(stderr, "\n    %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    CU_ASSERT_EQUAL(set.n_files, 1);
    CU_ASSERT_STRING_EQUAL(set.files[0].path, path);
    CU_ASSERT_EQUAL(set.files[0].header_len, strlen(kValidJson));
    CU_ASSERT_EQUAL(set.files[0].size, 8 + strlen(kValidJson) + VALID_DLEN);
    CU_ASSERT_EQUAL(set.n_tensors, 6); /* __metadata__ is not a tensor */
    for (size_t i = 1; i < set.n_tensors; i++)
        CU_ASSERT(strcmp(set.tensors[i - 1].name, set.tensors[i].name) < 0); /* sorted */

    check_tensor(&set, "a.bf16", KF_DTYPE_BF16, 2, (int64_t[]){2, 3}, 6, 0, 12);
    check_tensor(&set, "b.f16", KF_DTYPE_F16, 1, (int64_t[]){4}, 4, 12, 20);
    check_tensor(&set, "c.f32", KF_DTYPE_F32, 2, (int64_t[]){2, 2}, 4, 20, 36);
    check_tensor(&set, "d.i64", KF_DTYPE_I64, 1, (int64_t[]){3}, 3, 36, 60);
    check_tensor(&set, "e.empty", KF_DTYPE_F32, 2, (int64_t[]){0, 5}, 0, 60, 60);
    check_tensor(&set, "f.scalar", KF_DTYPE_F32, 0, NULL, 1, 60, 64);

    /* values read back through the (possibly unaligned) pointers */
    const kf_st_tensor *t = kf_st_find(&set, "d.i64");
    int64_t v[3];
    memcpy(v, t->data, sizeof v);
    CU_ASSERT_EQUAL(v[0], -5);
    CU_ASSERT_EQUAL(v[1], 1LL << 40);
    CU_ASSERT_EQUAL(v[2], 7);
    t = kf_st_find(&set, "c.f32");
    float f[4];
    memcpy(f, t->data, sizeof f);
    CU_ASSERT_EQUAL(f[0], 1.5f);
    CU_ASSERT_EQUAL(f[3], 1e30f);

    CU_ASSERT_PTR_NULL(kf_st_find(&set, "__metadata__"));
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "missing"));
    CU_ASSERT_PTR_NULL(kf_st_find(&set, ""));
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "a.bf1"));
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "z"));
    kf_st_close(&set);
    CU_ASSERT_EQUAL(set.n_tensors, 0);
    CU_ASSERT_PTR_NULL(set.tensors);
    kf_st_close(&set);                              /* closing twice is harmless */
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "a.bf16")); /* and a closed set finds nothing */
}

static void test_dtype_table(void) {
    CU_ASSERT_EQUAL(kf_dtype_size(KF_DTYPE_BOOL), 1);
    CU_ASSERT_EQUAL(kf_dtype_size(KF_DTYPE_BF16), 2);
    CU_ASSERT_EQUAL(kf_dtype_size(KF_DTYPE_F16), 2);
    CU_ASSERT_EQUAL(kf_dtype_size(KF_DTYPE_F32), 4);
    CU_ASSERT_EQUAL(kf_dtype_size(KF_DTYPE_I64), 8);
    CU_ASSERT_EQUAL(kf_dtype_size(KF_DTYPE_F64), 8);
    CU_ASSERT_STRING_EQUAL(kf_st_dtype_name(KF_DTYPE_BF16), "BF16");
    CU_ASSERT_STRING_EQUAL(kf_st_dtype_name(KF_DTYPE_U64), "U64");
    CU_ASSERT_STRING_EQUAL(kf_st_dtype_name((kf_dtype)99), "?");
    CU_ASSERT_EQUAL(kf_dtype_size((kf_dtype)99), 0);
}

/* Every dtype name the reader knows, one tensor each. */
static void test_all_dtypes(void) {
    static const struct {
        const char *name;
        kf_dtype dt;
        size_t size;
    } dts[] = {{"BOOL", KF_DTYPE_BOOL, 1}, {"U8", KF_DTYPE_U8, 1},   {"I8", KF_DTYPE_I8, 1},
               {"I16", KF_DTYPE_I16, 2},   {"U16", KF_DTYPE_U16, 2}, {"F16", KF_DTYPE_F16, 2},
               {"BF16", KF_DTYPE_BF16, 2}, {"I32", KF_DTYPE_I32, 4}, {"U32", KF_DTYPE_U32, 4},
               {"F32", KF_DTYPE_F32, 4},   {"I64", KF_DTYPE_I64, 8}, {"U64", KF_DTYPE_U64, 8},
               {"F64", KF_DTYPE_F64, 8}};
    char json[4096] = "{";
    size_t off = 0;
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
        char one[256];
        snprintf(one, sizeof one, "%s\"t%02zu\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[%zu,%zu]}",
                 i ? "," : "", i, dts[i].name, off, off + 3 * dts[i].size);
        strcat(json, one);
        off += 3 * dts[i].size;
    }
    strcat(json, "}");
    char path[512];
    write_st(path, sizeof path, "dtypes.safetensors", json, kData, off);
    kf_st_set set;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_st_open_file(&set, path, &err), KF_OK);
    CU_ASSERT_EQUAL(set.n_tensors, sizeof dts / sizeof dts[0]);
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
        char name[16];
        snprintf(name, sizeof name, "t%02zu", i);
        const kf_st_tensor *t = kf_st_find(&set, name);
        CU_ASSERT_PTR_NOT_NULL_FATAL(t);
        CU_ASSERT_EQUAL(t->dtype, dts[i].dt);
        CU_ASSERT_EQUAL(t->nbytes, 3 * dts[i].size);
        CU_ASSERT_EQUAL(kf_dtype_size(t->dtype), dts[i].size);
        CU_ASSERT_STRING_EQUAL(kf_st_dtype_name(t->dtype), dts[i].name);
    }
    kf_st_close(&set);
}

/* Edge cases that must be accepted. */
static void test_valid_edge_cases(void) {
    char path[512];
    kf_st_set set;
    kf_error err = {0};

    /* no tensors at all */
    write_st(path, sizeof path, "empty-object.safetensors", "{}", NULL, 0);
    CU_ASSERT_EQUAL(kf_st_open_file(&set, path, &err), KF_OK);
    CU_ASSERT_EQUAL(set.n_tensors, 0);
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "x"));
    kf_st_close(&set);

    /* only metadata; data after the header that no tensor uses is tolerated */
    write_st(path, sizeof path, "meta-only.safetensors", "{\"__metadata__\":{}}", kData, 16);
    CU_ASSERT_EQUAL(kf_st_open_file(&set, path, &err), KF_OK);
    CU_ASSERT_EQUAL(set.n_tensors, 0);
    kf_st_close(&set);

    /* a zero-element tensor alone, and a zero-element tensor sitting inside another one's bytes
     * (empty spans cannot overlap anything) */
    write_st(path, sizeof path, "zero.safetensors",
             "{\"z\":{\"dtype\":\"BF16\",\"shape\":[4,0,2],\"data_offsets\":[2,2]},"
             "\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
             kData, 4);
    CU_ASSERT_EQUAL_FATAL(kf_st_open_file(&set, path, &err), KF_OK);
    const kf_st_tensor *t = kf_st_find(&set, "z");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_EQUAL(t->numel, 0);
    CU_ASSERT_EQUAL(t->nbytes, 0);
    CU_ASSERT_EQUAL(t->ndim, 3);
    CU_ASSERT_EQUAL(t->shape[1], 0);
    kf_st_close(&set);

    /* adjacent tensors touch but do not overlap; 8 dimensions is the limit */
    write_st(path, sizeof path, "adjacent.safetensors",
             "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,3],\"data_offsets\":[0,3]},"
             "\"b\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[3,6]}}",
             kData, 6);
    CU_ASSERT_EQUAL_FATAL(kf_st_open_file(&set, path, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_st_find(&set, "a")->ndim, 8);
    kf_st_close(&set);
}

/* The process's resident file-backed memory (RssFile of /proc/self/status), in kB; -1 unknown. */
static long rss_file_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "RssFile: %ld kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

/* kf_st_release_pages: the embedding's 1.6 MB leave the resident set once read (at least half of
 * them by the kernel's approximate counters), and read back the same bytes afterwards (the
 * mapping stays valid). */
static void test_release_pages(void) {
    kf_st_set set;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_st_open_file(&set, kf_test_data("hf-qwen3-tiny/model.safetensors"), &err), KF_OK);
    const kf_st_tensor *t = kf_st_find(&set, "model.embed_tokens.weight");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    uint64_t sum = 0, again = 0;
    for (size_t i = 0; i < t->nbytes; i++) /* fault every page in */
        sum = sum * 31 + ((const unsigned char *)t->data)[i];
    const long before = rss_file_kb();
    kf_st_release_pages(&set, t);
    const long after = rss_file_kb();
    CU_ASSERT_FATAL(before > 0 && after >= 0);
    /* the kernel's RSS counters are per-CPU approximations (off by tens of pages): half of it */
    CU_ASSERT(before - after >= (long)(t->nbytes / 2048));
    if (before - after < (long)(t->nbytes / 2048))
        fprintf(stderr, "\n    RssFile %ld -> %ld kB for a %zu-byte tensor\n", before, after, t->nbytes);
    for (size_t i = 0; i < t->nbytes; i++)
        again = again * 31 + ((const unsigned char *)t->data)[i];
    CU_ASSERT_EQUAL(sum, again);
    kf_st_close(&set);
}

static void test_real_fixture(void) {
    char path[4096];
    snprintf(path, sizeof path, "%s", kf_test_data("hf-qwen3-tiny/model.safetensors"));
    kf_st_set set;
    kf_error err = {0};
    kf_status st = kf_st_open_file(&set, path, &err);
    if (st != KF_OK)
        fprintf(stderr, "\n    %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    CU_ASSERT_EQUAL(set.n_tensors, 46); /* 47 header keys, one is __metadata__ */
    const kf_st_tensor *t = kf_st_find(&set, "model.embed_tokens.weight");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_EQUAL(t->dtype, KF_DTYPE_BF16);
    CU_ASSERT_EQUAL(t->ndim, 2);
    CU_ASSERT_EQUAL(t->shape[0], 3200);
    CU_ASSERT_EQUAL(t->shape[1], 256);
    CU_ASSERT_EQUAL(t->numel, 3200 * 256);
    CU_ASSERT_EQUAL(t->nbytes, 3200 * 256 * 2);
    t = kf_st_find(&set, "model.layers.0.input_layernorm.weight");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_EQUAL(t->ndim, 1);
    CU_ASSERT_EQUAL(t->shape[0], 256);
    CU_ASSERT_PTR_NOT_NULL(kf_st_find(&set, "model.layers.3.self_attn.q_norm.weight"));
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "lm_head.weight")); /* tied */
    /* every tensor lies inside the mapping */
    const unsigned char *lo = set.files[0].map, *hi = lo + set.files[0].size;
    for (size_t i = 0; i < set.n_tensors; i++) {
        const unsigned char *p = set.tensors[i].data;
        CU_ASSERT(p >= lo + 8 + set.files[0].header_len && p + set.tensors[i].nbytes <= hi);
    }
    kf_st_close(&set);

    /* the same through kf_st_open_dir */
    snprintf(path, sizeof path, "%s", kf_test_data("hf-qwen3-tiny"));
    CU_ASSERT_EQUAL_FATAL(kf_st_open_dir(&set, path, &err), KF_OK);
    CU_ASSERT_EQUAL(set.n_files, 1);
    CU_ASSERT_EQUAL(set.n_tensors, 46);
    CU_ASSERT_PTR_NOT_NULL(kf_st_find(&set, "model.norm.weight"));
    kf_st_close(&set);
}

/* ---- malformed files ------------------------------------------------------------------- */

static void test_bad_length_prefix(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", kf_test_write_file("empty.safetensors", "", 0));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "truncated");
    snprintf(path, sizeof path, "%s", kf_test_write_file("short.safetensors", "\x10\0\0\0\0", 5));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "truncated");
    snprintf(path, sizeof path, "%s", kf_test_write_file("seven.safetensors", "\x02\0\0\0\0\0\0", 7));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "8-byte");

    const char *json = "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}";
    /* header length larger than the rest of the file */
    write_st_hlen(path, sizeof path, "hlen-long.safetensors", strlen(json) + 5, json, kData, 4);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "runs past the end");
    write_st_hlen(path, sizeof path, "hlen-long2.safetensors", strlen(json) + 1000, json, kData, 4);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "truncated");
    /* only the 8-byte prefix, claiming a header */
    write_st_hlen(path, sizeof path, "prefix-only.safetensors", 2, "", NULL, 0);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "runs past the end");
    /* absurd header lengths */
    write_st_hlen(path, sizeof path, "absurd.safetensors", 1ULL << 60, json, kData, 4);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "absurd");
    write_st_hlen(path, sizeof path, "absurd2.safetensors", (uint64_t)KF_ST_MAX_HEADER + 1, json, kData, 4);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "absurd");
    write_st_hlen(path, sizeof path, "absurd3.safetensors", UINT64_MAX, json, kData, 4);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "absurd");
    /* header too short to be an object */
    write_st_hlen(path, sizeof path, "tiny-header.safetensors", 0, "", kData, 4);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "JSON object");
    write_st(path, sizeof path, "one-byte-header.safetensors", "{", NULL, 0);
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "JSON object");
}

static void test_truncated_file(void) {
    /* a valid file cut in the data section, then in the header */
    size_t n;
    unsigned char *b = st_bytes(strlen(kValidJson), kValidJson, valid_data, VALID_DLEN, &n);
    char path[512];
    snprintf(path, sizeof path, "%s", kf_test_write_file("cut-data.safetensors", b, n - 10));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "outside the data section");
    snprintf(path, sizeof path, "%s", kf_test_write_file("cut-data1.safetensors", b, n - 1));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "data_offsets");
    snprintf(path, sizeof path, "%s", kf_test_write_file("cut-header.safetensors", b, 8 + strlen(kValidJson) / 2));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "truncated");
    snprintf(path, sizeof path, "%s", kf_test_write_file("cut-prefix.safetensors", b, 8));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "truncated");
    free(b);
}

static void test_bad_json(void) {
    EXPECT_HEADER_FAIL("{not json}", 0, KF_ERR_FORMAT, "not valid JSON");
    EXPECT_HEADER_FAIL("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}", 4, KF_ERR_FORMAT,
                       "not valid JSON");
    EXPECT_HEADER_FAIL("{\"a\":1} trailing", 0, KF_ERR_FORMAT, "not valid JSON");
    EXPECT_HEADER_FAIL("[1, 2, 3]", 0, KF_ERR_FORMAT, "not an object");
    EXPECT_HEADER_FAIL("\"a string\"", 0, KF_ERR_FORMAT, "JSON");
    EXPECT_HEADER_FAIL("42", 0, KF_ERR_FORMAT, "JSON");
    /* duplicate keys are refused by the JSON parser */
    EXPECT_HEADER_FAIL("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                       "\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}",
                       4, KF_ERR_FORMAT, "duplicate");
    /* a NUL byte inside the header */
    char path[512];
    static const char nul[] = "{\"a\":{\"dtype\":\"U8\",\"sh\0pe\":[2],\"data_offsets\":[0,2]}}";
    size_t n;
    unsigned char *b = st_bytes(sizeof nul - 1, "", NULL, 0, &n);
    unsigned char *full = malloc(8 + sizeof nul - 1 + 2);
    memcpy(full, b, 8);
    memcpy(full + 8, nul, sizeof nul - 1);
    memcpy(full + 8 + sizeof nul - 1, "xy", 2);
    snprintf(path, sizeof path, "%s", kf_test_write_file("nul.safetensors", full, 8 + sizeof nul - 1 + 2));
    EXPECT_FILE_FAIL(path, KF_ERR_FORMAT, "JSON");
    free(b);
    free(full);
}

static void test_bad_entries(void) {
    EXPECT_HEADER_FAIL2("{\"x\":3}", 0, KF_ERR_FORMAT, "'x'", "not an object");
    EXPECT_HEADER_FAIL2("{\"x\":[1,2]}", 0, KF_ERR_FORMAT, "'x'", "not an object");
    EXPECT_HEADER_FAIL2("{\"__metadata__\":[1]}", 0, KF_ERR_FORMAT, "__metadata__", "not an object");
    /* missing or mistyped fields */
    EXPECT_HEADER_FAIL2("{\"w\":{\"shape\":[2],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'", "dtype");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'", "shape");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2]}}", 2, KF_ERR_FORMAT, "'w'", "data_offsets");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":3,\"shape\":[2],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'", "dtype");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":2,\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "shape");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":\"0,2\"}}", 2, KF_ERR_FORMAT, "'w'",
                        "data_offsets");
    /* unknown dtypes are well-formed but unsupported */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, KF_ERR_UNSUPPORTED,
                        "'w'", "unknown dtype 'F8_E4M3'");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"bf16\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, KF_ERR_UNSUPPORTED,
                        "'w'", "unknown dtype");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, KF_ERR_UNSUPPORTED, "'w'",
                        "dtype");
    /* shapes */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "shape[0]");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2,-3],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "shape[1]");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2.5],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "non-negative integer");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2.0],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "non-negative integer");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "shape[0]");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[null],\"data_offsets\":[0,2]}}", 2, KF_ERR_FORMAT, "'w'",
                        "shape[0]");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,2]}}", 2,
                        KF_ERR_FORMAT, "'w'", "dimensions");
    /* shape product overflowing 64 bits: in the element count, and in count * element size */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,2]}}", 2,
                        KF_ERR_FORMAT, "'w'", "overflow");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[4294967297,4294967297,0],\"data_offsets\":[0,0]}}", 0,
                        KF_ERR_FORMAT, "'w'", "overflow");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 0,
                        KF_ERR_FORMAT, "'w'", "overflow");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"I64\",\"shape\":[2305843009213693952,1],\"data_offsets\":[0,0]}}", 0,
                        KF_ERR_FORMAT, "'w'", "overflow");
    /* the largest JSON integer as a dimension: 2^64 - 2 bytes, which no data section holds */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"BF16\",\"shape\":[9223372036854775807],\"data_offsets\":[0,0]}}", 0,
                        KF_ERR_FORMAT, "'w'", "bytes");
}

static void test_bad_offsets(void) {
    /* past the end of the data section */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", 4, KF_ERR_FORMAT, "'w'",
                        "outside the data section");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[5,5]}}", 4, KF_ERR_FORMAT, "'w'",
                        "outside the data section");
    /* an offset beyond int64 is refused by the JSON parser */
    EXPECT_HEADER_FAIL("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[18446744073709551615,0]}}", 4,
                       KF_ERR_FORMAT, "JSON");
    /* begin > end */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,2]}}", 4, KF_ERR_FORMAT, "'w'",
                        "[4, 2]");
    /* malformed offsets */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[-2,0]}}", 4, KF_ERR_FORMAT, "'w'",
                        "non-negative");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0]}}", 4, KF_ERR_FORMAT, "'w'",
                        "two non-negative integers");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2,4]}}", 4, KF_ERR_FORMAT, "'w'",
                        "two non-negative integers");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2.0]}}", 4, KF_ERR_FORMAT, "'w'",
                        "two non-negative integers");
    /* dtype x shape != byte length */
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,6]}}", 8, KF_ERR_FORMAT, "'w'",
                        "holds 8 bytes");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 16, KF_ERR_FORMAT,
                        "'w'", "span 16 bytes");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,4]}}", 4, KF_ERR_FORMAT, "'w'",
                        "holds 0 bytes");
    EXPECT_HEADER_FAIL2("{\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}}", 4, KF_ERR_FORMAT, "'w'",
                        "holds 4 bytes");
}

static void test_overlap(void) {
    /* partial overlap */
    EXPECT_HEADER_FAIL2("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                        "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}",
                        8, KF_ERR_FORMAT, "overlap", "'a'");
    /* identical spans (aliasing) */
    EXPECT_HEADER_FAIL2("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                        "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                        4, KF_ERR_FORMAT, "overlap", "'b'");
    /* one inside another, listed in reverse order */
    EXPECT_HEADER_FAIL2("{\"in\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[3,5]},"
                        "\"out\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}",
                        8, KF_ERR_FORMAT, "overlap", "'out'");
    /* a big tensor containing a later one that is not next to it in offset order */
    EXPECT_HEADER_FAIL2("{\"big\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
                        "\"s1\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]},"
                        "\"s2\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[10,12]}}",
                        16, KF_ERR_FORMAT, "overlap", "'big'");
    /* an overlap with an empty tensor between the two in offset order */
    EXPECT_HEADER_FAIL2("{\"big\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
                        "\"empty\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,4]},"
                        "\"small\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[8,10]}}",
                        16, KF_ERR_FORMAT, "overlap", "'small'");
}

static void test_not_a_file(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", kf_test_make_dir("a-directory.safetensors"));
    EXPECT_FILE_FAIL(path, KF_ERR_IO, "not a regular file");
    snprintf(path, sizeof path, "%s", kf_test_make_dir("no-such-dir"));
    strcat(path, "/missing.safetensors");
    EXPECT_FILE_FAIL(path, KF_ERR_IO, "cannot open");
    EXPECT_FILE_FAIL("/nonexistent/kvfold/model.safetensors", KF_ERR_IO, "No such file");
}

/* ---- sharded checkpoints --------------------------------------------------------------- */

static const char kShard1[] = "{\"__metadata__\":{\"format\":\"pt\"},"
                              "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                              "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[8,16]}}";
static const char kShard2[] = "{\"c\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}";

/* A directory name unique per call; the path goes into out. */
static void make_dir(char *out, size_t outsz, const char *name) {
    snprintf(out, outsz, "%s", kf_test_make_dir(name));
}

static void put_file(const char *dir, const char *name, const void *bytes, size_t n) {
    char rel[1024];
    /* kf_test_write_file takes a name relative to the temp root: the directory's last component */
    const char *slash = strrchr(dir, '/');
    snprintf(rel, sizeof rel, "%s/%s", slash ? slash + 1 : dir, name);
    kf_test_write_file(rel, bytes, n);
}

static void put_shard(const char *dir, const char *name, const char *json, size_t dlen) {
    size_t n;
    unsigned char *b = st_bytes(strlen(json), json, kData, dlen, &n);
    put_file(dir, name, b, n);
    free(b);
}

static void put_text(const char *dir, const char *name, const char *text) {
    put_file(dir, name, text, strlen(text));
}

/* A directory with the two good shards and the given index. */
static void make_sharded(char *dir, size_t dirsz, const char *name, const char *index) {
    make_dir(dir, dirsz, name);
    put_shard(dir, "model-00001-of-00002.safetensors", kShard1, 16);
    put_shard(dir, "model-00002-of-00002.safetensors", kShard2, 8);
    if (index)
        put_text(dir, "model.safetensors.index.json", index);
}

static const char kGoodIndex[] = "{\"metadata\":{\"total_size\":24},\"weight_map\":{"
                                 "\"a\":\"model-00001-of-00002.safetensors\","
                                 "\"c\":\"model-00002-of-00002.safetensors\","
                                 "\"b\":\"model-00001-of-00002.safetensors\"}}";

static void expect_dir_fail_at(const char *dir, kf_status code, const char *kw1, const char *kw2, unsigned line) {
    kf_st_set set;
    kf_error err = {0};
    kf_status st = kf_st_open_dir(&set, dir, &err);
    int ok = st == code && strstr(err.msg, kw1) && (!kw2 || strstr(err.msg, kw2));
    if (!ok)
        fprintf(stderr, "\n    line %u: status %s (want %s), message: %s\n", line, kf_status_name(st),
                kf_status_name(code), err.msg);
    ASSERT_AT(st == code, line);
    ASSERT_AT(strstr(err.msg, kw1) != NULL, line);
    if (kw2)
        ASSERT_AT(strstr(err.msg, kw2) != NULL, line);
    if (st == KF_OK)
        kf_st_close(&set);
    else /* a failed open leaves nothing behind */
        ASSERT_AT(set.n_tensors == 0 && set.tensors == NULL && set.n_files == 0 && set.files == NULL, line);
}
#define EXPECT_DIR_FAIL(dir, code, kw1, kw2) expect_dir_fail_at((dir), (code), (kw1), (kw2), __LINE__)

static void test_sharded_ok(void) {
    char dir[512];
    make_sharded(dir, sizeof dir, "sharded-ok", kGoodIndex);
    kf_st_set set;
    kf_error err = {0};
    kf_status st = kf_st_open_dir(&set, dir, &err);
    if (st != KF_OK)
        fprintf(stderr, "\n    %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, KF_OK);
    CU_ASSERT_EQUAL(set.n_files, 2);
    CU_ASSERT_EQUAL(set.n_tensors, 3);
    const kf_st_tensor *a = kf_st_find(&set, "a"), *b = kf_st_find(&set, "b"), *c = kf_st_find(&set, "c");
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "d"));
    CU_ASSERT_PTR_NOT_NULL(strstr(set.files[a->file].path, "model-00001-of-00002.safetensors"));
    CU_ASSERT_PTR_NOT_NULL(strstr(set.files[b->file].path, "model-00001-of-00002.safetensors"));
    CU_ASSERT_PTR_NOT_NULL(strstr(set.files[c->file].path, "model-00002-of-00002.safetensors"));
    CU_ASSERT_NOT_EQUAL(a->file, c->file);
    CU_ASSERT_EQUAL(a->dtype, KF_DTYPE_F32);
    CU_ASSERT_EQUAL(b->shape[1], 2);
    CU_ASSERT_EQUAL(c->dtype, KF_DTYPE_I64);
    /* each pointer is in its own shard's data section */
    const kf_st_file *f1 = &set.files[a->file], *f2 = &set.files[c->file];
    CU_ASSERT_PTR_EQUAL(a->data, (const unsigned char *)f1->map + 8 + f1->header_len);
    CU_ASSERT_PTR_EQUAL(b->data, (const unsigned char *)f1->map + 8 + f1->header_len + 8);
    CU_ASSERT_PTR_EQUAL(c->data, (const unsigned char *)f2->map + 8 + f2->header_len);
    CU_ASSERT_EQUAL(memcmp(c->data, kData, 8), 0);
    CU_ASSERT_EQUAL(memcmp(b->data, kData + 8, 8), 0);
    kf_st_close(&set);

    /* the index wins over a stray model.safetensors */
    put_shard(dir, "model.safetensors", "{\"zzz\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
    CU_ASSERT_EQUAL_FATAL(kf_st_open_dir(&set, dir, &err), KF_OK);
    CU_ASSERT_EQUAL(set.n_files, 2);
    CU_ASSERT_PTR_NULL(kf_st_find(&set, "zzz"));
    kf_st_close(&set);

    /* a single model.safetensors */
    make_dir(dir, sizeof dir, "single-ok");
    put_shard(dir, "model.safetensors", kShard1, 16);
    CU_ASSERT_EQUAL_FATAL(kf_st_open_dir(&set, dir, &err), KF_OK);
    CU_ASSERT_EQUAL(set.n_files, 1);
    CU_ASSERT_EQUAL(set.n_tensors, 2);
    CU_ASSERT_PTR_NOT_NULL(kf_st_find(&set, "b"));
    kf_st_close(&set);
}

static void test_sharded_bad(void) {
    char dir[512];

    /* an index naming a shard that does not exist */
    make_sharded(dir, sizeof dir, "sharded-missing",
                 "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                 "\"b\":\"model-00001-of-00002.safetensors\",\"c\":\"model-00003-of-00003.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_IO, "model-00003-of-00003.safetensors", "cannot open");

    /* shard names that leave the directory */
    make_sharded(dir, sizeof dir, "sharded-slash", "{\"weight_map\":{\"a\":\"sub/model-00001-of-00002.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "sub/model-00001-of-00002.safetensors", "plain file name");
    make_sharded(dir, sizeof dir, "sharded-dotdot",
                 "{\"weight_map\":{\"a\":\"../sharded-ok/model-00001-of-00002.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "../sharded-ok", "plain file name");
    make_sharded(dir, sizeof dir, "sharded-dotdot2", "{\"weight_map\":{\"a\":\"..\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "'..'", "plain file name");
    make_sharded(dir, sizeof dir, "sharded-abs", "{\"weight_map\":{\"a\":\"/etc/passwd\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "/etc/passwd", "plain file name");
    make_sharded(dir, sizeof dir, "sharded-emptyname", "{\"weight_map\":{\"a\":\"\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "plain file name");
    make_sharded(dir, sizeof dir, "sharded-notstring", "{\"weight_map\":{\"a\":1}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "weight_map['a']", "not a file name");

    /* a tensor mapped to the wrong shard */
    make_sharded(dir, sizeof dir, "sharded-wrong",
                 "{\"weight_map\":{\"a\":\"model-00002-of-00002.safetensors\","
                 "\"b\":\"model-00001-of-00002.safetensors\",\"c\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "'a'", "model-00002-of-00002.safetensors");
    /* a tensor in the index that is in no shard */
    make_sharded(dir, sizeof dir, "sharded-ghost",
                 "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                 "\"ghost\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "'ghost'", "not there");

    /* the same tensor in two shards */
    make_dir(dir, sizeof dir, "sharded-dup");
    put_shard(dir, "model-00001-of-00002.safetensors", kShard1, 16);
    put_shard(dir, "model-00002-of-00002.safetensors",
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    put_text(dir, "model.safetensors.index.json",
             "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
             "\"b\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "'a'", "appears in both");

    /* a malformed shard is reported under the shard's name */
    make_dir(dir, sizeof dir, "sharded-badshard");
    put_shard(dir, "model-00001-of-00002.safetensors", kShard1, 16);
    put_shard(dir, "model-00002-of-00002.safetensors",
              "{\"c\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8);
    put_text(dir, "model.safetensors.index.json", kGoodIndex);
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model-00002-of-00002.safetensors", "outside the data section");

    /* index that is not JSON, or has no weight_map */
    make_sharded(dir, sizeof dir, "sharded-notjson", "{\"weight_map\": {\"a\": ");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "not valid JSON");
    make_sharded(dir, sizeof dir, "sharded-emptyindex", "");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "JSON");
    make_sharded(dir, sizeof dir, "sharded-noweightmap", "{\"metadata\":{}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "weight_map");
    make_sharded(dir, sizeof dir, "sharded-array", "[\"model-00001-of-00002.safetensors\"]");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "weight_map");
    make_sharded(dir, sizeof dir, "sharded-wm-array", "{\"weight_map\":[]}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "weight_map");
    make_sharded(dir, sizeof dir, "sharded-dupkey",
                 "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                 "\"a\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_FAIL(dir, KF_ERR_FORMAT, "model.safetensors.index.json", "duplicate");

    /* neither file */
    make_dir(dir, sizeof dir, "sharded-none");
    put_text(dir, "config.json", "{}");
    EXPECT_DIR_FAIL(dir, KF_ERR_NOTFOUND, dir, "model.safetensors");
    EXPECT_DIR_FAIL("/nonexistent/kvfold-model", KF_ERR_NOTFOUND, "/nonexistent/kvfold-model", NULL);
    /* model.safetensors that is a directory */
    make_dir(dir, sizeof dir, "single-isdir");
    kf_test_make_dir("single-isdir/model.safetensors");
    EXPECT_DIR_FAIL(dir, KF_ERR_IO, "model.safetensors", "not a regular file");
}

/* An index whose weight_map is empty names no shard: it must not crash (an empty set or a
 * clear refusal are both acceptable). */
static void test_sharded_empty_weight_map(void) {
    char dir[512];
    make_sharded(dir, sizeof dir, "sharded-emptymap", "{\"weight_map\":{}}");
    kf_st_set set;
    kf_error err = {0};
    kf_status st = kf_st_open_dir(&set, dir, &err);
    if (st == KF_OK) {
        CU_ASSERT_EQUAL(set.n_tensors, 0);
        CU_ASSERT_PTR_NULL(kf_st_find(&set, "a"));
        kf_st_close(&set);
    } else {
        CU_ASSERT(err.msg[0] != 0);
    }
}

/* ---- mutation: the reader must never crash -------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void test_mutations(void) {
    size_t n;
    unsigned char *good = st_bytes(strlen(kValidJson), kValidJson, valid_data, VALID_DLEN, &n);
    unsigned char *buf = malloc(n);
    static const char jsonish[] = "0123456789[]{},:\"-.eE \\x";
    uint64_t seed = 0x6b76666f6c64ULL; /* fixed: the run is deterministic */
    int n_ok = 0, n_fail = 0;
    for (int it = 0; it < 300; it++) {
        memcpy(buf, good, n);
        size_t len = n;
        uint64_t r = rng_next(&seed);
        size_t pos = (size_t)(rng_next(&seed) % n);
        int kind = (int)(r % 5);
        switch (kind) {
        case 0: /* flip one bit */ buf[pos] ^= (unsigned char)(1u << (r >> 8 & 7)); break;
        case 1: /* a JSON-ish character: keeps the header parseable more often */
            buf[pos] = (unsigned char)jsonish[(r >> 8) % (sizeof jsonish - 1)];
            break;
        case 2: /* truncate */ len = pos; break;
        case 3: /* a random byte in the length prefix or anywhere */
            buf[(r >> 16) & 1 ? pos % 8 : pos] = (unsigned char)(r >> 24);
            break;
        default: /* a digit in the header replaced by another digit */
            for (size_t k = 0; k < n; k++) {
                size_t q = 8 + (pos + k) % strlen(kValidJson);
                if (buf[q] >= '0' && buf[q] <= '9') {
                    buf[q] = (unsigned char)('0' + (r >> 8) % 10);
                    break;
                }
            }
            break;
        }
        char path[512];
        snprintf(path, sizeof path, "%s", kf_test_write_file("mutant.safetensors", buf, len));
        kf_st_set set;
        kf_error err = {0};
        kf_status st = kf_st_open_file(&set, path, &err);
        if (st == KF_OK) {
            n_ok++;
            CU_ASSERT_EQUAL(set.n_files, 1);
            const unsigned char *lo = (const unsigned char *)set.files[0].map + 8 + set.files[0].header_len;
            const unsigned char *hi = (const unsigned char *)set.files[0].map + set.files[0].size;
            unsigned sum = 0;
            for (size_t i = 0; i < set.n_tensors; i++) {
                const kf_st_tensor *t = &set.tensors[i];
                const unsigned char *p = t->data;
                CU_ASSERT(p >= lo && p <= hi && t->nbytes <= (size_t)(hi - p));
                CU_ASSERT_EQUAL(t->nbytes, (size_t)t->numel * kf_dtype_size(t->dtype));
                CU_ASSERT_PTR_EQUAL(kf_st_find(&set, t->name), t);
                if (p >= lo && p <= hi && t->nbytes <= (size_t)(hi - p))
                    for (size_t k = 0; k < t->nbytes; k++)
                        sum += p[k]; /* touch every byte */
            }
            (void)sum;
            kf_st_close(&set);
        } else {
            n_fail++;
            if (err.msg[0] == 0)
                fprintf(stderr, "\n    mutation %d (kind %d at %zu): status %s with an empty message\n", it, kind, pos,
                        kf_status_name(st));
            CU_ASSERT(err.msg[0] != 0);
            CU_ASSERT(st == KF_ERR_FORMAT || st == KF_ERR_UNSUPPORTED);
            CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, path));
            CU_ASSERT(set.n_tensors == 0 && set.tensors == NULL);
        }
    }
    printf("\n    300 mutants: %d opened, %d refused", n_ok, n_fail);
    CU_ASSERT(n_fail > 0);
    free(buf);
    free(good);
}

/* ---- non-finite values ------------------------------------------------------------------ */

/* n elements of dtype dt at an odd (unaligned) address: finite patterns everywhere (the largest
 * finite value, subnormals, -0), then NaN or +-Inf at chosen indices; the scan must report the
 * first one. F32 and F64 are checked against isnan/isinf of the values themselves. */
static void check_nonfinite(kf_dtype dt, size_t esz) {
    enum { N = 3000 };
    unsigned char *buf = calloc(N * 8 + 1, 1), *data = buf + 1;
    const uint64_t maxfin = esz == 2   ? (dt == KF_DTYPE_BF16 ? 0x7f7f : 0x7bff)
                            : esz == 4 ? 0x7f7fffffull
                                       : 0x7fefffffffffffffull;
    const uint64_t sign = 1ull << (esz * 8 - 1);
    const uint64_t inf = esz == 2   ? (dt == KF_DTYPE_BF16 ? 0x7f80 : 0x7c00)
                         : esz == 4 ? 0x7f800000ull
                                    : 0x7ff0000000000000ull;
    for (size_t i = 0; i < N; i++) {
        const uint64_t v = i % 4 == 0 ? maxfin : i % 4 == 1 ? (maxfin | sign) : i % 4 == 2 ? 1 : sign;
        memcpy(data + i * esz, &v, esz); /* little-endian host */
    }
    kf_st_tensor t = {.dtype = dt, .ndim = 1, .shape = {N}, .numel = N, .data = data, .nbytes = N * esz};
    int is_nan = 7;
    CU_ASSERT_EQUAL(kf_st_first_nonfinite(&t, &is_nan), -1);
    const struct {
        size_t at;
        uint64_t bits;
        int nan;
    } cases[] = {{2999, inf, 0}, {1500, inf | sign, 0}, {1023, inf | 1, 1}, {0, inf | sign | (inf >> 1), 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        memcpy(data + cases[c].at * esz, &cases[c].bits, esz);
        if (dt == KF_DTYPE_F32) {
            float f;
            memcpy(&f, data + cases[c].at * esz, 4);
            CU_ASSERT(cases[c].nan ? isnan(f) : isinf(f));
        } else if (dt == KF_DTYPE_F64) {
            double f;
            memcpy(&f, data + cases[c].at * esz, 8);
            CU_ASSERT(cases[c].nan ? isnan(f) : isinf(f));
        }
        CU_ASSERT_EQUAL(kf_st_first_nonfinite(&t, &is_nan), (int64_t)cases[c].at);
        CU_ASSERT_EQUAL(is_nan, cases[c].nan);
    }
    free(buf);
}

static void test_first_nonfinite(void) {
    check_nonfinite(KF_DTYPE_BF16, 2);
    check_nonfinite(KF_DTYPE_F16, 2);
    check_nonfinite(KF_DTYPE_F32, 4);
    check_nonfinite(KF_DTYPE_F64, 8);
    /* integers have no NaN: all-ones bit patterns are ordinary values */
    unsigned char ones[64];
    memset(ones, 0xff, sizeof ones);
    kf_st_tensor t = {.dtype = KF_DTYPE_I32, .ndim = 1, .shape = {16}, .numel = 16, .data = ones, .nbytes = 64};
    CU_ASSERT_EQUAL(kf_st_first_nonfinite(&t, NULL), -1);
    t.dtype = KF_DTYPE_U16;
    t.numel = t.shape[0] = 32;
    CU_ASSERT_EQUAL(kf_st_first_nonfinite(&t, NULL), -1);
    /* the real fixture is finite */
    kf_st_set set = {0};
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_st_open_file(&set, kf_test_data("hf-qwen3-tiny/model.safetensors"), &err), KF_OK);
    for (size_t i = 0; i < set.n_tensors; i++)
        CU_ASSERT_EQUAL(kf_st_first_nonfinite(&set.tensors[i], NULL), -1);
    kf_st_close(&set);
}

static int suite_init(void) {
    init_data();
    make_valid_data();
    return 0;
}

static CU_TestInfo valid_tests[] = {
    {"valid file: BF16/F16/F32/I64, metadata, empty and scalar tensors", test_valid_file},
    {"dtype sizes and names", test_dtype_table},
    {"every known dtype", test_all_dtypes},
    {"accepted edge cases", test_valid_edge_cases},
    {"real fixture hf-qwen3-tiny/model.safetensors", test_real_fixture},
    {"released pages leave the resident set and read back the same", test_release_pages},
    {"first NaN or infinity of BF16/F16/F32/F64 tensors", test_first_nonfinite},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo malformed_tests[] = {
    {"length prefix: empty, short, too long, absurd", test_bad_length_prefix},
    {"truncated files", test_truncated_file},
    {"header not JSON, not an object, duplicate keys", test_bad_json},
    {"bad entries: fields, dtype, shape, overflow", test_bad_entries},
    {"bad data_offsets and byte lengths", test_bad_offsets},
    {"overlapping tensors", test_overlap},
    {"directory and missing file", test_not_a_file},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo sharded_tests[] = {
    {"index with two shards; single file", test_sharded_ok},
    {"bad indexes and shards", test_sharded_bad},
    {"empty weight_map", test_sharded_empty_weight_map},
    CU_TEST_INFO_NULL,
};
static CU_TestInfo fuzz_tests[] = {
    {"300 seeded mutations never crash", test_mutations},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"valid", suite_init, NULL, NULL, NULL, valid_tests},
    {"malformed", suite_init, NULL, NULL, NULL, malformed_tests},
    {"sharded", suite_init, NULL, NULL, NULL, sharded_tests},
    {"mutation", suite_init, NULL, NULL, NULL, fuzz_tests},
    CU_SUITE_INFO_NULL,
};

int main(void) {
    return kf_test_main(suites);
}
