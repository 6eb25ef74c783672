/* kvf.c — the file's spellings, names, digests, paths and the HDF5 glue shared by the kvf reader
 * and writer. */
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "formats/escape.h"
#include "formats/kvf_internal.h"

/* ---- names ---- */

static const char *const kFrames[] = {"compacted", "original"};

/* The file's own spellings of the methods and dtypes it stores (kvf.h): written and read through
 * these tables only, so that no change to the program's names or numbers changes a file. */
const char *const kvf_method_attrs[KVF_N_METHODS] = {"keep", "drop", "am", "fold"}; /* by head_method byte */
const char *const kvf_dtype_attrs[KVF_N_DTYPES] = {"bfloat16", "float16", "float32"};
const kf_dtype kvf_dtype_of_attr[KVF_N_DTYPES] = {KF_DTYPE_BF16, KF_DTYPE_F16, KF_DTYPE_F32};
/* a head_method byte is the head's kf_method */
_Static_assert(KF_METHOD_KEEP == 0 && KF_METHOD_DROP == 1 && KF_METHOD_AM == 2 && KF_METHOD_FOLD == 3 &&
                   KVF_N_METHODS == KF_METHOD_COUNT,
               "kvf: the head_method bytes are kf_method's numbers");

void kvf_header_init(kvf_header *h) {
    memset(h, 0, sizeof *h);
    h->version = KVF_VERSION;
    snprintf(h->creator, sizeof h->creator, "kvfold %s", KVFOLD_VERSION);
    h->method = KF_METHOD_FOLD;
    h->budget = 1.0;
    h->rope_frame = KVF_FRAME_COMPACTED;
    snprintf(h->placeholder, sizeof h->placeholder, "%s", KVF_PLACEHOLDER);
    h->dtype = KF_DTYPE_BF16;
    h->block_size = KVF_BLOCK;
    memset(h->recipe_digest, '0', KVF_DIGEST_LEN);
}

const char *kvf_rope_frame_name(kvf_rope_frame f) {
    return (unsigned)f < 2 ? kFrames[f] : "?";
}

const char *kvf_method_attr(kf_method m) {
    return (unsigned)m < KVF_N_METHODS ? kvf_method_attrs[m] : NULL;
}

const char *kvf_dtype_attr(kf_dtype d) {
    for (int i = 0; i < KVF_N_DTYPES; i++)
        if (kvf_dtype_of_attr[i] == d)
            return kvf_dtype_attrs[i];
    return NULL;
}

int kvf_method_from_attr(const char *s, kf_method *out) {
    for (int i = 0; i < KVF_N_METHODS; i++)
        if (strcmp(s, kvf_method_attrs[i]) == 0) {
            *out = (kf_method)i;
            return 0;
        }
    return -1;
}

int kvf_dtype_parse(const char *s, kf_dtype *out) {
    kf_dtype d;
    if (kf_dtype_parse(s, &d) != 0 || !kvf_dtype_attr(d))
        return -1;
    *out = d;
    return 0;
}

int64_t kvf_kv_bytes(const kvf_header *h) {
    return 2 * (int64_t)h->n_layers * h->n_tokens * h->kv_heads * h->head_dim * (int64_t)kf_dtype_size(h->dtype);
}

/* ---- digests and paths ---- */

void kvf_document_digest(const int32_t *ids, int64_t n, char out[KVF_DIGEST_LEN + 1]) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    uint8_t buf[4096];
    size_t used = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int b = 0; b < 4; b++)
            buf[used++] = (uint8_t)(v >> (8 * b));
        if (used == sizeof buf) {
            XXH3_128bits_update(&st, buf, used);
            used = 0;
        }
    }
    for (int b = 0; b < 8; b++)
        buf[used++] = (uint8_t)((uint64_t)n >> (8 * b));
    XXH3_128bits_update(&st, buf, used);
    XXH128_hash_t h = XXH3_128bits_digest(&st);
    snprintf(out, KVF_DIGEST_LEN + 1, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
}

void kvf_format_budget(double budget, char *out, size_t out_len) {
    if (!out || out_len == 0)
        return;
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, out_len, "%.*g", prec, budget);
        if (strtod(out, NULL) == budget)
            return;
    }
}

