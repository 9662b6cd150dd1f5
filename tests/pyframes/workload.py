"""Ground-truth workload for the CPython stack walker (runs under CPython 3.10 to 3.13).

    python workload.py LIBCUDART GILCALL_DIR OUT.json [MODE]

Calls the stand-in cudaMalloc with size = a sequence number, from several threads, generators,
nested calls, methods and a deep recursion, through ctypes (GIL released) and through the _gilcall
extension (GIL held). At every call it records its own stack (file, qualified name, line per frame)
*on the same line as the call*, so the recorded line of the innermost frame is the call site.
MODE "exec" generates fresh code objects in a loop instead. Prints "ready" and waits for a line on
stdin before starting (the test configures the probe then), prints "done" and waits again before
exiting (the test resolves stacks while the process lives).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import sys
import threading
import time

LIB, GILDIR, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
MODE = sys.argv[4] if len(sys.argv) > 4 else "stacks"

sys.path.insert(0, GILDIR)
import _gilcall  # noqa: E402

cudart = ctypes.CDLL(LIB)
cudart.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
_gilcall.open(LIB)

_seq = itertools.count(1)
_lock = threading.Lock()
truth: list[dict] = []


def record(via: str) -> int:
    """The caller's stack as the interpreter sees it; returns the sequence number to pass on."""
    frames = []
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        frames.append([code.co_filename, getattr(code, "co_qualname", code.co_name), f.f_lineno])
        f = f.f_back
    with _lock:
        seq = next(_seq)
        truth.append({"seq": seq, "tid": threading.get_native_id(), "via": via, "frames": frames})
    return seq


def call_ctypes() -> None:
    p = ctypes.c_void_p()
    cudart.cudaMalloc(ctypes.byref(p), record("ctypes"))  # KNOWN CALL SITE (ctypes)


def call_gil() -> None:
    _gilcall.cudaMalloc(record("gil"))  # KNOWN CALL SITE (gil)


def nested(depth: int, gil: bool) -> None:
    if depth:
        nested(depth - 1, gil)
    elif gil:
        call_gil()
    else:
        call_ctypes()


def batches(n: int):
    for i in range(n):
        yield cudart.cudaMalloc(ctypes.byref(ctypes.c_void_p()), record("ctypes"))
        yield _gilcall.cudaMalloc(record("gil"))
        yield i


def outer_generator(n: int):
    yield from batches(n)


class Trainer:
    def step(self, i: int) -> None:
        [call_ctypes() for _ in range(1)]
        (lambda: call_gil())()
        nested(i % 4, gil=bool(i % 2))

    def run(self, steps: int) -> None:
        for i in range(steps):
            self.step(i)
            for _ in outer_generator(1):
                pass


def deep(n: int) -> None:
    if n:
        deep(n - 1)
    else:
        call_ctypes()


# A recursion of large frames (120 locals each, ~1 KiB): 30 levels overflow a 3.11+ thread's data
# stack chunk (16 KiB), so the walker's window reads (bpf/pystack.h) meet a chunk boundary.
_WIDE = ", ".join(f"v{i}" for i in range(120))
exec(compile(f"def wide(n):\n    {_WIDE} = range(120)\n    if n:\n        wide(n - 1)\n"
             f"    else:\n        call_ctypes()\n", "<wide>", "exec"), globals())


def worker(steps: int) -> None:
    Trainer().run(steps)


def run_stacks() -> None:
    threads = [threading.Thread(target=worker, args=(6,), name=f"w{i}") for i in range(3)]
    for t in threads:
        t.start()
    Trainer().run(4)
    deep(80)  # deeper than the walker's 64 frames: truncated, innermost frames kept
    wide(30)  # noqa: F821 - defined by the exec above
    for t in threads:
        t.join()


def run_exec(iterations: int = 300) -> None:
    # Fresh code objects, each freed a few iterations later, so addresses are reused by code with
    # other names and lines. A short pause gives the resolver time to read live ones.
    alive: list[dict] = []
    for i in range(iterations):
        src = f"def gen_{i}():\n" + "\n" * (i % 5) + "    call(byref(c_void_p()), record('exec'))\n"
        ns = {"call": cudart.cudaMalloc, "byref": ctypes.byref, "c_void_p": ctypes.c_void_p,
              "record": record}
        exec(compile(src, f"<gen-{i % 7}>", "exec"), ns)
        ns[f"gen_{i}"]()
        alive.append(ns)
        if len(alive) > 4:
            alive.pop(0)
        time.sleep(0.002)


print("ready", flush=True)
sys.stdin.readline()
if MODE == "exec":
    run_exec()
else:
    run_stacks()
with open(OUT, "w") as out:
    json.dump(truth, out)
print("done", flush=True)
sys.stdin.readline()
