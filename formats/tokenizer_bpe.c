/* tokenizer_bpe.c — the byte-level BPE model: one pre-token (raw bytes) -> ids.
 *
 * Start from one symbol per byte; keep a min-heap of adjacent pairs that have a merge, ordered by
 * (rank, position); pop, check the pair is still current (stale entries are skipped), merge the
 * right symbol into the left, push the two new neighbour pairs. O(n log n) in the word length, so
 * long runs (thousands of spaces or letters) stay cheap. Results for short words are cached.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

enum {
    KF_BPE_CACHE_MAX_WORD = 256,      /* bytes: longer pre-tokens are not cached */
    KF_BPE_CACHE_MAX_ENTRIES = 1 << 18,
};

void kf_bpe_free(kf_bpe *bpe) {
    kf_bmap_free(&bpe->vocab);
    kf_pmap_free(&bpe->merges);
    kf_bmap_free(&bpe->cache);
    free(bpe->syms);
    free(bpe->heap);
    free(bpe->cache_ids);
    free(bpe->cache_refs);
    memset(bpe, 0, sizeof *bpe);
}

static bool ids_reserve(kf_token_ids *out, size_t extra) {
    if (out->n + extra <= out->cap)
        return true;
    size_t cap = out->cap ? out->cap : 256;
    while (cap < out->n + extra)
        cap *= 2;
    int32_t *ids = realloc(out->ids, cap * sizeof *ids);
    if (!ids)
        return false;
    out->ids = ids;
    out->cap = cap;
    return true;
}

