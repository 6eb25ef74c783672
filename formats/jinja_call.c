/* jinja_call.c — calls: the str and dict methods of the subset, loop.cycle, and the globals
 * range, namespace, dict and raise_exception, each with CPython's argument rules.
 */
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

_Noreturn static void fail_at(jrender *r, const jnode *n, kf_status code, const char *fmt, const char *a) {
    jfail(r->c, code, n->line, n->col, fmt, a);
}

static const jstr *want_str(jrender *r, const jnode *at, jv v, const char *fn) {
    if (v.kind != JV_STR)
        fail_at(r, at, KF_ERR_INVALID, "%s: expected a str argument", fn);
    return v.u.s;
}

static int64_t want_int(jrender *r, const jnode *at, jv v, const char *fn) {
    if (v.kind != JV_INT && v.kind != JV_BOOL)
        fail_at(r, at, KF_ERR_INVALID, "%s: expected an int argument", fn);
    return v.kind == JV_BOOL ? v.u.b : v.u.i;
}

/* startswith/endswith: a str or a tuple of str (no start, end). */
static bool affix(jrender *r, const jnode *at, const jstr *s, jv arg, bool prefix, const char *fn) {
    if (arg.kind == JV_LIST && arg.tuple == 1) {
        for (size_t i = 0; i < arg.u.l->n; i++)
            if (affix(r, at, s, arg.u.l->items[i], prefix, fn))
                return true;
        return false;
    }
    const jstr *x = want_str(r, at, arg, fn);
    if (x->len > s->len)
        return false;
    return memcmp(prefix ? s->b : s->b + s->len - x->len, x->b, x->len) == 0;
}

static jv str_join(jrender *r, const jnode *at, const jstr *sep, jv seq) {
    if (seq.kind == JV_NONE || seq.kind == JV_INT || seq.kind == JV_FLOAT || seq.kind == JV_BOOL || seq.kind == JV_NS ||
        seq.kind == JV_FUNC)
        fail_at(r, at, KF_ERR_INVALID, "join(): can only join an iterable, not %s", jv_type_name(seq));
    const jlist *items = jiter_items(r, seq, at);
    jbuf b = {0};
    for (size_t i = 0; i < items->n; i++) {
        if (items->items[i].kind != JV_STR)
            fail_at(r, at, KF_ERR_INVALID, "join(): sequence item: expected str instance, %s found",
                    jv_type_name(items->items[i]));
        if (i)
            jbuf_put(r->c, &b, sep->b, sep->len);
        jbuf_put(r->c, &b, items->items[i].u.s->b, items->items[i].u.s->len);
    }
    return jv_str(jstr_new(r->c, b.b ? b.b : "", b.len));
}

static jv str_method(jrender *r, const jnode *at, const jstr *s, const char *m, const jargs *a) {
    jv x, y, z;
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        jargs_check(r, at, a, 1, NULL, m);
        if (!jarg(a, 0, "", &x))
            fail_at(r, at, KF_ERR_INVALID, "%s() takes at least 1 argument", m);
        return jv_bool(affix(r, at, s, x, m[0] == 's', m));
    }
    if (!strcmp(m, "split")) {
        static const char *const names[] = {"sep", "maxsplit", NULL};
        jargs_check(r, at, a, 2, names, m);
        const bool has_sep = jarg(a, 0, "sep", &x) && x.kind != JV_NONE;
        const int64_t maxsplit = jarg(a, 1, "maxsplit", &y) ? want_int(r, at, y, m) : -1;
        return jv_list(jstr_split(r->c, s, has_sep ? want_str(r, at, x, m) : NULL, maxsplit, at), false);
    }
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
        jargs_check(r, at, a, 1, NULL, m);
        const bool has = jarg(a, 0, "", &x) && x.kind != JV_NONE;
        return jv_str(jstr_strip(r->c, s, has ? want_str(r, at, x, m) : NULL, m[0] != 'r', m[0] != 'l'));
    }
    if (!strcmp(m, "replace")) {
        jargs_check(r, at, a, 3, NULL, m);
        if (!jarg(a, 0, "", &x) || !jarg(a, 1, "", &y))
            fail_at(r, at, KF_ERR_INVALID, "%s() takes at least 2 arguments", m);
        const int64_t count = jarg(a, 2, "", &z) ? want_int(r, at, z, m) : -1;
        return jv_str(jstr_replace(r->c, s, want_str(r, at, x, m), want_str(r, at, y, m), count));
    }
    if (!strcmp(m, "upper") || !strcmp(m, "lower")) {
        jargs_check(r, at, a, 0, NULL, m);
        return jv_str(jstr_ascii_case(r->c, s, m[0] == 'u', at));
    }
    /* join */
    jargs_check(r, at, a, 1, NULL, m);
    if (!jarg(a, 0, "", &x))
        fail_at(r, at, KF_ERR_INVALID, "%s() takes exactly one argument", m);
    return str_join(r, at, s, x);
}

