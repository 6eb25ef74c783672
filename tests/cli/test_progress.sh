#!/usr/bin/env bash
# The progress of kvfold compact and eval quality on stderr. Off a terminal (stderr to a file, every
# step with --progress-interval 0): each document's stage lines in order with their counts (the
# prefill's chunks in tokens, then per layer the repeat's tokens and the solve's KV heads), each
# with its time left, before the document's own line; --quiet prints none. On a terminal (script
# gives the command a pseudo-terminal): the same stages drawn in place ("\r\033[K"), no line wider
# than the terminal, the line cleared before the summary; --quiet draws nothing.
# The expected steps come from the documents' lengths, the chunk (64) and the model's shape
# (records-llama3-induct: 2 layers, 2 KV heads). Usage: test_progress.sh KVFOLD_BIN TEST_DATA_DIR
set -uo pipefail
kvfold=$1
data=$2
model=$data/records-llama3-induct
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

# Two documents cut to 150 and 90 tokens (3 and 2 chunks of 64), and two whole small ones for eval.
python3 - "$data/records-dev.jsonl" "$tmp" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
with open(sys.argv[2] + "/docs.jsonl", "w") as f:
    for r, n in ((rows[1], 150), (rows[2], 90)):
        f.write(json.dumps({"id": r["id"], "ids": r["ids"][:n],
                            "repeat_instruction_ids": r["repeat_instruction_ids"]}) + "\n")
small = sorted(rows, key=lambda r: len(r["ids"]))[:2]
with open(sys.argv[2] + "/eval.jsonl", "w") as f:
    for r in small:
        f.write(json.dumps(r) + "\n")
PY

# $tmp/expected.py KIND FILE: the stages each document must show, in order, one per line:
# "<doc> <step>" (<doc> the manifest line; steps as the progress prints them).
cat >"$tmp/expected.py" <<'PY'
import json, sys
kind, path = sys.argv[1], sys.argv[2]
L, heads, chunk = 2, 2, 64
for line, text in enumerate(open(path), 1):
    r = json.loads(text)
    n, S = len(r["ids"]), len(r["repeat_instruction_ids"]) + len(r["ids"])
    steps = ["reference", "compaction"] if kind == "eval" else []
    steps += [f"prefill {min(t, n)}/{n} tokens" for t in range(chunk, n + chunk, chunk)]
    for l in range(1, L + 1):
        steps += [f"repeat layer {l}/{L}, {S}/{S} tokens", f"solve layer {l}/{L}, {heads}/{heads} heads"]
    if kind == "eval":
        steps += ["measure full (1/2)", "measure fold 0.25 (2/2)"]
    for s in steps:
        print(f"{line} {s}")
PY

# $tmp/log.py KIND ERR: the stage lines of a log as "<doc> <step>", each document's in the order of the
# log, checking that each carries its place i/N, its time and (library steps) its time left, and
# that a document's lines come before its own line (compact: the file written; eval: the count).
cat >"$tmp/log.py" <<'PY'
import re, sys
kind, path = sys.argv[1], sys.argv[2]
tag = "[compact]" if kind == "compact" else "[eval]"
stage = re.compile(r"^\[(compact|eval)\] (\d+)/2 \S+:(\d+)(?: \(\S+\))?: (.*); (\S+?)(, ETA \S+)?( \(run ETA \S+\))?$")
done = re.compile(r"^\[compact\] (\d+)/2 \S+:(\d+) \(\S+\): \d+ -> \d+ tokens|^\[eval\] (\d+) documents, ")
out, bad, place, n_done = [], [], {}, 0
for raw in open(path):
    line = raw.rstrip("\n")
    m = stage.match(line)
    if m:
        i, doc, step, eta = int(m[2]), m[3], m[4], m[6]
        library = re.match(r"(prefill|repeat|solve) ", step)
        if (eta is None) == bool(library) or m[7] is None or i != n_done + 1:
            bad.append(line)
        out.append(f"{doc} {step}")
        continue
    m = done.match(line)
    if m:
        n_done = int(m[1] or m[3]) if kind == "eval" else int(m[1])
        continue
    if line.startswith(tag):
        bad.append(line)
for b in bad:
    print("BAD " + b)
print("\n".join(out))
PY

common=(--model "$model" --budget 0.25 --max-queries 500 --chunk 64)
"$kvfold" compact "${common[@]}" --out "$tmp/root" --manifest "$tmp/docs.jsonl" --progress-interval 0 \
    >"$tmp/c.out" 2>"$tmp/c.err"
check "compact (log): exit 0" test $? -eq 0
python3 "$tmp/expected.py" compact "$tmp/docs.jsonl" | sort -s -n -k1,1 >"$tmp/c.want"
python3 "$tmp/log.py" compact "$tmp/c.err" >"$tmp/c.got"
check "compact (log): every line well formed (place, time, ETA)" test "$(grep -c '^BAD' "$tmp/c.got")" -eq 0
grep -v '^BAD' "$tmp/c.got" | sort -s -n -k1,1 >"$tmp/c.got.sorted"
check "compact (log): each document's stages in order with their counts" diff "$tmp/c.want" "$tmp/c.got.sorted"
check "compact (log): stages of one document, then the next" \
    test "$(grep -v '^BAD' "$tmp/c.got" | cut -d' ' -f1 | uniq | wc -l)" -eq 2
check "compact (log): no terminal codes" test "$(grep -c $'\033' "$tmp/c.err")" -eq 0
grep -q "2 done" "$tmp/c.out"
check "compact (log): the summary" test $? -eq 0

