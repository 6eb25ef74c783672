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

int cmd_bench_kvf(int argc, char **argv) {
    kvf_opts o = {.mb = 256, .repeat = 3, .dtype = KF_DTYPE_BF16,
                  .dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp"};
    int first;
    const int prc = cli_opts_parse(&cli_bench_kvf_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first != argc)
        return cli_usage_error("bench kvf", "unexpected argument '%s'", argv[first]);
    const long long mb = o.mb, repeat = o.repeat;
    const kf_dtype dt = (kf_dtype)o.dtype;
    const char *dir = o.dir;

    kvf_cache c = {0};
    kvf_header *h = &c.hdr;
    kvf_header_init(h);
    h->n_layers = 32;
    h->kv_heads = 8;
    h->head_dim = 128;
    h->dtype = dt;
    const size_t esz = kf_dtype_size(dt), row = (size_t)h->kv_heads * (size_t)h->head_dim;
    const size_t per_token = 2 * (size_t)h->n_layers * row * esz;
    h->n_tokens = (int64_t)((size_t)mb * 1000000 / per_token);
    if (h->n_tokens < 1)
        h->n_tokens = 1;
    h->n_doc_tokens = h->n_tokens * 4;
    h->budget = 0.25;
    h->method = KF_METHOD_FOLD;
    memset(h->model_fingerprint, 'a', KVF_DIGEST_LEN);
    int32_t ids[2] = {1, 2};
    kvf_document_digest(ids, 2, h->document_digest);
    const size_t n = (size_t)h->n_layers * (size_t)h->n_tokens * row; /* elements of keys (and of values) */
    const size_t ln = (size_t)h->n_tokens * row;
    const double bytes = 2.0 * (double)n * (double)esz;

    char kvf_path[4096], plain_path[4096];
    snprintf(kvf_path, sizeof kvf_path, "%s/kvfold-bench-%ld.kvf", dir, (long)getpid());
    snprintf(plain_path, sizeof plain_path, "%s/kvfold-bench-%ld.bin", dir, (long)getpid());
    void *keys = malloc(n * esz), *values = malloc(n * esz), *back_k = malloc(n * esz), *back_v = malloc(n * esz);
    float *f32 = malloc(ln * 4);
    enum { W_PLAIN, W_KVF, R_PLAIN, R_KVF, C_PLAIN, C_KVF, R_KVF32, V_KVF, N_T };
    double *t[N_T]; /* [repeat] seconds each */
    for (int i = 0; i < N_T; i++)
        t[i] = malloc(sizeof(double) * (size_t)repeat);
    int rc = KF_EXIT_FAIL;
    kf_error err = {0};
    if (!keys || !values || !back_k || !back_v || !f32 || !t[N_T - 1]) {
        cli_error("bench kvf", "out of memory for %.0f MB", 2 * bytes / 1e6);
        goto out;
    }
    /* random-looking values in [-2, 2) so that nothing compresses or short-cuts */
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < ln; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        f32[i] = (float)((double)(s >> 11) * 0x1p-53 * 4 - 2);
    }
    for (int l = 0; l < h->n_layers; l++) {
        to_dtype(dt, f32, (char *)keys + (size_t)l * ln * esz, ln);
        to_dtype(dt, f32, (char *)values + (size_t)l * ln * esz, ln);
    }
    c.keys_raw = keys;
    c.values_raw = values;
    fprintf(stderr, "bench kvf: %lld tokens x 32 layers x 8 heads x 128, %s: %.1f MB of K/V in %s\n",
            (long long)h->n_tokens, kf_dtype_name(dt), bytes / 1e6, dir);

    for (long long r = 0; r < repeat; r++) {
        /* both write new files (as a compaction job does): replacing a file would add the cost of
         * freeing the old one's blocks, which a journaling filesystem makes large and erratic */
        unlink(plain_path);
        unlink(kvf_path);
        sync();
        double t0 = cli_now();
        if (plain_write(plain_path, keys, values, n * esz) != 0) {
            cli_error("bench kvf", "cannot write %s", plain_path);
            goto out;
        }
        double t1 = cli_now();
        if (kvf_write(kvf_path, &c, &err) != KF_OK) {
            cli_error("bench kvf", "%s", err.msg);
            goto out;
        }
        double t2 = cli_now();
        t[W_PLAIN][r] = t1 - t0;
        t[W_KVF][r] = t2 - t1;
        for (int cold = 0; cold < 2; cold++) {
            if (cold) {
                drop_cache(plain_path);
                drop_cache(kvf_path);
            }
            double a = cli_now();
            if (plain_read(plain_path, back_k, back_v, n * esz) != 0) {
                cli_error("bench kvf", "cannot read %s", plain_path);
                goto out;
            }
            double b = cli_now();
            kvf_file *f;
            if (kvf_open(kvf_path, &f, &err) != KF_OK) {
                cli_error("bench kvf", "%s", err.msg);
                goto out;
            }
            for (int l = 0; l < h->n_layers && err.code == KF_OK; l++) {
                kvf_read_layer_raw(f, l, KVF_KEYS, (char *)back_k + (size_t)l * ln * esz, &err);
                kvf_read_layer_raw(f, l, KVF_VALUES, (char *)back_v + (size_t)l * ln * esz, &err);
            }
            double e = cli_now();
            if (err.code == KF_OK && !cold) {
                for (int l = 0; l < h->n_layers && err.code == KF_OK; l++) {
                    kvf_read_layer(f, l, KVF_KEYS, f32, &err);
                    kvf_read_layer(f, l, KVF_VALUES, f32, &err);
                }
                t[R_KVF32][r] = cli_now() - e;
            }
            kvf_close(f);
            if (err.code == KF_OK && !cold) {
                const double v0 = cli_now();
                if (kvf_open(kvf_path, &f, &err) == KF_OK) {
                    kvf_verify(f, &err);
                    kvf_close(f);
                }
                t[V_KVF][r] = cli_now() - v0;
            }
            if (err.code != KF_OK) {
                cli_error("bench kvf", "%s", err.msg);
                goto out;
            }
            if (memcmp(back_k, keys, n * esz) != 0 || memcmp(back_v, values, n * esz) != 0) {
                cli_error("bench kvf", "read back different bytes");
                goto out;
            }
            t[cold ? C_PLAIN : R_PLAIN][r] = b - a;
            t[cold ? C_KVF : R_KVF][r] = e - b;
        }
    }
    {
        const int R = (int)repeat;
        double w_plain = median(t[W_PLAIN], R), w_kvf = median(t[W_KVF], R), r_plain = median(t[R_PLAIN], R),
               r_kvf = median(t[R_KVF], R), c_plain = median(t[C_PLAIN], R), c_kvf = median(t[C_KVF], R),
               r_kvf32 = median(t[R_KVF32], R), v_kvf = median(t[V_KVF], R);
        printf("%-34s %8s %8s %7s\n", "", "plain", "kvf", "ratio");
        printf("%-34s %8.2f %8.2f %7.2f\n", "write GB/s (+fsync)", bytes / w_plain / 1e9, bytes / w_kvf / 1e9,
               w_plain / w_kvf);
        printf("%-34s %8.2f %8.2f %7.2f\n", "read GB/s, page cache", bytes / r_plain / 1e9, bytes / r_kvf / 1e9,
               r_plain / r_kvf);
        printf("%-34s %8.2f %8.2f %7.2f\n", "read GB/s, after fadvise DONTNEED", bytes / c_plain / 1e9,
               bytes / c_kvf / 1e9, c_plain / c_kvf);
        printf("%-34s %8s %8.2f %7.2f\n", "read GB/s, page cache, to fp32", "", bytes / r_kvf32 / 1e9,
               r_plain / r_kvf32);
        printf("%-34s %8.2f %8.2f %7.2f\n", "verify GB/s, page cache", bytes / r_plain / 1e9, bytes / v_kvf / 1e9,
               r_plain / v_kvf);
        printf("verify time / read time %.2f (target <= 1.3), write time / plain write + fsync %.2f (target <= 2)\n",
               v_kvf / r_plain, w_kvf / w_plain);
        printf("write_ratio %.3f\nread_ratio %.3f\nwrite_time_ratio %.3f\nverify_time_ratio %.3f\n", w_plain / w_kvf,
               r_plain / r_kvf, w_kvf / w_plain, v_kvf / r_plain);
    }
    rc = KF_EXIT_OK;
out:
    unlink(kvf_path);
    unlink(plain_path);
    free(keys);
    free(values);
    free(back_k);
    free(back_v);
    free(f32);
    for (int i = 0; i < N_T; i++)
        free(t[i]);
    return rc;
}
