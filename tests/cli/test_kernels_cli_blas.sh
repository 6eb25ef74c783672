#!/bin/bash
# The CPU kernels' same-bits checks (test_kernels) under the OpenBLAS kernels the kvfold command
# runs with: where OpenBLAS falls back to its SSE3 kernels on an AVX-512 CPU, kvfold asks for its
# AVX-512 ones (tools/kvfold.c), which add a small-matrix path; the rows' bits must not depend on
# the call or the threads there either. `kvfold --version` names the kernels; on a machine where
# they are the library's own this is test_kernels again. It also names the path of the values'
# normal equations.
# usage: test_kernels_cli_blas.sh KVFOLD TEST_KERNELS
set -u
core=$(env -u OPENBLAS_CORETYPE "$1" --version | sed -n 's/^blas: OpenBLAS, \(.*\) kernels.*/\1/p')
[ -n "$core" ] || { echo "FAIL: kvfold --version names no kernels"; exit 1; }
echo "kvfold's kernels: $core"
# The values' normal equations (kernels/cpu/gram_bf16.c) run on AVX-512 BF16 exactly where the CPU
# has it.
want="ssyrk and sgemm"
grep -qw avx512_bf16 /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && want="AVX-512 BF16"
path=$("$1" --version | sed -n "s/^solve: the values' normal equations through //p")
[ "$path" = "$want" ] || { echo "FAIL: kvfold --version says the values' normal equations run through '$path', the CPU's flags '$want'"; exit 1; }
echo "the values' normal equations: $path"
OPENBLAS_CORETYPE=$core "$2"
