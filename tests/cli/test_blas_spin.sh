#!/bin/bash
# kvfold tunes OpenBLAS (tools/kvfold.c, openblas_tune): it shortens the idle spin (with worker
# threads and OPENBLAS_THREAD_TIMEOUT unset) and, where OpenBLAS fell back to its SSE3 kernels
# (Prescott) on an AVX-512 CPU, sets OPENBLAS_CORETYPE=SkylakeX; either runs it again once. A value
# of the user's own (or GOTO_THREAD_TIMEOUT) or a single thread means no second run for the spin;
# the spin's cases pin OPENBLAS_CORETYPE to the library's own choice so that only the spin counts. The dynamic loader's
# own trace (glibc's LD_DEBUG=files) counts the program starts: "transferring control" once per
# exec. The command must run exactly once whatever happens (its output once, its exit status).
# usage: test_blas_spin.sh KVFOLD DATA
set -u
BIN=$1; DATA=$2
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fails=0; n=0

# check WANT_STARTS ENV... -- ARGS...: kvfold ARGS under `env -u ... ENV`, WANT_STARTS program starts
check() {
    local want=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    n=$((n + 1))
    env -u OPENBLAS_THREAD_TIMEOUT -u GOTO_THREAD_TIMEOUT -u OPENBLAS_CORETYPE "${envs[@]}" LD_DEBUG=files LD_DEBUG_OUTPUT="$T/ld" \
        "$BIN" "$@" > "$T/out" 2> "$T/err"
    local rc=$? starts
    starts=$(cat "$T"/ld.* 2>/dev/null | grep -c "transferring control: ")
    rm -f "$T"/ld.*
    local why=""
    [ $rc -eq 0 ] || why="exit $rc"
    [ "$starts" -eq "$want" ] || why="$why; $starts program starts, not $want"
    [ "$(grep -c "^kvfold \|^model " "$T/out")" -eq 1 ] || why="$why; its output not exactly once"
    if [ -n "$why" ]; then
        echo "FAIL: ${envs[*]} kvfold $*: $why"; sed 's/^/    /' "$T/out" "$T/err" | head -8
        fails=$((fails + 1))
    fi
}

# The library's own kernel choice and the CPU's flags, found independently of kvfold: the same
# libopenblas.so.0 (ldd) loaded by Python's ctypes without OPENBLAS_CORETYPE, and /proc/cpuinfo.
LIB=$(ldd "$BIN" | awk '/libopenblas/ {print $3; exit}')
OWN=$(env -u OPENBLAS_CORETYPE /usr/bin/python3 -c "import ctypes, sys
l = ctypes.CDLL(sys.argv[1]); l.openblas_get_corename.restype = ctypes.c_char_p
print(l.openblas_get_corename().decode())" "$LIB")
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
want=$OWN
if [ "${OWN,,}" = prescott ]; then
    if [[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512dq "* && $flags == *" avx512vl "* ]]; then
        want=SkylakeX
    fi
fi
[ -n "$OWN" ] || { echo "FAIL: cannot ask $LIB for its kernels"; fails=$((fails + 1)); }
echo "OpenBLAS's own kernels: $OWN; kvfold's: $want"

# OpenBLAS caps its threads at the cores it may use: on a one-core machine there is nothing to shorten
threaded=2; [ "$(nproc)" -ge 2 ] || threaded=1
check $threaded OPENBLAS_NUM_THREADS=2 OPENBLAS_CORETYPE="$OWN" -- --version
check $threaded OPENBLAS_NUM_THREADS=2 OPENBLAS_CORETYPE="$OWN" -- model-info "$DATA/hf-qwen3-tiny"
check 1 OPENBLAS_NUM_THREADS=2 OPENBLAS_THREAD_TIMEOUT=6 OPENBLAS_CORETYPE="$OWN" -- --version
check 1 OPENBLAS_NUM_THREADS=2 GOTO_THREAD_TIMEOUT=6 OPENBLAS_CORETYPE="$OWN" -- --version
check 1 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE="$OWN" -- --version

# the kernels: kvfold's choice when unset (one more start where it differs from the library's own),
# the user's own value kept
starts=1; [ "$want" = "$OWN" ] || starts=2
check $starts OPENBLAS_NUM_THREADS=1 -- --version
n=$((n + 1))
grep -q "^blas: OpenBLAS, $want kernels" "$T/out" || { echo "FAIL: kernels unset: $(cat "$T/out")"; fails=$((fails + 1)); }
check 1 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Prescott -- --version
n=$((n + 1))
grep -q "^blas: OpenBLAS, Prescott kernels" "$T/out" || { echo "FAIL: Prescott asked: $(cat "$T/out")"; fails=$((fails + 1)); }
echo "$((n - fails)) passed, $fails failed"
[ $fails -eq 0 ]
