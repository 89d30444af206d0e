#!/usr/bin/env bash
# Tokenizer benchmark (run by `make bench`, which appends stdout to the results file): single-thread
# throughput of the C tokenizer (build/tools/bench_tok) on the parity corpus for the SmolLM2,
# Llama-3-style and Qwen2-style tokenizers, next to HF `tokenizers` and `tiktoken` measured by
# tests/bench/bench_tokenizer.py in .venv-ref (created from
# tests/reference/requirements-tokenizer.txt if missing; rows say "skipped" if PyPI is unreachable).
# Never fails the bench run because of Python-side problems.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CORPUS=tests/fixtures/tokenizer/corpus.bin.zst
FIX=tests/fixtures/tokenizer
echo "## Tokenizer throughput"
echo
if [ ! -x "$BUILD/tools/bench_tok" ]; then
  make --no-print-directory "$BUILD/tools/bench_tok" >&2 || { echo "skipped: cannot build $BUILD/tools/bench_tok"; exit 0; }
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
smol=$MODEL
[ -f "$smol" ] || smol=$FIX/smollm2-tokenizer.json.zst
for fam in smollm2 llama3 qwen2; do
  tok=$FIX/$fam-tokenizer.json.zst
  [ "$fam" = smollm2 ] && tok=$smol
  echo "$tok" > "$tmp/$fam.tok"
  if ! "$BUILD/tools/bench_tok" --dump "$tmp/$fam.ids" "$tok" "$CORPUS" > "$tmp/$fam.json"; then
    echo "bench_tok failed for $fam" >&2
    rm -f "$tmp/$fam.json"
  fi
done
echo "Command: \`$BUILD/tools/bench_tok --dump IDS TOKENIZER $CORPUS\` per family; \`tests/bench/bench_tokenizer.py\`."
echo
PY=.venv-ref/bin/python
reason=""
if [ ! -x "$PY" ]; then
  if python3 -m venv .venv-ref >&2 2>&1 && timeout 300 .venv-ref/bin/pip install -q --disable-pip-version-check \
       -r tests/reference/requirements-tokenizer.txt >&2 2>&1; then :; else reason="could not create .venv-ref (PyPI unreachable?)"; fi
elif ! "$PY" -c "import tokenizers, tiktoken" 2>/dev/null; then
  timeout 300 "$PY" -m pip install -q --disable-pip-version-check -r tests/reference/requirements-tokenizer.txt >&2 2>&1 \
    || reason="could not install tokenizers/tiktoken (PyPI unreachable?)"
fi
if [ -z "$reason" ] && RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false "$PY" tests/bench/bench_tokenizer.py "$CORPUS" "$tmp" > "$tmp/table.md"; then
  cat "$tmp/table.md"
else
  [ -z "$reason" ] && reason="bench_tokenizer.py failed (see stderr)"
  echo "| family | tokenizer | MB/s | tokens/s | ours / this | ids vs ours |"
  echo "|---|---|---:|---:|---:|---|"
  for f in "$tmp"/*.json; do
    [ -e "$f" ] || continue
    fam=$(basename "$f" .json)
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"| $fam | ours (C, bench_tok) | {d['mb_s']:.2f} | {d['tok_s']:,.0f} | 1.00 | reference |\")" "$f"
    echo "| $fam | HF tokenizers / tiktoken | - | - | - | skipped: $reason |"
  done
fi
echo
exit 0
