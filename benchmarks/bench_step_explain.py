"""Step report latency on a large synthetic session written through the store: S steps of a
training thread, each with 240 CUDA calls, ~250 off-CPU intervals and 8 block requests (about 500
events per step: 20,000 steps are 10 million events); one step in 1,000 stalls, alternately behind
a CPU hog and on a slow read. Measures `explain(step=N)` for a stalled step and for a normal one,
`explain()` (find the worst stall, then explain it), and the MCP `explain_stall` round trip over
real stdio (the server in a subprocess, the SDK's client). Needs no root.

    .venv/bin/python benchmarks/bench_step_explain.py [STEPS] [DB]   # default 20000 /tmp/bench_steps.db
    .venv/bin/python benchmarks/bench_step_explain.py --reuse [DB]   # measure an existing DB again
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import open_store  # noqa: E402
from store.report.build import explain  # noqa: E402

MS = 1_000_000
T0 = 10**12
CALLS, SLEEPS, READS = 240, 250, 8


def new_recording(db: str):
    """A new recording at `db` (an older one there is removed) with the CUDA API table filled:
    (store, id of cudaLaunchKernel, id of cudaStreamSynchronize)."""
    for p in (db, db + "-wal", db + "-shm"):
        if os.path.exists(p):
            os.remove(p)
    s = open_store(db, create=True)
    from recorder.layers import cuda

    s.conn.executemany("INSERT INTO cuda_api (id, name, family, library, arguments) VALUES (?,?,?,?,?)",
                       [(i, a.name, a.family, a.library, a.layout) for i, a in enumerate(cuda.APIS)])
    launch, sync = cuda.API_INDEX["cudaLaunchKernel"], cuda.API_INDEX["cudaStreamSynchronize"]
    return s, launch, sync


def build(steps: int, db: str) -> tuple[int, float]:
    s, launch, sync = new_recording(db)
    s.conn.execute("INSERT INTO process (id, session_id, pid, name, first_ts) VALUES (1, 1, 10, 'train', 0),"
                   " (2, 1, 20, 'hog', 0)")
    s.conn.execute("INSERT INTO thread (id, session_id, tid, process_id, name, first_ts, traced) VALUES"
                   " (1, 1, 10, 1, 'train', 0, 1), (2, 1, 11, 1, 'cuda-EvtHandlr', 0, 1), (3, 1, 20, 2, 'hog', 0, 0)")
    s.conn.execute("INSERT INTO block_device VALUES (1, 'nvme0n1', 259, 0, 'nvme0n1', 'nvme0', '0000:01:00.0',"
                   " 'nvme', 'bench')")
    t = T0
    calls, offs, reqs, marks = [], [], [], []

    def flush() -> None:
        s.conn.executemany("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, stream, cgroup_id)"
                           " VALUES (1, ?, ?, 1, ?, 0, 7, 1)", calls)
        s.conn.executemany("INSERT INTO offcpu_interval (session_id, ts, dur, thread_id, cpu, state, syscall,"
                           " waker_thread_id, wakeup_ts, in_cpu, contender_thread_id, cgroup_id)"
                           " VALUES (1, ?, ?, 1, 1, ?, ?, ?, ?, 1, ?, 1)", offs)
        s.conn.executemany(
            "INSERT INTO block_request (session_id, ts, dur, thread_id, submitter_kind, device, dev_major, dev_minor,"
            " sector, size_bytes, op, rwbs, sync, metadata, fua, readahead, preflush, bio_queue_ts, issue_ts,"
            " complete_ts, queued_dur, device_dur, error, requeues, merges) VALUES (1, ?, ?, 1, 'target', 'nvme0n1',"
            " 259, 0, ?, 262144, 'read', 'R', 0, 0, 0, 0, 0, ?, ?, ?, ?, ?, 0, 0, 0)", reqs)
        s.conn.executemany("INSERT INTO step_mark (session_id, ts, thread_id, step, inferred) VALUES (1, ?, 1, ?, 0)",
                           marks)
        calls.clear(), offs.clear(), reqs.clear(), marks.clear()

    for n in range(steps):
        marks.append((t, n))
        stall = n % 1000 == 500
        for i in range(READS):  # data loading: reads that block the thread
            dev = 120 * MS if stall and n % 2000 == 1500 and i == 3 else 1_500_000
            reqs.append((t, 40_000 + dev, n * 64 + i, t, t + 40_000, t + 40_000 + dev, 40_000, dev))
            offs.append((t + 5_000, 40_000 + dev, 2, 17, None, t + 40_000 + dev, None))
            t += 50_000 + dev
        for i in range(CALLS):  # forward: kernel launches, short sleeps between some
            calls.append((t, 7_000, launch))
            t += 100_000
            if i % 24 == 0:
                offs.append((t, 50_000, 1, 202, 2, t + 45_000, None))
                t += 60_000
        if stall and n % 2000 == 500:  # a hog takes the CPU: 40 preemptions of 5 ms
            for _ in range(40):
                offs.append((t, 5 * MS, 256, None, None, None, 3))
                t += 5 * MS + 50_000
        calls.append((t, 30 * MS, sync))
        offs.append((t + 20_000, 30 * MS - 40_000, 1, 202, 2, t + 30 * MS - 30_000, None))
        t += 30 * MS + 2 * MS
        if len(calls) > 200_000:
            flush()
    flush()
    s.db["session"].insert({
        "id": 1, "started_ts": T0 - MS, "stopped_ts": t + MS, "wall_offset_ns": 1_777_000_000 * 10**9,
        "status": "complete", "recorder_pid": 1, "hostname": "bench", "kernel_release": "k", "boot_id": "b",
        "cpu_count": 2, "target": "synthetic", "command": "bench_step_explain", "tool_version": "bench"})
    s.conn.execute("INSERT INTO capability (session_id, layer, probe, status, ts) VALUES"
                   " (1, 'sched', 'sched:sched_switch', 'attached', 0), (1, 'cuda', 'cudaLaunchKernel', 'attached', 0),"
                   " (1, 'block', 'block:block_rq_complete', 'attached', 0)")
    s.conn.commit()
    events = sum(s.one(f"SELECT count(*) AS n FROM {table}")["n"]
                 for table in ("cuda_call", "offcpu_interval", "block_request", "step_mark"))
    t0 = time.perf_counter()
    s.build_indexes()
    s.store_baselines(1)
    stop = time.perf_counter() - t0
    s.close()
    return events, stop


def timed(fn, reps: int = 5) -> tuple[float, float]:
    """(first call, median of the next reps) in ms."""
    t = time.perf_counter()
    fn()
    first = (time.perf_counter() - t) * 1000
    laps = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        laps.append((time.perf_counter() - t) * 1000)
    return first, statistics.median(laps)


def mcp_round_trip(db: str, reps: int = 5) -> tuple[float, float]:
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", db],
                                   cwd=str(Path(__file__).resolve().parent.parent))

    async def go() -> tuple[float, float]:
        async with Client(params) as c:
            laps = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                r = await c.call_tool("explain_stall", {})
                laps.append((time.perf_counter() - t) * 1000)
                assert not r.is_error, r.content
            return laps[0], statistics.median(laps[1:])
    return anyio.run(go)


def main() -> int:
    args = sys.argv[1:]
    reuse = bool(args) and args[0] == "--reuse"
    if reuse:
        args = args[1:]
    steps = int(args[0]) if args and not reuse else 20_000
    db = args[-1] if args and not args[-1].isdigit() else "/tmp/bench_steps.db"
    if not reuse:
        t = time.perf_counter()
        events, stop = build(steps, db)
        print(f"built {events:,} events over {steps:,} steps in {time.perf_counter() - t:.0f} s; "
              f"indexes and baselines at stop {stop:.1f} s; {os.path.getsize(db) / 1e9:.2f} GB")
    with open_store(db, readonly=True) as r:
        worst = explain(r)
        assert worst["stall"], worst["symptom"]
        n = worst["step"]["step"]
        stalled = timed(lambda: explain(r, step=n))
        normal = timed(lambda: explain(r, step=n + 3))
        whole = timed(lambda: explain(r), reps=3)
    rt = mcp_round_trip(db)
    print(f"worst stall: step {n}: {worst['primary_cause']['summary']}")
    print("| events | explain --step (stalled) | explain --step (normal) | explain (find worst) "
          "| MCP explain_stall over stdio |")
    print(f"| {os.path.getsize(db) / 1e9:.1f} GB | {stalled[1]:.0f} ms (first {stalled[0]:.0f}) "
          f"| {normal[1]:.0f} ms (first {normal[0]:.0f}) | {whole[1]:.0f} ms (first {whole[0]:.0f}) "
          f"| {rt[1]:.0f} ms (first {rt[0]:.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
