#!/usr/bin/env bash
# Long rows on the CPU (issue 12): `trainer estimate` against the peak RSS the trainer reports
# (getrusage ru_maxrss) for one training step of SmolLM2-135M-Instruct at T = 4096, 8192 and 16384
# tokens, job = `trainer config --template long-context` (context extension to T, S2-Attn 1/4,
# activation checkpointing "auto", LoRA r 8 q/k/v/o + trainable embed_tokens and norms), on the
# long documents of scripts/make-long-docs through a private loaderd; plus the step time. Fails
# when an estimate is more than 15% away from the measured peak. BENCH_LONG_T overrides the
# lengths ("4096 8192 16384").
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
BUILD=${BUILD:-build}
run=runs/bench-long
mkdir -p "$run"
make -s "$BUILD/trainer" "$BUILD/loaderd" "$BUILD/loaderctl" >&2
# its own directory: scripts/demo-long.sh cuts data/long with its own number of held-out documents
scripts/make-long-docs data/long-bench >&2
. scripts/private-loaderd.sh
start_loaderd "$run"
"$BUILD/trainer" config --template long-context > "$run/job.template.json"

echo "## Long rows: trainer estimate vs measured peak RSS (CPU)"
echo
echo "Command: \`make bench\` (tests/bench/bench_long.sh): one step of \`trainer train\` with the long-context"
echo "template (context extended to T, S2-Attn 1/4, checkpointing auto, LoRA r 8 + LoRA+), threads = all cores."
echo
echo "| T | step time | measured peak RSS | trainer estimate | estimate error |"
echo "|---|---|---|---|---|"
fail=0
for T in ${BENCH_LONG_T:-4096 8192 16384}; do
  sets=(--set "socket=$sock" --set "data.shards=[\"data/long-bench/train-*.jsonl.zst\"]"
        --set "eval.shards=[]" --set "data.seq_len=$T" --set "steps=1" --set "grad_accum=1"
        --set "save_every=0" --set "threads=0" --set "out_dir=$run/adapter-$T" --set "name=bench-long-$T")
  [ "$T" -gt 8192 ] && sets+=(--set "context_extension.target_length=$T") \
                   || sets+=(--set "context_extension=null")
  "$BUILD/trainer" config --check "$run/job.template.json" "${sets[@]}" > "$run/job-$T.json"
  est=$("$BUILD/trainer" estimate --config "$run/job-$T.json" | awk '$1 == "peak" {print $2}')
  "$BUILD/trainer" train --config "$run/job-$T.json" > "$run/train-$T.out" 2> "$run/train-$T.log"
  rss=$(grep -o 'peak RSS [0-9.]* MiB' "$run/train-$T.log" | awk '{print $3}')
  step=$(grep -o 'elapsed [0-9hms]*' "$run/train-$T.out" | tail -n1 | cut -d' ' -f2)
  err=$(awk -v e="$est" -v r="$rss" 'BEGIN {printf "%+.1f%%", 100 * (e - r) / r}')
  echo "| $T | $step | $rss MiB | $est MiB | $err |"
  awk -v e="$est" -v r="$rss" 'BEGIN {exit !((e - r) / r <= 0.15 && (r - e) / r <= 0.15)}' || fail=1
done
stop_loaderd
exit $fail
