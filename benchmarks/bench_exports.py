"""Time and peak memory of the three exports on a synthetic session written through the store (the
session of bench_explain.py: N cudaMalloc calls, an off-CPU interval per call, one slow call in
10,007 behind a hog). Each export runs in a fresh process, as the CLI does. Needs no root.

    .venv/bin/python benchmarks/bench_exports.py [N ...] [--json]      # default N = 20000 100000
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_explain import build  # noqa: E402

EXPORTS = {
    "perfetto, whole session": ["export", "--perfetto", "{out}.pftrace"],
    "perfetto, a 1 s window": ["export", "--perfetto", "{out}.pftrace", "--window", "10..11"],
    "html report": ["report", "--html", "{out}.html"],
    "datasette metadata": ["export", "--datasette-metadata", "{out}.json"],
}
# the CLI in a child that reports its own peak RSS when done
CHILD = ("import resource, sys; from recorder.cli import main; code = main(sys.argv[1:]); "
         "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)")


def run(db: str, out: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-c", CHILD, *[a.format(out=out) for a in args], "--db", db]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {r.stderr.strip()}")
    rss = next(int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("RSS"))
    size = Path(args[2].format(out=out)).stat().st_size
    return {"seconds": round(wall, 2), "peak_rss_mb": round(rss / 1024), "file_mb": round(size / 1e6, 2)}


def main() -> int:
    as_json = "--json" in sys.argv
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or [20_000, 100_000]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            db = f"{tmp}/bench_exports_{n}.db"
            build(n, db)
            results[str(n)] = {name: run(db, f"{tmp}/out", args) for name, args in EXPORTS.items()}
    if as_json:
        print(json.dumps(results, indent=1))
        return 0
    print("| CUDA calls | export | time | peak RSS | file |\n|---:|---|---:|---:|---:|")
    for n, rows in results.items():
        for name, r in rows.items():
            print(f"| {int(n):,} | {name} | {r['seconds']} s | {r['peak_rss_mb']} MB | {r['file_mb']} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
