/* escape.h — names and strings from outside (document ids, paths, file attributes) made safe to
 * print on a terminal or in a log line.
 *
 * kf_escape() copies s, replacing what could act on a terminal or forge a line of output:
 *   - C0 control bytes and DEL: \n, \r, \t, or \xNN (ESC is \x1b)
 *   - a backslash: \\ (so every escape reads back unambiguously)
 *   - bytes that are not valid UTF-8 (stray continuation bytes, overlong forms, surrogates,
 *     truncated sequences, beyond U+10FFFF): \xNN per byte
 *   - C1 controls (U+0080..U+009F), the bidirectional controls (U+061C, U+200E, U+200F,
 *     U+202A..U+202E, U+2066..U+2069) and the line and paragraph separators (U+2028, U+2029):
 *     \uNNNN
 * Everything else (printable ASCII, valid UTF-8) passes unchanged. One helper for every place
 * that prints such a string; library code only formats messages, the CLI escapes what it prints.
 */
#ifndef KF_ESCAPE_H
#define KF_ESCAPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The escaped copy of s in out [cap] (NUL-terminated; cap >= 8). Output that does not fit is cut
 * at an escape or character boundary and ends in "..."; returns out. s NULL prints as "". */
const char *kf_escape(const char *s, char *out, size_t cap);

/* Room for an escaped path or id: every byte may become 4 ("\xNN"). */
#define KF_ESC_MAX (4 * 4096 + 8)
/* An escaped copy in a buffer that lives until the end of the enclosing block:
 * printf("%s\n", KF_ESC(path)). */
#define KF_ESC(s) kf_escape((s), (char[KF_ESC_MAX]){0}, KF_ESC_MAX)

/* The length of the valid UTF-8 sequence at p (1..4) with its code point in *cp, or 0 when p does
 * not start one (a stray byte, an overlong form, a surrogate, a truncated sequence). */
int kf_utf8_next(const char *p, uint32_t *cp);
/* True for the code points kf_escape rewrites: C0, DEL, C1, bidirectional controls, U+2028/9. */
bool kf_cp_is_control(uint32_t cp);
/* True when s is valid UTF-8 holding no code point kf_cp_is_control refuses. */
bool kf_text_is_plain(const char *s);

#endif
