"""The workload metrics in Prometheus: what they cost, and how soon the late-rank alert fires.

Two modes:

- `detection` (needs Debian's prometheus): a real Prometheus with the shipped rules
  (packaging/prometheus/stall-recorder-rules.yml, unscaled) scrapes, every SCRAPE seconds, three
  simulated jobs of 64, 256 and 1,024 ranks (tests/prometheus_harness.py: one target per job).
  In each job a different rank turns late every PERIOD seconds (for PERIOD - 20 s, then on time
  again); the time from each onset to the alert firing for that rank is measured (polling the
  alerts API every 0.5 s). Prints per job size: the detections, p50 and max latency, and the cost
  of a scrape (Prometheus' own scrape_duration_seconds of the target, and the simulator's render).
- `watch` (no root): the recorder's side. A recording made by the store (step marks, NCCL
  collectives and their synchronisations, off-CPU intervals of the step thread: STEPS steps a
  second for SECONDS) is read by WorkloadWatch.tick() once per simulated second, as a recorder
  does; prints the CPU time per tick and as a share of one core.

    .venv/bin/python benchmarks/bench_prometheus.py detection --scrape 5 --period 60 --rounds 3
    .venv/bin/python benchmarks/bench_prometheus.py watch --steps 1000 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

NS = 1_000_000_000


def detection(scrape: float, period: float, rounds: int) -> dict:
    from prometheus_harness import RULES, Prometheus, SimulatedJob, Simulator

    start = time.time() + 45  # the ranks' series old enough for the rules' windows
    sizes = (64, 256, 1024)
    jobs = [SimulatedJob(f"job-{n}", n, late_rank=n // 3, onset=start, until=start + period - 20) for n in sizes]
    sim = Simulator(jobs)
    folder = Path(tempfile.mkdtemp(prefix="bench-prom-"))
    prom = Prometheus(folder, {j.job_id: (f"127.0.0.1:{sim.port}", f"/{j.job_id}/metrics") for j in jobs},
                      RULES.read_text(), scrape_s=scrape)
    latencies: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for round_ in range(rounds):
            onset = start + round_ * period
            for j in jobs:  # a new late rank each round
                j.late_rank = (j.ranks // 3 + round_ * 7) % j.ranks
                j.onset, j.until = onset, onset + period - 20
                j.started = min(j.started, time.time())
            waiting = {j.ranks: j for j in jobs}
            while waiting and time.time() < onset + period - 20:
                now = time.time()
                for a in prom.alerts():
                    labels = a["labels"]
                    if labels["alertname"] != "StallRecorderLateRank":
                        continue
                    size = int(labels["job_id"].split("-")[1])
                    j = waiting.get(size)
                    if j is not None and labels["rank"] == str(j.late_rank) and now > onset:
                        latencies[size].append(now - onset)
                        del waiting[size]
                time.sleep(0.5)
            time.sleep(max(0.0, onset + period - time.time()))
        scrape_ms = {r["metric"]["job"]: float(r["value"][1]) * 1e3
                     for r in prom.query("avg_over_time(scrape_duration_seconds[10m])")}
    finally:
        prom.stop()
        sim.close()
    out = {}
    for j in jobs:
        lat = latencies[j.ranks]
        out[j.ranks] = {"detected": len(lat), "rounds": rounds,
                        "p50_s": round(statistics.median(lat), 1) if lat else None,
                        "max_s": round(max(lat), 1) if lat else None,
                        "scrape_ms": round(scrape_ms.get(j.job_id, float("nan")), 2),
                        "render_ms": round(j.render_s / max(j.scrapes, 1) * 1e3, 2)}
    return out


def watch(steps: int, seconds: int) -> dict:
    from prometheus_harness import synthetic_rank

    from recorder.workload_metrics import WorkloadWatch
    from store.db import Store
    from store.db.rules import stall_rule

    folder = Path(tempfile.mkdtemp(prefix="bench-watch-"))
    db = folder / "watch.db"
    rec = synthetic_rank(db)
    conn, sid, thread, allreduce, sync = rec.conn, rec.session_id, rec.thread_id, rec.allreduce, rec.sync
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    w = WorkloadWatch(ro, sid, stall_rule(Store(db, ro, True)), "bench-node", 0)
    step_ns = NS // steps
    costs = []
    for second in range(seconds):
        base = second * NS
        marks, calls, syncs, offcpu = [], [], [], []
        for i in range(steps):
            ts = base + i * step_ns
            marks.append((sid, ts, thread, second * steps + i))
            calls.append((sid, ts + step_ns // 2, step_ns // 10, thread, allreduce, 0, 77, 9, 0))
            syncs.append((sid, ts + step_ns // 2 + step_ns // 10 + 1000, step_ns // 10, thread, sync, 0, 9, 0))
            offcpu.append((sid, ts + step_ns // 4, step_ns // 20, thread, 0, 256 if i % 3 else 1, ts + step_ns // 5, 0))
            offcpu.append((sid, ts + step_ns // 2 + 100, step_ns // 20, thread, 0, 1, ts + step_ns // 2 + 2000, 0))
        conn.executemany("INSERT INTO step_mark (session_id, ts, thread_id, step) VALUES (?, ?, ?, ?)", marks)
        conn.executemany("INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, handle, stream, "
                         "cgroup_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", calls)
        conn.executemany("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, stream, cgroup_id) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", syncs)
        conn.executemany("INSERT INTO offcpu_interval (session_id, ts, dur, thread_id, cpu, state, wakeup_ts, "
                         "cgroup_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", offcpu)
        conn.commit()
        began = time.process_time()
        w.tick(base + NS)
        w.metrics()
        costs.append(time.process_time() - began)
    steady = costs[2:] or costs
    r = next(iter(w.ranks.values()))
    return {"steps_per_s": steps, "seconds": seconds, "tick_ms_p50": round(statistics.median(steady) * 1e3, 2),
            "tick_ms_max": round(max(steady) * 1e3, 2),
            "core_share_pct": round(statistics.mean(steady) * 100, 2),
            "steps_counted": r.steps, "collectives_counted": sum(r.collectives.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("detection")
    d.add_argument("--scrape", type=float, default=5)
    d.add_argument("--period", type=float, default=60)
    d.add_argument("--rounds", type=int, default=3)
    w = sub.add_parser("watch")
    w.add_argument("--steps", type=int, default=1000)
    w.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = detection(args.scrape, args.period, args.rounds) if args.mode == "detection" else \
        watch(args.steps, args.seconds)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
