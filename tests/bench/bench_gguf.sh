#!/usr/bin/env bash
# GGUF-native base (issue 13) on the demo data: held-out loss of SmolLM2-135M-Instruct with its
# base held as the GGUF's own Q4_1 blocks (base_dtype gguf), as the fp32 dequantisation of those
# blocks (fp32) and as their NF4 re-quantisation (nf4), measured side by side in one run through
# loaderd (`trainer eval`: the 64 held-out FOLDOC documents of data/demo/eval.jsonl.zst, seq_len
# 256, micro-batch 4, every batch, no adapter). The GGUF-native loss must equal the fp32 one within
# 1e-4. Step time and model memory of the three bases are in bench_train.sh's micro-batch table.
# Prints a markdown section for `make bench` (tests/bench/run.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
BUILD=${BUILD:-build}
MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -x "$BUILD/trainer" ] && [ -x "$BUILD/loaderd" ] || make --no-print-directory "$BUILD/trainer" "$BUILD/loaderd" >&2
ls data/demo/eval.jsonl.zst >/dev/null 2>&1 || scripts/make-shards data/demo >&2
tmp=$(mktemp -d /tmp/bt-bench-gguf.XXXXXX)
sock=$tmp/loaderd.sock
cat > "$tmp/loaderd.json" <<JSON
{"socket": "$sock", "socket_mode": "0600", "data_roots": ["$root/data"],
 "model_roots": ["$(cd "$(dirname "$MODEL")" && pwd)"], "tokenizer_threads": 2}
JSON
"$BUILD/loaderd" --config "$tmp/loaderd.json" --foreground 2> "$tmp/loaderd.log" &
ld=$!
cleanup() { kill -TERM "$ld" 2>/dev/null || true; wait "$ld" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "bench_gguf: loaderd did not start" >&2; cat "$tmp/loaderd.log" >&2; exit 1; }

echo "## GGUF-native base: held-out loss (demo data)"
echo
echo "SmolLM2-135M-Instruct ($(basename "$MODEL")), the 64 held-out documents of data/demo/eval.jsonl.zst, seq_len 256, micro-batch 4, all batches, no adapter; each base through \`$BUILD/trainer eval --config scripts/job.demo.json --set base_dtype=B --set data.seq_len=256 --set eval.max_batches=0\`."
echo
echo "| base_dtype | what the linears hold | held-out loss | perplexity | labelled tokens |"
echo "|---|---|---|---|---|"
declare -A loss
for b in gguf fp32 nf4; do
  out=$("$BUILD/trainer" eval --config scripts/job.demo.json --set "socket=$sock" --set "base_dtype=$b" \
        --set data.seq_len=256 --set eval.max_batches=0 --set model="$MODEL" 2> "$tmp/eval-$b.log") \
    || { echo "bench_gguf: trainer eval ($b) failed:" >&2; cat "$tmp/eval-$b.log" >&2; exit 1; }
  l=$(echo "$out" | sed -n 's/^held-out loss: \([0-9.]*\), perplexity \([0-9.]*\) (\([0-9]*\) tokens).*/\1 \2 \3/p')
  [ -n "$l" ] || { echo "bench_gguf: no held-out loss in: $out" >&2; exit 1; }
  set -- $l
  loss[$b]=$1
  case $b in
    gguf) what="the GGUF's own Q4_1 blocks (no re-quantisation)" ;;
    fp32) what="the fp32 dequantisation of those blocks" ;;
    nf4) what="their NF4 re-quantisation (double-quantised absmax)" ;;
  esac
  echo "| $b | $what | $1 | $2 | $3 |"
done
echo
python3 - "${loss[gguf]}" "${loss[fp32]}" "${loss[nf4]}" <<'PY'
import sys
g, f, n = map(float, sys.argv[1:])
print(f"|gguf - fp32| = {abs(g - f):.2e} (must be <= 1e-4: {'yes' if abs(g - f) <= 1e-4 else 'NO'}); "
      f"nf4 - gguf = {n - g:+.4f} (what re-quantising the GGUF to NF4 costs)")
PY
