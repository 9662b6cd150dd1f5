"""`recorder import` speed and result size: a PyTorch profiler trace of a real GPU job (the public A100
trace in tests/fixtures/traces/, two steps, 4,855 events) repeated end to end into one larger trace of
--steps steps (each copy shifted in time and renumbered, so every step, kernel and correlation id is
distinct), imported into a new database in a fresh process; then `explain --step` on it.

Prints events/s of the import (reading, checking and writing, all of it), the trace's size (gzip
and JSON), the database's size and bytes per event, the importer's peak RSS, and the time of one
step's report. No root, no GPU.

    .venv/bin/python benchmarks/bench_import.py [--steps 200] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "fixtures" / "traces" / "hta_sampled_rank0.json.gz"


def build_trace(out: Path, steps: int) -> int:
    """Write a trace of `steps` steps from the two-step source; the number of events written."""
    doc = json.loads(gzip.decompress(SOURCE.read_bytes()))
    events = doc["traceEvents"]
    times = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float)) and isinstance(e.get("pid"), int)]
    span = max(times) - min(times) + 1000  # us, and a 1 ms gap between copies
    out_events = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M"]
    copies = (steps + 1) // 2
    for c in range(copies):
        for e in timed:
            e2 = dict(e)
            if isinstance(e2.get("ts"), (int, float)):
                e2["ts"] = e2["ts"] + c * span
            args = e2.get("args")
            if isinstance(args, dict) and ("correlation" in args or "External id" in args):
                args = dict(args)
                for k in ("correlation", "External id"):
                    if isinstance(args.get(k), int):
                        args[k] = args[k] + c * 10_000_000
                e2["args"] = args
            name = e2.get("name")
            if isinstance(name, str) and name.startswith("ProfilerStep#"):
                e2["name"] = f"ProfilerStep#{int(name.split('#')[1]) + 2 * c}"
            out_events.append(e2)
    doc["traceEvents"] = out_events
    with gzip.open(out, "wt") as f:
        json.dump(doc, f)
    return len(out_events)


CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from store.traces import import_files
summary = import_files(sys.argv[1], [sys.argv[2]])[0]
t1 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "summary": summary}))
"""

EXPLAIN = """
import json, sys, time
from store.db import open_store
from store.report.build import explain
with open_store(sys.argv[1], readonly=True) as store:
    t0 = time.perf_counter()
    report = explain(store, None, step=int(sys.argv[2]))
    print(json.dumps({"explain_s": time.perf_counter() - t0, "busy_pct": report["gpu"]["busy_pct"]}))
"""


def run(steps: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="stall-bench-import-") as tmp:
        trace = Path(tmp) / "trace.json.gz"
        events = build_trace(trace, steps)
        json_bytes = len(gzip.decompress(trace.read_bytes()))
        gz_bytes = trace.stat().st_size
        runs = []
        for i in range(reps):
            db = Path(tmp) / f"run{i}.db"
            out = subprocess.run([sys.executable, "-c", CHILD, str(db), str(trace)], capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            r = json.loads(out.stdout)
            r["db_bytes"] = db.stat().st_size
            runs.append(r)
        first = runs[0]["summary"]["steps"][len(runs[0]["summary"]["steps"]) // 2]
        ex = json.loads(subprocess.run([sys.executable, "-c", EXPLAIN, str(Path(tmp) / "run0.db"), str(first)],
                                       capture_output=True, text=True, cwd=ROOT, check=True).stdout)
    secs = statistics.median(r["import_s"] for r in runs)
    db_bytes = runs[0]["db_bytes"]
    return {"steps": steps, "events": events, "trace_gz_bytes": gz_bytes, "trace_json_bytes": json_bytes,
            "import_s": round(secs, 2), "events_per_s": round(events / secs),
            "host_ops": runs[0]["summary"]["host_ops"], "device_activities": runs[0]["summary"]["device_activities"],
            "db_bytes": db_bytes, "db_bytes_per_event": round(db_bytes / events, 1),
            "peak_rss_mb": round(max(r["rss_kb"] for r in runs) / 1024), "explain_step_s": round(ex["explain_s"], 3),
            "reps": reps, "cpu": os.cpu_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="steps in the trace built (default 200)")
    ap.add_argument("--reps", type=int, default=3, help="imports timed (default 3; the median is reported)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args()
    r = run(args.steps, args.reps)
    r["bench_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"| steps | events | JSON (gzip) | import (median of {r['reps']}) | events/s | database | bytes/event | "
          "peak RSS | explain --step |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {r['steps']} | {r['events']:,} | {r['trace_json_bytes'] / 1e6:.0f} MB "
          f"({r['trace_gz_bytes'] / 1e6:.1f} MB) | {r['import_s']} s | "
          f"{r['events_per_s']:,} | {r['db_bytes'] / 1e6:.1f} MB | {r['db_bytes_per_event']} | {r['peak_rss_mb']} MB | "
          f"{r['explain_step_s'] * 1000:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
