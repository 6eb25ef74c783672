/* jinja_internal.h — the pieces of formats/jinja*.c that talk to each other.
 * Not a public header: include formats/jinja.h instead.
 *
 * Values live in an arena (one per template for literals, one per render for everything else) and
 * are never freed one by one; errors unwind with longjmp to the entry point, which owns the arenas.
 */
#ifndef KF_JINJA_INTERNAL_H
#define KF_JINJA_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/base/error.h"
#include "jinja.h"

/* ---- arena ---- */

typedef struct jarena_chunk jarena_chunk;
typedef struct {
    jarena_chunk *head;
    size_t used;  /* bytes handed out, all chunks */
    size_t limit; /* refuse beyond this (0: no limit) */
} jarena;

/* ---- values ---- */

typedef enum {
    JV_UNDEF, /* jinja2's Undefined: prints '', false, iterates empty; most operations fail */
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST, /* also tuples (flag tuple) */
    JV_DICT, /* string keys, insertion order */
    JV_NS,   /* namespace(): a dict whose attributes may be assigned */
    JV_FUNC, /* a builtin function or a bound method */
    JV_LOOP, /* the loop object of a for */
} jv_kind;

typedef struct jstr {
    size_t len; /* bytes, not counting the NUL */
    size_t ncp; /* code points */
    char b[];   /* [len + 1] UTF-8, NUL-terminated (may contain NULs) */
} jstr;

typedef struct jv {
    uint8_t kind;  /* jv_kind */
    uint8_t tuple; /* JV_LIST: 0 a list, 1 a tuple (never equal to a list), JV_VIEW or JV_ITER */
    union {
        bool b;
        int64_t i;
        double f;
        jstr *s;
        struct jlist *l;
        struct jdict *d;
        struct jfunc *fn;
        struct jloop *loop;
    } u;
} jv;

/* What Python would hold instead of a list: a dict view (keys(), values(), items(): len, in and
 * iteration, no index), or an iterator (reversed(), the items filter's generator: always true,
 * iterated once). Whatever else Python does with them is refused. */
enum { JV_VIEW = 2, JV_ITER = 3 };

typedef struct jlist {
    size_t n, cap;
    jv *items;     /* [cap] */
    bool consumed; /* a JV_ITER that has been iterated: empty from then on */
} jlist;

typedef struct jdict {
    size_t n, cap;
    jstr **keys; /* [cap] */
    jv *vals;    /* [cap] */
} jdict;

typedef enum {
    JF_RANGE, JF_NAMESPACE, JF_DICT, JF_RAISE, /* globals */
    JF_METHOD,                                 /* a method of self, by name */
    JF_CYCLE,                                  /* loop.cycle */
} jfunc_kind;

typedef struct jfunc {
    int kind;
    jv self;
    const char *name; /* the method's name */
} jfunc;

typedef struct jloop {
    int64_t index0, length, depth;
    jv prev, next; /* JV_UNDEF at the ends */
} jloop;

/* ---- template AST ---- */

typedef enum {
    /* statements */
    JN_TEXT, JN_PRINT, JN_IF, JN_FOR, JN_SET, JN_SETBLOCK, JN_BREAK, JN_CONTINUE, JN_BLOCK,
    /* expressions */
    JN_LIT, JN_NAME, JN_LIST, JN_TUPLE, JN_DICT, JN_ATTR, JN_ITEM, JN_SLICE, JN_CALL, JN_FILTER,
    JN_TEST, JN_BIN, JN_NEG, JN_POS, JN_NOT, JN_AND, JN_OR, JN_COND, JN_CMP, JN_NSATTR,
} jnode_kind;

typedef enum {
    JOP_ADD, JOP_SUB, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW, JOP_CONCAT,
    JOP_EQ, JOP_NE, JOP_LT, JOP_LE, JOP_GT, JOP_GE, JOP_IN, JOP_NOTIN,
} jop;

