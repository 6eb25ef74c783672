#!/usr/bin/env bash
# The job side against hostile input: a file of another document under a document's name, lock
# names planted as symlinks or FIFOs, names that would forge log lines, inputs past the model's
# positions, manifest lines that cannot be read, text files that look like JSON, header strings
# with control characters, a config with fewer layers than its checkpoint.
# Usage: test_job_guard.sh KVFOLD_BIN TEST_DATA_DIR (needs /usr/bin/python3 with h5py)
set -uo pipefail
kvfold=$1
data=$2
malloc_cap=$3 # tests/cli/malloc_cap.c built as a preloadable library
model=$data/records-llama3-induct
py=/usr/bin/python3
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

"$py" -c 'import h5py' || { echo "FAIL /usr/bin/python3 cannot import h5py (install python3-h5py)"; exit 1; }
# Three short records documents (ids), named a, b, c.
"$py" - "$data/records-dev.jsonl" "$tmp/docs.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
small = [r for r in rows if len(r["ids"]) < 500][:3]
with open(sys.argv[2], "w") as f:
    for name, r in zip("abc", small):
        f.write(json.dumps({"id": name, "ids": r["ids"][:64],
                            "repeat_instruction_ids": r["repeat_instruction_ids"]}) + "\n")
PY
common=(--model "$model" --budget 0.25 --max-queries 200)

# ---- a file of another document under a document's name: never skipped, never verified ----
"$kvfold" compact "${common[@]}" -q --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/1.out" 2>&1
check "three documents compacted" has "$tmp/1.out" "3 documents (shard 0/1): 3 done"
"$kvfold" compact "${common[@]}" -q --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/2.out" 2>&1
check "rerun: skipped, nothing replaced" has "$tmp/2.out" "0 done, 3 skipped (valid file exists), 0 busy (another worker), 0 failed; 0 files replaced"
# two of the files (two documents): one copied over the other's name
mapfile -t files < <(find "$tmp/root" -name '*.kvf' | sort)
a=${files[0]}
b=${files[1]}
cp "$a" "$tmp/a.orig"
cp "$b" "$a"
"$kvfold" verify "$a" --model "$model" >"$tmp/v.out" 2>"$tmp/v.err"
check "b's file under a's name: verify exits 1 (was 0)" test $? -eq 1
check "b's file under a's name: verify names the mismatch" has "$tmp/v.err" "the document differs (a file copied or renamed over another's name)"
"$kvfold" ask "$a" --model "$model" --question-ids 5,6,7 >/dev/null 2>"$tmp/ask.err"
check "b's file under a's name: ask refuses to serve it" bash -c "[ $? -eq 1 ] && grep -qF 'the document differs' '$tmp/ask.err'"
"$kvfold" compact "${common[@]}" --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/3.out" 2>"$tmp/3.err"
check "b's file under a's name: compacted again (exit 0)" test $? -eq 0
check "b's file under a's name: counted in the summary" has "$tmp/3.out" "1 done, 2 skipped (valid file exists), 0 busy (another worker), 0 failed; 1 file replaced"
check "b's file under a's name: reported with the cause" bash -c "grep -q 'kvf: holds document [0-9a-f]*, not [0-9a-f]*: compacting it again\$' '$tmp/3.err'"
digest() { "$kvfold" inspect --format json "$1" | "$py" -c 'import json, sys; print(json.load(sys.stdin)["document_digest"])'; }
check "b's file under a's name: a's own document back" test "$(digest "$a")" = "$(digest "$tmp/a.orig")"
"$kvfold" verify "$a" --model "$model" >/dev/null 2>&1
check "b's file under a's name: verify accepts the recompacted file" test $? -eq 0
# a header that claims another budget under the same recipe digest (a crafted file)
cp "$a" "$tmp/crafted.kvf"
"$py" - "$tmp/crafted.kvf" <<'PY'
import h5py, sys
with h5py.File(sys.argv[1], "r+") as f:
    f.attrs.modify("budget", 0.5)
PY
cp "$tmp/crafted.kvf" "$a"
"$kvfold" compact "${common[@]}" -q --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/4.out" 2>"$tmp/4.err"
check "a header with another budget: compacted again, counted" has "$tmp/4.out" "1 done, 2 skipped (valid file exists), 0 busy (another worker), 0 failed; 1 file replaced"
check "a header with another budget: the cause" has "$tmp/4.err" "holds budget 0.5, not 0.25"

