#!/usr/bin/env bash
# tools/slurm/compact.sbatch against a real Slurm: munge, slurmctld and slurmd from Debian's
# packages, started here on localhost with a configuration in a temporary directory (no cgroups),
# and stopped again whatever happens. Fails (never skips) when they cannot start.
#
#   A  a 3-task array over 12 records documents: one valid file per document, nothing else left,
#      the tasks' summary lines add up
#   B  the same into a fresh root while two readers load every file that appears through the
#      connector's load path; task 1 is held in the middle of a file (tests/slurm/stall.c),
#      cancelled (scancel), checked, requeued (scontrol requeue) and checked again
#   C  A's array again: everything skipped, no file touched
#   D  exit codes: a bad manifest line (1), an array that is not 0..N-1 (2), a document claimed by
#      another worker past the waits (75)
#   E  a writer killed outright (SIGKILL): the next task removes its temporary and lock files
#
# Usage: test_slurm.sh KVFOLD_BIN TEST_DATA_DIR STALL_SO   (KVFOLD_EXT_DIR: the extension's folder)
set -uo pipefail
kvfold=$(realpath "$1")
data=$(realpath "$2")
stall_so=$(realpath "$3")
model=$data/records-qwen3
here=$(cd "$(dirname "$0")" && pwd)
sbatch_script=$(cd "$here/../../tools/slurm" && pwd)/compact.sbatch
check_py=$here/slurm_check.py
py=/usr/bin/python3
budget_s=170 # the whole test, daemons included; ctest's timeout is a backstop above it
t_start=$SECONDS
fails=0

# an outer Slurm's variables must not leak into this cluster's commands
for v in $(compgen -e | grep -E '^(SLURM|SBATCH|SALLOC|SRUN|SQUEUE|SCANCEL|SINFO)_'); do unset "$v"; done
T=$(mktemp -d /tmp/kvfold-slurm.XXXXXX)
export SLURM_CONF=$T/slurm.conf
pids_started=()
reader_pids=()

