"""Cost of capturing the Python stack each time a traced thread blocks (bpf/sched.bpf.c), per
blocking switch, with the recorder's own BPF programs, in one run.

    sudo .venv/bin/python benchmarks/bench_offcpu_stack.py [-n 2000] [--depth 20] [-r 7] [--json]

A child Python process, pinned to one CPU, runs two threads that ping-pong a byte through two
pipes from a Python stack --depth frames deep: in every round trip one thread blocks in read(2)
(one capture) and the other is preempted by the thread it woke (no capture), as the recorded
off-CPU intervals show. The recorder's programs are loaded once (recorder.core.loader.Probes) and the
child is timed in each mode, the modes interleaved in every repetition: no BPF programs loaded yet
(measured first), loaded but the child not a target, a target with stack capture off (the off-CPU
interval only), a target with stack capture on. Prints the median microseconds per round trip,
the blocking switches per round trip (counted from the off-CPU records) and the capture's cost per
blocking switch, in wall-clock time and as the kernel's own count of time spent in the
sched_switch program (BPF_ENABLE_STATS; it includes the tail-called walker), which does not depend
on what else the machine runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("sched:sched_switch", "raw_syscalls:sys_enter", "raw_syscalls:sys_exit")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = r"""
import os, sys, threading, time
os.sched_setaffinity(0, {int(sys.argv[1])})
depth = int(sys.argv[2])
a_r, a_w = os.pipe()
b_r, b_w = os.pipe()

def nest(d, fn, *args):
    return nest(d - 1, fn, *args) if d else fn(*args)

def echo_loop():
    while os.read(a_r, 1) == b"x":
        os.write(b_w, b"y")

def pingpong(n):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        os.write(a_w, b"x")
        os.read(b_r, 1)
    return time.perf_counter_ns() - t0

