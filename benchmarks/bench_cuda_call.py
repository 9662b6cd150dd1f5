"""Per-call cost of a traced CUDA call: untraced, under an empty uprobe+uretprobe pair, and under
the real recorder, measured in one run on the same process.

A small C driver (built here with gcc) dlopens the stand-in libcudart.so.12, configures the API to
do no work, and on each request calls it N times in a loop timed with clock_gettime. The three
modes are interleaved repetition by repetition (the order alternates) so that a change in machine
load hits all of them alike; the figures are medians over the repetitions:

- untraced: no probe on the symbol;
- empty pair: a BCC program with two empty functions attached as uprobe and uretprobe (and each
  alone: the trap cost of an entry probe and of a return probe);
- recorder: a real `Session` (TargetSpec(pids=(driver,))) with its consumer loop running in a
  thread, so records are drained and written to SQLite while the driver calls; after each
  recorder repetition the benchmark waits until every record was written.

The recorder's session (sched tracepoints included) lives through the whole run; for the other two
modes only its probes on the measured symbol are detached. At the end the benchmark checks that the
recorder stored exactly as many `cuda_call` rows as calls were made under it, and no loss.

    .venv/bin/python benchmarks/bench_cuda_call.py                     # cudaLaunchKernel
    .venv/bin/python benchmarks/bench_cuda_call.py --api cudaStreamSynchronize -n 50000 -r 15
    .venv/bin/python benchmarks/bench_cuda_call.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "native"))

BUILD = ROOT / "build" / "bench"
TARGET_RATIO = 2.0  # target: the recorder's added cost <= 2x the empty pair's

DRIVER_C = r"""
/* Calls one stand-in CUDA API N times per request read from stdin; prints elapsed ns. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { unsigned int x, y, z; } dim3;
typedef int (*launch_t)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*stream_t)(void *);
typedef void (*configure_t)(const char *, uint64_t, uint64_t, int);

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIBRARY API\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    configure_t configure = (configure_t)dlsym(lib, "standin_configure");
    void *fn = dlsym(lib, argv[2]);
    if (!configure || !fn) {
        fprintf(stderr, "%s or standin_configure not exported\n", argv[2]);
        return 2;
    }
    configure(argv[2], 0, 0, 0);
    int launch = strstr(argv[2], "LaunchKernel") != NULL;
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        long n = atol(line);
        if (n <= 0)
            break;
        dim3 grid = {64, 1, 1}, block = {256, 1, 1};
        int bad = 0;
        uint64_t t0 = now_ns();
        if (launch)
            for (long i = 0; i < n; i++)
                bad |= ((launch_t)fn)((void *)0x1000, grid, block, NULL, 0, (void *)0x10);
        else
            for (long i = 0; i < n; i++)
                bad |= ((stream_t)fn)((void *)0x10);
        uint64_t t1 = now_ns();
        printf("%llu %d\n", (unsigned long long)(t1 - t0), bad);
        fflush(stdout);
    }
    return 0;
}
"""

EMPTY_PAIR_C = """
int empty_entry(struct pt_regs *ctx) { return 0; }
int empty_return(struct pt_regs *ctx) { return 0; }
"""


def build_c(name: str, source: str, extra: tuple[str, ...] = ()) -> Path:
    """Compile a benchmark's C program into build/bench (rebuilt when its text changed)."""
    BUILD.mkdir(parents=True, exist_ok=True)
    src = BUILD / f"{name}.c"
    exe = BUILD / name
    if not exe.exists() or not src.exists() or src.read_text() != source:
        src.write_text(source)
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(src), *extra], check=True)
    return exe


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF uprobes): run it with sudo"
    return None


class Driver:
    """The C calling loop, kept alive across modes so every mode measures the same process."""

    def __init__(self, exe: Path, library: Path, api: str) -> None:
        self.proc = subprocess.Popen([str(exe), str(library), api], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"driver failed to start (exit {self.proc.wait()})")
        self.pid = self.proc.pid

    def calls(self, n: int) -> float:
        """Make n calls; ns per call."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        elapsed, bad = self.proc.stdout.readline().split()
        if bad != "0":
            raise RuntimeError("the stand-in call returned an error")
        return int(elapsed) / n

    def close(self) -> None:
        self.proc.stdin.write("0\n")
        self.proc.stdin.close()
        self.proc.wait()


def measure(api: str, n: int, reps: int) -> dict:
    from bcc import BPF

    import native_libs as native  # tests/native/native_libs.py
    from recorder.core import kheaders
    from recorder.core.loader import TargetSpec
    from recorder.layers import cuda
    from recorder.session import Session

    library = Path(os.path.realpath(native.build_libraries()["libcudart.so.12"]))
    exe = build_c("cuda_call_driver", DRIVER_C, ("-ldl",))
    driver = Driver(exe, library, api)
    tmp = tempfile.TemporaryDirectory(prefix="bench_cuda_call.")
    index = cuda.API_INDEX[api]
    results: dict[str, list[float]] = {"untraced": [], "empty_entry": [], "empty_return": [], "empty_pair": [],
                                       "recorder": []}
    try:
        driver.calls(n)  # warm the caches and the page tables
        before = statistics.median(driver.calls(n) for _ in range(reps))

        kheaders.locate()  # points BCC at usable kernel headers, as the recorder does
        empty = BPF(text=EMPTY_PAIR_C)
        session = Session(Path(tmp.name) / "bench.db", TargetSpec(pids=(driver.pid,)), (),
                          "bench_cuda_call")
        session.begin()
        probes = session.probes
        if probes.attached_libraries.get(str(library), 0) == 0:
            raise RuntimeError(f"the recorder attached nothing to {library}")
        stop = threading.Event()
        consumer = threading.Thread(target=session.run, args=(stop.is_set,), daemon=True)
        consumer.start()

        state = {"recorder": True, "empty_entry": False, "empty_return": False}

        def set_mode(mode: str) -> None:
            want_rec = mode == "recorder"
            want_entry = mode in ("empty_entry", "empty_pair")
            want_return = mode in ("empty_return", "empty_pair")
            if state["recorder"] and not want_rec:
                probes.bpf.detach_uprobe(name=str(library), sym=api)
                probes.bpf.detach_uretprobe(name=str(library), sym=api)
            if not state["recorder"] and want_rec:
                probes.bpf.attach_uprobe(name=str(library), sym=api, fn_name=f"cuda_entry_{index}")
                probes.bpf.attach_uretprobe(name=str(library), sym=api,
                                            fn_name=cuda.return_program(cuda.APIS[index]))
            if state["empty_entry"] and not want_entry:
                empty.detach_uprobe(name=str(library), sym=api)
            if not state["empty_entry"] and want_entry:
                empty.attach_uprobe(name=str(library), sym=api, fn_name="empty_entry")
            if state["empty_return"] and not want_return:
                empty.detach_uretprobe(name=str(library), sym=api)
            if not state["empty_return"] and want_return:
                empty.attach_uretprobe(name=str(library), sym=api, fn_name="empty_return")
            state["recorder"], state["empty_entry"], state["empty_return"] = want_rec, want_entry, want_return

        def wait_written(expected: int, timeout_s: float = 30.0) -> None:
            deadline = time.monotonic() + timeout_s
            while session.counters.events["cuda"] < expected and time.monotonic() < deadline:
                time.sleep(0.02)

        expected = 0
        modes = list(results)
        for rep in range(reps):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                set_mode(mode)
                results[mode].append(driver.calls(n))
                if mode == "recorder":
                    expected += n
                    wait_written(expected)
        set_mode("untraced")
        wait_written(expected)
        stop.set()
        consumer.join()
        summary = session.finish()
        empty.cleanup()
        from store.db import open_store

        with open_store(Path(tmp.name) / "bench.db", readonly=True) as store:
            rows = store.one("SELECT count(*) AS n FROM cuda_call_named WHERE api = ?", (api,))["n"]
            lost = store.one("SELECT coalesce(sum(dropped), 0) AS n FROM loss")["n"]
    finally:
        driver.close()
        tmp.cleanup()

    med = {mode: statistics.median(v) for mode, v in results.items()}
    empty_added = med["empty_pair"] - med["untraced"]
    recorder_added = med["recorder"] - med["untraced"]
    ratio = recorder_added / empty_added if empty_added > 0 else float("inf")
    return {
        "api": api, "calls_per_rep": n, "reps": reps,
        "untraced_before_session_ns": before,
        "ns_per_call": med,
        "ns_per_call_all": results,
        "empty_pair_added_ns": empty_added,
        "uprobe_trap_ns": med["empty_entry"] - med["untraced"],
        "uretprobe_trap_ns": med["empty_return"] - med["untraced"],
        "recorder_added_ns": recorder_added,
        "recorder_vs_empty_pair": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "calls_under_recorder": expected,
        "rows_stored": rows,
        "rows_exact": rows == expected,
        "dropped": lost,
        "session_dropped": summary["dropped"],
        "load_avg": os.getloadavg(),
    }


def render(r: dict) -> str:
    m = r["ns_per_call"]
    lines = [
        f"### Per-call cost of `{r['api']}` (stand-in, zero work), "
        f"median of {r['reps']} x {r['calls_per_rep']:,} calls",
        "",
        "| mode | ns/call | added ns/call | x empty pair |",
        "|---|---:|---:|---:|",
        f"| untraced | {m['untraced']:,.0f} | - | - |",
        f"| empty uprobe alone (the entry's trap) | {m['empty_entry']:,.0f} | {r['uprobe_trap_ns']:,.0f} | - |",
        f"| empty uretprobe alone (the return's trap) | {m['empty_return']:,.0f} | {r['uretprobe_trap_ns']:,.0f} "
        "| - |",
        f"| empty uprobe+uretprobe | {m['empty_pair']:,.0f} | {r['empty_pair_added_ns']:,.0f} "
        "| 1.00 |",
        f"| recorder (Session, consumer running) | {m['recorder']:,.0f} | "
        f"{r['recorder_added_ns']:,.0f} | {r['recorder_vs_empty_pair']:.2f} |",
        "",
        f"- untraced before the session started: {r['untraced_before_session_ns']:,.0f} ns/call",
        f"- target: recorder added cost <= {r['target_ratio']:.0f}x the empty pair's: "
        f"{'met' if r['meets_target'] else 'NOT met'}",
        f"- rows stored: {r['rows_stored']:,} for {r['calls_under_recorder']:,} calls "
        f"({'exact' if r['rows_exact'] else 'MISMATCH'}), dropped {r['dropped']}",
        f"- load average during the run: {', '.join(f'{x:.2f}' for x in r['load_avg'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[-4:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", default="cudaLaunchKernel",
                    choices=("cudaLaunchKernel", "cudaStreamSynchronize"),
                    help="stand-in API to call (configured with zero work)")
    ap.add_argument("-n", type=int, default=50_000,
                    help="calls per repetition (keep under the 65,536 records the ring holds)")
    ap.add_argument("-r", "--reps", type=int, default=11, help="repetitions of each mode")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    reason = skip_reason()
    if reason:
        message = f"bench_cuda_call: skipped: {reason}"
        print(json.dumps({"skipped": reason}) if args.json else message)
        return 0
    result = measure(args.api, args.n, args.reps)
    print(json.dumps(result) if args.json else render(result))
    return 0 if result["rows_exact"] and result["dropped"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
