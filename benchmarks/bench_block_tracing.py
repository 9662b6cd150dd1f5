"""Per-request cost of block tracing alone: 4 KiB O_DIRECT reads of a loop device, untraced, with only
the block layer's tracepoints attached, and under the whole recorder, measured in one run on the
same process.

A small C driver (built here with gcc) opens a loop device with O_DIRECT and, on each request,
reads N blocks of 4 KiB one pread at a time (each one block request: O_DIRECT, synchronous, no
readahead), timed with clock_gettime. The loop device is backed by a file in the page cache, so a
request costs tens of microseconds and the probes' share stands out. One real `Session`
(TargetSpec(pids=(driver,))) lives through the run with its consumer loop in a thread, writing rows
to SQLite as in a recording; between repetitions the benchmark detaches or re-attaches its
tracepoints, so the modes differ only in what is attached:

- untraced: no tracepoint of the session attached (its uprobes are on libraries the driver does
  not call);
- block only: the block layer's tracepoints (block_bio_queue, rq_insert/issue/complete, merges,
  requeue, error, and the ext4/iomap intent hooks) and nothing else: no scheduler, syscall, task,
  memory, DMA or network tracepoint;
- recorder: every tracepoint of the session, as `recorder record` has them.

The modes are interleaved repetition by repetition (the order alternates) so that a change in
machine load hits all of them alike; figures are medians. At the end the benchmark checks that every
read made while the block layer was attached is accounted for: one `block_request` row each, except
requests whose completion the kernel did not run the probe for (it skips a tracepoint's BPF program
while another one runs on that CPU: any session's, anyone's), which the session counts in `loss` as
'block request completion not seen'; and no other loss of the block layer (other layers' skipped
program runs, which an interrupt during a program causes, are printed but touch no request; a
skipped completion is one counted as not seen, or another device's). The
kernel's own count of skipped runs of the block programs (recursion_misses, all devices and
processes) is printed beside it.

    sudo .venv/bin/python benchmarks/bench_block_tracing.py               # 5,000 reads x 21 reps
    sudo .venv/bin/python benchmarks/bench_block_tracing.py -n 5000 -r 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_cuda_call import build_c  # noqa: E402

DRIVER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    int fd = open(argv[1], O_RDONLY | O_DIRECT);
    long blocks = atol(argv[2]);
    void *buf;
    if (fd < 0 || blocks <= 0 || posix_memalign(&buf, 4096, 4096))
        return 1;
    printf("ready\n");
    fflush(stdout);
    long n, next = 0;
    while (scanf("%ld", &n) == 1 && n > 0) {
        int bad = 0;
        uint64_t t0 = now_ns();
        for (long i = 0; i < n; i++) {
            if (pread(fd, buf, 4096, (off_t)next * 4096) != 4096)
                bad = 1;
            next = (next + 1) % blocks;
        }
        uint64_t t1 = now_ns();
        printf("%llu %d\n", (unsigned long long)(t1 - t0), bad);
        fflush(stdout);
    }
    return 0;
}
"""
DEVICE_MIB = 64
MODES = ("untraced", "block_only", "recorder")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF tracepoints, loop devices): run it with sudo"
    if not Path("/dev/loop-control").exists():
        return "needs loop devices (/dev/loop-control)"
    return None


