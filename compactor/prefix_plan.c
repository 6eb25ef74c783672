#include "compactor/prefix_plan.h"

#include <stdlib.h>
#include <string.h>

/* qsort has no context argument: the documents being sorted */
static const int32_t *const *g_docs;
static const int64_t *g_lens;

static int cmp_docs(const void *pa, const void *pb) {
    const int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    const int32_t *x = g_docs[a], *y = g_docs[b];
    const int64_t n = g_lens[a] < g_lens[b] ? g_lens[a] : g_lens[b];
    for (int64_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return x[i] < y[i] ? -1 : 1;
    if (g_lens[a] != g_lens[b])
        return g_lens[a] < g_lens[b] ? -1 : 1; /* a prefix sorts before its extensions */
    return a < b ? -1 : (a > b); /* ties by index: a deterministic order */
}

void kf_prefix_plan_free(kf_prefix_plan *p) {
    free(p->order);
    free(p->parent);
    free(p->pred);
    free(p->shared);
    memset(p, 0, sizeof *p);
}

kf_status kf_prefix_plan_build(const int32_t *const *docs, const int64_t *lens, int n, int granule,
                               const kf_prefix_cost *cost, kf_prefix_plan *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    if (n < 0 || granule < 16 || granule % 16)
        return kf_fail(err, KF_ERR_INVALID, "prefix plan: %d documents, granule %d (a positive multiple of 16)", n,
                       granule);
    const size_t m = n ? (size_t)n : 1;
    out->n = n;
    out->order = malloc(sizeof(int32_t) * m);
    out->parent = malloc(sizeof(int32_t) * m);
    out->pred = malloc(sizeof(int32_t) * m);
    out->shared = calloc(m, sizeof(int64_t));
    if (!out->order || !out->parent || !out->pred || !out->shared) {
        kf_prefix_plan_free(out);
        return kf_fail(err, KF_ERR_NOMEM, "prefix plan: out of memory");
    }
    for (int i = 0; i < n; i++) {
        out->order[i] = i;
        out->parent[i] = -1;
        out->pred[i] = -1;
        out->tokens_total += lens[i];
    }
    g_docs = docs;
    g_lens = lens;
    qsort(out->order, (size_t)n, sizeof(int32_t), cmp_docs);
    g_docs = NULL;
    g_lens = NULL;

    int64_t shared_sum = 0;
    for (int k = 1; k < n; k++) {
        const int32_t i = out->order[k], prev = out->order[k - 1];
        out->pred[i] = prev;
        const int64_t lim = lens[prev] < lens[i] - 1 ? lens[prev] : lens[i] - 1; /* keep the last token */
        int64_t lcp = 0;
        while (lcp < lim && docs[i][lcp] == docs[prev][lcp])
            lcp++;
        const int64_t s = lcp / granule * granule;
        if (s <= 0)
            continue;
        out->shared[i] = s;
        int32_t owner = prev; /* climb to the document that computed these pages */
        while (out->parent[owner] >= 0 && out->shared[owner] >= s)
            owner = out->parent[owner];
        out->parent[i] = owner;
        shared_sum += s;
    }
    out->enabled = shared_sum > 0;
    if (cost && shared_sum > 0) {
        out->saved_s = (double)shared_sum * cost->flops_per_token / cost->flops_per_s;
        out->added_s = (double)shared_sum * cost->kv_bytes_per_token / cost->bytes_per_s;
        if (!cost->writes_kv)
            out->added_s += (double)out->tokens_total * cost->kv_bytes_per_token / cost->bytes_per_s;
        out->enabled = out->saved_s > out->added_s;
    }
    if (!out->enabled) {
        for (int i = 0; i < n; i++) {
            out->shared[i] = 0;
            out->parent[i] = -1;
        }
        shared_sum = 0;
    }
    out->tokens_computed = out->tokens_total - shared_sum;
    return KF_OK;
}
