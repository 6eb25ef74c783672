/* jinja_value.c — values of a render: the arena they live in, Python's str() of them, equality and
 * ordering as CPython defines them, and json.dumps as Hugging Face's tojson filter calls it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

#define JV_MAX_DEPTH 200 /* nesting of lists/dicts walked by == and < (deeper is refused) */

struct jarena_chunk {
    jarena_chunk *next;
    size_t size, used;
    _Alignas(16) unsigned char mem[];
};

void jarena_free(jarena *a) {
    for (jarena_chunk *k = a->head, *next; k; k = next) {
        next = k->next;
        free(k);
    }
    a->head = NULL, a->used = 0;
}

void *jalloc(jctx *c, size_t n) {
    jarena *a = c->arena;
    n = (n + 15) & ~(size_t)15;
    if (a->limit && (n > a->limit || a->used > a->limit - n))
        jfail(c, KF_ERR_NOSPACE, 0, 0, "the template needs more than %zu bytes of memory", a->limit);
    jarena_chunk *k = a->head;
    if (!k || k->size - k->used < n) {
        const size_t size = n > 65536 ? n : 65536;
        k = malloc(sizeof *k + size);
        if (!k)
            jfail(c, KF_ERR_NOMEM, 0, 0, "out of memory");
        k->size = size, k->used = 0, k->next = a->head;
        a->head = k;
    }
    void *p = k->mem + k->used;
    k->used += n, a->used += n;
    memset(p, 0, n);
    return p;
}

jstr *jstr_new(jctx *c, const char *b, size_t len) {
    jstr *s = jalloc(c, sizeof *s + len + 1);
    if (len)
        memcpy(s->b, b, len);
    s->b[len] = 0;
    s->len = len;
    s->ncp = jutf8_count(b, len);
    return s;
}

jstr *jstr_cat(jctx *c, const jstr *x, const jstr *y) {
    jstr *s = jalloc(c, sizeof *s + x->len + y->len + 1);
    memcpy(s->b, x->b, x->len);
    memcpy(s->b + x->len, y->b, y->len);
    s->b[x->len + y->len] = 0;
    s->len = x->len + y->len, s->ncp = x->ncp + y->ncp;
    return s;
}

jv jv_cstr(jctx *c, const char *s) { return jv_str(jstr_new(c, s, strlen(s))); }

jlist *jlist_new(jctx *c, size_t cap) {
    jlist *l = jalloc(c, sizeof *l);
    l->cap = cap ? cap : 1;
    l->items = jalloc(c, l->cap * sizeof *l->items);
    return l;
}

void jlist_push(jctx *c, jlist *l, jv v) {
    if (l->n == l->cap) {
        jv *items = jalloc(c, 2 * l->cap * sizeof *items);
        memcpy(items, l->items, l->n * sizeof *items);
        l->items = items, l->cap *= 2;
    }
    l->items[l->n++] = v;
}

jdict *jdict_new(jctx *c, size_t cap) {
    jdict *d = jalloc(c, sizeof *d);
    d->cap = cap ? cap : 1;
    d->keys = jalloc(c, d->cap * sizeof *d->keys);
    d->vals = jalloc(c, d->cap * sizeof *d->vals);
    return d;
}

void jdict_set(jctx *c, jdict *d, jstr *k, jv v) {
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i]->len == k->len && memcmp(d->keys[i]->b, k->b, k->len) == 0) {
            d->vals[i] = v;
            return;
        }
    if (d->n == d->cap) {
        jstr **keys = jalloc(c, 2 * d->cap * sizeof *keys);
        jv *vals = jalloc(c, 2 * d->cap * sizeof *vals);
        memcpy(keys, d->keys, d->n * sizeof *keys);
        memcpy(vals, d->vals, d->n * sizeof *vals);
        d->keys = keys, d->vals = vals, d->cap *= 2;
    }
    d->keys[d->n] = k, d->vals[d->n] = v, d->n++;
}

bool jdict_get(const jdict *d, const char *k, size_t klen, jv *out) {
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i]->len == klen && memcmp(d->keys[i]->b, k, klen) == 0) {
            *out = d->vals[i];
            return true;
        }
    return false;
}

void jbuf_put(jctx *c, jbuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *nb = jalloc(c, cap);
        if (b->len)
            memcpy(nb, b->b, b->len);
        b->b = nb, b->cap = cap;
    }
    if (n)
        memcpy(b->b + b->len, s, n);
    b->len += n;
    b->b[b->len] = 0;
}

