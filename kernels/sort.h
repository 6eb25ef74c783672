/* sort.h — a merge sort into caller-given scratch (glibc's qsort mallocs its buffer for arrays
 * over 1 KiB; the solve's per-head path allocates nothing). Stable; for a comparison that is a
 * total order it gives qsort's result exactly. */
#ifndef KF_SORT_H
#define KF_SORT_H

#include <stddef.h>

/* Sorts n elements of size bytes at base; tmp [n * size] is scratch (kf_ws_bytes(n, size)). */
void kf_sort(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *), void *tmp);

#endif
