#!/usr/bin/env bash
# tools/gguf-write.py against llama.cpp: each bundled checkpoint (Qwen3 with tied embeddings, Llama
# with llama3 RoPE scaling, Llama with head_dim != hidden / heads) converted to F32 and BF16 GGUF,
# run by llama.cpp (node-llama-cpp's prebuilt CPU build), and its next-token log-probabilities
# after 40 random ids compared with 'kvfold logits' up to a constant: F32 within 1e-4 (llama.cpp
# with an F32 KV cache and no flash attention: only summation order differs), BF16 (activations
# rounded to bf16 in llama.cpp's GEMMs) within 0.2 with the same top token.
# Usage: test_gguf_llamacpp.sh KVFOLD_BIN TEST_DATA_DIR LLAMACPP_DIR (node-llama-cpp installed by
# tools/setup.sh --tests, or tools/llamacpp/install.sh BUILD_DIR).
set -uo pipefail
kvfold=$1
data=$2
modules=$3
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py=/usr/bin/python3
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT

command -v node >/dev/null || { echo "FAIL node not found (apt-get install nodejs npm)"; exit 1; }
[ -d "$modules/node_modules/node-llama-cpp" ] ||
    { echo "FAIL node-llama-cpp not installed in $modules (tools/llamacpp/install.sh BUILD_DIR)"; exit 1; }
"$py" -c 'import numpy' || { echo "FAIL /usr/bin/python3 cannot import numpy"; exit 1; }

models=(hf-qwen3-tiny hf-llama3-tiny-random records-qwen3 records-llama3-induct)
ids=$("$py" -c 'import random; r = random.Random(3); print(",".join(str(r.randrange(3199)) for _ in range(40)))')
files=()
for m in "${models[@]}"; do
    for t in f32 bf16; do
        "$py" "$root/tools/gguf-write.py" "$data/$m" "$tmp/$m-$t.gguf" --type "$t" >/dev/null || exit 1
        files+=("$tmp/$m-$t.gguf")
    done
    "$kvfold" logits --model "$data/$m" --ids "$ids" --format json --top 3200 > "$tmp/$m.kvfold.json" || exit 1
done
# one node process for all files: llama.cpp's start-up is most of the time
node "$root/tools/llamacpp/llamacpp.mjs" logits --modules "$modules" --ids "$ids" --threads 1 --kv f32 \
    --flash off --model "$(IFS=,; echo "${files[*]}")" > "$tmp/llamacpp.jsonl" || exit 1

fails=0
i=0
while IFS= read -r line; do
    f=${files[$i]}
    i=$((i + 1))
    m=$(basename "$f" .gguf)
    printf '%s\n' "$line" > "$tmp/one.json"
    tol=1e-4
    [[ $m == *-bf16 ]] && tol=0.2
    if out=$("$py" "$root/tools/llamacpp/compare-logits.py" "$tmp/${m%-*}.kvfold.json" "$tmp/one.json" --tol $tol); then
        echo "ok   $m: $out"
    else
        echo "FAIL $m (tolerance $tol): $out"
        fails=$((fails + 1))
    fi
done < "$tmp/llamacpp.jsonl"
[ "$i" -eq "${#files[@]}" ] || { echo "FAIL llama.cpp answered for $i of ${#files[@]} files"; exit 1; }
exit $((fails > 0))
