#!/bin/bash
# kvfold logits with the QUOKA prefill against the dense one, on the same ids: with a budget that
# covers the whole history QUOKA keeps every key, so its output is the dense output byte for byte;
# with a budget of 16 keys (4 queries, 2 sinks) over 80 tokens it is a valid top-5 (ranks 1..5,
# logits descending, probabilities in (0, 1] in the order of the logits) that differs from the
# dense one, so the sparse attention ran; --format json carries the same ids and logits.
# usage: test_logits.sh KVFOLD DATA
set -uo pipefail
kvfold=$1; data=$2
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
L=(logits --model "$data/hf-qwen3-tiny" --chunk 16 --top 5 --ids "$(seq -s, 100 7 653)")

"$kvfold" "${L[@]}" >"$tmp/dense" 2>&1
check "dense: exit 0" test $? -eq 0
"$kvfold" "${L[@]}" --prefill quoka --quoka-budget 96 >"$tmp/whole" 2>&1
check "quoka, budget over the history: the dense output" cmp -s "$tmp/dense" "$tmp/whole"
Q=("${L[@]}" --prefill quoka --quoka-budget 16 --quoka-nq 4 --quoka-sinks 2)
"$kvfold" "${Q[@]}" >"$tmp/sparse" 2>&1
check "quoka, 16 keys: exit 0" test $? -eq 0
check "quoka, 16 keys: 80 tokens, position 79" has "$tmp/sparse" "80 tokens; next-token prediction after position 79:"
valid_top5() {
    awk 'NR > 2 { n++; if ($1 != n) bad = 1; if (n > 1 && ($3 > logit || $4 > prob)) bad = 1;
                  if (!($4 > 0 && $4 <= 1)) bad = 1; logit = $3; prob = $4 }
         END { exit bad || n != 5 }' "$1"
}
check "quoka, 16 keys: ranks 1..5, logits and probabilities descending" valid_top5 "$tmp/sparse"
check "dense: the same checks" valid_top5 "$tmp/dense"
check "quoka, 16 keys: not the dense output (sparse attention ran)" bash -c "! cmp -s '$tmp/dense' '$tmp/sparse'"
"$kvfold" "${Q[@]}" --format json >"$tmp/sparse.json" 2>&1
check "--format json: the same ids and logits as the table" /usr/bin/python3 -c "
import json, sys
j = json.load(open('$tmp/sparse.json'))
rows = [l.split() for l in open('$tmp/sparse').read().splitlines()[2:]]
assert j['n_tokens'] == 80 and j['position'] == 79
assert [t['id'] for t in j['top']] == [int(r[1]) for r in rows]
assert all(abs(t['logit'] - float(r[2])) < 1e-3 for t, r in zip(j['top'], rows))
"
finish
