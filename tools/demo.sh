#!/usr/bin/env bash
# The main job on bundled defaults: compact a bundled records document (doc1-0 of
# tests/data/records-dev.jsonl) with the bundled trained model into a kvf cache file, then answer
# a question from that file alone through the paged engine, next to the full-context answer.
set -euo pipefail
cd "$(dirname "$0")/.."
kvfold=${KVFOLD_BIN:-build/kvfold}
model=${KVFOLD_MODEL:-tests/data/records-qwen3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$kvfold" model-info "$model"
echo
# one document as a manifest: its token ids and the model's repeat instruction
head -n 1 tests/data/records-dev.jsonl >"$work/docs.jsonl"
"$kvfold" compact --model "$model" --manifest "$work/docs.jsonl" --method fold --budget 0.25 --out "$work/cache"
kvf=$(find "$work/cache" -name '*.kvf')
echo
"$kvfold" inspect "$kvf" | head -n 12
echo
# the task this model was trained on: copying the document back, from 23 cached slots of 92 tokens
echo "kvfold ask: Repeat the records above."
"$kvfold" ask "$kvf" --model "$model" --doc "$work/docs.jsonl" --compare --max-tokens 20 $'Repeat the records above.\n'
echo
# a records question ("Q: <name>?\nA:"); retrieval is not learned reliably by this checkpoint
echo "kvfold ask: Q: rake?"
"$kvfold" ask "$kvf" --model "$model" --stop $'\n' $'Q: rake?\nA:'
