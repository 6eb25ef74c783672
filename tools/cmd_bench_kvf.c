/* kvfold bench kvf — write and read throughput of kvf cache files against plain fwrite/fread of the
 * same bytes (+ fsync), measured in the same run. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "formats/kvf.h"
#include "kernels/base/convert.h"
#include "tools/cli.h"
#include "tools/commands.h"

typedef struct {
    long long mb, repeat;
    int dtype; /* kf_dtype */
    const char *dir;
} kvf_opts;

static int set_dtype(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)err, (void)n;
    kf_dtype d;
    if (kvf_dtype_parse(arg, &d))
        return -1;
    *(int *)((char *)ctx + o->off) = (int)d;
    return 0;
}

#define K(field) OFF(kvf_opts, field)
static const cli_opt kRows[] = {
    {"mb", 0, OPT_LLONG, "N", K(mb), .lo = 1, .hi = 65536, .def = "256", .help = "size of keys + values in MB"},
    {"dtype", 0, OPT_FN, "T", K(dtype), .set = set_dtype, .must = "is bf16, f16 or f32", .def = "bf16",
     .help = "bf16, f16 or f32 in the file"},
    {"dir", 0, OPT_STR, "DIR", K(dir), .def = "$TMPDIR or /tmp", .help = "where to write"},
    {"repeat", 0, OPT_LLONG, "R", K(repeat), .lo = 1, .hi = 1000, .def = "3", .help = "timed runs of each"},
    {0}};

const cli_command cli_bench_kvf_command = {
    .name = "bench kvf",
    .usage = "kvfold bench kvf [--mb N] [--dtype bf16|f16|f32] [--dir DIR] [--repeat R]\n",
    .about = "Builds a synthetic cache of about N MB of keys and values (32 layers x 8 kv heads x head_dim\n"
             "128, C chosen to fit) and times, R times each (median reported):\n"
             "  write  kvf_write (temporary name, Fletcher32 per chunk, fsync, rename) against fwrite of the\n"
             "         same bytes + fsync, each into a new file;\n"
             "  read   kvf_open + every layer's keys and values as stored (checksums verified) against fread\n"
             "         of the plain file, from the page cache (warm) and after posix_fadvise(DONTNEED) (cold);\n"
             "  read   kvf_read_layer (converted to fp32), warm, for the connector's fp32 path;\n"
             "  verify kvf_open + kvf_verify (every chunk's sum, every value, every head digest), warm,\n"
             "         against fread of the plain file.\n"
             "Targets: verify within 1.3x the time of reading the bytes, write within 2x a plain\n"
             "write of the same bytes with fsync.\n"
             "Prints GB/s for each and the kvf/plain ratio. Files go to DIR and are removed afterwards.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .notes = "Last lines: 'write_ratio <kvf/plain>' and 'read_ratio <kvf/plain>' (speed, warm), then\n"
             "'write_time_ratio' and 'verify_time_ratio' (time kvf / time plain) for scripts.\n",
    .exit_status = "  0  measured\n"
                   "  1  a write or read failed (reported)\n"
                   "  2  usage errors\n",
    .example = "  kvfold bench kvf --mb 64 --dir /scratch\n",
};


static void to_dtype(kf_dtype dt, const float *x, void *out, size_t n) {
    uint16_t *o = out;
    for (size_t i = 0; i < n; i++)
        if (dt == KF_DTYPE_F32)
            memcpy((float *)out + i, x + i, 4);
        else
            o[i] = dt == KF_DTYPE_BF16 ? kf_f32_to_bf16(x[i]) : kf_f32_to_f16(x[i]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return t[n / 2];
}

static void drop_cache(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0) {
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
}

/* fwrite + fflush + fsync; 0 or -1 */
static int plain_write(const char *path, const void *a, const void *b, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp)
        return -1;
    int ok = fwrite(a, 1, n, fp) == n && fwrite(b, 1, n, fp) == n && fflush(fp) == 0 && fsync(fileno(fp)) == 0;
    return (fclose(fp) == 0 && ok) ? 0 : -1;
}

static int plain_read(const char *path, void *a, void *b, size_t n) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return -1;
    int ok = fread(a, 1, n, fp) == n && fread(b, 1, n, fp) == n;
    fclose(fp);
    return ok ? 0 : -1;
}

/* One sitting's state: the synthetic cache, its bytes and the timings. */
enum { W_PLAIN, W_KVF, R_PLAIN, R_KVF, C_PLAIN, C_KVF, R_KVF32, V_KVF, N_T };
typedef struct {
    kvf_cache c;                       /* header + keys_raw/values_raw (not owned by c) */
    size_t esz, n, ln;                 /* element size; elements of keys (and of values); per layer */
    double bytes;                      /* keys + values */
    void *keys, *values;               /* [L, C, H*D] stored dtype */
    void *back_k, *back_v;             /* [L, C, H*D] what was read back */
    float *f32;                        /* [C, H*D] one layer in fp32 */
    double *t[N_T];                    /* [repeat] seconds each */
    char kvf_path[4096], plain_path[4096];
    kf_error err;
} kvf_bench;

