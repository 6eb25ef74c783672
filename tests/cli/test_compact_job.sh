#!/usr/bin/env bash
# kvfold compact / ask / verify from the command line: bad input, --shard, two concurrent workers,
# text files and a round trip to an answer. Usage: test_compact_job.sh KVFOLD_BIN TEST_DATA_DIR
set -uo pipefail
kvfold=$1
data=$2
model=$data/records-qwen3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

# Six small records documents (ids), named by id.
python3 - "$data/records-dev.jsonl" "$tmp/docs.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
small = [r for r in rows if len(r["ids"]) < 500][:6]
with open(sys.argv[2], "w") as f:
    for r in small:
        f.write(json.dumps({"id": r["id"], "ids": r["ids"][:160],
                            "repeat_instruction_ids": r["repeat_instruction_ids"]}) + "\n")
PY
common=(--model "$model" --budget 0.25 --max-queries 500)

# ---- bad input: each reported with its file and line, the good documents still done ----
{
    sed -n 1p "$tmp/docs.jsonl"
    echo 'this is not json'
    echo '{"id": "empty", "ids": []}'
    echo '{"id": "badid", "ids": [1, 2, 999999]}'
    python3 -c 'import json; print(json.dumps({"id": "long", "ids": [45] * 5000}))'
    echo '{"id": "noids"}'
    sed -n 2p "$tmp/docs.jsonl"
} >"$tmp/bad.jsonl"
"$kvfold" compact "${common[@]}" --out "$tmp/bad-root" --manifest "$tmp/bad.jsonl" >"$tmp/bad.out" 2>"$tmp/bad.err"
rc=$?
check "bad manifest: exit status 1" test $rc -eq 1
check "bad manifest: not JSON at line 2" has "$tmp/bad.err" "bad.jsonl:2: not JSON"
check "bad manifest: empty document at line 3" has "$tmp/bad.err" "bad.jsonl:3 (empty): empty document"
check "bad manifest: invalid id at line 4" has "$tmp/bad.err" "bad.jsonl:4 (badid): \"ids\": token id 999999 at position 2 is outside the vocabulary"
check "bad manifest: too long at line 5" has "$tmp/bad.err" "bad.jsonl:5 (long): 5000 tokens: too long for the model"
check "bad manifest: no ids at line 6" has "$tmp/bad.err" "bad.jsonl:6 (noids): needs \"ids\""
check "bad manifest: the two good documents done" has "$tmp/bad.out" "7 documents (shard 0/1): 2 done, 0 skipped (valid file exists), 0 busy (another worker), 5 failed"
check "bad manifest: two files" test "$(find "$tmp/bad-root" -name '*.kvf' | wc -l)" -eq 2

"$kvfold" compact "${common[@]}" --out "$tmp/r" "$tmp/missing.txt" >/dev/null 2>"$tmp/miss.err"
check "missing text file: exit 1 and named" test $? -eq 1
check "missing text file: message" has "$tmp/miss.err" "missing.txt: cannot open: No such file or directory"
"$kvfold" compact "${common[@]}" --out "$tmp/r" --manifest "$tmp/nothere.jsonl" >"$tmp/miss2.out" 2>"$tmp/miss2.err"
check "missing manifest: usage error (exit 2)" test $? -eq 2
check "missing manifest: message" has "$tmp/miss2.err" "--manifest $tmp/nothere.jsonl: cannot read: No such file or directory"
check "missing manifest: no summary" test ! -s "$tmp/miss2.out"
"$kvfold" compact "${common[@]}" --out "$tmp/r" --manifest "$tmp" >"$tmp/dirm.out" 2>"$tmp/dirm.err"
check "manifest is a directory: usage error (exit 2)" test $? -eq 2
check "manifest is a directory: message" has "$tmp/dirm.err" "--manifest $tmp: cannot read: Is a directory"

