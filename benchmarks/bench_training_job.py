"""What the recorder costs a real training job: a PyTorch CPU training loop run untraced and under
`recorder record`, interleaved, on this machine.

The job (benchmarks/training_job.py) is what a user would leave the recorder running on: a small
CNN fed by a DataLoader with persistent worker processes, torch's intra-op threads, a `torch.save`
checkpoint every 50 steps and ~30 stand-in CUDA calls per step. It makes thousands of context
switches a second, which is where a recorder's cost lies, not in the per-call figures of the
stand-ins.

Three modes run in each repetition, their order rotating so that machine drift hits all alike:
- untraced: the job alone;
- traced: the job under `recorder record` (every layer the recorder has);
- traced+markers: the same with `recorder.step(n)` called at every step.

For each mode it reports medians over the repetitions of:
- the job's median and p95 step time (the first 10% of steps are warm-up and left out) and its CPU
  time (the process and its reaped DataLoader workers), with their ratios to untraced;
- the job's context switches per second (voluntary and involuntary, all its threads);
- the recorder's own CPU share: the CPU time of the `recorder record` process (all its threads, not
  the job) over the training loop, as a fraction of one core (its start, BPF compile included, is
  left out: it is paid once per session);
- the kernel's run time of each of the recorder's BPF programs (kernel.bpf_stats_enabled; the
  programs whose fds the recorder holds, read at the end of the loop while they are still loaded):
  runs per second, ns per run and BPF time per second of job;
- rows and bytes the recorder wrote per second, and drops (the `loss` table);
- how much CPU the recorder itself took from the job's threads: off-CPU intervals of the job whose
  contender is the recorder process, and the time the recorder ran while they waited.

Needs root (BPF) and PyTorch (`pip install torch==2.13.0`); reports `skipped` without either.

    sudo .venv/bin/python benchmarks/bench_training_job.py                 # 3 repetitions, 400 steps
    sudo .venv/bin/python benchmarks/bench_training_job.py -r 5 --steps 600 --json
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "native"))

JOB = ROOT / "benchmarks" / "training_job.py"
RECORDER = [sys.executable, "-m", "recorder"]
MODES = ("untraced", "traced", "traced+markers")

# What an operator can leave on: targets this benchmark reports as met or not.
TARGETS = {
    "median_step_ratio": 1.02,   # traced / untraced median step time
    "cpu_ratio": 1.03,           # traced / untraced CPU time of the job
    "recorder_core_share": 0.15,  # recorder process CPU, fraction of one core
    "sched_switch_ns_per_run": 600,
}


def _percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _bpf_programs(pid: int) -> dict[str, dict]:
    """Run counts and times of the BPF programs process `pid` holds (its fds), summed by name."""
    ids = set()
    for fdinfo in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            for line in fdinfo.read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
        except (OSError, ValueError):
            continue
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    programs: dict[str, dict] = {}
    for p in json.loads(out or "[]"):
        if p["id"] in ids:
            entry = programs.setdefault(p.get("name", str(p["id"])), {"runs": 0, "run_time_ns": 0})
            entry["runs"] += p.get("run_cnt", 0)
            entry["run_time_ns"] += p.get("run_time_ns", 0)
    return programs


def _cpu_seconds(pid: int) -> float:
    """CPU time so far of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_watched(cmd: list[str], traced: bool, started: Path, done: Path) -> tuple[int, str, str, dict]:
    """Run `cmd` (the recorder around a job, or the job alone) to its end: its exit status, its
    stdout and stderr, and its pid and, when traced, the recorder's CPU seconds, CLOCK_MONOTONIC ns
    and BPF programs at the moments the job writes `started` and then `done` (cpu0, t0, bpf0,
    cpu1, t1, bpf1)."""
    seen: dict = {}

    def watch() -> None:
        while proc.poll() is None and not started.exists():
            time.sleep(0.01)
        try:
            seen.update(cpu0=_cpu_seconds(proc.pid), t0=time.monotonic_ns(), bpf0=_bpf_programs(proc.pid))
            while proc.poll() is None and not done.exists():
                time.sleep(0.01)
            seen.update(cpu1=_cpu_seconds(proc.pid), t1=time.monotonic_ns(), bpf1=_bpf_programs(proc.pid))
        except OSError:  # it ended first: the caller finds the figures missing
            pass

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen["pid"] = proc.pid
    watcher = threading.Thread(target=watch, daemon=True)
    if traced:
        watcher.start()
    out, err = proc.communicate()
    if traced:
        watcher.join()
    return proc.returncode, out, err, seen


