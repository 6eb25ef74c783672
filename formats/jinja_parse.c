/* jinja_parse.c — tokens to the template's tree, by jinja2's grammar (its parser's precedence:
 * condexpr < or < and < not < comparisons < + - < ~ < * / // % < ** < unary, with filters and
 * tests binding to a unary operand). Statements outside the subset are refused where they stand.
 */
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

#define JPARSE_MAX_DEPTH 64   /* nested statements, parentheses, unary operators */
#define JPARSE_MAX_TREE 400   /* an expression tree's depth (left-deep chains a + b + ... too) */
#define JPARSE_MAX_ELIF 256   /* elif branches of one if */

typedef struct {
    jctx *c;
    const jtok *t; /* [n] */
    size_t n, i;
    int depth;     /* nesting of expressions and statements */
    int loops;     /* enclosing for statements (break, continue) */
} jparser;

static const jtok *cur(const jparser *P) { return &P->t[P->i]; }
static const jtok *peek(const jparser *P, size_t k) { return &P->t[P->i + k < P->n ? P->i + k : P->n - 1]; }
static const jtok *advance(jparser *P) {
    const jtok *t = cur(P);
    if (P->i + 1 < P->n)
        P->i++;
    return t;
}

static bool tok_is(const jtok *t, int kind, const char *s) {
    return t->kind == kind && (!s || (t->len == strlen(s) && memcmp(t->p, s, t->len) == 0));
}
static bool is_op(const jparser *P, const char *s) { return tok_is(cur(P), JT_OP, s); }
static bool is_name(const jparser *P, const char *s) { return tok_is(cur(P), JT_NAME, s); }

_Noreturn static void fail_at(jparser *P, const jtok *t, kf_status code, const char *fmt, const char *arg) {
    jfail(P->c, code, t->line, t->col, fmt, arg);
}

static const char *tok_text(jparser *P, const jtok *t) {
    static const char *const names[] = {"end of template", "text", "'{%'", "'%}'", "'{{'", "'}}'"};
    if (t->kind <= JT_VAR_END)
        return names[t->kind];
    char *s = jalloc(P->c, t->len + 3);
    snprintf(s, t->len + 3, "'%.*s'", (int)t->len, t->p);
    return s;
}

static void expect_op(jparser *P, const char *op) {
    if (!is_op(P, op)) {
        char msg[64];
        snprintf(msg, sizeof msg, "expected '%s', got %%s", op);
        fail_at(P, cur(P), KF_ERR_FORMAT, msg, tok_text(P, cur(P)));
    }
    advance(P);
}

static void expect_kind(jparser *P, int kind, const char *what) {
    if (cur(P)->kind != kind) {
        char msg[96];
        snprintf(msg, sizeof msg, "expected %s, got %%s", what);
        fail_at(P, cur(P), KF_ERR_FORMAT, msg, tok_text(P, cur(P)));
    }
    advance(P);
}

static jnode *node(jparser *P, int kind, const jtok *at) {
    jnode *n = jalloc(P->c, sizeof *n);
    n->kind = kind, n->line = at->line, n->col = at->col, n->depth = 1;
    return n;
}

static jstr *tok_str(jparser *P, const jtok *t) { return jstr_new(P->c, t->p, t->len); }

/* Sets n's tree depth from its children's (built before it): rendering recurses that deep. */
static jnode *fix_depth(jparser *P, jnode *n) {
    const jnode *kids[4] = {n->a, n->b, n->c, n->d};
    int d = 0;
    for (int i = 0; i < 4; i++)
        if (kids[i] && kids[i]->depth > d)
            d = kids[i]->depth;
    for (int i = 0; i < n->nargs; i++)
        if (n->args[i]->depth > d)
            d = n->args[i]->depth;
    if (d + 1 > JPARSE_MAX_TREE)
        jfail(P->c, KF_ERR_UNSUPPORTED, n->line, n->col, "an expression nested more than %d deep", JPARSE_MAX_TREE);
    n->depth = d + 1;
    return n;
}

static void enter(jparser *P) {
    if (++P->depth > JPARSE_MAX_DEPTH)
        fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "nested more than 64 deep%s", "");
}

