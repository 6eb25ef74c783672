#!/usr/bin/env bash
# Agreement of answers from compacted caches with full-context answers on a records manifest:
# compacts every document (kvfold compact), then asks each document's questions from its cache
# and from the full document (kvfold ask --compare) and counts equal greedy answers (up to the
# first newline). Also reports how often each matches the gold answer.
#   tools/ask-agreement.sh [MANIFEST] [BUDGET] [METHOD]   (defaults: records-dev.jsonl 0.25 fold)
# Env: KVFOLD_BIN (default build/kvfold), KVFOLD_MODEL (default tests/data/records-qwen3).
set -euo pipefail
cd "$(dirname "$0")/.."
kvfold=${KVFOLD_BIN:-build/kvfold}
model=${KVFOLD_MODEL:-tests/data/records-qwen3}
manifest=${1:-tests/data/records-dev.jsonl}
budget=${2:-0.25}
method=${3:-fold}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# a fresh root, so every document gets a "done" line naming its file
"$kvfold" compact --model "$model" --manifest "$manifest" --budget "$budget" --method "$method" \
    --out "$tmp/root" 2>"$tmp/log"
python3 - "$kvfold" "$model" "$manifest" "$tmp" <<'PY'
import json, re, subprocess, sys
kvfold, model, manifest, tmp = sys.argv[1:]
paths = {}
for line in open(tmp + "/log"):
    m = re.match(r"\[compact\] \d+/\d+ (.*):(\d+)(?: \(.*\))?: .* -> (\S+\.kvf)$", line.strip())
    if m:
        paths[int(m.group(2))] = m.group(3)
agree = n = gold_cache = gold_full = 0
for lineno, line in enumerate(open(manifest), 1):
    if not line.strip() or lineno not in paths:
        continue
    doc = json.loads(line)
    docfile = f"{tmp}/doc{lineno}.json"
    json.dump({"ids": doc["ids"]}, open(docfile, "w"))
    qs = [q["question"] for q in doc["questions"]]
    out = subprocess.run([kvfold, "ask", paths[lineno], "--model", model, "--doc", docfile, "--compare",
                          "--format", "json", "-q", "--stop", "\n", "--max-tokens", "8", *qs],
                         capture_output=True, text=True, check=True).stdout
    for q, r in zip(doc["questions"], map(json.loads, out.splitlines())):
        n += 1
        agree += r["agree"]
        gold_cache += r["answer_ids"] == q["answer_ids"]
        gold_full += r["full_answer_ids"] == q["answer_ids"]
    print(f"{doc.get('id', lineno)}: {len(doc['ids'])} tokens, {agree}/{n} agreeing so far", file=sys.stderr)
print(f"agreement: {agree}/{n} ({100.0 * agree / max(n, 1):.1f}%) cache answers equal the full context's")
print(f"gold answers: cache {gold_cache}/{n}, full context {gold_full}/{n}")
PY
