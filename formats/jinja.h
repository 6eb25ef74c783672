/* jinja.h — the subset of Jinja that chat templates use, rendered exactly as Hugging Face renders
 * them: jinja2's ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
 * loopcontrols extension, a `raise_exception` global and `tojson` as json.dumps(ensure_ascii=False).
 *
 * Whatever is outside the subset is refused with the template's line and column (KF_ERR_UNSUPPORTED),
 * never rendered differently. The subset:
 *
 *   source      newlines \r\n and \r read as \n; one trailing newline dropped (jinja2's defaults)
 *   data        text; {# comments #}; whitespace control {%- -%} {{- -}} {#- -#}, {%+ +%};
 *               trim_blocks (a newline after %} or #} dropped) and lstrip_blocks (white space
 *               before {% or {# at the start of a line dropped)
 *   statements  {{ expr }}
 *               {% if expr %} ... {% elif expr %} ... {% else %} ... {% endif %}
 *               {% for name[, name...] in expr [if expr] %} ... [{% else %} ...] {% endfor %}
 *                                         (the else runs when no iteration ran its body to the end,
 *                                          as jinja2 compiles it with break and continue)
 *               {% break %} {% continue %}          (inside for)
 *               {% set name[, name...] = expr[, expr...] %}   {% set ns.attr = expr %}
 *               {% set name %} ... {% endset %}
 *               {% generation %} ... {% endgeneration %}     (rendered as its body)
 *   expressions literals 'str' "str" (Python escapes, adjacent ones joined), 12, 1.5, 1e3, true,
 *               false, none (and True/False/None), [list], (tuple,), {'key': value}
 *               names, x.attr, x.0, x[key], x[start:stop:step], calls f(a, k=v)
 *               a if cond else b; or, and, not; == != < <= > >= (chained), in, not in;
 *               + - * / // % ** ~, unary - and +; x | filter(args); x is [not] test(args)
 *   globals     range, namespace, dict, raise_exception (the context's names shadow them)
 *   loop        loop.index loop.index0 loop.revindex loop.revindex0 loop.first loop.last
 *               loop.length loop.depth loop.depth0 loop.previtem loop.nextitem loop.cycle(...)
 *   str methods startswith endswith (a str or a tuple) split([sep[, maxsplit]]) strip lstrip
 *               rstrip ([chars]) replace(old, new[, count]) upper lower (ASCII text) join
 *   dict methods items() keys() values() get(key[, default])
 *   filters     tojson(ensure_ascii, indent, separators, sort_keys) trim length count string
 *               default/d first last join upper lower list reverse items replace abs
 *   tests       defined undefined none boolean true false integer float number string mapping
 *               iterable sequence callable odd even divisibleby eq ne lt le gt ge in (and their
 *               aliases == != < <= > >= equalto lessthan greaterthan) lower upper
 *   values      the JSON context: objects, arrays, strings, integers (64-bit), reals, booleans,
 *               null (None); printing prints str() of strings, numbers, booleans and None
 *               (Undefined prints nothing); printing a list, dict or function is refused.
 *               dict.items()/keys()/values() are views (len, in, iteration; no index) and the
 *               reverse and items filters give iterators (true, iterated once), as in Python.
 *               A slice Python cannot take (a non-sequence, non-integer bounds) is refused:
 *               jinja2 raises there, or gives Undefined where its optimizer folded constants.
 *
 * Undefined behaves as jinja2's default Undefined: a missing name, attribute or index gives it;
 * it is false, iterates empty, has length 0, concatenates (~) as ''; arithmetic, attributes,
 * items and calls on it fail. Python errors (TypeError, ZeroDivisionError, an integer that would
 * need more than 64 bits) fail the render with the position: jinja2 raises there too.
 *
 * Bounds (a template is untrusted input): nesting depth 64 in the parser, and per render a budget
 * of evaluation steps, of arena memory and of output bytes (kf_jinja_limits).
 */
#ifndef KF_JINJA_H
#define KF_JINJA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/base/error.h"

typedef struct kf_jinja kf_jinja;

typedef struct {
    int64_t max_steps;  /* expressions and statements evaluated (default 20,000,000) */
    size_t max_memory;  /* bytes of values held by one render (default 512 MiB) */
    size_t max_output;  /* bytes rendered (default 64 MiB) */
} kf_jinja_limits;

/* Parses a template (UTF-8). Refusals name "line L, column C" of the template. */
kf_status kf_jinja_parse(const char *src, size_t len, kf_jinja **out, kf_error *err);
void kf_jinja_free(kf_jinja *t);

/* Renders with the context `json` (a JSON object: its members are the template's variables).
 * On success *out is a malloc'ed UTF-8 string (NUL-terminated, *out_len bytes; the caller frees
 * it). raise_exception(msg) fails with KF_ERR_INVALID and the message. limits may be NULL. */
kf_status kf_jinja_render(const kf_jinja *t, const char *json, size_t json_len, const kf_jinja_limits *limits,
                          char **out, size_t *out_len, kf_error *err);

#endif
