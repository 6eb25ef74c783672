/* malloc_cap.so — an LD_PRELOAD shim for the CLI tests: every malloc, calloc or realloc of at least
 * KF_MALLOC_CAP bytes fails with ENOMEM, as it would on a machine out of memory; smaller ones go to
 * glibc. Unlike `ulimit -v` it does not depend on how much address space the shared libraries
 * (OpenBLAS's thread buffers, CUDA's) take, so a test can make exactly one large allocation fail. */
#include <errno.h>
#include <stdlib.h>

void *__libc_malloc(size_t n);
void *__libc_calloc(size_t k, size_t n);
void *__libc_realloc(void *p, size_t n);

static size_t cap(void) {
    static size_t c;
    if (!c) {
        const char *s = getenv("KF_MALLOC_CAP");
        c = s && *s ? strtoull(s, NULL, 10) : (size_t)-1;
    }
    return c;
}

void *malloc(size_t n) {
    if (n >= cap()) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_malloc(n);
}

void *calloc(size_t k, size_t n) {
    if (n && k >= cap() / n) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_calloc(k, n);
}

void *realloc(void *p, size_t n) {
    if (n >= cap()) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_realloc(p, n);
}
