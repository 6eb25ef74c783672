#!/usr/bin/env bash
# Installs node-llama-cpp 3.21.1 with its prebuilt Linux x64 CPU binaries into BUILD_DIR/llamacpp
# (npm ci of tools/llamacpp/package-lock.json), unless that exact lock is installed there already.
# No install scripts run (node-llama-cpp's would try to download or build llama.cpp) and the
# optional CUDA/Vulkan/other-platform binaries are left out.
#
#   tools/llamacpp/install.sh BUILD_DIR
#
# Exit status: 0 installed (or already there), 77 npm is missing or could not install (offline,
# registry unreachable, not Linux x64), 2 usage.
set -euo pipefail
src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ $# -eq 1 ]] || { echo "usage: tools/llamacpp/install.sh BUILD_DIR" >&2; exit 2; }
dest="$1/llamacpp"

# The marker is the lock, copied once npm ci has finished: an interrupted install is redone.
if [[ -d "$dest/node_modules/node-llama-cpp" ]] && cmp -s "$src/package-lock.json" "$dest/installed.lock"; then
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    echo "install.sh: npm not found (Debian: apt-get install nodejs npm)" >&2
    exit 77
fi
mkdir -p "$dest"
rm -rf "$dest/node_modules" "$dest/installed.lock"
cp "$src/package.json" "$src/package-lock.json" "$dest/"
echo "install.sh: npm ci node-llama-cpp 3.21.1 into $dest (about 85 MB)" >&2
if ! (cd "$dest" && npm ci --omit=optional --ignore-scripts --fetch-retries=1 --no-audit --no-fund --loglevel=error >&2); then
    rm -rf "$dest/node_modules"
    echo "install.sh: npm ci failed (registry unreachable, or not Linux x64 with glibc?)" >&2
    exit 77
fi
cp "$src/package-lock.json" "$dest/installed.lock"