"$kvfold" compact "${common[@]}" --out "$tmp/root-q" --manifest "$tmp/docs.jsonl" --progress-interval 0 -q \
    >"$tmp/q.out" 2>"$tmp/q.err"
check "compact --quiet: exit 0" test $? -eq 0
check "compact --quiet: nothing on stderr" test ! -s "$tmp/q.err"
check "compact --quiet: the summary" grep -q "2 done" "$tmp/q.out"

"$kvfold" eval quality --model "$model" --docs "$tmp/eval.jsonl" --method full,fold --budget 0.25 --max-queries 500 \
    --chunk 64 --progress-interval 0 >"$tmp/e.out" 2>"$tmp/e.err"
check "eval (log): exit 0" test $? -eq 0
python3 "$tmp/expected.py" eval "$tmp/eval.jsonl" >"$tmp/e.want"
python3 "$tmp/log.py" eval "$tmp/e.err" >"$tmp/e.got"
check "eval (log): every line well formed" test "$(grep -c '^BAD' "$tmp/e.got")" -eq 0
check "eval (log): each document's stages in order with their counts" diff "$tmp/e.want" <(grep -v '^BAD' "$tmp/e.got")
"$kvfold" eval quality --model "$model" --docs "$tmp/eval.jsonl" --method full,fold --budget 0.25 --max-queries 500 \
    --chunk 64 --progress-interval 0 --quiet >"$tmp/eq.out" 2>"$tmp/eq.err"
check "eval --quiet: exit 0" test $? -eq 0
check "eval --quiet: nothing on stderr" test ! -s "$tmp/eq.err"
check "eval --quiet: the same table" diff <(head -3 "$tmp/e.out") <(head -3 "$tmp/eq.out")

# ---- on a terminal: script runs the command on a pseudo-terminal (stdout and stderr both on it) ----
# $tmp/frames.py KIND FILE MANIFEST: the lines drawn in place ("\r\033[K" then the text) at each step's end
# and for each of the command's own stages, as "<doc> <step>" with the doc's manifest line; checks
# the width and that the line is cleared before the summary.
cat >"$tmp/frames.py" <<'PY'
import re, sys
kind, path, manifest = sys.argv[1], sys.argv[2], sys.argv[3]
import json
names = {json.loads(t).get("id", ""): i for i, t in enumerate(open(manifest), 1)}
raw = open(path, "rb").read().decode()
parts = raw.split("\r\033[K")
frames, bad = parts[1:], []
summary = "compact: 2 documents" if kind == "compact" else "method budget"
if not any(p.startswith(summary) for p in frames):
    bad.append("the summary does not follow a cleared line")
out = []
for f in frames:
    if f.startswith(summary) or f == "":
        continue
    if len(f) > 79 or "\n" in f:
        bad.append("frame " + repr(f))
    m = re.match(r"(\d+)/2 (\S+): (.*?)(, ETA \S+)? \| run ETA \S+$", f)
    if not m:
        bad.append("frame " + repr(f))
        continue
    doc, step = names.get(m[2], m[2].rsplit(":", 1)[-1]), m[3]
    within = re.match(r"(repeat|solve) layer \d+/\d+, (\d+)/(\d+) ", step)
    if step != "starting" and not (within and within[2] != within[3]): # redraws within a step aside
        out.append(f"{doc} {step}")
for b in bad:
    print("BAD " + b)
print("\n".join(out))
PY
q() { printf '%q ' "$@"; }
script -qefc "$(q "$kvfold" compact "${common[@]}" --out "$tmp/root-t" --manifest "$tmp/docs.jsonl")" /dev/null \
    </dev/null >"$tmp/t.raw" 2>&1
check "compact (terminal): exit 0" test $? -eq 0
python3 "$tmp/frames.py" compact "$tmp/t.raw" "$tmp/docs.jsonl" >"$tmp/t.got"
check "compact (terminal): frames fit, line cleared before the summary" test "$(grep -c '^BAD' "$tmp/t.got")" -eq 0
grep '^BAD' "$tmp/t.got" | head -3
grep -v '^BAD' "$tmp/t.got" | sort -s -n -k1,1 >"$tmp/t.steps"
check "compact (terminal): each step drawn in place, in order" diff "$tmp/c.want" "$tmp/t.steps"
check "compact (terminal): no log lines" test "$(grep -c '^\[compact\]' "$tmp/t.raw")" -eq 0
script -qefc "$(q "$kvfold" compact "${common[@]}" --out "$tmp/root-tq" --manifest "$tmp/docs.jsonl" -q)" /dev/null \
    </dev/null >"$tmp/tq.raw" 2>&1
check "compact --quiet (terminal): exit 0" test $? -eq 0
check "compact --quiet (terminal): nothing drawn" test "$(grep -c $'\033' "$tmp/tq.raw")" -eq 0
script -qefc "$(q "$kvfold" eval quality --model "$model" --docs "$tmp/eval.jsonl" --method full,fold --budget 0.25 \
    --max-queries 500 --chunk 64)" /dev/null </dev/null >"$tmp/te.raw" 2>&1
check "eval (terminal): exit 0" test $? -eq 0
python3 "$tmp/frames.py" eval "$tmp/te.raw" "$tmp/eval.jsonl" >"$tmp/te.got"
check "eval (terminal): frames fit, line cleared before the table" test "$(grep -c '^BAD' "$tmp/te.got")" -eq 0
grep '^BAD' "$tmp/te.got" | head -3
check "eval (terminal): every stage drawn in place, in order" diff "$tmp/e.want" <(grep -v '^BAD' "$tmp/te.got")

finish