ok() { printf 'ok   %-4s %s\n' "$((SECONDS - t_start))s" "$*"; }
fail() {
    printf 'FAIL %-4s %s\n' "$((SECONDS - t_start))s" "$*"
    fails=$((fails + 1))
}
check() { # check NAME COMMAND...
    local name=$1
    shift
    if "$@"; then ok "$name"; else fail "$name"; fi
}
left() { echo $((budget_s - (SECONDS - t_start))); }
show_logs() {
    for f in "$T"/log/*.log "$T"/logs/*.out; do
        [ -f "$f" ] && { echo "--- $f (last 15 lines)"; tail -n 15 "$f"; }
    done
}
die() {
    echo "FAIL $*"
    show_logs
    exit 1
}

cleanup() {
    local p
    for p in "${reader_pids[@]}"; do kill "$p" 2>/dev/null; done
    if [ -f "$T/run/slurmctld.pid" ]; then
        scancel --quiet --full --user=root 2>/dev/null # every job of this private cluster
        for _ in $(seq 1 40); do
            [ -z "$(squeue -h 2>/dev/null)" ] && break
            sleep 0.25
        done
    fi
    # the daemons by the pids they wrote or we recorded, never by name
    for f in "$T/run/slurmd.pid" "$T/run/slurmctld.pid" "$T/munge-run/munged.pid"; do
        [ -f "$f" ] && pids_started+=("$(cat "$f")")
    done
    for p in "${pids_started[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${pids_started[@]}"; do
        for _ in $(seq 1 40); do
            kill -0 "$p" 2>/dev/null || break
            sleep 0.25
        done
        if kill -0 "$p" 2>/dev/null; then
            echo "daemon $p did not stop on SIGTERM; SIGKILL"
            kill -KILL "$p" 2>/dev/null
        fi
    done
    if [ -n "${KF_SLURM_KEEP:-}" ]; then echo "kept $T"; else rm -rf "$T"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# ---------------------------------------------------------------- the daemons
for c in munged munge unmunge slurmctld slurmd sbatch squeue scontrol scancel sinfo flock; do
    command -v "$c" >/dev/null ||
        die "'$c' not found: install munge slurmctld slurmd slurm-client (tools/setup.sh --tests does)"
done
[ "$(id -u)" = 0 ] || die "must run as root: slurmd starts the jobs, here as root (SlurmUser=root)"
host=$(hostname -s)
read -r port1 port2 < <($py -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
mkdir -p "$T"/{munge-run,log,state,spool,run,logs}
head -c 1024 /dev/urandom >"$T/munge.key"
chmod 400 "$T/munge.key"
sock=$T/munge-run/munge.socket
# -f: munged calls a log folder not owned by the munge user "insecure" and would refuse it
munged --key-file="$T/munge.key" --socket="$sock" --pid-file="$T/munge-run/munged.pid" \
    --log-file="$T/log/munge.log" --seed-file="$T/munge-run/seed" -f ||
    die "munged did not start"
munge -n -S "$sock" | unmunge -S "$sock" >/dev/null || die "munge credentials do not round-trip through $sock"
cat >"$SLURM_CONF" <<EOF
ClusterName=kvtest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$sock
CredType=cred/munge
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/run/slurmctld.pid
SlurmdPidFile=$T/run/slurmd.pid
SlurmctldPort=$port1
SlurmdPort=$port2
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(getconf _NPROCESSORS_ONLN) RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
slurmctld -f "$SLURM_CONF" || die "slurmctld did not start"
slurmd -f "$SLURM_CONF" || die "slurmd did not start"
up=0
for _ in $(seq 1 120); do
    if [ "$(sinfo -h -o %T 2>/dev/null)" = idle ]; then
        up=1
        break
    fi
    sleep 0.25
done
[ "$up" = 1 ] || die "the node is not idle after 30 s (sinfo: $(sinfo -h -o '%T %E' 2>&1))"
ok "munged, slurmctld and slurmd up on $host, ports $port1/$port2 ($((SECONDS - t_start)) s)"

# ---------------------------------------------------------------- helpers
$py "$check_py" manifest "$data/records-dev.jsonl" "$T/docs.jsonl" 12 || die "cannot write the manifest"
opts=(--budget 0.25 --max-queries 500)
export KVFOLD=$kvfold OPENBLAS_NUM_THREADS=1
cd "$T" || exit 1 # the script's logs/ are relative to the submission folder

submit() { # submit ARRAY ROOT [sbatch options] -> the job id
    local array=$1 root=$2
    shift 2
    sbatch --parsable --array="$array" "$@" "$sbatch_script" "$model" "$T/docs.jsonl" "$root" "${opts[@]}" |
        cut -d';' -f1
}
wait_job() { # wait_job JOB: until no task of the array is pending or running
    while [ -n "$(squeue -h -j "$1" 2>/dev/null)" ]; do
        [ "$(left)" -gt 0 ] || die "job $1 still queued or running when the test's time ran out"
        sleep 0.25
    done
}
states() { # states JOB -> "task=STATE:EXIT" per array task, sorted
    scontrol -o show job "$1" | sed -n 's/.*ArrayTaskId=\([0-9]*\) .*JobState=\([A-Z_]*\) .*ExitCode=\([0-9:]*\).*/\1=\2:\3/p' |
        sort -n | tr '\n' ' ' | sed 's/ $//'
}
files_in() { find "$1" -type f -name '*.kvf' | sort; }
log_of() { echo "$T/logs/kvfold-compact-$1_$2.out"; }

# ---------------------------------------------------------------- A: a 3-task array
jobA=$(submit 0-2 "$T/rootA") || die "sbatch refused the job"
wait_job "$jobA"
check "A: the three tasks completed with exit code 0 ($(states "$jobA"))" \
    test "$(states "$jobA")" = "0=COMPLETED:0:0 1=COMPLETED:0:0 2=COMPLETED:0:0"
check "A: one valid file per document, nothing else" $py "$check_py" check "$T/rootA" "$T/docs.jsonl" "$model" "$kvfold"
check "A: the summary lines add up (12 done)" $py "$check_py" summaries "$T/logs" "$jobA" "$T/docs.jsonl" 3 12 0
check "A: one log per task" test "$(find "$T/logs" -name "kvfold-compact-${jobA}_[0-2].out" | wc -l)" -eq 3
ok "A took $((SECONDS - t_start)) s since the start"

# ---------------------------------------------------------------- B: readers, scancel, requeue
mkdir -p "$T/readers"
for r in 1 2; do
    $py "$check_py" reader "$T/rootB" "$model" "$T/docs.jsonl" "$T/readers" "reader$r" 2>"$T/readers/reader$r.err" &
    reader_pids+=($!)
done
for r in 1 2; do
    for _ in $(seq 1 80); do
        [ -f "$T/readers/reader$r.ready" ] && break
        sleep 0.25
    done
    [ -f "$T/readers/reader$r.ready" ] || die "reader $r did not start: $(cat "$T/readers/reader$r.err")"