/* Appends to a node's argument arrays (grown in the arena). */
static void add_arg(jparser *P, jnode *n, jnode *arg, jstr *kw, int op) {
    jnode **args = jalloc(P->c, (size_t)(n->nargs + 1) * sizeof *args);
    jstr **kws = jalloc(P->c, (size_t)(n->nargs + 1) * sizeof *kws);
    int *ops = jalloc(P->c, (size_t)(n->nargs + 1) * sizeof *ops);
    if (n->nargs) {
        memcpy(args, n->args, (size_t)n->nargs * sizeof *args);
        memcpy(kws, n->kw, (size_t)n->nargs * sizeof *kws);
        memcpy(ops, n->ops, (size_t)n->nargs * sizeof *ops);
    }
    args[n->nargs] = arg, kws[n->nargs] = kw, ops[n->nargs] = op;
    n->args = args, n->kw = kws, n->ops = ops, n->nargs++;
}

static jnode *parse_expr(jparser *P);
static jnode *parse_or(jparser *P);
static jnode *parse_unary(jparser *P, bool with_filter);

/* expr (, expr)* — a tuple when there is a comma (jinja2's parse_tuple). */
static jnode *parse_tuple(jparser *P, bool with_condexpr) {
    const jtok *at = cur(P);
    jnode *first = with_condexpr ? parse_expr(P) : parse_or(P);
    if (!is_op(P, ","))
        return first;
    jnode *t = node(P, JN_TUPLE, at);
    add_arg(P, t, first, NULL, 0);
    while (is_op(P, ",")) {
        advance(P);
        const jtok *k = cur(P);
        if (k->kind == JT_VAR_END || k->kind == JT_BLOCK_END || tok_is(k, JT_OP, ")") || tok_is(k, JT_NAME, "recursive"))
            break;
        add_arg(P, t, with_condexpr ? parse_expr(P) : parse_or(P), NULL, 0);
    }
    return fix_depth(P, t);
}

/* ( args ) of a call or filter: positional, then name=value. */
static void parse_call_args(jparser *P, jnode *n) {
    expect_op(P, "(");
    bool kw_seen = false;
    while (!is_op(P, ")")) {
        if (n->nargs)
            expect_op(P, ",");
        if (is_op(P, ")"))
            break;
        if (is_op(P, "*") || is_op(P, "**"))
            fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "*args and **kwargs in calls%s", "");
        if (cur(P)->kind == JT_NAME && tok_is(peek(P, 1), JT_OP, "=")) {
            jstr *k = tok_str(P, advance(P));
            advance(P);
            add_arg(P, n, parse_expr(P), k, 0);
            kw_seen = true;
        } else {
            if (kw_seen)
                fail_at(P, cur(P), KF_ERR_FORMAT, "a positional argument after a keyword argument%s", "");
            add_arg(P, n, parse_expr(P), NULL, 0);
        }
    }
    advance(P);
}

static jnode *parse_seq(jparser *P, const jtok *at, int kind, const char *close) {
    jnode *n = node(P, kind, at);
    while (!is_op(P, close)) {
        if (n->nargs)
            expect_op(P, ",");
        if (is_op(P, close))
            break;
        add_arg(P, n, parse_expr(P), NULL, 0);
        if (kind == JN_DICT) {
            expect_op(P, ":");
            add_arg(P, n, parse_expr(P), NULL, 0);
        }
    }
    advance(P);
    return fix_depth(P, n);
}

static jnode *parse_paren(jparser *P, const jtok *at) {
    if (is_op(P, ")")) {
        advance(P);
        return node(P, JN_TUPLE, at);
    }
    jnode *e = parse_expr(P);
    if (is_op(P, ",")) {
        jnode *t = node(P, JN_TUPLE, at);
        add_arg(P, t, e, NULL, 0);
        while (is_op(P, ",")) {
            advance(P);
            if (is_op(P, ")"))
                break;
            add_arg(P, t, parse_expr(P), NULL, 0);
        }
        e = fix_depth(P, t);
    }
    expect_op(P, ")");
    return e;
}