const char *jv_type_name(jv v) {
    static const char *const names[] = {"Undefined", "NoneType", "bool", "int", "float", "str", "list",
                                        "dict", "Namespace", "function", "LoopContext"};
    if (v.kind == JV_LIST && v.tuple)
        return v.tuple == 1 ? "tuple" : v.tuple == JV_VIEW ? "dict view" : "iterator";
    return names[v.kind];
}

/* Whether Python could hash it (a dict key lookup): not a list, a dict or a dict view; a tuple when
 * its items are (never one of this module's string keys anyway). */
bool jv_hashable(jv v) {
    if (v.kind == JV_DICT || (v.kind == JV_LIST && (v.tuple == 0 || v.tuple == JV_VIEW)))
        return false;
    if (v.kind == JV_LIST && v.tuple == 1)
        for (size_t i = 0; i < v.u.l->n; i++)
            if (!jv_hashable(v.u.l->items[i]))
                return false;
    return true;
}

bool jv_truthy(jv v) {
    switch (v.kind) {
    case JV_UNDEF: case JV_NONE: return false;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0;
    case JV_STR: return v.u.s->len > 0;
    case JV_LIST: return v.tuple == JV_ITER || v.u.l->n > 0;
    case JV_DICT: return v.u.d->n > 0;
    default: return true;
    }
}

/* The digits and exponent of the shortest decimal that reads back as f (finite, > 0), as Python's
 * repr finds it: at each length the nearest decimal, or else its neighbour in the last digit (near a
 * power of two the interval that reads back as f is lopsided; at most one neighbour can be in it). */
static int shortest_digits(double f, char *digits, int *exp10) {
    char tmp[48];
    uint64_t m = 0;
    int e = 0, p = 1;
    for (; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, f);
        m = 0;
        const char *t = tmp;
        for (; *t && *t != 'e'; t++)
            if (*t != '.')
                m = m * 10 + (uint64_t)(*t - '0');
        e = atoi(t + 1);
        if (strtod(tmp, NULL) == f || p == 17)
            break;
        uint64_t lo = 1;
        for (int i = 1; i < p; i++)
            lo *= 10; /* 10^(p-1): the smallest p-digit mantissa */
        bool found = false;
        for (int delta = -1; delta <= 1 && !found; delta += 2) {
            uint64_t m2 = m + (uint64_t)(int64_t)delta;
            int e2 = e;
            if (m2 == 10 * lo)
                m2 = lo, e2++;
            else if (m2 < lo)
                m2 = 10 * lo - 1, e2--;
            snprintf(tmp, sizeof tmp, "%llue%d", (unsigned long long)m2, e2 - (p - 1));
            if (strtod(tmp, NULL) == f)
                m = m2, e = e2, found = true;
        }
        if (found)
            break;
    }
    *exp10 = e;
    return snprintf(digits, 24, "%llu", (unsigned long long)m);
}

