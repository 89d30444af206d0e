#!/usr/bin/env bash
# GPU benchmarks (issue 5): tests/bench/gpu/run.sh CUDA_BUILD_DIR  (make bench-gpu)
# Writes tests/bench/results/<device-name>.md with
#   (a) every CUDA kernel vs its PyTorch equivalent (bench_kernels_gpu + bench_torch.py), and
#   (b) the whole training step, tokens/s and peak GPU memory, of our trainer (bench_step_gpu) vs
#       transformers + PEFT (+ bitsandbytes NF4) (bench_hf_step.py), for SmolLM2-135M (BT_MODEL)
#       and a Llama-2-7B-shaped random NF4 model, T = 4096, r = 16 on all linears.
# Anything that cannot run prints "skipped: reason" (no GPU: the whole script says so, exits 0).
#   (c) long context (issue 12): tokens/s of SmolLM2 and the Llama-2-7B-shaped model extended to
#       BENCH_LONG_T tokens (linear interpolation) with S2-Attn (group 1/4) against full
#       attention, activation checkpointing with and without offload of the checkpointed layer
#       inputs to pinned host memory; and the longest T that runs one step on this GPU next to
#       `trainer estimate`'s prediction for its memory.
# Knobs: PYTHON (python3), BENCH_STEPS (10), BENCH_T (4096), BENCH_7B_CKPT (1: activation
# checkpointing for the 7B runs, both trainers), BENCH_SKIP_HF=1, BENCH_SKIP_7B=1,
# BENCH_LONG_T (16384), BENCH_LONG_STEPS (3), BENCH_SKIP_LONG=1.
set -u
cd "$(dirname "$0")/../../.."
cb=${1:-build/cuda}
PY=${PYTHON:-python3}
STEPS=${BENCH_STEPS:-10}
T=${BENCH_T:-4096}
CK7=${BENCH_7B_CKPT:-1}
MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LT=${BENCH_LONG_T:-16384}
LSTEPS=${BENCH_LONG_STEPS:-3}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -qi '^GPU'; then
    echo "bench-gpu: skipped: no CUDA device (nvidia-smi lists no GPU)"
    exit 0