# ---- --probes-from that cannot be read or parsed: a usage error, nothing compacted ----
probe_case() { # probe_case NAME FILE EXPECTED-MESSAGE
    "$kvfold" compact "${common[@]}" --out "$tmp/probes-$1" --probes-from "$2" --manifest "$tmp/docs.jsonl" \
        >"$tmp/probes-$1.out" 2>"$tmp/probes-$1.err"
    check "--probes-from $1: exit 2" test $? -eq 2
    check "--probes-from $1: message" has "$tmp/probes-$1.err" "$3"
    check "--probes-from $1: nothing compacted" test -z "$(find "$tmp/probes-$1" -name '*.kvf' 2>/dev/null)"
    check "--probes-from $1: no summary" test ! -s "$tmp/probes-$1.out"
}
probe_case missing "$tmp/no-probes.jsonl" "--probes-from $tmp/no-probes.jsonl: cannot read: No such file or directory"
probe_case directory "$tmp" "--probes-from $tmp: cannot read: Is a directory"
printf '"Q: sila?"\n[1, 2, 3]\nnot json\n' >"$tmp/bad-probes.jsonl"
probe_case unparsable "$tmp/bad-probes.jsonl" "bad-probes.jsonl:3: not JSON"
printf '"Q: sila?"\n[1, 2, 3]\n' >"$tmp/good-probes.jsonl"
"$kvfold" compact "${common[@]}" -q --out "$tmp/probes-good" --probes-from "$tmp/good-probes.jsonl" --manifest "$tmp/docs.jsonl" \
    --shard 0/3 >"$tmp/probes-good.out" 2>&1
check "--probes-from a good file: exit 0, two documents done" bash -c "[ $? -eq 0 ] && grep -q ': 2 done' '$tmp/probes-good.out'"
"$kvfold" compact --model "$tmp/no-model" --out "$tmp/r" --manifest "$tmp/docs.jsonl" >/dev/null 2>"$tmp/model.err"
check "unreadable model directory: exit 1" test $? -eq 1
check "unreadable model directory: message names it" has "$tmp/model.err" "$tmp/no-model"
touch "$tmp/plainfile"
"$kvfold" compact "${common[@]}" --out "$tmp/plainfile/root" --manifest "$tmp/docs.jsonl" >"$tmp/root.out" 2>"$tmp/root.err"
check "root not writable: exit 1" test $? -eq 1
check "root not writable: message before any work" has "$tmp/root.err" "cannot create the output root $tmp/plainfile/root: Not a directory"
check "root not writable: no summary" test ! -s "$tmp/root.out"
"$kvfold" compact --model "$model" --manifest "$tmp/docs.jsonl" --shard 3/3 >/dev/null 2>&1
check "--shard 3/3 is a usage error" test $? -eq 2
"$kvfold" compact "${common[@]}" --out "$tmp/noinstr" --repeat-instruction '' --manifest "$tmp/docs.jsonl" >/dev/null 2>"$tmp/noinstr.err"
check "an empty --repeat-instruction is a usage error" test $? -eq 2
check "an empty --repeat-instruction: message, nothing compacted" bash -c "grep -q -- '--repeat-instruction must not be empty' '$tmp/noinstr.err' && [ -z \"\$(find '$tmp/noinstr' -name '*.kvf')\" ]"

# ---- --shard i/N: deterministic, the shards cover the manifest exactly once ----
for i in 0 1 2; do
    "$kvfold" compact "${common[@]}" -q --out "$tmp/shards" --manifest "$tmp/docs.jsonl" --shard $i/3 >"$tmp/shard$i.out" 2>&1
done
for r in again again2; do
    "$kvfold" compact "${common[@]}" -q --out "$tmp/$r" --manifest "$tmp/docs.jsonl" --shard 1/3 >/dev/null 2>&1
done
"$kvfold" compact "${common[@]}" -q --out "$tmp/whole" --manifest "$tmp/docs.jsonl" >"$tmp/whole.out" 2>&1
names() { (cd "$1" && find . -name '*.kvf' | sort); }
check "shards: 2 documents each" test "$(cat "$tmp"/shard?.out | grep -c ': 2 done, 0 skipped')" -eq 3
check "shards: union == the whole manifest" test "$(names "$tmp/shards")" = "$(names "$tmp/whole")"
check "shards: six distinct files" test "$(names "$tmp/shards" | wc -l)" -eq 6
check "shards: shard 1/3 twice gives the same documents" test "$(names "$tmp/again")" = "$(names "$tmp/again2")"
check "shards: shard 1/3's files are in the union" test -z "$(comm -23 <(names "$tmp/again") <(names "$tmp/shards"))"
"$kvfold" compact "${common[@]}" -q --out "$tmp/whole" --manifest "$tmp/docs.jsonl" >"$tmp/rerun.out" 2>&1
check "rerun: everything skipped" has "$tmp/rerun.out" "6 documents (shard 0/1): 0 done, 6 skipped"

