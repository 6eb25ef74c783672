#!/usr/bin/env python3
"""Compares kvfold's next-token logits ('kvfold logits --format json --top K') with llama.cpp's
log-probabilities ('llamacpp.mjs logits') after the same token ids.

  compare-logits.py KVFOLD.json LLAMACPP.json [--tol T]

Logits are compared up to a constant (softmax does not see one): for each of kvfold's K tokens,
logit - logit(kvfold's top token) against log p - log p(that token). Prints the largest absolute
difference and whether the top tokens agree; exits 1 when the difference exceeds --tol or the
top tokens differ, 2 on unreadable input.
"""
import argparse
import json
import sys


def load(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"compare-logits.py: {path}: cannot read {what} ({e})", file=sys.stderr)
        sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kvfold")
    ap.add_argument("llamacpp")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest allowed difference (default 1e-4)")
    a = ap.parse_args()
    kv = load(a.kvfold, "kvfold logits JSON")
    ll = load(a.llamacpp, "llama.cpp log-probabilities JSON")
    top = kv.get("top") or []
    logp = {int(k): v for k, v in (ll.get("logp") or {}).items()}
    if not top or not logp or kv.get("n_tokens") != ll.get("n_tokens"):
        print(f"compare-logits.py: {a.kvfold} / {a.llamacpp}: empty, or not after the same number of tokens",
              file=sys.stderr)
        return 2
    ref = top[0]["id"]
    if ref not in logp:
        print(f"compare-logits.py: {a.llamacpp}: no probability for token {ref}", file=sys.stderr)
        return 1
    worst = max(abs((t["logit"] - top[0]["logit"]) - (logp.get(t["id"], float("-inf")) - logp[ref])) for t in top)
    ll_top = max(logp, key=logp.get)
    same = ll_top == ref
    print(f"max |d logit| {worst:.3g} over {len(top)} tokens; top token kvfold {ref}, llama.cpp {ll_top}")
    return 0 if worst <= a.tol and same else 1


if __name__ == "__main__":
    sys.exit(main())
