/* jinja_str.c — Python's str operations on UTF-8 strings: indices count code points, white space is
 * str.isspace(), and each method gives what CPython gives (split, strip, replace, slices).
 */
#include <string.h>

#include "jinja_internal.h"

int jutf8_next(const char *s, size_t n, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0)
        return -1;
    if (u[0] < 0x80) {
        *cp = u[0];
        return 1;
    }
    int k;
    uint32_t v, min;
    if ((u[0] & 0xE0) == 0xC0)
        k = 2, v = u[0] & 0x1F, min = 0x80;
    else if ((u[0] & 0xF0) == 0xE0)
        k = 3, v = u[0] & 0x0F, min = 0x800;
    else if ((u[0] & 0xF8) == 0xF0)
        k = 4, v = u[0] & 0x07, min = 0x10000;
    else
        return -1;
    if ((size_t)k > n)
        return -1;
    for (int i = 1; i < k; i++) {
        if ((u[i] & 0xC0) != 0x80)
            return -1;
        v = v << 6 | (u[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return -1;
    *cp = v;
    return k;
}

size_t jutf8_put(uint32_t cp, char *d) {
    if (cp < 0x80) {
        d[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        d[0] = (char)(0xC0 | cp >> 6), d[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        d[0] = (char)(0xE0 | cp >> 12), d[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), d[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    d[0] = (char)(0xF0 | cp >> 18), d[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    d[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), d[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t jutf8_count(const char *s, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += ((unsigned char)s[i] & 0xC0) != 0x80;
    return n;
}

/* str.isspace() of CPython (Unicode 14/15: the same set). */
bool jcp_isspace(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

size_t jstr_offset(const jstr *s, int64_t i) {
    if (s->ncp == s->len)
        return (size_t)i;
    size_t off = 0;
    for (int64_t k = 0; k < i; k++) {
        off++;
        while (off < s->len && ((unsigned char)s->b[off] & 0xC0) == 0x80)
            off++;
    }
    return off;
}

/* Is the code point at s[i] (length *k) in chars (NULL: white space)? */
static bool strip_member(const jstr *s, size_t i, const jstr *chars, int *k) {
    uint32_t cp;
    *k = jutf8_next(s->b + i, s->len - i, &cp);
    if (!chars)
        return jcp_isspace(cp);
    for (size_t j = 0; j < chars->len;) {
        uint32_t c2;
        const int k2 = jutf8_next(chars->b + j, chars->len - j, &c2);
        if (c2 == cp)
            return true;
        j += (size_t)k2;
    }
    return false;
}

jstr *jstr_strip(jctx *c, const jstr *s, const jstr *chars, bool left, bool right) {
    size_t a = 0, b = s->len;
    int k;
    while (left && a < b && strip_member(s, a, chars, &k))
        a += (size_t)k;
    while (right && b > a) {
        size_t p = b - 1;
        while (p > a && ((unsigned char)s->b[p] & 0xC0) == 0x80)
            p--;
        if (!strip_member(s, p, chars, &k))
            break;
        b = p;
    }
    return jstr_new(c, s->b + a, b - a);
}

static const char *find_bytes(const char *h, size_t hn, const char *nd, size_t nn) {
    if (nn == 0)
        return h;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == nd[0] && memcmp(h + i, nd, nn) == 0)
            return h + i;
    return NULL;
}

bool jstr_find(const jstr *hay, const jstr *needle) {
    return find_bytes(hay->b, hay->len, needle->b, needle->len) != NULL;
}

/* str.split() with no separator: runs of white space, empty ends dropped. */
static jlist *split_space(jctx *c, const jstr *s, int64_t maxsplit) {
    jlist *l = jlist_new(c, 4);
    size_t i = 0;
    int k;
    for (;;) {
        while (i < s->len && strip_member(s, i, NULL, &k))
            i += (size_t)k;
        if (i >= s->len)
            break;
        if (maxsplit >= 0 && (int64_t)l->n == maxsplit) {
            jlist_push(c, l, jv_str(jstr_new(c, s->b + i, s->len - i))); /* the rest, as it is */
            break;
        }
        const size_t start = i;
        while (i < s->len && !strip_member(s, i, NULL, &k))
            i += (size_t)k;
        jlist_push(c, l, jv_str(jstr_new(c, s->b + start, i - start)));
    }
    return l;
}

jlist *jstr_split(jctx *c, const jstr *s, const jstr *sep, int64_t maxsplit, const jnode *at) {
    if (!sep)
        return split_space(c, s, maxsplit);
    if (sep->len == 0)
        jfail(c, KF_ERR_INVALID, at->line, at->col, "split(): empty separator");
    jlist *l = jlist_new(c, 4);
    const char *p = s->b, *end = s->b + s->len;
    for (;;) {
        const char *f = (maxsplit < 0 || (int64_t)l->n < maxsplit) ? find_bytes(p, (size_t)(end - p), sep->b, sep->len) : NULL;
        if (!f) {
            jlist_push(c, l, jv_str(jstr_new(c, p, (size_t)(end - p))));
            return l;
        }
        jlist_push(c, l, jv_str(jstr_new(c, p, (size_t)(f - p))));
        p = f + sep->len;
    }
}

jstr *jstr_replace(jctx *c, const jstr *s, const jstr *old, const jstr *new_, int64_t count) {
    jbuf b = {0};
    const char *p = s->b, *end = s->b + s->len;
    int64_t done = 0;
    if (old->len == 0) { /* Python inserts new before every code point and at the end */
        for (size_t i = 0; i <= s->len;) {
            if (count < 0 || done < count)
                jbuf_put(c, &b, new_->b, new_->len), done++;
            if (i == s->len)
                break;
            uint32_t cp;
            const int k = jutf8_next(s->b + i, s->len - i, &cp);
            jbuf_put(c, &b, s->b + i, (size_t)k);
            i += (size_t)k;
        }
        return jstr_new(c, b.b ? b.b : "", b.len);
    }
    for (;;) {
        const char *f = (count < 0 || done < count) ? find_bytes(p, (size_t)(end - p), old->b, old->len) : NULL;
        if (!f)
            break;
        jbuf_put(c, &b, p, (size_t)(f - p));
        jbuf_put(c, &b, new_->b, new_->len);
        p = f + old->len, done++;
    }
    jbuf_put(c, &b, p, (size_t)(end - p));
    return jstr_new(c, b.b ? b.b : "", b.len);
}

jstr *jstr_ascii_case(jctx *c, const jstr *s, bool upper, const jnode *at) {
    if (s->ncp != s->len)
        jfail(c, KF_ERR_UNSUPPORTED, at->line, at->col, "upper/lower of non-ASCII text");
    jstr *r = jstr_new(c, s->b, s->len);
    for (size_t i = 0; i < r->len; i++) {
        const char ch = r->b[i];
        if (upper && ch >= 'a' && ch <= 'z')
            r->b[i] = (char)(ch - 32);
        else if (!upper && ch >= 'A' && ch <= 'Z')
            r->b[i] = (char)(ch + 32);
    }
    return r;
}

/* Python's slice.indices(): clamps start/stop for a sequence of length n and step. */
static void slice_indices(int64_t n, bool has_start, int64_t *start, bool has_stop, int64_t *stop, int64_t step) {
    const int64_t lo = step < 0 ? -1 : 0, hi = step < 0 ? n - 1 : n;
    if (!has_start)
        *start = step < 0 ? hi : lo;
    else {
        if (*start < 0)
            *start = *start + n < lo ? lo : *start + n;
        else if (*start > hi)
            *start = hi;
    }
    if (!has_stop)
        *stop = step < 0 ? lo : hi;
    else {
        if (*stop < 0)
            *stop = *stop + n < lo ? lo : *stop + n;
        else if (*stop > hi)
            *stop = hi;
    }
}

jv jv_slice(jctx *c, jv seq, bool has_start, int64_t start, bool has_stop, int64_t stop, int64_t step) {
    const bool is_str = seq.kind == JV_STR;
    const int64_t n = is_str ? (int64_t)seq.u.s->ncp : (int64_t)seq.u.l->n;
    slice_indices(n, has_start, &start, has_stop, &stop, step);
    if (is_str) {
        const jstr *s = seq.u.s;
        size_t *off = NULL; /* [n + 1] byte offset of each code point, for non-ASCII text */
        if (s->ncp != s->len) {
            off = jalloc(c, ((size_t)n + 1) * sizeof *off);
            for (size_t i = 0, k = 0; i <= s->len; i++)
                if (i == s->len || ((unsigned char)s->b[i] & 0xC0) != 0x80)
                    off[k++] = i;
        }
        if (step == 1) {
            const size_t a = off ? off[start] : (size_t)start, b = off ? off[stop] : (size_t)stop;
            return jv_str(jstr_new(c, s->b + a, stop > start ? b - a : 0));
        }
        jbuf b = {0};
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            const size_t a = off ? off[i] : (size_t)i, e = off ? off[i + 1] : (size_t)i + 1;
            jbuf_put(c, &b, s->b + a, e - a);
        }
        return jv_str(jstr_new(c, b.b ? b.b : "", b.len));
    }
    jlist *l = jlist_new(c, 4);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        jlist_push(c, l, seq.u.l->items[i]);
    return jv_list(l, seq.tuple);
}
