"""Cost of the markers (recorder.step, recorder.lineage enter+exit) when nothing records and when a
uprobe is attached to the marker functions (what a recording session does). One run, medians.

    .venv/bin/python benchmarks/bench_markers.py [-n 200000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import recorder  # noqa: E402


def per_call_ns(fn, n: int, reps: int = 7) -> float:
    samples = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn(n)
        samples.append((time.perf_counter_ns() - t) / n)
    return statistics.median(samples)


def steps(n: int) -> None:
    step = recorder.step
    for i in range(n):
        step(i)


def scopes(n: int) -> None:
    scope = recorder.lineage("checkpoint_write/run42/step80000/shard17")
    for _ in range(n):
        with scope:
            pass


def empty(n: int) -> None:
    for _ in range(n):
        pass


def measure(n: int) -> dict:
    loop = per_call_ns(empty, n)
    result = {"loop_ns": loop, "not_recording": {
        "step_ns": per_call_ns(steps, n) - loop, "lineage_enter_exit_ns": per_call_ns(scopes, n) - loop}}
    if os.geteuid() == 0:
        from bcc import BPF

        from recorder import _markers
        from recorder.core import kheaders

        kheaders.locate()
        b = BPF(text="int hit(struct pt_regs *ctx) { return 0; }")
        for sym in ("stall_recorder_step", "stall_recorder_lineage"):
            b.attach_uprobe(name=_markers.__file__, sym=sym, fn_name="hit", pid=os.getpid())
        m = max(n // 20, 1000)  # a trap per call: fewer calls
        result["recording"] = {"step_ns": per_call_ns(steps, m) - loop,
                               "lineage_enter_exit_ns": per_call_ns(scopes, m) - loop}
        b.cleanup()
    else:
        result["recording"] = "skipped: needs root to attach uprobes"
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200_000)
    ap.add_argument("-j", "--json", action="store_true")
    args = ap.parse_args()
    r = measure(args.n)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print("| markers | not recording | recording (uprobe attached) |\n|---|---:|---:|")
    rec = r["recording"]
    for key, label in (("step_ns", "recorder.step(n)"), ("lineage_enter_exit_ns", "with recorder.lineage(...)")):
        rv = f"{rec[key]:,.0f} ns" if isinstance(rec, dict) else rec
        print(f"| {label} | {r['not_recording'][key]:,.0f} ns | {rv} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
