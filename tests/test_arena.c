/* The paged KV arena: refcounts, fork, truncate (also inside a page), copy-on-write, running out
 * of pages, and the invariant that every page is either free or referenced. */
#include <stdlib.h>
#include <string.h>

#include "compactor/arena.h"
#include "test_util.h"

enum { LAYERS = 2, KVH = 2, HD = 4 };
#define ROW (KVH * HD)

static kf_backend *g_b;

static int init(void) {
    g_b = kf_backend_cpu_create();
    return g_b ? 0 : -1;
}
static int clean(void) {
    g_b->destroy(g_b);
    return 0;
}

/* Distinct value for (doc tag, token, layer, k/v, element). */
static float val(int tag, int64_t t, int layer, int is_v, int e) {
    return (float)(tag * 100000 + t * 100 + layer * 10 + is_v * 5) + e * 0.01f;
}

/* Append n tokens of document tag to s, as the forward pass does: reserve, write, advance. */
static kf_status append(kf_arena *a, kf_seq *s, int tag, int64_t n) {
    kf_error err = {0};
    kf_status st = kf_seq_reserve(a, s, n, &err);
    if (st != KF_OK)
        return st;
    float k[ROW], v[ROW];
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = s->len + i;
        for (int l = 0; l < LAYERS; l++) {
            for (int e = 0; e < ROW; e++) {
                k[e] = val(tag, t, l, 0, e);
                v[e] = val(tag, t, l, 1, e);
            }
            kf_paged_kv kv = kf_arena_layer(a, l);
            g_b->kv_store(g_b, &kv, s->pages, t, 1, k, v);
        }
    }
    s->len += n;
    return KF_OK;
}

/* Every token t of s in [t0, t1) holds tag's values. */
static int holds(kf_arena *a, const kf_seq *s, int tag, int64_t t0, int64_t t1) {
    kf_error err = {0};
    float k[ROW], v[ROW];
    for (int64_t t = t0; t < t1; t++)
        for (int l = 0; l < LAYERS; l++) {
            if (kf_seq_read_kv(a, s, l, t, 1, k, v, &err) != KF_OK)
                return 0;
            for (int e = 0; e < ROW; e++)
                if (k[e] != val(tag, t, l, 0, e) || v[e] != val(tag, t, l, 1, e))
                    return 0;
        }
    return 1;
}

/* Sum of refcounts equals the page references held by the documents; free + used = total. */
static void check_invariants(kf_arena *a, kf_seq **seqs, int n) {
    int refs = 0, used = 0;
    for (int p = 0; p < a->n_pages; p++) {
        refs += a->refcount[p];
        used += a->refcount[p] > 0;
    }
    int held = 0;
    for (int i = 0; i < n; i++)
        held += seqs[i]->n_pages;
    CU_ASSERT_EQUAL(refs, held);
    CU_ASSERT_EQUAL(used + a->n_free, a->n_pages);
    for (int i = 0; i < a->n_free; i++)
        CU_ASSERT_EQUAL(a->refcount[a->free_list[i]], 0);
}

static void test_append_and_read(void) {
    kf_arena a;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 8, KF_DTYPE_F32, &err), KF_OK);
    kf_seq s;
    kf_seq_init(&s);
    CU_ASSERT_EQUAL(append(&a, &s, 1, 5), KF_OK);
    CU_ASSERT_EQUAL(append(&a, &s, 1, 30), KF_OK);
    CU_ASSERT_EQUAL(s.len, 35);
    CU_ASSERT_EQUAL(s.n_pages, 3);
    CU_ASSERT(holds(&a, &s, 1, 0, 35));
    kf_seq *all[] = {&s};
    check_invariants(&a, all, 1);
    kf_seq_release(&a, &s);
    CU_ASSERT_EQUAL(a.n_free, 8);
    kf_arena_free(&a);
}