# ---- lock files: never through a symlink, never anything but a regular file ----
rm -f "$a"
ln -s "$tmp/planted-target" "$a.lock"
"$kvfold" compact "${common[@]}" --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/lock.out" 2>"$tmp/lock.err"
check "symlink at the lock name: exit 1" test $? -eq 1
check "symlink at the lock name: its target not created (was created)" test ! -e "$tmp/planted-target"
check "symlink at the lock name: a clear message" has "$tmp/lock.err" "$a.lock is not a regular file (a symbolic link, directory, FIFO or device): refused; remove it"
check "symlink at the lock name: that document failed, the others skipped" has "$tmp/lock.out" "0 done, 2 skipped (valid file exists), 0 busy (another worker), 1 failed"
rm -f "$a.lock"
mkfifo "$a.lock"
timeout 120 "$kvfold" compact "${common[@]}" --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/fifo.out" 2>"$tmp/fifo.err"
check "FIFO at the lock name: refused (exit 1, no hang)" test $? -eq 1
check "FIFO at the lock name: a clear message" has "$tmp/fifo.err" "$a.lock is not a regular file"
rm -f "$a.lock"
"$kvfold" compact "${common[@]}" -q --out "$tmp/root" --manifest "$tmp/docs.jsonl" >"$tmp/lock2.out" 2>&1
check "lock name cleared: the document is done" has "$tmp/lock2.out" "1 done, 2 skipped"
check "lock name cleared: no lock file left" test -z "$(find "$tmp/root" -name '*.lock')"

# ---- names printed safely: no control character or invalid UTF-8 reaches stderr or stdout ----
"$py" - "$tmp/docs.jsonl" "$tmp/evil.jsonl" <<'PY'
import json, sys
good = json.loads(open(sys.argv[1]).readline())
with open(sys.argv[2], "w") as f:
    bad = dict(good, id="a\u001b[31m\u009b31m\u202e\r\nkvfold compact: forged line")
    f.write(json.dumps(bad) + "\n")
    f.write(json.dumps({"id": "x\u001b]0;title\u0007\r\nkvfold compact: forged failure", "ids": []}) + "\n")
PY
"$kvfold" compact "${common[@]}" --out "$tmp/evil-root" --manifest "$tmp/evil.jsonl" >"$tmp/evil.out" 2>"$tmp/evil.err"
check "hostile ids: exit 1 (a bad line)" test $? -eq 1
"$kvfold" compact "${common[@]}" --out "$tmp/evil-root" "$(printf '%s/missing-\377\376-\033[2J.txt' "$tmp")" >>"$tmp/evil.out" 2>>"$tmp/evil.err"
check "hostile path: exit 1" test $? -eq 1
cat "$tmp/evil.out" "$tmp/evil.err" >"$tmp/evil.all"
check "hostile ids: no ESC, CR, BEL or C1 byte printed" bash -c "! LC_ALL=C grep -q \$'[\\x1b\\r\\x07]' '$tmp/evil.all' && ! grep -qP '\\x{9b}|\\x{202e}' '$tmp/evil.all'"
check "hostile ids: no forged line" bash -c "! grep -q '^kvfold compact: forged' '$tmp/evil.all'"
check "hostile ids: the escapes shown" has "$tmp/evil.err" 'a\x1b[31m\u009b31m\u202e\r\nkvfold compact: forged line'
check "hostile path: invalid UTF-8 and ESC shown as bytes" has "$tmp/evil.err" 'missing-\xff\xfe-\x1b[2J.txt: cannot open'
check "hostile ids: the output is valid UTF-8" "$py" -c "open('$tmp/evil.all', encoding='utf-8').read()"

# ---- past the model's positions (4096): usage errors, exit 2 ----
sed -n 1p "$tmp/docs.jsonl" >"$tmp/doc-a.jsonl" # a document (a manifest line, as --doc reads it) and its file
"$kvfold" compact "${common[@]}" -q --out "$tmp/root-a" --manifest "$tmp/doc-a.jsonl" >/dev/null 2>&1
kvf=$(find "$tmp/root-a" -name '*.kvf')
long_ids=$("$py" -c 'print(",".join(["5"] * 6000))')
"$kvfold" ask "$kvf" --model "$model" --question-ids "$long_ids" >"$tmp/pos-ask.out" 2>"$tmp/pos-ask.err"
check "ask: 6000 question ids: exit 2 (was 0)" test $? -eq 2
check "ask: 6000 question ids: the message" has "$tmp/pos-ask.err" "6000 question tokens leave no room within the model's 4096 positions (max_position_embeddings)"
check "ask: 6000 question ids: no answer" test ! -s "$tmp/pos-ask.out"
edge_ids=$("$py" -c 'print(",".join(["5"] * 4000))')
"$kvfold" ask "$kvf" --model "$model" --max-tokens 200 --question-ids "$edge_ids" >/dev/null 2>"$tmp/pos-edge.err"
check "ask: C + 4000 tokens, 200 answer tokens: answered up to the last position (exit 0)" test $? -eq 0
"$kvfold" logits --model "$model" --ids "$long_ids" >"$tmp/pos-logits.out" 2>"$tmp/pos-logits.err"
check "logits: 6000 ids: exit 2 (was 0)" test $? -eq 2
check "logits: 6000 ids: the message" has "$tmp/pos-logits.err" "--ids: 6000 tokens run past the model's 4096 positions"
long_q=$("$py" -c 'print(" -" * 5000)')
"$kvfold" verify "$kvf" --model "$model" --doc "$tmp/doc-a.jsonl" --question "$long_q" >/dev/null 2>"$tmp/pos-verify.err"
check "verify --question of 5000 tokens: exit 2 (was 0)" test $? -eq 2
check "verify --question of 5000 tokens: the message" has "$tmp/pos-verify.err" "leave no room within the model's 4096 positions"