done
# the kvfold of task 1's first attempt stops for 120 s at its 2nd pwrite (kvf_write writes a file
# in 64 KiB pwrites: inside its first or second temporary file); every fsync of every task waits
# 150 ms, so the files appear spread out
cat >"$T/kvfold-stall" <<EOF
#!/bin/bash
if [ "\$SLURM_ARRAY_TASK_ID" = 1 ] && mkdir "$T/stalled" 2>/dev/null; then
    echo \$\$ >"$T/stalled/pid"
    export KF_STALL_PWRITE=2 KF_STALL_SECONDS=120 KF_STALL_MARK=$T/stalled/mark
fi
export KF_FSYNC_DELAY_MS=150 LD_PRELOAD=$stall_so
exec "$kvfold" "\$@"
EOF
chmod +x "$T/kvfold-stall"
jobB=$(KVFOLD=$T/kvfold-stall submit 0-2 "$T/rootB") || die "sbatch refused job B"
while [ ! -e "$T/stalled/mark" ] || [ "$(files_in "$T/rootB" | wc -l)" -lt 8 ] ||
    [[ "$(states "$jobB")" != "0=COMPLETED:0:0 1=RUNNING:0:0 2=COMPLETED:0:0" ]]; do
    [ "$(left)" -gt 60 ] || die "job B: task 1 never stalled beside tasks 0 and 2 done ($(states "$jobB"))"
    sleep 0.25
done
stuck=$(find "$T/rootB" -name "*.tmp-$(cat "$T/stalled/pid")-*")
check "B: task 1 is held in the middle of a temporary file (${stuck##*/})" test -n "$stuck" -a -f "$stuck"
check "B: tasks 0 and 2 done meanwhile ($(states "$jobB"))" test "$(files_in "$T/rootB" | wc -l)" -eq 8
scancel "${jobB}_1" || fail "scancel ${jobB}_1"
while [ -n "$(squeue -h -j "${jobB}_1" 2>/dev/null)" ] && [ "$(left)" -gt 40 ]; do sleep 0.25; done
check "B: task 1 cancelled ($(states "$jobB"))" \
    test "$(states "$jobB")" = "0=COMPLETED:0:0 1=CANCELLED:143:0 2=COMPLETED:0:0"
check "B: the cancelled writer's temporary file is gone" test -n "$stuck" -a ! -e "$stuck"
check "B: after scancel, no partial or left-over file, the other shards whole" \
    $py "$check_py" check "$T/rootB" "$T/docs.jsonl" "$model" "$kvfold" --absent-shard 1/3
check "B: task 1's log says it was stopped" grep -q "stopped by SIGTERM" "$(log_of "$jobB" 1)"
scontrol requeue "${jobB}_1" || fail "scontrol requeue ${jobB}_1"
# a requeued job waits out Slurm's requeue delay (about 2 minutes) unless told otherwise
scontrol update jobid="${jobB}_1" StartTime=now || fail "scontrol update StartTime=now"
wait_job "$jobB"
touch "$T/readers/writers-done"
check "B: after the requeue all three tasks completed ($(states "$jobB"))" \
    test "$(states "$jobB")" = "0=COMPLETED:0:0 1=COMPLETED:0:0 2=COMPLETED:0:0"
check "B: task 1 ran twice (Restarts=1)" bash -c "scontrol -o show job ${jobB}_1 | grep -q ' Restarts=1 '"
check "B: task 1's log has both attempts" grep -q "attempt 2" "$(log_of "$jobB" 1)"
check "B: one valid file per document, nothing else" $py "$check_py" check "$T/rootB" "$T/docs.jsonl" "$model" "$kvfold"
check "B: the summary lines add up (12 done)" $py "$check_py" summaries "$T/logs" "$jobB" "$T/docs.jsonl" 3 12 0
touch "$T/readers/stop"
for p in "${reader_pids[@]}"; do wait "$p"; done
reader_pids=()
for r in 1 2; do
    j=$T/readers/reader$r.json
    if [ ! -f "$j" ]; then
        fail "reader $r wrote no report: $(tail -n 5 "$T/readers/reader$r.err")"
        continue
    fi
    $py - "$j" "$r" <<'PY' || fails=$((fails + 1))
import json, sys
r = json.load(open(sys.argv[1]))
name = "reader " + sys.argv[2]
bad = 0
for cond, what in [(r["errors"] == [], "no load saw a partial, inconsistent or changed file"),
                   (r["files"] == 12 and len(set(r["digests"])) == 12, "loaded all 12 documents' files"),
                   (r["during_job"] >= 8, "loaded at least 8 of them while job B was writing")]:
    print(("ok   " if cond else "FAIL ") + "B: %s: %s (%d files, %d while writing, %d loads, %d passes)"
          % (name, what, r["files"], r["during_job"], r["loads"], r["passes"]))
    bad += not cond
