#!/usr/bin/env bash
# tools/gpu-check.sh — the whole GPU check in one call on an H200 (nvidia-h200 device).
#
#   tools/gpu-check.sh [all|test|bench]      (default all; logs under $OUT, the table printed last)
#
#   1. build   cmake -DKVFOLD_CUDA=ON (sm_90 + PTX) when the image has kvfold's dependencies;
#              otherwise the build carried in .gpu-bundle/ (tools/gpu-bundle.sh, made here)
#   2. test    test_cuda: every CUDA op against the CPU backend on fresh random inputs (outputs
#              poisoned first), the FlashAttention tolerance rule, hf-qwen3-tiny and
#              hf-llama3-tiny-random goldens end to end (dense and QUOKA)
#   3. bench   prefill of a random-weight Qwen3-4B-shaped model at 4k/16k/32k (dense and QUOKA,
#              B_KV 1024, chunk 4096), one attention chunk of 4096 queries against 32k and 128k
#              keys (dense, QUOKA with selection), and the same through PyTorch (transformers
#              prefill, SDPA) when torch is there; tests/data/FIXTURES.md's figures beside them
#
# Everything is bounded so that one device call (600 s) holds it: each step has a timeout and the
# script stops starting steps when less than a minute is left. Leaves the card's settings alone.
set -uo pipefail
mode=${1:-all}
T0=$SECONDS
LIMIT=${GPU_CHECK_LIMIT:-570}     # seconds for the whole script
REPEAT=${GPU_CHECK_REPEAT:-1}     # timed prefill runs after the warm-up
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-/tmp/kvfold-gpu-check}
mkdir -p "$OUT"
MODEL=${GPU_CHECK_MODEL:-/tmp/kvfold-qwen3-4b-random}
export KF_TEST_DATA=$ROOT/tests/data OMP_NUM_THREADS=8 OPENBLAS_NUM_THREADS=8 PYTHONUNBUFFERED=1
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

say() { echo "== $(date +%T) [$((SECONDS - T0)) s] $*" | tee -a "$SUMMARY"; }
left() { echo $((LIMIT - (SECONDS - T0))); }
# run_step NAME MAX_SECONDS CMD...: output to $OUT/NAME.log, bounded by the time left
run_step() {
  local name=$1 max=$2 l
  shift 2
  l=$(left)
  if [ "$l" -lt 60 ]; then
    say "$name: skipped, ${l}s left"
    return 124
  fi
  [ "$max" -gt $((l - 30)) ] && max=$((l - 30))
  say "$name (limit ${max}s): $*"
  timeout -k 10 "$max" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc"
  return $rc
}

# ---- environment ------------------------------------------------------------------------------
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  command -v nvcc && nvcc --version | tail -2
  uname -a
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
} >"$OUT/env.txt" 2>&1
say "$(head -2 "$OUT/env.txt" | tail -1)"

# ---- 1. build ---------------------------------------------------------------------------------
BIN=
deps="openblas lapacke jansson libxxhash cunit libpcre2-8 libutf8proc hdf5-serial"
if command -v nvcc >/dev/null && pkg-config --exists $deps 2>/dev/null; then
  gen=; command -v ninja >/dev/null && gen="-G Ninja"
  if run_step build 300 bash -c "cmake -S . -B build-gpu $gen -DKVFOLD_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build-gpu -j16 --target kvfold test_cuda"; then
    BIN=build-gpu
    TEST_CUDA=build-gpu/tests/test_cuda
  fi
else
  say "build: the image lacks nvcc or some of: $deps (pkg-config); using the carried bundle"
fi
if [ -z "$BIN" ] && [ -f .gpu-bundle/kvfold-gpu.tar.xz ]; then
  mkdir -p /tmp/kvfold-bundle && tar -C /tmp/kvfold-bundle -xJf .gpu-bundle/kvfold-gpu.tar.xz
  cudalibs=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(nvidia.cublas.__path__[0], "lib"))' 2>/dev/null)
  export LD_LIBRARY_PATH=/tmp/kvfold-bundle/lib:/usr/local/cuda/lib64:${cudalibs:+$cudalibs:}${LD_LIBRARY_PATH:-}
  BIN=/tmp/kvfold-bundle/bin
  TEST_CUDA=$BIN/test_cuda
  say "build: carried bundle; ldd: $(ldd $BIN/kvfold | grep -c 'not found') libraries not found"
  ldd $BIN/kvfold >"$OUT/ldd.txt" 2>&1
fi
if [ -z "$BIN" ]; then
  say "no kvfold build: see $OUT/build.log (or carry .gpu-bundle made by tools/gpu-bundle.sh)"
  exit 1
fi
KV=$BIN/kvfold

