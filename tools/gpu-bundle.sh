#!/usr/bin/env bash
# tools/gpu-bundle.sh — packs a CUDA build made on this machine for a device machine whose image
# lacks kvfold's build dependencies (OpenBLAS, LAPACKE, jansson, HDF5, CUnit, ...): kvfold and
# test_cuda plus the shared libraries they need, minus the C runtime and the CUDA libraries
# (those come from the device's own CUDA 13), xz-compressed to fit the 64 MiB carry limit.
#
#   tools/gpu-bundle.sh [BUILD_DIR]   -> .gpu-bundle/kvfold-gpu.tar.xz (ignored by git)
# then carry ".gpu-bundle" in the device call; tools/gpu-check.sh unpacks it when it cannot build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-cuda}
cd "$root"
if [ ! -x "$build/kvfold" ] || [ ! -x "$build/tests/test_cuda" ]; then
  cmake -S . -B "$build" -DKVFOLD_CUDA=ON -DCMAKE_BUILD_TYPE=Release
  cmake --build "$build" -j2 --target kvfold test_cuda
fi
grep -qx '/.gpu-bundle/' .git/info/exclude 2>/dev/null || echo '/.gpu-bundle/' >> .git/info/exclude
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" .gpu-bundle
cp "$build/kvfold" "$build/tests/test_cuda" "$stage/bin/"
for exe in "$stage"/bin/*; do
  ldd "$exe" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
    libcudart.so*|libcublas*|libcuda.so*) ;;
    *) cp -L "$lib" "$stage/lib/" ;;
  esac
done
tar -C "$stage" -cJf .gpu-bundle/kvfold-gpu.tar.xz bin lib
ls -l .gpu-bundle/kvfold-gpu.tar.xz
