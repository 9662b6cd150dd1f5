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

if [ ${#need[@]} -gt 0 ] || [ -n "$headers" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing system packages (${need[*]} $headers): run as root or install them with apt-get" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  [ ${#need[@]} -gt 0 ] && apt-get install -y -qq "${need[@]}" >/dev/null
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
