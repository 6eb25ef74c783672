/* jinja_builtin.c — what a name, an attribute, an item or a call finds: jinja2's sandboxed getattr
 * and getitem (an attribute falls back to an item and back; a miss is Undefined), the methods of
 * str and dict that chat templates call, the loop object and the globals. Python methods outside
 * the subset are refused by name, never treated as missing.
 */
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

_Noreturn static void fail_at(jrender *r, const jnode *n, kf_status code, const char *fmt, const char *a) {
    jfail(r->c, code, n->line, n->col, fmt, a);
}

static bool name_in(const char *name, size_t len, const char *const *list) {
    for (; *list; list++)
        if (strlen(*list) == len && memcmp(*list, name, len) == 0)
            return true;
    return false;
}

static const char *const str_methods[] = {"startswith", "endswith", "split", "strip", "lstrip", "rstrip", "replace",
                                          "upper", "lower", "join", NULL};
static const char *const py_str_methods[] = {
    "capitalize", "casefold", "center", "count", "encode", "expandtabs", "find", "format", "format_map", "index",
    "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable",
    "isspace", "istitle", "isupper", "ljust", "maketrans", "partition", "removeprefix", "removesuffix", "rfind",
    "rindex", "rjust", "rpartition", "rsplit", "splitlines", "swapcase", "title", "translate", "zfill", NULL};
static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};
static const char *const py_dict_methods[] = {"clear", "copy", "fromkeys", "pop", "popitem", "setdefault", "update", NULL};
static const char *const py_list_methods[] = {"append", "clear", "copy", "count", "extend", "index", "insert", "pop",
                                              "remove", "reverse", "sort", NULL};
static const char *const py_num_attrs[] = {"real", "imag", "numerator", "denominator", "conjugate", "bit_length",
                                           "bit_count", "to_bytes", "from_bytes", "as_integer_ratio", "is_integer",
                                           "hex", "fromhex", NULL};

static jv method(jrender *r, jv self, const char *name, size_t len) {
    jfunc *f = jalloc(r->c, sizeof *f);
    f->kind = JF_METHOD, f->self = self;
    f->name = jstr_new(r->c, name, len)->b;
    jv v = {.kind = JV_FUNC};
    v.u.fn = f;
    return v;
}

static jv loop_attr(jrender *r, const jloop *L, jv self, const char *name, size_t len, const jnode *at) {
    const char *const ints[] = {"index", "index0", "revindex", "revindex0", "length", "depth", "depth0", NULL};
    const int64_t vals[] = {L->index0 + 1, L->index0, L->length - L->index0, L->length - L->index0 - 1, L->length,
                            L->depth, L->depth - 1};
    for (int i = 0; ints[i]; i++)
        if (strlen(ints[i]) == len && memcmp(ints[i], name, len) == 0)
            return jv_int(vals[i]);
    if (len == 5 && memcmp(name, "first", 5) == 0)
        return jv_bool(L->index0 == 0);
    if (len == 4 && memcmp(name, "last", 4) == 0)
        return jv_bool(L->index0 == L->length - 1);
    if (len == 8 && memcmp(name, "previtem", 8) == 0)
        return L->prev;
    if (len == 8 && memcmp(name, "nextitem", 8) == 0)
        return L->next;
    if (len == 5 && memcmp(name, "cycle", 5) == 0) {
        jv m = method(r, self, name, len);
        m.u.fn->kind = JF_CYCLE;
        return m;
    }
    if (len == 7 && memcmp(name, "changed", 7) == 0)
        fail_at(r, at, KF_ERR_UNSUPPORTED, "loop.changed is not supported%s", "");
    return jv_undef();
}

jv jattr(jrender *r, jv obj, const char *name, size_t len, const jnode *at) {
    jv v;
    if (obj.kind == JV_UNDEF)
        fail_at(r, at, KF_ERR_INVALID, "an undefined value has no attribute '%s'", name);
    if (len > 0 && name[0] == '_')
        fail_at(r, at, KF_ERR_UNSUPPORTED, "the attribute '%s' (private attributes are not supported)", name);
    switch (obj.kind) {
    case JV_DICT:
        if (name_in(name, len, dict_methods))
            return method(r, obj, name, len);
        if (name_in(name, len, py_dict_methods))
            fail_at(r, at, KF_ERR_UNSUPPORTED, "the dict method '%s' is not supported", name);
        return jdict_get(obj.u.d, name, len, &v) ? v : jv_undef();
    case JV_NS: return jdict_get(obj.u.d, name, len, &v) ? v : jv_undef();
    case JV_STR:
        if (name_in(name, len, str_methods))
            return method(r, obj, name, len);
        if (name_in(name, len, py_str_methods))
            fail_at(r, at, KF_ERR_UNSUPPORTED, "the str method '%s' is not supported", name);
        return jv_undef();
    case JV_LIST:
        if (name_in(name, len, py_list_methods))
            fail_at(r, at, KF_ERR_UNSUPPORTED, "the list method '%s' is not supported", name);
        if (obj.tuple >= JV_VIEW)
            fail_at(r, at, KF_ERR_UNSUPPORTED, "attributes of a dict view or an iterator ('%s')", name);
        return jv_undef();
    case JV_LOOP: return loop_attr(r, obj.u.loop, obj, name, len, at);
    case JV_FUNC: fail_at(r, at, KF_ERR_UNSUPPORTED, "attributes of a function ('%s')", name);
    default:
        if (name_in(name, len, py_num_attrs))
            fail_at(r, at, KF_ERR_UNSUPPORTED, "the number attribute '%s' is not supported", name);
        return jv_undef();
    }
}

