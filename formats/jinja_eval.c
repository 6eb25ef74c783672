/* jinja_eval.c — rendering the tree: statements, scopes, and expressions with Python's semantics
 * (jinja2 compiles to Python; every operator here does what CPython's does, or refuses).
 *
 * Scopes follow jinja2: each iteration of a for has a fresh scope over the enclosing one (a set
 * inside a loop is gone after the iteration; namespace() carries values out), if has none.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

struct jscope {
    jscope *parent;
    jdict *vars; /* NULL until the first set */
};

_Noreturn static void fail_node(jrender *r, const jnode *n, kf_status code, const char *fmt, const char *a,
                                const char *b) {
    jfail(r->c, code, n->line, n->col, fmt, a, b);
}

static void step(jrender *r, const jnode *n) {
    if (++r->steps > r->max_steps)
        jfail(r->c, KF_ERR_NOSPACE, n->line, n->col, "the template ran more than %lld steps", (long long)r->max_steps);
}

static jv lookup(jrender *r, const jnode *n) {
    jv v;
    for (jscope *s = r->scope; s; s = s->parent)
        if (s->vars && jdict_get(s->vars, n->name->b, n->name->len, &v))
            return v;
    if (jdict_get(r->vars, n->name->b, n->name->len, &v))
        return v;
    bool found;
    v = jglobal(r, n->name->b, n, &found);
    return found ? v : jv_undef();
}

static void assign(jrender *r, jstr *name, jv v) {
    if (!r->scope->vars)
        r->scope->vars = jdict_new(r->c, 4);
    jdict_set(r->c, r->scope->vars, name, v);
}

/* ---- arithmetic ---- */

static bool is_num(jv v) { return v.kind == JV_BOOL || v.kind == JV_INT || v.kind == JV_FLOAT; }
static bool is_intlike(jv v) { return v.kind == JV_BOOL || v.kind == JV_INT; }
static int64_t as_int(jv v) { return v.kind == JV_BOOL ? v.u.b : v.u.i; }
static double as_float(jv v) { return v.kind == JV_FLOAT ? v.u.f : (double)as_int(v); }

_Noreturn static void type_error(jrender *r, const jnode *n, const char *op, jv a, jv b) {
    char msg[160];
    snprintf(msg, sizeof msg, "unsupported operand type(s) for %s: '%s' and '%s'", op, jv_type_name(a), jv_type_name(b));
    fail_node(r, n, KF_ERR_INVALID, "%s%s", msg, "");
}

_Noreturn static void overflow(jrender *r, const jnode *n) {
    fail_node(r, n, KF_ERR_UNSUPPORTED, "an integer beyond 64 bits%s%s", "", "");
}

static jv repeat(jrender *r, const jnode *n, jv seq, int64_t times) {
    if (times <= 0)
        return seq.kind == JV_STR ? jv_str(jstr_new(r->c, "", 0)) : jv_list(jlist_new(r->c, 1), seq.tuple);
    const size_t unit = seq.kind == JV_STR ? seq.u.s->len : seq.u.l->n * sizeof(jv);
    if (unit && (uint64_t)times > (r->c->arena->limit ? r->c->arena->limit : SIZE_MAX) / unit)
        fail_node(r, n, KF_ERR_NOSPACE, "a repetition beyond the memory limit%s%s", "", "");
    if (seq.kind == JV_STR) {
        jbuf b = {0};
        for (int64_t i = 0; i < times; i++)
            jbuf_put(r->c, &b, seq.u.s->b, seq.u.s->len);
        return jv_str(jstr_new(r->c, b.b ? b.b : "", b.len));
    }
    jlist *l = jlist_new(r->c, seq.u.l->n * (size_t)times);
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < seq.u.l->n; k++)
            jlist_push(r->c, l, seq.u.l->items[k]);
    return jv_list(l, seq.tuple);
}

