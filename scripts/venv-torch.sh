#!/usr/bin/env bash
# Make (or refresh) .venv-torch/: the pinned torch + transformers + PEFT stack of
# python/requirements-torch.txt (a complete lock, installed with --no-deps; see its header), plus
# the loaderd Python client installed the way users install it (`pip install ./python`).
# Idempotent: re-installs only when the lock or the client's sources changed (stamp in
# .venv-torch/.stamp). Used by `make test` (pytest-torch).
#
# Disk: about 4.6 GB installed (torch's CUDA runtime wheels included; no GPU is used). pip's cache
# is off and the largest wheels are installed one per pip call, so the peak is the install plus
# one wheel (about 1 GB) in $TMPDIR, not the install plus every wheel twice (cache and temp).
# A machine with less free space is told so before anything is downloaded.
# Needs PyPI the first time (about 2.5 GB of downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_TORCH:-.venv-torch}
PY=${PYTHON:-python3}
REQ=python/requirements-torch.txt
NEED_MB=${VENV_TORCH_NEED_MB:-5200}   # measured peak 4.8 GB: install (4.6 GB) + the wheel in flight
stamp_now=$( (sha256sum "$REQ"; find python -type f -not -path '*/__pycache__/*' -not -path '*/build/*' \
              -not -path '*.egg-info*' -print0 | sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-64)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "$stamp_now" ]; then
  exit 0
fi

# free MB on the filesystem holding $1
free_mb() { df -Pm "$1" | awk 'NR == 2 { print $4 }'; }
have_mb=$(( $(free_mb .) + $( [ -d "$VENV" ] && du -sm "$VENV" | cut -f1 || echo 0) ))
if [ "$have_mb" -lt "$NEED_MB" ]; then
  echo "venv-torch: needs about $NEED_MB MB free for $VENV (torch + transformers + PEFT);" \
       "$(pwd) has $(free_mb .) MB free (plus what $VENV already holds). Free some space, or" \
       "set VENV_TORCH=/path/on/a/larger/disk." >&2
  exit 1
fi
tmp=${TMPDIR:-/tmp}
if [ "$(df -P "$tmp" | awk 'NR == 2 { print $1 }')" != "$(df -P . | awk 'NR == 2 { print $1 }')" ] \
   && [ "$(free_mb "$tmp")" -lt 1500 ]; then
  echo "venv-torch: pip unpacks wheels of up to ~1 GB in $tmp, which has $(free_mb "$tmp") MB free;" \
       "set TMPDIR to a directory with at least 1500 MB free." >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "venv-torch: creating $VENV (first time: about 2.5 GB of downloads from PyPI, 4.6 GB installed)"
  "$PY" -m venv "$VENV"
fi
pip_install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps "$@"
}
# the big wheels (torch and the CUDA runtime) one per call, so that only one is in $TMPDIR at a
# time; then everything else in one call. Already-installed pins are skipped by pip.
big=$(grep -E '^(torch|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==' "$REQ")
for pin in $big; do
  pip_install "$pin"
done
grep -E '^[A-Za-z0-9_.-]+==' "$REQ" | grep -vxF -f <(printf '%s\n' $big) > "$VENV/.rest.txt"
pip_install -r "$VENV/.rest.txt"
rm -f "$VENV/.rest.txt"
# the client as users install it: no compiler, no build step beyond copying pure Python files;
# setuptools' in-tree build/ and egg-info of an earlier install go first (a module removed from
# python/ must not come back from build/lib)
rm -rf python/build python/barq_loaderd.egg-info
pip_install --force-reinstall ./python
echo "$stamp_now" > "$VENV/.stamp"
echo "venv-torch: ok ($("$VENV/bin/python" -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'); $(du -sh "$VENV" | cut -f1) on disk)"
