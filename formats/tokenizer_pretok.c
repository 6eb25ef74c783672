/* tokenizer_pretok.c — normalizers (utf8proc) and pre-tokenizers (PCRE2 regex splits, ByteLevel).
 *
 * Pieces are byte ranges of one buffer; each step turns the current list into a new one. The
 * ByteLevel byte -> character mapping is not materialized: BPE works on raw bytes.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer_internal.h"

/* ---- normalizers ----------------------------------------------------------------------------- */

kf_status kf_normalize(const kf_normalizer *nz, const char *s, size_t len, char **out,
                       size_t *out_len, kf_error *err) {
    char *cur = malloc(len + 1);
    if (!cur)
        return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
    memcpy(cur, s, len);
    cur[len] = 0;
    size_t cur_len = len;
    for (size_t k = 0; k < nz->n; k++) {
        /* Code points below U+0300 are NFC-stable and never combine with one another; ASCII is
         * stable under every form. Skip the library for such text. */
        unsigned char limit = nz->steps[k] == KF_NORM_NFC ? 0xCC : 0x80;
        bool plain = true;
        for (size_t i = 0; i < cur_len; i++) {
            if ((unsigned char)cur[i] >= limit) {
                plain = false;
                break;
            }
        }
        if (plain)
            continue;
        utf8proc_option_t opt = UTF8PROC_STABLE;
        switch (nz->steps[k]) {
        case KF_NORM_NFC: opt |= UTF8PROC_COMPOSE; break;
        case KF_NORM_NFD: opt |= UTF8PROC_DECOMPOSE; break;
        case KF_NORM_NFKC: opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
        case KF_NORM_NFKD: opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
        }
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)cur, (utf8proc_ssize_t)cur_len,
                                          &dst, opt);
        free(cur);
        if (n < 0) {
            return kf_fail(err, n == UTF8PROC_ERROR_NOMEM ? KF_ERR_NOMEM : KF_ERR_INVALID,
                           "tokenizer: normalization failed: %s", utf8proc_errmsg(n));
        }
        cur = (char *)dst;
        cur_len = (size_t)n;
    }
    *out = cur;
    *out_len = cur_len;
    return KF_OK;
}

/* ---- regex ----------------------------------------------------------------------------------- */

/* Unicode White_Space, as a character-class body (what Oniguruma's \s matches). */
static const char kf_ws_class[] =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}"
    "\\x{202f}\\x{205f}\\x{3000}";

bool kf_is_white_space(uint32_t c) {
    return (c >= 0x9 && c <= 0xd) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

static bool sb_add(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n + 1)
            c *= 2;
        char *p = realloc(*buf, c);
        if (!p)
            return false;
        *buf = p;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

/* Rewrites \s and \S to the White_Space class; everything else is passed to PCRE2 as is. */
static kf_status rewrite_regex(const char *p, size_t n, char **out, const char *what,
                               kf_error *err) {
    char *b = NULL;
    size_t len = 0, cap = 0;
    bool in_class = false, ok = true;
    size_t class_start = 0; /* offset in p just after '[' or '[^' */
    for (size_t i = 0; i < n && ok; i++) {
        char c = p[i];
        if (c == '\\' && i + 1 < n) {
            char e = p[i + 1];
            if (e == 's') {
                ok = in_class ? sb_add(&b, &len, &cap, kf_ws_class, sizeof kf_ws_class - 1)
                              : (sb_add(&b, &len, &cap, "[", 1) &&
                                 sb_add(&b, &len, &cap, kf_ws_class, sizeof kf_ws_class - 1) &&
                                 sb_add(&b, &len, &cap, "]", 1));
            } else if (e == 'S') {
                if (in_class) {
                    free(b);
                    return kf_fail(err, KF_ERR_UNSUPPORTED,
                                   "%s: \\S inside a character class is not supported", what);
                }
                ok = sb_add(&b, &len, &cap, "[^", 2) &&
                     sb_add(&b, &len, &cap, kf_ws_class, sizeof kf_ws_class - 1) &&
                     sb_add(&b, &len, &cap, "]", 1);
            } else if (e == 'Q') {
                free(b);
                return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: \\Q...\\E quoting is not supported",
                               what);
            } else {
                ok = sb_add(&b, &len, &cap, p + i, 2);
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            ok = sb_add(&b, &len, &cap, p + i, 1);
            if (i + 1 < n && p[i + 1] == '^') {
                ok = ok && sb_add(&b, &len, &cap, "^", 1);
                i++;
            }
            class_start = i + 1;
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && p[i + 1] == ':') {
            const char *end = NULL;
            for (size_t j = i + 2; j + 1 < n; j++) {
                if (p[j] == ':' && p[j + 1] == ']') {
                    end = p + j + 2;
                    break;
                }
            }
            if (end) {
                ok = sb_add(&b, &len, &cap, p + i, (size_t)(end - (p + i)));
                i = (size_t)(end - p) - 1;
                continue;
            }
        }
        if (in_class && c == ']' && i != class_start)
            in_class = false;
        ok = sb_add(&b, &len, &cap, p + i, 1);
    }
    if (!ok || !b) {
        free(b);
        if (!ok)
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        b = strdup("");
        if (!b)
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
    }
    *out = b;
    return KF_OK;
}

kf_status kf_regex_compile(const char *pattern, size_t len, bool literal, pcre2_code **out,
                           const char *what, kf_error *err) {
    char *rx = NULL;
    if (literal) {
        rx = malloc(len + 1);
        if (!rx)
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        memcpy(rx, pattern, len);
        rx[len] = 0;
    } else {
        KF_TRY(rewrite_regex(pattern, len, &rx, what, err));
    }
    int code;
    PCRE2_SIZE at;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)rx, literal ? len : PCRE2_ZERO_TERMINATED, opts,
                                   &code, &at, NULL);
    free(rx);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: PCRE2 cannot compile the pattern: %s (at %zu)",
                       what, (const char *)msg, (size_t)at);
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter */
    *out = re;
    return KF_OK;
}

