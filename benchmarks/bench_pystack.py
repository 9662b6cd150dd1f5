"""Per-call cost of capturing the CPython stack at a uprobe (bpf/pystack.h), in one run.

    sudo python3 benchmarks/bench_pystack.py [--calls 20000] [--depth 20] [--repeat 5] [--distinct]

Calls the stand-in cudaMalloc through ctypes from a Python stack `--depth` frames deep and times
it: untraced, under an empty uprobe+uretprobe pair (the floor any traced call pays), under a uprobe
that emits its call record and captures the stack, and under that plus the uretprobe (what a
recorder layer attaches to a CUDA API). Prints median microseconds per call over --repeat rounds
of --calls calls, the modes interleaved round by round; the ring buffers are drained between
batches, outside the timed region. "added vs pair" compares what the probes add to an untraced call;
"call vs pair" the whole traced call with the same call under the empty pair. The last mode is the
full capture with the code-object cache off (every walk reads every code object's head, as before
the walker kept checksums across walks), for the comparison in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "pyframes"))  # the probe the tests use
import harness  # noqa: E402
from recorder.core.pyframes import PyStackProbe, bpf_source, parse_pystack_event  # noqa: E402

BATCH = 1000


def nest(depth: int, fn: Callable[[], None]) -> None:
    if depth:
        nest(depth - 1, fn)
    else:
        fn()


def distinct_chain(depth: int) -> Callable[[Callable[[], None]], None]:
    """A chain of `depth` distinct functions (each its own code object, as in a real model's
    stack), the outermost of which calls fn at the bottom: nest() without the recursion."""
    ns: dict = {}
    src = "".join(f"def level_{i}(fn):\n    return level_{i + 1}(fn)\n" for i in range(depth))
    src += f"def level_{depth}(fn):\n    return fn()\n"
    exec(compile(src, "<chain>", "exec"), ns)
    return ns["level_0"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="calls per round (default 20000)")
    ap.add_argument("--depth", type=int, default=20, help="extra Python frames (default 20)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per mode, interleaved (default 5)")
    ap.add_argument("--distinct", action="store_true",
                    help="the extra frames are distinct functions, not one recursive function")
    args = ap.parse_args()
    if reason := harness.bpf_unavailable():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1

    lib, _ = harness.build_native(Path(tempfile.mkdtemp(prefix="bench-pystack-")), sys.executable)
    cudart = ctypes.CDLL(str(lib))
    malloc = cudart.cudaMalloc
    malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    ptr = ctypes.c_void_p()
    ref = ctypes.byref(ptr)

    from bcc import BPF

    harness.ensure_kernel_headers()
    text = bpf_source() + harness.PROBE_TEXT
    bpf = BPF(text=text, cflags=["-Wno-unused-function"])
    probe = PyStackProbe(bpf)
    probe.install()
    target = probe.configure(os.getpid())
    cache_state = probe.code_cache.get(os.getpid())  # None: on (the modes below switch it)
    frames_seen: list[int] = []
    bpf["pystacks"].open_ring_buffer(
        lambda _c, d, s: frames_seen.append(len(parse_pystack_event(ctypes.string_at(d, s)).frames))
    )
    bpf["calls"].open_ring_buffer(lambda _c, _d, _s: None)

    chain = distinct_chain(args.depth) if args.distinct else None

    def run_round() -> float:
        elapsed = 0.0
        for _ in range(args.calls // BATCH):
            def batch() -> None:
                nonlocal elapsed
                t0 = time.perf_counter_ns()
                for i in range(BATCH):
                    malloc(ref, i)
                elapsed += time.perf_counter_ns() - t0

            if chain is None:
                nest(args.depth, batch)
            else:
                chain(batch)
            bpf.ring_buffer_consume()
        return elapsed / (args.calls // BATCH * BATCH) / 1000

    cache_off = "uprobe + stack capture + uretprobe, no code cache"
    modes: list[tuple[str, list[tuple[str, str]]]] = [
        ("untraced", []),
        ("empty uprobe+uretprobe", [("u", "on_call_empty"), ("r", "on_return_empty")]),
        ("uprobe + stack capture", [("u", "on_call")]),
        ("uprobe + stack capture + uretprobe", [("u", "on_call"), ("r", "on_return_empty")]),
        (cache_off, [("u", "on_call"), ("r", "on_return_empty")]),
    ]
    # the modes interleaved, round by round: the trap cost drifts with the machine's load
    rounds: dict[str, list[float]] = {name: [] for name, _ in modes}
    for rep in range(args.repeat + 1):
        for name, probes in modes:
            probe.configure(os.getpid(), code_cache=name != cache_off)
            for kind, fn in probes:
                attach = bpf.attach_uprobe if kind == "u" else bpf.attach_uretprobe
                attach(name=str(lib), sym="cudaMalloc", fn_name=fn)
            us = run_round()
            if rep:  # the first round of each mode warms up
                rounds[name].append(us)
            for kind, _fn in probes:
                detach = bpf.detach_uprobe if kind == "u" else bpf.detach_uretprobe
                detach(name=str(lib), sym="cudaMalloc")
    results = {name: statistics.median(v) for name, v in rounds.items()}

    base, pair = results["untraced"], results["empty uprobe+uretprobe"]
    print(f"CPython {sys.version.split()[0]}, target {target}")
    print(f"extra frames: {args.depth} {'distinct functions' if args.distinct else 'recursive calls of one function'};"
          f" load average {os.getloadavg()[0]:.2f}")
    print(f"code objects cached across walks: {cache_state or 'yes'}")
    print(f"stack depth recorded: median {statistics.median(frames_seen or [0]):.0f} frames; "
          f"counts {probe.counts()}")
    # "added vs pair": the probes' cost over the empty pair's; "call vs pair": the whole traced call
    # (ctypes, the function, the probes) over the same call under the empty pair (the per-call cost target)
    print(f"{'mode':40} {'us/call':>9} {'added':>9} {'added vs pair':>14} {'call vs pair':>13}")
    for name, us in results.items():
        added = us - base
        ratio = f"{added / (pair - base):.2f}x" if name != "untraced" else ""
        whole = f"{us / pair:.2f}x" if name != "untraced" else ""
        print(f"{name:40} {us:9.2f} {added:9.2f} {ratio:>14} {whole:>13}")
    bpf.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