/* Python's // and % on ints (floor division) and floats (CPython's float_floor_div / float_rem). */
static jv floor_divmod(jrender *r, const jnode *n, jv a, jv b, bool want_mod) {
    if (is_intlike(a) && is_intlike(b)) {
        const int64_t x = as_int(a), y = as_int(b);
        if (y == 0)
            fail_node(r, n, KF_ERR_INVALID, "integer division or modulo by zero%s%s", "", "");
        if (x == INT64_MIN && y == -1)
            overflow(r, n);
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0)))
            q--, m += y;
        return jv_int(want_mod ? m : q);
    }
    const double x = as_float(a), y = as_float(b);
    if (y == 0)
        fail_node(r, n, KF_ERR_INVALID, "float division or modulo by zero%s%s", "", "");
    double mod = fmod(x, y), div = (x - mod) / y;
    if (mod != 0) {
        if ((y < 0) != (mod < 0))
            mod += y, div -= 1.0;
    } else
        mod = copysign(0.0, y);
    double fd;
    if (div != 0) {
        fd = floor(div);
        if (div - fd > 0.5)
            fd += 1.0;
    } else
        fd = copysign(0.0, x / y);
    return jv_float(want_mod ? mod : fd);
}

static jv power(jrender *r, const jnode *n, jv a, jv b) {
    if (is_intlike(a) && is_intlike(b) && as_int(b) >= 0) {
        int64_t base = as_int(a), e = as_int(b), acc = 1;
        while (e > 0) {
            if ((e & 1) && __builtin_mul_overflow(acc, base, &acc))
                overflow(r, n);
            e >>= 1;
            if (e > 0 && __builtin_mul_overflow(base, base, &base))
                overflow(r, n);
        }
        return jv_int(acc);
    }
    const double x = as_float(a), y = as_float(b);
    if (x == 0 && y < 0)
        fail_node(r, n, KF_ERR_INVALID, "0.0 cannot be raised to a negative power%s%s", "", "");
    if (x < 0 && y != floor(y))
        fail_node(r, n, KF_ERR_UNSUPPORTED, "a negative number to a fractional power (complex)%s%s", "", "");
    const double p = pow(x, y);
    if (isinf(p) && !isinf(x) && !isinf(y))
        fail_node(r, n, KF_ERR_INVALID, "float power overflow%s%s", "", "");
    return jv_float(p);
}

static jv arith_num(jrender *r, const jnode *n, jv a, jv b) {
    if (is_intlike(a) && is_intlike(b) && n->op != JOP_DIV) {
        const int64_t x = as_int(a), y = as_int(b);
        int64_t z;
        const bool of = n->op == JOP_ADD ? __builtin_add_overflow(x, y, &z)
                      : n->op == JOP_SUB ? __builtin_sub_overflow(x, y, &z) : __builtin_mul_overflow(x, y, &z);
        if (of)
            overflow(r, n);
        return jv_int(z);
    }
    const int64_t big = (int64_t)1 << 53; /* beyond it Python's int/int and int->float conversions differ */
    if ((is_intlike(a) && (as_int(a) > big || as_int(a) < -big)) || (is_intlike(b) && (as_int(b) > big || as_int(b) < -big)))
        fail_node(r, n, KF_ERR_UNSUPPORTED, "float arithmetic on an integer beyond 2**53%s%s", "", "");
    const double x = as_float(a), y = as_float(b);
    if (n->op == JOP_DIV && y == 0)
        fail_node(r, n, KF_ERR_INVALID, "division by zero%s%s", "", "");
    const double z = n->op == JOP_ADD ? x + y : n->op == JOP_SUB ? x - y : n->op == JOP_MUL ? x * y : x / y;
    return jv_float(z);
}

