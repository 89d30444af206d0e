#!/usr/bin/env bash
# GPU benchmarks: tests/bench/gpu/run.sh [CUDA_BUILD_DIR]   (make bench-gpu; scripts/gpu-run bench)
# Writes tests/bench/results/<card>.md (BENCH_RESULTS_DIR), one file per card so that an H100's and
# an H200's figures are never mixed, every row naming its card, row by row as each is measured
# (also to BENCH_OUT when set: scripts/gpu-run's $OUT/bench.md; a timeout keeps every finished row):
#   (a) every CUDA kernel vs its PyTorch equivalent (bench_kernels_gpu + bench_torch.py), against
#       the card's ceilings MEASURED at the start (a cuBLAS bf16 GEMM and a device-to-device copy:
#       about 798 TFLOP/s and 3.0 TB/s on an H100, 4.3 TB/s on an H200), not datasheet peaks;
#   (b) the whole training step, tokens/s and peak GPU memory, of our trainer (bench_step_gpu) vs
#       transformers + PEFT (+ bitsandbytes NF4) (bench_hf_step.py), for a SmolLM2-135M-shaped and
#       a Llama-2-7B-shaped model with random weights (BENCH_SMOL=random:smollm2-135m,
#       BENCH_BIG=random:llama2-7b; a GGUF path works too), T = BENCH_T, r 16 on all linears;
#   (c) long context: both models extended to BENCH_LONG_T tokens (linear) with S2-Attn (group 1/4)
#       and full attention, checkpointing with and without offload; and the longest T that runs one
#       step (doubling from BENCH_LONG_T up to BENCH_MAX_T_LIMIT = 131072, each T printed as it is
#       tried) next to `trainer estimate`'s prediction.
# BENCH_ONLY=a|b|c (or a list, "b,c") runs only those parts. Time: every invocation runs under
# BENCH_TIMEOUT (150 s), cut to BT_DEADLINE_AT (epoch seconds; scripts/gpu-run sets it); one that
# runs out prints a "TIMEOUT" row and "TIMEOUT <what>" on stderr, one with fewer than BT_RUN_MIN
# (10) s left is not started ("skipped: deadline" row). The programs' stderr is streamed as it
# comes. No device: "bench-gpu: skipped: no CUDA device", exit 0 (FAILED, exit 1, under
# BT_GPU_REQUIRE=1). Exit status: 0, 1 (an invocation failed), 124 (one timed out, none failed).
# Knobs: PYTHON (python3), BENCH_STEPS (10), BENCH_T (4096), BENCH_7B_CKPT (1), BENCH_SKIP_HF=1,
# BENCH_SKIP_7B=1, BENCH_LONG_T (16384), BENCH_LONG_STEPS (3), BENCH_KERNELS_ARGS (extra arguments
# of bench_kernels_gpu, e.g. "--quick").
set -u
cd "$(dirname "$0")/../../.."
cb=${1:-build/cuda}
PY=${PYTHON:-python3}
STEPS=${BENCH_STEPS:-10}
T=${BENCH_T:-4096}
CK7=${BENCH_7B_CKPT:-1}
SMOL=${BENCH_SMOL:-random:smollm2-135m}
BIG=${BENCH_BIG:-random:llama2-7b}
LT=${BENCH_LONG_T:-16384}
LSTEPS=${BENCH_LONG_STEPS:-3}
TLIM=${BENCH_MAX_T_LIMIT:-131072}
only=${BENCH_ONLY:-a,b,c}
inv_timeout=${BENCH_TIMEOUT:-150}
run_min=${BT_RUN_MIN:-10}
part() { [[ ",${only// /,}," == *",$1,"* ]]; }
for p in ${only//,/ }; do
    case "$p" in a | b | c) ;; *) echo "bench-gpu: BENCH_ONLY=$only: parts are a, b, c" >&2; exit 2 ;; esac
done

# ---- the device and its name
probe_bin=""
for b in "$cb/bench/bench_kernels_gpu" "$cb/bench/bench_step_gpu"; do
    [ -x "$b" ] && { probe_bin=$b; break; }
