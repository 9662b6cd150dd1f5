"""Per-request cost of block tracing: 4 KiB O_DIRECT writes with dd on an ext4 loop device, with
and without `recorder record` tracing dd (bpf/block.bpf.c on every bio, request and completion).

    sudo .venv/bin/python benchmarks/bench_block.py [--requests 20000] [--rounds 3]

Prints JSON: best-of-rounds seconds per request untraced and traced, and the difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dd(target: Path, n: int, recorder_db: Path | None) -> float:
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=4k", f"count={n}", "oflag=direct"]
    if recorder_db is None:
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        return time.perf_counter() - t0
    # dd's own time (its stderr), so the recorder's start and stop are not counted
    res = subprocess.run([sys.executable, "-m", "recorder", "record", "--db", str(recorder_db), "--", *cmd],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    for line in res.stderr.splitlines():
        if " copied, " in line:
            return float(line.split(" copied, ")[1].split(" s")[0])
    raise RuntimeError(res.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        img, mnt = Path(tmp) / "disk.img", Path(tmp) / "mnt"
        mnt.mkdir()
        subprocess.run(["truncate", "-s", "512M", str(img)], check=True)
        loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True,
                              check=True).stdout.strip()
        try:
            subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
            subprocess.run(["mount", loop, str(mnt)], check=True)
            try:
                plain, traced = [], []
                for i in range(a.rounds):
                    plain.append(dd(mnt / "f.bin", a.requests, None))
                    traced.append(dd(mnt / "f.bin", a.requests, Path(tmp) / f"r{i}.db"))
            finally:
                subprocess.run(["umount", str(mnt)], check=False)
        finally:
            subprocess.run(["losetup", "-d", loop], check=False)
    per_plain, per_traced = min(plain) / a.requests, min(traced) / a.requests
    print(json.dumps({"requests": a.requests, "untraced_us": round(per_plain * 1e6, 2),
                      "traced_us": round(per_traced * 1e6, 2),
                      "overhead_us": round((per_traced - per_plain) * 1e6, 2)}))


if __name__ == "__main__":
    main()
