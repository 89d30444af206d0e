#!/usr/bin/env bash
# Runs each cmocka test binary given; prints a closing "N passed, N failed" line.
# Usage: run-unit.sh <dir-for-label> <test binaries...>
set -u
label=$1; shift
pass=0; fail=0; failed=()
export BT_MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export BT_SHARED=${BT_SHARED:-../shared}
for t in "$@"; do
  if "$t"; then pass=$((pass+1)); else fail=$((fail+1)); failed+=("$t"); fi
done
echo "unit ($label): $pass passed, $fail failed"
[ "$fail" -eq 0 ] || { printf 'failed: %s\n' "${failed[@]}"; exit 1; }
