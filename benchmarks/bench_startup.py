"""Start-up of a recording: where `recorder start` spends its time before it records, and how long
until the first event is in the database.

Two measurements, each REPEAT times; with --compare DIR (another checkout of the repository, e.g.
`git archive main | tar -x -C /tmp/main`) the same runs of that checkout are interleaved with ours,
so both see the same machine load:

- phases (root): Session.begin() in a fresh process with every phase timed, wall and CPU of the
  process (all its threads): the imports (`python -X importtime` of recorder.cli and
  recorder.session, in a process of their own), opening the store (migrations), the layers'
  preparation, the BPF compile (BCC: clang and LLVM), loading and attaching the tracepoint
  programs, the CPython stack walker's programs, reading the kernel's BTF, each layer's attach
  (uprobes, dlopen, its programs), the first scan of the target, and the rest.
- first-event (root): `recorder start -p PID` on a workload that sleeps 2 ms in a loop, timed from
  the command's start to the first off-CPU interval committed in the database, with the CPU
  seconds of the command and of the recorder it forked, up to then.

    sudo .venv/bin/python benchmarks/bench_startup.py
    sudo .venv/bin/python benchmarks/bench_startup.py --repeat 3 --compare /tmp/main --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLEEPER = "import time\nwhile True:\n    time.sleep(0.002)\n"


# -- phases (in a child process whose sys.path starts with the checkout measured) ----------------------
def _child_phases() -> dict:
    src = os.environ["STARTUP_SRC"]
    sys.path.insert(0, src)
    import bcc

    from recorder import layers as layers_mod
    from recorder import session as session_mod
    from recorder.core import btf, loader, pyframes

    totals: dict[str, list[float]] = {}

    def timed(owner, attr: str, phase: str) -> None:
        original = getattr(owner, attr)

        def wrapper(*args, **kw):
            w0, c0 = time.monotonic(), time.process_time()
            try:
                return original(*args, **kw)
            finally:
                t = totals.setdefault(phase, [0.0, 0.0])
                t[0] += time.monotonic() - w0
                t[1] += time.process_time() - c0

        setattr(owner, attr, wrapper)

    timed(session_mod, "open_store", "store: open, migrations")
    timed(bcc.BPF, "__init__", "bpf: compile (clang, LLVM) + tracepoints")
    timed(bcc.BPF, "_trace_autoload", "bpf: load + attach tracepoint programs")
    timed(loader.Probes, "__init__", "probes: all")
    timed(pyframes.PyStackProbe, "install", "python walker programs")
    timed(pyframes.PyStackProbe, "install_tracepoints", "python walker programs")
    timed(btf, "member_offset", "target: first scan: of which kernel struct offset (BTF)")
    timed(loader.Probes, "open_rings", "ring buffers: open")
    timed(session_mod.Session, "_attach_process", "target: first scan")
    timed(session_mod.Session, "_rescan_members", "target: first scan")
    for cls in layers_mod.LAYERS:  # the registry (recorder/layers/__init__.py)
        timed(cls, "attach", f"layer attach: {cls.name}")
        timed(cls, "prepare", "layers: prepare")
    timed(layers_mod.GpuLayer, "start", "gpu: NVML")
    # the on-CPU profile's start: where it is compiled after the start, the fork of the child that does it
    timed(layers_mod.ProfileLayer, "start", "profile: start (its compile begins)")
    work = subprocess.Popen([sys.executable, "-c", SLEEPER])
    db = Path(tempfile.mkdtemp()) / "startup.db"
    try:
        s = session_mod.Session(db, loader.TargetSpec(pids=(work.pid,)), (), "bench_startup")
        w0, c0 = time.monotonic(), time.process_time()
        s.begin()
        total = (time.monotonic() - w0, time.process_time() - c0)
        s.stopping = True
        s.finish()
    finally:
        work.kill()
        work.wait()
    phases = {k: {"wall_s": round(v[0], 3), "cpu_s": round(v[1], 3)} for k, v in totals.items()}
    top = [v for k, v in phases.items()
           if k == "probes: all" or not k.startswith(("bpf", "python walker", "target: first scan: of"))]
    rest = {m: round(total[i] - sum(v[m] for v in top), 3) for i, m in enumerate(("wall_s", "cpu_s"))}
    # the compile alone: BPF.__init__ less its tracepoint autoload; Probes() less what is timed inside it
    bpf_all = phases.pop("bpf: compile (clang, LLVM) + tracepoints")
    auto = phases["bpf: load + attach tracepoint programs"]
    phases["bpf: compile (clang, LLVM)"] = {k: round(bpf_all[k] - auto[k], 3) for k in bpf_all}
    probes_all = phases.pop("probes: all")
    inside = [bpf_all, phases.get("python walker programs")]
    phases["probes: the rest"] = {k: round(probes_all[k] - sum(p[k] for p in inside if p), 3) for k in probes_all}
    phases["begin: total"] = {"wall_s": round(total[0], 3), "cpu_s": round(total[1], 3)}
    phases["begin: not in a phase above"] = rest
    return phases


def _import_time(src: str) -> float:
    """Seconds `python -X importtime` counts for importing the CLI and the session."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import recorder.cli, recorder.session"],
                         capture_output=True, text=True, cwd=src, env={**os.environ, "PYTHONPATH": src})
    total = 0
    for line in res.stderr.splitlines():
        parts = line.split("|")
        # the top-level imports: their cumulative time includes everything they imported
        if line.startswith("import time:") and len(parts) == 3 and not parts[2].startswith("  "):
            try:
                total += int(parts[1])
            except ValueError:  # the header line
                pass
    return total / 1e6