static bool is_hex(const char *s, size_t len) {
    if (strlen(s) != len)
        return false;
    for (size_t i = 0; i < len; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return false;
    return true;
}

/* mkdir -p; 0 or -1 with errno */
static int make_dirs(char *path) {
    for (char *p = path + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            int rc = mkdir(path, 0777);
            int e = errno;
            *p = c;
            if (rc != 0 && e != EEXIST) {
                errno = e;
                return -1;
            }
            if (!c)
                break;
        }
    }
    struct stat sb;
    if (stat(path, &sb) != 0)
        return -1;
    if (!S_ISDIR(sb.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

kf_status kvf_cache_path(const char *root, const char *model_fp, const char *doc_digest, kf_method method,
                         double budget, const char *recipe_digest, bool create_dirs, char *out, size_t out_len,
                         kf_error *err) {
    if (!root || !*root)
        return kf_fail(err, KF_ERR_INVALID, "kvf: empty cache root");
    if (!model_fp || !is_hex(model_fp, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_INVALID, "kvf: model fingerprint '%s' is not %d hex digits",
                       model_fp ? model_fp : "(null)", KVF_DIGEST_LEN);
    if (!doc_digest || !is_hex(doc_digest, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_INVALID, "kvf: document digest '%s' is not %d hex digits",
                       doc_digest ? doc_digest : "(null)", KVF_DIGEST_LEN);
    if ((unsigned)method > KF_METHOD_FOLD)
        return kf_fail(err, KF_ERR_INVALID, "kvf: unknown method %d", (int)method);
    if (!recipe_digest || !is_hex(recipe_digest, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_INVALID, "kvf: recipe digest '%s' is not %d hex digits",
                       recipe_digest ? recipe_digest : "(null)", KVF_DIGEST_LEN);
    if (!isfinite(budget) || budget <= 0 || budget > 1)
        return kf_fail(err, KF_ERR_INVALID, "kvf: budget %g must be in (0, 1]", budget);
    char b[32];
    kvf_format_budget(budget, b, sizeof b);
    size_t rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/')
        rl--;
    int n = snprintf(out, out_len, "%.*s/%s", (int)rl, root, model_fp);
    if (n < 0 || (size_t)n >= out_len)
        return kf_fail(err, KF_ERR_INVALID, "kvf: cache path under '%s' is too long", root);
    if (create_dirs && make_dirs(out) != 0)
        return kf_fail(err, KF_ERR_IO, "kvf: cannot create directory %s: %s", out, strerror(errno));
    int m = snprintf(out + n, out_len - (size_t)n, "/%s.%s-%s.%.16s.kvf", doc_digest, kvf_method_attr(method), b,
                     recipe_digest);
    if (m < 0 || (size_t)m >= out_len - (size_t)n)
        return kf_fail(err, KF_ERR_INVALID, "kvf: cache path under '%s' is too long", root);
    return KF_OK;
}

/* The parts of a content-addressed base name (kvf_cache_path): true when name has its form. */
typedef struct {
    char digest[KVF_DIGEST_LEN + 1], method[8], budget[32], recipe16[17];
} cache_name;

static bool parse_cache_name(const char *name, cache_name *cn) {
    const size_t n = strlen(name);
    /* <32 hex> "." <method> "-" <budget> "." <16 hex> ".kvf" */
    if (n < KVF_DIGEST_LEN + 1 + 3 + 16 + 5 || name[KVF_DIGEST_LEN] != '.' || strcmp(name + n - 4, ".kvf") != 0 ||
        name[n - 21] != '.')
        return false;
    snprintf(cn->digest, sizeof cn->digest, "%.*s", KVF_DIGEST_LEN, name);
    snprintf(cn->recipe16, sizeof cn->recipe16, "%.16s", name + n - 20);
    const char *mid = name + KVF_DIGEST_LEN + 1, *dash = memchr(mid, '-', (size_t)(name + n - 21 - mid));
    if (!dash || dash - mid >= (ptrdiff_t)sizeof cn->method ||
        name + n - 21 - (dash + 1) >= (ptrdiff_t)sizeof cn->budget)
        return false;
    snprintf(cn->method, sizeof cn->method, "%.*s", (int)(dash - mid), mid);
    snprintf(cn->budget, sizeof cn->budget, "%.*s", (int)(name + n - 21 - (dash + 1)), dash + 1);
    kf_method m;
    return is_hex(cn->digest, KVF_DIGEST_LEN) && is_hex(cn->recipe16, 16) && kvf_method_from_attr(cn->method, &m) == 0;
}

kf_status kvf_check_name(const char *path, const kvf_header *h, kf_error *err) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    cache_name cn;
    if (!parse_cache_name(base, &cn))
        return KF_OK; /* not a content-addressed name: nothing claimed */
    char b[32];
    kvf_format_budget(h->budget, b, sizeof b);
    const char *field = strcmp(cn.digest, h->document_digest)           ? "document"
                        : strcmp(cn.method, kvf_method_attr(h->method)) ? "method"
                        : strcmp(cn.budget, b)                          ? "budget"
                        : strncmp(cn.recipe16, h->recipe_digest, 16)    ? "recipe"
                                                                        : NULL;
    if (!field)
        return KF_OK;
    return kf_fail(err, KF_ERR_MISMATCH,
                   "%s: its name says %s.%s-%s.%s, its header %s.%s-%s.%.16s: the %s differs (a file copied or "
                   "renamed over another's name)",
                   path, cn.digest, cn.method, cn.budget, cn.recipe16, h->document_digest, kf_method_name(h->method),
                   b, h->recipe_digest, field);
}

bool kvf_is_temp_name(const char *name) {
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    const char *t = NULL;
    for (const char *p = strstr(base, ".tmp-"); p; p = strstr(p + 1, ".tmp-"))
        t = p;
    if (!t || t == base)
        return false;
    const char *p = t + 5;
    const char *digits = p;
    while (*p >= '0' && *p <= '9')
        p++;
    if (p == digits || *p != '-')
        return false;
    p++;
    for (int i = 0; i < 16; i++, p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return false;
    return *p == 0;
}

/* ---- temporary files of killed writers ---- */

static struct {
    double older_than, now;
    bool dry_run;
    void (*found)(void *, const char *, double);
    void *ctx;
    int n, failed_errno;
    char failed[512];
} g_clean; /* nftw has no context argument */
static pthread_mutex_t g_clean_lock = PTHREAD_MUTEX_INITIALIZER;

static int clean_visit(const char *path, const struct stat *sb, int type, struct FTW *ftw) {
    (void)ftw;
    if (type != FTW_F || !S_ISREG(sb->st_mode) || !kvf_is_temp_name(path))
        return 0;
    double age = g_clean.now - ((double)sb->st_mtim.tv_sec + 1e-9 * (double)sb->st_mtim.tv_nsec);
    if (age < g_clean.older_than)
        return 0;
    g_clean.n++;
    if (g_clean.found)
        g_clean.found(g_clean.ctx, path, age);
    if (!g_clean.dry_run && unlink(path) != 0 && errno != ENOENT && !g_clean.failed[0]) {
        g_clean.failed_errno = errno;
        snprintf(g_clean.failed, sizeof g_clean.failed, "%s", path);
    }
    return 0;
}

kf_status kvf_clean_temps(const char *root, double older_than_s, bool dry_run,
                          void (*found)(void *ctx, const char *path, double age_s), void *ctx, int *n_found,
                          kf_error *err) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    pthread_mutex_lock(&g_clean_lock);
    memset(&g_clean, 0, sizeof g_clean);
    g_clean.older_than = older_than_s;
    g_clean.now = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    g_clean.dry_run = dry_run;
    g_clean.found = found;
    g_clean.ctx = ctx;
    int rc = nftw(root, clean_visit, 16, FTW_PHYS);
    int e = errno;
    int n = g_clean.n, fe = g_clean.failed_errno;
    char failed[512];
    memcpy(failed, g_clean.failed, sizeof failed);
    pthread_mutex_unlock(&g_clean_lock);
    if (n_found)
        *n_found = n;
    if (rc != 0)
        return kf_fail(err, e == ENOENT ? KF_ERR_NOTFOUND : KF_ERR_IO, "kvf: cannot walk %s: %s", root, strerror(e));
    if (failed[0])
        return kf_fail(err, KF_ERR_IO, "kvf: cannot remove temporary file %s: %s", failed, strerror(fe));
    return KF_OK;
}

/* ---- HDF5 glue ---- */

static pthread_once_t g_quiet_once = PTHREAD_ONCE_INIT;
static void quiet_once(void) {
    H5open();
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

void kvf_h5_quiet(void) {
    pthread_once(&g_quiet_once, quiet_once);
    /* the setting is per thread in a thread-safe HDF5: cheap to repeat for the caller's thread */
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

typedef struct {
    char *buf;
    size_t n;
    bool got, checksum, truncated;
} err_walk;

static herr_t walk_cb(unsigned n, const H5E_error2_t *e, void *data) {
    (void)n;
    err_walk *w = data;
    const char *d = e->desc ? e->desc : "";
    if (strstr(d, "checksum") || strstr(d, "Fletcher"))
        w->checksum = true;
    if (strstr(d, "truncated") || e->min_num == H5E_TRUNCATED)
        w->truncated = true;
    if (!w->got && *d) { /* walking upward: the first entry is the most specific */
        snprintf(w->buf, w->n, "%s (in %s)", d, e->func_name ? e->func_name : "?");
        w->got = true;
    }
    return 0;
}

/* HDF5 clears its error stack at the start of every API call, so helpers that clean up after a
 * failure save it first (kvf_h5_capture) and the caller's kvf_h5_take_error finds it here. */
static _Thread_local struct {
    bool set, checksum, truncated;
    char msg[300];
} t_saved;

static void walk_stack(char *buf, size_t n, bool *checksum, bool *truncated) {
    err_walk w = {.buf = buf, .n = n};
    if (n)
        buf[0] = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, walk_cb, &w);
    H5Eclear2(H5E_DEFAULT);
    *checksum = w.checksum;
    *truncated = w.truncated;
}

void kvf_h5_capture(void) {
    if (H5Eget_num(H5E_DEFAULT) <= 0)
        return;
    walk_stack(t_saved.msg, sizeof t_saved.msg, &t_saved.checksum, &t_saved.truncated);
    t_saved.set = true;
}

void kvf_h5_take_error(char *buf, size_t n, bool *checksum, bool *truncated) {
    bool c = false, t = false;
    if (H5Eget_num(H5E_DEFAULT) > 0) {
        walk_stack(buf, n, &c, &t);
    } else if (t_saved.set) {
        snprintf(buf, n, "%s", t_saved.msg);
        c = t_saved.checksum;
        t = t_saved.truncated;
    } else if (n) {
        snprintf(buf, n, "HDF5 gave no detail");
    }
    t_saved.set = false;
    if (checksum)
        *checksum = c;
    if (truncated)
        *truncated = t;
}

hid_t kvf_h5_type(kf_dtype d) {
    if (d == KF_DTYPE_F32)
        return H5Tcopy(H5T_IEEE_F32LE);
    if (d == KF_DTYPE_BF16)
        return H5Tcopy(H5T_STD_U16LE);
    /* IEEE binary16: sign bit 15, exponent bits 10..14 (bias 15), mantissa bits 0..9 */
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    if (t < 0)
        return t;
    if (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 15) < 0) {
        H5Tclose(t);
        return -1;
    }
    return t;
}

/* x mod 65535 kept in 1..65535 for nonzero x, as one's-complement folding leaves it */
static inline uint64_t fold16(uint64_t x) {
    return x ? (x - 1) % 65535 + 1 : 0;
}

/* AVX2 where the CPU has it (GCC picks the clone at load time) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KVF_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVF_CLONES
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVF_FLETCHER_AVX2 1
enum { FL_T = 128 }; /* 32-byte vectors per block: 2,048 words; lane sums stay below 2^30 */

/* One block of 16 * FL_T big-endian words at p: A = sum w_j, B = sum (N - j) w_j, N = 16 FL_T.
 * Each 32-bit lane keeps its running sum (w) and the sum of running sums (s), adds only; the
 * lanes are told apart at the end (unpacklo/hi interleave words 0-3, 8-11 / 4-7, 12-15). */
__attribute__((target("avx2"))) static void fletcher_block_avx2(const unsigned char *p, uint64_t *A, uint64_t *B) {
    const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1, 0, 3, 2, 5, 4, 7, 6,
                                          9, 8, 11, 10, 13, 12, 15, 14);
    const __m256i z = _mm256_setzero_si256();
    __m256i w1 = z, w2 = z, s1 = z, s2 = z;
    for (int t = 0; t < FL_T; t++) {
        __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * t)), swap);
        w1 = _mm256_add_epi32(w1, _mm256_unpacklo_epi16(x, z));
        w2 = _mm256_add_epi32(w2, _mm256_unpackhi_epi16(x, z));
        s1 = _mm256_add_epi32(s1, w1);
        s2 = _mm256_add_epi32(s2, w2);
    }
    uint32_t a1[8], a2[8], b1[8], b2[8];
    _mm256_storeu_si256((__m256i *)(void *)a1, w1);
    _mm256_storeu_si256((__m256i *)(void *)a2, w2);
    _mm256_storeu_si256((__m256i *)(void *)b1, s1);
    _mm256_storeu_si256((__m256i *)(void *)b2, s2);
    static const uint64_t i1[8] = {0, 1, 2, 3, 8, 9, 10, 11}, i2[8] = {4, 5, 6, 7, 12, 13, 14, 15};
    uint64_t a = 0, b = 0;
    for (int k = 0; k < 8; k++) {
        a += (uint64_t)a1[k] + a2[k];
        b += 16 * ((uint64_t)b1[k] + b2[k]) - i1[k] * a1[k] - i2[k] * a2[k]; /* exact mod 2^64 */
    }
    *A = a;
    *B = b;
}
#endif

uint32_t kvf_fletcher32(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t s1 = 0, s2 = 0;
    size_t words = n / 2;
#ifdef KVF_FLETCHER_AVX2
    if (words >= 16 * (size_t)FL_T && __builtin_cpu_supports("avx2"))
        for (; words >= 16 * (size_t)FL_T; words -= 16 * (size_t)FL_T, p += 32 * FL_T) {
            uint64_t A, B;
            fletcher_block_avx2(p, &A, &B);
            s2 = fold16(s2 + 16 * (uint64_t)FL_T * s1 + B);
            s1 = fold16(s1 + A);
        }
#endif
    while (words > 0) {
        /* 64-bit sums: a fold every 2^16 words keeps s2 below 2^50 */
        size_t k = words < ((size_t)1 << 16) ? words : (size_t)1 << 16;
        words -= k;
        size_t i = 0;
        /* 64 words a step as a plain sum and a weighted sum (32-bit, below 2^28), which the
         * compiler vectorizes; word by word, s2 += s1 is one long chain of adds */
        for (; i + 64 <= k; i += 64, p += 128) {
            uint32_t a = 0, b = 0;
            for (uint32_t j = 0; j < 64; j++) {
                uint32_t w = (uint32_t)p[2 * j] << 8 | p[2 * j + 1];
                a += w;
                b += (64 - j) * w;
            }
            s2 += 64 * s1 + b;
            s1 += a;
        }
        for (; i < k; i++, p += 2) {
            s1 += (uint64_t)p[0] << 8 | p[1];
            s2 += s1;
        }
        s1 = fold16(s1);
        s2 = fold16(s2);
    }
    if (n & 1) {
        s1 = fold16(s1 + ((uint64_t)p[0] << 8));
        s2 = fold16(s2 + s1);
    }
    return (uint32_t)(s2 << 16 | s1);
}

hid_t kvf_h5_fapl(void) {
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl >= 0)
        H5Pset_file_locking(fapl, 0, 1);
    return fapl;
}