/* A cache of about mb MB: 32 layers x 8 kv heads x 128, C chosen to fit. */
static void bench_header(kvf_header *h, kf_dtype dt, long long mb) {
    kvf_header_init(h);
    h->n_layers = 32;
    h->kv_heads = 8;
    h->head_dim = 128;
    h->dtype = dt;
    const size_t per_token = 2 * (size_t)h->n_layers * (size_t)h->kv_heads * (size_t)h->head_dim * kf_dtype_size(dt);
    h->n_tokens = (int64_t)((size_t)mb * 1000000 / per_token);
    if (h->n_tokens < 1)
        h->n_tokens = 1;
    h->n_doc_tokens = h->n_tokens * 4;
    h->budget = 0.25;
    h->method = KF_METHOD_FOLD;
    memset(h->model_fingerprint, 'a', KVF_DIGEST_LEN);
    int32_t ids[2] = {1, 2};
    kvf_document_digest(ids, 2, h->document_digest);
}

/* Buffers and the payload: random-looking values in [-2, 2) so that nothing compresses or
 * short-cuts. 0, or -1 when out of memory. */
static int bench_init(kvf_bench *b, const kvf_opts *o) {
    kvf_header *h = &b->c.hdr;
    bench_header(h, (kf_dtype)o->dtype, o->mb);
    b->esz = kf_dtype_size(h->dtype);
    b->ln = (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim;
    b->n = (size_t)h->n_layers * b->ln;
    b->bytes = 2.0 * (double)b->n * (double)b->esz;
    snprintf(b->kvf_path, sizeof b->kvf_path, "%s/kvfold-bench-%ld.kvf", o->dir, (long)getpid());
    snprintf(b->plain_path, sizeof b->plain_path, "%s/kvfold-bench-%ld.bin", o->dir, (long)getpid());
    b->keys = malloc(b->n * b->esz), b->values = malloc(b->n * b->esz);
    b->back_k = malloc(b->n * b->esz), b->back_v = malloc(b->n * b->esz);
    b->f32 = malloc(b->ln * 4);
    for (int i = 0; i < N_T; i++)
        b->t[i] = malloc(sizeof(double) * (size_t)o->repeat);
    if (!b->keys || !b->values || !b->back_k || !b->back_v || !b->f32 || !b->t[N_T - 1])
        return -1;
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < b->ln; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        b->f32[i] = (float)((double)(s >> 11) * 0x1p-53 * 4 - 2);
    }
    for (int l = 0; l < h->n_layers; l++) {
        to_dtype(h->dtype, b->f32, (char *)b->keys + (size_t)l * b->ln * b->esz, b->ln);
        to_dtype(h->dtype, b->f32, (char *)b->values + (size_t)l * b->ln * b->esz, b->ln);
    }
    b->c.keys_raw = b->keys;
    b->c.values_raw = b->values;
    return 0;
}

static void bench_free(kvf_bench *b) {
    unlink(b->kvf_path);
    unlink(b->plain_path);
    free(b->keys), free(b->values), free(b->back_k), free(b->back_v), free(b->f32);
    for (int i = 0; i < N_T; i++)
        free(b->t[i]);
}

/* Both write new files (as a compaction job does): replacing a file would add the cost of freeing
 * the old one's blocks, which a journaling filesystem makes large and erratic. 0 or -1 (reported). */
static int bench_write(kvf_bench *b, long long r) {
    unlink(b->plain_path);
    unlink(b->kvf_path);
    sync();
    const double t0 = cli_now();
    if (plain_write(b->plain_path, b->keys, b->values, b->n * b->esz) != 0)
        return cli_error("bench kvf", "cannot write %s", b->plain_path), -1;
    const double t1 = cli_now();
    if (kvf_write(b->kvf_path, &b->c, &b->err) != KF_OK)
        return cli_error("bench kvf", "%s", b->err.msg), -1;
    b->t[W_PLAIN][r] = t1 - t0;
    b->t[W_KVF][r] = cli_now() - t1;
    return 0;
}

/* Warm only: every layer converted to fp32, then kvf_verify on a new open. */
static void bench_read_f32_verify(kvf_bench *b, kvf_file *f, long long r) {
    const double e = cli_now();
    for (int l = 0; l < b->c.hdr.n_layers && b->err.code == KF_OK; l++) {
        kvf_read_layer(f, l, KVF_KEYS, b->f32, &b->err);
        kvf_read_layer(f, l, KVF_VALUES, b->f32, &b->err);
    }
    b->t[R_KVF32][r] = cli_now() - e;
    if (b->err.code != KF_OK)
        return;
    const double v0 = cli_now();
    kvf_file *g;
    if (kvf_open(b->kvf_path, &g, &b->err) == KF_OK) {
        kvf_verify(g, &b->err);
        kvf_close(g);
    }
    b->t[V_KVF][r] = cli_now() - v0;
}

/* One read of each file, warm (page cache) or cold (after fadvise DONTNEED); the bytes read back
 * must be those written. 0 or -1 (reported). */