static jv arith(jrender *r, const jnode *n, jv a, jv b) {
    static const char *const sym[] = {"+", "-", "*", "/", "//", "%", "**"};
    if (n->op == JOP_MOD && a.kind == JV_STR) /* before Undefined: str % x formats, whatever x is */
        fail_node(r, n, KF_ERR_UNSUPPORTED, "%% string formatting%s%s", "", "");
    if (a.kind == JV_UNDEF || b.kind == JV_UNDEF)
        fail_node(r, n, KF_ERR_INVALID, "an undefined value in '%s'%s", sym[n->op], "");
    if (is_num(a) && is_num(b)) {
        if (n->op == JOP_FLOORDIV || n->op == JOP_MOD)
            return floor_divmod(r, n, a, b, n->op == JOP_MOD);
        if (n->op == JOP_POW)
            return power(r, n, a, b);
        return arith_num(r, n, a, b);
    }
    if (n->op == JOP_ADD && a.kind == JV_STR && b.kind == JV_STR)
        return jv_str(jstr_cat(r->c, a.u.s, b.u.s));
    if (n->op == JOP_ADD && a.kind == JV_LIST && b.kind == JV_LIST && a.tuple == b.tuple && a.tuple < JV_VIEW) {
        jlist *l = jlist_new(r->c, a.u.l->n + b.u.l->n);
        for (size_t i = 0; i < a.u.l->n; i++)
            jlist_push(r->c, l, a.u.l->items[i]);
        for (size_t i = 0; i < b.u.l->n; i++)
            jlist_push(r->c, l, b.u.l->items[i]);
        return jv_list(l, a.tuple);
    }
    if (n->op == JOP_MUL && ((a.kind == JV_STR || (a.kind == JV_LIST && a.tuple < JV_VIEW)) && is_intlike(b)))
        return repeat(r, n, a, as_int(b));
    if (n->op == JOP_MUL && ((b.kind == JV_STR || (b.kind == JV_LIST && b.tuple < JV_VIEW)) && is_intlike(a)))
        return repeat(r, n, b, as_int(a));
    type_error(r, n, sym[n->op], a, b);
}

/* ---- comparisons ---- */

static bool contains(jrender *r, const jnode *n, jv item, jv seq) {
    switch (seq.kind) {
    case JV_UNDEF: return false;
    case JV_STR:
        if (item.kind != JV_STR)
            fail_node(r, n, KF_ERR_INVALID, "'in <string>' requires string as left operand, not %s%s", jv_type_name(item), "");
        return jstr_find(seq.u.s, item.u.s);
    case JV_LIST:
        if (seq.tuple == JV_ITER)
            fail_node(r, n, KF_ERR_UNSUPPORTED, "'in' on an iterator (it consumes it)%s%s", "", "");
        for (size_t i = 0; i < seq.u.l->n; i++)
            if (jv_equal(r->c, n, seq.u.l->items[i], item))
                return true;
        return false;
    case JV_DICT:
        if (!jv_hashable(item))
            fail_node(r, n, KF_ERR_INVALID, "unhashable type: '%s'%s", jv_type_name(item), "");
        if (item.kind != JV_STR)
            return false;
        jv v;
        return jdict_get(seq.u.d, item.u.s->b, item.u.s->len, &v);
    default: break;
    }
    fail_node(r, n, KF_ERR_INVALID, "argument of type '%s' is not iterable%s", jv_type_name(seq), "");
}

