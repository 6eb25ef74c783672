#!/usr/bin/env bash
# Prefill throughput of kvfold next to llama.cpp (node-llama-cpp 3.21.1's prebuilt CPU build), same
# model converted to GGUF in F32 and BF16, same token counts, same thread count, in the same run:
# the ratios are the numbers to read, absolute rates depend on the machine and its load.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<EOF
Usage: tools/bench-llamacpp.sh [--model DIR] [--tokens LIST] [--threads T] [--repeat R]
                               [--kvfold BIN] [--build DIR] [--work DIR] [--flash auto|on|off]
                               [--kv-cache f16|f32] [--python PY]

Converts the model to GGUF twice (tools/gguf-write.py: F32, BF16), checks the conversion (the
next-token logits of llama.cpp F32 after 32 random ids against 'kvfold logits', within 1e-3 up to
a constant, llama.cpp run with an F32 KV cache and no flash attention so that only summation
order differs), then for each N runs 'kvfold bench prefill --model DIR --tokens N' and
llama.cpp's prefill of N random ids (one batch of N, one warm-up, median of R, the last position's
next token computed) on the F32 and the BF16 file, all with T threads. Prints a table (tokens/s,
peak resident memory, ratios) and as its last line
  kvfold vs llama.cpp bf16 prefill: R
with R the geometric mean over the token counts of kvfold tok/s over llama.cpp BF16 tok/s.

Options (environment variable in brackets):
  --model DIR     Hugging Face model directory, qwen3 or llama [KF_BENCH_MODEL]
                  (default: tests/data/hf-qwen3-tiny; tools/make-random-model.py makes bigger ones)
  --tokens LIST   comma-separated prompt lengths [KF_BENCH_TOKENS] (default: 512,2048)
  --threads T     threads for both [KF_BENCH_THREADS] (default: all cores, nproc)
                  kvfold gets OMP_NUM_THREADS/OPENBLAS_NUM_THREADS=T, llama.cpp n_threads=T
  --repeat R      timed runs per measurement [KF_BENCH_REPEAT] (default: 3)
  --kvfold BIN    kvfold binary [KVFOLD_BIN] (default: build/kvfold)
  --build DIR     build tree holding llamacpp/ (node-llama-cpp, installed there by
                  tools/llamacpp/install.sh when missing) (default: build)
  --work DIR      where the GGUF files go, kept (default: a temporary folder, removed at exit)
  --flash MODE    llama.cpp flash attention in the timed runs (default: auto, llama.cpp's own)
  --kv-cache T    llama.cpp KV cache type in the timed runs (default: f16, llama.cpp's own)
  --python PY     Python with numpy [KF_PYTHON] (default: /usr/bin/python3)
  -h, --help      show this help

Exit status: 0 done, 1 a run failed or the conversion check disagreed, 2 usage, 77 skipped:
node-llama-cpp is not installed and npm could not install it (no network, no npm, not Linux x64).
Nothing is downloaded after the install: node-llama-cpp runs with build 'never' and no downloads.
Peak memory (maximum resident set, GNU time) counts the whole process: for kvfold, bench prefill's
own sgemm peak measurement too; for llama.cpp, node and the weights it maps. On a loaded machine,
threads that spin while waiting lose their time slices: OpenMP's can cost kvfold several times
its throughput (see tools/bench-prefill.sh), and llama.cpp's own thread pool, which meets at a
barrier after every graph node, loses even more (a tiny model's 64-token prefill 18 times slower
with 2 threads than with 1 at a load of 7 on 2 cores). Read the load average line.
EOF
}

model="${KF_BENCH_MODEL:-$ROOT/tests/data/hf-qwen3-tiny}"
tokens="${KF_BENCH_TOKENS:-512,2048}"
threads="${KF_BENCH_THREADS:-$(nproc)}"
repeat="${KF_BENCH_REPEAT:-3}"
kvfold="${KVFOLD_BIN:-$ROOT/build/kvfold}"
build="$ROOT/build"
work=""
flash=auto
kvcache=f16
python="${KF_PYTHON:-/usr/bin/python3}"

die() { echo "bench-llamacpp.sh: $1" >&2; exit "${2:-2}"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --model|--tokens|--threads|--repeat|--kvfold|--build|--work|--flash|--kv-cache|--python)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                --model) model="$2" ;; --tokens) tokens="$2" ;; --threads) threads="$2" ;;
                --repeat) repeat="$2" ;; --kvfold) kvfold="$2" ;; --build) build="$2" ;;
                --work) work="$2" ;; --flash) flash="$2" ;; --kv-cache) kvcache="$2" ;;
                --python) python="$2" ;;
            esac
            shift 2 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
done