fi
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
slug=$(echo "$name" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\+/-/g; s/^-//; s/-$//')
out=tests/bench/results/${slug}.md
mkdir -p tests/bench/results
tmp=$(mktemp -d)
{
    echo "# GPU benchmarks: $name"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1), $($PY -c 'import torch;print("torch",torch.__version__)' 2>/dev/null || echo 'torch: not importable')"
    echo
    echo "## (a) kernels vs PyTorch (Llama-2-7B shapes, T = $T)"
    echo
    "$cb/bench/bench_kernels_gpu" --T "$T" 2>&1 || echo "bench_kernels_gpu: FAILED (exit $?)"
    echo
    echo "PyTorch rows:"
    echo
    echo "| kernel | shape | impl | ms | throughput | % of peak |"
    echo "|---|---|---|---|---|---|"
    $PY tests/bench/gpu/bench_torch.py --T "$T" 2>&1 | grep -v '^torch ' || echo "bench_torch.py: FAILED"
    echo
    echo "## (b) training step (LoRA r 16, alpha 32, dropout 0.05, all 7 linears; AdamW; clip 1.0; $STEPS timed steps after 2 warm-ups)"
    echo
    echo "Peak memory: ours = device memory in use by the process (cudaMemGetInfo, includes the CUDA context"
    echo "and cuBLAS workspaces); HF = torch.cuda.max_memory_reserved (excludes the context, ~0.5 GiB)."
    echo
    echo "| trainer | model | B x T | r | ckpt | tokens/s | step ms | peak GiB |"
    echo "|---|---|---|---|---|---|---|---|"
    if [ -f "$MODEL" ]; then
        "$cb/bench/bench_step_gpu" --model "$MODEL" --T "$T" --steps "$STEPS" --ckpt 0 2>"$tmp/s1.err" || { echo "| barq (CUDA) | $MODEL | FAILED | | | | | |"; tail -n 5 "$tmp/s1.err" >&2; }
        "$cb/bench/bench_step_gpu" --model "$MODEL" --T "$T" --steps "$STEPS" --ckpt 0 --attn mma --nf4 fused 2>"$tmp/s1f.err" || { echo "| barq (CUDA, mma attn, fused NF4) | $MODEL | FAILED | | | | | |"; tail -n 5 "$tmp/s1f.err" >&2; }
    else
        echo "| barq (CUDA) | SmolLM2 | skipped: $MODEL not found (make model) | | | | | |"
    fi
    if [ "${BENCH_SKIP_HF:-0}" != 1 ]; then
        BT_MODEL="$MODEL" $PY tests/bench/gpu/bench_hf_step.py --model smollm2 --T "$T" --steps "$STEPS" --ckpt 0 2>"$tmp/h1.err" || echo "| HF+PEFT | smollm2 | FAILED: $(tail -n 1 "$tmp/h1.err") | | | | | |"
    fi
    if [ "${BENCH_SKIP_7B:-0}" != 1 ]; then
        "$cb/bench/bench_step_gpu" --model random:llama2-7b --T "$T" --steps "$STEPS" --ckpt "$CK7" 2>"$tmp/s2.err" || { echo "| barq (CUDA) | random:llama2-7b | FAILED | | | | | |"; tail -n 5 "$tmp/s2.err" >&2; }
        "$cb/bench/bench_step_gpu" --model random:llama2-7b --T "$T" --steps "$STEPS" --ckpt "$CK7" --attn mma --nf4 fused 2>"$tmp/s2f.err" || { echo "| barq (CUDA, mma attn, fused NF4) | random:llama2-7b | FAILED | | | | | |"; tail -n 5 "$tmp/s2f.err" >&2; }
        if [ "${BENCH_SKIP_HF:-0}" != 1 ]; then
            $PY tests/bench/gpu/bench_hf_step.py --model llama2-7b --T "$T" --steps "$STEPS" --ckpt "$CK7" 2>"$tmp/h2.err" || echo "| HF+PEFT | llama2-7b | FAILED: $(tail -n 1 "$tmp/h2.err") | | | | | |"
        fi
    fi
    if [ "${BENCH_SKIP_LONG:-0}" != 1 ]; then
        echo
        echo "## (c) long context: T = $LT, context extended to T (linear), LoRA r 16 on all linears, checkpointing; $LSTEPS timed steps"
        echo
        echo "| trainer | model | B x T | r | ckpt | tokens/s | step ms | peak GiB |"
        echo "|---|---|---|---|---|---|---|---|"
        models=()
        [ -f "$MODEL" ] && models+=("$MODEL")
        [ "${BENCH_SKIP_7B:-0}" != 1 ] && models+=("random:llama2-7b")
        for mdl in "${models[@]}"; do
            for variant in "--s2 0.25" "--s2 0" "--s2 0.25 --offload 1" "--s2 0 --offload 1"; do
                # shellcheck disable=SC2086
                "$cb/bench/bench_step_gpu" --model "$mdl" --T "$LT" --extend "$LT" --ckpt 1 --steps "$LSTEPS" \
                    --warmup 1 $variant 2>>"$tmp/long.err" || echo "| barq (CUDA, $variant) | $mdl | FAILED | | | | | |"
            done
        done
        echo
        echo "Longest T that runs one training step (S2-Attn 1/4, checkpointing, context extended to T), doubling from $LT:"
        echo
        echo "| trainer | model | B x T | r | ckpt | longest T | trainer estimate | device memory |"
        echo "|---|---|---|---|---|---|---|---|"
        for mdl in "${models[@]}"; do
            for off in 0 1; do
                "$cb/bench/bench_step_gpu" --model "$mdl" --max-T 1 --T "$LT" --extend 1 --ckpt 1 --s2 0.25 \
                    --offload "$off" 2>>"$tmp/long.err" || echo "| barq (CUDA) longest T | $mdl | FAILED | | | | | |"
            done
        done
    fi
    echo
    echo "Logs:"
    echo
    echo '```'
    cat "$tmp"/*.err 2>/dev/null | grep -v '^\s*$' | tail -n 40
    echo '```'
} | tee "$out"
rm -rf "$tmp"
echo "bench-gpu: wrote $out"
