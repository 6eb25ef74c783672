#!/usr/bin/env bash
# kvfold compact writes the same bytes for one recipe however it runs: a second run (no timestamps
# in the file), 1, 2, 3 and 4 threads of kvfold's pool and of OpenBLAS, and a document compacted
# on its own (--no-share) or continued from the prefix it shares with another. The chunk (100) is
# not a multiple of the 16-token pages the prefixes are shared by, so the shared document's chunks
# begin elsewhere than its own prefill's. Usage: test_deterministic.sh KVFOLD_BIN TEST_DATA_DIR
set -uo pipefail
kvfold=$1
data=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

# Three records documents: "shares" begins with the first 208 tokens (13 pages) of "whole".
python3 - "$data/records-dev.jsonl" "$tmp/docs.jsonl" <<'PY'
import json, sys
rows = {json.loads(l)["id"]: json.loads(l) for l in open(sys.argv[1])}
a, b, c = rows["doc1-2"], rows["doc1-1"], rows["doc1-6"]
docs = [("whole", a["ids"][:300]), ("shares", a["ids"][:208] + b["ids"][:100]), ("odd", c["ids"][:233])]
with open(sys.argv[2], "w") as f:
    for name, ids in docs:
        f.write(json.dumps({"id": name, "ids": ids, "repeat_instruction_ids": a["repeat_instruction_ids"]}) + "\n")
PY
echo '[81, 58, 1541, 63, 10, 65, 58]' >"$tmp/probes.jsonl" # "Q: rake?\nA:": a probe of 7 rows

run() { # run NAME [VAR=VALUE...] [-- OPTION...]: compacts the documents into $tmp/NAME
    local name=$1 envs=() opts=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    [ $# -gt 0 ] && shift && opts=("$@")
    env "${envs[@]}" "$kvfold" compact --model "$data/records-llama3-induct" --method fold,am --budget 0.25 \
        --chunk 100 --probes-from "$tmp/probes.jsonl" --manifest "$tmp/docs.jsonl" --out "$tmp/$name" -q \
        "${opts[@]}" >"$tmp/$name.out" 2>&1
    check "$name: exit 0" test $? -eq 0
}
same() { # same NAME: every file of run NAME is byte for byte the file of run t1
    local f n=0 bad=0
    for f in $(cd "$tmp/t1" && find . -name '*.kvf' | sort); do
        n=$((n + 1))
        cmp -s "$tmp/t1/$f" "$tmp/$1/$f" || { echo "     differs: $f"; bad=$((bad + 1)); }
    done
    check "$1: the 6 files of one thread, byte for byte" test $n -eq 6 -a $bad -eq 0
}

run t1 OPENBLAS_NUM_THREADS=1
check "t1: the prefix was shared" grep -q 'prefix sharing: [0-9]* tokens computed, [0-9]* without sharing (on)' "$tmp/t1.out"
sleep 1 # a timestamp would move by a second at least
run again OPENBLAS_NUM_THREADS=1
same again
run t2 OPENBLAS_NUM_THREADS=2
same t2
run t3 OPENBLAS_NUM_THREADS=2 KVFOLD_THREADS=3
same t3
run t4 OPENBLAS_NUM_THREADS=4 KVFOLD_THREADS=4
same t4
run noshare OPENBLAS_NUM_THREADS=1 -- --no-share
check "noshare: nothing shared" grep -q '(off: --no-share)' "$tmp/noshare.out"
same noshare

KVFOLD_THREADS=0 "$kvfold" compact --model "$data/records-llama3-induct" --manifest "$tmp/docs.jsonl" \
    --out "$tmp/bad" >/dev/null 2>"$tmp/bad.err"
check "KVFOLD_THREADS=0 refused" grep -q "KVFOLD_THREADS must be a whole number from 1 to 1024, not '0'" "$tmp/bad.err"

finish
