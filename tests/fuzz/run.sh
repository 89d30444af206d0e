#!/usr/bin/env bash
# `make fuzz`: run every libFuzzer target in BUILD_DIR (default build/fuzz/bin) for FUZZ_SECONDS
# (default 30) each, from the repository root (the targets load $BT_MODEL, default
# models/SmolLM2-135M-Instruct.Q4_1.gguf). `make test` runs the same with FUZZ_SECONDS=3 (the
# short pass: the committed corpus is replayed, then a few seconds of mutation per target).
# Corpora persist in build/fuzz/corpus/<target>, seeded from the committed tests/fuzz/corpus/<target>
# (written by tests/fuzz/make_corpus.py; add a crash's input there once it is fixed, so it stays
# fixed); crashes land in build/fuzz/crashes/<target>-*. Exit 1 if any target found a crash,
# leak or invariant failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-build/fuzz/bin}
secs=${FUZZ_SECONDS:-30}
export BT_MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
root=build/fuzz
mkdir -p "$root/corpus" "$root/crashes"

fail=0
ran=0
for t in "$bin"/fuzz_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  ran=$((ran + 1))
  mkdir -p "$root/corpus/$name"
  [ -d "tests/fuzz/corpus/$name" ] && cp -n "tests/fuzz/corpus/$name"/* "$root/corpus/$name/" 2>/dev/null
  echo "fuzz: $name for ${secs}s" >&2
  log="$root/$name.log"
  if "$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$root/crashes/$name-" "$root/corpus/$name" > "$log" 2>&1; then
    echo "fuzz: $name ok: $(grep -E '^#[0-9]+.*DONE|stat::number_of_executed_units' "$log" | tail -1)" >&2
  else
    echo "fuzz: $name FAILED (log $log, artifacts $root/crashes/$name-*)" >&2
    tail -40 "$log" >&2
    fail=1
  fi
done
[ "$ran" -gt 0 ] || { echo "fuzz: no targets in $bin (build them with make fuzz)" >&2; exit 1; }
exit $fail
