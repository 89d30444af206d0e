#!/usr/bin/env bash
# `make demo-long`: extend SmolLM2-135M-Instruct (trained context 8192) to 16384 tokens with
# linear position interpolation and S2-Attn, on the CPU, and measure it on held-out long
# documents (scripts/make-long-docs: Shakespeare, the Debian Reference, Linux manual pages; every
# document >= 16384 tokens; the held-out ones never trained on):
#   1. held-out perplexity of the base model without extension, at 2048 and 16384 tokens;
#   2. `trainer train` with the long-context template: its evaluation before training is the
#      base with interpolation alone, after training the fine-tuned model (2048 and 16384);
#   3. one training step with full attention instead of S2-Attn (same settings otherwise);
#   4. `trainer estimate` for the job against the measured peak RSS of both runs (within 15%).
# Prints the figures and writes them to runs/demo-long/summary.md. Extra trainer overrides:
# DEMO_SET="steps=4 optim.lr=1e-4"; DEMO_EVAL_DOCS (1: held-out documents of ~16.9K tokens, each
# one 16384-token forward per evaluation), DEMO_SHORT / DEMO_LONG (2048 / 16384: the lengths
# evaluated; DEMO_LONG is also the row length and the extension's target). Run through
# `make demo-long` (set-up, model, build first).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
run=runs/demo-long
mkdir -p "$run"
t0=$(date +%s)
short=${DEMO_SHORT:-2048}   # the short-context length (regression check)
long=${DEMO_LONG:-16384}    # the extended length

scripts/make-long-docs data/long --eval-docs "${DEMO_EVAL_DOCS:-1}"

. scripts/private-loaderd.sh
start_loaderd "$run"
echo "demo-long: loaderd listening on $sock"

# the job: trainer config --template long-context, on this data, a short fine-tune
build/trainer config --template long-context > "$run/job.template.json"
sets=(--set "socket=$sock" --set "data.shards=[\"data/long/train-*.jsonl.zst\"]"
      --set "eval.shards=[\"data/long/eval.jsonl.zst\"]" --set "eval.lengths=[$short, $long]"
      --set "data.tokenizer_threads=2" --set "data.seq_len=$long"
      --set "context_extension.target_length=$long" --set steps=3 --set grad_accum=1 --set optim.lr=2e-4
      --set optim.warmup_steps=0 --set log_every=1 --set save_every=0 --set threads=0
      --set "out_dir=$run/adapter" --set "name=demo-long")
for kv in ${DEMO_SET:-}; do sets+=(--set "$kv"); done
build/trainer config --check "$run/job.template.json" "${sets[@]}" > "$run/job.json"
echo "demo-long: job $run/job.json (from trainer config --template long-context)"
job=(--config "$run/job.json")

# 1. the base model as it is: positions beyond 8192 were never trained
echo "demo-long: [1/4] held-out perplexity of the base model without extension"
build/trainer eval "${job[@]}" --set "context_extension=null" > "$run/eval-base.out" 2> "$run/eval-base.log"
cat "$run/eval-base.out"

# 2. extension (linear, 8192 -> 16384) + S2-Attn fine-tune; evaluated before and after
echo "demo-long: [2/4] fine-tune with interpolation and S2-Attn (held-out before = interpolation alone)"
build/trainer train "${job[@]}" > "$run/train.out" 2> "$run/train.log"
cat "$run/train.out"

# 3. the same step with full attention
echo "demo-long: [3/4] one step with full attention, for the step time and memory"
build/trainer train "${job[@]}" --set "attention.s2=null" --set steps=1 --set "eval.shards=[]" \
  --set "out_dir=$run/adapter-full" > "$run/train-full.out" 2> "$run/train-full.log"
cat "$run/train-full.out"

stop_loaderd || { echo "demo-long: loaderd exited with an error; see $run/loaderd.log" >&2; exit 1; }

# 4. the estimate for this job
echo "demo-long: [4/4] trainer estimate for the job"
build/trainer estimate "${job[@]}" > "$run/estimate.out"
build/trainer estimate "${job[@]}" --set "attention.s2=null" > "$run/estimate-full.out"
t1=$(date +%s)