# ---- killed writers' temporary files: removed at the start of a job once an hour old ----
fpdir=$(dirname "$(find "$tmp/whole" -name '*.kvf' | head -1)")
old=$fpdir/0123.fold-0.25.kvf.tmp-4242-0123456789abcdef
live=$fpdir/4567.fold-0.25.kvf.tmp-4243-0123456789abcdef
notemp=$fpdir/89ab.fold-0.25.kvf.tmpx
touch "$old" "$live" "$notemp"
touch -d '65 minutes ago' "$old" "$notemp"
touch -d '50 minutes ago' "$live"
"$kvfold" compact "${common[@]}" --out "$tmp/whole" --manifest "$tmp/docs.jsonl" >"$tmp/stale.out" 2>"$tmp/stale.err"
check "stale temporary file: exit 0, everything skipped" bash -c "[ $? -eq 0 ] && grep -q '0 done, 6 skipped' '$tmp/stale.out'"
check "stale temporary file (65 min): removed" test ! -e "$old"
check "stale temporary file: removal reported" has "$tmp/stale.err" "temporary file (1.1 h old): $old"
check "a writer's temporary file of 50 min: kept" test -e "$live"
check "a file that is not a temporary name: kept" test -e "$notemp"
rm -f "$live" "$notemp"

# ---- a full disk (a file size limit: EFBIG as from a full disk; kvfold ignores SIGXFSZ) ----
( ulimit -f 32; exec "$kvfold" compact "${common[@]}" --out "$tmp/full" --manifest "$tmp/docs.jsonl" >"$tmp/full.out" 2>"$tmp/full.err" )
rc=$?
check "full disk: exit status 1 (was a segfault, 139)" test $rc -eq 1
check "full disk: the summary" has "$tmp/full.out" "6 documents (shard 0/1): 0 done, 0 skipped (valid file exists), 0 busy (another worker), 6 failed"
check "full disk: each failure names its file and the cause" test "$(grep -c '\.kvf: cannot write .*: File too large$' "$tmp/full.err")" -eq 6
check "full disk: no file left (no partial, temporary or lock file)" test -z "$(find "$tmp/full" -type f ! -name '.kvfold-fingerprint')"
"$kvfold" compact "${common[@]}" -q --out "$tmp/full" --manifest "$tmp/docs.jsonl" >"$tmp/full2.out" 2>&1
check "full disk: the rerun with space does the work" has "$tmp/full2.out" "6 done, 0 skipped"
check "full disk: the rerun's files are the same names" test "$(names "$tmp/full")" = "$(names "$tmp/whole")"

# ---- two workers on the same manifest and root at once ----
root=$tmp/shared
mkdir -p "$root"
"$kvfold" compact "${common[@]}" -q --out "$root" --manifest "$tmp/docs.jsonl" >"$tmp/w1.out" 2>&1 &
p1=$!
"$kvfold" compact "${common[@]}" -q --out "$root" --manifest "$tmp/docs.jsonl" >"$tmp/w2.out" 2>&1 &
p2=$!
: >"$tmp/seen"
bad=0
while kill -0 $p1 2>/dev/null || kill -0 $p2 2>/dev/null; do
    for f in $(find "$root" -name '*.kvf' 2>/dev/null); do
        ino=$(stat -c %i "$f" 2>/dev/null) || continue
        if ! grep -q " $f\$" "$tmp/seen"; then
            # first sight: it must open (a partial file would not) and keep its inode from now on
            "$kvfold" inspect "$f" >/dev/null 2>&1 || { echo "partial or broken: $f"; bad=$((bad + 1)); }
            echo "$ino $f" >>"$tmp/seen"
        elif ! grep -q "^$ino $f\$" "$tmp/seen"; then
            echo "rewritten: $f"
            bad=$((bad + 1))
        fi
    done
    sleep 0.05
