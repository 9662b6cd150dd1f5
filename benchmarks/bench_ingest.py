"""Ingest: CUDA-call events per second the recorder moves from BPF into SQLite with zero drops,
and bytes per stored event.

A C program (built here with gcc) hammers a stand-in CUDA call (zero work) from 1-2 threads, paced
at increasing rates and finally as fast as it can, while a real `Session` records it
(TargetSpec(pids=(hammer,)), the same loop `recorder record` runs). For each rate it reports the
rate offered, the rows written per second (rows / time from the first call until the last row was
committed), the drops counted in the `loss` table and the database's bytes per row after stop.

Because on a small VM the producer (one uprobe+uretprobe trap per call) may be slower than the
consumer, a second measurement isolates the consumer: the hammer makes a burst of calls that fits
in the ring buffer while the consumer is paused, then the consumer drains it and the time to drain
gives the consumer's capacity. Time inside the loop is split into ring-buffer reading
(`Probes.poll`: the rings' memory mapping read in blocks, or with --bcc-rings BCC's
ring_buffer_poll and one Python callback per record), the Python stack records (`stacks.add`),
unpacking into row tuples (`_cuda_rows`: struct.iter_unpack plus tuple building) and handing the
batch to the writer (`Writer.flush`; the writer thread's executemany + commit runs beside the
loop and shows in the total), by wrapping those methods of the live session (the recorder code
itself is unchanged).

    .venv/bin/python benchmarks/bench_ingest.py                       # rates 25k..200k + flat out
    .venv/bin/python benchmarks/bench_ingest.py --rates 50000,100000 --threads 2 --seconds 5
    .venv/bin/python benchmarks/bench_ingest.py --rates 100000 --bcc-rings   # BCC's reader
    .venv/bin/python benchmarks/bench_ingest.py --python-rows   # without the packed-row path
    .venv/bin/python benchmarks/bench_ingest.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "native"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cuda_call import build_c, skip_reason  # noqa: E402
from recorder.core.pyframes import STATUS_NAMES  # noqa: E402
from recorder.core.settings import Settings  # noqa: E402

TARGET_EVENTS_PER_S = 300_000  # the sustained ingest target (docs/benchmarks.md)
RING_RECORDS = 58_254  # cuda_events: 2048 pages of 4 KiB / (136-byte record + 8-byte header)

HAMMER_C = r"""
/* Calls a stand-in CUDA API from THREADS threads, paced at RATE calls/s in all (0: as fast as
 * possible) for SECONDS, or COUNT calls in all when COUNT > 0. Starts on a line from stdin and
 * prints "calls elapsed_ns" at the end. With a seventh argument "warm", the first line gets one
 * call from the main thread and "warm" back, and the calls start on the next line. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { unsigned int x, y, z; } dim3;
typedef int (*launch_t)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*stream_t)(void *);
typedef void (*configure_t)(const char *, uint64_t, uint64_t, int);

static void *fn;
static int launch;
static double rate_per_thread;
static uint64_t duration_ns, count_per_thread, start_ns;

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void *worker(void *arg)
{
    uint64_t *done = arg;
    dim3 grid = {64, 1, 1}, block = {256, 1, 1};
    struct timespec pause = {0, 100000};
    for (;;) {
        if (count_per_thread) {
            if (*done >= count_per_thread)
                break;
        } else {
            uint64_t elapsed = now_ns() - start_ns;
            if (elapsed >= duration_ns)
                break;
            if (rate_per_thread > 0 && *done >= rate_per_thread * elapsed / 1e9) {
                nanosleep(&pause, NULL);
                continue;
            }
        }
        for (int i = 0; i < 16; i++) {
            if (launch)
                ((launch_t)fn)((void *)0x1000, grid, block, NULL, 0, (void *)0x10);
            else
                ((stream_t)fn)((void *)0x10);
        }
        *done += 16;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 7 && argc != 8) {
        fprintf(stderr, "usage: %s LIBRARY API THREADS RATE SECONDS COUNT [warm]\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    configure_t configure = (configure_t)dlsym(lib, "standin_configure");
    fn = dlsym(lib, argv[2]);
    if (!configure || !fn)
        return 2;
    configure(argv[2], 0, 0, 0);
    launch = strstr(argv[2], "LaunchKernel") != NULL;
    int threads = atoi(argv[3]);
    rate_per_thread = atof(argv[4]) / threads;
    duration_ns = (uint64_t)(atof(argv[5]) * 1e9);
    count_per_thread = (uint64_t)atoll(argv[6]) / threads;
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    if (argc == 8) {
        uint64_t one = 0;
        count_per_thread = 16;
        worker(&one);
        count_per_thread = (uint64_t)atoll(argv[6]) / threads;
        printf("warm\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    pthread_t tids[64];
    uint64_t done[64][8] = {{0}};
    start_ns = now_ns();
    for (int i = 0; i < threads; i++)
        pthread_create(&tids[i], NULL, worker, done[i]);
    uint64_t total = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(tids[i], NULL);
        total += done[i][0];
    }
    printf("%llu %llu\n", (unsigned long long)total, (unsigned long long)(now_ns() - start_ns));
    fflush(stdout);
    return 0;
}
"""


class Timers:
    """Wraps the live session's poll, row-building and write steps with wall-clock accumulators."""

    def __init__(self, session) -> None:
        self.poll_s = self.stacks_s = self.pack_s = self.rows_s = self.write_s = 0.0
        self.last_commit = 0.0
        probes, writer, stacks = session.probes, session.writer, session.stacks
        cuda = next(layer for layer in session.layers if layer.name == "cuda")
        poll, cuda_rows, flush, add = probes.poll, cuda._cuda_rows, writer.flush, stacks.add

        def timed_poll(timeout_ms: int) -> None:
            t = time.perf_counter()
            poll(timeout_ms)
            self.poll_s += time.perf_counter() - t

        def timed_add(records: list[bytes]) -> None:
            t = time.perf_counter()
            add(records)
            self.stacks_s += time.perf_counter() - t

        def timed_rows(joined: bytes) -> list[tuple]:
            t = time.perf_counter()
            rows = cuda_rows(joined)
            self.rows_s += time.perf_counter() - t
            return rows

        def timed_flush() -> int:
            t = time.perf_counter()
            n = flush()
            self.last_commit = time.perf_counter()
            self.write_s += self.last_commit - t
            return n

        pack = cuda._pack_cuda_rows

        def timed_pack(joined: bytes) -> bytes:
            t = time.perf_counter()
            rest = pack(joined)
            self.pack_s += time.perf_counter() - t
            return rest

        probes.poll = timed_poll
        cuda._pack_cuda_rows = timed_pack
        stacks.add = timed_add
        cuda._cuda_rows = timed_rows
        writer.flush = timed_flush


class Hammer:
    def __init__(self, exe: Path, library: Path, api: str, threads: int, rate: int,
                 seconds: float, count: int = 0, warm: bool = False) -> None:
        self.proc = subprocess.Popen(
            [str(exe), str(library), api, str(threads), str(rate), str(seconds), str(count)]
            + (["warm"] if warm else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"hammer failed to start (exit {self.proc.wait()})")
        self.pid = self.proc.pid
        self.exit: int | None = None

    def warm(self) -> None:
        """16 calls from the main thread first (a hammer started with warm=True)."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "warm":
            raise RuntimeError("hammer did not warm up")

    def go(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return time.perf_counter()

    def exited(self) -> bool:
        if self.exit is None:
            self.exit = self.proc.poll()
        return self.exit is not None

    def result(self) -> tuple[int, float]:
        calls, elapsed = self.proc.stdout.readline().split()
        self.proc.wait()
        return int(calls), int(elapsed) / 1e9


def _session(db: Path, pid: int):
    from recorder.core.loader import TargetSpec
    from recorder.session import Session

    session = Session(db, TargetSpec(pids=(pid,)), (), "bench_ingest")
    session.begin()
    return session


def _stored(db: Path, api: str) -> tuple[int, int, int]:
    from store.db import open_store

    with open_store(db, readonly=True) as store:
        rows = store.one("SELECT count(*) AS n FROM cuda_call_named WHERE api = ?", (api,))["n"]
        lost = store.one("SELECT coalesce(sum(dropped), 0) AS n FROM loss")["n"]
        other = store.one("SELECT count(*) AS n FROM offcpu_interval")["n"]
    return rows, lost, other


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sustained(exe: Path, library: Path, api: str, threads: int, rate: int, seconds: float,
              folder: Path) -> dict:
    """Record the hammer paced at `rate` (0: flat out) with the real loop; rows/s and drops."""
    db = folder / f"ingest_{rate}.db"
    hammer = Hammer(exe, library, api, threads, rate, seconds)
    session = _session(db, hammer.pid)
    timers = Timers(session)
    cpu0 = _cpu_s()
    t0 = hammer.go()
    session.run(hammer.exited)
    counts = session.stacks.walker.counts()
    session.finish()
    cpu = _cpu_s() - cpu0
    calls, elapsed = hammer.result()
    rows, lost, offcpu = _stored(db, api)
    span = max(timers.last_commit - t0, elapsed)
    return {
        "rate_asked": rate, "threads": threads, "calls": calls, "offered_per_s": calls / elapsed,
        "rows": rows, "rows_per_s": rows / span, "dropped": lost, "offcpu_rows": offcpu,
        "db_bytes": db.stat().st_size, "bytes_per_row": db.stat().st_size / max(rows, 1),
        "recorder_cpu_s": cpu, "span_s": span,
        "poll_s": timers.poll_s, "stacks_s": timers.stacks_s, "rows_s": timers.rows_s,
        "write_s": timers.write_s,
        # captures sent as a stack record vs as the digest of a stack sent before (bpf/pystack.h)
        "stack_records": sum(counts.get(n, 0) for n in STATUS_NAMES.values()) - counts.get("sent as digest", 0),
        "stack_digests": counts.get("sent as digest", 0),
    }


def drain(exe: Path, library: Path, api: str, threads: int, burst: int, reps: int,
          folder: Path) -> dict:
    """Consumer capacity: a burst that fits the ring is made with the consumer paused, then
    drained by the real loop; events/s and the split of the time, medians over `reps`. Each
    burst comes after 16 calls the session has already stored, as in a session under way (its
    thread and stacks known), not as the first calls of a session."""
    per: list[dict] = []
    rows = lost = 0
    for rep in range(reps):
        # a database of its own: a session recorded into a database with earlier sessions also
        # updates the indexes their stop built, which is another measurement
        db = folder / f"drain_{rep}.db"
        hammer = Hammer(exe, library, api, threads, 0, 3600, burst, warm=True)
        session = _session(db, hammer.pid)
        hammer.warm()
        session.run(lambda s=session: s.counters.events["cuda"] >= 16)
        session.flush()  # the warm-up's stack record read and its digest confirmed
        timers = Timers(session)
        hammer.go()
        hammer.proc.wait()  # the consumer is not polling: every record waits in the ring
        calls, _ = hammer.result()
        expected = session.counters.events["cuda"] + calls
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        session.run(lambda s=session, e=expected: s.counters.events["cuda"] >= e)
        session.writer.sync()  # rows committed, not only handed to the writer thread
        wall = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        session.finish()
        per.append({"calls": calls, "wall_s": wall, "cpu_s": cpu, "poll_s": timers.poll_s,
                    "stacks_s": timers.stacks_s, "pack_s": timers.pack_s, "rows_s": timers.rows_s,
                    "write_s": timers.write_s})
        stored, dropped, _ = _stored(db, api)
        rows, lost = rows + stored, lost + dropped
    total_calls = sum(p["calls"] for p in per)

    def med(key: str) -> float:
        return statistics.median(p[key] / p["calls"] for p in per) * 1e9

    return {
        "burst": burst, "reps": reps, "calls": total_calls, "rows": rows, "dropped": lost,
        "rows_exact": rows == total_calls + 16 * reps,  # and each burst's warm-up calls
        "events_per_s": 1e9 / med("wall_s"),
        "ns_per_event": {"total_wall": med("wall_s"), "cpu": med("cpu_s"), "poll": med("poll_s"),
                         "stack_records": med("stacks_s"), "pack_rows": med("pack_s"),
                         "unpack_rows": med("rows_s"),
                         "hand_to_writer": med("write_s")},
    }


def measure(api: str, threads: int, rates: list[int], seconds: float, burst: int,
            reps: int) -> dict:
    import native_libs as native  # tests/native/native_libs.py

    library = Path(os.path.realpath(native.build_libraries()["libcudart.so.12"]))
    exe = build_c("ingest_hammer", HAMMER_C, ("-pthread", "-ldl"))
    with tempfile.TemporaryDirectory(prefix="bench_ingest.") as tmp:
        folder = Path(tmp)
        runs = [sustained(exe, library, api, threads, rate, seconds, folder) for rate in rates]
        capacity = drain(exe, library, api, threads, burst, reps, folder)
    clean = [r for r in runs if r["dropped"] == 0 and r["rows"] == r["calls"]]
    best = max(clean, key=lambda r: r["rows_per_s"]) if clean else None
    by_rows = sorted(runs, key=lambda r: r["rows"])
    big = [by_rows[0], by_rows[-1]] if len(by_rows) > 1 else by_rows
    marginal = ((big[1]["db_bytes"] - big[0]["db_bytes"]) / (big[1]["rows"] - big[0]["rows"])
                if len(big) == 2 and big[1]["rows"] > big[0]["rows"] else None)
    return {
        "api": api, "threads": threads, "seconds": seconds, "runs": runs,
        "best_zero_drop_rows_per_s": best["rows_per_s"] if best else 0.0,
        "bytes_per_row_marginal": marginal,
        "drain": capacity, "target_events_per_s": TARGET_EVENTS_PER_S,
        "ring_reader": "BCC callbacks" if Settings.from_environment().bcc_rings
        else "memory-mapped, in blocks",
        "rows": "packed in C" if _packed_rows() else "Python tuples",
        "load_avg": os.getloadavg(),
    }


def _packed_rows() -> bool:
    import recorder.layers.cuda.layer

    return recorder.layers.cuda.layer._ingest_module() is not None


def render(r: dict) -> str:
    lines = [
        f"### Sustained ingest of `{r['api']}` from {r['threads']} thread(s), "
        f"{r['seconds']:g} s per rate, rows {r['rows']}",
        "",
        "| asked calls/s | offered calls/s | rows written/s | rows | dropped | bytes/row "
        "| recorder CPU s | stack records / as digest |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["runs"]:
        asked = f"{x['rate_asked']:,}" if x["rate_asked"] else "flat out"
        lines.append(
            f"| {asked} | {x['offered_per_s']:,.0f} | {x['rows_per_s']:,.0f} | {x['rows']:,} | "
            f"{x['dropped']:,} | {x['bytes_per_row']:.1f} | {x['recorder_cpu_s']:.2f} | "
            f"{x['stack_records']:,} / {x['stack_digests']:,} |")
    d = r["drain"]
    ns = d["ns_per_event"]
    lines += [
        "",
        f"- best rate with zero drops and every call stored: "
        f"{r['best_zero_drop_rows_per_s']:,.0f} rows/s (target {r['target_events_per_s']:,})",
    ]
    if r["bytes_per_row_marginal"] is not None:
        lines.append(f"- marginal bytes per row (smallest vs largest run, indexes included): "
                     f"{r['bytes_per_row_marginal']:.1f}")
    lines += [
        "",
        f"### Consumer capacity: bursts of {d['burst']:,} records drained from a full ring, "
        f"median of {d['reps']}",
        "",
        "| step | ns/event |",
        "|---|---:|",
        f"| ring buffers read (`Probes.poll`, {r['ring_reader']}) | {ns['poll']:,.0f} |",
        f"| Python stack records (`stacks.add`) | {ns['stack_records']:,.0f} |",
        f"| packed rows in C (`_pack_cuda_rows`) | {ns['pack_rows']:,.0f} |",
        f"| unpack + row tuples (`_cuda_rows`) | {ns['unpack_rows']:,.0f} |",
        f"| hand over to the writer thread (`Writer.flush`) | {ns['hand_to_writer']:,.0f} |",
        f"| total wall | {ns['total_wall']:,.0f} |",
        f"| recorder process CPU | {ns['cpu']:,.0f} |",
        "",
        f"- drain rate: {d['events_per_s']:,.0f} events/s; rows {d['rows']:,} for "
        f"{d['calls']:,} calls + {16 * d['reps']} warm-up ({'exact' if d['rows_exact'] else 'MISMATCH'}), "
        f"dropped {d['dropped']}",
        f"- load average during the run: {', '.join(f'{x:.2f}' for x in r['load_avg'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[-5:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", default="cudaLaunchKernel",
                    choices=("cudaLaunchKernel", "cudaStreamSynchronize"),
                    help="stand-in API to hammer (configured with zero work)")
    ap.add_argument("--threads", type=int, default=2, help="hammer threads (1-2 on a small VM)")
    ap.add_argument("--rates", default="25000,50000,100000,200000,0",
                    help="comma-separated calls/s to offer in all; 0 means as fast as possible")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each rate")
    ap.add_argument("--burst", type=int, default=50_000,
                    help=f"calls per drain burst (under the {RING_RECORDS:,} the ring holds)")
    ap.add_argument("--reps", type=int, default=5, help="drain bursts")
    ap.add_argument("--bcc-rings", action="store_true",
                    help="read the rings with BCC's callback per record (as before the mapped reader)")
    ap.add_argument("--python-rows", action="store_true",
                    help="build and bind cuda_call rows in Python (as without the C extensions)")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.bcc_rings:
        os.environ["STALL_RECORDER_BCC_RINGS"] = "1"
    if args.python_rows:
        import recorder.layers.cuda.layer

        recorder.layers.cuda.layer._ingest_module = lambda: None
    reason = skip_reason()
    if reason:
        print(json.dumps({"skipped": reason}) if args.json else f"bench_ingest: skipped: {reason}")
        return 0
    rates = [int(x) for x in args.rates.split(",") if x.strip()]
    if not 0 < args.burst < RING_RECORDS:  # a burst the ring cannot hold would never drain
        ap.error(f"--burst must be under the {RING_RECORDS:,} records the ring holds")
    result = measure(args.api, args.threads, rates, args.seconds, args.burst, args.reps)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