/* ---- header checks ---- */

bool kvf_is_hex(const char *s, size_t len) {
    return is_hex(s, len);
}

bool kvf_is_clean_utf8(const char *s) {
    return kf_text_is_plain(s);
}

static bool str_ok(const char *s, size_t cap) {
    return strnlen(s, cap) < cap && kvf_is_clean_utf8(s);
}

int kvf_parse_ids(const char *s, int32_t *out, int cap) {
    int n = 0;
    for (const char *p = s; *p;) {
        int64_t v = 0;
        const char *q = p;
        for (; *q >= '0' && *q <= '9' && v <= INT32_MAX; q++)
            v = v * 10 + (*q - '0');
        if (q == p || v > INT32_MAX || (*q && *q != ',') || (*q == ',' && !q[1]) || n == cap)
            return -1;
        if (out)
            out[n] = (int32_t)v;
        n++;
        p = *q ? q + 1 : q;
    }
    return n;
}

/* The chat record: all empty, or a template digest with id lists. */
static kf_status chat_check(const kvf_header *h, const char *path, kf_error *err) {
    const char *lists[3] = {h->chat_prefix_ids, h->chat_question_prefix_ids, h->chat_question_suffix_ids};
    static const char *const names[3] = {"chat_prefix_ids", "chat_question_prefix_ids", "chat_question_suffix_ids"};
    const bool chat = h->chat_template_digest[0] != 0;
    if (chat && !is_hex(h->chat_template_digest, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_FORMAT, "%s: chat_template_digest '%.40s' is not %d lowercase hex digits", path,
                       h->chat_template_digest, KVF_DIGEST_LEN);
    for (int i = 0; i < 3; i++) {
        if (strnlen(lists[i], KVF_CHAT_IDS_LEN) == KVF_CHAT_IDS_LEN ||
            kvf_parse_ids(lists[i], NULL, KVF_CHAT_IDS_LEN) < 0)
            return kf_fail(err, KF_ERR_FORMAT, "%s: %s '%.40s' is not a list of token ids joined by commas", path,
                           names[i], lists[i]);
        if (!chat && lists[i][0])
            return kf_fail(err, KF_ERR_FORMAT, "%s: %s without a chat_template_digest", path, names[i]);
    }
    return KF_OK;
}

kf_status kvf_header_check(const kvf_header *h, const char *path, kf_error *err) {
    if (!is_hex(h->model_fingerprint, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_FORMAT, "%s: model_fingerprint '%.40s' is not %d lowercase hex digits", path,
                       h->model_fingerprint, KVF_DIGEST_LEN);
    if (!is_hex(h->document_digest, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_FORMAT, "%s: document_digest '%.40s' is not %d lowercase hex digits", path,
                       h->document_digest, KVF_DIGEST_LEN);
    if (!is_hex(h->recipe_digest, KVF_DIGEST_LEN))
        return kf_fail(err, KF_ERR_FORMAT, "%s: recipe_digest '%.40s' is not %d lowercase hex digits", path,
                       h->recipe_digest, KVF_DIGEST_LEN);
    size_t tl = strnlen(h->tokenizer_digest, sizeof h->tokenizer_digest);
    if (tl == sizeof h->tokenizer_digest || !is_hex(h->tokenizer_digest, tl))
        return kf_fail(err, KF_ERR_FORMAT, "%s: tokenizer_digest '%.70s' is not empty or up to 64 lowercase hex digits",
                       path, h->tokenizer_digest);
    if (!str_ok(h->creator, sizeof h->creator) || !str_ok(h->placeholder, sizeof h->placeholder))
        return kf_fail(err, KF_ERR_FORMAT, "%s: creator or placeholder is not a terminated, printable UTF-8 string",
                       path);
    if (strcmp(h->placeholder, KVF_PLACEHOLDER) != 0)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: placeholder '%s' is not \"" KVF_PLACEHOLDER "\", the only placeholder policy of version %d",
                       path, h->placeholder, KVF_VERSION);
    if ((unsigned)h->method > KF_METHOD_FOLD || !kvf_dtype_attr(h->dtype) ||
        (unsigned)h->rope_frame > KVF_FRAME_ORIGINAL)
        return kf_fail(err, KF_ERR_FORMAT, "%s: method, dtype or rope_frame out of range", path);
    if (h->n_layers < 1 || h->n_layers > 4096 || h->kv_heads < 1 || h->kv_heads > 4096 || h->head_dim < 1 ||
        h->head_dim > 65536)
        return kf_fail(err, KF_ERR_FORMAT, "%s: shape n_layers %d, kv_heads %d, head_dim %d is out of range", path,
                       h->n_layers, h->kv_heads, h->head_dim);
    if (h->n_doc_tokens < 1 || h->n_doc_tokens > INT32_MAX || h->n_tokens < 1 || h->n_tokens > h->n_doc_tokens)
        return kf_fail(err, KF_ERR_FORMAT, "%s: lengths D = %lld, C = %lld: need 1 <= C <= D <= 2^31 - 1", path,
                       (long long)h->n_doc_tokens, (long long)h->n_tokens);
    /* a layer's elements (and so every size below) stay far from overflow: C * H * D < 2^40 */
    if ((double)h->n_tokens * h->kv_heads * h->head_dim > (double)((int64_t)1 << 40))
        return kf_fail(err, KF_ERR_FORMAT, "%s: a layer of C = %lld tokens is too large", path, (long long)h->n_tokens);
    /* HDF5 chunks stay below 4 GiB: a K/V chunk [C, D] of one (layer, head) and a side layer [H, C] */
    if ((int64_t)h->n_tokens * h->head_dim * (int64_t)kf_dtype_size(h->dtype) + 4 >= ((int64_t)1 << 32) ||
        (int64_t)h->kv_heads * h->head_dim > ((int64_t)1 << 24) ||
        (int64_t)h->kv_heads * h->n_tokens > ((int64_t)1 << 29))
        return kf_fail(err, KF_ERR_FORMAT, "%s: kv_heads %d x head_dim %d x C %lld is too large for one chunk", path,
                       h->kv_heads, h->head_dim, (long long)h->n_tokens);
    if (h->block_size != KVF_BLOCK)
        return kf_fail(err, KF_ERR_FORMAT, "%s: block_size %d (version %d uses %d)", path, h->block_size, KVF_VERSION,
                       KVF_BLOCK);
    if (!isfinite(h->budget) || h->budget <= 0 || h->budget > 1)
        return kf_fail(err, KF_ERR_FORMAT, "%s: budget %g must be in (0, 1]", path, h->budget);
    if (!isfinite(h->lambda) || h->lambda < 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: lambda %g must be finite and non-negative", path, h->lambda);
    return chat_check(h, path, err);
}

/* ---- values and digests ---- */

KVF_CLONES int64_t kvf_first_nonfinite(kf_dtype d, const void *x, size_t n) {
    /* a vectorizable OR over all elements first; the index only when something is wrong */
    int bad = 0;
    if (d == KF_DTYPE_F32) {
        const uint32_t *p = x;
        for (size_t i = 0; i < n; i++)
            bad |= (p[i] & 0x7f800000u) == 0x7f800000u;
    } else {
        const uint16_t *p = x;
        const uint16_t m = d == KF_DTYPE_BF16 ? 0x7f80 : 0x7c00;
        for (size_t i = 0; i < n; i++)
            bad |= (p[i] & m) == m;
    }
    if (!bad)
        return -1;
    for (size_t i = 0; i < n; i++) {
        bool nf = d == KF_DTYPE_F32 ? (((const uint32_t *)x)[i] & 0x7f800000u) == 0x7f800000u
                               : (((const uint16_t *)x)[i] & (d == KF_DTYPE_BF16 ? 0x7f80 : 0x7c00)) ==
                                     (d == KF_DTYPE_BF16 ? 0x7f80 : 0x7c00);
        if (nf)
            return (int64_t)i;
    }
    return -1;
}

kf_status kvf_check_side(const kvf_header *h, const char *path, int layer, const float *beta, const float *u,
                         const int32_t *pos, const uint8_t *hm, kf_error *err) {
    const size_t H = (size_t)h->kv_heads, C = (size_t)h->n_tokens, D = (size_t)h->head_dim;
    for (size_t i = 0; i < H * C; i++) {
        if (pos[i] < -1 || pos[i] >= h->n_doc_tokens)
            return kf_fail(err, KF_ERR_FORMAT,
                           "%s: position %d of layer %d, head %zu, slot %zu is outside [0, D = %lld)", path,
                           (int)pos[i], layer, i / C, i % C, (long long)h->n_doc_tokens);
        if (!isfinite(beta[i]) && !(beta[i] == -INFINITY && pos[i] == -1))
            return kf_fail(
                err, KF_ERR_FORMAT,
                "%s: beta %g of layer %d, head %zu, slot %zu is not finite (only a padding slot may hold -inf)", path,
                (double)beta[i], layer, i / C, i % C);
    }
    for (size_t i = 0; i < H * D; i++)
        if (!isfinite(u[i]))
            return kf_fail(err, KF_ERR_FORMAT, "%s: u of layer %d, head %zu is not finite", path, layer, i / D);
    for (size_t i = 0; i < H; i++)
        if (hm[i] > KF_METHOD_FOLD)
            return kf_fail(err, KF_ERR_FORMAT, "%s: head_method %u of layer %d, head %zu is not a method (0..3)", path,
                           hm[i], layer, i);
    return KF_OK;
}

static void put_u64(XXH3_state_t *st, uint64_t v) {
    uint8_t b8[8];
    for (int b = 0; b < 8; b++)
        b8[b] = (uint8_t)(v >> (8 * b));
    XXH3_128bits_update(st, b8, 8);
}

void kvf_head_digest_finish(const kvf_header *h, int layer, int head, void *state, const float *beta,
                            const float *u, const int32_t *pos, const uint8_t *hm, uint8_t out[16]) {
    const size_t C = (size_t)h->n_tokens, D = (size_t)h->head_dim, hd = (size_t)head;
    XXH3_state_t *st = state;
    kvf_hash_update(st, beta + hd * C, C * 4);
    kvf_hash_update(st, u + hd * D, D * 4);
    kvf_hash_update(st, pos + hd * C, C * 4);
    XXH3_128bits_update(st, hm + hd, 1);
    put_u64(st, (uint64_t)layer);
    put_u64(st, (uint64_t)head);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
    memcpy(out, c.digest, 16);
}

void kvf_payload_digest(const uint8_t *head_digests, int n_layers, int kv_heads, char out[KVF_DIGEST_LEN + 1]) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, head_digests, (size_t)n_layers * (size_t)kv_heads * 16);
    put_u64(&st, (uint64_t)n_layers);
    put_u64(&st, (uint64_t)kv_heads);
    XXH128_hash_t hh = XXH3_128bits_digest(&st);
    snprintf(out, KVF_DIGEST_LEN + 1, "%016llx%016llx", (unsigned long long)hh.high64, (unsigned long long)hh.low64);
}

/* ---- XXH3 updates with AVX2 ----
 * The system libxxhash is built for SSE2; the same algorithm with AVX2 (xxhash.h inlined for
 * this one function, XXH_VECTOR = AVX2) runs about twice as fast and gives the same digests
 * (test_kvf_integrity compares a file's head digests with libxxhash's). The state is the
 * library's XXH3_state_t: the inlined code has the same layout (same header). Kept at the end of
 * the file: the inlined header renames the XXH3 functions for everything below it. */
static void hash_update_lib(void *st, const void *p, size_t n) {
    XXH3_128bits_update(st, p, n);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVF_NO_AVX2_HASH)
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
#define XXH_INLINE_ALL
#define XXH_VECTOR 2 /* XXH_AVX2 */
#include <xxhash.h>
static void hash_update_avx2(void *st, const void *p, size_t n) {
    XXH3_128bits_update((XXH3_state_t *)st, p, n);
}
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

void kvf_hash_update(void *xxh3_state, const void *p, size_t n) {
    static int avx2 = -1;
    if (avx2 < 0)
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (avx2)
        hash_update_avx2(xxh3_state, p, n);
    else
        hash_update_lib(xxh3_state, p, n);
}
#else
void kvf_hash_update(void *xxh3_state, const void *p, size_t n) {
    hash_update_lib(xxh3_state, p, n);
}
#endif
