#!/bin/bash
# The usage errors of kvfold compact, eval quality and bench compact: a bad value, a missing or
# conflicting option, an unreadable input named by an option. Each must exit with the usage status
# (2), print nothing on stdout, name the option (or say what is wrong) on stderr and point to the
# command's --help. Each command's --help must exit 0 and document every option checked here. The
# compaction options that the three commands share (tools/cli_quality.h) are checked on each
# command that takes them, and refused as unknown by bench compact where it does not.
# usage: test_usage_errors.sh KVFOLD DATA
set -u
BIN=$1; DATA=$2
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
cd "$T" || exit 1
M=$DATA/records-qwen3; D=$DATA/records-dev.jsonl
fails=0; n=0

# expect_usage CMD WANT ARGS...: CMD is the command's name in messages ("compact", "eval quality", ...)
expect_usage() {
    local cmd=$1 want=$2; shift 2
    n=$((n + 1))
    "$BIN" "$@" > out 2> err
    local rc=$?
    local why=""
    [ $rc -eq 2 ] || why="exit $rc, not 2"
    [ -s out ] && why="$why; wrote on stdout"
    grep -qF -- "$want" err || why="$why; stderr does not say '$want'"
    grep -qxF "Try 'kvfold $cmd --help'." err || grep -qF "unrecognized option" err || why="$why; no pointer to --help"
    if [ -n "$why" ]; then
        echo "FAIL: kvfold $*: $why"; sed 's/^/    /' err | head -5
        fails=$((fails + 1))
    fi
}

# expect_help CMD FLAG...: --help exits 0 with the usage on stdout naming every FLAG
expect_help() {
    local cmd=$1; shift
    n=$((n + 1))
    # shellcheck disable=SC2086
    "$BIN" $cmd --help > out 2> err
    local rc=$? why=""
    [ $rc -eq 0 ] || why="exit $rc"
    head -1 out | grep -q "^Usage: kvfold $cmd " || why="$why; no usage line"
    for f in "$@"; do
        grep -qE -- "(^| )$f( |$|=)" out || why="$why; $f not documented"
    done
    [ -z "$why" ] || { echo "FAIL: kvfold $cmd --help:$why"; fails=$((fails + 1)); }
}

# bad values of the shared compaction options: FLAG VALUE
SHARED_ALL=(--head-choice maybe --value-ridge -1 --ridge-to one --beta-fit lbfgs --val-frac 0.95 --refit some
            --choice-margin 11 --lambda -1 --chunk 0)
SHARED_BENCH=(--max-queries 0 --refq-dtype f16 --arena-dtype f16 --queries self --repeat-fraction 0
              --repeat-spans 65 --weights fp16 --prefill sparse --quoka-nq 0 --quoka-budget 1.5
              --quoka-sinks -1 --quoka-margin -2)

