#!/usr/bin/env bash
# `make bench`: runs every executable tests/bench/bench_*.sh in turn; each prints a markdown
# section (a heading and a table of figures it measured side by side in one run). The sections
# are collected, with the machine and the commit, into tests/bench/results/<machine>.md, and
# printed. Figures quoted in the README come from these files. BENCH_ONLY="a b" runs only
# tests/bench/bench_a.sh and bench_b.sh (e.g. BENCH_ONLY="tokenizer dataplane"); BENCH_MACHINE
# names the results file (default cpu-<cores>core).
set -uo pipefail
cd "$(dirname "$0")/../.."
machine=${BENCH_MACHINE:-cpu-$(nproc)core}
out=tests/bench/results/$machine.md
tmp=$(mktemp)
{
  echo "# BarqTrain benchmarks: $machine"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+dirty')"
  echo "- cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) cores), $(free -g | awk '/Mem:/{print $2}') GiB"
  echo "- command: ${BENCH_ONLY:+BENCH_ONLY=\"$BENCH_ONLY\" }${BENCH_MACHINE:+BENCH_MACHINE=$BENCH_MACHINE }make bench"
  echo
} > "$tmp"
fail=0
for b in tests/bench/bench_*.sh; do
  [ -x "$b" ] || continue
  if [ -n "${BENCH_ONLY:-}" ]; then
    name=$(basename "$b" .sh); name=${name#bench_}
    case " $BENCH_ONLY " in *" $name "*) ;; *) continue;; esac
  fi
  echo "bench: running $b" >&2
  if ! bash "$b" >> "$tmp"; then
    echo "bench: $b failed" >&2
    printf '\n(%s failed; see its output above)\n\n' "$b" >> "$tmp"
    fail=1
  fi
  echo >> "$tmp"
done
mv "$tmp" "$out"
cat "$out"
echo "bench: results written to $out" >&2
exit $fail
