#!/usr/bin/env bash
# Make (or refresh) .venv-torch/: the pinned torch + transformers + PEFT stack of
# python/requirements-torch.txt, plus the loaderd Python client installed the way users install
# it (`pip install ./python`). Idempotent: re-installs only when the requirements file or the
# client's sources changed (stamp in .venv-torch/.stamp). Used by `make test` (pytest-torch).
# Needs PyPI the first time (~3 GB of wheels, torch's CUDA runtime included; no GPU is used).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_TORCH:-.venv-torch}
PY=${PYTHON:-python3}
REQ=python/requirements-torch.txt
stamp_now=$( (sha256sum "$REQ"; find python -type f -not -path '*/__pycache__/*' -not -path '*/build/*' \
              -not -path '*.egg-info*' -print0 | sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-64)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "$stamp_now" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "venv-torch: creating $VENV (first time: downloads ~3 GB of wheels from PyPI)"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ"
# the client as users install it: no compiler, no build step beyond copying pure Python files
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps ./python
echo "$stamp_now" > "$VENV/.stamp"
echo "venv-torch: ok ($("$VENV/bin/python" -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'))"
