#include "compactor/refq.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"

kf_status kf_refq_init(kf_refq *r, int n_layers, int kv_heads, int head_dim, int group, int64_t n_pos, int bf16,
                       kf_error *err) {
    return kf_refq_init_held(r, n_layers, n_layers, kv_heads, head_dim, group, n_pos, bf16, err);
}

kf_status kf_refq_init_held(kf_refq *r, int n_layers, int n_held, int kv_heads, int head_dim, int group, int64_t n_pos,
                            int bf16, kf_error *err) {
    memset(r, 0, sizeof *r);
    if (n_held < 1 || n_held > n_layers)
        return kf_fail(err, KF_ERR_INVALID, "reference queries: %d layers held of %d", n_held, n_layers);
    r->n_layers = n_layers;
    r->n_held = n_held;
    r->kv_heads = kv_heads;
    r->head_dim = head_dim;
    r->group = group;
    r->n_pos = n_pos;
    r->R = (int64_t)group * n_pos;
    const size_t n = (size_t)n_held * kv_heads * (size_t)r->R * head_dim;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    if (bf16)
        r->qh = malloc(elem * (n ? n : 1));
    else
        r->q = malloc(elem * (n ? n : 1));
    r->source = calloc((size_t)(n_pos ? n_pos : 1), 1);
    if (!(r->q || r->qh) || !r->source) {
        kf_refq_free(r);
        return kf_fail(err, KF_ERR_NOMEM, "reference queries: out of memory (%.1f MiB)", (double)(n * elem) / (1 << 20));
    }
    return KF_OK;
}

const float *kf_refq_head(const kf_refq *r, int layer, int g, float *scratch) {
    if (r->q)
        return kf_refq_rows(r, layer, g);
    const size_t n = (size_t)r->R * r->head_dim;
    const uint16_t *h = r->qh + ((size_t)(layer % r->n_held) * r->kv_heads + g) * n;
    for (size_t i = 0; i < n; i++)
        scratch[i] = kf_bf16_to_f32(h[i]);
    return scratch;
}

void kf_refq_free(kf_refq *r) {
    free(r->q);
    free(r->qh);
    free(r->source);
    memset(r, 0, sizeof *r);
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int kf_sample_indices(int64_t n_total, int64_t n_keep, uint64_t seed, int64_t *out) {
    if (n_keep >= n_total) {
        for (int64_t i = 0; i < n_total; i++)
            out[i] = i;
        return 0;
    }
    /* partial Fisher-Yates over a permutation of [0, n_total) */
    int64_t *perm = malloc(sizeof(int64_t) * (size_t)n_total);
    if (!perm)
        return -1;
    for (int64_t i = 0; i < n_total; i++)
        perm[i] = i;
    uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 0xD1B54A32D192ED03ULL;
    for (int64_t i = 0; i < n_keep; i++) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        const uint64_t rnd = s * 0x2545F4914F6CDD1DULL;
        const int64_t j = i + (int64_t)(rnd % (uint64_t)(n_total - i));
        const int64_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    memcpy(out, perm, sizeof(int64_t) * (size_t)n_keep);
    free(perm);
    qsort(out, (size_t)n_keep, sizeof *out, cmp_i64);
    return 0;
}
