/* jinja_filter.c — the filters and tests of the subset, with jinja2 3.1's definitions (and Hugging
 * Face's tojson). An unknown filter or test is refused (jinja2 refuses it when compiling).
 */
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

_Noreturn static void fail_at(jrender *r, const jnode *n, kf_status code, const char *fmt, const char *a) {
    jfail(r->c, code, n->line, n->col, fmt, a);
}

static bool is(const jnode *n, const char *name) { return strcmp(n->name->b, name) == 0; }

static bool listed(const char *name, const char *const *list) {
    for (; *list; list++)
        if (strcmp(name, *list) == 0)
            return true;
    return false;
}

bool jfilter_known(const char *name) {
    static const char *const names[] = {"tojson", "default", "d", "join", "replace", "trim", "length", "count",
                                        "string", "first", "last", "upper", "lower", "list", "reverse", "items",
                                        "abs", NULL};
    return listed(name, names);
}

bool jtest_known(const char *name) {
    static const char *const names[] = {"defined", "undefined", "none", "boolean", "true", "false", "integer",
                                        "float", "number", "string", "mapping", "iterable", "sequence", "callable",
                                        "odd", "even", "lower", "upper", "divisibleby", "eq", "equalto", "==", "ne",
                                        "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge",
                                        ">=", "in", NULL};
    return listed(name, names);
}

static int64_t length(jrender *r, const jnode *at, jv v) {
    switch (v.kind) {
    case JV_UNDEF: return 0;
    case JV_STR: return (int64_t)v.u.s->ncp;
    case JV_LIST:
        if (v.tuple == JV_ITER)
            break;
        return (int64_t)v.u.l->n;
    case JV_DICT: return (int64_t)v.u.d->n;
    default: break;
    }
    fail_at(r, at, KF_ERR_INVALID, "object of type '%s' has no len()", jv_type_name(v));
}

