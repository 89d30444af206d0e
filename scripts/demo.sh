#!/usr/bin/env bash
# The main job, end to end, on the real default: real shards (FOLDOC + alpaca seed tasks) ->
# loaderd (foreground, private socket) -> trainer QLoRA-fine-tunes SmolLM2-135M-Instruct on CPU
# -> held-out loss before/after and the PEFT adapter. Run through `make demo` (which installs,
# fetches the model and builds first). Extra trainer overrides: DEMO_SET="steps=10 lr=1e-3".
# DEMO_MODEL=gemma3-270m (`make demo MODEL=gemma3-270m`): the same data on Gemma 3 270M
# (pretrained, GGUF-native Q4_K_M, Gemma's turn format; scripts/job.demo-gemma3.json, run dir
# runs/demo-gemma3), then the adapter in `trainer generate` and exported for llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
run=runs/demo
job=scripts/job.demo.json
case "${DEMO_MODEL:-smollm2}" in
smollm2) ;;
gemma3-270m) run=runs/demo-gemma3 job=scripts/job.demo-gemma3.json ;;
*) echo "demo: unknown DEMO_MODEL \"$DEMO_MODEL\" (smollm2, gemma3-270m)" >&2; exit 2 ;;
esac
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
build/trainer train --config "$job" "${sets[@]}" 2>&1 | tee "$run/trainer.log"

kill "$status_pid" 2>/dev/null || true; status_pid=""
if [ -s "$run/loaderctl-status.log" ]; then
  echo
  echo "demo: loaderd as loaderctl saw it during training (last snapshot of $run/loaderctl-status.log):"
  awk -v j="$(basename "$run")  " 'BEGIN{RS=""} index($0, j){last=$0} END{print last}' "$run/loaderctl-status.log"
fi
stop_loaderd || { echo "demo: loaderd exited with an error; see $run/loaderd.log" >&2; exit 1; }
t1=$(date +%s)
echo "demo: loaderd stopped cleanly; live status snapshots in $run/loaderctl-status.log"
if [ -s "$run/report/report.png" ]; then
  build/trainer report "$run/report"
  echo "demo: run report: $run/report/metrics.jsonl (one JSON line per step and held-out evaluation)"
  echo "      and the plot $run/report/report.png (redraw it: build/trainer report $run/report)"
fi
if [ "$run" = runs/demo-gemma3 ]; then
  # the adapter in our own generator and, exported as a GGUF LoRA, in llama.cpp (when the
  # reference library of scripts/llamacpp-ref.sh is installed); Gemma's turn format
  model=$(sed -n 's/^ *"model": "\(.*\)",$/\1/p' "$job")
  prompt=$'<start_of_turn>user\nWhat is FOLDOC?<end_of_turn>\n<start_of_turn>model\n'
  echo "demo: trainer generate, greedy, 40 tokens, base then base + adapter:"
  build/trainer generate --model "$model" --prompt "$prompt" --max-new-tokens 40 2>/dev/null
  build/trainer generate --model "$model" --adapter "$run/adapter" --prompt "$prompt" \
    --max-new-tokens 40 2>/dev/null
  build/trainer export --model "$model" --adapter "$run/adapter" --format gguf-lora \
    --out "$run/adapter-lora.gguf"
  if [ -f .llamacpp/xllamacpp.abi3.so ]; then
    # the GGUF as is: llama.cpp b8929 takes a LoRA on the Q4_K tensors it repacks
    # (tests/py/test_llamacpp.py::test_lora_on_repacked_q4_k), so no F32 copy is written
    echo "demo: llama.cpp (b8929) with $run/adapter-lora.gguf on $model, greedy, 40 tokens:"
    BT_PROMPT="$prompt" BT_MODEL="$model" BT_LORA="$run/adapter-lora.gguf" python3 - <<'PY'
import os, sys
sys.path[:0] = ["tests/py"]
import llamacpp_ref
lc = llamacpp_ref.LlamaCpp.from_env()
m = lc.load_model(os.environ["BT_MODEL"])
ctx = m.context(512, adapter=m.lora(os.environ["BT_LORA"]))
ids = m.tokenize(os.environ["BT_PROMPT"].encode(), add_special=True, parse_special=True)
print(m.detokenize(ctx.greedy(ids, 40)).decode(errors="replace"))
PY
  else
    echo "demo: llama.cpp reference not installed (scripts/llamacpp-ref.sh): skipping its run"
  fi
fi
t1=$(date +%s)
echo "demo: wall time $(( (t1 - t0) / 60 ))m$(( (t1 - t0) % 60 ))s"
