/* jinja_lex.c — a template's source to tokens, as jinja2's lexer splits it (trim_blocks and
 * lstrip_blocks on): data between tags, with the whitespace control applied, and the tokens
 * inside {% %} and {{ }}. Comments are dropped here.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

typedef struct {
    jctx *c;
    const char *s; /* normalized source */
    size_t n;
    jtok *toks; /* [cap] */
    size_t ntoks, cap;
    size_t cur_off; /* line/column cursor: the offset it stands at */
    int cur_line, cur_col;
    char bal[64]; /* open brackets inside a tag */
    int nbal;
} jlexer;

/* Line and column (1-based, columns in code points) of offset off; offsets come in order. */
static void lex_pos(jlexer *L, size_t off, int *line, int *col) {
    if (off < L->cur_off)
        L->cur_off = 0, L->cur_line = 1, L->cur_col = 1;
    for (; L->cur_off < off; L->cur_off++) {
        const unsigned char ch = (unsigned char)L->s[L->cur_off];
        if (ch == '\n')
            L->cur_line++, L->cur_col = 1;
        else if ((ch & 0xC0) != 0x80)
            L->cur_col++;
    }
    *line = L->cur_line, *col = L->cur_col;
}

_Noreturn static void lex_fail(jlexer *L, kf_status code, size_t off, const char *what) {
    int line, col;
    lex_pos(L, off, &line, &col);
    jfail(L->c, code, line, col, "%s", what);
}

static jtok *emit(jlexer *L, int kind, size_t off, size_t len) {
    if (L->ntoks == L->cap) {
        const size_t cap = L->cap ? 2 * L->cap : 256;
        jtok *t = jalloc(L->c, cap * sizeof *t);
        if (L->ntoks)
            memcpy(t, L->toks, L->ntoks * sizeof *t);
        L->toks = t, L->cap = cap;
    }
    jtok *t = &L->toks[L->ntoks++];
    memset(t, 0, sizeof *t);
    t->kind = kind, t->p = L->s + off, t->len = len;
    lex_pos(L, off, &t->line, &t->col);
    return t;
}

/* Python's \s at s[i] (a str pattern: Unicode white space); its byte length, 0 when not. */
static int space_at(const char *s, size_t n, size_t i) {
    if (i >= n)
        return 0;
    uint32_t cp;
    const int k = jutf8_next(s + i, n - i, &cp);
    return k > 0 && jcp_isspace(cp) ? k : 0;
}

static size_t skip_space(const char *s, size_t n, size_t i) {
    int k;
    while ((k = space_at(s, n, i)) > 0)
        i += (size_t)k;
    return i;
}

/* The data before a tag, with {%- (strip all) or lstrip_blocks (the tag alone on its line) applied. */
static size_t strip_before(const jlexer *L, size_t start, size_t end, char sign, char kind, bool line_starting) {
    if (sign == '-') {
        size_t e = end; /* Python's rstrip(): back over white space, a code point at a time */
        while (e > start) {
            size_t b = e - 1;
            while (b > start && ((unsigned char)L->s[b] & 0xC0) == 0x80)
                b--;
            if (space_at(L->s, L->n, b) != (int)(e - b))
                break;
            e = b;
        }
        return e;
    }
    if (sign == '+' || kind == '{')
        return end;
    size_t l = end;
    while (l > start && L->s[l - 1] != '\n')
        l--;
    if (l == start && !line_starting)
        return end;
    if (l < end && skip_space(L->s, end, l) == end)
        return l;
    return end;
}

/* A comment from just after {# (and its sign); returns the offset after its end. */
static size_t lex_comment(jlexer *L, size_t p, size_t tag) {
    for (; p + 1 < L->n; p++) {
        if ((L->s[p] == '+' || L->s[p] == '-') && L->s[p + 1] == '#' && p + 2 < L->n && L->s[p + 2] == '}')
            return L->s[p] == '-' ? skip_space(L->s, L->n, p + 3) : p + 3;
        if (L->s[p] == '#' && L->s[p + 1] == '}')
            return (p + 2 < L->n && L->s[p + 2] == '\n') ? p + 3 : p + 2;
    }
    lex_fail(L, KF_ERR_FORMAT, tag, "missing end of comment tag");
}