def phases(src: str) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, cwd=src,
                         env={**os.environ, "STARTUP_SRC": src, "PYTHONPATH": src}, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"phases run failed in {src}:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["imports: recorder.cli + recorder.session"] = {"wall_s": round(_import_time(src), 3), "cpu_s": None}
    return out


# -- first event ----------------------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_event(src: str) -> dict:
    work = subprocess.Popen([sys.executable, "-c", SLEEPER])
    folder = Path(tempfile.mkdtemp())
    db = folder / "first.db"
    env = {**os.environ, "PYTHONPATH": src}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "recorder", "start", "--db", str(db), "-p", str(work.pid), "--json"]
    start = subprocess.Popen(argv, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = recorder_pid = None
    recorder_cpu = 0.0
    try:
        while time.monotonic() - t0 < 300:
            if recorder_pid is None:
                try:
                    recorder_pid = int(db.with_name(db.name + ".lock").read_text().strip())
                except (OSError, ValueError):
                    pass
            if db.exists():
                try:
                    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1)
                    n = conn.execute("SELECT count(*) FROM offcpu_interval").fetchone()[0]
                    conn.close()
                except sqlite3.Error:
                    n = 0
                if n:
                    first = time.monotonic() - t0
                    if recorder_pid:
                        recorder_cpu = _cpu_s(recorder_pid)
                    break
            if start.poll() not in (None, 0):
                raise SystemExit(f"recorder start failed in {src}: {start.stderr.read()[-2000:]}")
            time.sleep(0.02)
        start.wait(timeout=300)
        attached = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    finally:
        subprocess.run([sys.executable, "-m", "recorder", "stop", "--db", str(db)], cwd=src, env=env,
                       capture_output=True, timeout=300)
        work.kill()
        work.wait()
    return {"first_event_s": round(first, 2) if first else None, "start_returned_s": round(attached, 2),
            "recorder_cpu_s": round(recorder_cpu, 2), "start_command_cpu_s": round(cli_cpu, 2),
            "cpu_s": round(recorder_cpu + cli_cpu, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare", metavar="DIR", help="another checkout, measured interleaved with this one")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child_phases()))
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_startup: needs root (it records): run it with sudo")
    checkouts = {"this": str(ROOT)}
    if args.compare:
        checkouts = {"compare": str(Path(args.compare).resolve()), **checkouts}
    runs: dict[str, dict[str, list]] = {name: {"phases": [], "first": []} for name in checkouts}
    for _ in range(args.repeat):
        for name, src in checkouts.items():
            runs[name]["first"].append(first_event(src))
            runs[name]["phases"].append(phases(src))
    result = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "repeat": args.repeat, "checkouts": {}}
    for name, src in checkouts.items():
        first = runs[name]["first"]
        keys = runs[name]["phases"][0].keys()
        result["checkouts"][name] = {
            "src": src,
            "first_event": {k: statistics.median(r[k] for r in first if r[k] is not None) for k in first[0]},
            "first_event_runs": first,
            "phases_median": {k: {m: statistics.median(r[k][m] for r in runs[name]["phases"])
                                  if runs[name]["phases"][0][k][m] is not None else None
                                  for m in ("wall_s", "cpu_s")} for k in keys},
        }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, r in result["checkouts"].items():
        f = r["first_event"]
        print(f"{name} ({r['src']}): first event {f['first_event_s']:.2f} s after `recorder start`, "
              f"{f['cpu_s']:.2f} CPU-s (recorder {f['recorder_cpu_s']:.2f}, command {f['start_command_cpu_s']:.2f}); "
              f"median of {args.repeat}")
        for phase, v in sorted(r["phases_median"].items()):
            cpu = f"{v['cpu_s']:7.2f}" if v["cpu_s"] is not None else "      -"
            print(f"  {phase:45s} {v['wall_s']:7.2f} s wall {cpu} CPU-s")
    print(f"load average {result['load_average'][0]:.1f} on {result['cpus']} CPUs")


if __name__ == "__main__":
    main()
