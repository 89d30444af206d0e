#!/usr/bin/env bash
# tests/systemd/build-root.sh CACHE_DIR BIN... : prints the path of a minimal Debian 12 root with
# systemd as PID 1 and the runtime libraries of BIN... (found with ldd, mapped to their Debian
# packages with dpkg -S), for `make test-systemd` (tests/py/test_systemd.py).
#
# The root is built once with `debootstrap --variant=minbase` and cached under
# CACHE_DIR/root-<hash>, where the hash covers the suite, the mirror and the package list: a
# changed package list (a new library linked into loaderd, say) builds a new root and removes
# the old one. Nothing else is ever removed. Exit status: 0 and the path on stdout; 77 when the
# Debian mirror cannot be reached (no network: the caller skips, saying why); 1 otherwise.
set -euo pipefail
cache=${1:?usage: build-root.sh CACHE_DIR BIN...}
shift
suite=${BT_SYSTEMD_SUITE:-bookworm}
mirror=${BT_SYSTEMD_MIRROR:-http://deb.debian.org/debian}

pkgs=(systemd systemd-sysv dbus)
while read -r lib; do
    p=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true)
    p=$(printf '%s\n' "$p" | grep -v '^diversion' | head -n 1 | cut -d: -f1)
    [ -n "$p" ] || { echo "build-root: $lib belongs to no Debian package" >&2; exit 1; }
    pkgs+=("$p")
done < <(for b in "$@"; do ldd "$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u)
list=$(printf '%s\n' "${pkgs[@]}" | sort -u | paste -sd, -)
key=$(printf '%s\n%s\n%s\nminbase\n' "$suite" "$mirror" "$list" | sha256sum | cut -c1-12)
root="$cache/root-$key"
if [ -f "$root/.barq-root-complete" ]; then
    echo "$root"
    exit 0
fi

mkdir -p "$cache"
# roots of older package lists: ours (the marker says so), so they may go
for old in "$cache"/root-*; do
    [ "$old" = "$root" ] && continue
    case "$old" in
    *.building) rm -rf --one-file-system "$old" ;;
    *) [ -e "$old/.barq-root-complete" ] && rm -rf --one-file-system "$old" ;;
    esac
done
tmp="$root.building"
rm -rf --one-file-system "$tmp"
mkdir -p "$tmp"
log="$cache/debootstrap-$key.log"
echo "build-root: debootstrap $suite ($list) into $root (once; log: $log)" >&2
if ! debootstrap --variant=minbase --include="$list" "$suite" "$tmp" "$mirror" >"$log" 2>&1; then
    tail -n 5 "$log" >&2
    rm -rf --one-file-system "$tmp"
    if grep -qiE "Failed getting release file|Couldn't download|Temporary failure resolving|Could not resolve|unable to connect|Network is unreachable" "$log"; then
        exit 77
    fi
    exit 1
fi
printf '%s\n%s\n%s\n' "$suite" "$mirror" "$list" >"$tmp/.barq-root-complete"
mv "$tmp" "$root"
echo "$root"