typedef struct jnode jnode;
struct jnode {
    int kind; /* jnode_kind */
    int op;   /* jop for JN_BIN; negated for JN_TEST */
    int line, col;
    jnode *a, *b, *c, *d; /* children: see the parser for each kind's use */
    jnode **args;         /* [nargs] list items, call/filter/test arguments, dict keys/values pairs */
    jstr **kw;            /* [nargs] keyword names of call arguments (NULL: positional) */
    int *ops;             /* [nargs] JN_CMP: the operator before each args[i] */
    int nargs;
    int depth;    /* of the expression tree below (1: a leaf); bounded by the parser */
    jv lit;       /* JN_TEXT, JN_LIT */
    jstr *name;   /* JN_NAME, JN_ATTR, JN_FILTER, JN_TEST, JN_NSATTR (attribute) */
    jnode *next;  /* next statement in a body */
};

struct kf_jinja {
    jarena arena; /* the AST and its literals */
    jnode *body;
};

/* ---- lexer ---- */

typedef enum {
    JT_EOF, JT_DATA, JT_BLOCK_BEGIN, JT_BLOCK_END, JT_VAR_BEGIN, JT_VAR_END,
    JT_NAME, JT_STRING, JT_INT, JT_FLOAT, JT_OP,
} jtok_kind;

typedef struct {
    int kind;
    int line, col;
    const char *p; /* in the normalized source */
    size_t len;
    jv val; /* JT_DATA, JT_STRING, JT_INT, JT_FLOAT */
} jtok;

/* The shared state of a parse or a render: where to unwind to and what to report. */
typedef struct {
    jmp_buf jb;
    kf_error *err;
    jarena *arena;
    const char *src; /* the normalized source, for positions */
    size_t src_len;
} jctx;

