#!/usr/bin/env bash
# The main job, end to end, on the real default: real shards (FOLDOC + alpaca seed tasks) ->
# loaderd (foreground, private socket) -> trainer QLoRA-fine-tunes SmolLM2-135M-Instruct on CPU
# -> held-out loss before/after and the PEFT adapter. Run through `make demo` (which installs,
# fetches the model and builds first). Extra trainer overrides: DEMO_SET="steps=10 lr=1e-3".
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
run=runs/demo
mkdir -p "$run"
t0=$(date +%s)

scripts/make-shards data/demo

. scripts/private-loaderd.sh
start_loaderd "$run"
echo "demo: loaderd listening on $sock (watch it live: build/loaderctl --socket $sock watch)"

# Snapshot loaderd's live status every 20 s while the trainer runs.
( while sleep 20; do
    { date -u +%H:%M:%S; build/loaderctl --socket "$sock" status 2>&1; echo; } >> "$run/loaderctl-status.log"
  done ) &
status_pid=$!

sets=(--set "socket=$sock")
for kv in ${DEMO_SET:-}; do sets+=(--set "$kv"); done
build/trainer train --config scripts/job.demo.json "${sets[@]}" 2>&1 | tee "$run/trainer.log"

kill "$status_pid" 2>/dev/null || true; status_pid=""
if [ -s "$run/loaderctl-status.log" ]; then
  echo
  echo "demo: loaderd as loaderctl saw it during training (last snapshot of $run/loaderctl-status.log):"
  awk 'BEGIN{RS=""} /demo  /{last=$0} END{print last}' "$run/loaderctl-status.log"
fi
stop_loaderd || { echo "demo: loaderd exited with an error; see $run/loaderd.log" >&2; exit 1; }
t1=$(date +%s)
echo "demo: loaderd stopped cleanly; live status snapshots in $run/loaderctl-status.log"
if [ -s "$run/report/report.png" ]; then
  build/trainer report "$run/report"
  echo "demo: run report: $run/report/metrics.jsonl (one JSON line per step and held-out evaluation)"
  echo "      and the plot $run/report/report.png (redraw it: build/trainer report $run/report)"
fi
echo "demo: wall time $(( (t1 - t0) / 60 ))m$(( (t1 - t0) % 60 ))s"
