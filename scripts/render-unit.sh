#!/usr/bin/env bash
# scripts/render-unit.sh UNIT BINDIR SYSCONFDIR BIN... : prints the systemd unit UNIT with its
# placeholders filled in, as `make install` installs it (tests/py/test_loaderd_service.py and
# tests/py/test_systemd.py check what this prints):
#   @BINDIR@      where loaderd and loaderctl are installed
#   @SYSCONFDIR@  where loaderd/loaderd.json lives
#   @LIBDIRS@     the directories of the shared libraries and the ELF interpreter that BIN...
#                 (the built loaderd and loaderctl) load, found with ldd: with NoExecPaths=/ these
#                 are the only places besides the two programs from which anything may be mapped
#                 executable, so the unit runs nothing else (ExecPaths=).
set -euo pipefail
unit=${1:?usage: render-unit.sh UNIT BINDIR SYSCONFDIR BIN...}
bindir=${2:?}
sysconfdir=${3:?}
shift 3
libdirs=$(for b in "$@"; do ldd "$b"; done |
    awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' |
    while read -r f; do dirname "$(readlink -f "$f")"; done | sort -u | paste -sd' ' -)
[ -n "$libdirs" ] || { echo "render-unit: no library directories found for $*" >&2; exit 1; }
sed "s#@BINDIR@#$bindir#g; s#@SYSCONFDIR@#$sysconfdir#g; s#@LIBDIRS@#$libdirs#g" "$unit"
