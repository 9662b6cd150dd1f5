"""What the recorder costs a real PyTorch job on a real GPU, untraced and traced interleaved.

The job (benchmarks/gpu_job.py): a 170M-parameter transformer LM in bf16 autocast, fused AdamW,
DDP over NCCL (world size 1), a DataLoader with 4 workers and pinned memory, a loss all-reduce and
`.item()` per step (~30 ms and ~550 kernel launches a step on one H200), then --graphs replays of a
captured CUDA graph. Each pair runs it untraced and under `recorder record` (every layer), the order
alternating, and reports medians over the pairs of:
- the median and p95 step (steps 30 on) traced / untraced, pair by pair;
- the recorder process's CPU over the training loop (from step 30 to the end), as a share of a core;
- the kernel's BPF run time of the CUDA programs (entries, returns, stack walks) per CUDA row of the
  loop, and per second of it (kernel.bpf_stats_enabled);
- CUDA calls kept (rows) and dropped (`loss`), the launches among them, and the graph replays
  recorded against those the job made.
It prints the GPU, driver and CUDA versions it ran on, for docs/benchmarks.md.

It says why it skips: not root (BPF), no PyTorch, or no CUDA device. `--cpu` runs the same job on
the CPU (small shapes, gloo) to check the benchmark itself where there is no GPU: its figures are
not a GPU job's.

    sudo .venv/bin/python benchmarks/bench_gpu_job.py                      # 3 pairs x 300 steps
    sudo .venv/bin/python benchmarks/bench_gpu_job.py -r 3 --steps 300 --graphs 500 --json
    sudo .venv/bin/python benchmarks/bench_gpu_job.py --cpu -r 1 --steps 60   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_training_job import run_watched  # noqa: E402

JOB = ROOT / "benchmarks" / "gpu_job.py"
RECORDER = [sys.executable, "-m", "recorder"]
TARGETS = {"median_step_ratio": 1.02, "recorder_core_share": 0.15, "cuda_dropped": 0}
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")


def skip_reason(cpu: bool) -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF uprobes and tracepoints)"
    probe = "import torch; print(torch.cuda.is_available() and torch.cuda.device_count())"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return "needs PyTorch in this interpreter (pip install torch)"
    if not cpu and res.stdout.strip() in ("False", "0"):
        return "needs a CUDA GPU (torch.cuda.is_available() is False here); --cpu checks the benchmark itself"
    return None


def device_versions(cpu: bool) -> dict:
    """The GPU, driver and CUDA the figures come from."""
    out: dict = {"torch": None, "cuda": None, "gpu": None, "driver": None}
    res = subprocess.run([sys.executable, "-c", "import torch, json; print(json.dumps([torch.__version__, "
                          "torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() "
                          "else None]))"], capture_output=True, text=True)
    if res.returncode == 0:
        out["torch"], out["cuda"], out["gpu"] = json.loads(res.stdout.strip().splitlines()[-1])
    if not cpu:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        if smi.returncode == 0 and smi.stdout.strip():
            out["gpu"], out["driver"] = (x.strip() for x in smi.stdout.strip().splitlines()[0].split(",", 1))
    return out


def run_job(traced: bool, workdir: Path, label: str, steps: int, graphs: int, cpu: bool) -> dict:
    out = workdir / f"{label}.json"
    marks = workdir / "marks"
    marks.mkdir(exist_ok=True)
    started, done = marks / f"started_{label}", marks / f"done_{label}"
    for f in (out, started, done):
        f.unlink(missing_ok=True)
    job = [sys.executable, str(JOB), "--steps", str(steps), "--out", str(out), "--mark", f"{marks}/{label}",
           "--graphs", str(graphs), "--ckpt-dir", str(workdir / "ckpt")] + (
              ["--cpu", "--layers", "2", "--workers", "2"] if cpu else [])
    db = workdir / f"{label}.db"
    cmd = RECORDER + ["record", "--db", str(db), "--"] + job if traced else job
    returncode, _, err, seen = run_watched(cmd, traced, started, done)
    if returncode != 0 or not out.exists():
        raise RuntimeError(f"{label} failed ({returncode}): {err.strip()[-3000:]}")
    truth = json.loads(out.read_text())
    result = {"label": label, "traced": traced, "median_ms": truth["median_ms"], "p95_ms": truth["p95_ms"],
              "graph_replays": (truth.get("graphs") or {}).get("replays", 0)}
    if not traced:
        return result
    if "bpf1" not in seen:
        raise RuntimeError(f"{label}: the recorder ended before the training loop did")
    wall_s = (seen["t1"] - seen["t0"]) / 1e9
    result["recorder_core_share"] = (seen["cpu1"] - seen["cpu0"]) / wall_s
    bpf_ns = 0
    for name, p in seen["bpf1"].items():
        if name.startswith("cuda_"):
            bpf_ns += p["run_time_ns"] - seen["bpf0"].get(name, {"run_time_ns": 0})["run_time_ns"]
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = dict(con.execute("SELECT a.name, count(*) FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
                                " GROUP BY 1").fetchall())
        in_loop = con.execute("SELECT count(*) FROM cuda_call WHERE ts BETWEEN ? AND ?",
                              (seen["t0"], seen["t1"])).fetchone()[0]
        losses = dict(con.execute("SELECT probe, sum(dropped) FROM loss GROUP BY probe").fetchall())
        route = con.execute("SELECT detail FROM capability WHERE layer = 'cuda' AND probe = 'launch probes'"
                            ).fetchone()
    finally:
        con.close()
    result.update({
        "rows": sum(rows.values()), "rows_by_api": rows, "losses": losses,
        "cuda_dropped": sum(n for probe, n in losses.items() if "cuda" in probe),
        "launches": sum(rows.get(api, 0) for api in LAUNCH_APIS),
        "graph_rows": sum(rows.get(api, 0) for api in GRAPH_APIS),
        "cuda_rows_per_s": in_loop / wall_s,
        "bpf_ns_per_cuda_row": bpf_ns / max(1, in_loop),
        "bpf_ms_per_s": bpf_ns / 1e6 / wall_s,
        "launch_probes": route[0] if route else "runtime and driver",
    })
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--reps", type=int, default=3, help="untraced/traced pairs (default 3)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--graphs", type=int, default=200, help="CUDA graph replays after the steps")
    ap.add_argument("--cpu", action="store_true", help="dry run of the benchmark on the CPU (no GPU figures)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    reason = skip_reason(args.cpu)
    if reason:
        print(json.dumps({"skipped": reason}) if args.json else f"bench_gpu_job: skipped: {reason}")
        return 0
    subprocess.run(["sysctl", "-q", "-w", "kernel.bpf_stats_enabled=1"], check=False)
    versions = device_versions(args.cpu)
    graphs = 0 if args.cpu else args.graphs
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-job-") as tmp:
        for rep in range(args.reps):
            for traced in ((False, True) if rep % 2 == 0 else (True, False)):
                label = f"{'t' if traced else 'u'}{rep}"
                runs.append(run_job(traced, Path(tmp), label, args.steps, graphs, args.cpu))
                r = runs[-1]
                if not args.json:
                    extra = (f", recorder {r['recorder_core_share']:.1%} of a core, {r['rows']:,} CUDA rows "
                             f"({r['launches']:,} launches), {r['cuda_dropped']:,} dropped, "
                             f"BPF {r['bpf_ns_per_cuda_row']:,.0f} ns per row" if traced else "")
                    print(f"{label}: median step {r['median_ms']:.2f} ms, p95 {r['p95_ms']:.2f} ms{extra}", flush=True)
    untraced = [r for r in runs if not r["traced"]]
    traced = [r for r in runs if r["traced"]]
    med = statistics.median
    pairs = list(zip(untraced, traced, strict=True))
    summary = {
        "versions": versions, "cpu_dry_run": args.cpu, "reps": args.reps, "steps": args.steps,
        "median_step_ratio": med(t["median_ms"] / u["median_ms"] for u, t in pairs),
        "p95_step_ratio": med(t["p95_ms"] / u["p95_ms"] for u, t in pairs),
        "recorder_core_share": med(r["recorder_core_share"] for r in traced),
        "bpf_ns_per_cuda_row": med(r["bpf_ns_per_cuda_row"] for r in traced),
        "bpf_ms_per_s": med(r["bpf_ms_per_s"] for r in traced),
        "cuda_rows_per_s": med(r["cuda_rows_per_s"] for r in traced),
        "cuda_dropped": sum(r["cuda_dropped"] for r in traced),
        "graph_replays": sum(r["graph_replays"] for r in traced),
        "graph_rows": sum(r["graph_rows"] for r in traced),
        "launch_probes": traced[-1]["launch_probes"],
        "rows_by_api": traced[-1]["rows_by_api"], "losses": traced[-1]["losses"],
    }
    summary["targets_met"] = {key: summary[key] <= target for key, target in TARGETS.items()}
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary}, indent=1))
        return 0
    print(f"\n{versions}{' (CPU dry run: not GPU figures)' if args.cpu else ''}\n")
    print("| figure | value | target |")
    print("|---|---:|---:|")
    for key in ("median_step_ratio", "p95_step_ratio", "recorder_core_share", "bpf_ns_per_cuda_row", "bpf_ms_per_s",
                "cuda_rows_per_s", "cuda_dropped", "graph_replays", "graph_rows"):
        v = summary[key]
        print(f"| {key} | {v:,.3f} | {TARGETS.get(key, '')} |" if isinstance(v, float) else
              f"| {key} | {v:,} | {TARGETS.get(key, '')} |")
    print(f"\nlaunch probes: {summary['launch_probes']}")
    print(f"rows by API (last traced run): {summary['rows_by_api']}")
    print(f"losses (last traced run): {summary['losses']}")
    print(f"targets met: {summary['targets_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
