"""Round trip of the MCP `explain_stall` tool over real stdio, on a synthetic recording of N events.

    .venv/bin/python benchmarks/bench_mcp.py                     # 1,000,000 events, 7 calls
    .venv/bin/python benchmarks/bench_mcp.py --events 10000000   # the 10M-event target
    .venv/bin/python benchmarks/bench_mcp.py --json

The recording is written straight into SQLite (no BPF): half CUDA calls (cudaMalloc / cudaLaunchKernel
on 8 threads, 1 in 1000 slow), half off-CPU intervals, one preemption inside each slow call; then the
store's stop-time indexes are built. It is cached in build/bench/mcp-<N>.db. The benchmark starts
`recorder mcp --db` as a subprocess through the SDK's stdio client (as Claude Code or Cursor do), and
times explain_stall (whole session, and --worst) from request to parsed result; `recorder explain`
in process (store.report.build.explain) is timed alongside to separate query cost from the MCP layer.
run_sql is timed on a trivial statement (SELECT 1) and a count over cuda_call: each query runs in a
process forked from a forkserver (killed at its time limit), and the trivial one shows that cost.
Target from the issue: <= 300 ms on a 10M-event database.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mcp import Client, StdioServerParameters  # noqa: E402

from store.db import open_store  # noqa: E402
from store.report.build import explain  # noqa: E402

THREADS = 8
SLOW_EVERY = 1000
BATCH = 200_000


def make_db(path: Path, events: int) -> float:
    """Write the synthetic recording; returns seconds taken."""
    started = time.monotonic()
    tmp = path.with_suffix(".tmp")
    for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        p.unlink(missing_ok=True)
    calls = events // 2
    with open_store(tmp, create=True) as s:
        sid = s.db["session"].insert({
            "started_ts": 0, "stopped_ts": calls * 1_000_000 + 10**9, "wall_offset_ns": 1_700_000_000 * 10**9,
            "status": "complete", "recorder_pid": 1, "hostname": "bench", "kernel_release": "k", "boot_id": "b",
            "cpu_count": 2, "target": "bench", "command": "bench_mcp", "tool_version": "bench"}).last_pk
        s.db["process"].insert_all([{"id": 1, "session_id": sid, "pid": 100, "name": "train", "first_ts": 0},
                                    {"id": 2, "session_id": sid, "pid": 200, "name": "hog", "first_ts": 0}])
        s.db["thread"].insert_all([{"id": t + 1, "session_id": sid, "tid": 100 + t, "process_id": 1,
                                    "name": "train", "first_ts": 0, "traced": 1} for t in range(THREADS)]
                                  + [{"id": 99, "session_id": sid, "tid": 200, "process_id": 2, "name": "hog",
                                      "first_ts": 0, "traced": 0}])
        s.db["capability"].insert_all([{"session_id": sid, "layer": x, "probe": x, "status": "attached",
                                        "detail": "", "ts": 0} for x in ("sched", "cuda")])
        named = "api_id" in {c.name for c in s.db["cuda_call"].columns}
        apis = [("cudaMalloc", 21), ("cudaLaunchKernel", None)]
        if named:
            s.db["cuda_api"].insert_all([{"id": i, "name": a, "family": a, "library": "runtime", "arguments": "x"}
                                         for i, (a, _) in enumerate(apis)])
            cols = "session_id, ts, dur, thread_id, api_id, ret, size_bytes, size_class, cgroup_id"
        else:
            cols = "session_id, ts, dur, thread_id, api, family, library, ret, size_bytes, size_class, cgroup_id"
        call_sql = f"INSERT INTO cuda_call ({cols}) VALUES ({','.join('?' * len(cols.split(',')))})"
        off_sql = ("INSERT INTO offcpu_interval (session_id, ts, dur, thread_id, cpu, state, next_thread_id, in_cpu,"
                   " contender_thread_id, contender_run_dur, cgroup_id, syscall) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)")
        for lo in range(0, calls, BATCH):
            crows, orows = [], []
            for i in range(lo, min(lo + BATCH, calls)):
                ts = i * 1_000_000
                slow = i % SLOW_EVERY == 7
                dur = 9_000_000 if slow else 300_000 + (i % 7) * 1000
                thread = i % THREADS + 1
                k = i % 2
                api, size_class = apis[k]
                size = (1 << 20) if size_class else None
                if named:
                    crows.append((sid, ts, dur, thread, k, 0, size, size_class, 0))
                else:
                    crows.append((sid, ts, dur, thread, api, api, "runtime", 0, size, size_class, 0))
                if slow:  # preempted by the hog inside the call
                    orows.append((sid, ts + 100_000, 8_000_000, thread, 1, 256, 99, 1, 99, 8_000_000, 0, None))
                else:  # a futex sleep between calls
                    orows.append((sid, ts + dur + 10_000, 200_000, thread, 0, 1, 99, 0, None, None, 0, 202))
            s.conn.executemany(call_sql, crows)
            s.conn.executemany(off_sql, orows)
            s.conn.commit()
        try:
            s.build_indexes()
        except Exception as e:  # the index files follow the schema; say so rather than fail the run
            print(f"note: store indexes not built ({e})", file=sys.stderr)
        s.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    os.replace(tmp, path)
    return time.monotonic() - started


async def round_trips(db: Path, repeat: int) -> dict:
    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", str(db)],
                                   cwd=str(ROOT))
    out: dict[str, list[float]] = {"whole": [], "worst": [], "sql_trivial": [], "sql_count": []}
    t0 = time.perf_counter()
    async with Client(params) as c:
        connect_s = time.perf_counter() - t0
        for _ in range(repeat):
            for key, args in (("whole", {}), ("worst", {"worst": True})):
                t = time.perf_counter()
                r = await c.call_tool("explain_stall", args, read_timeout_seconds=600)
                out[key].append(time.perf_counter() - t)
                assert not r.is_error and r.structured_content["stall"], r.content
            for key, sql in (("sql_trivial", "SELECT 1"), ("sql_count", "SELECT count(*) FROM cuda_call")):
                t = time.perf_counter()
                r = await c.call_tool("run_sql", {"sql": sql}, read_timeout_seconds=600)
                out[key].append(time.perf_counter() - t)
                assert not r.is_error, r.content
    return {"connect_s": connect_s, **out}


def in_process(db: Path, repeat: int) -> dict:
    out: dict[str, list[float]] = {"whole": [], "worst": []}
    for _ in range(repeat):
        for key, worst in (("whole", False), ("worst", True)):
            t = time.perf_counter()
            with open_store(db, readonly=True) as s:
                explain(s, worst=worst)
            out[key].append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000, help="events in the recording (default 1,000,000)")
    ap.add_argument("-r", "--repeat", type=int, default=7, help="calls of each kind (default 7)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    db = ROOT / "build" / "bench" / f"mcp-{args.events}.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    made_s = None if db.exists() else make_db(db, args.events)
    local = in_process(db, max(1, args.repeat // 2))
    remote = anyio.run(round_trips, db, args.repeat)
    ms = lambda xs: round(1000 * statistics.median(xs), 1)  # noqa: E731
    result = {
        "events": args.events, "db_bytes": db.stat().st_size, "db_build_s": made_s,
        "stdio_connect_ms": round(1000 * remote["connect_s"], 1),
        "explain_stall_stdio_median_ms": {"whole": ms(remote["whole"]), "worst": ms(remote["worst"])},
        "explain_stall_stdio_max_ms": {k: round(1000 * max(remote[k]), 1) for k in ("whole", "worst")},
        "explain_in_process_median_ms": {"whole": ms(local["whole"]), "worst": ms(local["worst"])},
        "run_sql_stdio_median_ms": {"select_1": ms(remote["sql_trivial"]), "count_cuda_call": ms(remote["sql_count"])},
        "target_ms": 300, "loadavg": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print("| events | DB MB | call | stdio round trip median (max) | in-process explain() |\n|---|---|---|---|---|")
    for k in ("whole", "worst"):
        print(f"| {args.events:,} | {result['db_bytes'] / 1e6:.0f} | explain_stall {k} | "
              f"{result['explain_stall_stdio_median_ms'][k]} ms ({result['explain_stall_stdio_max_ms'][k]} ms) | "
              f"{result['explain_in_process_median_ms'][k]} ms |")
    sql = result["run_sql_stdio_median_ms"]
    print(f"\nrun_sql over stdio, median: SELECT 1 {sql['select_1']} ms, count(*) FROM cuda_call "
          f"{sql['count_cuda_call']} ms")
    print(f"stdio connect (spawn + initialize): {result['stdio_connect_ms']} ms; load average {result['loadavg']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
