"""A Python stack whose caller's code object is swapped out, for tests/test_stack_reads_bpf.py.

    python swapped_code.py [--rounds N]

Each round compiles a fresh function `outer_N` (a new code object: the walker has never read it),
which calls `inner`. `inner` pages out the page that holds the head of outer_N's code object
(madvise(MADV_PAGEOUT): to swap, so swap must be on), checks in /proc/self/pagemap that it is
swapped out, and sleeps 20 ms: the recorder reads the thread's stack at the sleep's end, when
outer_N's code object is not resident, so the walker cannot read it. Then `inner` spins (no system
call, no page of outer_N touched) while the recorder reads the code object back, and returns.
Prints one JSON line: pid, tid and, per round, whether the page was swapped out before the sleep.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time

MADV_PAGEOUT = 21
PAGE = os.sysconf("SC_PAGE_SIZE")
SLEEP_S = 0.02
SPIN_S = 0.5  # the recorder reads the sleep's stack, and the code object back, meanwhile
SETTLE_S = 1.0  # the recorder detects the interpreter meanwhile
PAGEOUT_TRIES = 20

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def swapped(addr: int) -> bool:
    """Whether the page of `addr` is swapped out (pagemap bit 62), without touching it."""
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        entry = int.from_bytes(os.pread(f.fileno(), 8, addr // PAGE * 8), "little")
    return bool(entry >> 62 & 1) and not entry >> 63 & 1


def inner(code_addr: int, out: list[bool]) -> None:
    page = code_addr // PAGE * PAGE
    for _ in range(PAGEOUT_TRIES):  # a page the kernel could not take off its lists yet stays in
        if libc.madvise(page, PAGE, MADV_PAGEOUT) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_PAGEOUT)")
        if swapped(code_addr):
            break
    out.append(swapped(code_addr))
    time.sleep(SLEEP_S)  # @sleep
    end = time.perf_counter() + SPIN_S
    while time.perf_counter() < end:
        pass


def make_outer(n: int):  # type: ignore[no-untyped-def]
    # a long body makes the code object span pages of its own, mostly: its head's page then holds
    # little that the rest of the round touches
    body = "".join(f"        v{i} = {i}\n" for i in range(2000))
    src = f"def outer_{n}(inner, out):\n    if out is None:\n{body}    inner(id(outer_{n}.__code__), out)\n"
    scope: dict = {}
    exec(compile(src, f"<outer_{n}>", "exec"), scope)
    return scope[f"outer_{n}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    # one CPU: a page allocated on another CPU may wait in that CPU's list of new pages, which
    # MADV_PAGEOUT (draining only its own CPU's) cannot take
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    time.sleep(SETTLE_S)
    outers = [make_outer(n) for n in range(args.rounds)]  # kept alive: their code objects too
    results: list[bool] = []
    for f in outers:
        f(inner, results)
    print(json.dumps({"pid": os.getpid(), "tid": threading.get_native_id(), "swapped": results,
                      "sleep_ms": SLEEP_S * 1000}))


if __name__ == "__main__":
    main()
