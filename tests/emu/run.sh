#!/usr/bin/env bash
# Runs the GPU test programs built for the CPU emulator (tests/emu/README.md):
#   tests/emu/run.sh LOGDIR BIN...
# Each binary runs with BT_GPU_EMU=1 (emulation-sized cases) and BT_GPU_QUICK=1 (reduced grids, no
# SmolLM2 model), up to BT_EMU_JOBS (default: number of CPUs) at a time; its output goes to
# LOGDIR/<name>.log. Prints the per-case result lines of every binary (cmocka's "[       OK ] X",
# "[  FAILED  ] X", "[  SKIPPED ] X"), the whole log tail of a failing one, and a final summary
# line. Exit status 0 only if every binary passed.
set -u
logdir=${1:?usage: run.sh LOGDIR BIN...}
shift
mkdir -p "$logdir"
jobs=${BT_EMU_JOBS:-$(nproc 2>/dev/null || echo 2)}
start=$(date +%s)

# longest first (the trainer step parity dominates)
bins=()
for b in "$@"; do case "$b" in *trainer*) bins=("$b" "${bins[@]}") ;; *) bins+=("$b") ;; esac; done

declare -A rc
run_one() {
    local b=$1 name
    name=$(basename "$b")
    BT_GPU_EMU=1 BT_GPU_QUICK=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$b" >"$logdir/$name.log" 2>&1
    echo $? >"$logdir/$name.rc"
}
running=0
for b in "${bins[@]}"; do
    run_one "$b" &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        wait -n
        running=$((running - 1))
    fi
done
wait

pass=0
fail=0
skip=0
bad=()
for b in "$@"; do
    name=$(basename "$b")
    r=$(cat "$logdir/$name.rc" 2>/dev/null || echo 99)
    echo "== $name (emulated; log: $logdir/$name.log)"
    grep -E '^(\[ +(OK|FAILED|SKIPPED) +\]|PASS|FAIL) ' "$logdir/$name.log" | grep -v ' test(s)'
    line=$(grep -E "^$name: [0-9]+ passed, [0-9]+ failed" "$logdir/$name.log" | tail -n 1)
    if [ -n "$line" ]; then
        echo "$line"
        p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
        f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
        pass=$((pass + p))
        fail=$((fail + f))
        case "$line" in *skipped*) skip=$((skip + $(echo "$line" | sed -E 's/.* ([0-9]+) skipped.*/\1/'))) ;; esac
    fi
    if [ "$r" -ne 0 ] || [ -z "$line" ]; then
        bad+=("$name (exit $r)")
        echo "---- last lines of $logdir/$name.log:"
        tail -n 40 "$logdir/$name.log"
    fi
done
secs=$(( $(date +%s) - start ))
if [ ${#bad[@]} -ne 0 ] || [ "$fail" -ne 0 ]; then
    echo "test-emu: FAILED: ${bad[*]:-} ($pass passed, $fail failed; CPU emulation of the CUDA kernels, ${secs}s)"
    exit 1
fi
echo "test-emu: $pass passed, $skip skipped (CPU emulation of the CUDA kernels: correctness of indexing/synchronisation logic, not of the hardware; ${secs}s)"
exit 0