class Driver:
    """The C reading loop, kept alive across modes so every mode measures the same process."""

    def __init__(self, exe: Path, device: str, blocks: int) -> None:
        self.proc = subprocess.Popen([str(exe), device, str(blocks)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"driver failed to open {device} (exit {self.proc.wait()})")
        self.pid = self.proc.pid

    def reads(self, n: int) -> float:
        """Make n reads; ns per read."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        elapsed, bad = self.proc.stdout.readline().split()
        if bad != "0":
            raise RuntimeError("a read failed")
        return int(elapsed) / n

    def close(self) -> None:
        self.proc.stdin.write("0\n")
        self.proc.stdin.close()
        self.proc.wait()


class Tracepoints:
    """Detach and re-attach the session's tracepoints by layer, without recompiling."""

    def __init__(self, probes) -> None:
        from recorder.layers.io.layer import SOURCES
        from recorder.layers.task import OPENAT

        self.bpf = probes.bpf
        # BCC keeps one attachment per tracepoint name: the openat tracepoint carries two programs
        # (checkpoints, the dlopen hold), so it stays attached in every mode. The driver opens its
        # device once, before any read is timed.
        self.all = sorted(tp.decode() for tp in self.bpf.tracepoint_fds if tp.decode() != OPENAT)
        block = set(SOURCES[0].required) | set(probes.optional.get("block", ()))
        self.block = [tp for tp in self.all if tp in block]
        self.attached = set(self.all)
        if not self.block:
            raise RuntimeError("the session attached no block tracepoint")

    def only(self, wanted: list[str]) -> None:
        for tp in sorted(self.attached - set(wanted)):
            self.bpf.detach_tracepoint(tp.encode())
            self.attached.discard(tp)
        for tp in sorted(set(wanted) - self.attached):
            category, event = tp.split(":")
            self.bpf.attach_tracepoint(tp=tp.encode(), fn_name=f"tracepoint__{category}__{event}".encode())
            self.attached.add(tp)


class BpfRunTime:
    """The kernel's own count of time spent in BPF programs (BPF_ENABLE_STATS, on while this object
    lives and off when its fd closes, even if the benchmark dies), read with bpftool."""

    BPF_SYSCALL, BPF_OBJ_GET_INFO_BY_FD, BPF_ENABLE_STATS = 321, 15, 32

    def __init__(self, bpf, names: list[str]) -> None:
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        attr = (ctypes.c_uint32 * 30)()  # BPF_STATS_RUN_TIME = 0
        self.fd = self._libc.syscall(self.BPF_SYSCALL, self.BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr))
        if self.fd < 0:
            raise RuntimeError(f"BPF_ENABLE_STATS failed (errno {ctypes.get_errno()})")
        self.ids = {name: self._prog_id(bpf.funcs[f"tracepoint__{name.replace(':', '__')}".encode()].fd)
                    for name in names}

    def _prog_id(self, prog_fd: int) -> int:
        import ctypes

        info = (ctypes.c_uint32 * 64)()
        attr = (ctypes.c_uint32 * 30)()
        attr[0], attr[1] = prog_fd, ctypes.sizeof(info)
        ctypes.memmove(ctypes.addressof(attr) + 8, ctypes.byref(ctypes.c_uint64(ctypes.addressof(info))), 8)
        if self._libc.syscall(self.BPF_SYSCALL, self.BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr),
                              ctypes.sizeof(attr)) < 0:
            raise RuntimeError(f"BPF_OBJ_GET_INFO_BY_FD failed (errno {ctypes.get_errno()})")
        return info[1]  # struct bpf_prog_info: type, id, ...

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """name -> (run time ns, runs) so far; recursion_misses: name -> runs the kernel skipped."""
        out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True, check=True)
        progs = {p["id"]: p for p in json.loads(out.stdout)}
        self.recursion_misses = {name: progs.get(prog_id, {}).get("recursion_misses", 0)
                                 for name, prog_id in self.ids.items()}
        return {name: (progs.get(prog_id, {}).get("run_time_ns", 0), progs.get(prog_id, {}).get("run_cnt", 0))
                for name, prog_id in self.ids.items()}

    def close(self) -> None:
        os.close(self.fd)