static int bench_read(kvf_bench *b, long long r, int cold) {
    if (cold) {
        drop_cache(b->plain_path);
        drop_cache(b->kvf_path);
    }
    const double a = cli_now();
    if (plain_read(b->plain_path, b->back_k, b->back_v, b->n * b->esz) != 0)
        return cli_error("bench kvf", "cannot read %s", b->plain_path), -1;
    const double m = cli_now();
    kvf_file *f;
    if (kvf_open(b->kvf_path, &f, &b->err) != KF_OK)
        return cli_error("bench kvf", "%s", b->err.msg), -1;
    for (int l = 0; l < b->c.hdr.n_layers && b->err.code == KF_OK; l++) {
        kvf_read_layer_raw(f, l, KVF_KEYS, (char *)b->back_k + (size_t)l * b->ln * b->esz, &b->err);
        kvf_read_layer_raw(f, l, KVF_VALUES, (char *)b->back_v + (size_t)l * b->ln * b->esz, &b->err);
    }
    const double e = cli_now();
    if (b->err.code == KF_OK && !cold)
        bench_read_f32_verify(b, f, r);
    kvf_close(f);
    if (b->err.code != KF_OK)
        return cli_error("bench kvf", "%s", b->err.msg), -1;
    if (memcmp(b->back_k, b->keys, b->n * b->esz) != 0 || memcmp(b->back_v, b->values, b->n * b->esz) != 0)
        return cli_error("bench kvf", "read back different bytes"), -1;
    b->t[cold ? C_PLAIN : R_PLAIN][r] = m - a;
    b->t[cold ? C_KVF : R_KVF][r] = e - m;
    return 0;
}

static void bench_print(kvf_bench *b, int R) {
    const double bytes = b->bytes;
    double w_plain = median(b->t[W_PLAIN], R), w_kvf = median(b->t[W_KVF], R), r_plain = median(b->t[R_PLAIN], R),
           r_kvf = median(b->t[R_KVF], R), c_plain = median(b->t[C_PLAIN], R), c_kvf = median(b->t[C_KVF], R),
           r_kvf32 = median(b->t[R_KVF32], R), v_kvf = median(b->t[V_KVF], R);
    printf("%-34s %8s %8s %7s\n", "", "plain", "kvf", "ratio");
    printf("%-34s %8.2f %8.2f %7.2f\n", "write GB/s (+fsync)", bytes / w_plain / 1e9, bytes / w_kvf / 1e9,
           w_plain / w_kvf);
    printf("%-34s %8.2f %8.2f %7.2f\n", "read GB/s, page cache", bytes / r_plain / 1e9, bytes / r_kvf / 1e9,
           r_plain / r_kvf);
    printf("%-34s %8.2f %8.2f %7.2f\n", "read GB/s, after fadvise DONTNEED", bytes / c_plain / 1e9,
           bytes / c_kvf / 1e9, c_plain / c_kvf);
    printf("%-34s %8s %8.2f %7.2f\n", "read GB/s, page cache, to fp32", "", bytes / r_kvf32 / 1e9, r_plain / r_kvf32);
    printf("%-34s %8.2f %8.2f %7.2f\n", "verify GB/s, page cache", bytes / r_plain / 1e9, bytes / v_kvf / 1e9,
           r_plain / v_kvf);
    printf("verify time / read time %.2f (target <= 1.3), write time / plain write + fsync %.2f (target <= 2)\n",
           v_kvf / r_plain, w_kvf / w_plain);
    printf("write_ratio %.3f\nread_ratio %.3f\nwrite_time_ratio %.3f\nverify_time_ratio %.3f\n", w_plain / w_kvf,
           r_plain / r_kvf, w_kvf / w_plain, v_kvf / r_plain);
}

int cmd_bench_kvf(int argc, char **argv) {
    kvf_opts o = {.mb = 256, .repeat = 3, .dtype = KF_DTYPE_BF16,
                  .dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp"};
    int first;
    const int prc = cli_opts_parse(&cli_bench_kvf_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first != argc)
        return cli_usage_error("bench kvf", "unexpected argument '%s'", argv[first]);
    kvf_bench b = {0};
    int rc = KF_EXIT_FAIL;
    if (bench_init(&b, &o) != 0) {
        cli_error("bench kvf", "out of memory for %.0f MB", 2 * b.bytes / 1e6);
        goto out;
    }
    fprintf(stderr, "bench kvf: %lld tokens x 32 layers x 8 heads x 128, %s: %.1f MB of K/V in %s\n",
            (long long)b.c.hdr.n_tokens, kf_dtype_name(b.c.hdr.dtype), b.bytes / 1e6, o.dir);
    for (long long r = 0; r < o.repeat; r++)
        if (bench_write(&b, r) != 0 || bench_read(&b, r, 0) != 0 || bench_read(&b, r, 1) != 0)
            goto out;
    bench_print(&b, (int)o.repeat);
    rc = KF_EXIT_OK;
out:
    bench_free(&b);
    return rc;
}
