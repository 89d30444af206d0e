#!/usr/bin/env bash
# Runs the GPU parity tests: tests/gpu/run.sh BINDIR BIN...
# Without a usable CUDA device it prints "test-gpu: SKIPPED: no CUDA device (<reason>)" and exits 0
# WITHOUT any pass line (CI on GPU-less machines only requires that everything compiles).
# With a device: runs every binary (each prints per-test PASS/FAIL lines and "N passed, N failed"),
# then, if compute-sanitizer is available, reruns each under memcheck, racecheck and synccheck
# (BT_GPU_SANITIZE=0 skips that). test_trainer_gpu (the whole GPU trainer step vs the CPU trainer,
# tiny model + SmolLM2 from BT_MODEL) is one of the binaries. Exit status: 0 only if every binary and sanitizer run passed.
set -u
bindir=${1:?usage: run.sh BINDIR BIN...}
shift
bins=("$@")

reason=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
    reason="nvidia-smi not found"
elif ! nvidia-smi -L >/dev/null 2>&1; then
    reason="nvidia-smi -L failed: $(nvidia-smi -L 2>&1 | head -n 1)"
elif [ -z "$(nvidia-smi -L 2>/dev/null | grep -i '^GPU')" ]; then
    reason="nvidia-smi lists no GPU"
fi
if [ -z "$reason" ] && [ ${#bins[@]} -gt 0 ]; then
    # second opinion from the CUDA runtime itself (driver/runtime mismatch, MIG without access...)
    out=$("${bins[0]}" --probe-only 2>&1 | grep -m1 'SKIPPED' || true)
    if [ -n "$out" ]; then
        reason="cudaGetDeviceCount: ${out#*no CUDA device (}"
        reason="${reason%)}"
    fi
fi
if [ -n "$reason" ]; then
    echo "test-gpu: SKIPPED: no CUDA device ($reason)"
    exit 0
fi

fail=0
for b in "${bins[@]}"; do
    echo "== $(basename "$b")"
    "$b"
    rc=$?
    if [ $rc -eq 77 ]; then
        echo "test-gpu: SKIPPED: $(basename "$b") found no CUDA device"
        exit 0
    elif [ $rc -ne 0 ]; then
        echo "test-gpu: $(basename "$b") FAILED (exit $rc)"
        fail=1
    fi
done

CS=${COMPUTE_SANITIZER:-}
if [ -z "$CS" ]; then
    CS=$(command -v compute-sanitizer || true)
    [ -z "$CS" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && CS=/usr/local/cuda/bin/compute-sanitizer
fi
if [ "${BT_GPU_SANITIZE:-1}" != "0" ]; then
    if [ -z "$CS" ]; then
        echo "test-gpu: compute-sanitizer not found; memcheck/racecheck NOT run"
    else
        for tool in memcheck racecheck synccheck; do
            for b in "${bins[@]}"; do
                echo "== compute-sanitizer --tool $tool $(basename "$b")"
                # BT_GPU_QUICK=1: test_trainer_gpu runs only its tiny-model cases under the
                # sanitizers (the SmolLM2 cases would take far too long there)
                if ! BT_GPU_QUICK=1 "$CS" --tool "$tool" --error-exitcode 99 "$b" >"$bindir/$(basename "$b").$tool.log" 2>&1; then
                    echo "test-gpu: $tool FAILED on $(basename "$b") (log: $bindir/$(basename "$b").$tool.log)"
                    tail -n 30 "$bindir/$(basename "$b").$tool.log"
                    fail=1
                else
                    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$bindir/$(basename "$b").$tool.log" | tail -n 1
                fi
            done
        done
    fi
fi

if [ $fail -ne 0 ]; then
    echo "test-gpu: FAILED"
    exit 1
fi
echo "test-gpu: all GPU test binaries passed"
exit 0