static inline bool cand_less(const kf_bpe_cand *a, const kf_bpe_cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(kf_bpe_cand *h, size_t *n, kf_bpe_cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static kf_bpe_cand heap_pop(kf_bpe_cand *h, size_t *n) {
    kf_bpe_cand top = h[0];
    kf_bpe_cand last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && cand_less(&h[c + 1], &h[c]))
            c++;
        if (!cand_less(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n)
        h[i] = last;
    return top;
}

static void push_pair(kf_bpe *bpe, size_t *heap_n, int32_t left) {
    int32_t right = bpe->syms[left].next;
    if (right < 0)
        return;
    const kf_pmap_slot *m = kf_pmap_get(&bpe->merges, bpe->syms[left].id, bpe->syms[right].id);
    if (!m)
        return;
    heap_push(bpe->heap, heap_n,
              (kf_bpe_cand){.rank = m->rank, .left = left, .left_id = bpe->syms[left].id,
                            .right_id = bpe->syms[right].id});
}

static void cache_store(kf_bpe *bpe, const char *word, size_t len, const int32_t *ids, size_t n) {
    if (len > KF_BPE_CACHE_MAX_WORD)
        return;
    if (bpe->cache.n >= KF_BPE_CACHE_MAX_ENTRIES) {
        kf_bmap_clear(&bpe->cache);
        bpe->cache_ids_len = 0;
        bpe->cache_refs_len = 0;
    }
    if (bpe->cache_ids_len + n > bpe->cache_ids_cap) {
        size_t cap = bpe->cache_ids_cap ? bpe->cache_ids_cap : 1 << 16;
        while (cap < bpe->cache_ids_len + n)
            cap *= 2;
        int32_t *p = realloc(bpe->cache_ids, cap * sizeof *p);
        if (!p)
            return; /* a cache is optional */
        bpe->cache_ids = p;
        bpe->cache_ids_cap = cap;
    }
    if (bpe->cache_refs_len + 2 > bpe->cache_refs_cap) {
        size_t cap = bpe->cache_refs_cap ? bpe->cache_refs_cap * 2 : 1 << 14;
        uint32_t *p = realloc(bpe->cache_refs, cap * sizeof *p);
        if (!p)
            return;
        bpe->cache_refs = p;
        bpe->cache_refs_cap = cap;
    }
    size_t ref = bpe->cache_refs_len / 2;
    if (!kf_bmap_put(&bpe->cache, word, len, (int32_t)ref))
        return;
    bpe->cache_refs[bpe->cache_refs_len++] = (uint32_t)bpe->cache_ids_len;
    bpe->cache_refs[bpe->cache_refs_len++] = (uint32_t)n;
    memcpy(bpe->cache_ids + bpe->cache_ids_len, ids, n * sizeof *ids);
    bpe->cache_ids_len += n;
}

kf_status kf_bpe_encode_word(kf_bpe *bpe, const char *word, size_t len, kf_token_ids *out,
                             kf_error *err) {
    if (len == 0)
        return KF_OK;
    int32_t ref;
    if (len <= KF_BPE_CACHE_MAX_WORD && kf_bmap_get(&bpe->cache, word, len, &ref)) {
        uint32_t start = bpe->cache_refs[2 * ref], n = bpe->cache_refs[2 * ref + 1];
        if (!ids_reserve(out, n))
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        memcpy(out->ids + out->n, bpe->cache_ids + start, n * sizeof(int32_t));
        out->n += n;
        return KF_OK;
    }
    int32_t whole;
    if (bpe->ignore_merges && kf_bmap_get(&bpe->vocab, word, len, &whole)) {
        if (!ids_reserve(out, 1))
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        out->ids[out->n++] = whole;
        return KF_OK;
    }
    if (len > INT32_MAX / 2)
        return kf_fail(err, KF_ERR_INVALID, "tokenizer: pre-token of %zu bytes is too long", len);
    if (len > bpe->syms_cap) {
        size_t cap = bpe->syms_cap ? bpe->syms_cap : 64;
        while (cap < len)
            cap *= 2;
        kf_bpe_sym *s = realloc(bpe->syms, cap * sizeof *s);
        kf_bpe_cand *h = realloc(bpe->heap, 3 * cap * sizeof *h);
        if (s)
            bpe->syms = s;
        if (h)
            bpe->heap = h;
        if (!s || !h)
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        bpe->syms_cap = cap;
        bpe->heap_cap = 3 * cap; /* at most 2 * len live entries */
    }
    /* One symbol per byte; a byte without a vocabulary entry becomes unk, or is dropped when the
     * model has no unk token (what the reference does). */
    int32_t n = 0;
    for (size_t i = 0; i < len; i++) {
        int32_t id = bpe->byte_id[(uint8_t)word[i]];
        if (id < 0)
            id = bpe->unk_id;
        if (id < 0)
            continue;
        bpe->syms[n] = (kf_bpe_sym){.pos = (int32_t)i, .len = 1, .id = id, .prev = n - 1, .next = n + 1};
        n++;
    }
    if (n == 0)
        return KF_OK;
    bpe->syms[n - 1].next = -1;
    size_t heap_n = 0;
    for (int32_t i = 0; i + 1 < n; i++)
        push_pair(bpe, &heap_n, i);
    while (heap_n) {
        kf_bpe_cand c = heap_pop(bpe->heap, &heap_n);
        kf_bpe_sym *l = &bpe->syms[c.left];
        if (l->len == 0 || l->id != c.left_id || l->next < 0)
            continue;
        kf_bpe_sym *r = &bpe->syms[l->next];
        if (r->id != c.right_id)
            continue;
        const kf_pmap_slot *m = kf_pmap_get(&bpe->merges, c.left_id, c.right_id);
        l->id = m->id;
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0)
            bpe->syms[r->next].prev = c.left;
        if (l->prev >= 0)
            push_pair(bpe, &heap_n, l->prev);
        push_pair(bpe, &heap_n, c.left);
    }
    size_t count = 0;
    for (int32_t i = 0; i >= 0; i = bpe->syms[i].next)
        count++;
    if (!ids_reserve(out, count))
        return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
    int32_t *dst = out->ids + out->n;
    for (int32_t i = 0; i >= 0; i = bpe->syms[i].next)
        *dst++ = bpe->syms[i].id;
    cache_store(bpe, word, len, out->ids + out->n, count);
    out->n += count;
    return KF_OK;
}