static int hex_digits(const char *s, size_t n, size_t p, int k, uint32_t *v) {
    *v = 0;
    for (int j = 0; j < k; j++) {
        if (p + (size_t)j >= n)
            return 0;
        const char h = s[p + (size_t)j];
        const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
        if (d < 0)
            return 0;
        *v = *v * 16 + (uint32_t)d;
    }
    return k;
}

/* One backslash escape at s[p] == '\\' (Python's unicode-escape); appends to d, returns its length. */
static size_t lex_escape(jlexer *L, size_t p, char *d, size_t *dn) {
    const char e = L->s[p + 1];
    uint32_t cp = 0;
    size_t k = 2;
    switch (e) {
    case '\n': return 2; /* a line continuation */
    case '\\': case '\'': case '"': cp = (uint32_t)e; break;
    case 'a': cp = 7; break;
    case 'b': cp = 8; break;
    case 'f': cp = 12; break;
    case 'n': cp = 10; break;
    case 'r': cp = 13; break;
    case 't': cp = 9; break;
    case 'v': cp = 11; break;
    case 'x': case 'u': case 'U': {
        const int want = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        if (!hex_digits(L->s, L->n, p + 2, want, &cp))
            lex_fail(L, KF_ERR_FORMAT, p, "a truncated \\x, \\u or \\U escape in a string");
        k = 2 + (size_t)want;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            lex_fail(L, KF_ERR_UNSUPPORTED, p, "a surrogate or out-of-range code point in a string escape");
        break;
    }
    default:
        if (e >= '0' && e <= '7') {
            for (k = 1; k < 4 && L->s[p + k] >= '0' && L->s[p + k] <= '7'; k++)
                cp = cp * 8 + (uint32_t)(L->s[p + k] - '0');
            break;
        }
        if ((unsigned char)e >= 0x80 || e == 'N')
            lex_fail(L, KF_ERR_UNSUPPORTED, p, "a backslash before a non-ASCII character or \\N{...} in a string");
        d[(*dn)++] = '\\', d[(*dn)++] = e; /* Python keeps an unknown escape as it is */
        return 2;
    }
    *dn += jutf8_put(cp, d + *dn);
    return k;
}

static void lex_string(jlexer *L, size_t *pp) {
    const size_t p = *pp;
    const char q = L->s[p];
    size_t e = p + 1;
    while (e < L->n && L->s[e] != q)
        e += L->s[e] == '\\' ? 2 : 1;
    if (e >= L->n)
        lex_fail(L, KF_ERR_FORMAT, p, "unterminated string");
    char *d = jalloc(L->c, e - p + 4); /* escapes never lengthen the text */
    size_t dn = 0;
    for (size_t i = p + 1; i < e;)
        if (L->s[i] == '\\')
            i += lex_escape(L, i, d, &dn);
        else
            d[dn++] = L->s[i++];
    jtok *t = emit(L, JT_STRING, p, e + 1 - p);
    t->val = jv_str(jstr_new(L->c, d, dn));
    *pp = e + 1;
}

static size_t digits(const char *s, size_t n, size_t p) {
    while (p < n && s[p] >= '0' && s[p] <= '9')
        p++;
    return p;
}