threading.Thread(target=nest, args=(depth, echo_loop), daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    print(nest(depth, pingpong, n), flush=True)
os.write(a_w, b"q")
"""

MODES = ("not a target", "target, stacks off", "target, stacks on")


class Child:
    def __init__(self, cpu: int, depth: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(cpu), str(depth)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, round_trips: int) -> float:
        """us per round trip over `round_trips` ping-pongs."""
        self.proc.stdin.write(f"{round_trips}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline()) / round_trips / 1000

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def measure(round_trips: int, depth: int, reps: int) -> dict:
    from recorder.core.loader import Probes, TargetSpec
    from recorder.layers import bpf_sources, cuda, definitions
    from recorder.layers.sched import OFFCPU, set_offcpu_stacks

    cpu = max(os.sched_getaffinity(0))
    child = Child(cpu, depth)
    try:
        child.run(round_trips)  # warm-up
        unloaded = statistics.median(child.run(round_trips) for _ in range(reps))
        probes = Probes(TargetSpec(pids=()), bpf_sources(), [cuda.bpf_programs()], definitions=definitions())
        records = {"blocked": 0, "preempted": 0, "pystack": 0}
        state_at = OFFCPU.offsets()["state"]

        def offcpu(data: bytes) -> None:
            state = int.from_bytes(data[state_at:state_at + 8], "little")
            records["blocked" if state & 0xFF else "preempted"] += 1

        def pystack(_data: bytes) -> None:
            records["pystack"] += 1

        probes.open_rings({"offcpu_events": offcpu, "pystacks": pystack})
        target = probes.pystack.configure(child.proc.pid)
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        per_trip: dict[str, float] = {}
        try:
            from bench_block_tracing import BpfRunTime

            stats = BpfRunTime(probes.bpf, list(PROGRAMS))
        except Exception as e:  # no bpftool, or a kernel without BPF_ENABLE_STATS
            stats, stats_error = None, str(e)
        bpf_ns: dict[str, list[float]] = {m: [] for m in MODES}
        # per program: the syscall's exit reads the stack of a long wait (bpf/sched.bpf.c)
        prog_ns: dict[tuple[str, str], list[float]] = {(m, p): [] for m in MODES for p in PROGRAMS}
        for _ in range(reps + 1):  # the first repetition warms up
            for mode in MODES:
                targets = probes.bpf["targets"]
                if mode == "not a target":
                    targets.pop(ctypes.c_uint32(child.proc.pid), None)
                else:
                    probes.add_pid(child.proc.pid)
                set_offcpu_stacks(probes, mode == "target, stacks on")
                before = dict(records)
                ran_before = stats.snapshot() if stats else {}
                us = child.run(round_trips)
                if stats:
                    ran = stats.snapshot()
                    for prog in PROGRAMS:
                        prog_ns[(mode, prog)].append((ran[prog][0] - ran_before[prog][0]) / round_trips)
                    bpf_ns[mode].append(prog_ns[(mode, "sched:sched_switch")][-1])
                probes.consume()  # outside the timed region
                for kind in records:
                    per_trip[f"{kind} ({mode})"] = (records[kind] - before[kind]) / round_trips
                samples[mode].append(us)
        counts = probes.pystack.counts()
        if stats:
            stats.close()
        probes.cleanup()
    finally:
        child.close()
    result = {"round_trips": round_trips, "depth": depth, "repetitions": reps, "target": str(target),
              "load_average": os.getloadavg(), "us_per_round_trip": {"no BPF programs": unloaded}}
    for mode in MODES:
        result["us_per_round_trip"][mode] = statistics.median(samples[mode][1:])
    result["per_round_trip"] = per_trip
    blocking = per_trip["blocked (target, stacks on)"]
    rt = result["us_per_round_trip"]
    result["blocking_switches_per_round_trip"] = blocking
    result["stack_records_per_blocking_switch"] = per_trip["pystack (target, stacks on)"] / blocking if blocking else 0
    result["capture_us_per_blocking_switch"] = ((rt["target, stacks on"] - rt["target, stacks off"]) / blocking
                                                if blocking else None)
    result["offcpu_us_per_blocking_switch"] = ((rt["target, stacks off"] - rt["not a target"]) / blocking
                                               if blocking else None)
    result["walker_counts"] = counts
    if stats:
        ns = {m: statistics.median(v[1:]) for m, v in bpf_ns.items()}
        result["sched_switch_bpf_ns_per_round_trip"] = ns
        result["bpf_ns_per_round_trip"] = {f"{p} ({m})": statistics.median(v[1:]) for (m, p), v in prog_ns.items()}
        result["capture_bpf_ns_per_blocking_switch"] = ((ns["target, stacks on"] - ns["target, stacks off"]) / blocking
                                                        if blocking else None)
    else:
        result["sched_switch_bpf_ns_per_round_trip"] = f"not measured: {stats_error}"
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--round-trips", type=int, default=2000, help="ping-pongs per measurement (default 2000)")
    ap.add_argument("--depth", type=int, default=20, help="extra Python frames under each read (default 20)")
    ap.add_argument("-r", "--repeat", type=int, default=7, help="repetitions per mode (default 7)")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print(json.dumps({"skipped": "needs root (BPF)"}) if args.json else "skipped: needs root (BPF)")
        return 0
    r = measure(args.round_trips, args.depth, args.repeat)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    per = r["us_per_round_trip"]
    base = per["no BPF programs"]
    print(f"{r['target']}; {args.round_trips} round trips x {args.repeat} repetitions, depth {args.depth}; "
          f"load average {' '.join(f'{x:.2f}' for x in r['load_average'])}")
    print(f"per round trip (stacks on): {r['blocking_switches_per_round_trip']:.2f} blocking switches, "
          f"{r['per_round_trip']['preempted (target, stacks on)']:.2f} preemptions; stack records per "
          f"blocking switch {r['stack_records_per_blocking_switch']:.2f}; walker counts {r['walker_counts']}")
    bpf_ns = r["sched_switch_bpf_ns_per_round_trip"]
    print("| mode | us/round trip | added us | vs previous row | in sched_switch BPF, ns/round trip |")
    print("|---|---:|---:|---:|---:|")
    prev = base
    for mode, us in per.items():
        ran = f"{bpf_ns[mode]:,.0f}" if isinstance(bpf_ns, dict) and mode in bpf_ns else "-"
        print(f"| {mode} | {us:.2f} | {us - base:.2f} | {us - prev:+.2f} | {ran} |")
        prev = us
    if r["capture_us_per_blocking_switch"] is not None:
        print(f"off-CPU interval: {r['offcpu_us_per_blocking_switch']:.2f} us per blocking switch; "
              f"stack capture: {r['capture_us_per_blocking_switch']:.2f} us more")
    if r.get("capture_bpf_ns_per_blocking_switch") is not None:
        print(f"stack capture in BPF (kernel run time): {r['capture_bpf_ns_per_blocking_switch']:,.0f} ns per blocking "
              "switch")
    for name, ns in r.get("bpf_ns_per_round_trip", {}).items():
        print(f"  {name}: {ns:,.0f} ns BPF per round trip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