static void test_fork_shares_and_copies_on_write(void) {
    kf_arena a;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 16, KF_DTYPE_F32, &err), KF_OK);
    kf_seq parent, child;
    kf_seq_init(&parent);
    CU_ASSERT_EQUAL(append(&a, &parent, 1, 40), KF_OK); /* pages 0,1 full, page 2 holds 8 */
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &parent, 40, &child, &err), KF_OK);
    CU_ASSERT_EQUAL(child.len, 40);
    for (int i = 0; i < 3; i++) {
        CU_ASSERT_EQUAL(child.pages[i], parent.pages[i]);
        CU_ASSERT_EQUAL(a.refcount[parent.pages[i]], 2);
    }
    /* the child writes into the shared partial page: it gets its own copy */
    const int32_t shared_last = parent.pages[2];
    CU_ASSERT_EQUAL(append(&a, &child, 2, 10), KF_OK);
    CU_ASSERT_NOT_EQUAL(child.pages[2], shared_last);
    CU_ASSERT_EQUAL(a.refcount[shared_last], 1);
    CU_ASSERT_EQUAL(a.refcount[parent.pages[0]], 2);
    CU_ASSERT(holds(&a, &child, 1, 0, 40));  /* the copy kept the prefix */
    CU_ASSERT(holds(&a, &child, 2, 40, 50));
    /* the parent continues with other tokens and does not see the child's */
    CU_ASSERT_EQUAL(append(&a, &parent, 3, 20), KF_OK);
    CU_ASSERT(holds(&a, &parent, 1, 0, 40));
    CU_ASSERT(holds(&a, &parent, 3, 40, 60));
    CU_ASSERT(holds(&a, &child, 2, 40, 50));
    kf_seq *all[] = {&parent, &child};
    check_invariants(&a, all, 2);
    /* a fork at a page boundary shares only whole pages */
    kf_seq grandchild;
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &child, 32, &grandchild, &err), KF_OK);
    CU_ASSERT_EQUAL(grandchild.n_pages, 2);
    CU_ASSERT_EQUAL(a.refcount[child.pages[0]], 3);
    kf_seq *all3[] = {&parent, &child, &grandchild};
    check_invariants(&a, all3, 3);
    kf_seq_release(&a, &parent);
    kf_seq_release(&a, &grandchild);
    CU_ASSERT(holds(&a, &child, 1, 0, 40));
    CU_ASSERT(holds(&a, &child, 2, 40, 50));
    kf_seq_release(&a, &child);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    /* forking more than the document holds is refused */
    kf_seq empty, bad;
    kf_seq_init(&empty);
    CU_ASSERT_EQUAL(kf_seq_fork(&a, &empty, 1, &bad, &err), KF_ERR_INVALID);
    kf_arena_free(&a);
}

static void test_truncate_inside_a_page_then_continue(void) {
    kf_arena a;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 16, KF_DTYPE_F32, &err), KF_OK);
    kf_seq s;
    kf_seq_init(&s);
    CU_ASSERT_EQUAL(append(&a, &s, 1, 70), KF_OK); /* 5 pages */
    CU_ASSERT_EQUAL(kf_seq_truncate(&a, &s, 37, &err), KF_OK);
    CU_ASSERT_EQUAL(s.len, 37);
    CU_ASSERT_EQUAL(s.n_pages, 3);
    CU_ASSERT_EQUAL(a.n_free, 13);
    CU_ASSERT_EQUAL(append(&a, &s, 4, 20), KF_OK);
    CU_ASSERT(holds(&a, &s, 1, 0, 37));
    CU_ASSERT(holds(&a, &s, 4, 37, 57));
    /* rewind a fork inside a shared page, then write: the parent keeps its tokens */
    kf_seq child;
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &s, 57, &child, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_seq_truncate(&a, &child, 20, &err), KF_OK);
    CU_ASSERT_EQUAL(append(&a, &child, 5, 6), KF_OK);
    CU_ASSERT(holds(&a, &s, 1, 0, 37));
    CU_ASSERT(holds(&a, &child, 1, 0, 20));
    CU_ASSERT(holds(&a, &child, 5, 20, 26));
    CU_ASSERT_EQUAL(kf_seq_truncate(&a, &child, 0, &err), KF_OK);
    CU_ASSERT_EQUAL(child.n_pages, 0);
    CU_ASSERT_EQUAL(kf_seq_truncate(&a, &s, 58, &err), KF_ERR_INVALID); /* cannot grow by truncating */
    kf_seq *all[] = {&s, &child};
    check_invariants(&a, all, 2);
    kf_seq_release(&a, &child);
    kf_seq_release(&a, &s);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
}

