"""The flight recorder over time: database size and CPU while `--keep` deletes what falls out of
the window.

Two modes, each printing one row per sample:

- `live` (root): `recorder record --keep KEEP` around a stand-in training loop
  (tests/workloads/train_steps.py: per step a cudaMalloc, three launches, a synchronise and a free
  through the stand-in libcudart, Python host work, a sleep; ~70 steps and ~450 CUDA calls a
  second, plus its off-CPU intervals and Python stacks) for MINUTES. Every SAMPLE seconds: the
  database and its log on disk, the recorder's CPU share since the last sample (utime+stime of its
  process), the rows in the main event tables and the age of the oldest one kept.
- `synthetic` (no root): the store side alone at an accelerated rate. A Writer inserts RATE
  off-CPU rows and RATE/4 CUDA-call rows per simulated second and runs the Retention statements
  every simulated second, as the session does, for HOURS of simulated time. Every simulated
  SAMPLE seconds: the file's size, its free pages and the CPU seconds spent per simulated second.
- `sized` (no root): `--max-size` in real time. A Writer inserts RATE events a second (four
  off-CPU rows to one CUDA call) in 100 ms batches for SECONDS, and the flight recorder's own
  window keeping (FlightRecorder.keep, at every batch as in a session) holds the database and its
  log within MAX_SIZE. Every 100 ms: the database and its log on disk; the result is the largest
  total seen, against the bound, and the window kept.

    sudo .venv/bin/python benchmarks/bench_flight.py live --minutes 12 --keep 2m
    .venv/bin/python benchmarks/bench_flight.py synthetic --hours 1 --keep 10m --rate 5000
    .venv/bin/python benchmarks/bench_flight.py synthetic --hours 1 --json
    .venv/bin/python benchmarks/bench_flight.py sized --rate 100000 --max-size 16MB --seconds 60
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
S = 1_000_000_000


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _db_bytes(db: Path) -> tuple[int, int]:
    sizes = []
    for p in (db, db.with_name(db.name + "-wal")):
        try:
            sizes.append(p.stat().st_size)
        except OSError:
            sizes.append(0)
    return sizes[0], sizes[1]


def live(args) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "needs root (BPF)"}
    sys.path.insert(0, str(ROOT / "tests" / "native"))
    import native_libs

    libdir = native_libs.build_libraries()["libcudart.so.12"].parent
    folder = Path(tempfile.mkdtemp(prefix="bench-flight-"))
    db = folder / "flight.db"
    steps = int(args.minutes * 60 * 200)  # more than it can do in the time: stopped by the deadline
    rec = subprocess.Popen(
        [sys.executable, "-m", "recorder", "record", "--db", str(db), "--keep", args.keep, "--before", "20s",
         "--after", "10s", "--triggers", "", "--", sys.executable, str(ROOT / "tests/workloads/train_steps.py"),
         "--libdir", str(libdir), "--steps", str(steps), "--quiet"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    samples = []
    prev_cpu, prev_t = 0.0, t0
    recorder_pid = None
    while time.monotonic() - t0 < args.minutes * 60:
        time.sleep(args.sample)
        if recorder_pid is None:
            recorder_pid = rec.pid
        now = time.monotonic()
        try:
            cpu = _cpu_s(recorder_pid)
        except OSError:
            break
        main, wal = _db_bytes(db)
        row = {"t_s": round(now - t0), "db_mb": round(main / 1e6, 1), "wal_mb": round(wal / 1e6, 1),
               "recorder_cpu_pct": round(100 * (cpu - prev_cpu) / (now - prev_t), 1)}
        try:
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            for table in ("offcpu_interval", "cuda_call"):
                lo, hi, n = conn.execute(f"SELECT (SELECT ts FROM {table} WHERE id = (SELECT min(id) FROM {table})),"
                                         f" (SELECT max(id) FROM {table}), (SELECT count(*) FROM {table})").fetchone()
                row[f"{table}_rows"] = n
                row[f"{table}_ids"] = hi
            clock = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            lo = conn.execute("SELECT ts FROM offcpu_interval WHERE id = (SELECT min(id) FROM offcpu_interval)"
                              ).fetchone()
            row["oldest_s"] = round((clock - lo[0]) / S, 1) if lo else None
            conn.close()
        except sqlite3.Error as e:
            row["error"] = str(e)
        samples.append(row)
        if not args.json:
            print(json.dumps(row), flush=True)
        prev_cpu, prev_t = cpu, now
    # the workload is the recorder's child: end it, the recorder stops and finishes
    for line in subprocess.run(["pgrep", "-P", str(rec.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(line), 15)
    rec.communicate(timeout=300)
    main, wal = _db_bytes(db)
    return {"mode": "live", "keep": args.keep, "minutes": args.minutes, "samples": samples,
            "final_db_mb": round(main / 1e6, 1), "loadavg": os.getloadavg()}


def _recording(db: Path, started: int, limits=None) -> tuple:
    """A new recording with one thread and one CUDA API, and a background Writer of off-CPU
    intervals and CUDA calls: (store, session id, writer)."""
    from store.db import Writer, open_store

    store = open_store(db, create=True)
    sid = store.db["session"].insert({
        "started_ts": started, "wall_offset_ns": 0, "status": "recording", "recorder_pid": os.getpid(),
        "hostname": "b", "kernel_release": "k", "boot_id": "b", "cpu_count": 1, "target": "bench",
        "command": "bench", "tool_version": "0"}).last_pk
    store.conn.execute("INSERT INTO thread (id, session_id, tid, name, first_ts) VALUES (1, ?, 1, 'w', 0)", (sid,))
    store.conn.execute("INSERT INTO cuda_api (id, name, family, library, arguments) VALUES "
                       "(0, 'cudaLaunchKernel', 'cudaLaunchKernel', 'runtime', 'launch_rt')")
    store.conn.commit()
    writer = Writer(store, background=True, limits=limits)
    writer.table("offcpu_interval", ("session_id", "ts", "dur", "thread_id", "cpu", "state", "cgroup_id"))
    writer.table("cuda_call", ("session_id", "ts", "dur", "thread_id", "api_id", "ret", "stream", "cgroup_id"))
    return store, sid, writer


def synthetic(args) -> dict:
    from store.db.session import parse_duration
    from store.flight import Retention, event_tables, used_bytes

    keep = parse_duration(args.keep)
    folder = Path(tempfile.mkdtemp(prefix="bench-flight-"))
    db = folder / "flight.db"
    store, sid, writer = _recording(db, 0)
    retention = Retention(event_tables(store.conn))
    for sql in retention.setup:
        writer.execute(sql)
    writer.execute("PRAGMA journal_size_limit = 67108864")
    monitor = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rate, calls = args.rate, args.rate // 4
    samples = []
    cpu0 = time.process_time()
    wall0 = time.monotonic()
    last_cpu = cpu0
    for sec in range(1, int(args.hours * 3600) + 1):
        base = (sec - 1) * S
        writer.extend("offcpu_interval", [(sid, base + i * (S // rate), 50_000, 1, i & 1, 1, 7) for i in range(rate)])
        writer.extend("cuda_call", [(sid, base + i * (S // calls), 20_000, 1, 0, 0, 0x51, 7) for i in range(calls)])
        for sql, params in retention.statements(sec * S, sec * S - keep):
            writer.execute(sql, params)
        writer.flush()
        if sec % args.sample == 0:
            writer.sync()
            used, free = used_bytes(monitor)
            main, wal = _db_bytes(db)
            cpu = time.process_time()
            row = {"sim_min": round(sec / 60, 1), "db_mb": round(main / 1e6, 1), "wal_mb": round(wal / 1e6, 1),
                   "free_mb": round(free / 1e6, 1),
                   "rows": monitor.execute("SELECT count(*) FROM offcpu_interval").fetchone()[0],
                   "cpu_ms_per_sim_s": round(1000 * (cpu - last_cpu) / args.sample, 1)}
            last_cpu = cpu
            samples.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    writer.close()
    store.close()
    return {"mode": "synthetic", "keep": args.keep, "rate": rate, "hours": args.hours, "samples": samples,
            "wall_s": round(time.monotonic() - wall0, 1), "cpu_s": round(time.process_time() - cpu0, 1),
            "loadavg": os.getloadavg()}


def sized(args) -> dict:
    from recorder.core.clock import now_ns
    from recorder.core.participant import SessionHandle
    from recorder.flight import FlightOptions, FlightRecorder, Window, parse_size
    from store.db.session import parse_duration

    folder = Path(tempfile.mkdtemp(prefix="bench-flight-"))
    db = folder / "flight.db"
    started = now_ns()
    max_bytes = parse_size(args.max_size)
    options = FlightOptions(keep_ns=parse_duration(args.keep), max_bytes=max_bytes, before_ns=S, after_ns=S)
    window = Window(options)  # made before the writer, as in a session: its limits are the writer's
    store, sid, writer = _recording(db, started, window.writer_limits())
    handle = SessionHandle(db, sid, started, writer)
    flight = FlightRecorder(handle, options, window)
    flight.start()
    per_batch = args.rate // 10
    calls = per_batch // 5
    peak, samples, late = 0, [], 0
    cpu0, t0 = time.process_time(), time.monotonic()
    for batch in range(args.seconds * 10):
        due = t0 + batch / 10
        if time.monotonic() < due:
            time.sleep(due - time.monotonic())
        else:
            late += 1
        now = now_ns()
        step = 100_000_000 // per_batch
        writer.extend("offcpu_interval", [(sid, now - 100_000_000 + i * step, 50_000, 1, i & 1, 1, 7)
                                          for i in range(per_batch - calls)])
        writer.extend("cuda_call", [(sid, now - 100_000_000 + i * step * 5, 20_000, 1, 0, 0, 0x51, 7)
                                    for i in range(calls)])
        flight.keep(now)
        writer.flush()
        main, wal = _db_bytes(db)
        peak = max(peak, main + wal)
        if batch % (args.sample * 10) == 0:
            row = {"s": batch // 10, "db_mb": round(main / 1e6, 2), "wal_mb": round(wal / 1e6, 2),
                   "kept_s": round(window.keep_now / S, 2), "peak_mb": round(peak / 1e6, 2)}
            samples.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    writer.sync()
    reader = handle.connect()
    rows = sum(reader.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("offcpu_interval", "cuda_call"))
    reader.close()
    flight.finish(now_ns())
    writer.close()
    store.close()
    return {"mode": "sized", "rate": args.rate, "max_size": args.max_size, "max_bytes": max_bytes,
            "seconds": args.seconds, "peak_bytes": peak, "peak_of_bound": round(peak / max_bytes, 3),
            "kept_s_at_end": round(window.keep_now / S, 2), "shortest_kept_s": round((window.shortest or 0) / S, 2),
            "rows_kept_at_end": rows, "late_batches": late,
            "cpu_s_per_s": round((time.process_time() - cpu0) / args.seconds, 2), "samples": samples,
            "loadavg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("live", "synthetic", "sized"))
    ap.add_argument("--keep", default=None, help="the window kept (live 2m, synthetic 10m)")
    ap.add_argument("--minutes", type=float, default=12, help="live: how long to record")
    ap.add_argument("--hours", type=float, default=1, help="synthetic: simulated time")
    ap.add_argument("--rate", type=int, default=None,
                    help="synthetic: off-CPU rows per simulated second (5000); sized: events a second (100000)")
    ap.add_argument("--sample", type=int, default=None,
                    help="seconds between samples (live 30, synthetic 300, sized 5)")
    ap.add_argument("--max-size", default="16MB", help="sized: the bound on the database and its log")
    ap.add_argument("--seconds", type=int, default=60, help="sized: how long to write")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.keep = args.keep or ("2m" if args.mode in ("live", "sized") else "10m")
    args.rate = args.rate or (100_000 if args.mode == "sized" else 5000)
    args.sample = args.sample or {"live": 30, "synthetic": 300, "sized": 5}[args.mode]
    result = {"live": live, "synthetic": synthetic, "sized": sized}[args.mode](args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))


if __name__ == "__main__":
    main()