bool jcompare_op(jrender *r, const jnode *n, int op, jv a, jv b) {
    if (op == JOP_EQ || op == JOP_NE)
        return jv_equal(r->c, n, a, b) == (op == JOP_EQ);
    if (op == JOP_IN || op == JOP_NOTIN)
        return contains(r, n, a, b) == (op == JOP_IN);
    if (a.kind == JV_UNDEF || b.kind == JV_UNDEF)
        fail_node(r, n, KF_ERR_INVALID, "an undefined value in a comparison%s%s", "", "");
    bool ok;
    const int c = jv_compare(r->c, n, a, b, &ok);
    if (!ok) {
        char msg[160];
        snprintf(msg, sizeof msg, "ordering not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
        fail_node(r, n, KF_ERR_INVALID, "%s%s", msg, "");
    }
    return op == JOP_LT ? c < 0 : op == JOP_LE ? c <= 0 : op == JOP_GT ? c > 0 : c >= 0;
}

static jv eval_cmp(jrender *r, const jnode *n) {
    jv left = jeval(r, n->a);
    for (int i = 0; i < n->nargs; i++) { /* a < b < c is a < b and b < c */
        const jv right = jeval(r, n->args[i]);
        if (!jcompare_op(r, n, n->ops[i], left, right))
            return jv_bool(false);
        left = right;
    }
    return jv_bool(true);
}

/* ---- expressions ---- */

static void slice_bound(jrender *r, const jnode *e, bool *has, int64_t *v, bool *bad) {
    *has = false;
    if (!e)
        return;
    const jv x = jeval(r, e);
    if (x.kind == JV_NONE)
        return;
    if (!is_intlike(x))
        *bad = true; /* TypeError: slice indices must be integers or None */
    else
        *has = true, *v = as_int(x);
}

/* jinja2 compiles x[a:b:c] to Python's own subscript (a TypeError where that fails), except where
 * its optimizer can fold the expression to a constant: it does so with getitem, which turns the
 * TypeError into Undefined. Which one happens is not worth reproducing: a slice Python cannot take
 * is refused. */
static jv eval_slice(jrender *r, const jnode *n) {
    const jv obj = jeval(r, n->a);
    if (obj.kind == JV_UNDEF)
        fail_node(r, n, KF_ERR_INVALID, "slicing an undefined value%s%s", "", "");
    bool hs, he, hst, bad = false;
    int64_t s = 0, e = 0, st = 1;
    slice_bound(r, n->b, &hs, &s, &bad);
    slice_bound(r, n->c, &he, &e, &bad);
    slice_bound(r, n->d, &hst, &st, &bad);
    if (bad || !(obj.kind == JV_STR || (obj.kind == JV_LIST && obj.tuple < JV_VIEW)))
        fail_node(r, n, KF_ERR_UNSUPPORTED, bad ? "a slice with indices other than integers or None%s%s"
                                                : "slicing a %s (an error or Undefined in jinja2, as it folds constants)",
                  bad ? "" : jv_type_name(obj), "");
    if (!hst)
        st = 1;
    if (st == 0)
        fail_node(r, n, KF_ERR_INVALID, "slice step cannot be zero%s%s", "", "");
    if (st == INT64_MIN)
        overflow(r, n);
    return jv_slice(r->c, obj, hs, s, he, e, st);
}

static jv eval_seq(jrender *r, const jnode *n) {
    if (n->kind == JN_DICT) {
        jdict *d = jdict_new(r->c, (size_t)n->nargs / 2 + 1);
        for (int i = 0; i + 1 < n->nargs; i += 2) {
            const jv k = jeval(r, n->args[i]);
            if (k.kind != JV_STR)
                fail_node(r, n->args[i], KF_ERR_UNSUPPORTED, "dict keys other than strings (%s)%s", jv_type_name(k), "");
            jdict_set(r->c, d, k.u.s, jeval(r, n->args[i + 1]));
        }
        return jv_dict(d);
    }
    jlist *l = jlist_new(r->c, (size_t)n->nargs);
    for (int i = 0; i < n->nargs; i++)
        jlist_push(r->c, l, jeval(r, n->args[i]));
    return jv_list(l, n->kind == JN_TUPLE);
}

static jv eval_unary(jrender *r, const jnode *n) {
    const jv a = jeval(r, n->a);
    if (n->kind == JN_NOT)
        return jv_bool(!jv_truthy(a));
    if (!is_num(a))
        fail_node(r, n, KF_ERR_INVALID, "bad operand type for unary %s: '%s'", n->kind == JN_NEG ? "-" : "+", jv_type_name(a));
    if (n->kind == JN_POS)
        return a.kind == JV_BOOL ? jv_int(a.u.b) : a;
    if (a.kind == JV_FLOAT)
        return jv_float(-a.u.f);
    if (as_int(a) == INT64_MIN)
        overflow(r, n);
    return jv_int(-as_int(a));
}

jv jeval(jrender *r, const jnode *n) {
    step(r, n);
    switch (n->kind) {
    case JN_LIT: return n->lit;
    case JN_NAME: return lookup(r, n);
    case JN_LIST: case JN_TUPLE: case JN_DICT: return eval_seq(r, n);
    case JN_ATTR: return jattr(r, jeval(r, n->a), n->name->b, n->name->len, n);
    case JN_ITEM: {
        const jv obj = jeval(r, n->a);
        return jitem(r, obj, jeval(r, n->b), n);
    }
    case JN_SLICE: return eval_slice(r, n);
    case JN_CALL: return jcall(r, jeval(r, n->a), n);
    case JN_FILTER: return jfilter(r, n);
    case JN_TEST: return jv_bool(jtest(r, n) != (n->op != 0));
    case JN_BIN: {
        const jv a = jeval(r, n->a), b = jeval(r, n->b);
        if (n->op == JOP_CONCAT)
            return jv_str(jstr_cat(r->c, jv_to_str(r->c, a, n), jv_to_str(r->c, b, n)));
        return arith(r, n, a, b);
    }
    case JN_NEG: case JN_POS: case JN_NOT: return eval_unary(r, n);
    case JN_AND: {
        const jv a = jeval(r, n->a);
        return jv_truthy(a) ? jeval(r, n->b) : a;
    }
    case JN_OR: {
        const jv a = jeval(r, n->a);
        return jv_truthy(a) ? a : jeval(r, n->b);
    }
    case JN_COND:
        if (jv_truthy(jeval(r, n->b)))
            return jeval(r, n->a);
        return n->c ? jeval(r, n->c) : jv_undef();
    case JN_CMP: return eval_cmp(r, n);
    default: fail_node(r, n, KF_ERR_INVALID, "internal: not an expression%s%s", "", "");
    }
}

/* ---- statements ---- */

enum { FLOW_NEXT, FLOW_BREAK, FLOW_CONTINUE };
static int exec_body(jrender *r, const jnode *s);

static void output(jrender *r, const jnode *n, const jstr *s) {
    if (r->out.len + s->len > r->max_output)
        jfail(r->c, KF_ERR_NOSPACE, n->line, n->col, "the output exceeds %zu bytes", r->max_output);
    jbuf_put(r->c, &r->out, s->b, s->len);
}

/* The items a for iterates (a str's characters, a dict's keys). */
jlist *jiter_items(jrender *r, jv seq, const jnode *n) {
    jlist *l;
    switch (seq.kind) {
    case JV_UNDEF: return jlist_new(r->c, 1);
    case JV_LIST:
        if (seq.tuple == JV_ITER) { /* an iterator yields its items once */
            if (seq.u.l->consumed)
                return jlist_new(r->c, 1);
            seq.u.l->consumed = true;
        }
        return seq.u.l;
    case JV_DICT:
        l = jlist_new(r->c, seq.u.d->n);
        for (size_t i = 0; i < seq.u.d->n; i++)
            jlist_push(r->c, l, jv_str(seq.u.d->keys[i]));
        return l;
    case JV_STR:
        l = jlist_new(r->c, seq.u.s->ncp);
        for (size_t i = 0; i < seq.u.s->len;) {
            uint32_t cp;
            const int k = jutf8_next(seq.u.s->b + i, seq.u.s->len - i, &cp);
            jlist_push(r->c, l, jv_str(jstr_new(r->c, seq.u.s->b + i, (size_t)k)));
            i += (size_t)k;
        }
        return l;
    default:
        fail_node(r, n, KF_ERR_INVALID, "'%s' object is not iterable%s", jv_type_name(seq), "");
    }
}

/* Binds targets (names in n->args) to v, unpacking when there are several. */
static void bind(jrender *r, const jnode *n, jv v) {
    if (n->nargs == 1) {
        assign(r, n->args[0]->name, v);
        return;
    }
    if (v.kind != JV_LIST && v.kind != JV_STR)
        fail_node(r, n, KF_ERR_INVALID, "cannot unpack non-iterable %s object%s", jv_type_name(v), "");
    const jlist *items = jiter_items(r, v, n);
    if (items->n != (size_t)n->nargs)
        fail_node(r, n, KF_ERR_INVALID, "wrong number of values to unpack%s%s", "", "");
    for (int i = 0; i < n->nargs; i++)
        assign(r, n->args[i]->name, items->items[i]);
}

static jlist *for_items(jrender *r, const jnode *n) {
    jlist *all = jiter_items(r, jeval(r, n->a), n->a);
    if (!n->d)
        return all;
    jlist *kept = jlist_new(r->c, all->n);
    jscope *outer = r->scope;
    for (size_t i = 0; i < all->n; i++) {
        jscope s = {.parent = outer};
        r->scope = &s;
        bind(r, n, all->items[i]);
        if (jv_truthy(jeval(r, n->d)))
            jlist_push(r->c, kept, all->items[i]);
        r->scope = outer;
    }
    return kept;
}

/* The else of a for runs when no iteration ran its body to the end: jinja2 clears its flag after
 * the body, so a loop left by break or continue on every iteration (or none) runs it too. */
static int exec_for(jrender *r, const jnode *n) {
    const jlist *items = for_items(r, n);
    jscope *outer = r->scope;
    bool completed = false;
    r->loop_depth++;
    for (size_t i = 0; i < items->n; i++) {
        jscope s = {.parent = outer};
        r->scope = &s;
        jloop *L = jalloc(r->c, sizeof *L);
        L->index0 = (int64_t)i, L->length = (int64_t)items->n, L->depth = 1; /* depth counts recursive loops only */
        L->prev = i > 0 ? items->items[i - 1] : jv_undef();
        L->next = i + 1 < items->n ? items->items[i + 1] : jv_undef();
        jv lv = {.kind = JV_LOOP};
        lv.u.loop = L;
        assign(r, jstr_new(r->c, "loop", 4), lv);
        bind(r, n, items->items[i]);
        const int flow = exec_body(r, n->b);
        r->scope = outer;
        completed |= flow == FLOW_NEXT;
        if (flow == FLOW_BREAK)
            break;
    }
    r->loop_depth--;
    int flow = FLOW_NEXT;
    if (!completed && n->c) { /* after the loop: a break or continue there is the enclosing loop's */
        jscope s = {.parent = outer};
        r->scope = &s;
        flow = exec_body(r, n->c);
        r->scope = outer;
    }
    return flow;
}

static void exec_set(jrender *r, const jnode *n) {
    if (n->kind == JN_NSATTR) {
        const jv ns = lookup(r, n->a);
        if (ns.kind != JV_NS)
            fail_node(r, n, KF_ERR_INVALID, "cannot assign attribute on non-namespace object%s%s", "", "");
        jdict_set(r->c, ns.u.d, n->name, jeval(r, n->b));
        return;
    }
    if (n->kind == JN_SETBLOCK) {
        const jbuf saved = r->out;
        r->out = (jbuf){0};
        exec_body(r, n->b);
        const jv v = jv_str(jstr_new(r->c, r->out.b ? r->out.b : "", r->out.len));
        r->out = saved;
        assign(r, n->args[0]->name, v);
        return;
    }
    bind(r, n, jeval(r, n->b));
}

static int exec_body(jrender *r, const jnode *s) {
    for (; s; s = s->next) {
        step(r, s);
        switch (s->kind) {
        case JN_TEXT: output(r, s, s->lit.u.s); break;
        case JN_PRINT: output(r, s, jv_to_str(r->c, jeval(r, s->a), s)); break;
        case JN_IF: {
            const int flow = exec_body(r, jv_truthy(jeval(r, s->a)) ? s->b : s->c);
            if (flow != FLOW_NEXT)
                return flow;
            break;
        }
        case JN_FOR: {
            const int flow = exec_for(r, s);
            if (flow != FLOW_NEXT)
                return flow;
            break;
        }
        case JN_SET: case JN_NSATTR: case JN_SETBLOCK: exec_set(r, s); break;
        case JN_BREAK: return FLOW_BREAK;
        case JN_CONTINUE: return FLOW_CONTINUE;
        case JN_BLOCK: {
            const int flow = exec_body(r, s->b);
            if (flow != FLOW_NEXT)
                return flow;
            break;
        }
        default: fail_node(r, s, KF_ERR_INVALID, "internal: not a statement%s%s", "", "");
        }
    }
    return FLOW_NEXT;
}

void jexec(jrender *r, const jnode *body) {
    jscope top = {0};
    r->scope = &top;
    exec_body(r, body);
}
