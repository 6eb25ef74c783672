#!/usr/bin/env bash
# kvf files from the command line: compact's recipe identity (another --lambda or --dtype is a new
# file, a rerun with the same settings is skipped, a file with a flipped data byte is recomputed),
# inspect in text and JSON (head methods, recipe), and inspect on a file with invalid UTF-8 in a
# string attribute or under a name that is not UTF-8: a clear error and exit 1, never invalid
# JSON. Usage: test_kvf_cli.sh KVFOLD_BIN TEST_DATA_DIR (needs /usr/bin/python3 with h5py).
set -uo pipefail
kvfold=$1
data=$2
model=$data/records-qwen3
py=/usr/bin/python3
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
nfiles() { find "$1" -name '*.kvf' | wc -l; }

"$py" -c 'import h5py' || { echo "FAIL /usr/bin/python3 cannot import h5py (install python3-h5py)"; exit 1; }
"$py" - "$data/records-dev.jsonl" "$tmp/docs.jsonl" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if len(json.loads(l)["ids"]) < 500][0]
with open(sys.argv[2], "w") as f:
    f.write(json.dumps({"id": r["id"], "ids": r["ids"][:96], "repeat_instruction_ids": r["repeat_instruction_ids"]}) + "\n")
PY
common=(--model "$model" --budget 0.25 --max-queries 300 --quiet --manifest "$tmp/docs.jsonl" --out "$tmp/root")

# ---- recipe identity ----
"$kvfold" compact "${common[@]}" >"$tmp/1.out" 2>&1
check "first run: one file" test "$(nfiles "$tmp/root")" -eq 1
"$kvfold" compact "${common[@]}" >"$tmp/2.out" 2>&1
check "same recipe: skipped" has "$tmp/2.out" "1 skipped"
"$kvfold" compact "${common[@]}" --lambda 0.5 >"$tmp/3.out" 2>&1
check "another --lambda: computed, a second file" test "$(nfiles "$tmp/root")" -eq 2
check "another --lambda: not skipped" has "$tmp/3.out" "1 done"
"$kvfold" compact "${common[@]}" --dtype f32 >"$tmp/4.out" 2>&1
check "another --dtype: a third file" test "$(nfiles "$tmp/root")" -eq 3
first=$(find "$tmp/root" -name '*.kvf' | sort | head -1)
# one flipped byte in a stored chunk of values: the skip check reads the sums
"$py" - "$first" <<'PY'
import h5py, sys
with h5py.File(sys.argv[1], "r") as f:
    off = f["values"].id.get_chunk_info(0).byte_offset
with open(sys.argv[1], "r+b") as f:
    f.seek(off + 5); b = f.read(1); f.seek(off + 5); f.write(bytes([b[0] ^ 0x40]))
PY
check "flipped byte: verify refuses" bash -c "! '$kvfold' verify --model '$model' '$first' >/dev/null 2>&1"
for extra in "" "--lambda 0.5" "--dtype f32"; do
    # shellcheck disable=SC2086
    "$kvfold" compact "${common[@]}" $extra >"$tmp/5.out" 2>&1
    has "$tmp/5.out" "1 done" && recomputed=1
done
check "flipped byte: that file is recomputed, not skipped" test "${recomputed:-0}" -eq 1
check "after recompute: verify accepts every file" bash -c "for f in \$(find '$tmp/root' -name '*.kvf'); do '$kvfold' verify --model '$model' \"\$f\" >/dev/null || exit 1; done"

# ---- inspect ----
"$kvfold" inspect "$first" >"$tmp/i.txt" 2>&1
check "inspect: exit 0" test $? -eq 0
check "inspect: head methods line" has "$tmp/i.txt" "head methods"
check "inspect: recipe line" has "$tmp/i.txt" "recipe "
"$kvfold" inspect --format json "$first" >"$tmp/i.json" 2>"$tmp/i.err"
check "inspect --json: exit 0" test $? -eq 0
check "inspect --json: valid JSON with head_methods and recipe_digest" "$py" -c "
import json, sys
d = json.load(open('$tmp/i.json'))
hm = d['head_methods']
assert len(d['recipe_digest']) == 32 and d['version'] == 2
assert sum(hm[k] for k in ('keep', 'drop', 'am', 'fold')) == d['n_layers'] * d['kv_heads']
assert len(hm['per_layer']) == d['n_layers']"

# invalid UTF-8 in a string attribute (fixed-length, as version 2 writes them)
cp "$first" "$tmp/bad-utf8.kvf"
"$py" - "$tmp/bad-utf8.kvf" <<'PY'
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], "r+") as f:
    del f.attrs["placeholder"]
    tid = h5py.h5t.C_S1.copy(); tid.set_size(5); tid.set_cset(h5py.h5t.CSET_UTF8)
    a = h5py.h5a.create(f.id, b"placeholder", tid, h5py.h5s.create(h5py.h5s.SCALAR))
    a.write(np.array(b"ab\xff\xfe", dtype="S5"), mtype=tid)
PY
"$kvfold" inspect --format json "$tmp/bad-utf8.kvf" >"$tmp/b.json" 2>"$tmp/b.err"
check "invalid UTF-8, --json: exit 1" test $? -eq 1
check "invalid UTF-8, --json: nothing on stdout" test ! -s "$tmp/b.json"
check "invalid UTF-8, --json: the cause on stderr" has "$tmp/b.err" "'placeholder' is not printable UTF-8"
"$kvfold" inspect "$tmp/bad-utf8.kvf" >"$tmp/b.txt" 2>&1
check "invalid UTF-8, text: exit 1" test $? -eq 1
check "invalid UTF-8, text: no raw bytes written" bash -c "! LC_ALL=C grep -q \$'\\xff' '$tmp/b.txt'"

# a file name that is not UTF-8: text mode works, --json (the old spelling of --format json) is a
# clear error
bad_name=$(printf '%s/name-\377.kvf' "$tmp")
cp "$first" "$bad_name"
"$kvfold" inspect --json "$bad_name" >"$tmp/n.json" 2>"$tmp/n.err"
rc=$?
check "non-UTF-8 name, --json: exit 1 or valid JSON" bash -c "[ $rc -eq 1 ] && [ ! -s '$tmp/n.json' ] || '$py' -c 'import json; json.load(open(\"$tmp/n.json\"))'"
check "non-UTF-8 name, --json: the cause on stderr" has "$tmp/n.err" "not UTF-8"
check "inspect --json (old spelling): a note naming --format json" \
    has "$tmp/n.err" "kvfold inspect: note: --json is now --format json"

finish
