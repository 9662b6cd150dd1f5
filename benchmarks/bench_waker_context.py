"""Cost of telling interrupt-context wake-ups apart (bpf/sched.bpf.c): the programs on
irq:irq_handler_entry, irq:softirq_entry, the timer callbacks' entry and exit, the hardirq vectors
that are no device interrupt (irq_vectors: irq_work, IPIs) and sched_waking
itself, as the kernel counts them (kernel.bpf_stats_enabled), while the recorder records a thread
that sleeps 1 ms in a loop beside a busy loop on the same CPU.

    sudo .venv/bin/python benchmarks/bench_waker_context.py [--seconds 10] [--json]

Prints, per program: runs per second over the whole machine, ns per run and CPU ms per second, and
how many of the recorded sleeps were woken by 'timer'. The interrupt and timer tracepoints fire for
every interrupt on the machine, traced or not; their cost is what this adds to a recording.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("tracepoint__irq__irq_handler_entry", "tracepoint__irq__softirq_entry",
            "tracepoint__timer__hrtimer_expire_entry", "tracepoint__timer__hrtimer_expire_exit",
            "tracepoint__timer__timer_expire_entry", "tracepoint__timer__timer_expire_exit",
            "tracepoint__irq_vectors__irq_work_entry",
            "tracepoint__irq_vectors__call_function_entry",
            "tracepoint__irq_vectors__call_function_single_entry",
            "tracepoint__sched__sched_waking")
STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def _program_ids(pid: int) -> set[int]:
    """Ids of the BPF programs process `pid` holds open (from its fds' fdinfo)."""
    ids = set()
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            for line in info.read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
        except OSError:
            continue
    return ids


def _programs(recorder_pid: int) -> dict[str, tuple[int, int]]:
    """name -> (run_cnt, run_time_ns) of the recorder's programs (other recorders on the machine
    load programs of the same names)."""
    mine = _program_ids(recorder_pid)
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["name"]: (p.get("run_cnt", 0), p.get("run_time_ns", 0)) for p in json.loads(out)
            if p.get("id") in mine and p.get("name") in PROGRAMS}


def run(seconds: float) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "needs root"}
    before = STATS.read_text().strip()
    STATS.write_text("1\n")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "bench.db"
            stop = Path(tmp) / "stop"
            script = ("taskset -c 0 sh -c 'while :; do :; done' & busy=$!; taskset -c 0 python3 -c "
                      f"'import os, time\nwhile not os.path.exists(\"{stop}\"): time.sleep(0.001)'; kill $busy")
            rec = subprocess.Popen([sys.executable, "-m", "recorder", "record", "--db", str(db), "--", "sh", "-c",
                                    script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            snaps: list[tuple[float, dict]] = []
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and len(_programs(rec.pid)) < len(PROGRAMS):
                time.sleep(0.5)  # compiling and attaching
            time.sleep(1)
            for _ in range(2):
                snaps.append((time.monotonic(), _programs(rec.pid)))
                time.sleep(seconds)
            stop.touch()
            rec.communicate(timeout=300)
            conn = sqlite3.connect(db)
            woken = dict(conn.execute("SELECT coalesce(waker_name, '(none)'), count(*) FROM offcpu"
                                      " WHERE syscall_name = 'clock_nanosleep' GROUP BY 1").fetchall())
            conn.close()
    finally:
        STATS.write_text(before + "\n")
    (t0, a), (t1, b) = snaps[0], snaps[1]
    span = t1 - t0
    rows = {}
    for name in PROGRAMS:
        if name in a and name in b:
            runs = b[name][0] - a[name][0]
            ns = b[name][1] - a[name][1]
            rows[name] = {"runs_per_s": round(runs / span), "ns_per_run": round(ns / runs) if runs else None,
                          "cpu_ms_per_s": round(ns / span / 1e6, 3)}
    return {"seconds": round(span, 1), "programs": rows, "sleeps_woken_by": woken,
            "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args.seconds)
    if args.json or "skipped" in result:
        print(json.dumps(result))
        return
    print(f"over {result['seconds']} s, load average {result['load_average']}\n")
    print("| program | runs/s | ns/run | CPU ms/s |\n|---|---|---|---|")
    for name, r in result["programs"].items():
        print(f"| {name} | {r['runs_per_s']:,} | {r['ns_per_run']} | {r['cpu_ms_per_s']} |")
    print(f"\nsleeps woken by: {result['sleeps_woken_by']}")


if __name__ == "__main__":
    main()