_Noreturn void jfail(jctx *c, kf_status code, int line, int col, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Tokenizes a normalized source: newlines as "\n", one trailing newline removed (jinja2's
 * defaults), whitespace control and trim_blocks/lstrip_blocks applied to the data tokens. */
void jlex(jctx *c, jtok **toks, size_t *ntoks);
void jlex_normalize(jctx *c, const char *src, size_t len, char **out, size_t *out_len);
jnode *jparse(jctx *c, const jtok *toks, size_t ntoks);

/* ---- jinja_value.c ---- */

void jarena_free(jarena *a);
void *jalloc(jctx *c, size_t n); /* zeroed; fails the render when over the arena's limit */
jstr *jstr_new(jctx *c, const char *b, size_t len);
jstr *jstr_cat(jctx *c, const jstr *x, const jstr *y);
jlist *jlist_new(jctx *c, size_t cap);
void jlist_push(jctx *c, jlist *l, jv v);
jdict *jdict_new(jctx *c, size_t cap);
void jdict_set(jctx *c, jdict *d, jstr *k, jv v);
bool jdict_get(const jdict *d, const char *k, size_t klen, jv *out);

static inline jv jv_undef(void) { jv v = {.kind = JV_UNDEF}; return v; }
static inline jv jv_none(void) { jv v = {.kind = JV_NONE}; return v; }
static inline jv jv_bool(bool b) { jv v = {.kind = JV_BOOL}; v.u.b = b; return v; }
static inline jv jv_int(int64_t i) { jv v = {.kind = JV_INT}; v.u.i = i; return v; }
static inline jv jv_float(double f) { jv v = {.kind = JV_FLOAT}; v.u.f = f; return v; }
static inline jv jv_str(jstr *s) { jv v = {.kind = JV_STR}; v.u.s = s; return v; }
static inline jv jv_list(jlist *l, bool tuple) { jv v = {.kind = JV_LIST, .tuple = tuple}; v.u.l = l; return v; }
static inline jv jv_dict(jdict *d) { jv v = {.kind = JV_DICT}; v.u.d = d; return v; }
jv jv_cstr(jctx *c, const char *s);

const char *jv_type_name(jv v); /* Python's name: 'str', 'int', 'list', ... */
bool jv_truthy(jv v);
bool jv_hashable(jv v);
/* Python's str(); lists, dicts and the like are refused (their repr is not reproduced). */
jstr *jv_to_str(jctx *c, jv v, const jnode *at);
/* Python's float repr into buf (at least 32 bytes). */
void jfmt_float(double f, char *buf);
/* ==, and <: *ok false when Python would raise TypeError (values nested too deep are refused at). */
bool jv_equal(jctx *c, const jnode *at, jv a, jv b);
int jv_compare(jctx *c, const jnode *at, jv a, jv b, bool *ok);

/* A buffer that grows in the arena (the output, tojson). */
typedef struct {
    char *b;
    size_t len, cap;
} jbuf;
void jbuf_put(jctx *c, jbuf *b, const char *s, size_t n);
static inline void jbuf_puts(jctx *c, jbuf *b, const char *s) { jbuf_put(c, b, s, strlen(s)); }

/* Python's json.dumps(v, ensure_ascii, indent (<0: None), separators, sort_keys). */
void jv_tojson(jctx *c, jbuf *out, jv v, bool ensure_ascii, int indent, const char *item_sep,
               const char *key_sep, bool sort_keys, const jnode *at);

/* ---- jinja_str.c: Python's str methods on UTF-8 ---- */

bool jcp_isspace(uint32_t cp);
/* Decodes one code point of UTF-8 at s (n bytes there); returns its length, -1 when invalid. */
int jutf8_next(const char *s, size_t n, uint32_t *cp);
/* Encodes cp at d (room for 4); returns its length. */
size_t jutf8_put(uint32_t cp, char *d);
size_t jutf8_count(const char *s, size_t len);
/* Byte offset of code point index i (0 <= i <= ncp). */
size_t jstr_offset(const jstr *s, int64_t i);
jstr *jstr_strip(jctx *c, const jstr *s, const jstr *chars, bool left, bool right);
jlist *jstr_split(jctx *c, const jstr *s, const jstr *sep, int64_t maxsplit, const jnode *at);
jstr *jstr_replace(jctx *c, const jstr *s, const jstr *old, const jstr *new_, int64_t count);
bool jstr_find(const jstr *hay, const jstr *needle);
jstr *jstr_ascii_case(jctx *c, const jstr *s, bool upper, const jnode *at);
/* Python's seq[start:stop:step] (absent bounds as has_* false) on a str or a list. */
jv jv_slice(jctx *c, jv seq, bool has_start, int64_t start, bool has_stop, int64_t stop, int64_t step);

/* ---- jinja_eval.c / jinja_builtin.c ---- */

typedef struct jscope jscope;
typedef struct {
    jctx *c;
    jdict *vars;     /* the render's context */
    jscope *scope;   /* innermost scope */
    jbuf out;
    int64_t steps, max_steps;
    size_t max_output;
    int loop_depth;
} jrender;

jv jeval(jrender *r, const jnode *n);
/* Arguments evaluated: positional in pos[npos], keywords in kwn/kwv[nkw]. */
typedef struct {
    jv pos[8];
    int npos;
    const jstr *kwn[8];
    jv kwv[8];
    int nkw;
} jargs;
void jeval_args(jrender *r, const jnode *call, int first, jargs *a);
jv jattr(jrender *r, jv obj, const char *name, size_t len, const jnode *at);
jv jitem(jrender *r, jv obj, jv key, const jnode *at);
jv jcall(jrender *r, jv fn, const jnode *call);
jv jfilter(jrender *r, const jnode *n);
bool jtest(jrender *r, const jnode *n);
jv jglobal(jrender *r, const char *name, const jnode *at, bool *found);
/* Argument i, or the keyword name: true when given. */
bool jarg(const jargs *a, int i, const char *name, jv *out);
/* Refuses more than max positional arguments, keywords outside names, a name given twice. */
void jargs_check(jrender *r, const jnode *at, const jargs *a, int max, const char *const *names, const char *fn);
/* The items a for iterates: a list's, a str's characters, a dict's keys, none for Undefined. */
jlist *jiter_items(jrender *r, jv seq, const jnode *n);
bool jcompare_op(jrender *r, const jnode *n, int op, jv a, jv b);
void jexec(jrender *r, const jnode *body);
jdict *jcontext_load(jctx *c, const char *json, size_t len);
/* Filters and tests of the subset (refused at parse time when not in it). */
bool jfilter_known(const char *name);
bool jtest_known(const char *name);

#endif
