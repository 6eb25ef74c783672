/* jinja_json.c — JSON in and out of a render: the context (jansson) to values, and Python's
 * json.dumps of a value, which is what the chat templates' tojson filter prints.
 */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

static jv from_json(jctx *c, const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jdict *d = jdict_new(c, json_object_size(j));
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)j, k, v) /* insertion order, as Python's json.loads */
            jdict_set(c, d, jstr_new(c, k, strlen(k)), from_json(c, v));
        return jv_dict(d);
    }
    case JSON_ARRAY: {
        jlist *l = jlist_new(c, json_array_size(j));
        for (size_t i = 0; i < json_array_size(j); i++)
            jlist_push(c, l, from_json(c, json_array_get(j, i)));
        return jv_list(l, false);
    }
    case JSON_STRING: return jv_str(jstr_new(c, json_string_value(j), json_string_length(j)));
    case JSON_INTEGER: return jv_int((int64_t)json_integer_value(j));
    case JSON_REAL: return jv_float(json_real_value(j));
    case JSON_TRUE: return jv_bool(true);
    case JSON_FALSE: return jv_bool(false);
    default: return jv_none();
    }
}

/* The context: a JSON object (duplicate keys refused: Python keeps the last, silently). */
jdict *jcontext_load(jctx *c, const char *json, size_t len) {
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!root)
        jfail(c, KF_ERR_FORMAT, 0, 0, "the context is not valid JSON (line %d, column %d: %s)", je.line, je.column,
              je.text);
    if (!json_is_object(root)) {
        json_decref(root);
        jfail(c, KF_ERR_INVALID, 0, 0, "the context must be a JSON object (its members are the template's variables)");
    }
    /* from_json can fail (memory limit) and unwind: the tree is freed first, by copying it in one go */
    jctx inner = *c;
    if (setjmp(inner.jb)) {
        json_decref(root);
        longjmp(c->jb, 1);
    }
    const jv v = from_json(&inner, root);
    json_decref(root);
    return v.u.d;
}

typedef struct {
    bool ensure_ascii;
    int indent; /* < 0: None */
    const char *item_sep, *key_sep;
    bool sort_keys;
    const jnode *at;
} jdump_opts;

static void dump_str(jctx *c, jbuf *o, const jstr *s, bool ensure_ascii) {
    jbuf_put(c, o, "\"", 1);
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        const int k = jutf8_next(s->b + i, s->len - i, &cp);
        char esc[16];
        const char *e = NULL;
        switch (cp) {
        case '"': e = "\\\""; break;
        case '\\': e = "\\\\"; break;
        case '\n': e = "\\n"; break;
        case '\r': e = "\\r"; break;
        case '\t': e = "\\t"; break;
        case '\b': e = "\\b"; break;
        case '\f': e = "\\f"; break;
        default:
            if (cp < 0x20 || (ensure_ascii && cp > 0x7E)) {
                if (cp >= 0x10000) /* a surrogate pair, as Python writes it */
                    snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF));
                else
                    snprintf(esc, sizeof esc, "\\u%04x", cp);
                e = esc;
            }
        }
        if (e)
            jbuf_puts(c, o, e);
        else
            jbuf_put(c, o, s->b + i, (size_t)k);
        i += (size_t)k;
    }
    jbuf_put(c, o, "\"", 1);
}

static void newline_indent(jctx *c, jbuf *o, const jdump_opts *opt, int level) {
    if (opt->indent < 0)
        return;
    jbuf_put(c, o, "\n", 1);
    for (int i = 0; i < opt->indent * level; i++)
        jbuf_put(c, o, " ", 1);
}

static void dump(jctx *c, jbuf *o, jv v, const jdump_opts *opt, int level);

/* Key order of a dict: insertion, or sorted (code point order) with sort_keys. */
static size_t *key_order(jctx *c, const jdict *d, bool sort) {
    size_t *ord = jalloc(c, (d->n + 1) * sizeof *ord);
    for (size_t i = 0; i < d->n; i++) {
        size_t j = i;
        for (; sort && j > 0; j--) {
            const jstr *a = d->keys[ord[j - 1]], *b = d->keys[i];
            const size_t n = a->len < b->len ? a->len : b->len;
            const int r = memcmp(a->b, b->b, n);
            if (r < 0 || (r == 0 && a->len <= b->len))
                break;
            ord[j] = ord[j - 1];
        }
        ord[j] = i;
    }
    return ord;
}

static void dump_container(jctx *c, jbuf *o, jv v, const jdump_opts *opt, int level) {
    const bool is_list = v.kind == JV_LIST;
    const size_t n = is_list ? v.u.l->n : v.u.d->n;
    jbuf_put(c, o, is_list ? "[" : "{", 1);
    if (n == 0) {
        jbuf_put(c, o, is_list ? "]" : "}", 1);
        return;
    }
    const size_t *ord = is_list ? NULL : key_order(c, v.u.d, opt->sort_keys);
    for (size_t i = 0; i < n; i++) {
        if (i)
            jbuf_puts(c, o, opt->item_sep);
        newline_indent(c, o, opt, level + 1);
        if (is_list)
            dump(c, o, v.u.l->items[i], opt, level + 1);
        else {
            dump_str(c, o, v.u.d->keys[ord[i]], opt->ensure_ascii);
            jbuf_puts(c, o, opt->key_sep);
            dump(c, o, v.u.d->vals[ord[i]], opt, level + 1);
        }
    }
    newline_indent(c, o, opt, level);
    jbuf_put(c, o, is_list ? "]" : "}", 1);
}

static void dump(jctx *c, jbuf *o, jv v, const jdump_opts *opt, int level) {
    char buf[48];
    const jnode *at = opt->at;
    if (level > 200)
        jfail(c, KF_ERR_UNSUPPORTED, at->line, at->col, "tojson: values nested more than 200 deep");
    switch (v.kind) {
    case JV_NONE: jbuf_puts(c, o, "null"); break;
    case JV_BOOL: jbuf_puts(c, o, v.u.b ? "true" : "false"); break;
    case JV_INT: snprintf(buf, sizeof buf, "%lld", (long long)v.u.i), jbuf_puts(c, o, buf); break;
    case JV_FLOAT:
        if (v.u.f != v.u.f)
            jbuf_puts(c, o, "NaN");
        else if (v.u.f - v.u.f != 0)
            jbuf_puts(c, o, v.u.f < 0 ? "-Infinity" : "Infinity");
        else
            jfmt_float(v.u.f, buf), jbuf_puts(c, o, buf);
        break;
    case JV_STR: dump_str(c, o, v.u.s, opt->ensure_ascii); break;
    case JV_LIST:
        if (v.tuple >= JV_VIEW) /* Python: "Object of type dict_keys is not JSON serializable" */
            jfail(c, KF_ERR_INVALID, at->line, at->col, "tojson: a dict view or an iterator is not JSON serializable");
        dump_container(c, o, v, opt, level);
        break;
    case JV_DICT: dump_container(c, o, v, opt, level); break;
    default:
        jfail(c, KF_ERR_INVALID, at->line, at->col, "tojson: Object of type %s is not JSON serializable", jv_type_name(v));
    }
}

void jv_tojson(jctx *c, jbuf *out, jv v, bool ensure_ascii, int indent, const char *item_sep, const char *key_sep,
               bool sort_keys, const jnode *at) {
    const jdump_opts opt = {ensure_ascii, indent, item_sep ? item_sep : indent >= 0 ? "," : ", ",
                            key_sep ? key_sep : ": ", sort_keys, at};
    dump(c, out, v, &opt, 0);
}
