#!/usr/bin/env bash
# Training-path CPU benchmarks (tests/tools/bench_train.c): fused vs unfused linear+CE (at
# SmolLM2-135M's and at Gemma 3 270M's 262,144-token vocabulary, random weights), NF4 vs
# fp32 linear, SmolLM2 micro-batch NF4 vs fp32 — each pair measured side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
make -s "$BUILD/tools/bench_train" >&2
echo "## Trainer (CPU backend)"
echo
echo "Command: \`$BUILD/tools/bench_train models/SmolLM2-135M-Instruct.Q4_1.gguf --tokens 2048 --reps 3\`"
echo
"$BUILD/tools/bench_train" models/SmolLM2-135M-Instruct.Q4_1.gguf --tokens 2048 --reps 3
