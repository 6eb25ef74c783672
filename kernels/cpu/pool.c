/* A small pthread pool: workers sleep on a condition variable, items go out through an atomic
 * counter. */
#include "kernels/cpu/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct kf_pool {
    int n_threads;
    pid_t pid;               /* the process that started the workers (a fork's child has none) */
    pthread_t *workers;      /* [n_threads - 1] */
    pthread_mutex_t mu;
    pthread_cond_t wake;     /* workers wait here for a new job (or shutdown) */
    pthread_cond_t done;     /* the caller waits here for the workers to leave the job */
    unsigned long job;       /* generation: bumped for every job */
    int shutdown;
    int busy;                /* workers still inside the current job */
    kf_pool_fn fn;
    void *ctx;
    int n_items;
    atomic_int next;         /* next item to hand out */
};

typedef struct {
    kf_pool *p;
    int thread;
} worker_arg;

static void drain(kf_pool *p, kf_pool_fn fn, void *ctx, int n_items, int thread) {
    for (int i; (i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < n_items;)
        fn(ctx, i, thread);
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    kf_pool *p = wa->p;
    const int thread = wa->thread;
    free(wa);
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->shutdown && p->job == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->shutdown)
            break;
        seen = p->job;
        kf_pool_fn fn = p->fn;
        void *ctx = p->ctx;
        const int n_items = p->n_items;
        pthread_mutex_unlock(&p->mu);
        drain(p, fn, ctx, n_items, thread);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

kf_pool *kf_pool_create(int n_threads) {
    kf_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n_threads = 1;
    p->pid = getpid();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->next, 0);
    if (n_threads > 1 && !(p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers))) {
        kf_pool_destroy(p);
        return NULL;
    }
    for (int t = 1; t < n_threads; t++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa) {
            wa->p = p;
            wa->thread = t;
        }
        if (!wa || pthread_create(&p->workers[t - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            kf_pool_destroy(p);
            return NULL;
        }
        p->n_threads = t + 1;
    }
    return p;
}

void kf_pool_destroy(kf_pool *p) {
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->shutdown = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int t = 1; t < p->n_threads && getpid() == p->pid; t++)
        pthread_join(p->workers[t - 1], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
}

int kf_pool_threads(const kf_pool *p) {
    return p ? p->n_threads : 1;
}

void kf_pool_run(kf_pool *p, int n_items, kf_pool_fn fn, void *ctx) {
    if (n_items <= 0)
        return;
    if (!p || p->n_threads == 1 || n_items == 1 || getpid() != p->pid) {
        for (int i = 0; i < n_items; i++)
            fn(ctx, i, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_items = n_items;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    p->busy = p->n_threads - 1;
    p->job++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    drain(p, fn, ctx, n_items, 0);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
