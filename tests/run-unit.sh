#!/usr/bin/env bash
# Runs each cmocka test binary given; prints a closing "N passed, N failed" line, and the slowest
# binaries (wall seconds, those of 3 s or more: where `make test`'s time goes).
# Usage: run-unit.sh <dir-for-label> <test binaries...>
set -u
label=$1; shift
pass=0; fail=0; failed=(); times=()
export BT_MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export BT_SHARED=${BT_SHARED:-../shared}
for t in "$@"; do
  t0=$(date +%s%N)
  if "$t"; then pass=$((pass+1)); else fail=$((fail+1)); failed+=("$t"); fi
  times+=("$(( ($(date +%s%N) - t0) / 1000000 )) $t")
done
echo "unit ($label): $pass passed, $fail failed"
printf '%s\n' "${times[@]}" | sort -rn | awk '$1 >= 3000 && n++ < 8 { printf "  slowest: %6.1f s %s\n", $1 / 1000, $2 }'
[ "$fail" -eq 0 ] || { printf 'failed: %s\n' "${failed[@]}"; exit 1; }
