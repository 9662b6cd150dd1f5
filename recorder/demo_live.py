"""`make demo`: record a stand-in training loop on real BPF while a CPU hog shares its core, then
explain the recording.

The training loop calls a CUDA runtime with the real exported names (built from
tests/native/cudart.c), pinned to one CPU. After a second, `busy_loop` is pinned to the same CPU at a
higher priority for two seconds. The report that follows is computed from the recording only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from recorder.core.loader import check_privileges
from recorder.daemon import record_command
from store.db import open_store
from store.errors import UserError
from store.report.build import explain, render_text

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    try:
        check_privileges()
    except UserError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tests" / "native"))
    import native_libs as build  # tests/native/native_libs.py

    out = ROOT / "build" / "native"
    build.build_libraries(out)
    hog = build.build_busy_loop(out)
    cpu = max(os.sched_getaffinity(0))
    other = [c for c in os.sched_getaffinity(0) if c != cpu]
    if other:
        os.sched_setaffinity(0, set(other))  # keep the recorder off the contended CPU
    db = ROOT / "build" / "demo.db"
    for p in db.parent.glob("demo.db*"):
        p.unlink()

    def noisy_neighbour() -> None:
        time.sleep(1.0)
        print(f"demo: 3 x busy_loop at nice -15 pinned to cpu {cpu} for 2 s", flush=True)
        hogs = [subprocess.Popen(["taskset", "-c", str(cpu), "nice", "-n", "-15", str(hog), "2"])
                for _ in range(3)]
        for h in hogs:
            h.wait()

    workload = [sys.executable, str(ROOT / "tests" / "workloads" / "train_steps.py"),
                "--libdir", str(out), "--steps", "400", "--cpu", str(cpu), "--markers", "--quiet"]
    print(f"demo: recording {' '.join(workload[1:2])} pinned to cpu {cpu} into {db}", flush=True)
    code, summary = record_command(
        db, workload, (), "make demo",
        on_started=lambda pid: threading.Thread(target=noisy_neighbour, daemon=True).start())
    print(f"demo: recorded {summary['rows']['cuda_call']} CUDA calls, "
          f"{summary['rows']['offcpu_interval']} off-CPU intervals, {summary['dropped']} dropped\n")
    with open_store(db, readonly=True) as store:
        print(render_text(explain(store)))
    print(f"\nThe recording is {db}: open it with sqlite3, or run "
          f".venv/bin/recorder explain --db {db} --json")
    return code


if __name__ == "__main__":
    sys.exit(main())