static jnode *parse_primary(jparser *P) {
    const jtok *t = advance(P);
    if (t->kind == JT_NAME) {
        jnode *n = node(P, JN_LIT, t);
        if (tok_is(t, JT_NAME, "true") || tok_is(t, JT_NAME, "True"))
            n->lit = jv_bool(true);
        else if (tok_is(t, JT_NAME, "false") || tok_is(t, JT_NAME, "False"))
            n->lit = jv_bool(false);
        else if (tok_is(t, JT_NAME, "none") || tok_is(t, JT_NAME, "None"))
            n->lit = jv_none();
        else
            n->kind = JN_NAME, n->name = tok_str(P, t);
        return n;
    }
    if (t->kind == JT_STRING) {
        jnode *n = node(P, JN_LIT, t);
        n->lit = t->val;
        while (cur(P)->kind == JT_STRING) /* 'a' 'b' is 'ab' */
            n->lit = jv_str(jstr_cat(P->c, n->lit.u.s, advance(P)->val.u.s));
        return n;
    }
    if (t->kind == JT_INT || t->kind == JT_FLOAT) {
        jnode *n = node(P, JN_LIT, t);
        n->lit = t->val;
        return n;
    }
    if (tok_is(t, JT_OP, "("))
        return parse_paren(P, t);
    if (tok_is(t, JT_OP, "["))
        return parse_seq(P, t, JN_LIST, "]");
    if (tok_is(t, JT_OP, "{"))
        return parse_seq(P, t, JN_DICT, "}");
    fail_at(P, t, KF_ERR_FORMAT, "unexpected %s", tok_text(P, t));
}

/* x[...]: an index or a slice start:stop:step (absent parts NULL). */
static jnode *parse_subscript(jparser *P, jnode *obj, const jtok *at) {
    jnode *parts[3] = {NULL, NULL, NULL};
    int k = 0;
    bool slice = false;
    for (;;) {
        if (is_op(P, "]"))
            break;
        if (is_op(P, ":")) {
            if (++k > 2)
                fail_at(P, cur(P), KF_ERR_FORMAT, "unexpected ':'%s", "");
            slice = true;
            advance(P);
            continue;
        }
        if (is_op(P, ","))
            fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "tuple subscripts x[a, b]%s", "");
        if (parts[k])
            fail_at(P, cur(P), KF_ERR_FORMAT, "unexpected %s in a subscript", tok_text(P, cur(P)));
        parts[k] = parse_expr(P);
    }
    advance(P);
    jnode *n = node(P, slice ? JN_SLICE : JN_ITEM, at);
    n->a = obj;
    if (!slice) {
        if (!parts[0])
            fail_at(P, at, KF_ERR_FORMAT, "an empty subscript%s", "");
        n->b = parts[0];
    } else
        n->b = parts[0], n->c = parts[1], n->d = parts[2];
    return fix_depth(P, n);
}

static jnode *parse_postfix(jparser *P, jnode *n) {
    for (;;) {
        const jtok *t = cur(P);
        if (tok_is(t, JT_OP, ".")) {
            advance(P);
            const jtok *a = advance(P);
            jnode *m = node(P, a->kind == JT_NAME ? JN_ATTR : JN_ITEM, t);
            m->a = n;
            if (a->kind == JT_NAME)
                m->name = tok_str(P, a);
            else if (a->kind == JT_INT) {
                m->b = node(P, JN_LIT, a);
                m->b->lit = a->val;
            } else
                fail_at(P, a, KF_ERR_FORMAT, "expected a name or a number after '.', got %s", tok_text(P, a));
            n = fix_depth(P, m);
        } else if (tok_is(t, JT_OP, "[")) {
            advance(P);
            n = parse_subscript(P, n, t);
        } else if (tok_is(t, JT_OP, "(")) {
            jnode *m = node(P, JN_CALL, t);
            m->a = n;
            parse_call_args(P, m);
            n = fix_depth(P, m);
        } else
            return n;
    }
}

static jnode *parse_test(jparser *P, jnode *n, const jtok *at) {
    jnode *t = node(P, JN_TEST, at);
    t->a = n;
    if (is_name(P, "not"))
        advance(P), t->op = 1;
    const jtok *name = cur(P);
    expect_kind(P, JT_NAME, "a test name");
    t->name = tok_str(P, name);
    if (is_op(P, "."))
        fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "dotted test names%s", "");
    if (!jtest_known(t->name->b))
        fail_at(P, name, KF_ERR_UNSUPPORTED, "the test %s is not supported", tok_text(P, name));
    const jtok *k = cur(P);
    if (tok_is(k, JT_OP, "("))
        parse_call_args(P, t);
    else if ((k->kind == JT_NAME || k->kind == JT_STRING || k->kind == JT_INT || k->kind == JT_FLOAT ||
              tok_is(k, JT_OP, "[") || tok_is(k, JT_OP, "{")) &&
             !tok_is(k, JT_NAME, "else") && !tok_is(k, JT_NAME, "or") && !tok_is(k, JT_NAME, "and")) {
        if (tok_is(k, JT_NAME, "is"))
            fail_at(P, k, KF_ERR_FORMAT, "tests cannot be chained with is%s", "");
        add_arg(P, t, parse_postfix(P, parse_primary(P)), NULL, 0);
    }
    return fix_depth(P, t);
}

