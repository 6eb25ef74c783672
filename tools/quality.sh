#!/usr/bin/env bash
# The quality tables and figure of docs/quality.md: `kvfold eval quality` on both bundled records
# models, then tools/plot-quality.py. Writes tools/quality/<model>.tsv and docs/quality.png.
#
#   KVFOLD_BIN   the kvfold binary (default build/kvfold)
#   LIMIT        documents of tests/data/records-dev.jsonl (default 10: two of each length
#                16, 64, 128, 256, 512 lines; 40 for all)
set -euo pipefail
cd "$(dirname "$0")/.."
kvfold=${KVFOLD_BIN:-build/kvfold}
limit=${LIMIT:-10}
out=tools/quality
docs=tests/data/records-dev.jsonl
# records-qwen3 copies but does not retrieve: 16 probe questions per document join the reference
# queries; records-llama3-induct retrieves: no probes, one question per context
"$kvfold" eval quality --model tests/data/records-qwen3 --docs "$docs" --limit "$limit" \
  --probes 16 --budget 0.25,0.1 --format tsv >"$out/records-qwen3.tsv"
"$kvfold" eval quality --model tests/data/records-llama3-induct --docs "$docs" --limit "$limit" \
  --budget 0.5,0.25,0.1 --format tsv >"$out/records-llama3-induct.tsv"
/usr/bin/python3 tools/plot-quality.py --out docs/quality.png \
  records-qwen3="$out/records-qwen3.tsv" records-llama3-induct="$out/records-llama3-induct.tsv"
echo "quality.sh: wrote $out/records-qwen3.tsv, $out/records-llama3-induct.tsv and docs/quality.png"
