/* pool.h — a small pthread pool for the CPU backend's row kernels and attention.
 *
 * n_threads - 1 worker threads plus the calling thread. Workers sleep on a condition variable
 * between jobs (no busy-waiting: the GEMMs run on OpenBLAS's own threads, and spinning workers
 * next to them made prefill several times slower on a 2-core machine). A job is a loop of
 * n_items independent items handed out one at a time through an atomic counter, so uneven items
 * (causal attention tiles) balance themselves. Jobs from one pool must not overlap: one thread
 * of control submits at a time (the backend's contract). In a forked child (which inherits the
 * pool but not its threads) every job runs inline.
 */
#ifndef KF_POOL_H
#define KF_POOL_H

typedef struct kf_pool kf_pool;

/* fn(ctx, item, thread): thread is in [0, kf_pool_threads) and tells which per-thread scratch
 * the item may use (0 is the calling thread). */
typedef void (*kf_pool_fn)(void *ctx, int item, int thread);

/* A pool of n_threads threads in all (n_threads <= 1: no workers, every job runs inline).
 * NULL when out of memory or a thread could not be started. */
kf_pool *kf_pool_create(int n_threads);
void kf_pool_destroy(kf_pool *p);
int kf_pool_threads(const kf_pool *p); /* 1 for NULL */

/* Runs fn(ctx, i, thread) for every i in [0, n_items) and returns when all have finished.
 * With p NULL, one thread or a single item, it runs inline on the calling thread. */
void kf_pool_run(kf_pool *p, int n_items, kf_pool_fn fn, void *ctx);

/* Splits [0, n) into `parts` contiguous ranges of near-equal size: range i is [*lo, *hi). */
static inline void kf_pool_range(int n, int parts, int i, int *lo, int *hi) {
    const long long a = (long long)n * i / parts, b = (long long)n * (i + 1) / parts;
    *lo = (int)a;
    *hi = (int)b;
}

#endif
