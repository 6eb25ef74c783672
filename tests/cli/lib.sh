# lib.sh — what the tests/cli/*.sh scripts share: sourced after `set -uo pipefail`.
#   check NAME CONDITION...   runs CONDITION; prints "ok   NAME" or "FAIL NAME" and counts failures
#   has FILE TEXT / hasnt FILE TEXT   whether FILE holds TEXT (fixed string)
#   finish                    prints the count of failures; exits 1 when any
fails=0
check() {
    local name=$1
    shift
    if "$@"; then echo "ok   $name"; else echo "FAIL $name"; fails=$((fails + 1)); fi
}
has() { grep -qF -- "$2" "$1"; }
hasnt() { ! grep -qF -- "$2" "$1"; }
finish() {
    echo "$fails failed"
    exit $((fails > 0))
}
