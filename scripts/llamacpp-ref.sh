#!/usr/bin/env bash
# Install llama.cpp itself as a test reference (tests/py/test_llamacpp.py, tests/py/llamacpp_ref.py):
# the CPU library of the pinned PyPI wheel llama-cpp-cffi 0.4.42 (llama.cpp b4965, commit
# b3298fa4), downloaded by pip with its sha256 checked, and that one file extracted into
# $BT_LLAMACPP_DIR (default .llamacpp/, git-ignored). Nothing of the wheel is installed into any
# Python environment: its Python layer (which pins transformers < 5) is never imported; the tests
# load the library with ctypes.
#
# Disk: the wheel is 291 MB (CPU, Vulkan and CUDA builds together); pip's cache is off and the
# wheel is deleted once the 6 MB CPU library is out, so the peak is about 300 MB in $TMPDIR.
# Idempotent: does nothing when the library is there with the pinned sha256.
#
# Where the wheel cannot be had (no route to PyPI, a platform other than x86-64 Linux), it writes
# the reason to $BT_LLAMACPP_DIR/SKIPPED and exits 0: the tests then report SKIPPED with that
# reason, never passed. A wheel whose sha256 differs from the pin is an error (exit 1), not a skip.
# Used by `make llamacpp-ref` (and so `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${BT_LLAMACPP_DIR:-.llamacpp}

# the pin: wheel, its sha256 (as PyPI lists it), the member we use and that member's sha256
WHEEL_SPEC="llama-cpp-cffi==0.4.42"
WHEEL_FILE="llama_cpp_cffi-0.4.42-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256="d46c7e486262521eef6e0a694a62066dff43e8655df96399058e525ec92aa3f1"
MEMBER="llama/_llama_cpp_cpu.cpython-311-x86_64-linux-gnu.so"
MEMBER_SHA256="7f003c698c3752924db24900781587ef5eeb85ad8682c41d26d8ce503a09ee91"
LIB="$DIR/$(basename "$MEMBER")"

skip() {
  mkdir -p "$DIR"
  printf '%s\n' "$*" > "$DIR/SKIPPED"
  echo "llamacpp-ref: SKIPPED: $*" >&2
  exit 0
}

if [ -f "$LIB" ] && [ "$(sha256sum "$LIB" | cut -c1-64)" = "$MEMBER_SHA256" ]; then
  rm -f "$DIR/SKIPPED"
  exit 0
fi
[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] ||
  skip "llama-cpp-cffi 0.4.42 ships x86-64 Linux wheels only; this is $(uname -s)-$(uname -m)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-ref.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
free_mb=$(df -Pm "$tmp" | awk 'NR == 2 { print $4 }')
if [ "$free_mb" -lt 700 ]; then
  echo "llamacpp-ref: needs about 700 MB free in ${TMPDIR:-/tmp} for the 291 MB wheel; it has" \
       "$free_mb MB. Set TMPDIR to a directory with more room." >&2
  exit 1
fi
echo "$WHEEL_SPEC --hash=sha256:$WHEEL_SHA256" > "$tmp/req.txt"
echo "llamacpp-ref: downloading $WHEEL_FILE (291 MB, sha256 checked by pip)"
# the wheel's tags, not this interpreter's: the library is loaded with ctypes from any CPython 3
if ! "$PY" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps \
      --only-binary=:all: --platform manylinux_2_34_x86_64 --python-version 3.11 \
      --implementation cp --require-hashes -r "$tmp/req.txt" -d "$tmp" > "$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log" >&2
  if grep -q "DO NOT MATCH THE HASHES" "$tmp/pip.log"; then
    echo "llamacpp-ref: $WHEEL_FILE does not have the pinned sha256 $WHEEL_SHA256" >&2
    exit 1
  fi
  skip "pip could not download $WHEEL_SPEC ($(tail -n 1 "$tmp/pip.log"))"
fi
# pip checked the hash; check again what we unpack (a file of the same name left in $tmp cannot
# get here, but the pin is cheap to verify)
[ "$(sha256sum "$tmp/$WHEEL_FILE" | cut -c1-64)" = "$WHEEL_SHA256" ] || {
  echo "llamacpp-ref: $tmp/$WHEEL_FILE: sha256 differs from the pin $WHEEL_SHA256" >&2
  exit 1
}
mkdir -p "$DIR"
"$PY" - "$tmp/$WHEEL_FILE" "$MEMBER" "$tmp/lib.so" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
got=$(sha256sum "$tmp/lib.so" | cut -c1-64)
if [ "$got" != "$MEMBER_SHA256" ]; then
  echo "llamacpp-ref: $MEMBER in the wheel has sha256 $got, not the pinned $MEMBER_SHA256" >&2
  exit 1
fi
mv "$tmp/lib.so" "$LIB"
rm -f "$DIR/SKIPPED"
echo "llamacpp-ref: ok ($LIB, llama.cpp b4965 b3298fa4 from $WHEEL_FILE)"