python3 - "$run" "$(( t1 - t0 ))" "$short" "$long" <<'PY'
import re, sys
run, wall, S, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def read(name):
    return open(f"{run}/{name}", encoding="utf-8").read()
def ppl_eval(text):
    return {int(m[1]): float(m[2]) for m in
            re.finditer(r"held-out perplexity at (\d+) tokens: ([0-9.]+) \(", text)}
def ppl_train(text):
    return {int(m[1]): (float(m[2]), float(m[3])) for m in
            re.finditer(r"held-out perplexity at (\d+) tokens: before ([0-9.]+) -> after ([0-9.]+)", text)}
def steps(text):
    s = [(int(m[1]), m[2]) for m in re.finditer(r"^step (\d+)/\d+ .*elapsed (\S+) \|", text, re.M)]
    def secs(t):
        h = re.match(r"(?:(\d+)h)?(\d+)m(\d+)s", t)
        return int(h[1] or 0) * 3600 + int(h[2]) * 60 + int(h[3])
    return s[-1][0], secs(s[-1][1])
def rss(log):
    return float(re.search(r"peak RSS ([0-9.]+) MiB", log)[1])
def est(text):
    return float(re.search(r"^\s+peak\s+([0-9.]+) MiB", text, re.M)[1])
base, tr = ppl_eval(read("eval-base.out")), ppl_train(read("train.out"))
n_s2, t_s2 = steps(read("train.out"))
n_full, t_full = steps(read("train-full.out"))
rss_s2, rss_full = rss(read("train.log")), rss(read("train-full.log"))
est_s2, est_full = est(read("estimate.out")), est(read("estimate-full.out"))
windows = {int(m[1]): int(m[2]) for m in re.finditer(r"held-out at (\d+) tokens: (\d+) windows", read("eval-base.log"))}
rows = [
    (f"held-out perplexity at {L}, base model (no extension)", f"{base[L]:.2f}"),
    (f"held-out perplexity at {L}, linear interpolation alone", f"{tr[L][0]:.2f}"),
    (f"held-out perplexity at {L}, after the S2-Attn fine-tune ({n_s2} steps)", f"{tr[L][1]:.2f}"),
    (f"held-out perplexity at {S}, base model", f"{base[S]:.2f}"),
    (f"held-out perplexity at {S}, interpolation alone", f"{tr[S][0]:.2f}"),
    (f"held-out perplexity at {S}, after the fine-tune", f"{tr[S][1]:.2f}"),
    (f"CPU step time at {L} tokens, S2-Attn (mean of {n_s2})", f"{t_s2 / n_s2:.0f} s"),
    (f"CPU step time at {L} tokens, full attention", f"{t_full / n_full:.0f} s"),
    ("S2-Attn / full attention step time", f"{(t_s2 / n_s2) / (t_full / n_full):.2f}x"),
    ("peak RSS, S2-Attn run (trainer estimate)", f"{rss_s2:.0f} MiB ({est_s2:.0f} MiB, {100 * (est_s2 - rss_s2) / rss_s2:+.1f}%)"),
    ("peak RSS, full-attention run (trainer estimate)", f"{rss_full:.0f} MiB ({est_full:.0f} MiB, {100 * (est_full - rss_full) / rss_full:+.1f}%)"),
    ("wall time of the demo", f"{wall // 60}m{wall % 60:02d}s"),
]
md = ["| what | measured |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
md.append("")
md.append(f"Held-out: {windows.get(L, '?')} window(s) of {L} tokens and {windows.get(S, '?')} of "
          f"{S} over the same document tokens.")
open(f"{run}/summary.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
ok = abs(est_s2 - rss_s2) <= 0.15 * rss_s2 and abs(est_full - rss_full) <= 0.15 * rss_full
print(f"demo-long: estimate within 15% of the measured peak RSS: {'yes' if ok else 'NO'}")
sys.exit(0 if ok else 1)
PY
echo "demo-long: figures in $run/summary.md; logs in $run/"
