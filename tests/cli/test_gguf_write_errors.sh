#!/usr/bin/env bash
# tools/gguf-write.py on bad input: exit 1, a message naming the file and the field or tensor at
# fault, and no GGUF file left behind. Usage: test_gguf_write_errors.sh TEST_DATA_DIR
set -uo pipefail
data=$1
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py=/usr/bin/python3
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
passed=0
failed=0

# model NAME PYTHON-EDIT: a copy of hf-qwen3-tiny whose config.json the edit changes (c is the dict)
model() {
    mkdir -p "$tmp/$1"
    cp "$data/hf-qwen3-tiny/model.safetensors" "$data/hf-qwen3-tiny/tokenizer.json" "$tmp/$1/"
    "$py" -c "import json, sys; c = json.load(open(sys.argv[1])); $2; json.dump(c, open(sys.argv[2], 'w'))" \
        "$data/hf-qwen3-tiny/config.json" "$tmp/$1/config.json"
}

# expect NAME MODEL_DIR MESSAGE: exit 1, MESSAGE on stderr, no output file
expect() {
    local out="$tmp/$1.gguf" err rc
    err=$("$py" "$root/tools/gguf-write.py" "$2" "$out" 2>&1 >/dev/null)
    rc=$?
    if [ "$rc" -eq 1 ] && grep -qF -- "$3" <<< "$err" && [ ! -e "$out" ] && [ ! -e "$out.part" ]; then
        echo "ok   $1: $err"
        passed=$((passed + 1))
    else
        echo "FAIL $1: exit $rc, wanted '$3', got: $err"
        failed=$((failed + 1))
    fi
}

model arch 'c["model_type"] = "mistral"'
expect arch "$tmp/arch" "config.json: model_type 'mistral' is not supported"
model layers 'c["num_hidden_layers"] = 5'
expect layers "$tmp/layers" "layers: the checkpoint has no tensor 'model.layers.4.input_layernorm.weight'"
model hidden 'c["intermediate_size"] = 700'
expect shape "$tmp/hidden" "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [768, 256], config.json implies [700, 256]"
model rope 'c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}'
expect rope "$tmp/rope" "config.json: rope type 'yarn' is not supported"
model missing 'del c["hidden_size"]'
expect missing "$tmp/missing" "config.json: field 'hidden_size' is missing"
model tok 'pass'
"$py" -c 'import json, sys; t = json.load(open(sys.argv[1])); t["model"]["type"] = "Unigram"; json.dump(t, open(sys.argv[2], "w"))' \
    "$data/hf-qwen3-tiny/tokenizer.json" "$tmp/tok/tokenizer.json"
expect tokenizer "$tmp/tok" "tok/tokenizer.json: model.type must be BPE"
model cut 'pass'
head -c 100000 "$data/hf-qwen3-tiny/model.safetensors" > "$tmp/cut/model.safetensors"
expect truncated "$tmp/cut" "model.safetensors: tensor"
printf '{"model_type": ' > "$tmp/cut/config.json"
expect json "$tmp/cut" "config.json: not valid JSON"
expect nodir "$tmp/none" "none/config.json: cannot read"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
