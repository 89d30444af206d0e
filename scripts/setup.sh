#!/usr/bin/env bash
# BarqTrain one-stop set-up: installs the Debian packages and Python test tools the build,
# the tests and the demos need (make demo-long reads the Debian Reference and the Linux manual
# pages: debian-reference-en, manpages, manpages-dev, rendered by man-db / groff-base). Idempotent: does nothing when everything is present.
# universal-ctags: scripts/depgraph.py (the include/call graph tests/py/test_layering.py checks).
# Used by `make setup` (and so by `make demo`, `make test`) and by .ci/run.
set -euo pipefail

DEB_PKGS=(build-essential pkg-config libuv1-dev libzstd-dev zstd libjansson-dev
          libopenblas-dev libcmocka-dev libpcre2-dev libutf8proc-dev libsystemd-dev libseccomp-dev libssl-dev
          systemd clang libclang-rt-14-dev dict-foldoc unzip patchelf libyaml-dev gnuplot-nox gdb
          debian-reference-en manpages manpages-dev man-db groff-base debootstrap systemd-container
          universal-ctags)
PY_PKGS=("pytest==8.3.3" "numpy==1.26.4" "gguf==0.19.0" "tensorboard==2.21.0" "cffi==2.0.0" "PyYAML==6.0.3")

missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  # Wait for another apt/dpkg run (a parallel set-up, unattended-upgrades) instead of failing.
  APT=(apt-get -o DPkg::Lock::Timeout=900)
  $SUDO "${APT[@]}" update -qq
  $SUDO "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
for spec in "${PY_PKGS[@]}"; do
  mod=${spec%%=*} ver=${spec##*==}
  # installed at exactly the pinned version (a different one is replaced: the tests' readers are
  # checked against the pinned gguf-py, the newest on PyPI when pinned)
  if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$mod') != '$ver')" 2>/dev/null; then
    echo "setup: installing Python package $spec"
    "$PY" -m pip install -q --disable-pip-version-check "$spec"
  fi
done
echo "setup: ok"
