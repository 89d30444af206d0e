#!/usr/bin/env bash
# Runs the GPU parity tests (make test-gpu; scripts/gpu-run steps quick, sanitize, test):
#   tests/gpu/run.sh [BIN...]     (default: every build/cuda/tests/test_* executable, the kernels,
#                                  NF4 GEMM, GGUF GEMM, attention, trainer and model-family tests in
#                                  that order, then the others)
# 1. Device check: the first binary's --probe-only (device query + a one-kernel probe). Without a
#    usable device: "test-gpu: SKIPPED: no CUDA device (<reason>)", exit 0 and no pass line; under
#    BT_GPU_REQUIRE=1 (scripts/gpu-run sets it) "test-gpu: FAILED: no CUDA device ...", exit 1.
# 2. Plain runs (BT_GPU_PLAIN=0 skips them): each binary, its output streamed and kept in
#    $BT_GPU_LOGDIR/<bin>.plain.log. A binary that crashes (signal, a CUDA error exit, no summary
#    line) is restarted after the case it crashed in (--after CASE; at most BT_GPU_RESTARTS=3 times
#    per binary): "CRASH <bin> in <case> (...)".
# 3. Sanitizers (BT_GPU_SANITIZE=0 skips them): first a probe, the one-kernel probe under
#    compute-sanitizer memcheck; where the runtime does not support the tool (gVisor: "Device not
#    supported") it prints "test-gpu: sanitizers unavailable on this runtime (<why>)" and runs none
#    (not a failure). Then the plan BT_GPU_SAN_PLAN, in order (default: memcheck on all, racecheck
#    on the NF4 GEMM, the GGUF GEMM and attention last, synccheck on attention, initcheck on the
#    kernels test), every run with BT_GPU_QUICK=1 (reduced grids: the tools slow kernels 10-100x),
#    its log in $BT_GPU_LOGDIR/sanitizer/<bin>.<tool>.log; after each run the directory is tarred
#    to $BT_GPU_SAN_TAR when set (scripts/gpu-run: $OUT/sanitizer-logs.tar.gz), so that a timeout
#    still returns every finished run's log.
# Time: each plain run under BT_GPU_TIMEOUT (300 s), each sanitizer run under BT_GPU_SAN_TIMEOUT
# (240 s), both cut to BT_DEADLINE_AT (epoch seconds; scripts/gpu-run sets it from BT_DEADLINE); a
# run that times out prints "TIMEOUT <bin> <tool>" (tool "plain" for a plain run) and the next one
# goes on; a run with fewer than BT_RUN_MIN (10) seconds left is not started:
# "SKIPPED <bin> <tool> (deadline: N s left)".
# Selection: BT_GPU_BINS ("kernels attention": binaries whose name contains a word), BT_GPU_TOOLS
# ("memcheck racecheck": tools of the plan), BT_GPU_CASE (--case SUBSTR for every run).
# test_trainer_gpu's SmolLM2 cases read BT_MODEL (a GGUF, or random:smollm2-135m).
# Exit status: 0 every run passed; 1 a run failed or crashed; 124 nothing failed but a run timed
# out or was not started for the deadline.
set -u
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ]; then # the quick binaries first, so that a deadline leaves the most results
    for n in kernels nf4_gemm ggml attention trainer families; do
        [ -e "build/cuda/tests/test_${n}_gpu" ] && set -- "$@" "build/cuda/tests/test_${n}_gpu"
    done
    for f in build/cuda/tests/test_*; do
        [[ " $* " == *" $f "* ]] || set -- "$@" "$f"
    done
fi
logdir=${BT_GPU_LOGDIR:-build/gpu-logs/tests}
plain_timeout=${BT_GPU_TIMEOUT:-300}
san_timeout=${BT_GPU_SAN_TIMEOUT:-240}
run_min=${BT_RUN_MIN:-10}
restarts=${BT_GPU_RESTARTS:-3}
plan=${BT_GPU_SAN_PLAN:-"memcheck:* racecheck:nf4_gemm,ggml,attention synccheck:attention initcheck:kernels"}
mkdir -p "$logdir/sanitizer"

