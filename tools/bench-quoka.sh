#!/usr/bin/env bash
# QUOKA against dense attention, in the same run: one chunk's attention over long histories
# ('kvfold bench attention'), whole prefills ('kvfold bench prefill --prefill dense|quoka'),
# and optionally the accuracy gap on the records model ('kvfold bench quoka'). The ratios are
# the numbers to read; absolute rates depend on the machine and its load.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<EOF
Usage: tools/bench-quoka.sh [--model DIR] [--tokens LIST] [--chunk C] [--budget B] [--threads T]
                            [--repeat R] [--history LIST] [--accuracy] [--kvfold BIN]

1. kvfold bench attention --history LIST --chunk C --quoka-budget B (random data, records shape)
2. for each N in LIST: kvfold bench prefill --tokens N --chunk C, dense then --prefill quoka
   --quoka-budget B, and a table: tokens, dense tok/s, quoka tok/s, ratio (quoka/dense)
3. with --accuracy: kvfold bench quoka on tests/data/records-qwen3 and records-dev.jsonl

Options (environment variable in brackets):
  --model DIR     model for the whole prefills [KF_BENCH_MODEL] (default: tests/data/hf-qwen3-tiny)
  --tokens LIST   prefill lengths [KF_BENCH_TOKENS] (default: 4096,8192,16384)
  --chunk C       chunk size (default: 512)
  --budget B      QUOKA budget, keys per KV head or a fraction (default: 1024)
  --history LIST  histories of the attention benchmark (default: 4096,16384,65536)
  --threads T     OMP/OpenBLAS threads [KF_BENCH_THREADS] (default: nproc)
  --repeat R      timed runs per measurement [KF_BENCH_REPEAT] (default: 1)
  --accuracy      also run the accuracy table (a few minutes)
  --kvfold BIN    kvfold binary [KVFOLD_BIN] (default: build/kvfold)
  -h, --help      show this help
EOF
}

model="${KF_BENCH_MODEL:-$ROOT/tests/data/hf-qwen3-tiny}"
tokens="${KF_BENCH_TOKENS:-4096,8192,16384}"
threads="${KF_BENCH_THREADS:-$(nproc)}"
repeat="${KF_BENCH_REPEAT:-1}"
kvfold="${KVFOLD_BIN:-$ROOT/build/kvfold}"
chunk=512
budget=1024
history=4096,16384,65536
accuracy=0

die() { echo "bench-quoka.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --accuracy) accuracy=1; shift ;;
        --model|--tokens|--threads|--repeat|--kvfold|--chunk|--budget|--history)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                --model) model="$2" ;; --tokens) tokens="$2" ;; --threads) threads="$2" ;;
                --repeat) repeat="$2" ;; --kvfold) kvfold="$2" ;; --chunk) chunk="$2" ;;
                --budget) budget="$2" ;; --history) history="$2" ;;
            esac
            shift 2 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
done

[[ -x "$kvfold" ]] || die "kvfold binary not found: $kvfold (build it, or pass --kvfold)"
[[ -f "$model/config.json" ]] || die "not a model directory: $model"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$threads'"
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || die "--repeat must be a positive integer, got '$repeat'"
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"

echo "== attention: one chunk of $chunk queries, dense vs QUOKA (budget $budget)"
"$kvfold" bench attention --history "$history" --chunk "$chunk" --quoka-budget "$budget" --repeat 3 | grep -v '^ratio '

rate() { awk '$1 == "tokens_per_s" { v = $2 } END { if (v == "") exit 1; print v }'; }
rows=()
IFS=',' read -r -a counts <<< "$tokens"
for n in "${counts[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "bad token count '$n'"
    echo "== prefill $n tokens, $threads threads" >&2
    d_out="$("$kvfold" bench prefill --model "$model" --tokens "$n" --chunk "$chunk" --repeat "$repeat")" \
        || die "kvfold bench prefill (dense) failed for $n tokens"
    echo "$d_out" >&2
    q_out="$("$kvfold" bench prefill --model "$model" --tokens "$n" --chunk "$chunk" --repeat "$repeat" \
        --prefill quoka --quoka-budget "$budget")" || die "kvfold bench prefill (quoka) failed for $n tokens"
    echo "$q_out" >&2
    rows+=("$n $(rate <<< "$d_out") $(rate <<< "$q_out")")
done
echo
echo "whole prefill: model $model, chunk $chunk, budget $budget, threads $threads, repeat $repeat (median)"
printf '%8s %14s %14s %10s\n' tokens "dense tok/s" "quoka tok/s" ratio
for row in "${rows[@]}"; do
    read -r n d q <<< "$row"
    awk -v n="$n" -v d="$d" -v q="$q" 'BEGIN { printf "%8d %14.1f %14.1f %9.2fx\n", n, d, q, q / d }'
done

if [[ "$accuracy" == 1 ]]; then
    echo
    echo "== accuracy on records-qwen3"
    "$kvfold" bench quoka --model "$ROOT/tests/data/records-qwen3" --docs "$ROOT/tests/data/records-dev.jsonl"
fi
