#!/usr/bin/env bash
# loaderd pipeline end to end, in-process (tests/tools/bench_pipeline.c): data/demo shards
# (zstd JSONL, chat format: ~11k FOLDOC Q&A + 175 alpaca) -> lines -> ChatML -> BPE tokenize on
# N threads -> best-fit-decreasing packing -> batches of B=4 rows, one epoch, best of 3 runs.
# Prints a markdown section for `make bench` (tests/bench/run.sh).
# Target (issue 3 §9): >= 1M tokens/s per core. "per core" here = tokens / process CPU seconds
# (reader + tokenize workers + consumer, all of it), which does not flatter thread counts.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
tool=$BUILD/tools/bench_pipeline
[ -x "$tool" ] || make --no-print-directory "$tool" >&2
ls data/demo/train-*.jsonl.zst >/dev/null 2>&1 || scripts/make-shards data/demo >&2
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p"; }
echo "## loaderd pipeline (shards -> packed batches, in-process)"
echo
echo "data/demo train shards ($(ls data/demo/train-*.jsonl.zst | wc -l) zstd files, $(du -cb data/demo/train-*.jsonl.zst | tail -1 | cut -f1) bytes), chat format, $(basename "$MODEL") tokenizer, B=4, one epoch, best of 3."
echo
echo "| T | tokenize threads | tokens | docs | batches | packing efficiency | wall s | tokens/s | CPU s | tokens / CPU-s (per core) | vs 1M/s/core target |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for T in 2048 512; do
  for th in 1 2; do
    out=$("$tool" --model "$MODEL" --shards 'data/demo/train-*.jsonl.zst' --format chat --seq-len $T --batch 4 \
          --threads $th --epochs 1 --repeat 3)
    tps=$(echo "$out" | field tok_per_s); tpc=$(echo "$out" | field tok_per_cpu_s)
    verdict=$(awk -v x="$tpc" 'BEGIN{ printf "%s (%.2fx)", (x >= 1e6 ? "meets" : "below"), x / 1e6 }')
    printf '| %s | %s | %s | %s | %s | %.2f%% | %s | %.0f | %s | %.0f | %s |\n' "$T" "$th" \
      "$(echo "$out" | field tokens)" "$(echo "$out" | field docs)" "$(echo "$out" | field batches)" \
      "$(echo "$out" | field efficiency | awk '{print $1*100}')" "$(echo "$out" | field seconds)" "$tps" \
      "$(echo "$out" | field cpu_seconds)" "$tpc" "$verdict"
  done
done
echo
echo "Packing efficiency = real tokens / (batches x B x T), the final partly filled batch included."
echo "Windows of 256 x T tokens packed best-fit decreasing; one pipeline per job per node (its ranks"
echo "share it; per-node and per-epoch costs with the token cache: see \"Data plane per node\")."
