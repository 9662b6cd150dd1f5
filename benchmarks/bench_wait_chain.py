"""Wait-chain cost on a synthetic session written through the store: S steps of a training thread
that each wait 20 ms on a queue fed by a worker process (the main thread's read woken by the
worker's feeder thread, itself woken by the worker after its disk read: a chain of 2 hops per step,
plus ~100 short futex waits of each thread); one step in 500 waits 400 ms on a throttled read.
Measures `explain(step=N)` of a stalled step (its cause a wait chain), `store.analysis.waits.chain()` of one
wait, and the plain-SQL `wait_chain` view for one root and over the whole session. Needs no root.

    .venv/bin/python benchmarks/bench_wait_chain.py [STEPS] [DB]   # default 5000 /tmp/bench_waits.db
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import open_store  # noqa: E402
from store.analysis import waits  # noqa: E402
from store.report.build import explain  # noqa: E402

MS = 1_000_000
T0 = 10**12
MAIN, FEEDER, WORKER = 1, 2, 3
SHORT = 100  # short futex waits per thread and step


def build(steps: int, db: str) -> tuple[int, int]:
    for p in (db, db + "-wal", db + "-shm"):
        if os.path.exists(p):
            os.remove(p)
    s = open_store(db, create=True)
    s.conn.execute("INSERT INTO process (id, session_id, pid, name, first_ts) VALUES (1, 1, 10, 'train', 0),"
                   " (2, 1, 20, 'loader', 0)")
    s.conn.execute("INSERT INTO thread (id, session_id, tid, process_id, name, first_ts, traced) VALUES"
                   " (1, 1, 10, 1, 'train', 0, 1), (2, 1, 21, 2, 'feeder', 0, 1), (3, 1, 20, 2, 'loader', 0, 1)")
    offs, reqs, marks = [], [], []
    t = T0
    stalled = None
    for step in range(steps):
        marks.append((t, step))
        slow = step % 500 == 250
        if slow and stalled is None:
            stalled = step
        wait = (400 if slow else 20) * MS
        for i in range(SHORT):  # short futex waits of every thread, woken by one another
            for th, waker in ((MAIN, FEEDER), (FEEDER, WORKER), (WORKER, MAIN)):
                offs.append((t + i * 10_000, 3_000, th, 1, 202, waker, t + i * 10_000 + 2_000))
        a = t + 2 * MS
        offs.append((a - MS, wait - 2 * MS, WORKER, 2, 0, None, a + wait - 3 * MS))  # the disk read
        reqs.append((a - MS, wait - 2 * MS, a + wait - 4 * MS, a + wait - 3 * MS, wait - 3 * MS, MS))
        offs.append((a - MS // 2, wait - MS, FEEDER, 1, 202, WORKER, a + wait - 2 * MS))  # the feeder's futex
        offs.append((a, wait, MAIN, 1, 0, FEEDER, a + wait - MS))  # the queue read
        t = a + wait + 2 * MS
    s.conn.executemany("INSERT INTO offcpu_interval (session_id, ts, dur, thread_id, cpu, state, syscall,"
                       " waker_thread_id, wakeup_ts, in_cpu, cgroup_id) VALUES (1, ?, ?, ?, 0, ?, ?, ?, ?, 0, 1)",
                       offs)
    s.conn.executemany(
        "INSERT INTO block_request (session_id, ts, dur, thread_id, submitter_kind, device, dev_major, dev_minor,"
        " sector, size_bytes, op, rwbs, sync, metadata, fua, readahead, preflush, bio_queue_ts, issue_ts,"
        " complete_ts, queued_dur, device_dur, error, requeues, merges) VALUES (1, ?, ?, 3, 'target_deferred',"
        " 'loop0', 7, 0, 0, 1048576, 'read', 'R', 1, 0, 0, 0, 0, ?, ?, ?, ?, ?, 0, 0, 0)",
        [(ts, dur, issue, issue, ts + dur, queued, dev) for ts, dur, issue, _c, queued, dev in reqs])
    s.conn.executemany("INSERT INTO step_mark (session_id, ts, thread_id, step, inferred) VALUES (1, ?, 1, ?, 0)",
                       marks)
    s.db["session"].insert({
        "id": 1, "started_ts": T0 - MS, "stopped_ts": t + MS, "wall_offset_ns": 1_777_000_000 * 10**9,
        "status": "complete", "recorder_pid": 1, "hostname": "bench", "kernel_release": "k", "boot_id": "b",
        "cpu_count": 2, "target": "synthetic", "command": "bench_wait_chain", "tool_version": "bench"})
    s.conn.execute("INSERT INTO capability (session_id, layer, probe, status, ts) VALUES"
                   " (1, 'sched', 'sched:sched_switch', 'attached', 0), (1, 'block', 'block:block_rq_complete',"
                   " 'attached', 0)")
    s.conn.commit()
    s.build_indexes()
    s.store_baselines(1)
    s.close()
    return len(offs), stalled


def timed(fn, reps: int = 5) -> tuple[float, float]:
    t = time.perf_counter()
    fn()
    first = (time.perf_counter() - t) * 1000
    laps = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        laps.append((time.perf_counter() - t) * 1000)
    return first, statistics.median(laps)


def main() -> int:
    args = sys.argv[1:]
    steps = int(args[0]) if args else 5000
    db = args[1] if len(args) > 1 else "/tmp/bench_waits.db"
    t = time.perf_counter()
    intervals, stalled = build(steps, db)
    print(f"built {intervals:,} off-CPU intervals over {steps:,} steps in {time.perf_counter() - t:.0f} s")
    store = open_store(db, readonly=True)
    report = explain(store, step=stalled)
    print("stalled step:", report["primary_cause"]["summary"])
    root = report["primary_cause"]["chain"][0]["offcpu_id"]
    ex = timed(lambda: explain(store, step=stalled))
    ch = timed(lambda: waits.chain(store, root))
    one = timed(lambda: store.query("SELECT * FROM wait_chain WHERE root_offcpu_id = ?", (root,)))
    every = timed(lambda: store.query("SELECT count(*) AS n FROM wait_chain"), reps=1)
    print("| intervals | explain --step (chain) | waits.chain() | wait_chain, one root | wait_chain, every root |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {intervals / 1e6:.2f} M | {ex[1]:.0f} ms (first {ex[0]:.0f}) | {ch[1]:.1f} ms | {one[1]:.0f} ms |"
          f" {every[1]:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
