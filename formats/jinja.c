/* jinja.c — the public entry points: parse a template, render it with a JSON context.
 * Each owns the arenas of its work and is where a failure (jfail) unwinds to.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

void jfail(jctx *c, kf_status code, int line, int col, const char *fmt, ...) {
    char msg[KF_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0 && col > 0)
        kf_fail(c->err, code, "template line %d, column %d: %s", line, col, msg);
    else if (line > 0)
        kf_fail(c->err, code, "template line %d: %s", line, msg);
    else
        kf_fail(c->err, code, "template: %s", msg);
    longjmp(c->jb, 1);
}

kf_status kf_jinja_parse(const char *src, size_t len, kf_jinja **out, kf_error *err) {
    *out = NULL;
    kf_jinja *t = calloc(1, sizeof *t);
    if (!t)
        return kf_fail(err, KF_ERR_NOMEM, "template: out of memory");
    kf_error local = {0};
    jarena *scratch = calloc(1, sizeof *scratch); /* the tokens and the normalized source */
    if (!scratch) {
        free(t);
        return kf_fail(err, KF_ERR_NOMEM, "template: out of memory");
    }
    jctx c = {.err = err ? err : &local, .arena = scratch};
    t->arena.limit = scratch->limit = (size_t)1 << 30;
    if (setjmp(c.jb)) { /* t and scratch live on the heap: unchanged by the jump */
        jarena_free(scratch);
        free(scratch);
        kf_jinja_free(t);
        return c.err->code;
    }
    char *norm;
    size_t n;
    jlex_normalize(&c, src, len, &norm, &n);
    c.src = norm, c.src_len = n;
    jtok *toks;
    size_t ntoks;
    jlex(&c, &toks, &ntoks);
    c.arena = &t->arena; /* the tree keeps the tokens' strings: copy them there */
    for (size_t i = 0; i < ntoks; i++)
        if (toks[i].kind == JT_DATA || toks[i].kind == JT_STRING)
            toks[i].val = jv_str(jstr_new(&c, toks[i].val.u.s->b, toks[i].val.u.s->len));
    t->body = jparse(&c, toks, ntoks);
    jarena_free(scratch);
    free(scratch);
    *out = t;
    return KF_OK;
}

void kf_jinja_free(kf_jinja *t) {
    if (!t)
        return;
    jarena_free(&t->arena);
    free(t);
}

kf_status kf_jinja_render(const kf_jinja *t, const char *json, size_t json_len, const kf_jinja_limits *limits,
                          char **out, size_t *out_len, kf_error *err) {
    *out = NULL;
    if (out_len)
        *out_len = 0;
    const kf_jinja_limits lim = limits ? *limits : (kf_jinja_limits){20000000, (size_t)512 << 20, (size_t)64 << 20};
    kf_error local = {0};
    jarena *arena = calloc(1, sizeof *arena); /* on the heap: unchanged by a jump back here */
    if (!arena)
        return kf_fail(err, KF_ERR_NOMEM, "template: out of memory");
    arena->limit = lim.max_memory;
    jctx c = {.err = err ? err : &local, .arena = arena};
    jrender r = {.c = &c, .max_steps = lim.max_steps, .max_output = lim.max_output};
    if (setjmp(c.jb)) {
        jarena_free(arena);
        free(arena);
        return c.err->code;
    }
    r.vars = jcontext_load(&c, json, json_len);
    jexec(&r, t->body);
    char *s = malloc(r.out.len + 1);
    if (!s) {
        jarena_free(arena);
        free(arena);
        return kf_fail(err, KF_ERR_NOMEM, "template: out of memory for the output");
    }
    if (r.out.len)
        memcpy(s, r.out.b, r.out.len);
    s[r.out.len] = 0;
    *out = s;
    if (out_len)
        *out_len = r.out.len;
    jarena_free(arena);
    free(arena);
    return KF_OK;
}