/* ---- pieces ---------------------------------------------------------------------------------- */

void kf_pieces_free(kf_pieces *p) {
    free(p->buf);
    free(p->pieces);
    free(p->tmp);
    memset(p, 0, sizeof *p);
}

static bool tmp_push(kf_pieces *p, size_t off, size_t len) {
    if (p->tmp_n == p->tmp_cap) {
        size_t cap = p->tmp_cap ? p->tmp_cap * 2 : 256;
        kf_piece *t = realloc(p->tmp, cap * sizeof *t);
        if (!t)
            return false;
        p->tmp = t;
        p->tmp_cap = cap;
    }
    p->tmp[p->tmp_n++] = (kf_piece){off, len};
    return true;
}

static bool buf_reserve(kf_pieces *p, size_t extra) {
    if (p->buf_len + extra <= p->buf_cap)
        return true;
    size_t cap = p->buf_cap ? p->buf_cap : 4096;
    while (cap < p->buf_len + extra)
        cap *= 2;
    char *b = realloc(p->buf, cap);
    if (!b)
        return false;
    p->buf = b;
    p->buf_cap = cap;
    return true;
}

static void swap_tmp(kf_pieces *p) {
    kf_piece *t = p->pieces;
    size_t c = p->cap;
    p->pieces = p->tmp;
    p->cap = p->tmp_cap;
    p->n = p->tmp_n;
    p->tmp = t;
    p->tmp_cap = c;
    p->tmp_n = 0;
}

static size_t utf8_char_len(unsigned char c) {
    return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

/* Splits every piece by re, keeping both matches and the text between them (Isolated). */
static kf_status split_isolated(kf_pretokenizer *pt, pcre2_code *re, kf_pieces *p, kf_error *err) {
    p->tmp_n = 0;
    for (size_t k = 0; k < p->n; k++) {
        size_t off = p->pieces[k].off, len = p->pieces[k].len;
        PCRE2_SPTR subj = (PCRE2_SPTR)(p->buf + off);
        size_t prev = 0, at = 0;
        while (at < len) {
            int rc = pcre2_match(re, subj, len, at, PCRE2_NO_UTF_CHECK, pt->md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH)
                break;
            if (rc < 0) {
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(rc, msg, sizeof msg);
                return kf_fail(err, KF_ERR_INVALID, "tokenizer: regex match failed: %s",
                               (const char *)msg);
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(pt->md);
            size_t ms = ov[0], me = ov[1];
            if (me == ms) { /* empty match: no piece, step one character */
                at = ms + utf8_char_len(subj[ms]);
                continue;
            }
            if (ms > prev && !tmp_push(p, off + prev, ms - prev))
                return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
            if (!tmp_push(p, off + ms, me - ms))
                return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
            prev = at = me;
        }
        if (prev < len && !tmp_push(p, off + prev, len - prev))
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
    }
    swap_tmp(p);
    return KF_OK;
}

static kf_status prefix_space(kf_pieces *p, kf_error *err) {
    for (size_t k = 0; k < p->n; k++) {
        kf_piece *pc = &p->pieces[k];
        if (pc->len > 0 && p->buf[pc->off] == ' ')
            continue;
        if (!buf_reserve(p, pc->len + 1))
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        size_t off = p->buf_len;
        p->buf[off] = ' ';
        memcpy(p->buf + off + 1, p->buf + pc->off, pc->len);
        p->buf_len += pc->len + 1;
        pc->off = off;
        pc->len += 1;
    }
    return KF_OK;
}

kf_status kf_pretokenize(kf_pretokenizer *pt, const char *text, size_t len, kf_pieces *p,
                         kf_error *err) {
    p->buf_len = 0;
    p->n = 0;
    p->tmp_n = 0;
    if (!buf_reserve(p, len + 1) || !tmp_push(p, 0, len))
        return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
    memcpy(p->buf, text, len);
    p->buf_len = len;
    swap_tmp(p);
    for (size_t s = 0; s < pt->n; s++) {
        kf_pre_step *st = &pt->steps[s];
        if (st->kind == KF_PRE_BYTELEVEL && st->add_prefix_space)
            KF_TRY(prefix_space(p, err));
        if (st->re)
            KF_TRY(split_isolated(pt, st->re, p, err));
    }
    return KF_OK;
}

void kf_pretokenizer_free(kf_pretokenizer *pt) {
    for (size_t s = 0; s < pt->n; s++)
        pcre2_code_free(pt->steps[s].re);
    free(pt->steps);
    pcre2_match_data_free(pt->md);
    memset(pt, 0, sizeof *pt);
}
