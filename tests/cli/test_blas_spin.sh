#!/bin/bash
# kvfold shortens OpenBLAS's idle spin (tools/kvfold.c, openblas_tune): with worker threads and
# OPENBLAS_THREAD_TIMEOUT unset it runs itself again once, the variable set; a value of the user's
# own (or GOTO_THREAD_TIMEOUT) or a single thread means no second run. It keeps OpenBLAS's own
# kernels (OPENBLAS_CORETYPE is the user's) and --version names them. The dynamic loader's
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

# The library's own kernel choice, found independently of kvfold: the same
# libopenblas.so.0 (ldd) loaded by Python's ctypes without OPENBLAS_CORETYPE.
LIB=$(ldd "$BIN" | awk '/libopenblas/ {print $3; exit}')
OWN=$(env -u OPENBLAS_CORETYPE /usr/bin/python3 -c "import ctypes, sys
l = ctypes.CDLL(sys.argv[1]); l.openblas_get_corename.restype = ctypes.c_char_p
print(l.openblas_get_corename().decode())" "$LIB")
want=$OWN
[ -n "$OWN" ] || { echo "FAIL: cannot ask $LIB for its kernels"; fails=$((fails + 1)); }
echo "OpenBLAS's own kernels: $OWN"

# OpenBLAS caps its threads at the cores it may use: on a one-core machine there is nothing to shorten
threaded=2; [ "$(nproc)" -ge 2 ] || threaded=1
check $threaded OPENBLAS_NUM_THREADS=2 OPENBLAS_CORETYPE="$OWN" -- --version
check $threaded OPENBLAS_NUM_THREADS=2 OPENBLAS_CORETYPE="$OWN" -- model-info "$DATA/hf-qwen3-tiny"
check 1 OPENBLAS_NUM_THREADS=2 OPENBLAS_THREAD_TIMEOUT=6 OPENBLAS_CORETYPE="$OWN" -- --version
check 1 OPENBLAS_NUM_THREADS=2 GOTO_THREAD_TIMEOUT=6 OPENBLAS_CORETYPE="$OWN" -- --version
check 1 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE="$OWN" -- --version

# the kernels: the library's own when unset, the user's when set
check 1 OPENBLAS_NUM_THREADS=1 -- --version
n=$((n + 1))
grep -q "^blas: OpenBLAS, $want kernels" "$T/out" || { echo "FAIL: kernels unset: $(cat "$T/out")"; fails=$((fails + 1)); }
check 1 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Prescott -- --version
n=$((n + 1))
grep -q "^blas: OpenBLAS, Prescott kernels" "$T/out" || { echo "FAIL: Prescott asked: $(cat "$T/out")"; fails=$((fails + 1)); }
echo "$((n - fails)) passed, $fails failed"
[ $fails -eq 0 ]