done
wait $p1
r1=$?
wait $p2
r2=$?
done1=$(sed -n 's/.*: \([0-9]*\) done.*/\1/p' "$tmp/w1.out")
done2=$(sed -n 's/.*: \([0-9]*\) done.*/\1/p' "$tmp/w2.out")
check "concurrent: both workers exit 0" test $r1 -eq 0 -a $r2 -eq 0
check "concurrent: every observed file opened, none rewritten" test $bad -eq 0
check "concurrent: each document written once ($done1 + $done2 = 6)" test $((done1 + done2)) -eq 6
check "concurrent: six files, no temporary or lock files left" test "$(find "$root" -type f ! -name '.kvfold-fingerprint' | grep -c .)" -eq 6
for f in $(find "$root" -name '*.kvf'); do
    "$kvfold" verify "$f" --model "$model" >/dev/null 2>&1 || { echo "verify failed: $f"; fails=$((fails + 1)); }
done

# ---- text documents, ask and verify ----
printf -- '- feruli bracra\n- sila flotre\n- deku flicreflo\n- koma crastu\n- duvidu bresnu\n' >"$tmp/doc.txt"
"$kvfold" compact "${common[@]}" --repeat-instruction $'Repeat the records above.\n' --out "$tmp/text" "$tmp/doc.txt" >"$tmp/text.out" 2>&1
check "text file compacted" has "$tmp/text.out" "1 done"
kvf=$(find "$tmp/text" -name '*.kvf')
"$kvfold" ask "$kvf" --model "$model" --doc "$tmp/doc.txt" --compare --stop $'\n' $'Q: sila?\nA:' >"$tmp/ask.out" 2>"$tmp/ask.err"
check "ask: answers and compares" has "$tmp/ask.out" "agreement:"
check "ask: cache summary" has "$tmp/ask.err" "cache: "
"$kvfold" verify "$kvf" --model "$model" --doc "$tmp/doc.txt" --stop $'\n' --question $'Q: sila?\nA:' >"$tmp/verify.out" 2>&1
check "verify: checksums, document and KL" bash -c "grep -q 'checksums ok' '$tmp/verify.out' && grep -q 'matches' '$tmp/verify.out' && grep -q 'KL(full || cache)' '$tmp/verify.out'"
"$kvfold" verify "$kvf" --model "$model" --question 'Q: sila?' >"$tmp/verify-nodoc.out" 2>"$tmp/verify-nodoc.err"
check "verify: --question without --doc is a usage error (was: KL skipped, exit 0)" test $? -eq 2
check "verify: --question without --doc: message" has "$tmp/verify-nodoc.err" "--question needs the document (--doc FILE)"
"$kvfold" verify "$kvf" --model "$data/hf-qwen3-tiny" >/dev/null 2>"$tmp/other.err"
check "verify: another model's file refused (exit 1)" test $? -eq 1
check "verify: another model's file refused (message)" has "$tmp/other.err" "not for this model"
"$kvfold" ask "$kvf" --model "$model" --doc "$tmp/docs.jsonl" --compare 'Q: x?' >/dev/null 2>"$tmp/wrongdoc.err"
check "ask: a different document is refused" has "$tmp/wrongdoc.err" "is not the document of"

# ---- a model whose weights hold NaN or an infinity: refused at load, naming the tensor ----
python3 - "$data/hf-qwen3-tiny" "$tmp/nan-model" <<'PY'
import json, os, shutil, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
for f in ("config.json", "tokenizer.json"):
    shutil.copy(os.path.join(src, f), dst)