static void test_out_of_pages_is_a_status(void) {
    kf_arena a;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 4, KF_DTYPE_F32, &err), KF_OK);
    kf_seq s, t;
    kf_seq_init(&s);
    CU_ASSERT_EQUAL(append(&a, &s, 1, 40), KF_OK); /* 3 pages */
    CU_ASSERT_EQUAL(kf_seq_reserve(&a, &s, 30, &err), KF_ERR_NOSPACE);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "out of pages"));
    CU_ASSERT_EQUAL(s.n_pages, 3); /* unchanged */
    CU_ASSERT_EQUAL(a.n_free, 1);
    /* copy-on-write needs a page too: fork, fill the arena, then write into the shared page */
    CU_ASSERT_EQUAL_FATAL(kf_seq_fork(&a, &s, 40, &t, &err), KF_OK);
    CU_ASSERT_EQUAL(append(&a, &s, 2, 8), KF_OK); /* s's own copy of page 2: the last free page */
    CU_ASSERT_EQUAL(a.n_free, 0);
    CU_ASSERT_EQUAL(kf_seq_reserve(&a, &t, 1, &err), KF_OK); /* page 2 is t's alone now: no copy */
    CU_ASSERT_EQUAL(kf_seq_reserve(&a, &t, 9, &err), KF_ERR_NOSPACE);
    CU_ASSERT(holds(&a, &t, 1, 0, 40));
    CU_ASSERT(holds(&a, &s, 2, 40, 48));
    kf_seq *all[] = {&s, &t};
    check_invariants(&a, all, 2);
    kf_seq_release(&a, &s);
    kf_seq_release(&a, &t);
    CU_ASSERT_EQUAL(a.n_free, 4);
    kf_arena_free(&a);
    CU_ASSERT_EQUAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 0, KF_DTYPE_F32, &err), KF_ERR_INVALID);
}

/* Many random operations against a simple model of who holds which token values. */
static void test_random_operations_keep_invariants(void) {
    enum { DOCS = 6 };
    kf_arena a;
    kf_error err = {0};
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&a, g_b, LAYERS, KVH, HD, 40, KF_DTYPE_F32, &err), KF_OK);
    kf_seq docs[DOCS];
    int64_t written_by[DOCS][256]; /* tag that wrote each token of each document */
    for (int i = 0; i < DOCS; i++)
        kf_seq_init(&docs[i]);
    uint64_t rng = 12345;
    int failures = 0;
    for (int step = 0; step < 2000; step++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        const int d = (int)((rng >> 33) % DOCS), op = (int)((rng >> 40) % 4);
        const int64_t r = (int64_t)((rng >> 20) % 40);
        kf_seq *s = &docs[d];
        if (op == 0 && s->len + r <= 256) {
            int64_t before = s->len;
            if (append(&a, s, step, r) == KF_OK)
                for (int64_t t = before; t < s->len; t++)
                    written_by[d][t] = step;
        } else if (op == 1 && s->len > 0) {
            kf_seq_truncate(&a, s, (int64_t)((rng >> 8) % (uint64_t)(s->len + 1)), &err);
        } else if (op == 2) {
            const int src = (d + 1) % DOCS;
            const int64_t len = docs[src].len ? (int64_t)((rng >> 8) % (uint64_t)(docs[src].len + 1)) : 0;
            kf_seq_release(&a, s);
            CU_ASSERT_EQUAL(kf_seq_fork(&a, &docs[src], len, s, &err), KF_OK);
            memcpy(written_by[d], written_by[src], sizeof written_by[d]);
        } else if (op == 3) {
            kf_seq_release(&a, s);
        }
        for (int i = 0; i < DOCS; i++)
            for (int64_t t = 0; t < docs[i].len; t++)
                failures += !holds(&a, &docs[i], (int)written_by[i][t], t, t + 1);
    }
    CU_ASSERT_EQUAL(failures, 0);
    kf_seq *all[DOCS];
    for (int i = 0; i < DOCS; i++)
        all[i] = &docs[i];
    check_invariants(&a, all, DOCS);
    for (int i = 0; i < DOCS; i++)
        kf_seq_release(&a, &docs[i]);
    CU_ASSERT_EQUAL(a.n_free, a.n_pages);
    kf_arena_free(&a);
}

