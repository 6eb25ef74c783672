/* The per-thread workspace (kernels/workspace.h) and the scratch merge sort (kernels/sort.h). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/sort.h"
#include "kernels/workspace.h"
#include "test_util.h"

/* Requests are 64-byte aligned, rounded up to 64 bytes, refused (NULL) beyond the block, and a mark
 * gives back everything after it; peak is the most ever handed out. */
static void test_bump(void) {
    kf_ws ws;
    CU_ASSERT_EQUAL_FATAL(kf_ws_init(&ws, 1000), 0);
    CU_ASSERT_EQUAL(kf_ws_bytes(1, 1), 64);
    CU_ASSERT_EQUAL(kf_ws_bytes(16, 4), 64);
    CU_ASSERT_EQUAL(kf_ws_bytes(17, 4), 128);
    CU_ASSERT_EQUAL(kf_ws_bytes(0, 8), 0);
    float *a = kf_ws_alloc(&ws, 3, sizeof(float));
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_EQUAL((uintptr_t)a % KF_WS_ALIGN, 0);
    const size_t m = kf_ws_mark(&ws);
    CU_ASSERT_EQUAL(m, 64);
    double *b = kf_ws_zalloc(&ws, 100, sizeof(double)); /* 800 -> 832 bytes: 896 in all */
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    CU_ASSERT_EQUAL((uintptr_t)b % KF_WS_ALIGN, 0);
    CU_ASSERT_EQUAL((unsigned char *)b - (unsigned char *)a, 64);
    CU_ASSERT(b[0] == 0 && b[99] == 0);
    CU_ASSERT_PTR_NULL(kf_ws_alloc(&ws, 2, 64)); /* 128 more: past 1,000 */
    CU_ASSERT_PTR_NOT_NULL(kf_ws_alloc(&ws, 0, 8)); /* nothing always fits */
    CU_ASSERT_PTR_NOT_NULL(kf_ws_alloc(&ws, 1, 64)); /* 960 */
    CU_ASSERT_EQUAL(ws.peak, 960);
    kf_ws_reset(&ws, m);
    CU_ASSERT_EQUAL(ws.used, 64);
    CU_ASSERT_PTR_EQUAL(kf_ws_alloc(&ws, 1, 1), b); /* the same bytes again */
    CU_ASSERT_EQUAL(ws.peak, 960);
    CU_ASSERT_PTR_NULL(kf_ws_alloc(&ws, -1, 4));
    kf_ws_free(&ws);
    /* a function's own block when it is given none, else the caller's */
    kf_ws own, given;
    CU_ASSERT_EQUAL_FATAL(kf_ws_init(&given, 64), 0);
    CU_ASSERT_PTR_EQUAL(kf_ws_or_own(&given, &own, 1 << 20), &given);
    CU_ASSERT_PTR_NULL(own.raw);
    kf_ws *w = kf_ws_or_own(NULL, &own, 1 << 20);
    CU_ASSERT_PTR_EQUAL_FATAL(w, &own);
    CU_ASSERT_EQUAL(own.cap, 1 << 20);
    kf_ws_free(&own);
    kf_ws_free(&given);
}

typedef struct {
    int key, id;
} item;
static int by_key(const void *a, const void *b) {
    const item *x = a, *y = b;
    return (x->key > y->key) - (x->key < y->key);
}
static int by_key_then_id(const void *a, const void *b) {
    const int c = by_key(a, b);
    return c ? c : (((const item *)a)->id > ((const item *)b)->id) - (((const item *)a)->id < ((const item *)b)->id);
}

/* kf_sort gives qsort's order for a total order, keeps equal keys in their input order, and
 * touches nothing but its array and scratch. */
static void test_sort(void) {
    enum { N = 3001 };
    static item x[N], y[N], tmp[N + 1];
    uint64_t s = 7;
    for (int n = 0; n <= N; n += n < 20 ? 1 : 997) {
        for (int i = 0; i < n; i++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            x[i] = y[i] = (item){(int)(s >> 59), i}; /* 32 keys: many ties */
        }
        tmp[n] = (item){-7, -7};
        kf_sort(x, (size_t)n, sizeof *x, by_key, tmp);
        qsort(y, (size_t)n, sizeof *y, by_key_then_id); /* stable == sorted by (key, input index) */
        CU_ASSERT_EQUAL(memcmp(x, y, sizeof *x * (size_t)n), 0);
        CU_ASSERT(tmp[n].key == -7 && tmp[n].id == -7);
    }
}

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
/* Under AddressSanitizer the bytes not handed out are poisoned: a request's bytes are usable, its
 * padding and everything given back by a reset are not. */
static void test_poison(void) {
    kf_ws ws;
    CU_ASSERT_EQUAL_FATAL(kf_ws_init(&ws, 256), 0);
    CU_ASSERT(__asan_address_is_poisoned(ws.base));
    const size_t m = kf_ws_mark(&ws);
    char *a = kf_ws_alloc(&ws, 40, 1);
    CU_ASSERT(!__asan_address_is_poisoned(a) && !__asan_address_is_poisoned(a + 39));
    CU_ASSERT(__asan_address_is_poisoned(a + 40)); /* the padding up to 64 */
    kf_ws_reset(&ws, m);
    CU_ASSERT(__asan_address_is_poisoned(a));
    kf_ws_free(&ws);
}
#endif

static CU_TestInfo tests[] = {
    {"bump allocation: alignment, rounding, refusal, mark and reset, own block", test_bump},
    {"merge sort into scratch: qsort's order, stable", test_sort},
#if defined(__SANITIZE_ADDRESS__)
    {"under AddressSanitizer, what is not handed out is poisoned", test_poison},
#endif
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"workspace and sort", NULL, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