b = bytearray(open(os.path.join(src, "model.safetensors"), "rb").read())
n = struct.unpack("<Q", b[:8])[0]
t = json.loads(b[8:8 + n])["model.layers.1.mlp.up_proj.weight"]
assert t["dtype"] == "BF16"
b[8 + n + t["data_offsets"][0] + 2 * 11: 8 + n + t["data_offsets"][0] + 2 * 12] = struct.pack("<H", 0x7fc0)
open(os.path.join(dst, "model.safetensors"), "wb").write(b)
PY
"$kvfold" model-info "$tmp/nan-model" >/dev/null 2>"$tmp/nan.err"
check "NaN weight: model-info exit 1" test $? -eq 1
check "NaN weight: model-info names the tensor" has "$tmp/nan.err" "tensor 'model.layers.1.mlp.up_proj.weight' holds NaN at element 11"
"$kvfold" logits --model "$tmp/nan-model" --ids 1,2,3 >"$tmp/nan-logits.out" 2>"$tmp/nan-logits.err"
check "NaN weight: logits exit 1" test $? -eq 1
check "NaN weight: logits prints no logits" test ! -s "$tmp/nan-logits.out"
check "NaN weight: logits names the tensor" has "$tmp/nan-logits.err" "model.layers.1.mlp.up_proj.weight' holds NaN"

# ---- several methods and budgets in one run: one file per (method, budget), each byte for byte the
# file a run with that single pair writes (same name, same recipe digest), from one prefill ----
head -n 2 "$tmp/docs.jsonl" >"$tmp/two.jsonl"
mv_common=(--model "$model" --max-queries 500 --quiet --manifest "$tmp/two.jsonl")
"$kvfold" compact "${mv_common[@]}" --method fold,drop,am --budget 0.25,0.1 --out "$tmp/multi" >"$tmp/multi.out" 2>"$tmp/multi.err"
check "several variants: exit 0" test $? -eq 0
check "several variants: 12 files" test "$(find "$tmp/multi" -name '*.kvf' | wc -l)" -eq 12
check "several variants: summary" has "$tmp/multi.out" "2 documents (shard 0/1): 2 done, 0 skipped"
for m in fold drop am; do
    for b in 0.25 0.1; do
        "$kvfold" compact "${mv_common[@]}" --method $m --budget $b --out "$tmp/single" >/dev/null 2>&1
    done
done
# the files' content: every dataset's bytes and every attribute (HDF5 also stores object times,
# which differ between runs in different seconds)
/usr/bin/python3 - "$tmp/single" "$tmp/multi" >"$tmp/multi-cmp.txt" 2>&1 <<'PY'
import os, sys, h5py, numpy as np
single, multi = sys.argv[1:3]
def content(path):
    out = {}
    def visit(name, obj):
        out[name] = (obj[()].tobytes() if isinstance(obj, h5py.Dataset) else None,
                     sorted((k, np.asarray(v).tobytes()) for k, v in obj.attrs.items()))
    with h5py.File(path, "r") as f:
        out["/"] = (None, sorted((k, np.asarray(v).tobytes()) for k, v in f.attrs.items()))
        f.visititems(visit)
    return out
n = 0
for root, _, files in os.walk(single):
    for name in files:
        if name.endswith(".kvf"):
            a = os.path.join(root, name)
            b = os.path.join(multi, os.path.relpath(a, single))
            n += 1
            if not os.path.exists(b) or content(a) != content(b):
                print("differs or missing:", b)
print("compared", n)
PY
check "several variants: every file equals its single run (12 of them)" test "$(cat "$tmp/multi-cmp.txt")" = "compared 12"
"$kvfold" compact "${mv_common[@]}" --method fold,drop --budget 0.25,0.1,0.5 --out "$tmp/multi" >"$tmp/multi2.out" 2>&1
check "several variants: a rerun computes only the missing budget (2 documents done)" has "$tmp/multi2.out" "2 documents (shard 0/1): 2 done, 0 skipped"
check "several variants: 16 files after the rerun" test "$(find "$tmp/multi" -name '*.kvf' | wc -l)" -eq 16
"$kvfold" compact "${mv_common[@]}" --method fold,drop --budget 0.25,0.1 --out "$tmp/multi" >"$tmp/multi3.out" 2>&1
check "several variants: all there: skipped" has "$tmp/multi3.out" "2 documents (shard 0/1): 0 done, 2 skipped"
"$kvfold" compact "${mv_common[@]}" --method fold,fold --out "$tmp/multi" >/dev/null 2>"$tmp/dup.err"
check "several variants: a pair given twice is a usage error" test $? -eq 2
check "several variants: bad method in a list named" bash -c '"$0" compact --model "$1" --method fold,nope x 2>&1 | grep -qF "not '"'"'nope'"'"'"' "$kvfold" "$model"

finish