def _db_figures(db: Path, recorder_pid: int) -> dict:
    """Rows per table, drops, and how much the recorder process contended with the job's threads."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        rows = {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        dropped = con.execute("SELECT coalesce(sum(dropped), 0) FROM loss").fetchone()[0]
        losses = dict(con.execute("SELECT probe, sum(dropped) FROM loss GROUP BY probe").fetchall())
        contended = con.execute(
            """SELECT count(*), coalesce(sum(o.contender_run_dur), 0)
               FROM offcpu_interval o
               JOIN thread c ON c.id = o.contender_thread_id
               JOIN process p ON p.id = c.process_id
               WHERE p.pid = ?""", (recorder_pid,)).fetchone()
        identities = con.execute("SELECT count(*) FROM thread WHERE traced = 1").fetchone()[0]
        all_identities = con.execute("SELECT count(*) FROM thread").fetchone()[0]
    finally:
        con.close()
    return {"rows": rows, "dropped": dropped, "losses": losses, "recorder_contended_intervals": contended[0],
            "recorder_contended_ms": contended[1] / 1e6, "traced_thread_identities": identities,
            "thread_identities": all_identities}


def run_job(mode: str, libdir: Path, steps: int, workdir: Path) -> dict:
    started, done = workdir / f"started-{mode}", workdir / f"done-{mode}"
    started.unlink(missing_ok=True)
    done.unlink(missing_ok=True)
    job = [sys.executable, str(JOB), "--libdir", str(libdir), "--steps", str(steps),
           "--started-file", str(started), "--done-file", str(done), "--linger", "1.0"]
    if mode == "traced+markers":
        job.append("--markers")
    db = workdir / f"{mode}.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    traced = mode != "untraced"
    cmd = (RECORDER + ["record", "--db", str(db), "--cuda-lib", str(libdir / "libcudart.so.12"), "--"] + job
           if traced else job)
    returncode, out, err, seen = run_watched(cmd, traced, started, done)
    if returncode != 0:
        raise RuntimeError(f"{mode} run failed ({returncode}): {err.strip()[-2000:]}")
    job_line = [line for line in out.splitlines() if line.startswith('{"step_ns"')]
    if not job_line:
        raise RuntimeError(f"{mode} run printed no result: {out[-2000:]} {err[-2000:]}")
    job_result = json.loads(job_line[-1])
    result = {"mode": mode, **{k: job_result[k] for k in ("cpu_s", "wall_s", "cuda_calls", "threads", "workers",
                                                           "ctx_switches")}}
    warm = len(job_result["step_ns"]) // 10
    steps_ns = job_result["step_ns"][warm:]
    result["median_step_ms"] = statistics.median(steps_ns) / 1e6
    result["p95_step_ms"] = _percentile(steps_ns, 0.95) / 1e6
    result["ctx_switches_per_s"] = job_result["ctx_switches"] / job_result["wall_s"]
    if traced:
        if "bpf1" not in seen:
            raise RuntimeError(f"{mode}: the recorder ended before the training loop did")
        result["bpf"] = seen["bpf1"]
        # the recorder's own process (its threads; the job is a child and not in its /proc stat)
        result["recorder_core_share"] = (seen["cpu1"] - seen["cpu0"]) / ((seen["t1"] - seen["t0"]) / 1e9)
        result["db_bytes"] = sum(Path(f"{db}{s}").stat().st_size for s in ("", "-wal", "-shm")
                                 if Path(f"{db}{s}").exists())
        result.update(_db_figures(db, seen["pid"]))
    return result


def summarise(runs: list[dict]) -> dict:
    by_mode: dict[str, list[dict]] = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    summary: dict[str, dict] = {}
    base = by_mode["untraced"]
    for mode, rs in by_mode.items():
        if not rs:
            continue
        med = statistics.median
        s = {
            "reps": len(rs),
            "median_step_ms": med(r["median_step_ms"] for r in rs),
            "p95_step_ms": med(r["p95_step_ms"] for r in rs),
            "cpu_s": med(r["cpu_s"] for r in rs),
            "wall_s": med(r["wall_s"] for r in rs),
            "ctx_switches_per_s": med(r["ctx_switches_per_s"] for r in rs),
            "cuda_calls_per_s": med(r["cuda_calls"] / r["wall_s"] for r in rs),
        }
        if base and mode != "untraced":
            # ratios per repetition against the untraced run of the same repetition, then the median
            pairs = list(zip(base, rs, strict=False))
            s["median_step_ratio"] = med(t["median_step_ms"] / u["median_step_ms"] for u, t in pairs)
            s["p95_step_ratio"] = med(t["p95_step_ms"] / u["p95_step_ms"] for u, t in pairs)
            s["cpu_ratio"] = med(t["cpu_s"] / u["cpu_s"] for u, t in pairs)
        if mode != "untraced":
            s["recorder_core_share"] = med(r["recorder_core_share"] for r in rs)
            s["rows_per_s"] = med(sum(r["rows"].values()) / r["wall_s"] for r in rs)
            s["bytes_per_s"] = med(r["db_bytes"] / r["wall_s"] for r in rs)
            s["dropped"] = max(r["dropped"] for r in rs)
            s["offcpu_rows_per_s"] = med(r["rows"].get("offcpu_interval", 0) / r["wall_s"] for r in rs)
            s["traced_thread_identities"] = med(r["traced_thread_identities"] for r in rs)
            s["thread_identities"] = med(r["thread_identities"] for r in rs)
            s["recorder_contended_ms_per_s"] = med(r["recorder_contended_ms"] / r["wall_s"] for r in rs)
            programs: dict[str, dict] = {}
            for name in {n for r in rs for n in r["bpf"]}:
                per_run = [r["bpf"][name]["run_time_ns"] / r["bpf"][name]["runs"]
                           for r in rs if r["bpf"].get(name, {}).get("runs")]
                if not per_run:
                    continue
                programs[name] = {
                    "ns_per_run": med(per_run),
                    "runs_per_s": med(r["bpf"].get(name, {}).get("runs", 0) / r["wall_s"] for r in rs),
                    "bpf_ms_per_s": med(r["bpf"].get(name, {}).get("run_time_ns", 0) / 1e6 / r["wall_s"]
                                        for r in rs),
                }
            s["bpf"] = dict(sorted(programs.items(), key=lambda kv: -kv[1]["bpf_ms_per_s"]))
        summary[mode] = s
    return summary


def _sched_switch_ns(s: dict) -> float | None:
    for name, p in s.get("bpf", {}).items():
        if "sched_switch" in name:
            return p["ns_per_run"]
    return None


def render(summary: dict, meta: dict) -> str:
    lines = [f"Training job: {meta['steps']} steps x {meta['reps']} repetitions, modes interleaved; "
             f"load average before {meta['load_before']}, after {meta['load_after']}", ""]
    lines.append("| mode | median step ms | p95 step ms | job CPU s | step ratio | p95 ratio | CPU ratio "
                 "| ctx switches/s | CUDA calls/s | recorder core share | rows/s | KiB/s | drops |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    columns = [("median_step_ms", "{:.2f}"), ("p95_step_ms", "{:.2f}"), ("cpu_s", "{:.1f}"),
               ("median_step_ratio", "{:.3f}"), ("p95_step_ratio", "{:.3f}"), ("cpu_ratio", "{:.3f}"),
               ("ctx_switches_per_s", "{:,.0f}"), ("cuda_calls_per_s", "{:,.0f}"),
               ("recorder_core_share", "{:.1%}"), ("rows_per_s", "{:,.0f}"), ("kib_per_s", "{:,.0f}"),
               ("dropped", "{}")]
    for mode, s in summary.items():
        values = dict(s, kib_per_s=s["bytes_per_s"] / 1024) if "bytes_per_s" in s else s
        cells = [fmt.format(values[key]) if key in values else "-" for key, fmt in columns]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    for mode, s in summary.items():
        if "bpf" not in s:
            continue
        lines += ["", f"BPF programs, {mode} (kernel.bpf_stats_enabled; medians over repetitions):", "",
                  "| program | runs/s | ns/run | BPF ms per s |", "|---|---:|---:|---:|"]
        for name, p in s["bpf"].items():
            lines.append(f"| {name} | {p['runs_per_s']:,.0f} | {p['ns_per_run']:,.0f} | {p['bpf_ms_per_s']:.2f} |")
        lines += ["", f"{mode}: {s['traced_thread_identities']:.0f} thread identities of the job "
                  f"({s['thread_identities']:.0f} with the other tasks seen); the recorder was "
                  f"the contender of the job's threads for {s['recorder_contended_ms_per_s']:.1f} ms per second"]
    traced = summary.get("traced")
    if traced:
        lines += ["", "Targets (traced mode):"]
        checks = [("median step ratio", traced.get("median_step_ratio"), TARGETS["median_step_ratio"]),
                  ("job CPU ratio", traced.get("cpu_ratio"), TARGETS["cpu_ratio"]),
                  ("recorder core share", traced.get("recorder_core_share"), TARGETS["recorder_core_share"]),
                  ("sched_switch ns/run", _sched_switch_ns(traced), TARGETS["sched_switch_ns_per_run"]),
                  ("drops", traced.get("dropped"), 0)]
        for name, value, target in checks:
            verdict = "n/a" if value is None else ("met" if value <= target else "NOT met")
            lines.append(f"- {name}: {value if value is None else round(value, 3)} (target <= {target}): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions of every mode (default 3)")
    ap.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(sorted(unknown))}: choose from {', '.join(MODES)}")
    skip = None
    if os.geteuid() != 0:
        skip = "needs root (BPF)"
    else:
        try:
            import torch  # noqa: F401
        except ImportError:
            skip = "needs PyTorch: pip install torch==2.13.0"
    if skip:
        print(json.dumps({"skipped": skip}) if args.json else f"bench_training_job: skipped ({skip})")
        return 0
    from native_libs import build_libraries

    libdir = build_libraries()["libcudart.so.12"].parent
    stats_before = Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip()
    Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1\n")
    load_before = os.getloadavg()[0]
    runs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
            workdir = Path(tmp)
            for rep in range(args.reps):
                order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                for mode in order:
                    result = run_job(mode, libdir, args.steps, workdir)
                    runs.append(result)
                    print(f"rep {rep + 1}/{args.reps} {mode}: median step {result['median_step_ms']:.2f} ms, "
                          f"CPU {result['cpu_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        Path("/proc/sys/kernel/bpf_stats_enabled").write_text(stats_before + "\n")
    meta = {"steps": args.steps, "reps": args.reps, "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    summary = summarise(runs)
    if args.json:
        print(json.dumps({"meta": meta, "summary": summary, "runs": runs}))
    else:
        print(render(summary, meta))
    failed = [r for r in runs if r["mode"] != "untraced" and r["cuda_calls"] and not r["rows"].get("cuda_call")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
