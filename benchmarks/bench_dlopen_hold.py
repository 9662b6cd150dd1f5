"""Calls recorded right after a dlopen, with the process held at the dlopen's return until the
library's probes are attached (the default) and without (STALL_RECORDER_DLOPEN_HOLD=0), on NVIDIA's
own libcudart.so.12 and libnccl.so.2 (tests/native/vendor_libs.py), and what the hold costs: how
long each `ctypes.CDLL` took untraced, traced with the hold and traced without.

    sudo .venv/bin/python benchmarks/bench_dlopen_hold.py [--reps 3] [--calls 500] [--json]

Needs root; skipped (exit 0, says why) without it or without the vendor wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "native"))
from vendor_libs import vendor_library  # noqa: E402

WORKLOAD = ROOT / "tests" / "workloads" / "vendor_calls.py"
RECORDER = [sys.executable, "-m", "recorder"]


def _run(libs: dict[str, str], calls: int, mode: str) -> dict:
    """One run of the workload: untraced, or traced with the hold on or off."""
    with tempfile.TemporaryDirectory() as tmp:
        db, go = Path(tmp) / "r.db", Path(tmp) / "go"
        argv = [sys.executable, str(WORKLOAD), "--cudart", libs["libcudart.so.12"], "--nccl", libs["libnccl.so.2"],
                "--calls", str(calls), "--wait-file", str(go)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        if mode != "untraced":
            env = dict(os.environ, STALL_RECORDER_DLOPEN_HOLD="1" if mode == "hold" else "0")
            subprocess.run([*RECORDER, "start", "-p", str(proc.pid), "--db", str(db)], cwd=ROOT, env=env,
                           check=True, capture_output=True)
        go.touch()
        out, _ = proc.communicate(timeout=300)
        ran = json.loads(out.strip().splitlines()[-1])
        result = {"load_s": ran["load_s"]}
        if mode != "untraced":
            time.sleep(0.3)
            subprocess.run([*RECORDER, "stop", "--db", str(db)], cwd=ROOT, check=True, capture_output=True)
            import sqlite3

            conn = sqlite3.connect(db)
            result["recorded"] = dict(conn.execute(
                "SELECT api, count(*) FROM cuda_call_named GROUP BY api UNION ALL"
                " SELECT api, count(*) FROM nccl_call_detail GROUP BY api").fetchall())
            conn.close()
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"skipped": "needs root"}) if args.json else "bench_dlopen_hold: skipped (needs root)")
        return 0
    libs = {name: vendor_library(name) for name in ("libcudart.so.12", "libnccl.so.2")}
    missing = [str(v) for v in libs.values() if isinstance(v, str)]
    if missing:
        print(json.dumps({"skipped": missing}) if args.json else f"bench_dlopen_hold: skipped ({missing})")
        return 0
    libs = {k: str(v) for k, v in libs.items()}
    runs: dict[str, list[dict]] = {"untraced": [], "hold": [], "no hold": []}
    for _ in range(args.reps):  # interleaved, so a change of machine load hits every mode alike
        for mode in runs:
            runs[mode].append(_run(libs, args.calls, mode))
    table = {}
    for mode, rs in runs.items():
        row = {f"{lib} load ms (median)": round(1000 * statistics.median(r["load_s"][lib] for r in rs), 1)
               for lib in ("cudart", "nccl")}
        if mode != "untraced":
            for api in ("cudaMalloc", "cudaStreamSynchronize", "ncclAllReduce"):
                row[f"{api} recorded (min of {args.reps})"] = min(r["recorded"].get(api, 0) for r in rs)
        table[mode] = row
    if args.json:
        print(json.dumps({"calls": args.calls, "reps": args.reps, "modes": table}))
        return 0
    print(f"Calls recorded of {args.calls} per API, and dlopen time ({args.reps} runs, interleaved)")
    cols = sorted({c for row in table.values() for c in row}, key=lambda c: ("load" not in c, c))
    print("| mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for mode, row in table.items():
        print(f"| {mode} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