# ---- id lists: an empty item is refused, never skipped ----
"$kvfold" logits --model "$model" --ids 1,,2 >"$tmp/ids.out" 2>"$tmp/ids.err"
check "logits --ids 1,,2: exit 2 (was 0: read as 1,2)" test $? -eq 2
check "logits --ids 1,,2: the message" has "$tmp/ids.err" "--ids: token id 2: an empty item (two commas, or a comma at either end)"
"$kvfold" logits --model "$model" --ids 1,2, >/dev/null 2>&1
check "logits --ids 1,2,: exit 2" test $? -eq 2
"$kvfold" logits --model "$model" --ids "1, 2 3" >/dev/null 2>&1
check "logits --ids '1, 2 3': commas and spaces still separate (exit 0)" test $? -eq 0
"$kvfold" ask "$kvf" --model "$model" --question-ids 5,,6 >/dev/null 2>"$tmp/qids.err"
check "ask --question-ids 5,,6: exit 2" test $? -eq 2
check "ask --question-ids 5,,6: the message" has "$tmp/qids.err" "--question-ids: token id 2: an empty item"

# ---- bounded input: a line that cannot be read fails alone, the next lines are read ----
{
    sed -n 1p "$tmp/docs.jsonl"
    "$py" -c 'import json; print(json.dumps({"id": "huge", "text": "x" * 9000}))'
    printf '{"id": "nul", "ids": [1, 2]}\0{"ids": [3]}\n'
    sed -n 2p "$tmp/docs.jsonl"
} >"$tmp/lines.jsonl"
"$kvfold" compact "${common[@]}" --max-line-bytes 8192 --out "$tmp/lines-root" --manifest "$tmp/lines.jsonl" >"$tmp/lines.out" 2>"$tmp/lines.err"
check "unreadable lines: exit 1" test $? -eq 1
check "unreadable lines: too long, named" has "$tmp/lines.err" "lines.jsonl:2: line of 9026 bytes is longer than --max-line-bytes 8192: skipped"
check "unreadable lines: NUL, named" has "$tmp/lines.err" "lines.jsonl:3: holds a NUL byte at byte 28: not a JSON line"
check "unreadable lines: the lines after them done, both counted failed" has "$tmp/lines.out" "4 documents (shard 0/1): 2 done, 0 skipped (valid file exists), 0 busy (another worker), 2 failed"
"$kvfold" compact "${common[@]}" --max-line-bytes 8192 --shard 1/2 --out "$tmp/lines-root2" --manifest "$tmp/lines.jsonl" >"$tmp/lines2.out" 2>&1
check "unreadable lines: line numbers kept for --shard (lines 2 and 4)" has "$tmp/lines2.out" "2 documents (shard 1/2): 1 done, 0 skipped (valid file exists), 0 busy (another worker), 1 failed"
# ENOMEM: a line of 150 MiB (within --max-line-bytes) whose buffer cannot be allocated fails alone
# and the next line is done. Every allocation of 140 MB or more fails, as on a machine out of
# memory: through malloc_cap.so (a preloaded malloc), or in a sanitizer build through ASan's own
# allocator options. Unlike `ulimit -v`, neither depends on the address space the libraries take.
"$py" -c 'import json; print(json.dumps({"id": "big", "text": "x" * (150 << 20)}))' >"$tmp/big.jsonl"
sed -n 3p "$tmp/docs.jsonl" >>"$tmp/big.jsonl"
big=("$kvfold" compact "${common[@]}" --max-line-bytes 1073741824 --out "$tmp/big-root" --manifest "$tmp/big.jsonl")
if ldd "$kvfold" 2>/dev/null | grep -q 'libasan'; then
    ASAN_OPTIONS="${ASAN_OPTIONS:-}:max_allocation_size_mb=140:allocator_may_return_null=1" "${big[@]}" \
        >"$tmp/big.out" 2>"$tmp/big.err"
else
    LD_PRELOAD="$malloc_cap" KF_MALLOC_CAP=140000000 "${big[@]}" >"$tmp/big.out" 2>"$tmp/big.err"
