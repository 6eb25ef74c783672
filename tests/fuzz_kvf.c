/* fuzz_kvf — libFuzzer target for the kvf reader (formats/kvf_read.c and HDF5 under it).
 *
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVFOLD_FUZZ=ON -DKVFOLD_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz_kvf
 *   mkdir -p build-fuzz/kvf-corpus
 *   KF_FUZZ_KVF_SEEDS=build-fuzz/kvf-corpus build-fuzz/tests/fuzz_kvf -max_total_time=30 \
 *       -max_len=65536 build-fuzz/kvf-corpus
 *
 * With KF_FUZZ_KVF_SEEDS=DIR the target first writes real cache files into DIR with kvf_write
 * (every dtype and method, short and multi-block layers, AM padding with beta = -inf, per-head
 * methods), which libFuzzer then reads as its seed corpus. Each input is written to a file and
 * opened, verified and read in full: besides "no crash, no hang, no sanitizer report", an input
 * that kvf_open and kvf_verify accept must also read in full, and a refusal must name the file.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats/kvf.h"

static char g_path[4096];

/* LeakSanitizer: HDF5 1.10.8 itself leaks a few bytes on some damaged object headers (in
 * H5Aexists -> H5O_protect, seen under valgrind too); kvfold's own allocations stay checked. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) {
    return "leak:libhdf5_serial.so\n";
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* One seed: L layers x H heads x D, C slots, in dtype dt, with method m. */
static void write_seed(const char *dir, int k, int L, int H, int D, int64_t C, kf_dtype dt, kf_method m) {
    kvf_cache c = {0};
    kvf_header *h = &c.hdr;
    kvf_header_init(h);
    memset(h->model_fingerprint, 'a' + k % 6, KVF_DIGEST_LEN);
    memset(h->recipe_digest, '0' + k % 10, KVF_DIGEST_LEN);
    int32_t ids[2] = {k, 1};
    kvf_document_digest(ids, 2, h->document_digest);
    h->n_doc_tokens = 2 * C;
    h->n_tokens = C;
    h->method = m;
    h->budget = 0.5;
    h->lambda = m == KF_METHOD_FOLD ? 0.01 : 0;
    h->dtype = dt;
    h->n_layers = L;
    h->kv_heads = H;
    h->head_dim = D;
    const size_t n = (size_t)L * C * H * D, nb = (size_t)L * H * C, nu = (size_t)L * H * D;
    float *kv = malloc(2 * n * 4), *beta = malloc(nb * 4), *u = malloc(nu * 4);
    int32_t *pos = malloc(nb * 4);
    uint8_t *hm = malloc((size_t)L * H);
    for (size_t i = 0; i < 2 * n; i++)
        kv[i] = (float)sin((double)i * 0.37 + k);
    for (size_t i = 0; i < nb; i++) {
        pos[i] = i % 9 == 8 ? -1 : (int32_t)(i % (size_t)h->n_doc_tokens);
        beta[i] = pos[i] < 0 && m == KF_METHOD_AM ? -INFINITY : (float)(i % 5) * 0.25f;
    }
    for (size_t i = 0; i < nu; i++)
        u[i] = (float)cos((double)i);
    for (size_t i = 0; i < (size_t)L * H; i++)
        hm[i] = (uint8_t)(i % 2 ? m : KF_METHOD_DROP);
    c.keys = kv;
    c.values = kv + n;
    c.beta = beta;
    c.u = u;
    c.positions = pos;
    c.head_method = hm;
    char path[4200];
    snprintf(path, sizeof path, "%s/seed-%d.kvf", dir, k);
    kf_error err = {0};
    if (kvf_write(path, &c, &err) != KF_OK) {
        fprintf(stderr, "fuzz_kvf: cannot write a seed: %s\n", err.msg);
        abort();
    }
    free(kv);
    free(beta);
    free(u);
    free(pos);
    free(hm);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *tmp = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(g_path, sizeof g_path, "%s/fuzz-kvf-%ld.kvf", tmp, (long)getpid());
    const char *seeds = getenv("KF_FUZZ_KVF_SEEDS");
    if (seeds) {
        mkdir(seeds, 0755);
        write_seed(seeds, 0, 1, 1, 4, 3, KF_DTYPE_BF16, KF_METHOD_KEEP);
        write_seed(seeds, 1, 2, 2, 8, 20, KF_DTYPE_BF16, KF_METHOD_AM);
        write_seed(seeds, 2, 2, 1, 16, 33, KF_DTYPE_F16, KF_METHOD_FOLD);
        write_seed(seeds, 3, 3, 2, 4, 16, KF_DTYPE_F32, KF_METHOD_DROP);
        write_seed(seeds, 4, 1, 4, 8, 40, KF_DTYPE_BF16, KF_METHOD_AM);
    }
    return 0;
}

static void read_everything(kvf_file *f) {
    const kvf_header *h = kvf_file_header(f);
    const size_t H = (size_t)h->kv_heads, C = (size_t)h->n_tokens, D = (size_t)h->head_dim;
    const size_t n = C * H * D;
    float *k = malloc(n * 4), *side = malloc(((C > D ? C : D) * H * (size_t)h->n_layers + 4) * 4);
    uint8_t *hm = malloc((size_t)h->n_layers * H);
    kf_error err = {0};
    int bad = 0;
    for (int l = 0; l < h->n_layers; l++) {
        bad |= kvf_read_layer(f, l, KVF_KEYS, k, &err) != KF_OK;
        bad |= kvf_read_layer(f, l, KVF_VALUES, k, &err) != KF_OK;
        for (int64_t b = 0; b < kvf_n_blocks(f); b++)
            bad |= kvf_read_block(f, l, b, KVF_VALUES, k, NULL, &err) != KF_OK;
    }
    bad |= kvf_read_beta(f, KVF_ALL_LAYERS, side, &err) != KF_OK;
    bad |= kvf_read_u(f, KVF_ALL_LAYERS, side, &err) != KF_OK;
    bad |= kvf_read_positions(f, KVF_ALL_LAYERS, (int32_t *)side, &err) != KF_OK;
    bad |= kvf_read_head_methods(f, hm, &err) != KF_OK;
    if (bad) { /* verified, then refused: a reader that is not deterministic */
        fprintf(stderr, "fuzz_kvf: a verified file failed a later read: %s\n", err.msg);
        abort();
    }
    free(k);
    free(side);
    free(hm);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FILE *fp = fopen(g_path, "wb");
    if (!fp || fwrite(data, 1, size, fp) != size || fclose(fp) != 0)
        abort();
    kvf_file *f = NULL;
    kf_error err = {0};
    kf_status st = kvf_open(g_path, &f, &err);
    if (st == KF_OK)
        st = kvf_verify(f, &err);
    if (st != KF_OK && !strstr(err.msg, g_path)) {
        fprintf(stderr, "fuzz_kvf: a refusal that does not name the file: %s\n", err.msg);
        abort();
    }
    if (st == KF_OK)
        read_everything(f);
    kvf_close(f);
    return 0;
}
