"""The recorder on the CPU stand-in of a real GPU job's CUDA traffic: launches kept, dropped, and
what they cost, untraced and traced interleaved.

The job (tests/workloads/standin_gpu_job.py) has the shape a PyTorch job has on a real GPU:
`cudaLaunchKernel` called from 24+ Python frames deep, several call sites, the stand-in runtime
calling the stand-in driver's exported `cuLaunchKernel` through a trampoline in executable
anonymous memory, `cuLaunchKernelEx` straight at the driver, a copy and a synchronisation per step
of 500 launches, paced at --rate launches a second (50,000 by default; a real 170M-parameter
transformer on an H200 made ~18,000).

Per repetition it runs the job untraced and under `recorder record` (every layer), the order
alternating, and reports medians of:
- launches a second reached, and the job's median step (500 launches) traced / untraced;
- CUDA calls the job made (a runtime call and the driver call it makes inside are one), `cuda_call`
  rows kept, and the losses the recording counted;
- the recorder process's CPU over the calling interval, as a share of one core;
- the kernel's BPF run time per CUDA call (all the recorder's programs that ran for the CUDA
  probes: entries, returns, the native and Python stack walks), from kernel.bpf_stats_enabled.

Needs root (BPF); says `skipped` without it.

    sudo .venv/bin/python benchmarks/bench_standin_gpu.py                  # 3 pairs x 20 s at 50,000/s
    sudo .venv/bin/python benchmarks/bench_standin_gpu.py -r 1 --seconds 60 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "native"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_training_job import run_watched  # noqa: E402

JOB = ROOT / "tests" / "workloads" / "standin_gpu_job.py"
RECORDER = [sys.executable, "-m", "recorder"]
STEP_LAUNCHES = 500
TARGETS = {"dropped": 0, "bytes_per_launch": 4, "ready_s": 3, "recorder_core_share": 0.15, "median_step_ratio": 1.02}
CUDA_PROGRAM_PREFIXES = ("cuda_", "pystack", "py_")


def _watch_readable(db: Path, done: Path, seen: dict) -> None:
    """Once the job has written `done`: when the recording reads complete, and when a report of it
    (`recorder explain --json`) has been read, CLOCK_MONOTONIC ns (complete, explained)."""
    while not done.exists():
        time.sleep(0.01)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
            try:
                row = con.execute("SELECT status FROM session ORDER BY id DESC LIMIT 1").fetchone()
            finally:
                con.close()
        except sqlite3.Error:
            row = None
        if row and row[0] == "complete":
            seen["complete"] = time.monotonic_ns()
            break
        time.sleep(0.02)
    else:
        return
    res = subprocess.run(RECORDER + ["explain", "--db", str(db), "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    if res.returncode != 0:
        seen["error"] = res.stderr.strip()[-2000:]
        return
    seen["explained"] = time.monotonic_ns()


def run_job(traced: bool, libdir: Path, workdir: Path, rate: float, seconds: float, label: str) -> dict:
    ready, out = workdir / f"ready-{label}", workdir / f"out-{label}.json"
    ready.unlink(missing_ok=True)
    out.unlink(missing_ok=True)
    job = [sys.executable, str(JOB), "--libdir", str(libdir), "--rate", str(rate), "--seconds", str(seconds),
           "--ready-file", str(ready), "--out", str(out)]
    db = workdir / f"{label}.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    cmd = RECORDER + ["record", "--db", str(db), "--"] + job if traced else job
    readable: dict = {}
    watcher = threading.Thread(target=_watch_readable, args=(db, out, readable), daemon=True)
    if traced:
        watcher.start()
    returncode, _, err, seen = run_watched(cmd, traced, ready, out)
    ended = time.monotonic_ns()
    if traced:
        watcher.join(timeout=600)
    if returncode != 0 or not out.exists():
        raise RuntimeError(f"{label} failed ({returncode}): {err.strip()[-2000:]}")
    job = json.loads(out.read_text())
    # the calls the job made, one row each: the driver calls the stand-in runtime makes inside its
    # own (cuLaunchKernel, cuStreamSynchronize) are part of those calls' rows
    calls = sum(job["calls"].values()) - job["calls"]["cuLaunchKernel"] - job["calls"]["cuStreamSynchronize"]
    result = {"label": label, "traced": traced, "launch_rate": job["launch_rate"],
              "step_median_ms": job["step_median_ns"] / 1e6, "calls": calls, "calls_by_api": job["calls"]}
    if not traced:
        return result
    if "bpf1" not in seen:
        raise RuntimeError(f"{label}: the recorder ended before the job did")
    # the job's end (its out file) -> the session complete in the file -> a report read from it (while
    # the recorder may still be detaching its probes); and -> the recorder's exit
    if "error" in readable or "explained" not in readable:
        raise RuntimeError(f"{label}: no report: {readable.get('error', 'the session never read complete')}")
    result["complete_s"] = (readable["complete"] - seen["t1"]) / 1e9
    result["ready_s"] = (readable["explained"] - seen["t1"]) / 1e9
    result["stop_s"] = (ended - seen["t1"]) / 1e9
    wall = (seen["t1"] - seen["t0"]) / 1e9
    result["recorder_core_share"] = (seen["cpu1"] - seen["cpu0"]) / wall
    bpf_ns = runs = 0
    per_program = {}
    for name, p in seen["bpf1"].items():
        if not name.startswith(CUDA_PROGRAM_PREFIXES):
            continue
        q = seen["bpf0"].get(name, {"runs": 0, "run_time_ns": 0})
        d_runs, d_ns = p["runs"] - q["runs"], p["run_time_ns"] - q["run_time_ns"]
        if d_runs:
            per_program[name] = {"runs": d_runs, "ns_per_run": d_ns / d_runs}
            bpf_ns += d_ns
            runs += d_runs
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = dict(con.execute("SELECT a.name, count(*) FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
                                " GROUP BY 1").fetchall())
        losses = dict(con.execute("SELECT probe, sum(dropped) FROM loss GROUP BY probe").fetchall())
    finally:
        con.close()
    calls_in_loop = calls
    result.update({
        "rows": sum(rows.values()), "rows_by_api": rows, "losses": losses, "missing_rows": calls - sum(rows.values()),
        "cuda_dropped": sum(n for probe, n in losses.items() if "cuda" in probe),
        "bpf_ns_per_call": bpf_ns / max(1, calls_in_loop),
        "bpf_programs": dict(sorted(per_program.items(), key=lambda kv: -kv[1]["runs"] * kv[1]["ns_per_run"])[:8]),
        "db_bytes": sum(Path(f"{db}{s}").stat().st_size for s in ("", "-wal") if Path(f"{db}{s}").exists()),
    })
    launches = job["calls"]["cudaLaunchKernel"] + job["calls"].get("cuLaunchKernelEx", 0)
    result["bytes_per_launch"] = result["db_bytes"] / max(1, launches)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--reps", type=int, default=3, help="untraced/traced pairs")
    ap.add_argument("--seconds", type=float, default=20.0, help="calling time per run")
    ap.add_argument("--rate", type=float, default=50_000, help="kernel launches a second")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"skipped": "needs root (BPF uprobes)"}) if args.json else "skipped: needs root (BPF uprobes)")
        return 0
    import native_libs
    libdir = native_libs.build_libraries()["libcudart.so.12"].parent
    subprocess.run(["sysctl", "-q", "-w", "kernel.bpf_stats_enabled=1"], check=False)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-standin-gpu-") as tmp:
        for rep in range(args.reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for traced in order:
                label = f"{'traced' if traced else 'untraced'}{rep}"
                runs.append(run_job(traced, libdir, Path(tmp), args.rate, args.seconds, label))
                if not args.json:
                    r = runs[-1]
                    extra = (f", recorder {r['recorder_core_share']:.1%} of a core, rows {r['rows']:,},"
                             f" cuda dropped {r['cuda_dropped']:,}, BPF {r['bpf_ns_per_call']:.0f} ns/call,"
                             f" {r['bytes_per_launch']:.1f} B/launch, ready {r['ready_s']:.1f} s after the job"
                             if traced else "")
                    print(f"{label}: {r['launch_rate']:,.0f} launches/s, step {r['step_median_ms']:.3f} ms,"
                          f" calls {r['calls']:,}{extra}", flush=True)
    untraced = [r for r in runs if not r["traced"]]
    traced = [r for r in runs if r["traced"]]
    med = statistics.median
    summary = {
        "reps": args.reps, "seconds": args.seconds, "rate": args.rate, "load_average": os.getloadavg(),
        "launch_rate_untraced": med(r["launch_rate"] for r in untraced),
        "launch_rate_traced": med(r["launch_rate"] for r in traced),
        "median_step_ratio": med(t["step_median_ms"] / u["step_median_ms"]
                                 for u, t in zip(untraced, traced, strict=True)),
        "recorder_core_share": med(r["recorder_core_share"] for r in traced),
        "bpf_ns_per_call": med(r["bpf_ns_per_call"] for r in traced),
        # a step is STEP_LAUNCHES launches (and a copy and a synchronisation)
        "added_us_per_launch": med((t["step_median_ms"] - u["step_median_ms"]) * 1000 / STEP_LAUNCHES
                                   for u, t in zip(untraced, traced, strict=True)),
        "bytes_per_launch": med(r["bytes_per_launch"] for r in traced),
        "complete_s": med(r["complete_s"] for r in traced),
        "stop_s": med(r["stop_s"] for r in traced),
        "ready_s": med(r["ready_s"] for r in traced),
        "calls": sum(r["calls"] for r in traced), "rows": sum(r["rows"] for r in traced),
        "cuda_dropped": sum(r["cuda_dropped"] for r in traced),
        "rows_by_api": traced[-1]["rows_by_api"], "calls_by_api": traced[-1]["calls_by_api"],
        "bpf_programs": traced[-1]["bpf_programs"], "losses": traced[-1]["losses"],
    }
    summary["targets"] = {
        "dropped": summary["cuda_dropped"] <= TARGETS["dropped"],
        "recorder_core_share": summary["recorder_core_share"] <= TARGETS["recorder_core_share"],
        "median_step_ratio": summary["median_step_ratio"] <= TARGETS["median_step_ratio"],
        "bytes_per_launch": summary["bytes_per_launch"] <= TARGETS["bytes_per_launch"],
        "ready_s": summary["ready_s"] <= TARGETS["ready_s"],
    }
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary}, indent=1))
        return 0
    print()
    print("| figure | value |")
    print("|---|---:|")
    for key in ("launch_rate_untraced", "launch_rate_traced", "median_step_ratio", "added_us_per_launch",
                "recorder_core_share", "bpf_ns_per_call", "bytes_per_launch", "complete_s", "ready_s", "stop_s",
                "calls", "rows", "cuda_dropped"):
        v = summary[key]
        print(f"| {key} | {v:,.3f} |" if isinstance(v, float) else f"| {key} | {v:,} |")
    print(f"\nrows by API (last traced run): {summary['rows_by_api']}")
    print(f"calls by API (last traced run): {summary['calls_by_api']}")
    print(f"losses (last traced run): {summary['losses']}")
    for name, p in summary["bpf_programs"].items():
        print(f"  {name}: {p['runs']:,} runs, {p['ns_per_run']:.0f} ns/run")
    print(f"targets met: {summary['targets']}; load average {summary['load_average']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