[[ -x "$kvfold" ]] || die "kvfold binary not found: $kvfold (build it, or pass --kvfold)"
[[ -f "$model/config.json" ]] || die "not a model directory: $model"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$threads'"
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || die "--repeat must be a positive integer, got '$repeat'"
[[ "$flash" =~ ^(auto|on|off)$ ]] || die "--flash must be auto, on or off, got '$flash'"
[[ "$kvcache" =~ ^(f16|f32)$ ]] || die "--kv-cache must be f16 or f32, got '$kvcache'"
IFS=',' read -r -a counts <<< "$tokens"
for n in "${counts[@]}"; do [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "bad token count '$n'"; done
"$python" -c 'import numpy' 2>/dev/null || die "$python cannot import numpy (pass --python)"
command -v node >/dev/null 2>&1 || die "node not found (Debian: apt-get install nodejs npm)"

rc=0
"$ROOT/tools/llamacpp/install.sh" "$build" || rc=$?
[[ $rc -eq 0 ]] || { [[ $rc -eq 77 ]] && die "skipped: node-llama-cpp is not installed and npm could not install it" 77; exit "$rc"; }
modules="$build/llamacpp"

if [[ -z "$work" ]]; then
    work="$(mktemp -d "${TMPDIR:-/tmp}/bench-llamacpp.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"

# The value of the last 'tokens_per_s <value>' line.
rate() { awk '$1 == "tokens_per_s" { v = $2 } END { if (v == "") exit 1; print v }'; }

# run OUT_VAR PEAK_VAR CMD...: stdout into OUT_VAR (and stderr), peak RSS in GB into PEAK_VAR.
run() {
    local -n out_=$1 peak_=$2
    shift 2
    local t="$work/time.txt" o
    if [[ -x /usr/bin/time ]]; then
        o="$(/usr/bin/time -f '%M' -o "$t" "$@")" || return 1
        peak_="$(awk '{ v = $1 } END { printf "%.2f", v / 1048576 }' "$t")"
    else
        o="$("$@")" || return 1
        peak_="-"
    fi
    echo "$o" >&2
    out_="$o"
}

vocab="$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$model/config.json")" \
    || die "$model/config.json: no vocab_size"
for t in f32 bf16; do
    "$python" "$ROOT/tools/gguf-write.py" "$model" "$work/$t.gguf" --type "$t" >&2 || die "GGUF conversion failed" 1
done

# The conversion check: 32 random ids, kvfold's top tokens against llama.cpp F32's log-probabilities.
ids="$("$python" -c 'import random, sys; r = random.Random(7); print(",".join(str(r.randrange(int(sys.argv[1]))) for _ in range(32)))' "$vocab")"
top=$((vocab < 256 ? vocab : 256))
"$kvfold" logits --model "$model" --ids "$ids" --format json --top "$top" > "$work/kvfold-logits.json" \
    || die "kvfold logits failed" 1
node "$ROOT/tools/llamacpp/llamacpp.mjs" logits --modules "$modules" --model "$work/f32.gguf" --ids "$ids" \
    --threads "$threads" --kv f32 --flash off > "$work/llamacpp-logits.json" || die "llama.cpp logits failed" 1
check="$("$python" "$ROOT/tools/llamacpp/compare-logits.py" "$work/kvfold-logits.json" \
    "$work/llamacpp-logits.json" --tol 1e-3)" || die "conversion check failed: $check" 1
echo "conversion check (llama.cpp F32 vs kvfold): $check" >&2

load_start="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
rows=()
for n in "${counts[@]}"; do
    echo "== $n tokens, $threads threads" >&2
    run kv_out kv_peak "$kvfold" bench prefill --model "$model" --tokens "$n" --repeat "$repeat" \
        || die "kvfold bench prefill failed for $n tokens" 1
    kv="$(rate <<< "$kv_out")" || die "no tokens_per_s line from kvfold" 1
    line="$n $kv $kv_peak"
    for t in f32 bf16; do
        run ll_out ll_peak node "$ROOT/tools/llamacpp/llamacpp.mjs" bench --modules "$modules" \
            --model "$work/$t.gguf" --tokens "$n" --threads "$threads" --repeat "$repeat" \
            --flash "$flash" --kv "$kvcache" --vocab "$vocab" || die "llama.cpp $t prefill failed for $n tokens" 1
        ll="$(rate <<< "$ll_out")" || die "no tokens_per_s line from llama.cpp $t" 1
        line+=" $ll $ll_peak"
    done
    rows+=("$line")
done

echo
echo "model: $model   threads: $threads   repeat: $repeat (median)   OMP_WAIT_POLICY: ${OMP_WAIT_POLICY:-unset}"
echo "llama.cpp: node-llama-cpp 3.21.1 CPU, batch = N, flash attention $flash, KV cache $kvcache"
echo "conversion check: $check"
echo "load average (1, 5, 15 min) at start: $load_start, at end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?') ($(getconf _NPROCESSORS_ONLN) cores)"
printf '%8s %13s %13s %13s %9s %9s %21s\n' tokens "kvfold tok/s" "llama f32" "llama bf16" "kv/f32" "kv/bf16" \
    "peak GB kv/f32/bf16"
for row in "${rows[@]}"; do
    read -r n kv kvp f32 f32p bf16 bf16p <<< "$row"
    awk -v n="$n" -v kv="$kv" -v a="$f32" -v b="$bf16" -v p="$kvp / $f32p / $bf16p" \
        'BEGIN { printf "%8d %13.1f %13.1f %13.1f %9.2f %9.2f %21s\n", n, kv, a, b, kv / a, kv / b, p }'
done
printf '%s\n' "${rows[@]}" | awk '{ s += log($2 / $6); k++ } END { printf "kvfold vs llama.cpp bf16 prefill: %.2f\n", exp(s / k) }'