static jnode *parse_filter_expr(jparser *P, jnode *n) {
    for (;;) {
        const jtok *t = cur(P);
        if (tok_is(t, JT_OP, "|")) {
            advance(P);
            jnode *f = node(P, JN_FILTER, cur(P));
            f->a = n;
            const jtok *name = cur(P);
            expect_kind(P, JT_NAME, "a filter name");
            f->name = tok_str(P, name);
            if (is_op(P, "."))
                fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "dotted filter names%s", "");
            if (!jfilter_known(f->name->b))
                fail_at(P, name, KF_ERR_UNSUPPORTED, "the filter %s is not supported", tok_text(P, name));
            if (is_op(P, "("))
                parse_call_args(P, f);
            n = fix_depth(P, f);
        } else if (tok_is(t, JT_NAME, "is")) {
            advance(P);
            n = parse_test(P, n, t);
        } else if (tok_is(t, JT_OP, "(")) {
            jnode *m = node(P, JN_CALL, t);
            m->a = n;
            parse_call_args(P, m);
            n = fix_depth(P, m);
        } else
            return n;
    }
}

static jnode *parse_unary(jparser *P, bool with_filter) {
    enter(P);
    const jtok *t = cur(P);
    jnode *n;
    if (tok_is(t, JT_OP, "-") || tok_is(t, JT_OP, "+")) {
        advance(P);
        n = node(P, tok_is(t, JT_OP, "-") ? JN_NEG : JN_POS, t);
        n->a = parse_unary(P, false);
        fix_depth(P, n);
    } else
        n = parse_primary(P);
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_expr(P, n);
    P->depth--;
    return n;
}

static jnode *binary(jparser *P, int op, jnode *a, jnode *b, const jtok *at) {
    jnode *n = node(P, JN_BIN, at);
    n->op = op, n->a = a, n->b = b;
    return fix_depth(P, n);
}

static jnode *parse_pow(jparser *P) {
    jnode *a = parse_unary(P, true);
    while (is_op(P, "**")) {
        const jtok *at = advance(P);
        a = binary(P, JOP_POW, a, parse_unary(P, true), at);
    }
    return a;
}

static jnode *parse_math2(jparser *P) {
    jnode *a = parse_pow(P);
    for (;;) {
        const int op = is_op(P, "*") ? JOP_MUL : is_op(P, "/") ? JOP_DIV : is_op(P, "//") ? JOP_FLOORDIV
                     : is_op(P, "%") ? JOP_MOD : -1;
        if (op < 0)
            return a;
        const jtok *at = advance(P);
        a = binary(P, op, a, parse_pow(P), at);
    }
}

static jnode *parse_concat(jparser *P) {
    jnode *a = parse_math2(P);
    while (is_op(P, "~")) {
        const jtok *at = advance(P);
        a = binary(P, JOP_CONCAT, a, parse_math2(P), at);
    }
    return a;
}

static jnode *parse_math1(jparser *P) {
    jnode *a = parse_concat(P);
    while (is_op(P, "+") || is_op(P, "-")) {
        const jtok *at = advance(P);
        a = binary(P, tok_is(at, JT_OP, "+") ? JOP_ADD : JOP_SUB, a, parse_concat(P), at);
    }
    return a;
}

static int compare_op(jparser *P) {
    static const char *const ops[] = {"==", "!=", "<", "<=", ">", ">="};
    static const int codes[] = {JOP_EQ, JOP_NE, JOP_LT, JOP_LE, JOP_GT, JOP_GE};
    for (int i = 0; i < 6; i++)
        if (is_op(P, ops[i])) {
            advance(P);
            return codes[i];
        }
    if (is_name(P, "in")) {
        advance(P);
        return JOP_IN;
    }
    if (is_name(P, "not") && tok_is(peek(P, 1), JT_NAME, "in")) {
        advance(P), advance(P);
        return JOP_NOTIN;
    }
    return -1;
}

static jnode *parse_compare(jparser *P) {
    const jtok *at = cur(P);
    jnode *a = parse_math1(P);
    jnode *cmp = NULL;
    int op;
    while ((op = compare_op(P)) >= 0) {
        if (!cmp) {
            cmp = node(P, JN_CMP, at);
            cmp->a = a;
        }
        add_arg(P, cmp, parse_math1(P), NULL, op);
    }
    return cmp ? fix_depth(P, cmp) : a;
}

