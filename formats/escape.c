/* escape.c — kf_escape and the UTF-8 checks behind it (see escape.h). */
#include "formats/escape.h"

#include <stdio.h>
#include <string.h>

int kf_utf8_next(const char *s, uint32_t *cp) {
    const unsigned char *p = (const unsigned char *)s;
    const unsigned c = p[0];
    const int n = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2 : (c & 0xf8) == 0xf0 ? 3 : -1;
    if (n < 0)
        return 0;
    uint32_t v = n == 0 ? c : n == 1 ? c & 0x1f : n == 2 ? c & 0x0f : c & 0x07;
    for (int i = 1; i <= n; i++) { /* a NUL ends the string: it is no continuation byte */
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        v = v << 6 | (p[i] & 0x3f);
    }
    /* overlong forms, surrogates, beyond U+10FFFF */
    if ((n == 1 && v < 0x80) || (n == 2 && v < 0x800) || (n == 3 && v < 0x10000) || v > 0x10ffff ||
        (v >= 0xd800 && v <= 0xdfff))
        return 0;
    *cp = v;
    return n + 1;
}

bool kf_cp_is_control(uint32_t cp) {
    return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f) || cp == 0x061c || cp == 0x200e || cp == 0x200f ||
           (cp >= 0x2028 && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

bool kf_text_is_plain(const char *s) {
    while (*s) {
        uint32_t cp;
        const int n = kf_utf8_next(s, &cp);
        if (n == 0 || kf_cp_is_control(cp))
            return false;
        s += n;
    }
    return true;
}

/* The escape of one character (n bytes at s, code point cp; n = 0: the invalid byte *s) into e. */
static void escape_one(const char *s, int n, uint32_t cp, char e[16]) {
    if (n == 0)
        snprintf(e, 16, "\\x%02x", (unsigned char)*s);
    else if (cp == '\\')
        snprintf(e, 16, "\\\\");
    else if (cp == '\n' || cp == '\r' || cp == '\t')
        snprintf(e, 16, "\\%c", cp == '\n' ? 'n' : cp == '\r' ? 'r' : 't');
    else if (cp < 0x80 && kf_cp_is_control(cp))
        snprintf(e, 16, "\\x%02x", (unsigned)cp);
    else if (kf_cp_is_control(cp))
        snprintf(e, 16, "\\u%04x", (unsigned)cp);
    else {
        memcpy(e, s, (size_t)n);
        e[n] = 0;
    }
}

const char *kf_escape(const char *s, char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    for (; s && *s;) {
        uint32_t cp = 0;
        const int n = kf_utf8_next(s, &cp);
        char e[16];
        escape_one(s, n, cp, e);
        const size_t el = strlen(e);
        if (len + el + 4 > cap) { /* room for "..." and the NUL */
            memcpy(out + len, "...", 4);
            return out;
        }
        memcpy(out + len, e, el + 1);
        len += el;
        s += n ? n : 1;
    }
    return out;
}