jv jitem(jrender *r, jv obj, jv key, const jnode *at) {
    jv v;
    if (obj.kind == JV_UNDEF)
        fail_at(r, at, KF_ERR_INVALID, "an undefined value has no items%s", "");
    if (obj.kind == JV_FUNC)
        fail_at(r, at, KF_ERR_UNSUPPORTED, "subscripting a function%s", "");
    const bool int_key = key.kind == JV_INT || key.kind == JV_BOOL;
    const int64_t k = key.kind == JV_BOOL ? key.u.b : key.u.i;
    if (obj.kind == JV_DICT && key.kind == JV_STR && jdict_get(obj.u.d, key.u.s->b, key.u.s->len, &v))
        return v;
    if ((obj.kind == JV_STR || (obj.kind == JV_LIST && obj.tuple < JV_VIEW)) && int_key) {
        const int64_t n = obj.kind == JV_STR ? (int64_t)obj.u.s->ncp : (int64_t)obj.u.l->n;
        const int64_t i = k < 0 ? k + n : k;
        if (i < 0 || i >= n)
            return jv_undef(); /* IndexError: jinja2 gives Undefined */
        if (obj.kind == JV_LIST)
            return obj.u.l->items[i];
        return jv_slice(r->c, obj, true, i, true, i + 1, 1);
    }
    if (key.kind == JV_STR) /* obj[key] failed: jinja2 tries getattr(obj, key) */
        return jattr(r, obj, key.u.s->b, key.u.s->len, at);
    return jv_undef();
}

jv jglobal(jrender *r, const char *name, const jnode *at, bool *found) {
    static const char *const names[] = {"range", "namespace", "dict", "raise_exception", NULL};
    static const int kinds[] = {JF_RANGE, JF_NAMESPACE, JF_DICT, JF_RAISE};
    static const char *const refused[] = {"lipsum", "cycler", "joiner", "strftime_now", NULL};
    *found = false;
    for (int i = 0; names[i]; i++)
        if (strcmp(name, names[i]) == 0) {
            jfunc *f = jalloc(r->c, sizeof *f);
            f->kind = kinds[i], f->name = names[i];
            jv v = {.kind = JV_FUNC};
            v.u.fn = f;
            *found = true;
            return v;
        }
    if (name_in(name, strlen(name), refused))
        fail_at(r, at, KF_ERR_UNSUPPORTED, "the global '%s' is not supported", name);
    return jv_undef();
}

void jeval_args(jrender *r, const jnode *call, int first, jargs *a) {
    memset(a, 0, sizeof *a);
    for (int i = first; i < call->nargs; i++) {
        if (call->kw[i]) {
            if (a->nkw == 8)
                fail_at(r, call, KF_ERR_UNSUPPORTED, "more than 8 keyword arguments%s", "");
            a->kwn[a->nkw] = call->kw[i];
            a->kwv[a->nkw++] = jeval(r, call->args[i]);
        } else {
            if (a->npos == 8)
                fail_at(r, call, KF_ERR_UNSUPPORTED, "more than 8 arguments%s", "");
            a->pos[a->npos++] = jeval(r, call->args[i]);
        }
    }
}

/* Argument i or keyword name: true when given. */
bool jarg(const jargs *a, int i, const char *name, jv *out) {
    if (i < a->npos) {
        *out = a->pos[i];
        return true;
    }
    for (int k = 0; k < a->nkw; k++)
        if (strcmp(a->kwn[k]->b, name) == 0) {
            *out = a->kwv[k];
            return true;
        }
    return false;
}

/* Refuses more positional arguments than max, or keywords outside names. */
void jargs_check(jrender *r, const jnode *at, const jargs *a, int max, const char *const *names, const char *fn) {
    if (a->npos > max)
        fail_at(r, at, KF_ERR_INVALID, "%s() got too many positional arguments", fn);
    for (int k = 0; k < a->nkw; k++) {
        bool ok = false;
        for (int i = 0; names && names[i]; i++)
            ok |= strcmp(a->kwn[k]->b, names[i]) == 0;
        for (int i = 0; i < a->npos && names && names[i]; i++)
            if (strcmp(a->kwn[k]->b, names[i]) == 0)
                fail_at(r, at, KF_ERR_INVALID, "%s() got multiple values for an argument", fn);
        if (!ok)
            fail_at(r, at, KF_ERR_INVALID, "%s() got an unexpected keyword argument", fn);
    }
}