/* An arena holding one layer of four (kf_arena_init_held): every layer maps to the one slot (a
 * page is a quarter of a full one), a write of layer 1 reads back as layer 3, and held counts
 * outside 1 .. n_layers are refused. */
static void test_one_layer_held(void) {
    kf_error err = {0};
    kf_arena full, one;
    CU_ASSERT_EQUAL(kf_arena_init_held(&one, g_b, 4, 0, KVH, HD, 4, KF_DTYPE_F32, &err), KF_ERR_INVALID);
    CU_ASSERT_EQUAL(kf_arena_init_held(&one, g_b, 4, 5, KVH, HD, 4, KF_DTYPE_F32, &err), KF_ERR_INVALID);
    CU_ASSERT_EQUAL_FATAL(kf_arena_init(&full, g_b, 4, KVH, HD, 4, KF_DTYPE_F32, &err), KF_OK);
    CU_ASSERT_EQUAL_FATAL(kf_arena_init_held(&one, g_b, 4, 1, KVH, HD, 4, KF_DTYPE_F32, &err), KF_OK);
    CU_ASSERT_EQUAL(full.n_held, 4);
    CU_ASSERT_EQUAL(one.page_stride * 4, full.page_stride);
    CU_ASSERT_PTR_EQUAL(kf_arena_layer(&one, 0).k, kf_arena_layer(&one, 3).k);
    CU_ASSERT_PTR_NOT_EQUAL(kf_arena_layer(&full, 0).k, kf_arena_layer(&full, 3).k);
    kf_seq s;
    kf_seq_init(&s);
    CU_ASSERT_EQUAL_FATAL(kf_seq_reserve(&one, &s, 20, &err), KF_OK);
    float k[20 * ROW], v[20 * ROW], rk[20 * ROW], rv[20 * ROW];
    for (int i = 0; i < 20 * ROW; i++)
        k[i] = (float)i, v[i] = -(float)i;
    CU_ASSERT_EQUAL(kf_seq_write_kv(&one, &s, 1, 0, 20, k, v, &err), KF_OK);
    CU_ASSERT_EQUAL(kf_seq_read_kv(&one, &s, 3, 0, 20, rk, rv, &err), KF_OK);
    CU_ASSERT(memcmp(k, rk, sizeof k) == 0 && memcmp(v, rv, sizeof v) == 0);
    kf_seq_release(&one, &s);
    kf_arena_free(&one);
    kf_arena_free(&full);
}

static CU_TestInfo tests[] = {
    {"append and read back", test_append_and_read},
    {"fork shares pages, copy-on-write", test_fork_shares_and_copies_on_write},
    {"truncate inside a page, then continue", test_truncate_inside_a_page_then_continue},
    {"out of pages is a status", test_out_of_pages_is_a_status},
    {"2000 random operations keep the invariants", test_random_operations_keep_invariants},
    {"one layer held of four", test_one_layer_held},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"arena", init, clean, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
