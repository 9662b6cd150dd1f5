#!/usr/bin/env bash
# Installs what stall-recorder needs on a Debian machine, skipping whatever is already there:
# BCC for the system python3, bpftool, kernel headers for BCC, a C compiler, and a venv in .venv
# made from /usr/bin/python3 with access to the system's bcc module.
# Usage: scripts/setup.sh [--test]   (--test also installs the test and benchmark tools)
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

need=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for p in python3-bpfcc bpftool python3-venv python3-dev libsqlite3-dev gcc make sqlite3 util-linux e2fsprogs; do
  have "$p" || need+=("$p")
done
if [ $want_test = 1 ]; then
  # chromium: tests render the HTML report headless and look at it (tests/test_html_report.py)
  for p in xfsprogs chromium; do have "$p" || need+=("$p"); done
  # prometheus (and its promtool): the tests check the shipped rules and run a server of their own
  # on a loopback port (tests/prometheus_harness.py); the package's own service is not wanted
  have prometheus || { need+=(prometheus); new_prometheus=1; }
fi
# The frame-walker and marker tests run every CPython the walker supports (tests/pyframes/harness.py
# finds pyenv's builds, then the distribution's python3.X). A version found nowhere is installed
# here with its headers where the distribution packages it (Debian 12 packages 3.11 only, Debian 13
# 3.13, Ubuntu 22.04 3.10, Ubuntu 24.04 3.12); no registry reached here ships other CPython builds
# without a download from elsewhere, so the tests of a version still missing skip and say so.
interpreters=()
packaged() {  # unknown until the package lists were read once: then apt-get update below tells
  ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1 || [ -n "$(apt-cache madison "$1" 2>/dev/null)" ]
}
if [ $want_test = 1 ]; then
  pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  for v in 3.10 3.11 3.12 3.13; do
    if ! ls "$pyenv_root"/versions/$v.*/bin/python$v >/dev/null 2>&1 && [ ! -x /usr/bin/python$v ]; then
      if packaged "python$v"; then
        interpreters+=("python$v" "python$v-dev")
      else
        echo "setup: CPython $v is not packaged by this distribution: its tests skip and say how to install it"
      fi
    elif [ -x /usr/bin/python$v ] && ! have "python$v-dev" && packaged "python$v-dev"; then
      interpreters+=("python$v-dev")  # the tests build a small extension for each interpreter
    fi
  done
fi

kver=$(uname -r)
headers=""
if [ ! -e "/lib/modules/$kver/build" ]; then
  # Headers for the running kernel where the distribution has them; otherwise its generic headers,
  # which the recorder wires for BCC itself (recorder/core/kheaders.py) without writing system folders.
  if ! ls -d /usr/src/linux-headers-*-common >/dev/null 2>&1; then
    headers="linux-headers-$kver"
  fi
fi

if [ ${#interpreters[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
  echo "setup: not root, so not installing ${interpreters[*]}: the tests of those interpreters skip"
  interpreters=()
fi
if [ ${#need[@]} -gt 0 ] || [ -n "$headers" ] || [ ${#interpreters[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing system packages (${need[*]} $headers): run as root or install them with apt-get" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  [ ${#need[@]} -gt 0 ] && apt-get install -y -qq "${need[@]}" >/dev/null
  if [ "${new_prometheus:-0}" = 1 ] && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true  # installed for its binaries, not as a service
  fi
  for p in "${interpreters[@]}"; do
    if [ -n "$(apt-cache madison "$p" 2>/dev/null)" ]; then
      apt-get install -y -qq "$p" >/dev/null
    else
      echo "setup: $p is not packaged by this distribution: its tests skip and say how to install it"
    fi
  done
  if [ -n "$headers" ]; then
    if apt-cache show "$headers" >/dev/null 2>&1; then
      apt-get install -y -qq "$headers" >/dev/null
    else
      echo "setup: no $headers in the distribution; installing its generic headers instead"
      apt-get install -y -qq linux-headers-cloud-amd64 >/dev/null || apt-get install -y -qq linux-headers-amd64 >/dev/null
    fi
  fi
fi

if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml setup.py recorder/*.c store/db/*.c | sha1sum | cut -c1-12)-$want_test
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  if [ $want_test = 1 ]; then
    .venv/bin/python -m pip install -q -e '.[test]'
  else
    .venv/bin/python -m pip install -q -e .
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
.venv/bin/python -c "import bcc" 2>/dev/null || { echo "setup: bcc is not importable from .venv" >&2; exit 1; }
if [ $want_test = 1 ]; then
  # NVIDIA's own libcudart and libnccl for the tests (tests/native/vendor_libs.py), downloaded once into
  # /var/cache/stall-recorder/wheels; offline, the tests that need them skip and say why
  .venv/bin/python tests/native/vendor_libs.py || echo "setup: the vendor libraries could not be prepared" >&2
fi