C=(compact --model "$M" --out root)
E=(eval quality --model "$M" --docs "$D" --method full --limit 1)
B=(bench compact --model "$M" --docs "$D" --tokens 64)
# shared FLAG VALUE pairs on the three commands; bench compact's message is BENCH_WANT (%s: the flag)
shared() {
    local bench_want=$1; shift
    local a=("$@")
    for ((i = 0; i < ${#a[@]}; i += 2)); do
        local f=${a[i]} v=${a[i + 1]}
        expect_usage compact "$f" "${C[@]}" "$f" "$v" doc.txt
        expect_usage "eval quality" "$f" "${E[@]}" "$f" "$v"
        # shellcheck disable=SC2059
        expect_usage "bench compact" "$(printf "$bench_want" "$f")" "${B[@]}" "$f" "$v"
    done
}
shared "unrecognized option '%s'" "${SHARED_ALL[@]}"
shared "%s" "${SHARED_BENCH[@]}"
expect_usage compact "--repeat-fraction" "${C[@]}" --queries context --repeat-fraction 0.5 doc.txt
expect_usage "eval quality" "--repeat-fraction" "${E[@]}" --repeat-fraction 0.5 --queries context

# compact's own options
expect_usage compact "--method" "${C[@]}" --method fold,cut doc.txt
expect_usage compact "--budget" "${C[@]}" --budget 0.1,1.5 doc.txt
expect_usage compact "given twice" "${C[@]}" --budget 0.1,0.1 doc.txt
expect_usage compact "--shard" "${C[@]}" --shard 2/2 doc.txt
expect_usage compact "--repeat-instruction" "${C[@]}" --repeat-instruction "" doc.txt
expect_usage compact "--dtype" "${C[@]}" --dtype f64 doc.txt
expect_usage compact "--model" compact --out root doc.txt
expect_usage compact "--manifest" "${C[@]}"
expect_usage compact "--manifest" "${C[@]}" --manifest docs.jsonl doc.txt
expect_usage compact "--manifest" "${C[@]}" --manifest missing.jsonl
expect_usage compact "--manifest" "${C[@]}" --manifest .
expect_usage compact "--probes-from" "${C[@]}" --probes-from missing.txt doc.txt
expect_usage compact "unrecognized option '--docs'" "${C[@]}" --docs "$D" doc.txt
expect_usage compact "--progress-interval" "${C[@]}" --progress-interval -1 doc.txt
expect_usage compact "--progress-interval" "${C[@]}" --progress-interval soon doc.txt
expect_usage compact "--lambda must be a finite non-negative number, not 'inf'" "${C[@]}" --lambda inf doc.txt
expect_usage compact "--budget '0.5,,0.1' has an empty item" "${C[@]}" --budget 0.5,,0.1 doc.txt
expect_usage compact "--budget '0.5,' has an empty item" "${C[@]}" --budget 0.5, doc.txt
expect_usage compact "--method 'fold,,am' has an empty item" "${C[@]}" --method fold,,am doc.txt
expect_usage compact "--max-line-bytes must be a byte count" "${C[@]}" --max-line-bytes 1 doc.txt
expect_usage compact "--manifest /dev/zero: cannot read: a device, not a file or a pipe" "${C[@]}" --manifest /dev/zero
expect_usage compact "--probes-from /dev/zero: cannot read: a device" "${C[@]}" --probes-from /dev/zero doc.txt
[ ! -e root ] || { echo "FAIL: a usage error created the output root"; fails=$((fails + 1)); }

# eval quality's own options
expect_usage "eval quality" "--budget: fractions" "${E[@]}" --budget 0.1,0
expect_usage "eval quality" "--method: full, keep" "${E[@]}" --method full,cut
expect_usage "eval quality" "--method: full, keep" "${E[@]}" --method fold,fold
# the old spellings, kept for one release: parsed as the new ones, after a note naming them
expect_usage "eval quality" "note: --budgets 0.1,0 is now --budget" "${E[@]}" --budgets 0.1,0
expect_usage "eval quality" "--method: full, keep, drop, am or fold, each once, not 'cut'" "${E[@]}" --methods full,cut
expect_usage "eval quality" "--probes" "${E[@]}" --probes -1
expect_usage "eval quality" "--probe-form" "${E[@]}" --probe-form answer
expect_usage "eval quality" "--limit" "${E[@]}" --limit 0
expect_usage "eval quality" "--format" "${E[@]}" --format csv
expect_usage "eval quality" "--fold-queries" "${E[@]}" --fold-queries some
expect_usage "eval quality" "--docs" eval quality --model "$M"
expect_usage "eval quality" "--progress-interval" "${E[@]}" --progress-interval -1
expect_usage "eval quality" "--lambda must be a finite non-negative number, not 'inf'" "${E[@]}" --lambda inf
expect_usage eval "unknown evaluation" eval speed

# bench compact's own options
expect_usage "bench compact" "--tokens must be from 16 to 16777216 (2^24), not '8'" "${B[@]}" --tokens 8
expect_usage "bench compact" "--tokens must be from 16 to 16777216 (2^24), not '100000000'" "${B[@]}" --tokens 100000000
expect_usage "bench compact" "--budget" "${B[@]}" --budget 0
expect_usage "bench compact" "--method" "${B[@]}" --method cut
expect_usage "bench compact" "--docs" bench compact --model "$M"

# bench prefill's weights
expect_usage "bench prefill" "--weights" bench prefill --model "$M" --weights fp16
expect_usage "bench prefill" "--compare-weights" bench prefill --model "$M" --compare-weights --context 16

flags() { local a=("$@") out=(); for ((i = 0; i < ${#a[@]}; i += 2)); do out+=("${a[i]}"); done; echo "${out[@]}"; }
# shellcheck disable=SC2046
expect_help compact $(flags "${SHARED_ALL[@]}") $(flags "${SHARED_BENCH[@]}") --method --budget --shard \
    --repeat-instruction --dtype --model --manifest --probes-from --out --no-share --quiet --progress-interval --max-line-bytes
# shellcheck disable=SC2046
expect_help "eval quality" $(flags "${SHARED_ALL[@]}") $(flags "${SHARED_BENCH[@]}") --budget --method \
    --probes --probe-form --limit --format --fold-queries --model --docs --per-head --head-budgets --probes-out \
    --quiet --progress-interval
# shellcheck disable=SC2046
expect_help "bench compact" $(flags "${SHARED_BENCH[@]}") --tokens --budget --method --model --docs --predict-only

echo "$((n - fails)) passed, $fails failed"
[ $fails -eq 0 ]