static jnode *parse_not(jparser *P) {
    if (is_name(P, "not")) {
        const jtok *at = advance(P);
        enter(P);
        jnode *n = node(P, JN_NOT, at);
        n->a = parse_not(P);
        P->depth--;
        return fix_depth(P, n);
    }
    return parse_compare(P);
}

static jnode *parse_and(jparser *P) {
    jnode *a = parse_not(P);
    while (is_name(P, "and")) {
        jnode *n = node(P, JN_AND, advance(P));
        n->a = a, n->b = parse_not(P);
        a = fix_depth(P, n);
    }
    return a;
}

static jnode *parse_or(jparser *P) {
    jnode *a = parse_and(P);
    while (is_name(P, "or")) {
        jnode *n = node(P, JN_OR, advance(P));
        n->a = a, n->b = parse_and(P);
        a = fix_depth(P, n);
    }
    return a;
}

/* a if cond [else b] */
static jnode *parse_expr(jparser *P) {
    enter(P);
    jnode *a = parse_or(P);
    while (is_name(P, "if")) {
        jnode *n = node(P, JN_COND, advance(P));
        n->a = a, n->b = parse_or(P);
        if (is_name(P, "else")) {
            advance(P);
            n->c = parse_expr(P);
        }
        a = fix_depth(P, n);
    }
    P->depth--;
    return a;
}

/* ---- statements ---- */

static jnode *parse_body(jparser *P, const char *const *ends, const char *what);

/* name[, name...] as the target of a for or a set */
static void parse_targets(jparser *P, jnode *n) {
    do {
        if (n->nargs)
            advance(P); /* the comma */
        const jtok *t = cur(P);
        if (is_op(P, "("))
            fail_at(P, t, KF_ERR_UNSUPPORTED, "parenthesized assignment targets%s", "");
        expect_kind(P, JT_NAME, "a variable name");
        static const char *const fixed[] = {"true", "false", "none", "True", "False", "None"};
        for (int i = 0; i < 6; i++)
            if (tok_is(t, JT_NAME, fixed[i]))
                fail_at(P, t, KF_ERR_FORMAT, "cannot assign to %s", tok_text(P, t));
        jnode *name = node(P, JN_NAME, t);
        name->name = tok_str(P, t);
        add_arg(P, n, name, NULL, 0);
    } while (is_op(P, ","));
}

static jnode *parse_if(jparser *P, const jtok *at, int elifs) {
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const endif[] = {"endif", NULL};
    jnode *n = node(P, JN_IF, at);
    n->a = parse_tuple(P, false);
    expect_kind(P, JT_BLOCK_END, "'%}'");
    n->b = parse_body(P, ends, "endif");
    const jtok *t = advance(P);
    if (tok_is(t, JT_NAME, "elif")) {
        if (elifs == JPARSE_MAX_ELIF)
            fail_at(P, t, KF_ERR_UNSUPPORTED, "more than 256 elif branches%s", "");
        n->c = parse_if(P, t, elifs + 1); /* consumes through endif */
    }
    else {
        if (tok_is(t, JT_NAME, "else")) {
            expect_kind(P, JT_BLOCK_END, "'%}'");
            n->c = parse_body(P, endif, "endif");
            advance(P);
        }
        expect_kind(P, JT_BLOCK_END, "'%}'");
    }
    return n;
}

static jnode *parse_for(jparser *P, const jtok *at) {
    static const char *const ends[] = {"endfor", "else", NULL};
    static const char *const endfor[] = {"endfor", NULL};
    jnode *n = node(P, JN_FOR, at);
    parse_targets(P, n);
    if (!is_name(P, "in"))
        fail_at(P, cur(P), KF_ERR_FORMAT, "expected 'in', got %s", tok_text(P, cur(P)));
    advance(P);
    n->a = parse_tuple(P, false);
    if (is_name(P, "if")) {
        advance(P);
        n->d = parse_expr(P);
    }
    if (is_name(P, "recursive"))
        fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "recursive loops%s", "");
    expect_kind(P, JT_BLOCK_END, "'%}'");
    P->loops++;
    n->b = parse_body(P, ends, "endfor");
    P->loops--;
    if (tok_is(advance(P), JT_NAME, "else")) {
        expect_kind(P, JT_BLOCK_END, "'%}'");
        n->c = parse_body(P, endfor, "endfor");
        advance(P);
    }
    expect_kind(P, JT_BLOCK_END, "'%}'");
    return n;
}