static jv dict_method(jrender *r, const jnode *at, const jdict *d, const char *m, const jargs *a) {
    jv x, y;
    if (!strcmp(m, "get")) {
        jargs_check(r, at, a, 2, NULL, m);
        if (!jarg(a, 0, "", &x))
            fail_at(r, at, KF_ERR_INVALID, "%s() takes at least 1 argument", m);
        if (x.kind == JV_STR && jdict_get(d, x.u.s->b, x.u.s->len, &y))
            return y;
        if (!jv_hashable(x))
            fail_at(r, at, KF_ERR_INVALID, "unhashable type: '%s'", jv_type_name(x));
        return jarg(a, 1, "", &y) ? y : jv_none();
    }
    jargs_check(r, at, a, 0, NULL, m);
    jlist *l = jlist_new(r->c, d->n);
    for (size_t i = 0; i < d->n; i++) {
        if (m[0] == 'k')
            jlist_push(r->c, l, jv_str(d->keys[i]));
        else if (m[0] == 'v')
            jlist_push(r->c, l, d->vals[i]);
        else {
            jlist *pair = jlist_new(r->c, 2);
            jlist_push(r->c, pair, jv_str(d->keys[i]));
            jlist_push(r->c, pair, d->vals[i]);
            jlist_push(r->c, l, jv_list(pair, true));
        }
    }
    jv v = jv_list(l, false);
    v.tuple = JV_VIEW;
    return v;
}

static jv call_range(jrender *r, const jnode *at, const jargs *a) {
    jargs_check(r, at, a, 3, NULL, "range");
    if (a->npos == 0)
        fail_at(r, at, KF_ERR_INVALID, "range expected at least 1 argument, got 0%s", "");
    int64_t start = 0, stop, st = 1;
    if (a->npos == 1)
        stop = want_int(r, at, a->pos[0], "range");
    else {
        start = want_int(r, at, a->pos[0], "range"), stop = want_int(r, at, a->pos[1], "range");
        if (a->npos == 3)
            st = want_int(r, at, a->pos[2], "range");
    }
    if (st == 0)
        fail_at(r, at, KF_ERR_INVALID, "range() arg 3 must not be zero%s", "");
    const double n = st > 0 ? ((double)stop - (double)start) / (double)st : ((double)start - (double)stop) / -(double)st;
    if (n > 100000)
        fail_at(r, at, KF_ERR_INVALID, "range too big: the sandbox allows at most 100000 items%s", "");
    jlist *l = jlist_new(r->c, n > 0 ? (size_t)n + 1 : 1);
    for (int64_t i = start; st > 0 ? i < stop : i > stop; i += st)
        jlist_push(r->c, l, jv_int(i));
    return jv_list(l, false);
}

/* namespace(...) and dict(...): an optional dict, then keywords. */
static jv call_mapping(jrender *r, const jnode *at, const jargs *a, int kind) {
    const char *fn = kind == JF_NAMESPACE ? "namespace" : "dict";
    if (a->npos > 1 || (a->npos == 1 && a->pos[0].kind != JV_DICT))
        fail_at(r, at, KF_ERR_UNSUPPORTED, "%s() with positional arguments other than one dict", fn);
    jdict *d = jdict_new(r->c, 4);
    if (a->npos == 1)
        for (size_t i = 0; i < a->pos[0].u.d->n; i++)
            jdict_set(r->c, d, a->pos[0].u.d->keys[i], a->pos[0].u.d->vals[i]);
    for (int k = 0; k < a->nkw; k++)
        jdict_set(r->c, d, jstr_new(r->c, a->kwn[k]->b, a->kwn[k]->len), a->kwv[k]);
    jv v = jv_dict(d);
    if (kind == JF_NAMESPACE)
        v.kind = JV_NS;
    return v;
}

jv jcall(jrender *r, jv fn, const jnode *call) {
    if (fn.kind == JV_UNDEF)
        fail_at(r, call, KF_ERR_INVALID, "calling an undefined value%s", "");
    if (fn.kind != JV_FUNC)
        fail_at(r, call, KF_ERR_INVALID, "'%s' object is not callable", jv_type_name(fn));
    jargs a;
    jeval_args(r, call, 0, &a);
    const jfunc *f = fn.u.fn;
    switch (f->kind) {
    case JF_RANGE: return call_range(r, call, &a);
    case JF_NAMESPACE: case JF_DICT: return call_mapping(r, call, &a, f->kind);
    case JF_RAISE: {
        jv msg;
        jargs_check(r, call, &a, 1, NULL, "raise_exception");
        const jstr *s = jarg(&a, 0, "", &msg) ? jv_to_str(r->c, msg, call) : jstr_new(r->c, "", 0);
        jfail(r->c, KF_ERR_INVALID, call->line, call->col, "the template raised an exception: %s", s->b);
    }
    case JF_CYCLE:
        if (a.nkw || a.npos == 0)
            fail_at(r, call, KF_ERR_INVALID, "loop.cycle() takes positional arguments, at least one%s", "");
        return a.pos[f->self.u.loop->index0 % a.npos];
    default:
        if (f->self.kind == JV_STR)
            return str_method(r, call, f->self.u.s, f->name, &a);
        return dict_method(r, call, f->self.u.d, f->name, &a);
    }
}