def loop_device(image: Path) -> str:
    with image.open("wb") as f:
        f.truncate(DEVICE_MIB << 20)
    subprocess.run(["dd", "if=/dev/urandom", f"of={image}", "bs=1M", f"count={DEVICE_MIB}", "conv=notrunc"],
                   check=True, capture_output=True)  # real data, read once into the page cache below
    device = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True,
                            check=True).stdout.strip()
    subprocess.run(["dd", f"if={image}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    return device


def measure(n: int, reps: int) -> dict:
    from recorder.core.loader import TargetSpec
    from recorder.session import Session
    from store.db import open_store

    exe = build_c("block_read_driver", DRIVER_C)
    tmp = tempfile.TemporaryDirectory(prefix="bench_block_tracing.")
    device = loop_device(Path(tmp.name) / "disk.img")
    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    bpf_ns = {mode: 0 for mode in MODES}  # in the block layer's programs, over the mode's reads
    bpf_runs = {mode: 0 for mode in MODES}
    per_program: dict[str, list[int]] = {}  # tracepoint -> [ns, runs] in block-only mode
    driver = Driver(exe, device, (DEVICE_MIB << 20) // 4096)
    stats = None
    try:
        driver.reads(n)  # warm the page cache, the loop worker and the driver's page tables
        db = Path(tmp.name) / "bench.db"
        session = Session(db, TargetSpec(pids=(driver.pid,)), (), "bench_block_tracing")
        session.begin()
        tracepoints = Tracepoints(session.probes)
        stats = BpfRunTime(session.probes.bpf, tracepoints.block)
        stop = threading.Event()
        consumer = threading.Thread(target=session.run, args=(stop.is_set,), daemon=True)
        consumer.start()
        wanted = {"untraced": [], "block_only": tracepoints.block, "recorder": tracepoints.all}
        traced_reads = 0
        for rep in range(reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                tracepoints.only(wanted[mode])
                time.sleep(0.1)  # the consumer drains the previous mode's records
                before = stats.snapshot()
                wall[mode].append(driver.reads(n))
                after = stats.snapshot()
                bpf_ns[mode] += sum(after[tp][0] - before[tp][0] for tp in after)
                bpf_runs[mode] += sum(after[tp][1] - before[tp][1] for tp in after)
                if mode == "block_only":
                    for tp in after:
                        acc = per_program.setdefault(tp, [0, 0])
                        acc[0] += after[tp][0] - before[tp][0]
                        acc[1] += after[tp][1] - before[tp][1]
                traced_reads += n if mode != "untraced" else 0
        tracepoints.only(tracepoints.all)
        time.sleep(0.3)
        stop.set()
        consumer.join()
        summary = session.finish()
        name = Path(device).name
        with open_store(db, readonly=True) as store:
            rows = store.one("SELECT count(*) AS n FROM block_request WHERE device = ? AND op = 'read'",
                             (name,))["n"]
            lost = store.one("SELECT coalesce(sum(dropped), 0) AS n FROM loss")["n"]
            unseen = store.one("SELECT coalesce(sum(dropped), 0) AS n FROM loss"
                               " WHERE probe = 'block request completion not seen'")["n"]
            other = {r["probe"]: r["n"] for r in store.query(
                "SELECT probe, sum(dropped) AS n FROM loss"
                " WHERE probe != 'block request completion not seen' GROUP BY probe")}
        misses = {tp: n for tp, n in stats.recursion_misses.items() if n}
    finally:
        if stats:
            stats.close()
        driver.close()
        subprocess.run(["losetup", "-d", device], check=False)
        tmp.cleanup()
    med = {mode: statistics.median(v) for mode, v in wall.items()}
    # each repetition runs the three modes back to back: their differences share that moment's load
    paired = {mode: statistics.median(t - u for t, u in zip(wall[mode], wall["untraced"], strict=True))
              for mode in MODES[1:]}
    reads = n * reps
    return {
        "reads_per_rep": n, "reps": reps, "device": "loop (page-cached file), 4 KiB O_DIRECT pread",
        "ns_per_read": med,
        "ns_per_read_all": wall,
        "added_ns_per_read": paired,
        "block_bpf_ns_per_read": {mode: bpf_ns[mode] / reads for mode in MODES[1:]},
        "block_bpf_runs_per_read": {mode: bpf_runs[mode] / reads for mode in MODES[1:]},
        "block_only_ns_per_program_run": {tp: round(ns / runs) for tp, (ns, runs) in sorted(per_program.items())
                                          if runs},
        "reads_traced": traced_reads,
        "rows_stored": rows,
        "rows_exact": rows == traced_reads,
        "completion_not_seen": unseen,
        # another layer's skipped program run (an interrupt during a program) touches no request;
        # a skipped completion is one of those counted as not seen, or another device's
        "accounted": rows + unseen == traced_reads and not {
            p for p in other if not re.fullmatch(r"bpf program \S+ skipped \((?!block\)).*\)", p)
            and p != "bpf program tracepoint__block__block_rq_complete skipped (block)"},
        "dropped": lost,
        "other_losses": other,
        "kernel_skipped_runs": misses,
        "session_dropped": summary["dropped"],
        "load_avg": os.getloadavg(),
    }


def render(r: dict) -> str:
    m, added = r["ns_per_read"], r["added_ns_per_read"]
    bpf, runs = r["block_bpf_ns_per_read"], r["block_bpf_runs_per_read"]
    lines = [
        f"### Block tracing per request ({r['reps']} reps x {r['reads_per_rep']:,} reads; {r['device']})",
        "",
        "| mode | ns/read (median) | added ns/read (median of paired differences) | in block BPF programs, ns/read |",
        "|---|---:|---:|---:|",
    ]
    for mode in MODES:
        if mode == "untraced":
            lines.append(f"| untraced | {m[mode]:,.0f} | - | - |")
        else:
            lines.append(f"| {mode.replace('_', ' ')} | {m[mode]:,.0f} | {added[mode]:,.0f} | "
                         f"{bpf[mode]:,.0f} ({runs[mode]:.1f} program runs) |")
    per_run = ", ".join(f"{tp.split(':')[1]} {ns:,}" for tp, ns in r["block_only_ns_per_program_run"].items())
    lines += [
        "",
        f"ns per program run (block only): {per_run}",
        f"rows: {r['rows_stored']:,} block_request rows + {r['completion_not_seen']} counted as completion not seen"
        f" for {r['reads_traced']:,} traced reads ({'all accounted' if r['accounted'] else 'NOT accounted'});"
        f" loss rows in all {r['dropped']}; load average {', '.join(f'{x:.1f}' for x in r['load_avg'])}",
        "other losses: " + (", ".join(f"{p} {n:,}" for p, n in r["other_losses"].items()) or "none"),
        "kernel-skipped runs of the block programs (recursion_misses, all devices): "
        + (", ".join(f"{tp.split(':')[1]} {n}" for tp, n in r["kernel_skipped_runs"].items()) or "none"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--reads", type=int, default=5_000, help="reads per repetition and mode")
    ap.add_argument("-r", "--reps", type=int, default=21, help="repetitions of each mode")
    ap.add_argument("-j", "--json", action="store_true", help="print JSON")
    a = ap.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(json.dumps({"skipped": reason}) if a.json else f"bench_block_tracing skipped: {reason}")
        return 0
    r = measure(a.reads, a.reps)
    print(json.dumps(r) if a.json else render(r))
    return 0 if r["accounted"] else 1


if __name__ == "__main__":
    sys.exit(main())
