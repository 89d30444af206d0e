#!/usr/bin/env bash
# Ring hand-off between two processes (tests/tools/bench_ring.c, proto/ring.c): GB/s moving
# B=4 x T=2048 batches (copy in + copy out, as loaderd and a trainer do) and producer-commit ->
# consumer-wake-up latency through the futex. Prints a markdown section for `make bench`.
set -euo pipefail
cd "$(dirname "$0")/../.."
tool=${BUILD:-build}/tools/bench_ring
[ -x "$tool" ] || make --no-print-directory "$tool" >&2
echo "## Ring hand-off (proto/ring.c, memfd shared by two processes)"
echo
echo "Producer copies a prepared batch into the slot and commits; consumer (a forked process"
echo "that mapped the memfd) copies it out and releases. Wake-up: commit into an empty ring while"
echo "the consumer sleeps in FUTEX_WAIT, until peek returns in the consumer."
echo
echo "| B | T | slot bytes | slots | pinned | batches | GB/s | batches/s | wake-ups | median µs | p99 µs | max µs |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
"$tool" --B 4 --T 2048 --slots 8 --seconds "${BENCH_RING_SECONDS:-3}" --samples 3000
"$tool" --B 4 --T 2048 --slots 2 --seconds "${BENCH_RING_SECONDS:-3}" --samples 1000
"$tool" --B 8 --T 4096 --slots 4 --seconds "${BENCH_RING_SECONDS:-3}" --samples 1000