void jfmt_float(double f, char *buf) {
    if (isnan(f)) {
        strcpy(buf, "nan");
        return;
    }
    if (isinf(f)) {
        strcpy(buf, f < 0 ? "-inf" : "inf");
        return;
    }
    if (f == 0) {
        strcpy(buf, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    char d[24];
    int e;
    const int n = shortest_digits(fabs(f), d, &e), decpt = e + 1;
    char *o = buf;
    if (f < 0)
        *o++ = '-';
    if (decpt <= -4 || decpt > 16) { /* repr's exponent form: 1e+16, 1.5e-07 */
        *o++ = d[0];
        if (n > 1) {
            *o++ = '.';
            memcpy(o, d + 1, (size_t)n - 1), o += n - 1;
        }
        sprintf(o, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    } else if (decpt <= 0) {
        o += sprintf(o, "0.");
        for (int i = 0; i < -decpt; i++)
            *o++ = '0';
        strcpy(o, d);
    } else if (decpt >= n) {
        memcpy(o, d, (size_t)n), o += n;
        for (int i = n; i < decpt; i++)
            *o++ = '0';
        strcpy(o, ".0");
    } else {
        memcpy(o, d, (size_t)decpt), o += decpt;
        *o++ = '.';
        strcpy(o, d + decpt);
    }
}

jstr *jv_to_str(jctx *c, jv v, const jnode *at) {
    char buf[48];
    switch (v.kind) {
    case JV_STR: return v.u.s;
    case JV_UNDEF: return jstr_new(c, "", 0);
    case JV_NONE: return jstr_new(c, "None", 4);
    case JV_BOOL: return v.u.b ? jstr_new(c, "True", 4) : jstr_new(c, "False", 5);
    case JV_INT: snprintf(buf, sizeof buf, "%lld", (long long)v.u.i); break;
    case JV_FLOAT: jfmt_float(v.u.f, buf); break;
    default:
        jfail(c, KF_ERR_UNSUPPORTED, at ? at->line : 0, at ? at->col : 0, "str() of a %s (its Python repr) is not supported",
              jv_type_name(v));
    }
    return jstr_new(c, buf, strlen(buf));
}

static bool is_num(jv v) { return v.kind == JV_BOOL || v.kind == JV_INT || v.kind == JV_FLOAT; }
static int64_t as_int(jv v) { return v.kind == JV_BOOL ? v.u.b : v.u.i; }

/* -1, 0, 1 for numbers, exactly as Python compares int and float; 2 when unordered (nan). */
static int num_cmp(jv a, jv b) {
    if (a.kind != JV_FLOAT && b.kind != JV_FLOAT) {
        const int64_t x = as_int(a), y = as_int(b);
        return x < y ? -1 : x > y;
    }
    const long double x = a.kind == JV_FLOAT ? (long double)a.u.f : (long double)as_int(a);
    const long double y = b.kind == JV_FLOAT ? (long double)b.u.f : (long double)as_int(b);
    if (x != x || y != y)
        return 2;
    return x < y ? -1 : x > y;
}

_Noreturn static void too_deep(jctx *c, const jnode *at) {
    jfail(c, KF_ERR_UNSUPPORTED, at ? at->line : 0, at ? at->col : 0, "comparing values nested more than %d deep",
          JV_MAX_DEPTH);
}

static bool equal_at(jctx *c, const jnode *at, jv a, jv b, int depth) {
    if (is_num(a) && is_num(b))
        return num_cmp(a, b) == 0;
    if ((a.kind == JV_LIST && a.tuple >= JV_VIEW) || (b.kind == JV_LIST && b.tuple >= JV_VIEW))
        jfail(c, KF_ERR_UNSUPPORTED, at ? at->line : 0, at ? at->col : 0, "comparing a dict view or an iterator");
    if (a.kind != b.kind)
        return false;
    if (depth > JV_MAX_DEPTH)
        too_deep(c, at);
    switch (a.kind) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->b, b.u.s->b, a.u.s->len) == 0;
    case JV_LIST:
        if (a.tuple != b.tuple || a.u.l->n != b.u.l->n)
            return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!equal_at(c, at, a.u.l->items[i], b.u.l->items[i], depth + 1))
                return false;
        return true;
    case JV_DICT:
        if (a.u.d->n != b.u.d->n)
            return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            jv w;
            if (!jdict_get(b.u.d, a.u.d->keys[i]->b, a.u.d->keys[i]->len, &w) || !equal_at(c, at, a.u.d->vals[i], w, depth + 1))
                return false;
        }
        return true;
    case JV_NS: return a.u.d == b.u.d;
    case JV_FUNC: return a.u.fn == b.u.fn;
    case JV_LOOP: return a.u.loop == b.u.loop;
    default: return false;
    }
}

bool jv_equal(jctx *c, const jnode *at, jv a, jv b) { return equal_at(c, at, a, b, 0); }

static int compare_at(jctx *c, const jnode *at, jv a, jv b, bool *ok, int depth) {
    if (is_num(a) && is_num(b)) {
        const int r = num_cmp(a, b);
        return r == 2 ? 0 : r; /* nan: every comparison false; the caller's op decides */
    }
    if (a.kind == JV_STR && b.kind == JV_STR) {
        const size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        const int r = memcmp(a.u.s->b, b.u.s->b, n); /* UTF-8 byte order is code point order */
        return r ? (r < 0 ? -1 : 1) : (a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len);
    }
    if (a.kind == JV_LIST && b.kind == JV_LIST && a.tuple == b.tuple) {
        if (depth > JV_MAX_DEPTH)
            too_deep(c, at);
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++)
            if (!equal_at(c, at, a.u.l->items[i], b.u.l->items[i], depth + 1))
                return compare_at(c, at, a.u.l->items[i], b.u.l->items[i], ok, depth + 1);
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
    }
    *ok = false;
    return 0;
}

int jv_compare(jctx *c, const jnode *at, jv a, jv b, bool *ok) {
    *ok = true;
    if (is_num(a) && is_num(b) && num_cmp(a, b) == 2) {
        *ok = false; /* nan ordering is refused rather than reproduced */
        return 0;
    }
    return compare_at(c, at, a, b, ok, 0);
}
