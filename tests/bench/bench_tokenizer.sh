#!/usr/bin/env bash
# Tokenizer benchmark (run by `make bench`, which appends stdout to the results file): per-thread
# throughput under W^X of the C tokenizer with its dedicated pre-tokenizers, the same tokenizer
# on PCRE2 (interpreter under W^X; JIT without, for context), tiktoken and HF tokenizers, side
# by side in interleaved rounds (tests/bench/bench_tokenizer.py, which sets PR_SET_MDWE on
# itself; bench_tok --wx does it for the C rows). Families: SmolLM2 (the GGUF), the Llama-3- and
# Qwen2-style fixtures; SentencePiece: Llama 2 and Gemma 3 GGUFs (against llama.cpp), Mistral
# tokenizer.json files (against HF tokenizers). tiktoken/tokenizers come from .venv-ref (tests/reference/
# requirements-tokenizer.txt, pinned; created if missing); without PyPI their rows say
# "skipped" and the C rows are still measured. Never fails the bench run because of Python-side
# problems.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CORPUS=tests/fixtures/tokenizer/corpus.bin.zst
FIX=tests/fixtures/tokenizer
echo "## Tokenizer throughput per thread (W^X)"
echo
if [ ! -x "$BUILD/tools/bench_tok" ]; then
  make --no-print-directory "$BUILD/tools/bench_tok" >&2 || { echo "skipped: cannot build $BUILD/tools/bench_tok"; exit 0; }
fi
smol=$MODEL
[ -f "$smol" ] || smol=$FIX/smollm2-tokenizer.json.zst
PY=.venv-ref/bin/python
if [ ! -x "$PY" ]; then
  python3 -m venv .venv-ref >&2 2>&1 && timeout 300 .venv-ref/bin/pip install -q --disable-pip-version-check \
    -r tests/reference/requirements-tokenizer.txt >&2 2>&1 || echo "bench_tokenizer: could not create .venv-ref (PyPI unreachable?)" >&2
elif ! "$PY" -c "import tokenizers, tiktoken, gguf" 2>/dev/null; then
  timeout 300 "$PY" -m pip install -q --disable-pip-version-check -r tests/reference/requirements-tokenizer.txt >&2 2>&1 \
    || echo "bench_tokenizer: could not install tokenizers/tiktoken (PyPI unreachable?)" >&2
fi
"$PY" -c "import tokenizers, tiktoken, gguf" 2>/dev/null || PY=python3
cmd="tests/bench/bench_tokenizer.py $BUILD $CORPUS smollm2=$smol llama3=$FIX/llama3-tokenizer.json.zst qwen2=$FIX/qwen2-tokenizer.json.zst"
# SentencePiece families (issue 24): the real files of scripts/fetch-tokenizers (and the Gemma 3
# GGUF), each against its reference (llama.cpp for GGUF, HF tokenizers for tokenizer.json)
bash scripts/fetch-tokenizers >&2 || true
make --no-print-directory llamacpp-ref >&2 || true
TOKDIR=${BT_TOKENIZERS_DIR:-models/tokenizers}
[ -f "$TOKDIR/ggml-vocab-llama-spm.gguf" ] && cmd="$cmd llama2-spm-gguf=$TOKDIR/ggml-vocab-llama-spm.gguf"
[ -f models/gemma-3-270m-q4_k_m.gguf ] && cmd="$cmd gemma3-gguf=models/gemma-3-270m-q4_k_m.gguf"
cmd="$cmd mistral-v0.1-json=$FIX/mistral-v0.1-tokenizer.json.zst mistral-v0.3-json=$FIX/mistral-v0.3-tokenizer.json.zst"
echo "Command: \`$PY $cmd\`"
echo
if ! RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false "$PY" $cmd; then
  echo "(bench_tokenizer.py failed; see stderr)"
fi
echo
exit 0
