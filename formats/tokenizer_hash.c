/* tokenizer_hash.c — open-addressing hash maps for the tokenizer: token bytes -> id, and
 * merge pair -> (rank, merged id). Linear probing, load factor at most 1/2. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tokenizer_internal.h"

uint64_t kf_hash_bytes(const void *p, size_t len) { return XXH3_64bits(p, len); }

void kf_bmap_free(kf_bmap *m) {
    free(m->slots);
    free(m->pool);
    memset(m, 0, sizeof *m);
}

void kf_bmap_clear(kf_bmap *m) {
    if (m->slots)
        memset(m->slots, 0, m->cap * sizeof *m->slots);
    m->n = 0;
    m->pool_len = 0;
}

static bool bmap_grow(kf_bmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    kf_bmap_slot *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return false;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->slots[i].used)
            continue;
        size_t j = m->slots[i].hash & (cap - 1);
        while (slots[j].used)
            j = (j + 1) & (cap - 1);
        slots[j] = m->slots[i];
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    return true;
}

bool kf_bmap_put(kf_bmap *m, const void *key, size_t len, int32_t value) {
    if (len > UINT32_MAX / 2)
        return false;
    if ((m->n + 1) * 2 > m->cap && !bmap_grow(m))
        return false;
    uint64_t h = kf_hash_bytes(key, len);
    size_t j = h & (m->cap - 1);
    while (m->slots[j].used) {
        kf_bmap_slot *s = &m->slots[j];
        if (s->hash == h && s->len == len && memcmp(m->pool + s->off, key, len) == 0) {
            s->value = value;
            return true;
        }
        j = (j + 1) & (m->cap - 1);
    }
    if (m->pool_len + len > m->pool_cap) {
        size_t cap = m->pool_cap ? m->pool_cap : 4096;
        while (cap < m->pool_len + len)
            cap *= 2;
        if (cap > UINT32_MAX)
            return false;
        char *pool = realloc(m->pool, cap);
        if (!pool)
            return false;
        m->pool = pool;
        m->pool_cap = cap;
    }
    if (len)
        memcpy(m->pool + m->pool_len, key, len);
    m->slots[j] = (kf_bmap_slot){.hash = h, .off = (uint32_t)m->pool_len, .len = (uint32_t)len,
                                 .value = value, .used = 1};
    m->pool_len += len;
    m->n++;
    return true;
}

bool kf_bmap_get(const kf_bmap *m, const void *key, size_t len, int32_t *value) {
    if (!m->cap)
        return false;
    uint64_t h = kf_hash_bytes(key, len);
    size_t j = h & (m->cap - 1);
    while (m->slots[j].used) {
        const kf_bmap_slot *s = &m->slots[j];
        if (s->hash == h && s->len == len && memcmp(m->pool + s->off, key, len) == 0) {
            *value = s->value;
            return true;
        }
        j = (j + 1) & (m->cap - 1);
    }
    return false;
}

void kf_pmap_free(kf_pmap *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

bool kf_pmap_reserve(kf_pmap *m, size_t n) {
    size_t cap = 1024;
    while (cap < 2 * n + 2)
        cap *= 2;
    kf_pmap_slot *slots = malloc(cap * sizeof *slots);
    if (!slots)
        return false;
    for (size_t i = 0; i < cap; i++)
        slots[i].key = UINT64_MAX;
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    m->n = 0;
    return true;
}

static inline uint64_t pmap_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

void kf_pmap_put(kf_pmap *m, int32_t left, int32_t right, int32_t rank, int32_t id) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t j = pmap_hash(key) & (m->cap - 1);
    while (m->slots[j].key != UINT64_MAX) {
        if (m->slots[j].key == key)
            return;
        j = (j + 1) & (m->cap - 1);
    }
    m->slots[j] = (kf_pmap_slot){.key = key, .rank = rank, .id = id};
    m->n++;
}

const kf_pmap_slot *kf_pmap_get(const kf_pmap *m, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t j = pmap_hash(key) & (m->cap - 1);
    while (m->slots[j].key != UINT64_MAX) {
        if (m->slots[j].key == key)
            return &m->slots[j];
        j = (j + 1) & (m->cap - 1);
    }
    return NULL;
}
