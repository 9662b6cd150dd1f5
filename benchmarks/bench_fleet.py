"""The fleet at 64 and 512 nodes: `recorder export --parquet` with the causal model's answers on every
node, then `recorder cluster explain` over the Parquet alone (the recordings moved away, so the late
rank is explained from the answers its node exported). Synthetic nodes of recorder/cluster_demo.py:
8 ranks and 60 steps each, rank 17 late by 3.4 s on an NVMe timeout in step 80042.

Measures: the export per node (the same code a node runs; the nodes exported by a pool of one
process per core, as many nodes export at once), its answers' share, the export's size, and
`cluster explain` over the whole folder in a fresh process: wall time and peak memory (RSS). Checks
the answer (rank 17, node-02, nvme_timeout, save_checkpoint() at train.py:212). Needs no root.

    .venv/bin/python benchmarks/bench_fleet.py [--nodes 64 512] [--dir /tmp/bench_fleet] [--json]
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
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recorder.cluster_demo import ClusterSpec, write_cluster  # noqa: E402

LINE = "save_checkpoint() at train.py:212"
RUN = ("import json, resource, sys, time\n"
       "t = time.perf_counter()\n"
       "from store.cluster import explain_paths\n"
       "r = explain_paths(sys.argv[1:])\n"
       "print(json.dumps({'s': time.perf_counter() - t, 'rss_kib': resource.getrusage(resource.RUSAGE_SELF)"
       ".ru_maxrss, 'late': [(x['rank'], x['node'], x['explanation'].get('kind'), x['explanation'].get('python'))"
       " for x in r['late_ranks']]}))\n")


def _export(args: tuple[list[str], str]) -> dict:
    from store.exports.parquet import export_parquet

    dbs, out = args
    times, answers = [], []
    for db in dbs:
        t = time.perf_counter()
        r = export_parquet(db, out)
        times.append(time.perf_counter() - t)
        answers.append(sum(a["seconds"] for a in r["answers"].values()))
    return {"times": times, "answers": answers, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def run(nodes: int, folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    dbs, pq = folder / "nodes", folder / "parquet"
    t = time.perf_counter()
    write_cluster(dbs, ClusterSpec(nodes=nodes))
    write_s = time.perf_counter() - t
    files = sorted(str(p) for p in dbs.glob("*.db"))
    workers = max(1, os.cpu_count() or 1)
    t = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        parts = list(pool.map(_export, [(files[i::workers], str(pq)) for i in range(workers)]))
    export_wall = time.perf_counter() - t
    times = [x for p in parts for x in p["times"]]
    answers = [x for p in parts for x in p["answers"]]
    dbs.rename(folder / "away")  # the recordings are not where the export says: the answers must do
    res = subprocess.run([sys.executable, "-c", RUN, str(pq)], capture_output=True, text=True, cwd=ROOT, check=True)
    explain = json.loads(res.stdout)
    ok = explain["late"] == [[17, "node-02", "nvme_timeout", LINE]]
    return {"nodes": nodes, "ranks": nodes * 8, "write_s": round(write_s, 1), "export_workers": workers,
            "export_wall_s": round(export_wall, 1), "export_node_median_s": round(statistics.median(times), 3),
            "export_node_max_s": round(max(times), 3), "answers_node_median_s": round(statistics.median(answers), 3),
            "export_rss_mib": round(max(p["rss_kib"] for p in parts) / 1024),
            "parquet_mib": round(sum(p.stat().st_size for p in pq.rglob("*.parquet")) / 2**20, 1),
            "explain_s": round(explain["s"], 2), "explain_rss_mib": round(explain["rss_kib"] / 1024), "ok": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_fleet"))
    ap.add_argument("-j", "--json", action="store_true")
    args = ap.parse_args(argv)
    results = [run(n, args.dir / f"n{n}") for n in args.nodes]
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print("| nodes | ranks | export per node (median / max) | of which answers | export, all nodes "
              "(wall, workers) | export peak RSS | Parquet | cluster explain over Parquet | its peak RSS | answer |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['nodes']} | {r['ranks']} | {r['export_node_median_s']:.2f} s / {r['export_node_max_s']:.2f} s "
                  f"| {r['answers_node_median_s']:.2f} s | {r['export_wall_s']:.0f} s, {r['export_workers']} "
                  f"| {r['export_rss_mib']} MiB | {r['parquet_mib']} MiB | {r['explain_s']:.1f} s "
                  f"| {r['explain_rss_mib']} MiB | {'rank 17, node-02, nvme_timeout, line' if r['ok'] else 'WRONG'} |")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
