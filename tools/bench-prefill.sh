#!/usr/bin/env bash
# Prefill throughput of kvfold next to the PyTorch reference (tests/reference/hf_reference.py),
# same model, same token counts, same thread count, in the same run: the ratio is the number to
# read, absolute rates depend on the machine and its load.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<EOF
Usage: tools/bench-prefill.sh [--model DIR] [--tokens LIST] [--threads T] [--repeat R]
                              [--kvfold BIN] [--python PY]

Runs 'kvfold bench prefill --model DIR --tokens N' and the PyTorch reference's
'hf_reference.py bench' (fp32, CPU, one warm-up, median of R, last position's logits only)
for each N, both with T threads, and prints a table: tokens, kvfold tok/s, torch tok/s,
ratio (kvfold/torch).

Options (environment variable in brackets):
  --model DIR     Hugging Face model directory [KF_BENCH_MODEL]
                  (default: tests/data/hf-qwen3-tiny)
  --tokens LIST   comma-separated prompt lengths [KF_BENCH_TOKENS] (default: 512,2048)
  --threads T     threads for both [KF_BENCH_THREADS] (default: all cores, nproc)
                  kvfold gets OMP_NUM_THREADS/OPENBLAS_NUM_THREADS=T, torch set_num_threads(T)
  --repeat R      timed runs per measurement [KF_BENCH_REPEAT] (default: 3)
  --kvfold BIN    kvfold binary [KVFOLD_BIN] (default: build/kvfold)
  --python PY     Python with torch and numpy [KF_PYTHON] (default: /usr/bin/python3)
  -h, --help      show this help

The rest of the environment passes through to both. On a loaded machine, OpenMP's default
spin-waiting (OMP_WAIT_POLICY=active) next to OpenBLAS's own thread pool can cost several
times the throughput; compare with OMP_WAIT_POLICY=passive when the numbers look off.
The torch side is a plain eager implementation (full T x T attention scores), not transformers.
EOF
}

model="${KF_BENCH_MODEL:-$ROOT/tests/data/hf-qwen3-tiny}"
tokens="${KF_BENCH_TOKENS:-512,2048}"
threads="${KF_BENCH_THREADS:-$(nproc)}"
repeat="${KF_BENCH_REPEAT:-3}"
kvfold="${KVFOLD_BIN:-$ROOT/build/kvfold}"
# Debian's python3 carries torch; the first python3 on PATH may not.
python="${KF_PYTHON:-/usr/bin/python3}"

die() { echo "bench-prefill.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --model|--tokens|--threads|--repeat|--kvfold|--python)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                --model) model="$2" ;; --tokens) tokens="$2" ;; --threads) threads="$2" ;;
                --repeat) repeat="$2" ;; --kvfold) kvfold="$2" ;; --python) python="$2" ;;
            esac
            shift 2 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
done

[[ -x "$kvfold" ]] || die "kvfold binary not found: $kvfold (build it, or pass --kvfold)"
[[ -f "$model/config.json" ]] || die "not a model directory: $model"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$threads'"
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || die "--repeat must be a positive integer, got '$repeat'"
"$python" -c 'import torch, numpy' 2>/dev/null || die "$python cannot import torch and numpy (pass --python)"

export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"

# The value of the 'tokens_per_s <value>' line both tools print last.
rate() { awk '$1 == "tokens_per_s" { v = $2 } END { if (v == "") exit 1; print v }'; }

rows=()
IFS=',' read -r -a counts <<< "$tokens"
for n in "${counts[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "bad token count '$n'"
    echo "== $n tokens, $threads threads" >&2
    kv_out="$("$kvfold" bench prefill --model "$model" --tokens "$n" --repeat "$repeat")" \
        || die "kvfold bench prefill failed for $n tokens"
    echo "$kv_out" >&2
    kv="$(rate <<< "$kv_out")" || die "no tokens_per_s line from kvfold"
    pt_out="$("$python" "$ROOT/tests/reference/hf_reference.py" bench --model "$model" \
        --tokens "$n" --repeat "$repeat" --threads "$threads")" \
        || die "torch reference bench failed for $n tokens"
    echo "$pt_out" >&2
    pt="$(rate <<< "$pt_out")" || die "no tokens_per_s line from the torch reference"
    rows+=("$n $kv $pt")
done

echo
echo "model: $model   threads: $threads   repeat: $repeat (median)   OMP_WAIT_POLICY: ${OMP_WAIT_POLICY:-unset}"
printf '%8s %16s %16s %10s\n' tokens "kvfold tok/s" "torch tok/s" ratio
for row in "${rows[@]}"; do
    read -r n kv pt <<< "$row"
    awk -v n="$n" -v kv="$kv" -v pt="$pt" 'BEGIN { printf "%8d %16.1f %16.1f %10.2f\n", n, kv, pt, kv / pt }'
done
