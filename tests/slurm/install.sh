#!/usr/bin/env bash
# Installs what tests/py/test_slurm.py needs for a real one-node Slurm: Debian's slurmctld, slurmd,
# slurm-client and munge. Idempotent; waits for the dpkg lock like scripts/setup.sh. Starts no
# service: the test brings up its own private cluster (tests/py/slurm_cluster.py), so while the
# packages install, a policy-rc.d that refuses service starts is put in place when none exists.
# Exit status: 0 installed (or already there); 3 Slurm cannot be installed here (not root and no
# password-less sudo, no apt-get, or apt-get failed), with the reason on stderr.
set -uo pipefail
PKGS=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2> /dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
command -v apt-get > /dev/null || { echo "slurm: no apt-get to install ${missing[*]}" >&2; exit 3; }
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  sudo -n true 2> /dev/null || { echo "slurm: installing ${missing[*]} needs root (or password-less sudo)" >&2; exit 3; }
  SUDO=(sudo -n)
fi
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" > /dev/null && "${SUDO[@]}" chmod 755 "$policy"
  trap '"${SUDO[@]}" rm -f "$policy"' EXIT
fi
echo "slurm: installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
APT=(apt-get -o DPkg::Lock::Timeout=900)
log=$(mktemp)
if ! { "${SUDO[@]}" "${APT[@]}" update -qq && "${SUDO[@]}" "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}"; } > "$log" 2>&1; then
  echo "slurm: apt-get could not install ${missing[*]}:" >&2
  tail -n 20 "$log" >&2
  rm -f "$log"
  exit 3
fi
rm -f "$log"
exit 0
