"""`recorder cluster explain` at scale: N synthetic node recordings (recorder/cluster_demo.py), R
ranks each, S steps, one all-reduce and its stream synchronisation per step and rank, rank 17 late
by 3.4 s on an NVMe timeout in step 80042. Measures, in a fresh process each time (median of the
repetitions): `recorder cluster explain FOLDER --json` over the SQLite files, and over a Parquet
export of the same recordings (`recorder export --parquet`), wall time and peak memory (RSS); and
checks the answer (rank 17, node-02, nvme_timeout, save_checkpoint() at train.py:212). Needs no root.

    .venv/bin/python benchmarks/bench_cluster.py [--nodes 64] [--ranks 8] [--steps 1000] [--reps 3]
                                                 [--dir /tmp/bench_cluster] [--reuse] [--json]

Target: under 10 s for 64 nodes x 8 ranks x 1,000 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recorder.cluster_demo import FIRST_STEP, ClusterSpec, write_cluster  # noqa: E402

TARGET_S = 10.0
RUN = ("import json, resource, sys, time\n"
       "t = time.perf_counter()\n"
       "from store.cluster import explain_paths\n"
       "r = explain_paths(sys.argv[1:])\n"
       "print(json.dumps({'s': time.perf_counter() - t, 'rss_kib': resource.getrusage(resource.RUSAGE_SELF)"
       ".ru_maxrss, 'late': [(x['rank'], x['node'], x['explanation']['kind'], x['explanation']['python'])"
       " for x in r['late_ranks']], 'step': r['step'], 'residual_ns': r['clock']['residual_skew_ns']}))\n")


def measure(paths: list[str], reps: int) -> dict:
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run([sys.executable, "-c", RUN, *paths], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if res.returncode:
            raise SystemExit(res.stderr)
        out = json.loads(res.stdout)
        out["wall_s"] = wall
        out["cpu_s"] = cpu
        out["load"] = os.getloadavg()[0]
        runs.append(out)
    ok = runs[0]["late"] == [[17, "node-02", "nvme_timeout", "save_checkpoint() at train.py:212"]] \
        and runs[0]["step"] == 80_042
    return {"explain_s": statistics.median(r["s"] for r in runs),
            "process_wall_s": statistics.median(r["wall_s"] for r in runs),
            "process_cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "load_average": max(r["load"] for r in runs),
            "peak_rss_mib": max(r["rss_kib"] for r in runs) / 1024, "residual_skew_ns": runs[0]["residual_ns"],
            "answer_ok": ok, "late": runs[0]["late"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_cluster"))
    ap.add_argument("--reuse", action="store_true", help="measure recordings written by an earlier run")
    ap.add_argument("-j", "--json", action="store_true")
    args = ap.parse_args(argv)
    dbs, pq = args.dir / "nodes", args.dir / "parquet"
    build = {}
    if not args.reuse or not dbs.is_dir():
        shutil.rmtree(args.dir, ignore_errors=True)
        t = time.perf_counter()
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks, steps=args.steps,
                           stall_step=min(80_042, FIRST_STEP + args.steps - 1))
        write_cluster(dbs, spec)
        build["write_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for db in sorted(dbs.glob("*.db")):
            subprocess.run([sys.executable, "-m", "recorder", "export", "--parquet", str(pq), "--db", str(db)],
                           check=True, capture_output=True, cwd=ROOT)
        build["export_s"] = time.perf_counter() - t
    size = sum(p.stat().st_size for p in dbs.glob("*.db"))
    pq_size = sum(p.stat().st_size for p in pq.rglob("*.parquet"))
    rows = args.nodes * args.ranks * args.steps
    result = {"nodes": args.nodes, "ranks": args.nodes * args.ranks, "steps": args.steps,
              "rank_steps": rows, "sqlite_mib": size / 2**20, "parquet_mib": pq_size / 2**20, **build,
              "sqlite": measure([str(dbs)], args.reps), "parquet": measure([str(pq)], args.reps)}
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["bench_rss_mib"] = self_rss / 1024
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.nodes} nodes x {args.ranks} ranks x {args.steps} steps ({rows:,} rank-steps; "
              f"SQLite {result['sqlite_mib']:.0f} MiB, Parquet {result['parquet_mib']:.0f} MiB)")
        if build:
            print(f"written in {build['write_s']:.1f} s, exported to Parquet in {build['export_s']:.1f} s")
        print("| input | cluster explain (wall) | process wall | process CPU | peak RSS | residual skew | load avg |"
              " answer |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for name in ("sqlite", "parquet"):
            m = result[name]
            print(f"| {name} | {m['explain_s']:.2f} s | {m['process_wall_s']:.2f} s | {m['process_cpu_s']:.2f} s |"
                  f" {m['peak_rss_mib']:.0f} MiB | {m['residual_skew_ns'] / 1e3:.0f} us | {m['load_average']:.1f} |"
                  f" {'ok' if m['answer_ok'] else m['late']} |")
        print(f"target: < {TARGET_S:.0f} s for 64 nodes x 8 ranks x 1,000 steps")
    return 0 if result["sqlite"]["answer_ok"] and result["parquet"]["answer_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
