#!/usr/bin/env bash
# DPO on real preference data (issue 25 §4): `make dpo-data` (FOLDOC: each term's real definition
# chosen, a confusable term's definition rejected, 200 held-out terms) -> loaderd with a token cache
# -> trainer DPO-fine-tunes SmolLM2-135M-Instruct (GGUF-native Q4_1 base, CPU) -> held-out
# preference accuracy before / after: logps/accuracies (ours: the share of held-out pairs whose
# POLICY log-prob of chosen > rejected; it must rise by at least 10 points, else the demo fails)
# and logps/margins, next to TRL's rewards/accuracies and rewards/margins (0 before training by
# construction: policy = reference), and the PEFT adapter.
# The evaluation before training scores each pair with one forward: the fresh adapter is the
# identity (lora_B = 0), so the reference's log-probs (which it computes and hands to loaderd's
# cache) are the policy's; the one after training reads them back from the cache.
# Then run 2, the first DEMO_CACHED_STEPS (default 4; 0: all) steps of the same training with the
# reference log-probs from loaderd's cache (precompute_ref_log_probs; stop_at_step keeps run 1's
# schedule, so its losses must equal run 1's): the time saved per step is measured against run 1's
# same steps, in wall seconds (metrics.jsonl step_s) and in CPU seconds (the trainer's
# "steps in ... (CPU ...)" line: load-insensitive where other processes share the CPUs).
# Every phase's wall and CPU time is printed at the end. Run through `make demo-dpo`. Extra
# trainer overrides: DEMO_SET="steps=30 optim.lr=5e-4".
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
run=runs/demo-dpo
rm -rf "$run/adapter" "$run/adapter2" "$run/report" "$run/report2" "$run/tcache" "$run/checkpoint2"
mkdir -p "$run"
t0=$(date +%s)
cached_steps=${DEMO_CACHED_STEPS:-4}
load0=$(cut -d' ' -f1-3 /proc/loadavg)
TIMEFORMAT="%R %U %S" # bash's `time`: wall, user, system seconds

data_t="(already built)"
if [ ! -s data/dpo/eval.jsonl ]; then
  { time python3 scripts/make-dpo-data data/dpo; } 2> "$run/time.data"
  data_t=$(awk '{printf "%.1f s (CPU %.1f s)", $1, $2 + $3}' "$run/time.data")
fi

. scripts/private-loaderd.sh
start_loaderd "$run" "\"token_cache_dir\": \"$root/$run/tcache\","
echo "demo-dpo: loaderd listening on $sock, token cache in $run/tcache"

sets=(--set "socket=$sock")
for kv in ${DEMO_SET:-}; do sets+=(--set "$kv"); done
echo "demo-dpo: run 1: reference log-probs computed (and handed to loaderd's cache)"
{ time build/trainer train --config scripts/job.demo-dpo.json "${sets[@]}" 2>&1 | tee "$run/trainer.log"; } \
  2> "$run/time.run1"
echo "demo-dpo: run 2: the first ${cached_steps/#0/all} steps of the same training, reference log-probs" \
  "from the cache (no held-out evaluation)"
{ time build/trainer train --config scripts/job.demo-dpo.json "${sets[@]}" --set out_dir=$run/adapter2 \
  --set report.dir=$run/report2 --set 'eval.shards=[]' --set "stop_at_step=$cached_steps" \
  --set checkpoint_dir=$run/checkpoint2 2>&1 | tee "$run/trainer2.log"; } 2> "$run/time.run2"
# loaderd's CPU seconds (utime + stime of /proc/PID/stat, in clock ticks) before it exits
ld_cpu=$(awk -v hz="$(getconf CLK_TCK)" '{sub(/^.*\) /, ""); printf "%.1f", ($12 + $13) / hz}' \
  "/proc/$ld_pid/stat" 2>/dev/null || echo "?")
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
python3 - "$run" "$data_t" "$ld_cpu" <<'PY' || ok=$?
import json, re, sys
run, data_t, ld_cpu = sys.argv[1:4]
a, b = (open(f"{run}/{n}").read() for n in ("trainer.log", "trainer2.log"))
def ev(t):
    return re.search(r"held-out rewards/accuracies: before (\S+) -> after (\S+); rewards/margins:? before (\S+) -> after (\S+)", t)
def lp(t):
    return re.search(r"held-out logps/accuracies \(policy log-prob chosen > rejected\): before (\S+) -> after (\S+) "
                     r"\(\S+ points\); logps/margins: before (\S+) -> after (\S+) \((\d+) pairs\)", t)
