#!/usr/bin/env bash
# DPO on real preference data (issue 25 §4): `make dpo-data` (FOLDOC: each term's real definition
# chosen, a confusable term's definition rejected, 200 held-out terms) -> loaderd with a token cache
# -> trainer DPO-fine-tunes SmolLM2-135M-Instruct (GGUF-native Q4_1 base, CPU) -> held-out
# preference accuracy before / after: logps/accuracies (ours: the share of held-out pairs whose
# POLICY log-prob of chosen > rejected; it must rise by at least 10 points, else the demo fails)
# and logps/margins, next to TRL's rewards/accuracies and rewards/margins (0 before training by
# construction: policy = reference), and the PEFT adapter. Then the same training
# again: the reference log-probs come from loaderd's cache (precompute_ref_log_probs), the losses
# are the same, and the training time saved is printed (run 2 skips the held-out evaluations,
# which run 1 already shows: its second one reads the reference values its first one cached; this
# keeps the demo within 15 minutes on 2 cores). Run through `make demo-dpo`. Extra trainer
# overrides: DEMO_SET="steps=30 optim.lr=5e-4".
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
run=runs/demo-dpo
rm -rf "$run/adapter" "$run/adapter2" "$run/report" "$run/report2" "$run/tcache"
mkdir -p "$run"
t0=$(date +%s)

[ -s data/dpo/eval.jsonl ] || python3 scripts/make-dpo-data data/dpo

. scripts/private-loaderd.sh
start_loaderd "$run" "\"token_cache_dir\": \"$root/$run/tcache\","
echo "demo-dpo: loaderd listening on $sock, token cache in $run/tcache"

sets=(--set "socket=$sock")
for kv in ${DEMO_SET:-}; do sets+=(--set "$kv"); done
echo "demo-dpo: run 1: reference log-probs computed (and handed to loaderd's cache)"
t1=$(date +%s)
build/trainer train --config scripts/job.demo-dpo.json "${sets[@]}" 2>&1 | tee "$run/trainer.log"
t2=$(date +%s)
echo "demo-dpo: run 2: the same training, reference log-probs from the cache (no held-out evaluation)"
build/trainer train --config scripts/job.demo-dpo.json "${sets[@]}" --set out_dir=$run/adapter2 \
  --set report.dir=$run/report2 --set 'eval.shards=[]' 2>&1 | tee "$run/trainer2.log"
t3=$(date +%s)
stop_loaderd || { echo "demo-dpo: loaderd exited with an error; see $run/loaderd.log" >&2; exit 1; }

for f in adapter_config.json adapter_model.safetensors; do
  [ -s "$run/adapter/$f" ] || { echo "demo-dpo: $run/adapter/$f missing" >&2; exit 1; }
done
if [ -x .venv-torch/bin/python ]; then
  .venv-torch/bin/python - "$run/adapter" <<'PY'
import sys, json
from peft import LoraConfig
from safetensors.torch import load_file
cfg = LoraConfig.from_pretrained(sys.argv[1])
w = load_file(sys.argv[1] + "/adapter_model.safetensors")
bad = [k for k in w if not (k.startswith("base_model.model.model.layers.") and
                             (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight")))]
assert not bad and w, f"not PEFT's LoRA names: {bad[:3]}"
print(f"demo-dpo: peft reads the adapter: r {cfg.r}, lora_alpha {cfg.lora_alpha}, "
      f"{len(w)} tensors, target_modules {sorted(cfg.target_modules)}")
PY
fi

ok=0
python3 - "$run/trainer.log" "$run/trainer2.log" <<'PY' || ok=$?
import re, sys
a, b = (open(p).read() for p in sys.argv[1:3])
def ev(t):
    m = re.search(r"held-out rewards/accuracies: before (\S+) -> after (\S+); rewards/margins:? before (\S+) -> after (\S+)", t)
    return m
def lp(t):
    return re.search(r"held-out logps/accuracies \(policy log-prob chosen > rejected\): before (\S+) -> after (\S+) "
                     r"\(\S+ points\); logps/margins: before (\S+) -> after (\S+) \((\d+) pairs\)", t)
def train_s(t):
    m = re.search(r"(\d+) steps in (\S+) s", t)
    return float(m.group(2)) if m else float("nan")
def heldout_s(t):
    return sum(float(x) for x in re.findall(r"held-out: .*\((\S+) s\)", t))
def losses(t):
    return re.findall(r"^step (\d+)/\d+ \| loss (\S+) \| acc (\S+) \| margin (\S+)", t, re.M)
def refs(t):
    m = re.search(r"reference log-probs \(rank 0\): (.*)", t)
    return m.group(1) if m else "?"
m = ev(a)
if m:
    print(f"demo-dpo: held-out rewards/accuracies {float(m.group(1)):.3f} -> {float(m.group(2)):.3f}, "
          f"rewards/margins {float(m.group(3)):.4f} -> {float(m.group(4)):.4f}")
p = lp(a)
rise = 100.0 * (float(p.group(2)) - float(p.group(1))) if p else float("nan")
if p:
    print(f"demo-dpo: held-out preference accuracy (policy log-prob chosen > rejected, logps/accuracies) "
          f"{float(p.group(1)):.3f} -> {float(p.group(2)):.3f} ({rise:+.1f} points, {p.group(5)} pairs); "
          f"mean policy margin (logps/margins) {float(p.group(3)):.3f} -> {float(p.group(4)):.3f}")
print(f"demo-dpo: run 1 (reference computed): training {train_s(a):.1f} s, held-out evaluations {heldout_s(a):.1f} s; {refs(a)}")
print(f"demo-dpo: run 2 (reference cached):   training {train_s(b):.1f} s; {refs(b)}")
print(f"demo-dpo: training time saved by the cache: {train_s(a) - train_s(b):.1f} s; "
      f"printed losses / acc / margins identical: {losses(a) == losses(b) and len(losses(a)) > 0}")
if not p:
    print("demo-dpo: FAILED: no held-out logps/accuracies before / after line in " + sys.argv[1], file=sys.stderr)
    sys.exit(1)
if not rise >= 10.0:
    print(f"demo-dpo: FAILED: held-out preference accuracy rose {rise:+.1f} points, the demo asks >= +10",
          file=sys.stderr)
    sys.exit(1)
print(f"demo-dpo: held-out preference accuracy rose {rise:+.1f} points (>= +10: ok)")
PY
t4=$(date +%s)
echo "demo-dpo: wall time $(( (t4 - t0) / 60 ))m$(( (t4 - t0) % 60 ))s"
exit $ok