for e in r["errors"][:10]:
    print("  " + e)
sys.exit(1 if bad else 0)
PY
done

# ---------------------------------------------------------------- C: again: everything skipped
before=$(cd "$T/rootA" && find . -type f -printf '%p %i %T@\n' | sort)
jobC=$(submit 0-2 "$T/rootA") || die "sbatch refused job C"
wait_job "$jobC"
check "C: the three tasks completed with exit code 0 ($(states "$jobC"))" \
    test "$(states "$jobC")" = "0=COMPLETED:0:0 1=COMPLETED:0:0 2=COMPLETED:0:0"
check "C: every document skipped" $py "$check_py" summaries "$T/logs" "$jobC" "$T/docs.jsonl" 3 0 12
check "C: no file touched" test "$(cd "$T/rootA" && find . -type f -printf '%p %i %T@\n' | sort)" = "$before"

# ---------------------------------------------------------------- D: exit codes Slurm records
{ sed -n 1p "$T/docs.jsonl"; echo 'this is not json'; } >"$T/bad.jsonl"
jobD=$(sbatch --parsable --array=0-1 "$sbatch_script" "$model" "$T/bad.jsonl" "$T/rootD" "${opts[@]}" | cut -d';' -f1)
jobE=$(sbatch --parsable --array=0-4:2 "$sbatch_script" "$model" "$T/docs.jsonl" "$T/rootE" "${opts[@]}" | cut -d';' -f1)
# one document of a fresh root held by another worker (same name as in rootA: content-addressed)
held=$(cd "$T/rootA" && files_in . | head -n 1)
mkdir -p "$T/rootF/$(dirname "$held")"
exec {holder}>"$T/rootF/$held.lock"
flock -x "$holder" || die "cannot lock $T/rootF/$held.lock"
jobF=$(KVFOLD_BUSY_TRIES=1 KVFOLD_BUSY_WAIT=1 submit 0-0 "$T/rootF") || die "sbatch refused job F"
wait_job "$jobD"
wait_job "$jobE"
wait_job "$jobF"
exec {holder}>&-
check "D: a bad manifest line fails its task with exit 1, the other completes ($(states "$jobD"))" \
    test "$(states "$jobD")" = "0=COMPLETED:0:0 1=FAILED:1:0"
check "D: the failed task's log names the line" grep -q "bad.jsonl:2: not JSON" "$(log_of "$jobD" 1)"
check "D: an array with a step is a usage error, exit 2 ($(states "$jobE"))" \
    test "$(states "$jobE")" = "0=FAILED:2:0 2=FAILED:2:0 4=FAILED:2:0"
check "D: a document held by another worker past the waits: exit 75 ($(states "$jobF"))" \
    test "$(states "$jobF")" = "0=FAILED:75:0"
check "D: ... after waiting once" grep -q "again in 1s (1/1)" "$(log_of "$jobF" 0)"
check "D: ... and the other 11 documents done" test "$(files_in "$T/rootF" | wc -l)" -eq 11

# ---------------------------------------------------------------- E: a writer killed outright
# SIGKILL (a lost node, KillWait exceeded) leaves the temporary file and the lock file; the next
# task to start on the root removes both, since no one holds the lock
LD_PRELOAD=$stall_so KF_STALL_PWRITE=2 KF_STALL_MARK=$T/killed.mark \
    "$kvfold" compact --model "$model" --manifest "$T/docs.jsonl" --out "$T/rootG" "${opts[@]}" >/dev/null 2>&1 &
victim=$!
for _ in $(seq 1 120); do
    [ -e "$T/killed.mark" ] && break
    sleep 0.25
done
kill -KILL "$victim" 2>/dev/null
wait "$victim" 2>/dev/null
check "E: the killed writer left a temporary file" test -n "$(find "$T/rootG" -name "*.tmp-$victim-*")"
jobG=$(submit 0-0 "$T/rootG") || die "sbatch refused job G"
wait_job "$jobG"
check "E: the next task completed ($(states "$jobG"))" test "$(states "$jobG")" = "0=COMPLETED:0:0"
check "E: ... saying it removed the dead writer's temporary file" \
    grep -q "removed 1 temporary file(s) of stopped writers" "$(log_of "$jobG" 0)"
check "E: one valid file per document, nothing else" $py "$check_py" check "$T/rootG" "$T/docs.jsonl" "$model" "$kvfold"

echo "$((SECONDS - t_start)) s in all"
[ "$fails" = 0 ] || show_logs
echo "$fails failed"
exit $((fails > 0))