static jv f_tojson(jrender *r, const jnode *n, jv v, const jargs *a) {
    static const char *const names[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
    jargs_check(r, n, a, 4, names, "tojson");
    jv x;
    const bool ascii = jarg(a, 0, "ensure_ascii", &x) && jv_truthy(x);
    int indent = -1;
    if (jarg(a, 1, "indent", &x) && x.kind != JV_NONE) {
        if (x.kind != JV_INT || x.u.i < 0 || x.u.i > 64)
            fail_at(r, n, KF_ERR_UNSUPPORTED, "tojson: indent other than an int from 0 to 64%s", "");
        indent = (int)x.u.i;
    }
    const char *item_sep = NULL, *key_sep = NULL;
    if (jarg(a, 2, "separators", &x) && x.kind != JV_NONE) {
        if (x.kind != JV_LIST || x.u.l->n != 2 || x.u.l->items[0].kind != JV_STR || x.u.l->items[1].kind != JV_STR)
            fail_at(r, n, KF_ERR_INVALID, "tojson: separators must be two strings%s", "");
        item_sep = x.u.l->items[0].u.s->b, key_sep = x.u.l->items[1].u.s->b;
    }
    const bool sort = jarg(a, 3, "sort_keys", &x) && jv_truthy(x);
    jbuf b = {0};
    jv_tojson(r->c, &b, v, ascii, indent, item_sep, key_sep, sort, n);
    return jv_str(jstr_new(r->c, b.b, b.len));
}

static jv f_default(jrender *r, const jnode *n, jv v, const jargs *a) {
    static const char *const names[] = {"default_value", "boolean", NULL};
    jargs_check(r, n, a, 2, names, "default");
    jv d, boolean;
    if (!jarg(a, 0, "default_value", &d))
        d = jv_str(jstr_new(r->c, "", 0));
    const bool by_truth = jarg(a, 1, "boolean", &boolean) && jv_truthy(boolean);
    return (v.kind == JV_UNDEF || (by_truth && !jv_truthy(v))) ? d : v;
}

static jv f_first_last(jrender *r, const jnode *n, jv v, bool first) {
    if (v.kind == JV_UNDEF && first)
        return jv_undef();
    if (!(v.kind == JV_STR || (v.kind == JV_LIST && v.tuple < JV_VIEW) || (v.kind == JV_DICT && first)))
        fail_at(r, n, KF_ERR_UNSUPPORTED, "first/last of a %s", jv_type_name(v));
    const jlist *items = jiter_items(r, v, n);
    if (items->n == 0)
        return jv_undef();
    return items->items[first ? 0 : items->n - 1];
}

static jv f_join(jrender *r, const jnode *n, jv v, const jargs *a) {
    static const char *const names[] = {"d", "attribute", NULL};
    jargs_check(r, n, a, 2, names, "join");
    jv sep, attr;
    if (jarg(a, 1, "attribute", &attr))
        fail_at(r, n, KF_ERR_UNSUPPORTED, "join(attribute=...)%s", "");
    const jstr *s = jarg(a, 0, "d", &sep) ? jv_to_str(r->c, sep, n) : jstr_new(r->c, "", 0);
    if (!(v.kind == JV_UNDEF || v.kind == JV_STR || v.kind == JV_LIST || v.kind == JV_DICT))
        fail_at(r, n, KF_ERR_INVALID, "join: '%s' object is not iterable", jv_type_name(v));
    const jlist *items = jiter_items(r, v, n);
    jbuf b = {0};
    for (size_t i = 0; i < items->n; i++) {
        const jstr *x = jv_to_str(r->c, items->items[i], n);
        if (i)
            jbuf_put(r->c, &b, s->b, s->len);
        jbuf_put(r->c, &b, x->b, x->len);
    }
    return jv_str(jstr_new(r->c, b.b ? b.b : "", b.len));
}

static jv f_list(jrender *r, const jnode *n, jv v, bool reverse) {
    if (reverse && v.kind == JV_STR)
        return jv_slice(r->c, v, false, 0, false, 0, -1);
    if (!(v.kind == JV_UNDEF || v.kind == JV_STR || v.kind == JV_LIST || v.kind == JV_DICT))
        fail_at(r, n, KF_ERR_INVALID, "'%s' object is not iterable", jv_type_name(v));
    const jlist *items = jiter_items(r, v, n);
    jlist *l = jlist_new(r->c, items->n);
    for (size_t i = 0; i < items->n; i++)
        jlist_push(r->c, l, items->items[reverse ? items->n - 1 - i : i]);
    jv out = jv_list(l, false);
    if (reverse)
        out.tuple = JV_ITER; /* reversed() */
    return out;
}

static jv f_items(jrender *r, const jnode *n, jv v) {
    jlist *l = jlist_new(r->c, 4);
    if (v.kind != JV_UNDEF && v.kind != JV_DICT) /* jinja2's generator fails only once iterated */
        fail_at(r, n, KF_ERR_UNSUPPORTED, "the items filter on a %s", jv_type_name(v));
    for (size_t i = 0; v.kind == JV_DICT && i < v.u.d->n; i++) {
        jlist *pair = jlist_new(r->c, 2);
        jlist_push(r->c, pair, jv_str(v.u.d->keys[i]));
        jlist_push(r->c, pair, v.u.d->vals[i]);
        jlist_push(r->c, l, jv_list(pair, true));
    }
    jv out = jv_list(l, false);
    out.tuple = JV_ITER; /* a generator */
    return out;
}

static jv f_replace(jrender *r, const jnode *n, jv v, const jargs *a) {
    static const char *const names[] = {"old", "new", "count", NULL};
    jargs_check(r, n, a, 3, names, "replace");
    jv old, new_, count;
    if (!jarg(a, 0, "old", &old) || !jarg(a, 1, "new", &new_))
        fail_at(r, n, KF_ERR_INVALID, "replace needs old and new%s", "");
    int64_t k = -1;
    if (jarg(a, 2, "count", &count) && count.kind != JV_NONE) {
        if (count.kind != JV_INT)
            fail_at(r, n, KF_ERR_INVALID, "replace: count must be an int%s", "");
        k = count.u.i;
    }
    return jv_str(jstr_replace(r->c, jv_to_str(r->c, v, n), jv_to_str(r->c, old, n), jv_to_str(r->c, new_, n), k));
}

jv jfilter(jrender *r, const jnode *n) {
    const jv v = jeval(r, n->a);
    jargs a;
    jeval_args(r, n, 0, &a);
    jv x;
    if (is(n, "tojson"))
        return f_tojson(r, n, v, &a);
    if (is(n, "default") || is(n, "d"))
        return f_default(r, n, v, &a);
    if (is(n, "join"))
        return f_join(r, n, v, &a);
    if (is(n, "replace"))
        return f_replace(r, n, v, &a);
    if (is(n, "trim")) {
        jargs_check(r, n, &a, 1, (const char *const[]){"chars", NULL}, "trim");
        const bool has = jarg(&a, 0, "chars", &x) && x.kind != JV_NONE;
        return jv_str(jstr_strip(r->c, jv_to_str(r->c, v, n), has ? jv_to_str(r->c, x, n) : NULL, true, true));
    }
    jargs_check(r, n, &a, 0, NULL, n->name->b);
    if (is(n, "length") || is(n, "count"))
        return jv_int(length(r, n, v));
    if (is(n, "string"))
        return jv_str(jv_to_str(r->c, v, n));
    if (is(n, "first") || is(n, "last"))
        return f_first_last(r, n, v, is(n, "first"));
    if (is(n, "upper") || is(n, "lower"))
        return jv_str(jstr_ascii_case(r->c, jv_to_str(r->c, v, n), is(n, "upper"), n));
    if (is(n, "list") || is(n, "reverse"))
        return f_list(r, n, v, is(n, "reverse"));
    if (is(n, "items"))
        return f_items(r, n, v);
    if (is(n, "abs")) {
        if (v.kind == JV_FLOAT)
            return jv_float(v.u.f < 0 ? -v.u.f : v.u.f);
        if ((v.kind != JV_INT && v.kind != JV_BOOL) || (v.kind == JV_INT && v.u.i == INT64_MIN))
            fail_at(r, n, KF_ERR_INVALID, "bad operand type for abs(): '%s'", jv_type_name(v));
        const int64_t i = v.kind == JV_BOOL ? v.u.b : v.u.i;
        return jv_int(i < 0 ? -i : i);
    }
    fail_at(r, n, KF_ERR_UNSUPPORTED, "the filter '%s' is not supported", n->name->b);
}

/* ---- tests ---- */

static bool one_of(const jnode *n, const char *const *names) {
    for (; *names; names++)
        if (is(n, *names))
            return true;
    return false;
}

static bool ascii_case_test(jrender *r, const jnode *n, jv v, bool upper) {
    const jstr *s = jv_to_str(r->c, v, n);
    if (s->ncp != s->len)
        fail_at(r, n, KF_ERR_UNSUPPORTED, "the %s test on non-ASCII text", n->name->b);
    bool cased = false;
    for (size_t i = 0; i < s->len; i++) {
        const char ch = s->b[i];
        if ((upper && ch >= 'a' && ch <= 'z') || (!upper && ch >= 'A' && ch <= 'Z'))
            return false;
        cased |= (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
    }
    return cased;
}

static bool test_with_arg(jrender *r, const jnode *n, jv v, jv arg) {
    static const char *const names[][4] = {{"eq", "equalto", "==", NULL}, {"ne", "!=", NULL}, {"lt", "lessthan", "<", NULL},
                                           {"le", "<=", NULL}, {"gt", "greaterthan", ">", NULL}, {"ge", ">=", NULL},
                                           {"in", NULL}};
    static const int ops[] = {JOP_EQ, JOP_NE, JOP_LT, JOP_LE, JOP_GT, JOP_GE, JOP_IN};
    for (int i = 0; i < 7; i++)
        if (one_of(n, names[i]))
            return jcompare_op(r, n, ops[i], v, arg);
    if (is(n, "divisibleby")) {
        if ((v.kind != JV_INT && v.kind != JV_BOOL) || (arg.kind != JV_INT && arg.kind != JV_BOOL))
            fail_at(r, n, KF_ERR_UNSUPPORTED, "divisibleby on other than integers%s", "");
        const int64_t x = v.kind == JV_BOOL ? v.u.b : v.u.i, y = arg.kind == JV_BOOL ? arg.u.b : arg.u.i;
        if (y == 0)
            fail_at(r, n, KF_ERR_INVALID, "integer division or modulo by zero%s", "");
        return y == -1 || x % y == 0;
    }
    fail_at(r, n, KF_ERR_UNSUPPORTED, "the test '%s' is not supported (or takes no argument)", n->name->b);
}

bool jtest(jrender *r, const jnode *n) {
    const jv v = jeval(r, n->a);
    jargs a;
    jeval_args(r, n, 0, &a);
    if (a.nkw || a.npos > 1)
        fail_at(r, n, KF_ERR_UNSUPPORTED, "the test '%s' with keywords or several arguments", n->name->b);
    if (a.npos == 1)
        return test_with_arg(r, n, v, a.pos[0]);
    const int k = v.kind;
    if (is(n, "defined")) return k != JV_UNDEF;
    if (is(n, "undefined")) return k == JV_UNDEF;
    if (is(n, "none")) return k == JV_NONE;
    if (is(n, "boolean")) return k == JV_BOOL;
    if (is(n, "true")) return k == JV_BOOL && v.u.b;
    if (is(n, "false")) return k == JV_BOOL && !v.u.b;
    if (is(n, "integer")) return k == JV_INT;
    if (is(n, "float")) return k == JV_FLOAT;
    if (is(n, "number")) return k == JV_INT || k == JV_FLOAT || k == JV_BOOL;
    if (is(n, "string")) return k == JV_STR;
    if (is(n, "mapping")) return k == JV_DICT;
    if (is(n, "iterable")) return k == JV_UNDEF || k == JV_STR || k == JV_LIST || k == JV_DICT || k == JV_LOOP;
    if (is(n, "sequence")) return k == JV_UNDEF || k == JV_STR || (k == JV_LIST && v.tuple < JV_VIEW) || k == JV_DICT;
    if (is(n, "callable")) return k == JV_FUNC || k == JV_LOOP || k == JV_UNDEF; /* Undefined has __call__ */
    if (is(n, "odd") || is(n, "even")) {
        if (k != JV_INT && k != JV_BOOL)
            fail_at(r, n, KF_ERR_UNSUPPORTED, "odd/even of a %s", jv_type_name(v));
        const int64_t i = k == JV_BOOL ? v.u.b : v.u.i;
        return (i % 2 != 0) == is(n, "odd");
    }
    if (is(n, "lower") || is(n, "upper"))
        return ascii_case_test(r, n, v, is(n, "upper"));
    fail_at(r, n, KF_ERR_UNSUPPORTED, "the test '%s' is not supported", n->name->b);
}
