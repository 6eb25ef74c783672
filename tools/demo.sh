#!/usr/bin/env bash
# The main job on bundled defaults: compact a bundled records document (doc1-1 of
# tests/data/records-dev.jsonl, 64 record and prose lines, 463 tokens) with the bundled retrieving
# model (tests/data/records-llama3-induct) into a kvf cache file at half its length, then answer
# three questions about its records from that file alone through the paged engine, each beside
# the answer from the full document. At budget 0.5 the facts survive (fold and drop answer all
# eight questions of this document as the full context does); at 0.25 most are lost.
#
#   KVFOLD_BIN     the kvfold binary (default build/kvfold)
#   KVFOLD_MODEL   the model directory (default tests/data/records-llama3-induct)
#   DEMO_METHOD    keep, drop, am or fold (default fold)
#   DEMO_BUDGET    kept fraction of the document (default 0.5)
set -euo pipefail
cd "$(dirname "$0")/.."
kvfold=${KVFOLD_BIN:-build/kvfold}
model=${KVFOLD_MODEL:-tests/data/records-llama3-induct}
method=${DEMO_METHOD:-fold}
budget=${DEMO_BUDGET:-0.5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$kvfold" model-info "$model"
echo
# one document as a manifest: its token ids and the repeat instruction whose queries drive the fit
sed -n 2p tests/data/records-dev.jsonl >"$work/docs.jsonl"
"$kvfold" compact --model "$model" --manifest "$work/docs.jsonl" --method "$method" --budget "$budget" \
  --out "$work/cache" 2>/dev/null
kvf=$(find "$work/cache" -name '*.kvf')
echo
echo "the cache against the full cache:"
"$kvfold" inspect "$kvf" | grep -E '^(document|compacted|method|sizes|compression) '
echo
# three of the document's evaluation questions ("Q: <name>?\nA:"), one per context, answered from
# the file alone and from the full document (--compare); the model answers " <name> <value>\n"
echo "kvfold ask (three questions about doc1-1's records):"
"$kvfold" ask "$kvf" --model "$model" --doc "$work/docs.jsonl" --compare --stop $'\n' --max-tokens 8 -q \
  $'Q: nini?\nA:' $'Q: rukidu?\nA:' $'Q: ripipi?\nA:'
echo