static jnode *parse_set(jparser *P, const jtok *at) {
    static const char *const endset[] = {"endset", NULL};
    jnode *n = node(P, JN_SET, at);
    if (cur(P)->kind == JT_NAME && tok_is(peek(P, 1), JT_OP, ".")) { /* ns.attr = value */
        n->kind = JN_NSATTR;
        n->a = node(P, JN_NAME, cur(P));
        n->a->name = tok_str(P, advance(P));
        advance(P);
        const jtok *attr = cur(P);
        expect_kind(P, JT_NAME, "an attribute name");
        n->name = tok_str(P, attr);
        expect_op(P, "=");
        n->b = parse_tuple(P, true);
    } else {
        parse_targets(P, n);
        if (is_op(P, "=")) {
            advance(P);
            n->b = parse_tuple(P, true);
        } else {
            if (n->nargs != 1 || is_op(P, "|"))
                fail_at(P, cur(P), KF_ERR_UNSUPPORTED, "this form of set block (several names or a filter)%s", "");
            expect_kind(P, JT_BLOCK_END, "'%}'");
            n->kind = JN_SETBLOCK;
            n->b = parse_body(P, endset, "endset");
            advance(P);
        }
    }
    expect_kind(P, JT_BLOCK_END, "'%}'");
    return n;
}

static jnode *parse_statement(jparser *P) {
    static const char *const endgen[] = {"endgeneration", NULL};
    const jtok *t = cur(P);
    if (t->kind != JT_NAME)
        fail_at(P, t, KF_ERR_FORMAT, "expected a statement name, got %s", tok_text(P, t));
    advance(P);
    if (tok_is(t, JT_NAME, "if"))
        return parse_if(P, t, 0);
    if (tok_is(t, JT_NAME, "for"))
        return parse_for(P, t);
    if (tok_is(t, JT_NAME, "set"))
        return parse_set(P, t);
    if (tok_is(t, JT_NAME, "break") || tok_is(t, JT_NAME, "continue")) {
        if (!P->loops)
            fail_at(P, t, KF_ERR_FORMAT, "%s outside a loop", tok_text(P, t));
        expect_kind(P, JT_BLOCK_END, "'%}'");
        return node(P, tok_is(t, JT_NAME, "break") ? JN_BREAK : JN_CONTINUE, t);
    }
    if (tok_is(t, JT_NAME, "generation")) {
        jnode *n = node(P, JN_BLOCK, t);
        expect_kind(P, JT_BLOCK_END, "'%}'");
        n->b = parse_body(P, endgen, "endgeneration");
        advance(P);
        expect_kind(P, JT_BLOCK_END, "'%}'");
        return n;
    }
    static const char *const misplaced[] = {"elif", "else", "endif", "endfor", "endset", "endgeneration", NULL};
    for (int i = 0; misplaced[i]; i++)
        if (tok_is(t, JT_NAME, misplaced[i]))
            fail_at(P, t, KF_ERR_FORMAT, "unexpected %s", tok_text(P, t));
    fail_at(P, t, KF_ERR_UNSUPPORTED, "the statement %s is not supported", tok_text(P, t));
}

/* Statements up to one of ends (left as the current token, after its '{%'), or the end. */
static jnode *parse_body(jparser *P, const char *const *ends, const char *what) {
    jnode *head = NULL, **tail = &head;
    enter(P);
    for (;;) {
        const jtok *t = advance(P);
        jnode *s = NULL;
        if (t->kind == JT_EOF) {
            if (ends)
                fail_at(P, t, KF_ERR_FORMAT, "unexpected end of template, expected '%s'", what);
            break;
        }
        if (t->kind == JT_DATA) {
            s = node(P, JN_TEXT, t);
            s->lit = t->val;
        } else if (t->kind == JT_VAR_BEGIN) {
            s = node(P, JN_PRINT, t);
            s->a = parse_tuple(P, true);
            expect_kind(P, JT_VAR_END, "'}}'");
        } else if (t->kind == JT_BLOCK_BEGIN) {
            for (int i = 0; ends && ends[i]; i++)
                if (is_name(P, ends[i])) {
                    P->depth--;
                    return head;
                }
            s = parse_statement(P);
        } else
            fail_at(P, t, KF_ERR_FORMAT, "unexpected %s", tok_text(P, t));
        *tail = s, tail = &s->next;
    }
    P->depth--;
    return head;
}

jnode *jparse(jctx *c, const jtok *toks, size_t ntoks) {
    jparser P = {.c = c, .t = toks, .n = ntoks};
    return parse_body(&P, NULL, NULL);
}
