"""A stand-in training loop: each step allocates, launches kernels, synchronises and frees, through
the stand-in CUDA runtime. Pinned to one CPU so a hog pinned there contends with it. With
--markers it calls recorder.step(n) at the top of each step; --slow-step (or --slow-when: the first
step to begin once a file exists) makes one step longer and --jitter varies the host work per step.
SIGINT ends the loop after the step running. Prints the CLOCK_MONOTONIC ns each step began.

    python train_steps.py --libdir build/native [--steps 200] [--cpu 1] [--malloc-work-us 600]
                          [--markers] [--slow-step 40 --slow-ms 300] [--slow-when FILE] [--jitter 0.3]
                          [--hog-step 30 --hog "busy_loop 1" --long-launch-ms 150]
                          [--no-step-malloc] [--once-malloc-step 60 --once-malloc-ms 400]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cpu", type=int, default=None)
    ap.add_argument("--malloc-work-us", type=int, default=600)
    ap.add_argument("--launch-work-us", type=int, default=40)
    ap.add_argument("--sync-sleep-us", type=int, default=4000)
    ap.add_argument("--step-sleep-us", type=int, default=2000)
    ap.add_argument("--host-work-us", type=int, default=6000,
                    help="CPU work in Python per step (data loading, bookkeeping)")
    ap.add_argument("--markers", action="store_true", help="call recorder.step(n) at each step")
    ap.add_argument("--quiet", action="store_true", help="print no JSON at the end (the demo)")
    ap.add_argument("--slow-step", type=int, default=-1, help="this step sleeps --slow-ms longer")
    ap.add_argument("--slow-ms", type=int, default=300)
    ap.add_argument("--slow-when", default=None, help="the first step to begin once this file exists sleeps "
                                                      "--slow-ms longer")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="host work varies per step by up to this fraction, either way")
    ap.add_argument("--hog-step", type=int, default=-1,
                    help="this step starts --hog (a helper process, on the same CPU) and then makes one "
                         "--long-launch-ms launch, which the hog preempts")
    ap.add_argument("--hog", default="", help="the helper's command line")
    ap.add_argument("--long-launch-ms", type=int, default=150, help="CPU work of the long launch")
    ap.add_argument("--no-step-malloc", action="store_true", help="no cudaMalloc/cudaFree in every step")
    ap.add_argument("--once-malloc-step", type=int, default=-1,
                    help="this step begins with one cudaMalloc of 1 GiB spending --once-malloc-ms on the CPU")
    ap.add_argument("--once-malloc-ms", type=int, default=400)
    args = ap.parse_args()
    step_marker = None
    if args.markers:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        import recorder

        step_marker = recorder.step
    rng = random.Random(1)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    rt = ctypes.CDLL(os.path.join(args.libdir, "libcudart.so.12"))
    rt.standin_configure(b"cudaMalloc", ctypes.c_uint64(args.malloc_work_us * 1000), ctypes.c_uint64(0), 0)
    rt.standin_configure(b"cudaLaunchKernel", ctypes.c_uint64(args.launch_work_us * 1000), ctypes.c_uint64(0), 0)
    rt.standin_configure(b"cudaStreamSynchronize", ctypes.c_uint64(0),
                         ctypes.c_uint64(args.sync_sleep_us * 1000), 0)
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_void_p]
    rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    stream = ctypes.c_void_p(0x5151)
    kernel = ctypes.c_void_p(0x4000AA)

    def long_launch() -> None:
        rt.standin_configure(b"cudaLaunchKernel", ctypes.c_uint64(args.long_launch_ms * 1_000_000),
                             ctypes.c_uint64(0), 0)
        rt.cudaLaunchKernel(kernel, Dim3(128, 1, 1), Dim3(256, 1, 1), None, 0, stream)  # the long launch
        rt.standin_configure(b"cudaLaunchKernel", ctypes.c_uint64(args.launch_work_us * 1000), ctypes.c_uint64(0), 0)

    helpers, briefs = [], []
    step_times, step_starts = [], []
    slow_step = args.slow_step
    stopping = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    for step in range(args.steps):
        if stopping:
            break
        step_starts.append(time.monotonic_ns())
        if args.slow_when and slow_step < 0 and os.path.exists(args.slow_when):
            slow_step = step
        if step_marker:
            step_marker(step)
        t0 = time.monotonic()
        ptr = ctypes.c_void_p()
        if step == args.once_malloc_step:
            rt.standin_configure(b"cudaMalloc", ctypes.c_uint64(args.once_malloc_ms * 1_000_000), ctypes.c_uint64(0), 0)
            rt.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 1 << 30)  # the once-only allocation
            rt.standin_configure(b"cudaMalloc", ctypes.c_uint64(args.malloc_work_us * 1000), ctypes.c_uint64(0), 0)
        if not args.no_step_malloc:
            rt.cudaMalloc(ctypes.byref(ptr), 64 << 20)
        for _ in range(3):
            rt.cudaLaunchKernel(kernel, Dim3(128, 1, 1), Dim3(256, 1, 1), None, 0, stream)
        if step == args.hog_step:
            # a thread that sets no name and is gone before the recorder reads its /proc entry
            brief = threading.Thread(target=lambda: briefs.append(threading.get_native_id()))
            brief.start()
            brief.join()
            helpers.append(subprocess.Popen(shlex.split(args.hog)))  # the hog starts here
            time.sleep(0.02)  # the last line with a stack before the hog's first preemptions
            until = time.thread_time() + 0.003
            while time.thread_time() < until:  # a little Python work, preempted first
                sum(range(200))
            long_launch()  # most of the preemptions
        rt.cudaStreamSynchronize(stream)
        if not args.no_step_malloc:
            rt.cudaFree(ptr)
        host_s = args.host_work_us / 1e6 * (1 + rng.uniform(-args.jitter, args.jitter))
        until = time.thread_time() + host_s
        while time.thread_time() < until:
            sum(range(200))
        time.sleep(args.step_sleep_us / 1e6 + (args.slow_ms / 1000 if step == slow_step else 0))
        step_times.append(time.monotonic() - t0)
    for helper in helpers:
        helper.wait()
    if args.quiet:
        return
    print(json.dumps({"pid": os.getpid(), "steps": len(step_times), "slow_step": slow_step,
                      "brief_thread_tids": briefs,
                      "max_step_s": round(max(step_times), 4), "step_start_ns": step_starts}), flush=True)


if __name__ == "__main__":
    main()