/* 12, 1.5, 1e3, 2.5E-3 (jinja2's float_re and integer_re without '_', 0x, 0o, 0b). */
static void lex_number(jlexer *L, size_t *pp) {
    const size_t p = *pp, n = L->n;
    const char *s = L->s;
    size_t q = digits(s, n, p);
    bool is_float = false;
    const bool after_dot = p > 0 && s[p - 1] == '.';
    if (!after_dot && q + 1 < n && s[q] == '.' && s[q + 1] >= '0' && s[q + 1] <= '9')
        q = digits(s, n, q + 1), is_float = true;
    if (!after_dot && q < n && (s[q] == 'e' || s[q] == 'E')) {
        size_t r = q + 1;
        if (r < n && (s[r] == '+' || s[r] == '-'))
            r++;
        if (r < n && s[r] >= '0' && s[r] <= '9')
            q = digits(s, n, r), is_float = true;
    }
    if (q < n && (s[q] == '_' || ((s[q] == 'x' || s[q] == 'o' || s[q] == 'b' || s[q] == 'X' || s[q] == 'O' || s[q] == 'B') && q == p + 1 && s[p] == '0')))
        lex_fail(L, KF_ERR_UNSUPPORTED, p, "numbers with '_' or a 0x, 0o, 0b prefix");
    char buf[64];
    if (q - p >= sizeof buf)
        lex_fail(L, KF_ERR_UNSUPPORTED, p, "a number literal longer than 63 characters");
    memcpy(buf, s + p, q - p);
    buf[q - p] = 0;
    jtok *t = emit(L, is_float ? JT_FLOAT : JT_INT, p, q - p);
    errno = 0;
    if (is_float)
        t->val = jv_float(strtod(buf, NULL));
    else {
        if (q - p > 1 && buf[0] == '0')
            lex_fail(L, KF_ERR_UNSUPPORTED, p, "an integer with a leading zero");
        const long long v = strtoll(buf, NULL, 10);
        if (errno == ERANGE)
            lex_fail(L, KF_ERR_UNSUPPORTED, p, "an integer beyond 64 bits");
        t->val = jv_int(v);
    }
    *pp = q;
}

static bool lex_operator(jlexer *L, size_t *pp) {
    static const char *const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]",
                                      "(", ")", "{", "}", ">", "<", "=", ".", ":", "|", ",", ";"};
    const size_t p = *pp;
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        const size_t k = strlen(ops[i]);
        if (p + k > L->n || memcmp(L->s + p, ops[i], k) != 0)
            continue;
        const char ch = ops[i][0];
        if (k == 1 && (ch == '(' || ch == '[' || ch == '{')) {
            if (L->nbal == (int)sizeof L->bal)
                lex_fail(L, KF_ERR_UNSUPPORTED, p, "brackets nested too deeply");
            L->bal[L->nbal++] = ch == '(' ? ')' : ch == '[' ? ']' : '}';
        } else if (k == 1 && (ch == ')' || ch == ']' || ch == '}')) {
            if (L->nbal == 0 || L->bal[L->nbal - 1] != ch)
                lex_fail(L, KF_ERR_FORMAT, p, ch == ')' ? "unexpected ')'" : ch == ']' ? "unexpected ']'" : "unexpected '}'");
            L->nbal--;
        }
        emit(L, JT_OP, p, k);
        *pp = p + k;
        return true;
    }
    return false;
}

/* The end of a tag at p (only outside brackets): its length, with what it swallows after it. */
static size_t tag_end(const jlexer *L, size_t p, char kind) {
    const char *s = L->s;
    const size_t n = L->n;
    const char close = kind == '%' ? '%' : '}';
    if (L->nbal)
        return 0;
    if (kind == '%' && p + 3 <= n && s[p] == '+' && s[p + 1] == '%' && s[p + 2] == '}')
        return 3;
    if (p + 3 <= n && s[p] == '-' && s[p + 1] == close && s[p + 2] == '}')
        return skip_space(s, n, p + 3) - p;
    if (p + 2 <= n && s[p] == close && s[p + 1] == '}')
        return (kind == '%' && p + 2 < n && s[p + 2] == '\n') ? 3 : 2;
    return 0;
}

