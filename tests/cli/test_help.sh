#!/bin/bash
# kvfold --help and every command's --help as the binary prints them: the top level lists every
# command and every benchmark; each command's help exits 0 on stdout with its usage line first,
# then Options, Exit status and Example (naming the command) in that order, and no line over 100
# columns. The old spellings still work, print one note naming the new spelling on stderr, and
# give the same output as the new one; the new spelling prints no note.
# usage: test_help.sh KVFOLD DATA
set -uo pipefail
kvfold=$1; data=$2
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

"$kvfold" --help >"$tmp/top" 2>"$tmp/top.err"
check "kvfold --help: exit 0" test $? -eq 0
for c in model-info logits compact inspect verify ask tokenize chat-template eval bench; do
    check "kvfold --help lists $c" grep -qE "^  $c " "$tmp/top"
done
check "kvfold --help: bench lists every benchmark" \
    has "$tmp/top" "benchmarks (prefill, attention, quoka, compact, kvf, tokenize)"
"$kvfold" bench --help >"$tmp/bench"
for b in prefill kvf tokenize compact attention quoka; do
    check "kvfold bench --help lists $b" grep -qE "^  $b " "$tmp/bench"
done

# sections CMD...: the help of `kvfold CMD... --help`
sections() {
    local name="$*" h="$tmp/h"
    "$kvfold" "$@" --help >"$h" 2>"$tmp/h.err" || return 1
    [ ! -s "$tmp/h.err" ] || return 1
    head -1 "$h" | grep -q "^Usage: kvfold $name" || return 1
    # the four headings, each once, in order
    [ "$(grep -nE '^(Usage:|Options:|Exit status:|Example:)' "$h" | sed 's/:.*//;' | tr '\n' ' ')" \
        = "$(grep -nE '^(Usage:|Options:|Exit status:|Example:)' "$h" | sort -n -t: -k1 | sed 's/:.*//' | tr '\n' ' ')" ] || return 1
    [ "$(grep -cE '^(Usage:|Options:|Exit status:|Example:)' "$h")" -eq 4 ] || return 1
    awk '/^Usage:/{u=NR} /^Options:/{o=NR} /^Exit status:/{e=NR} /^Example:/{x=NR} END{exit !(u<o && o<e && e<x)}' "$h" || return 1
    sed -n '/^Example:/,$p' "$h" | grep -q "kvfold $name" || return 1
    awk 'length > 100 {bad=1} END {exit bad}' "$h" || return 1
    grep -qE '^  -h, --help ' "$h"
}
for c in model-info logits compact inspect verify ask tokenize chat-template "eval quality" bench "bench prefill" \
    "bench kvf" "bench tokenize" "bench compact" "bench attention" "bench quoka"; do
    # shellcheck disable=SC2086
    check "kvfold $c --help: usage, options, exit status, example" sections $c
done
"$kvfold" logits --help >"$tmp/logits"
check "logits --help: --device in the usage line" bash -c "sed -n '1,/^\$/p' '$tmp/logits' | grep -q -- '--device DEV'"
"$kvfold" compact --help >"$tmp/compact"
check "compact --help: under 95 lines" test "$(wc -l <"$tmp/compact")" -lt 95
check "compact --help: the rows that change the bytes marked" grep -qE '^\* --budget B' "$tmp/compact"
check "compact --help: --out not marked" grep -qE '^  --out ROOT' "$tmp/compact"
check "compact --help: points to docs/compact.md" has "$tmp/compact" "docs/compact.md"

# old spellings: same stdout as the new one, one note on stderr naming the new spelling
M=$data/hf-qwen3-tiny
"$kvfold" logits --model "$M" --ids 1,2,3 --top 3 --format json >"$tmp/new.out" 2>"$tmp/new.err"
check "logits --format json: exit 0" test $? -eq 0
check "logits --format json: no note" test ! -s "$tmp/new.err"
"$kvfold" logits --model "$M" --ids 1,2,3 --top 3 --json >"$tmp/old.out" 2>"$tmp/old.err"
check "logits --json (old): exit 0" test $? -eq 0
check "logits --json (old): the same output" cmp -s "$tmp/new.out" "$tmp/old.out"
check "logits --json (old): a note naming --format json" \
    has "$tmp/old.err" "kvfold logits: note: --json is now --format json"
check "logits --json (old): one line on stderr" test "$(wc -l <"$tmp/old.err")" -eq 1

# expect_note OLD NEW ARGS...: a bad value under the old spelling is refused as the new option's,
# after the note
expect_note() {
    local old=$1 new=$2; shift 2
    "$kvfold" "$@" >"$tmp/o" 2>"$tmp/e"
    local rc=$?
    [ $rc -eq 2 ] && grep -qE "note: --$old( [^ ]+)? is now --$new" "$tmp/e" && grep -qF -- "--$new " "$tmp/e" &&
        [ ! -s "$tmp/o" ]
}
Q=(bench quoka --model "$M" --docs "$data/records-dev.jsonl")
check "bench quoka --sinks (old) is --quoka-sinks" expect_note sinks quoka-sinks "${Q[@]}" --sinks -1
check "bench quoka --budgets (old) is --quoka-budget" expect_note budgets quoka-budget "${Q[@]}" --budgets 64 --max-docs 0
check "bench quoka --chunks (old) is --chunk" expect_note chunks chunk "${Q[@]}" --chunks 64 --max-docs 0
E=(eval quality --model "$data/records-qwen3" --docs "$data/records-dev.jsonl")
check "eval quality --methods (old) is --method" expect_note methods method "${E[@]}" --methods cut
check "eval quality --budgets (old) is --budget" expect_note budgets budget "${E[@]}" --budgets 2

finish
