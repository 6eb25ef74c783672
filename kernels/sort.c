/* sort.c — top-down merge sort (kernels/sort.h). */
#include "kernels/sort.h"

#include <string.h>

static void msort(unsigned char *b, size_t n, size_t s, int (*cmp)(const void *, const void *), unsigned char *t) {
    if (n <= 1)
        return;
    size_t n1 = n / 2, n2 = n - n1;
    unsigned char *b1 = b, *b2 = b + n1 * s, *o = t;
    msort(b1, n1, s, cmp, t);
    msort(b2, n2, s, cmp, t);
    while (n1 > 0 && n2 > 0) { /* ties take the left run: stable */
        if (cmp(b1, b2) <= 0)
            memcpy(o, b1, s), b1 += s, n1--;
        else
            memcpy(o, b2, s), b2 += s, n2--;
        o += s;
    }
    if (n1 > 0)
        memcpy(o, b1, n1 * s);
    memcpy(b, t, (n - n2) * s); /* the right run's rest is already in place */
}

void kf_sort(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *), void *tmp) {
    msort(base, n, size, cmp, tmp);
}
