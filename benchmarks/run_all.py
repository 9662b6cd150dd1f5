"""Runs every benchmark of the recorder (what `make bench` runs) and prints their tables.

    .venv/bin/python benchmarks/run_all.py            # all, markdown tables
    .venv/bin/python benchmarks/run_all.py --quick    # fewer repetitions and rates
    .venv/bin/python benchmarks/run_all.py --json     # one JSON object keyed by benchmark

The recording benchmarks (bench_cuda_call, bench_ingest, bench_block_tracing) need root and are
reported as skipped otherwise; bench_kmsg and bench_pystack run as any user. Exit status is non-zero
when a benchmark failed its own checks (rows missing, drops where none are allowed), not when a
target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_ingest  # noqa: E402

import bench_cuda_call  # noqa: E402


def _python_bench(name: str, args: list[str], as_json: bool) -> tuple[int, str]:
    """Run a module's main() in-process, capturing what it prints."""
    module = {"bench_cuda_call": bench_cuda_call, "bench_ingest": bench_ingest}[name]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = module.main(args + (["--json"] if as_json else []))
    return code, out.getvalue().strip()


# other benchmarks, run as scripts: name -> whether it has --json
SCRIPTS = {"bench_kmsg": True, "bench_pystack": False, "bench_markers": True, "bench_block_tracing": True,
           "bench_step_explain": False, "bench_offcpu_stack": True, "bench_symbols": True,
           "bench_exports": True, "bench_cluster": True, "bench_training_job": True, "bench_dlopen_hold": True,
           "bench_wait_chain": False, "bench_standin_gpu": True, "bench_gpu_job": True,
           "bench_causal_sql": True, "bench_fleet": True, "bench_import": True, "bench_old_recording": False,
           "bench_stop": True, "bench_probe_placement": True}


def _script_bench(name: str, as_json: bool) -> tuple[int, str]:
    script = HERE / f"{name}.py"
    if not script.exists():
        return 0, json.dumps({"skipped": "not present"}) if as_json else f"{name}: not present"
    cmd = [sys.executable, str(script)] + (["--json"] if as_json and SCRIPTS[name] else [])
    result = subprocess.run(cmd, capture_output=True, text=True)
    text = result.stdout.strip() or result.stderr.strip()
    return result.returncode, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and rates")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    quick_args = {
        "bench_cuda_call": ["-r", "5"] if args.quick else [],
        "bench_ingest": ["--rates", "25000,0", "--seconds", "2", "--reps", "3"] if args.quick
        else [],
    }
    status = 0
    collected: dict[str, object] = {}
    for name in ("bench_cuda_call", "bench_ingest"):
        code, text = _python_bench(name, quick_args[name], args.json)
        status |= code
        collected[name] = json.loads(text) if args.json else text
        if not args.json:
            print(text + "\n", flush=True)
    for name in SCRIPTS:
        code, text = _script_bench(name, args.json)
        status |= code
        if args.json:
            try:
                collected[name] = json.loads(text)
            except ValueError:
                collected[name] = {"output": text}
        else:
            print(f"### {name}\n\n```\n{text}\n```\n", flush=True)
    if args.json:
        print(json.dumps(collected))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