fi
rc=$?
check "a line beyond memory: exit 1 (was 0: taken as the end of the manifest)" test $rc -eq 1
check "a line beyond memory: named" has "$tmp/big.err" "big.jsonl:1: out of memory for a line of 157286425 bytes: skipped"
check "a line beyond memory: the next line done" has "$tmp/big.out" "2 documents (shard 0/1): 1 done, 0 skipped (valid file exists), 0 busy (another worker), 1 failed"
rm -f "$tmp/big.jsonl"
# --probes-from: read whole or refused before any work
{ echo '"Q: sila?"'; "$py" -c 'import json; print(json.dumps("y" * 9000))'; } >"$tmp/probes-long.jsonl"
"$kvfold" compact "${common[@]}" --max-line-bytes 8192 --probes-from "$tmp/probes-long.jsonl" --out "$tmp/probes-root" --manifest "$tmp/docs.jsonl" >"$tmp/probes.out" 2>"$tmp/probes.err"
check "--probes-from with a line too long: exit 2 (was 0)" test $? -eq 2
check "--probes-from with a line too long: named" has "$tmp/probes.err" "probes-long.jsonl:2: line of 9002 bytes is longer than --max-line-bytes 8192"
check "--probes-from with a line too long: nothing compacted" test -z "$(find "$tmp/probes-root" -name '*.kvf' 2>/dev/null)"
printf '"Q: sila?"\0"ignored"\n' >"$tmp/probes-nul.jsonl"
"$kvfold" compact "${common[@]}" --probes-from "$tmp/probes-nul.jsonl" --out "$tmp/probes-root" --manifest "$tmp/docs.jsonl" >/dev/null 2>"$tmp/probes-nul.err"
check "--probes-from with a NUL: exit 2 (was 0: the rest of the line ignored)" test $? -eq 2
check "--probes-from with a NUL: named" has "$tmp/probes-nul.err" "probes-nul.jsonl:1: holds a NUL byte at byte 10"

# ---- compact FILE... reads text, whatever it looks like ----
printf '[3, 1, 4, 1, 5, 9, 2, 6]' >"$tmp/looks-like-ids.txt"
printf '{"ids": [3, 1, 4]}' >"$tmp/looks-like-line.txt"
for f in looks-like-ids looks-like-line; do
    "$kvfold" compact "${common[@]}" -q --out "$tmp/text-root-$f" "$tmp/$f.txt" >"$tmp/$f.out" 2>&1
    want=$("$kvfold" tokenize --model "$model" --add-special <"$tmp/$f.txt" | tr ',' '\n' | grep -c .)
    got=$("$kvfold" inspect --format json "$(find "$tmp/text-root-$f" -name '*.kvf')" | "$py" -c 'import json, sys; print(json.load(sys.stdin)["n_doc_tokens"])')
    check "$f.txt: compacted as its text ($want tokens, got $got)" test "$got" = "$want"
done

# ---- header strings: C1 controls, bidirectional overrides, a free-form placeholder ----
for case in c1 bidi placeholder; do
    cp "$kvf" "$tmp/$case.kvf"
    "$py" - "$tmp/$case.kvf" "$case" <<'PY'
import h5py, numpy as np, sys
path, case = sys.argv[1:3]
name, value = {"c1": ("creator", "kvfold \u009b31m".encode()), "bidi": ("creator", "kvfold \u202e0.1".encode()),
               "placeholder": ("placeholder", b"anything")}[case]
with h5py.File(path, "r+") as f:
    del f.attrs[name]
    tid = h5py.h5t.C_S1.copy(); tid.set_size(len(value) + 1); tid.set_cset(h5py.h5t.CSET_UTF8)
    a = h5py.h5a.create(f.id, name.encode(), tid, h5py.h5s.create(h5py.h5s.SCALAR))
    a.write(np.array(value, dtype="S%d" % (len(value) + 1)), mtype=tid)
PY
    "$kvfold" inspect "$tmp/$case.kvf" >"$tmp/$case.txt" 2>&1
    check "header $case: inspect refuses it (exit 1)" test $? -eq 1
    check "header $case: nothing raw printed" bash -c "! grep -qP '\\x{9b}|\\x{202e}' '$tmp/$case.txt'"
done
check "header placeholder: the cause" has "$tmp/placeholder.txt" "placeholder 'anything' is not \"digest\""

# ---- a config with fewer layers than the checkpoint ----
mkdir -p "$tmp/fewer"
cp "$model"/* "$tmp/fewer/"
"$py" - "$tmp/fewer/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = 1
json.dump(c, open(sys.argv[1], "w"))
PY
"$kvfold" model-info "$tmp/fewer" >/dev/null 2>"$tmp/fewer.err"
check "num_hidden_layers 1 of 2: refused (exit 1, was 0)" test $? -eq 1
check "num_hidden_layers 1 of 2: the message" has "$tmp/fewer.err" "the checkpoint holds layer 1 (tensor 'model.layers.1."

finish