done
[ -n "$probe_bin" ] || { echo "bench-gpu: FAILED: no benchmark binary in $cb/bench (make cuda)"; exit 1; }
probe=$("$probe_bin" --probe-only 2>&1)
if [ $? -ne 0 ]; then
    why=$(echo "$probe" | grep -m1 -o 'no CUDA device.*' || echo "$probe" | tail -n 1)
    if [ "${BT_GPU_REQUIRE:-0}" != 0 ]; then
        echo "bench-gpu: FAILED: $why (BT_GPU_REQUIRE=1)"
        exit 1
    fi
    echo "bench-gpu: skipped: $why"
    exit 0
fi
name=$(echo "$probe" | sed -n 's/^probe: one kernel ran on \(.*\): ok$/\1/p')
[ -n "$name" ] || name=unknown
slug=$(echo "$name" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\+/-/g; s/^-//; s/-$//')
resdir=${BENCH_RESULTS_DIR:-tests/bench/results}
mkdir -p "$resdir"
res=$resdir/$slug.md
: > "$res"
outs=("$res")
if [ -n "${BENCH_OUT:-}" ]; then : > "$BENCH_OUT"; outs+=("$BENCH_OUT"); fi
emit() { printf '%s\n' "$*" | tee -a "${outs[@]}"; }

failed=0 timed=0
time_for() {
    local t=$1 left
    if [ -n "${BT_DEADLINE_AT:-}" ]; then
        left=$((BT_DEADLINE_AT - $(date +%s)))
        [ "$left" -lt "$t" ] && t=$left
    fi
    echo "$t"
}
# invoke LABEL NCELLS CMD...: runs CMD under its time, its stdout (rows) into the results as they
# come, its stderr streamed; a failure or a timeout becomes a row of NCELLS cells.
invoke() {
    local label=$1 ncells=$2 t rc pad=""
    shift 2
    for _ in $(seq 4 "$ncells"); do pad="$pad |"; done
    t=$(time_for "$inv_timeout")
    if [ "$t" -lt "$run_min" ]; then
        emit "| $label | skipped: deadline (${t}s left) |$pad $name |"
        echo "bench-gpu: $label not started: deadline (${t}s left)" >&2
        timed=1
        return
    fi
    echo "bench-gpu: $label (timeout ${t}s): $*" >&2
    timeout -k 5 "$t" "$@" | tee -a "${outs[@]}"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        emit "| $label | TIMEOUT after ${t}s |$pad $name |"
        echo "TIMEOUT $label" >&2
        timed=1
    elif [ "$rc" -ne 0 ]; then
        emit "| $label | FAILED (exit $rc; its stderr above) |$pad $name |"
        failed=1
    fi
}
is_model() { [[ "$1" == random:* ]] || [ -e "$1" ]; }

emit "# GPU benchmarks: $name"
emit ""
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
emit "$(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), driver ${driver:-?}, $($PY -c 'import torch;print("torch",torch.__version__)' 2>/dev/null || echo 'torch: not importable'); every row names its card"

if part a; then
    emit ""
    emit "## (a) kernels vs PyTorch (T = $T) -- $name"
    emit ""
    # shellcheck disable=SC2086
    invoke "bench_kernels_gpu" 7 "$cb/bench/bench_kernels_gpu" --T "$T" ${BENCH_KERNELS_ARGS:-}
    ceil=$(grep -m1 '^ceilings: ' "$res")
    tf=$(echo "$ceil" | sed -n 's/.*: \([0-9.e+-]*\) bf16 TFLOP\/s.*/\1/p')
    gbs=$(echo "$ceil" | sed -n 's/.*, \([0-9.e+-]*\) GB\/s.*/\1/p')
    emit ""
    emit "PyTorch rows (the same ceilings):"
    emit ""
    emit "| kernel | shape | impl | ms | throughput | % of ceiling | card |"
    emit "|---|---|---|---|---|---|---|"
    invoke "bench_torch.py" 7 "$PY" tests/bench/gpu/bench_torch.py --T "$T" \
        ${tf:+--ceiling-tflops "$tf"} ${gbs:+--ceiling-gbs "$gbs"}
fi
if part b; then
    emit ""
    emit "## (b) training step (LoRA r 16, alpha 32, dropout 0.05, all 7 linears; AdamW; clip 1.0; $STEPS timed steps after 2 warm-ups) -- $name"
    emit ""
    emit "Peak memory: ours = device memory in use by the process (cudaMemGetInfo, includes the CUDA context"
    emit "and cuBLAS workspaces); HF = torch.cuda.max_memory_reserved (excludes the context, ~0.5 GiB)."
    emit ""
    emit "| trainer | model | B x T | r | ckpt | tokens/s | step ms | peak GiB | card |"
    emit "|---|---|---|---|---|---|---|---|---|"
    models=("$SMOL")
    [ "${BENCH_SKIP_7B:-0}" != 1 ] && models+=("$BIG")
    for mdl in "${models[@]}"; do
        is_model "$mdl" || { emit "| barq (CUDA) | $mdl | skipped: not found |||||| $name |"; continue; }
        ck=0
        [ "$mdl" = "$BIG" ] && ck=$CK7
        invoke "barq (CUDA) $mdl" 9 "$cb/bench/bench_step_gpu" --model "$mdl" --T "$T" --steps "$STEPS" --ckpt "$ck"
        invoke "barq (CUDA, mma attn, fused NF4) $mdl" 9 "$cb/bench/bench_step_gpu" --model "$mdl" --T "$T" \
            --steps "$STEPS" --ckpt "$ck" --attn mma --nf4 fused
        if [ "${BENCH_SKIP_HF:-0}" != 1 ]; then
            hf=smollm2 gg=""
            [ "$mdl" = "$BIG" ] && hf=llama2-7b
            [ "$hf" = smollm2 ] && [ -f "$mdl" ] && gg=$mdl
            invoke "HF+PEFT $hf" 9 "$PY" tests/bench/gpu/bench_hf_step.py --model "$hf" --gguf "$gg" --T "$T" \
                --steps "$STEPS" --ckpt "$ck"
        fi
    done
fi
if part c; then
    emit ""
    emit "## (c) long context: T = $LT, context extended to T (linear), LoRA r 16 on all linears, checkpointing; $LSTEPS timed steps -- $name"
    emit ""
    emit "| trainer | model | B x T | r | ckpt | tokens/s | step ms | peak GiB | card |"
    emit "|---|---|---|---|---|---|---|---|---|"
    models=("$SMOL")
    [ "${BENCH_SKIP_7B:-0}" != 1 ] && models+=("$BIG")
    for mdl in "${models[@]}"; do
        for variant in "--s2 0.25" "--s2 0" "--s2 0.25 --offload 1" "--s2 0 --offload 1"; do
            # shellcheck disable=SC2086
            invoke "barq (CUDA, $variant) $mdl" 9 "$cb/bench/bench_step_gpu" --model "$mdl" --T "$LT" --extend "$LT" \
                --ckpt 1 --steps "$LSTEPS" --warmup 1 $variant
        done
    done
    emit ""
    emit "Longest T that runs one training step (S2-Attn 1/4, checkpointing, context extended to T), doubling from $LT up to $TLIM -- $name:"
    emit ""
    emit "| trainer | model | B x T | r | ckpt | longest T | trainer estimate | device memory | card |"
    emit "|---|---|---|---|---|---|---|---|---|"
    for mdl in "${models[@]}"; do
        for off in 0 1; do
            invoke "barq (CUDA) longest T, offload $off, $mdl" 9 "$cb/bench/bench_step_gpu" --model "$mdl" --max-T 1 \
                --T "$LT" --extend 1 --ckpt 1 --s2 0.25 --offload "$off" --max-T-limit "$TLIM"
        done
    done
fi
echo "bench-gpu: wrote $res${BENCH_OUT:+ and $BENCH_OUT}" >&2
[ $failed = 1 ] && exit 1
[ $timed = 1 ] && exit 124
exit 0
