#!/usr/bin/env bash
# Installs what kernel-patches/check needs on a Debian machine, skipping what
# is already there (as scripts/setup.sh does for the recorder):
#   always   linux-source-6.12 (the base of the series), gcc, make, flex,
#            bison, bc, perl, git, xz-utils, libelf-dev, libssl-dev, codespell
#   --boot   also qemu-system-x86, e2fsprogs, xfsprogs, cpio
# Usage: kernel-patches/setup.sh [--boot]   (root when something is missing)
set -euo pipefail

pkgs=(linux-source-6.12 gcc make flex bison bc perl git xz-utils libelf-dev
	libssl-dev codespell)
[ "${1:-}" = "--boot" ] && pkgs+=(qemu-system-x86 e2fsprogs xfsprogs cpio)

have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
need=()
for p in "${pkgs[@]}"; do
	have "$p" || need+=("$p")
done
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
	echo "kernel-patches/setup.sh: missing packages (${need[*]}): run as root or install them with apt-get" >&2
	exit 1
fi
echo "kernel-patches/setup.sh: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
