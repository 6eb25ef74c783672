/* fuzz_safetensors — libFuzzer target for the safetensors reader (formats/safetensors.c).
 *
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVFOLD_FUZZ=ON -DKVFOLD_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz_safetensors
 *   tests/fuzz_seeds.py build-fuzz/seeds      # seeds from the real files in tests/data
 *   build-fuzz/tests/fuzz_safetensors -max_total_time=30 -max_len=65536 CORPUS build-fuzz/seeds/safetensors
 *
 * The input is a whole .safetensors file (in a memfd, which the reader opens and maps like any
 * file). Besides "no crash, no sanitizer report": a refusal carries a message; an accepted file
 * keeps every promise of safetensors.h (names sorted and unique, each tensor's bytes inside the
 * data section, numel and byte counts consistent, no two tensors overlapping), every tensor byte
 * can be read, kf_st_find finds each tensor, and the non-finite scan stays inside the tensor.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "formats/safetensors.h"

static int g_fd = -1;
static char g_path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    g_fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
    if (g_fd < 0) {
        perror("fuzz_safetensors: memfd_create");
        abort();
    }
    snprintf(g_path, sizeof g_path, "/proc/self/fd/%d", g_fd);
    return 0;
}

static void fail(const char *what, const kf_st_tensor *t) {
    fprintf(stderr, "fuzz_safetensors: %s (tensor '%s')\n", what, t ? t->name : "");
    abort();
}

static int by_offset(const void *a, const void *b) {
    const kf_st_tensor *x = *(const kf_st_tensor *const *)a, *y = *(const kf_st_tensor *const *)b;
    const uintptr_t p = (uintptr_t)x->data, q = (uintptr_t)y->data;
    return p < q ? -1 : p > q;
}

static void check_set(const kf_st_set *set) {
    const kf_st_file *f = &set->files[0];
    const unsigned char *lo = (const unsigned char *)f->map + 8 + f->header_len, *hi = (const unsigned char *)f->map + f->size;
    if (8 + f->header_len > f->size)
        fail("header beyond the file", NULL);
    const kf_st_tensor **order = malloc(sizeof *order * (set->n_tensors + 1));
    unsigned sum = 0;
    for (size_t i = 0; i < set->n_tensors; i++) {
        const kf_st_tensor *t = &set->tensors[i];
        order[i] = t;
        if (i > 0 && strcmp(set->tensors[i - 1].name, t->name) >= 0)
            fail("names not sorted and unique", t);
        if (kf_st_find(set, t->name) != t)
            fail("kf_st_find does not find it", t);
        if (t->ndim < 0 || t->ndim > KF_ST_MAX_DIMS)
            fail("ndim out of range", t);
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0 || (t->shape[d] > 0 && numel > INT64_MAX / t->shape[d]))
                fail("bad dimension", t);
            numel *= t->shape[d];
        }
        if (numel != t->numel || (uint64_t)t->numel * kf_dtype_size(t->dtype) != t->nbytes)
            fail("numel or nbytes inconsistent", t);
        const unsigned char *p = t->data;
        if (t->nbytes > 0 && (p < lo || p > hi || t->nbytes > (size_t)(hi - p)))
            fail("bytes outside the data section", t);
        for (size_t b = 0; b < t->nbytes; b++)
            sum += p[b];
        const int64_t bad = kf_st_first_nonfinite(t, NULL);
        if (bad < -1 || bad >= t->numel)
            fail("non-finite index outside the tensor", t);
    }
    qsort(order, set->n_tensors, sizeof *order, by_offset);
    for (size_t i = 1; i < set->n_tensors; i++)
        if (order[i - 1]->nbytes > 0 && order[i]->nbytes > 0 &&
            (const unsigned char *)order[i - 1]->data + order[i - 1]->nbytes > (const unsigned char *)order[i]->data)
            fail("tensors overlap", order[i]);
    free(order);
    if (sum == 0xdeadbeef) /* keep the reads */
        fputc(' ', stderr);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (ftruncate(g_fd, 0) != 0 || pwrite(g_fd, data, size, 0) != (ssize_t)size)
        abort();
    kf_st_set set = {0};
    kf_error err = {0};
    const kf_status st = kf_st_open_file(&set, g_path, &err);
    if (st != KF_OK) {
        if (!strstr(err.msg, g_path)) {
            fprintf(stderr, "fuzz_safetensors: refusal %d does not name the file: '%s'\n", st, err.msg);
            abort();
        }
        return 0;
    }
    check_set(&set);
    kf_st_close(&set);
    return 0;
}
