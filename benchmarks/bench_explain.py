"""Report latency on a synthetic session written through the store: N cudaMalloc calls (one in
10,007 made slow by a hog holding the CPU) and N+ off-CPU intervals; then `explain()` over the whole
session and with worst=True, and the time to store baselines at stop. Needs no root.

    .venv/bin/python benchmarks/bench_explain.py [N] [DB]      # default 200000 /tmp/bench_explain.db
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import open_store  # noqa: E402
from store.report.build import explain  # noqa: E402


def build(n: int, db: str) -> float:
    for p in (db, db + "-wal", db + "-shm"):
        if os.path.exists(p):
            os.remove(p)
    s = open_store(db, create=True)
    s.db["session"].insert({
        "started_ts": 10**9, "stopped_ts": 10**9 + n * 10**6, "wall_offset_ns": 0, "status": "complete",
        "recorder_pid": 1, "hostname": "h", "kernel_release": "k", "boot_id": "b", "cpu_count": 2,
        "target": "synthetic", "command": "bench_explain", "tool_version": "bench"})
    s.conn.execute("INSERT INTO cuda_api VALUES (0, 'cudaMalloc', 'cudaMalloc', 'runtime', 'malloc')")
    s.conn.execute("INSERT INTO process (id, session_id, pid, name, first_ts) VALUES (1, 1, 10, 'train', 0),"
                   " (2, 1, 20, 'hog', 0)")
    s.conn.execute("INSERT INTO thread (id, session_id, tid, process_id, name, first_ts, traced) VALUES"
                   " (1, 1, 10, 1, 'train', 0, 1), (2, 1, 20, 2, 'hog', 0, 0)")
    calls, off = [], []
    for i in range(n):
        ts = 10**9 + i * 10**6
        slow = i % 10007 == 5
        calls.append((1, ts, 12_000_000 if slow else 600_000, 1, 0, 0, 1 << 20, 21, 0))
        off.append((1, ts + 700_000, 200_000, 1, 1, 1, 2, None, 1, 0))
        if slow:
            off.append((1, ts + 100_000, 5_000_000, 1, 1, 256, 2, None, 1, 0))
    s.conn.executemany("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, size_bytes, size_class,"
                       " cgroup_id) VALUES (?,?,?,?,?,?,?,?,?)", calls)
    s.conn.executemany("INSERT INTO offcpu_interval (session_id, ts, dur, thread_id, cpu, state,"
                       " contender_thread_id, syscall, in_cpu, cgroup_id) VALUES (?,?,?,?,?,?,?,?,?,?)", off)
    s.conn.commit()
    s.build_indexes()
    t = time.perf_counter()
    s.store_baselines(1)
    spent = time.perf_counter() - t
    s.close()
    return spent


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    db = sys.argv[2] if len(sys.argv) > 2 else "/tmp/bench_explain.db"
    baselines = build(n, db)
    with open_store(db, readonly=True) as r:
        t = time.perf_counter()
        report = explain(r)
        whole = time.perf_counter() - t
        t = time.perf_counter()
        explain(r, worst=True)
        worst = time.perf_counter() - t
    assert report["primary_cause"]["kind"] == "cpu_contention"
    print(f"| {n:,} calls | baselines at stop {baselines:.2f} s | explain (whole session) {whole:.2f} s "
          f"| explain --worst {worst:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
