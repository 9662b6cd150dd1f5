"""A training loop pinned to one CPU whose steps are delayed by the job itself, not by a foreign task.

At step --sibling-step a thread of the same process ("spinner") spins on that CPU in native code
(the stand-in library's CPU work: ctypes releases the GIL, as a thread pool's worker would) for
--spin-ms at a higher priority; at step --child-step a forked child process ("worker-spin", as a
data-loader worker) does the same. Every step is marked with recorder.step(n). Prints JSON with the
pid and the spinners' ids.

    python own_contention.py --libdir build/native [--steps 120] [--cpu 1] [--sibling-step 40]
                             [--child-step 80] [--spin-ms 300]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import recorder  # noqa: E402

PR_SET_NAME = 15


def _name_and_raise(name: bytes) -> None:
    """Name the calling thread and give it priority over the training thread, on the same CPU."""
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--cpu", type=int, required=True)
    ap.add_argument("--sibling-step", type=int, default=40)
    ap.add_argument("--child-step", type=int, default=80)
    ap.add_argument("--spin-ms", type=int, default=300)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    rt = ctypes.CDLL(os.path.join(args.libdir, "libcudart.so.12"))
    rt.standin_configure(b"cudaMallocHost", ctypes.c_uint64(args.spin_ms * 1_000_000), ctypes.c_uint64(0), 0)
    rt.cudaMallocHost.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    spinners: dict[str, int] = {}

    def sibling() -> None:
        spinners["sibling_tid"] = threading.get_native_id()
        _name_and_raise(b"spinner")
        ptr = ctypes.c_void_p()
        rt.cudaMallocHost(ctypes.byref(ptr), 4096)  # spins --spin-ms on the CPU, GIL released

    threads = []
    for step in range(args.steps):
        recorder.step(step)
        if step == args.sibling_step:
            threads.append(threading.Thread(target=sibling, name="spinner"))
            threads[-1].start()
        if step == args.child_step:
            child = os.fork()
            if child == 0:
                _name_and_raise(b"worker-spin")
                until = time.monotonic() + args.spin_ms / 1000
                while time.monotonic() < until:
                    pass
                os._exit(0)
            spinners["child_pid"] = child
        until = time.thread_time() + 0.004  # the step's own CPU work
        while time.thread_time() < until:
            sum(range(200))
        time.sleep(0.002)
    for t in threads:
        t.join()
    os.waitpid(spinners["child_pid"], 0)
    print(json.dumps({"pid": os.getpid(), **spinners}), flush=True)


if __name__ == "__main__":
    main()
