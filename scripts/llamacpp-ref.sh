#!/usr/bin/env bash
# Install llama.cpp itself as a test reference (tests/py/test_llamacpp.py, tests/py/llamacpp_ref.py):
# the llama.cpp library of the pinned PyPI wheel xllamacpp 2026.4.8929 (llama.cpp b8929, April
# 2026: the wheel's version is the build number; xllamacpp commit 98c241b pins llama.cpp at
# 9d34231b), downloaded by pip with its sha256 checked, and that one file extracted into
# $BT_LLAMACPP_DIR (default .llamacpp/, git-ignored). Nothing of the wheel is installed into any
# Python environment; the tests load the library with ctypes. The library does not carry its
# version (LLAMA_BUILD_NUMBER 0, LLAMA_COMMIT "unknown"): MEMBER_SHA256 below is what names it,
# and tests/py/llamacpp_ref.py reads that line and checks the file against it.
#
# Disk: the wheel is 27.7 MB (the CPU build of llama.cpp and ggml statically linked into one
# library, whose only dependencies are libstdc++ and libgomp); pip's cache is off and the wheel is
# deleted once the library is out, so the peak is about 120 MB in $TMPDIR (wheel + library,
# measured 120.2 MB) and 92.5 MB remain in $BT_LLAMACPP_DIR.
# Idempotent: does nothing when the library is there with the pinned sha256; removes the library
# of an earlier pin (llama-cpp-cffi's) from $BT_LLAMACPP_DIR.
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
WHEEL_SPEC="xllamacpp==2026.4.8929"
WHEEL_FILE="xllamacpp-2026.4.8929-cp310-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
WHEEL_SHA256="bc53a6a492db416316f63c9ac368b20242e9a14570bc099e131d1b761f6dc496"
MEMBER="xllamacpp/xllamacpp.abi3.so"
MEMBER_SHA256="2f3f2b6c44c83f8730bf1a72480c96e6cf3695a53d89777e395043ba794481ba"
LIB="$DIR/$(basename "$MEMBER")"
# the library of the earlier pin (llama-cpp-cffi 0.4.42, llama.cpp b4965), removed on upgrade
OLD_LIB="$DIR/_llama_cpp_cpu.cpython-311-x86_64-linux-gnu.so"

skip() {
  mkdir -p "$DIR"
  printf '%s\n' "$*" > "$DIR/SKIPPED"
  echo "llamacpp-ref: SKIPPED: $*" >&2
  exit 0
}

if [ -f "$LIB" ] && [ "$(sha256sum "$LIB" | cut -c1-64)" = "$MEMBER_SHA256" ]; then
  rm -f "$DIR/SKIPPED" "$OLD_LIB"
  exit 0
fi
[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] ||
  skip "the pinned $WHEEL_SPEC wheel is for x86-64 Linux; this is $(uname -s)-$(uname -m)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-ref.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
free_mb=$(df -Pm "$tmp" | awk 'NR == 2 { print $4 }')
if [ "$free_mb" -lt 300 ]; then
  echo "llamacpp-ref: needs about 300 MB free in ${TMPDIR:-/tmp} for the 28 MB wheel and its 93 MB library; it has" \
       "$free_mb MB. Set TMPDIR to a directory with more room." >&2
  exit 1
fi
echo "$WHEEL_SPEC --hash=sha256:$WHEEL_SHA256" > "$tmp/req.txt"
echo "llamacpp-ref: downloading $WHEEL_FILE (28 MB, sha256 checked by pip)"
# the wheel's tags, not this interpreter's: the library is loaded with ctypes from any CPython 3
if ! "$PY" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps \
      --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.10 \
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
rm -f "$DIR/SKIPPED" "$OLD_LIB"
echo "llamacpp-ref: ok ($LIB, llama.cpp b8929 9d34231b from $WHEEL_FILE)"
