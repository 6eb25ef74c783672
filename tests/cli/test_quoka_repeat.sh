#!/bin/bash
# --quoka-repeat: QUOKA in the repeat prefill too. eval quality on one records document: with a
# QUOKA budget that covers every history the tables equal the dense prefill's byte for byte (QUOKA
# keeps every key; the wiring changes nothing else); with 32 keys they differ from the document-only
# QUOKA's (the repeat's attention was sparse too); without --prefill quoka the option is refused.
# usage: test_quoka_repeat.sh KVFOLD DATA
set -uo pipefail
kvfold=$1; data=$2
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
E=(eval quality --quiet --model "$data/records-qwen3" --docs "$data/records-dev.jsonl" --limit 1 --probes 4
   --method fold --budget 0.25 --chunk 64 --format tsv)
run() { # run NAME OPTION...: the table without its timing line
    "$kvfold" "${E[@]}" "${@:2}" 2>"$tmp/$1.err" | grep -Ev '^[0-9.]+ s$' >"$tmp/$1"
    check "$1: exit 0" test "${PIPESTATUS[0]}" -eq 0
}
run dense
run whole --prefill quoka --quoka-budget 100000 --quoka-repeat
check "every key kept: the dense tables" cmp -s "$tmp/dense" "$tmp/whole"
run doc --prefill quoka --quoka-budget 32
run both --prefill quoka --quoka-budget 32 --quoka-repeat
check "32 keys, the repeat too: not the document-only tables" bash -c "! cmp -s '$tmp/doc' '$tmp/both'"
check "32 keys: not the dense tables" bash -c "! cmp -s '$tmp/dense' '$tmp/doc'"
"$kvfold" "${E[@]}" --quoka-repeat >"$tmp/alone" 2>&1
check "--quoka-repeat without --prefill quoka: usage error" test $? -eq 2
check "... naming --prefill quoka" has "$tmp/alone" "--quoka-repeat needs --prefill quoka"
finish