/* The tokens of one {% %} or {{ }} from p; returns the offset after its end. */
static size_t lex_tag(jlexer *L, size_t p, size_t tag, char kind) {
    L->nbal = 0;
    for (;;) {
        if (p >= L->n)
            lex_fail(L, KF_ERR_FORMAT, tag, kind == '%' ? "missing end of block tag ('%}')" : "missing end of variable tag ('}}')");
        const size_t e = tag_end(L, p, kind);
        if (e) {
            emit(L, kind == '%' ? JT_BLOCK_END : JT_VAR_END, p, e);
            return p + e;
        }
        const int sp = space_at(L->s, L->n, p);
        const char ch = L->s[p];
        if (sp > 0)
            p += (size_t)sp;
        else if (ch >= '0' && ch <= '9')
            lex_number(L, &p);
        else if (ch == '_' || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z')) {
            size_t q = p;
            while (q < L->n && (L->s[q] == '_' || (L->s[q] >= 'a' && L->s[q] <= 'z') ||
                                (L->s[q] >= 'A' && L->s[q] <= 'Z') || (L->s[q] >= '0' && L->s[q] <= '9')))
                q++;
            emit(L, JT_NAME, p, q - p);
            p = q;
        } else if (ch == '\'' || ch == '"')
            lex_string(L, &p);
        else if (!lex_operator(L, &p))
            lex_fail(L, KF_ERR_UNSUPPORTED, p, "unexpected character in a tag");
    }
}

/* Offset of the next "{%", "{{" or "{#" at or after p (n when none). */
static size_t next_tag(const jlexer *L, size_t p) {
    for (; p + 1 < L->n; p++)
        if (L->s[p] == '{' && (L->s[p + 1] == '%' || L->s[p + 1] == '{' || L->s[p + 1] == '#'))
            return p;
    return L->n;
}

static void emit_data(jlexer *L, size_t start, size_t end) {
    if (end > start) {
        jtok *t = emit(L, JT_DATA, start, end - start);
        t->val = jv_str(jstr_new(L->c, L->s + start, end - start));
    }
}

void jlex(jctx *c, jtok **toks, size_t *ntoks) {
    jlexer L = {.c = c, .s = c->src, .n = c->src_len, .cur_line = 1, .cur_col = 1};
    bool line_starting = true;
    size_t pos = 0;
    while (pos < L.n) {
        const size_t i = next_tag(&L, pos);
        if (i == L.n) {
            emit_data(&L, pos, L.n);
            break;
        }
        const char kind = L.s[i + 1];
        const char sign = (i + 2 < L.n && (L.s[i + 2] == '-' || L.s[i + 2] == '+')) ? L.s[i + 2] : 0;
        emit_data(&L, pos, strip_before(&L, pos, i, sign, kind, line_starting));
        const size_t body = i + 2 + (sign ? 1 : 0);
        if (kind == '#')
            pos = lex_comment(&L, body, i);
        else {
            emit(&L, kind == '%' ? JT_BLOCK_BEGIN : JT_VAR_BEGIN, i, body - i);
            pos = lex_tag(&L, body, i, kind == '%' ? '%' : '{');
        }
        line_starting = pos > 0 && L.s[pos - 1] == '\n';
    }
    emit(&L, JT_EOF, L.n, 0);
    *toks = L.toks, *ntoks = L.ntoks;
}

/* Newlines to "\n" and one trailing newline dropped; refuses invalid UTF-8 (with its position). */
void jlex_normalize(jctx *c, const char *src, size_t len, char **out, size_t *out_len) {
    char *d = jalloc(c, len + 1);
    size_t n = 0;
    int line = 1;
    for (size_t i = 0; i < len;) {
        const unsigned char ch = (unsigned char)src[i];
        if (ch == '\r') {
            d[n++] = '\n', line++;
            i += (i + 1 < len && src[i + 1] == '\n') ? 2 : 1;
            continue;
        }
        uint32_t cp;
        const int k = jutf8_next(src + i, len - i, &cp);
        if (k <= 0)
            jfail(c, KF_ERR_FORMAT, line, 0, "the template is not valid UTF-8 (byte %zu)", i);
        line += ch == '\n';
        memcpy(d + n, src + i, (size_t)k);
        n += (size_t)k, i += (size_t)k;
    }
    if (n > 0 && d[n - 1] == '\n')
        n--;
    d[n] = 0;
    *out = d, *out_len = n;
}
