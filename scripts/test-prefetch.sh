#!/usr/bin/env bash
# scripts/test-prefetch.sh BUILD: the download-bound set-up of the later `make test` stages, run
# by `make test` beside the CPU-bound ones (unit, unit-asan, fuzz-short, pytest) so that the
# downloads and unpacking overlap the compiling and testing instead of adding to them:
#   1. .venv-torch/ (scripts/venv-torch.sh; pytest-torch) — about 2.5 GB from PyPI the first time,
#   2. the Debian 12 root of test-systemd (tests/systemd/build-root.sh; debootstrap from the
#      Debian mirror, cached in BUILD/systemd), for the binaries tests/py/test_systemd.py installs,
#   3. llama.cpp's library for test-llamacpp (scripts/llamacpp-ref.sh; a 27.7 MB wheel).
# Each step is idempotent and is run again by its own stage, which reports a failure in its own
# words (a skip with the reason, or an error); so a failure here is only noted and never fails
# `make test` by itself, and a machine where a step cannot run at all (no root, no debootstrap)
# just leaves it to its stage. Nothing outside .venv-torch/, .llamacpp/ and BUILD/systemd is
# written. Prints one line per step with its outcome and time.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: test-prefetch.sh BUILD}

step() { # step NAME CMD...: run, say how it went and how long it took
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    "$@" >"$build/prefetch-$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        echo "test-prefetch: $name ready ($(( $(date +%s) - t0 )) s)"
    else
        echo "test-prefetch: $name exited $rc after $(( $(date +%s) - t0 )) s (its stage runs it again" \
             "and reports; log: $build/prefetch-$name.log)"
    fi
}

mkdir -p "$build"
step venv-torch bash scripts/venv-torch.sh
if [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null && command -v systemd-nspawn >/dev/null; then
    # the same binaries, so the same package list and cache key, as tests/py/test_systemd.py
    step systemd-root bash tests/systemd/build-root.sh "$build/systemd" "$build/loaderd" "$build/loaderctl" \
        "$build/trainer" "$build/tools/sandbox_probe" "$build/tools/mk_tiny_gguf"
fi
step llamacpp bash scripts/llamacpp-ref.sh
exit 0