def train(t):  # (steps, wall s, CPU s) of the trainer's end-of-training line
    m = re.search(r"(\d+) steps in (\S+) s \(CPU (\S+) s\)", t)
    return (int(m.group(1)), float(m.group(2)), float(m.group(3))) if m else (0, float("nan"), float("nan"))
def heldout(t):  # [(wall s, CPU s, policy forward skipped)] of each held-out evaluation
    return [(float(w), float(c), bool(x)) for w, c, x in
            re.findall(r"held-out: .*\((\S+) s, CPU (\S+) s(; the adapter is the identity)?", t)]
def step_s(name):  # metrics.jsonl: wall seconds of each step
    out = []
    for line in open(f"{run}/{name}/metrics.jsonl"):
        j = json.loads(line)
        if j.get("type") == "train": out.append(j["step_s"])
    return out
def proc(name):  # bash time of the whole trainer process: wall, CPU
    w, u, s = open(f"{run}/{name}").read().split()[-3:]
    return float(w), float(u) + float(s)
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
n1, w1, c1 = train(a)
n2, w2, c2 = train(b)
s1, s2 = step_s("report"), step_s("report2")
k = min(n2, len(s1), len(s2))
la, lb = losses(a), losses(b)
same = len(lb) > 0 and lb == la[:len(lb)]
ho = heldout(a)
print("demo-dpo: phases, wall / CPU seconds (CPU: user + system of all threads, less sensitive to other load):")
print(f"demo-dpo:   data build (make-dpo-data)        {data_t}")
if len(ho) >= 1:
    print(f"demo-dpo:   run 1 held-out before training   {ho[0][0]:7.1f} s (CPU {ho[0][1]:.1f} s)"
          + (" one forward per batch: policy = reference" if ho[0][2] else ""))
print(f"demo-dpo:   run 1 training ({n1} steps)          {w1:7.1f} s (CPU {c1:.1f} s), reference computed")
if len(ho) >= 2:
    print(f"demo-dpo:   run 1 held-out after training    {ho[1][0]:7.1f} s (CPU {ho[1][1]:.1f} s), reference from the cache")
pw1, pc1 = proc("time.run1")
pw2, pc2 = proc("time.run2")
print(f"demo-dpo:   run 1 trainer process            {pw1:7.1f} s (CPU {pc1:.1f} s)")
print(f"demo-dpo:   run 2 training ({n2} steps)           {w2:7.1f} s (CPU {c2:.1f} s), reference from the cache")
print(f"demo-dpo:   run 2 trainer process            {pw2:7.1f} s (CPU {pc2:.1f} s)")
print(f"demo-dpo:   loaderd (both runs)              CPU {ld_cpu} s")
print(f"demo-dpo: run 1 reference values: {refs(a)}")
print(f"demo-dpo: run 2 reference values: {refs(b)}")
if k > 0 and n1 > 0 and n2 > 0:
    a_k, b_k = sum(s1[:k]), sum(s2[:k])
    cps1, cps2 = c1 / n1, c2 / n2
    print(f"demo-dpo: training time saved by the cache: steps 1-{k} took {a_k:.1f} s with the reference computed "
          f"(run 1), {b_k:.1f} s from the cache (run 2): {a_k - b_k:.1f} s saved ({100 * (a_k - b_k) / a_k:.0f}%, wall, "
          f"load-dependent); CPU per step {cps1:.1f} s -> {cps2:.1f} s: {cps1 - cps2:.1f} s saved per step "
          f"({100 * (cps1 - cps2) / cps1:.0f}%), {n1 * (cps1 - cps2):.0f} CPU s over run 1's {n1} steps")
print(f"demo-dpo: run 2's printed losses / acc / margins equal run 1's first {len(lb)} steps: {same}")
if not p:
    print("demo-dpo: FAILED: no held-out logps/accuracies before / after line in " + run + "/trainer.log", file=sys.stderr)
    sys.exit(1)
if not same:
    print("demo-dpo: FAILED: the cached-reference run's losses differ from run 1's", file=sys.stderr)
    sys.exit(1)
if not rise >= 10.0:
    print(f"demo-dpo: FAILED: held-out preference accuracy rose {rise:+.1f} points, the demo asks >= +10",
          file=sys.stderr)
    sys.exit(1)
print(f"demo-dpo: held-out preference accuracy rose {rise:+.1f} points (>= +10: ok)")
PY
t4=$(date +%s)
echo "demo-dpo: wall time $(( (t4 - t0) / 60 ))m$(( (t4 - t0) % 60 ))s (load average at the start $load0," \
  "at the end $(cut -d' ' -f1-3 /proc/loadavg), on $(nproc) CPUs)"
exit $ok