# ---- 2. correctness ---------------------------------------------------------------------------
if [ "$mode" != bench ]; then
  run_step test_cuda 180 "$TEST_CUDA"
  echo "test_cuda: exit $? ($(grep -E '^test_cuda: ' "$OUT/test_cuda.log" | tail -1))" >>"$OUT/table.txt"
  grep -E 'FAIL' "$OUT/test_cuda.log" | head -20 | tee -a "$SUMMARY"
  run_step logits_cuda 60 "$KV" logits --model tests/data/hf-qwen3-tiny --ids 1,2,3,4,5,6,7,8 --device cuda
  run_step logits_cpu 60 "$KV" logits --model tests/data/hf-qwen3-tiny --ids 1,2,3,4,5,6,7,8 --device cpu
fi
[ "$mode" = test ] && { cat "$OUT/table.txt"; exit 0; }

# ---- 3. benchmarks ----------------------------------------------------------------------------
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >"$OUT/clocks-before.txt" 2>&1
run_step attention 120 "$TEST_CUDA" bench-attention --history 32768,131072 --chunk 4096 --repeat 5
have_torch=0
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && have_torch=1
[ "$have_torch" = 1 ] && run_step torch_sdpa 90 python3 tools/gpu-ref-torch.py sdpa 32768,131072
if [ ! -f "$MODEL/model.safetensors" ]; then
  run_step make_model 150 python3 tools/make-random-model.py "$MODEL"
fi
for n in 4096 16384 32768; do
  run_step "prefill_dense_$n" 150 "$KV" bench prefill --model "$MODEL" --tokens $n --chunk 4096 --repeat "$REPEAT" --device cuda
  run_step "prefill_quoka_$n" 150 "$KV" bench prefill --model "$MODEL" --tokens $n --chunk 4096 --repeat "$REPEAT" --device cuda \
    --prefill quoka --quoka-budget 1024
done
if [ "$have_torch" = 1 ]; then
  run_step torch_prefill 180 python3 tools/gpu-ref-torch.py prefill 4096,16384,32768
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >"$OUT/clocks-after.txt" 2>&1

# ---- the table --------------------------------------------------------------------------------
med() { sed -n 's/.*median \([0-9.]*\) s.*/\1/p' "$OUT/$1.log" 2>/dev/null | tail -1; }
ref() { awk -v k="$1" -v n="$2" '$1 == "ref" && $2 == k && $3 == n {print $4}' "$OUT"/torch_*.log 2>/dev/null | tail -1; }
att() { awk -v n="$1" -v f="$2" '$1 == "attn" && $2 == n {for (i = 3; i < NF; i++) if ($i == f) print $(i + 1)}' "$OUT/attention.log" 2>/dev/null; }
ratio() { [ -n "$1" ] && [ -n "$2" ] && awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.2fx", a / b}'; }
{
  echo
  echo "prefill, Qwen3-4B shapes, random bf16 weights, chunk 4096 (seconds; speedup = transformers / kvfold)"
  printf "%7s %10s %10s %13s %13s %11s %11s\n" tokens dense quoka transformers "FIXTURES ref" "dense spd" "quoka spd"
  i=0
  for n in 4096 16384 32768; do
    refs=(0.091 0.449 1.131)
    d=$(med prefill_dense_$n); q=$(med prefill_quoka_$n); t=$(ref prefill $n)
    base=${t:-${refs[$i]}}
    printf "%7s %10s %10s %13s %13s %11s %11s\n" $n "${d:--}" "${q:--}" "${t:--}" "${refs[$i]}" \
      "$(ratio "$base" "$d")" "$(ratio "$base" "$q")"
    i=$((i + 1))
  done
  echo "targets at 32k: dense >= 1.2x, QUOKA >= 2x"
  echo
  echo "attention chunk: 4096 queries, 32/8 heads, head_dim 128 (ms; speedup = SDPA / kvfold)"
  printf "%7s %10s %10s %10s %10s %11s %11s\n" keys dense quoka select "SDPA" "FIXTURES ref" "quoka spd"
  i=0
  for n in 32768 131072; do
    refs=(3.21 14.1)
    s=$(ref sdpa $n); s=${s:+$(awk -v x="$s" 'BEGIN {printf "%.3f", x * 1e3}')}
    q=$(att $n quoka_ms)
    printf "%7s %10s %10s %10s %10s %11s %11s\n" $n "$(att $n dense_ms)" "${q:--}" "$(att $n select_ms)" "${s:--}" \
      "${refs[$i]}" "$(ratio "${s:-${refs[$i]}}" "$q")"
    i=$((i + 1))
  done
  echo "target at 128k keys: QUOKA (selection included) >= 5x faster than SDPA"
  echo "TFLOP/s of each kernel: $OUT/attention.log; H200 ceilings measured here before: ~790 TFLOP/s bf16 GEMM, ~4.3 TB/s copy"
} >>"$OUT/table.txt"
say "done in $((SECONDS - T0)) s; logs in $OUT"
cat "$OUT/table.txt"