# The binaries: executables only (never a .log or other file next to them), filtered by BT_GPU_BINS.
bins=()
for b in "$@"; do
    name=$(basename "$b")
    [ -f "$b" ] && [ -x "$b" ] && [[ "$name" != *.* ]] || continue
    if [ -n "${BT_GPU_BINS:-}" ]; then
        keep=0
        for w in ${BT_GPU_BINS//,/ }; do [[ "$name" == *"$w"* ]] && keep=1; done
        [ $keep = 1 ] || continue
    fi
    bins+=("$b")
done
if [ ${#bins[@]} -eq 0 ]; then
    echo "test-gpu: FAILED: no test binary selected (given: $*; BT_GPU_BINS='${BT_GPU_BINS:-}')"
    exit 1
fi
case_args=()
[ -n "${BT_GPU_CASE:-}" ] && case_args=(--case "$BT_GPU_CASE")

fail=() timeouts=()
# seconds a run may take: min(its own limit, what is left before BT_DEADLINE_AT); prints nothing
time_for() {
    local t=$1 left
    if [ -n "${BT_DEADLINE_AT:-}" ]; then
        left=$((BT_DEADLINE_AT - $(date +%s)))
        [ "$left" -lt "$t" ] && t=$left
    fi
    echo "$t"
}

# ---- 1. the device
probe=$("${bins[0]}" --probe-only 2>&1)
prc=$?
if [ $prc -ne 0 ]; then
    reason=$(echo "$probe" | grep -m1 -o 'no CUDA device (.*)' | sed 's/^no CUDA device (//; s/)$//')
    [ -z "$reason" ] && reason="$(basename "${bins[0]}") --probe-only exit $prc: $(echo "$probe" | grep -v '^\s*$' | tail -n 1)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        reason="$reason; nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -n 1)"
    else
        reason="$reason; nvidia-smi not found"
    fi
    if [ "${BT_GPU_REQUIRE:-0}" != 0 ]; then
        echo "test-gpu: FAILED: no CUDA device ($reason) and BT_GPU_REQUIRE=1"
        exit 1
    fi
    echo "test-gpu: SKIPPED: no CUDA device ($reason)"
    exit 0
fi
echo "$probe" | grep -E 'device 0|probe:'

# ---- 2. plain runs
# The case a crashed run was in: the last cmocka "[ RUN      ] X" of LOG with no "[       OK ] X",
# "[  FAILED  ] X" or "[  SKIPPED ] X" after it.
crashed_case() {
    awk '/^\[ RUN      \] / { c = substr($0, 14) }
         /^\[ +(OK|FAILED|SKIPPED) +\] / { if (substr($0, 14) == c) c = "" }
         END { print c }' "$1"
}
if [ "${BT_GPU_PLAIN:-1}" != 0 ]; then
    for b in "${bins[@]}"; do
        name=$(basename "$b")
        log=$logdir/$name.plain.log
        : > "$log"
        after=() n_restart=0
        while :; do
            t=$(time_for "$plain_timeout")
            if [ "$t" -lt "$run_min" ]; then
                echo "SKIPPED $name plain (deadline: $t s left)"
                timeouts+=("$name plain (not started)")
                break
            fi
            echo "== $name${after[1]:+ (restarted after ${after[1]})} (timeout ${t}s)"
            timeout -k 5 "$t" "$b" "${case_args[@]}" "${after[@]}" 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
                echo "TIMEOUT $name plain (after ${t}s; its log so far: $log)"
                timeouts+=("$name plain")
                break
            fi
            summary=$(grep -E "^$name: [0-9]+ passed, [0-9]+ failed" "$log" | tail -n 1)
            if [ "$rc" -eq 0 ] && [ -n "$summary" ]; then
                break
            elif [ "$rc" -eq 1 ] && [ -n "$summary" ]; then
                fail+=("$name")
                break
            elif [ "$rc" -eq 77 ]; then # the device went away between the probe and this run
                echo "test-gpu: $name found no CUDA device"
                fail+=("$name (no device)")
                break
            fi
            c=$(crashed_case "$log")
            echo "CRASH $name in ${c:-an unknown case} (exit $rc$([ "$rc" -gt 128 ] && echo ", signal $((rc - 128))"))"
            fail+=("$name (crash in ${c:-?})")
            n_restart=$((n_restart + 1))
            if [ -z "$c" ] || [ "$n_restart" -gt "$restarts" ]; then
                break
            fi
            after=(--after "$c")
        done
    done
fi

# ---- 3. sanitizers
CS=${COMPUTE_SANITIZER:-}
if [ -z "$CS" ]; then
    CS=$(command -v compute-sanitizer || true)
    [ -z "$CS" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && CS=/usr/local/cuda/bin/compute-sanitizer
fi
tar_logs() {
    [ -n "${BT_GPU_SAN_TAR:-}" ] || return 0
    tar -C "$logdir" -czf "$BT_GPU_SAN_TAR.tmp" sanitizer && mv -f "$BT_GPU_SAN_TAR.tmp" "$BT_GPU_SAN_TAR"
}
if [ "${BT_GPU_SANITIZE:-1}" != 0 ]; then
    if [ -z "$CS" ]; then
        echo "test-gpu: sanitizers unavailable on this runtime (compute-sanitizer not found; COMPUTE_SANITIZER names it); none run"
    else
        t=$(time_for 60)
        pout=$(timeout -k 5 "$t" "$CS" --tool memcheck --error-exitcode 99 "${bins[0]}" --probe-only 2>&1)
        prc=$?
        echo "$pout" > "$logdir/sanitizer/probe.memcheck.log"
        if [ $prc -ne 0 ] && ! echo "$pout" | grep -Eq 'ERROR SUMMARY: [1-9]'; then
            why=$(echo "$pout" | grep -m1 -iE 'not supported|error|fail' || echo "$pout" | grep -v '^\s*$' | tail -n 1)
            [ $prc -eq 124 ] && why="the probe timed out after ${t}s"
            echo "test-gpu: sanitizers unavailable on this runtime ($(echo "$why" | sed 's/^=* *//'); exit $prc); none run"
        else
            echo "test-gpu: compute-sanitizer works here: $("$CS" --version 2>/dev/null | grep -m1 -i version)"
            for entry in $plan; do
                tool=${entry%%:*}
                if [ -n "${BT_GPU_TOOLS:-}" ] && [[ " ${BT_GPU_TOOLS//,/ } " != *" $tool "* ]]; then
                    continue
                fi
                targets=()
                if [ "${entry#*:}" = "*" ]; then
                    targets=("${bins[@]}")
                else
                    IFS=, read -r -a words <<< "${entry#*:}"
                    for w in "${words[@]}"; do
                        for b in "${bins[@]}"; do [[ "$(basename "$b")" == *"$w"* ]] && targets+=("$b"); done
                    done
                fi
                for b in "${targets[@]}"; do
                    name=$(basename "$b")
                    log=$logdir/sanitizer/$name.$tool.log
                    t=$(time_for "$san_timeout")
                    if [ "$t" -lt "$run_min" ]; then
                        echo "SKIPPED $name $tool (deadline: $t s left)"
                        timeouts+=("$name $tool (not started)")
                        continue
                    fi
                    echo "== compute-sanitizer --tool $tool $name (timeout ${t}s)"
                    BT_GPU_QUICK=1 timeout -k 5 "$t" "$CS" --tool "$tool" --error-exitcode 99 \
                        "$b" "${case_args[@]}" > "$log" 2>&1
                    rc=$?
                    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
                        echo "TIMEOUT $name $tool (after ${t}s; its log so far: $log)"
                        timeouts+=("$name $tool")
                    elif [ $rc -ne 0 ]; then
                        echo "test-gpu: $tool FAILED on $name (exit $rc; log: $log)"
                        tail -n 30 "$log"
                        fail+=("$name $tool")
                    else
                        grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1
                    fi
                    tar_logs
                done
            done
        fi
        tar_logs
    fi
fi

if [ ${#fail[@]} -ne 0 ]; then
    echo "test-gpu: FAILED: ${fail[*]}${timeouts[*]:+; timed out: ${timeouts[*]}}"
    exit 1
fi
if [ ${#timeouts[@]} -ne 0 ]; then
    echo "test-gpu: TIMEOUT: ${timeouts[*]} (nothing failed)"
    exit 124
fi
echo "test-gpu: all GPU test binaries passed"
exit 0
