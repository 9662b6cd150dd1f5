"""How long a recording takes to stop: `recorder start -p PID` then `recorder stop` of an idle
recording, and `recorder record -- /bin/true` from start to end, each timed from the command's start
to its exit (wall seconds).

With --compare DIR (another checkout of the repository, e.g. `git archive main | tar -x -C
/tmp/main`, with its C extensions built or copied in) the same runs of that checkout are interleaved
with ours, run by run, so both see the same machine load; the medians are printed per checkout.

    sudo .venv/bin/python benchmarks/bench_stop.py
    sudo .venv/bin/python benchmarks/bench_stop.py --repeat 5 --compare /tmp/main --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLEEPER = "import time\nwhile True:\n    time.sleep(0.002)\n"


def _recorder(checkout: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "recorder", *args], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t
    if res.returncode != 0:
        raise SystemExit(f"recorder {' '.join(args)} in {checkout} failed: {res.stderr.strip()}")
    return took, res


def one_run(checkout: Path, folder: Path, idle_s: float) -> dict[str, float]:
    """start -p, `idle_s` of recording an idle process, stop; then record -- /bin/true."""
    sleeper = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        db = folder / f"stop-{time.monotonic_ns()}.db"
        start_s, _ = _recorder(checkout, "start", "--db", str(db), "-p", str(sleeper.pid))
        time.sleep(idle_s)
        stop_s, _ = _recorder(checkout, "stop", "--db", str(db))
    finally:
        sleeper.kill()
        sleeper.wait()
    record_s, _ = _recorder(checkout, "record", "--db", str(folder / f"true-{time.monotonic_ns()}.db"),
                            "--", "/bin/true")
    return {"start_s": start_s, "stop_s": stop_s, "record_true_s": record_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--repeat", type=int, default=3, help="runs of each checkout (default 3)")
    ap.add_argument("--idle", type=float, default=2.0, help="seconds recorded before the stop (default 2)")
    ap.add_argument("--compare", type=Path, help="another checkout, run interleaved with this one")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_stop: needs root (it records): run it with sudo")
    checkouts = {"this": ROOT}
    if args.compare:
        checkouts["compare"] = args.compare.resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as tmp:
        for i in range(args.repeat):
            for name, checkout in checkouts.items():
                runs[name].append(one_run(checkout, Path(tmp), args.idle))
                if not args.json:
                    print(f"run {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()),
                          flush=True)
    medians = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for name, rs in runs.items()}
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"medians": medians, "runs": runs, "loadavg_1m": load}, indent=1))
        return 0
    print(f"medians of {args.repeat} runs (load average {load:.1f}):")
    for name, m in medians.items():
        print(f"  {name:8s} " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
