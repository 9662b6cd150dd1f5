"""Causal SQL on an hour of a training job: the time `causal_link` (and the views and Datasette
canned queries built beside it) take to answer one step's links and a whole-session count, from a
synthetic recording written through the store's own Writer and schema, sized like a real job.

The job: one training process of 3 threads (the training thread, CUDA's event handler thread, the
pin-memory thread) and a DataLoader worker process, 12,000 steps of 300 ms (an hour). Each step:
160 kernel launches, a 200 ms cudaStreamSynchronize the training thread sleeps in (woken by the
event handler), 8 preemptions, 10 polls of the event handler, the pin-memory thread woken by the
worker after its 4 disk reads, 3 GPU utilisation samples. One step in 600 stalls, in turn behind a
CPU hog inside a kernel launch, on a slow disk read (a chain of waits) and in memory-cgroup reclaim; a checkpoint of 200
writes every 1,000 steps. About 1.5 million rows, ~200 MB (a 60 s recording of one such process
is 3.7 MB).

Measured, on the complete recording (links stored at the stop) and, --live, on the same rows
with nothing stored (a recording still being written, or one from an older recorder):
a step's links (`WHERE from_table = 'step_mark' AND from_id = ?`), `SELECT count(*) FROM
causal_link`, and every Datasette canned query (store/exports/datasette.py). Needs no root.

    .venv/bin/python benchmarks/bench_causal_sql.py [--steps 12000] [--db /tmp/bench_causal.db] [--reuse]
    .venv/bin/python benchmarks/bench_causal_sql.py --live --steps 2000   # the unstored path too
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step_explain import new_recording  # noqa: E402

from store import open_store  # noqa: E402
from store.db import Writer  # noqa: E402
from store.exports.datasette import QUERIES  # noqa: E402

US, MS, S = 1_000, 1_000_000, 1_000_000_000
T0 = 10**12
TRAIN, EVT, PIN, WORKER, HOG = 1, 2, 3, 4, 5
STEP = 300 * MS

OFFCPU = ("session_id", "ts", "dur", "thread_id", "cpu", "state", "syscall", "next_thread_id", "waker_thread_id",
          "wakeup_ts", "in_cpu", "contender_thread_id", "contender_run_dur", "cgroup_id")
CUDA = ("session_id", "ts", "dur", "thread_id", "api_id", "ret", "stream", "function", "cgroup_id")
BLOCK = ("session_id", "ts", "dur", "thread_id", "submitter_kind", "device", "dev_major", "dev_minor", "sector",
         "size_bytes", "op", "rwbs", "sync", "metadata", "fua", "readahead", "preflush", "bio_queue_ts", "issue_ts",
         "complete_ts", "queued_dur", "device_dur", "error", "requeues", "merges")
GPU = ("session_id", "ts", "gpu_index", "pci_address", "name", "util_gpu", "util_mem")


def build(steps: int, db: str) -> dict:
    """Write the recording; returns its row count and the ids of a stalled and a normal step."""
    s, launch, sync = new_recording(db)
    s.conn.execute("INSERT INTO process (id, session_id, pid, name, first_ts) VALUES (1, 1, 10, 'python3', 0),"
                   " (2, 1, 30, 'pt_data_worker', 0), (3, 1, 50, 'hog', 0)")
    s.conn.execute("INSERT INTO thread (id, session_id, tid, process_id, name, first_ts, traced) VALUES"
                   " (1, 1, 10, 1, 'python3', 0, 1), (2, 1, 11, 1, 'cuda-EvtHandlr', 0, 1),"
                   " (3, 1, 12, 1, 'pin_memory', 0, 1), (4, 1, 30, 2, 'pt_data_worker', 0, 1),"
                   " (5, 1, 50, 3, 'hog', 0, 0)")
    s.conn.execute("INSERT INTO block_device VALUES (1, 'nvme0n1', 259, 0, 'nvme0n1', 'nvme0', '0000:01:00.0',"
                   " 'nvme', 'bench')")
    w = Writer(s)
    for name, cols in (("offcpu_interval", OFFCPU), ("cuda_call", CUDA), ("block_request", BLOCK),
                       ("gpu_sample", GPU)):
        w.table(name, cols)
    w.table("step_mark", ("session_id", "ts", "thread_id", "step", "inferred"))
    w.table("reclaim_interval", ("session_id", "ts", "dur", "thread_id", "kind", "pages_reclaimed"))

    def off(ts: int, dur: int, thread: int, state: int, syscall: int | None, waker: int | None = None,
            wake: int | None = None, contender: int | None = None) -> None:
        w.add("offcpu_interval", (1, ts, dur, thread, 0, state, syscall, contender, waker, wake, 0, contender,
                                  dur if contender else None, 1))

    def read(ts: int, dur: int, thread: int, sector: int, op: str = "read") -> None:
        w.add("block_request", (1, ts, dur, thread, "target", "nvme0n1", 259, 0, sector, 262144, op,
                                op[0].upper(), 0, 0, 0, 0, 0, ts, ts + 20 * US, ts + dur, 20 * US, dur - 20 * US,
                                0, 0, 0))

    t = T0
    stalled = None
    for n in range(steps):
        w.add("step_mark", (1, t, TRAIN, n, 0))
        kind = (n // 600) % 3 if n % 600 == 300 else None
        if kind is not None and stalled is None:
            stalled = n
        # the worker reads the next batch; the pin-memory thread waits for it, then the training thread
        disk = 900 * MS if kind == 1 else 2 * MS
        a = t + 10 * MS
        for i in range(4):
            d = disk if i == 3 else 2 * MS
            read(a, d, WORKER, n * 64 + i * 8)
            off(a + 5 * US, d, WORKER, 2, 17, None, a + d)
            a += d + 100 * US
        off(t + 5 * MS, a - t - 5 * MS + 50 * US, PIN, 1, 202, WORKER, a + 20 * US)
        c = t + 1 * MS
        if kind == 1:  # the training thread waits for the batch
            off(c, a - c + 200 * US, TRAIN, 1, 202, PIN, a + 150 * US)
            c = a + 300 * US
        for i in range(160):
            w.add("cuda_call", (1, c, 8 * US, TRAIN, launch, 0, 7, 0x7f00 + i, 1))
            c += 1 * MS
            if i % 10 == 5:
                off(c, 40 * US, TRAIN, 256, None, None, None, HOG if kind == 0 else None)
                c += 50 * US
        if kind == 0:  # a hog takes the CPU inside a launch: 40 preemptions of 5 ms
            w.add("cuda_call", (1, c, 40 * (5 * MS + 50 * US) + 10 * US, TRAIN, launch, 0, 7, 0x7eff, 1))
            for _ in range(40):
                off(c + 5 * US, 5 * MS, TRAIN, 256, None, None, None, HOG)
                c += 5 * MS + 50 * US
            c += 10 * US
        if kind == 2:  # memory-cgroup reclaim in an allocation
            w.add("reclaim_interval", (1, c, 400 * MS, TRAIN, "memcg", 2000))
            off(c + 100 * US, 390 * MS, TRAIN, 2, None)
            c += 400 * MS
        if n % 1000 == 999:  # a checkpoint
            for i in range(200):
                read(c, 400 * US, TRAIN, 10**7 + n * 4096 + i * 512, "write")
                off(c + 5 * US, 390 * US, TRAIN, 2, 1, None, c + 395 * US)
                c += 410 * US
        sync_dur = max(20 * MS, t + STEP - c - 5 * MS)
        w.add("cuda_call", (1, c, sync_dur, TRAIN, sync, 0, 7, None, 1))
        e = t
        for i in range(10):  # the event handler's polls; the last one wakes the training thread
            end = c + sync_dur - 200 * US if i == 9 else e + 20 * MS
            off(e, end - e, EVT, 1, 7, None, end)
            e = end + 50 * US
        off(c + 30 * US, sync_dur - 60 * US, TRAIN, 1, 202, EVT, c + sync_dur - 100 * US)
        t = c + sync_dur + 5 * MS
        for i in range(3):
            util = 15 if kind is not None else 90 - (n + i) % 7
            w.add("gpu_sample", (1, t - STEP + i * 100 * MS, 0, "0000:10:00.0", "NVIDIA H200", util, 40))
        if w.pending() > 100_000:
            w.flush()
    w.close()
    s.db["session"].insert({
        "id": 1, "started_ts": T0 - 30 * S, "stopped_ts": t + MS, "wall_offset_ns": 1_777_000_000 * S,
        "status": "complete", "recorder_pid": 1, "hostname": "bench", "kernel_release": "k", "boot_id": "b",
        "cpu_count": 2, "target": "synthetic", "command": "bench_causal_sql", "tool_version": "bench"})
    s.conn.execute("INSERT INTO capability (session_id, layer, probe, status, ts) VALUES"
                   " (1, 'sched', 'sched:sched_switch', 'attached', 0), (1, 'cuda', 'cudaLaunchKernel', 'attached', 0),"
                   " (1, 'block', 'block:block_rq_complete', 'attached', 0), (1, 'gpu', 'nvml', 'attached', 0)")
    s.conn.commit()
    rows = sum(s.one(f"SELECT count(*) AS n FROM {table}")["n"] for table in
               ("cuda_call", "offcpu_interval", "block_request", "step_mark", "gpu_sample", "reclaim_interval"))
    t0 = time.perf_counter()
    s.build_indexes()
    s.store_baselines(1)
    stop_s = time.perf_counter() - t0
    ids = s.one("SELECT (SELECT id FROM step_mark WHERE step = ?) AS stalled, (SELECT id FROM step_mark"
                " WHERE step = ?) AS normal", (stalled, stalled + 7))
    s.close()
    return {"rows": rows, "stop_s": stop_s, "stalled_step": stalled, **ids}


LIMIT_S = 60.0  # a query still running after this long is stopped and reported as "> 60 s"


def timed(conn, fn, reps: int = 3) -> float:
    """Median wall time of `reps` calls, ms; inf for a call stopped at LIMIT_S."""
    import sqlite3

    laps = []
    for _ in range(reps):
        t = time.perf_counter()
        conn.set_progress_handler(lambda t=t: time.perf_counter() - t > LIMIT_S, 100_000)
        try:
            fn()
        except sqlite3.OperationalError as e:
            if "interrupted" not in str(e):
                raise
            return float("inf")
        finally:
            conn.set_progress_handler(None, 0)
        laps.append((time.perf_counter() - t) * 1000)
    return statistics.median(laps)


def _ms(v: float, digits: int = 0) -> str:
    return f"> {LIMIT_S:.0f} s" if v == float("inf") else f"{v:.{digits}f} ms"


def measure(db: str, stalled_step: int, stalled_id: int, reps: int) -> dict:
    with open_store(db, readonly=True) as r:
        q = r.conn.execute
        out = {
            "step_links_ms": timed(r.conn, lambda: q("SELECT * FROM causal_link WHERE from_table = 'step_mark'"
                                             " AND from_id = ?", (stalled_id,)).fetchall(), reps),
            "step_links": len(q("SELECT * FROM causal_link WHERE from_table = 'step_mark' AND from_id = ?",
                                (stalled_id,)).fetchall()),
            "count_ms": timed(r.conn, lambda: q("SELECT count(*) FROM causal_link").fetchone(), reps),
            "canned_ms": {},
        }
        for name, query in QUERIES.items():
            params = {"step": stalled_step} if ":step" in query["sql"] else {}
            out["canned_ms"][name] = timed(r.conn, lambda sql=query["sql"], p=params: q(sql, p).fetchall(), reps)
    return out


def unstore(db: str) -> str:
    """A copy of the recording as one still being written would read: no links stored."""
    import shutil

    live = db.replace(".db", "") + "_live.db"
    shutil.copyfile(db, live)
    with open_store(live) as s:
        s.conn.execute("DELETE FROM causal_link_session")
        s.conn.execute("DELETE FROM causal_link_stored")
        s.conn.commit()
    return live


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12_000, help="steps of 300 ms (12,000: an hour)")
    ap.add_argument("--db", default="/tmp/bench_causal.db")
    ap.add_argument("--reuse", action="store_true", help="measure an existing --db again")
    ap.add_argument("--live", action="store_true", help="also measure a copy with no links stored")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    if args.reuse:
        with open_store(args.db, readonly=True) as r:
            built = r.one("SELECT (SELECT step FROM step_mark WHERE step % 600 = 300 ORDER BY step LIMIT 1)"
                          " AS stalled_step")
            built["stalled"] = r.one("SELECT id FROM step_mark WHERE step = ?", (built["stalled_step"],))["id"]
    else:
        built = build(args.steps, args.db)
    build_s = time.perf_counter() - t
    result = {"steps": args.steps, "db_bytes": os.path.getsize(args.db), "build_s": round(build_s, 1),
              **built, "stored": measure(args.db, built["stalled_step"], built["stalled"], args.reps)}
    if args.live:
        result["live"] = measure(unstore(args.db), built["stalled_step"], built["stalled"], 1)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.steps:,} steps, {built.get('rows', 0):,} rows, {result['db_bytes'] / 1e6:.0f} MB; "
          f"indexes, baselines and links at the stop: {built.get('stop_s', 0):.1f} s")
    modes = ["stored"] + (["live"] if args.live else [])
    print("| query | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))
    print(f"| a step's links ({result['stored']['step_links']} rows) | "
          + " | ".join(_ms(result[m]["step_links_ms"], 1) for m in modes) + " |")
    print("| count(*) of causal_link | " + " | ".join(_ms(result[m]["count_ms"]) for m in modes) + " |")
    for name in QUERIES:
        print(f"| canned query {name} | " + " | ".join(_ms(result[m]["canned_ms"][name]) for m in modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
