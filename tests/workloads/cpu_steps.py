"""Training-like steps whose excess is CPU time, for the on-CPU profile's tests.

    python cpu_steps.py [--steps 12] [--burn-step 6] [--burn-ms 400] [--libdir build/native --spin-step 9]
                        [--until-sampled STATUS_FILE]

Every step marks itself (recorder.step) and sleeps 20 ms (its wait for "the GPU"). Step --burn-step
also runs Python code for --burn-ms of CPU time at BURN_LINE; with --libdir, step --spin-step calls
the stand-in driver's cuLaunchKernel (at LAUNCH_LINE), configured to spin --burn-ms in the driver.
Prints one JSON line at the end with the thread id, the steps and the lines. --until-sampled: before
the first step, run on the CPU (in bursts) until the recorder's status file counts on-CPU samples
(the profile attaches seconds after the recording began, recorder/layers/profile), at most 120 s.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time

import recorder

BURN_LINE = 30  # the line burn() spends its time at


def burn(ms: int) -> int:
    until, n, i = time.thread_time() + ms / 1000, 0, 0
    while (i := i + 1) % 4096 or time.thread_time() < until: n += len(str(i))  # noqa: E701  (BURN_LINE)
    return n


def until_sampled(status: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        burn(20)
        try:
            with open(status) as f:
                if json.load(f)["events"].get("profile", 0) > 0:
                    return
        except (OSError, ValueError, KeyError):  # not written yet, or being replaced
            pass
        time.sleep(0.01)
    raise SystemExit("the recorder's status file counted no on-CPU sample in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--burn-step", type=int, default=6)
    ap.add_argument("--burn-ms", type=int, default=400)
    ap.add_argument("--libdir")
    ap.add_argument("--spin-step", type=int, default=9)
    ap.add_argument("--until-sampled", metavar="STATUS_FILE")
    args = ap.parse_args()
    if args.until_sampled:
        until_sampled(args.until_sampled)
    cuda = None
    if args.libdir:
        cuda = ctypes.CDLL(os.path.join(args.libdir, "libcuda.so.1"))
        cuda.standin_configure(b"cuLaunchKernel", ctypes.c_uint64(args.burn_ms * 1_000_000), ctypes.c_uint64(0), 0)
    launch_line = 0
    for step in range(args.steps):
        recorder.step(step)
        time.sleep(0.02)
        if step == args.burn_step:
            burn(args.burn_ms)
        if cuda is not None and step == args.spin_step:
            launch_line = _launch(cuda)
    recorder.step(args.steps)
    print(json.dumps({"tid": threading.get_native_id(), "pid": os.getpid(), "burn_step": args.burn_step,
                      "spin_step": args.spin_step if cuda is not None else None, "BURN_LINE": BURN_LINE,
                      "LAUNCH_LINE": launch_line}))


def _launch(cuda) -> int:
    import inspect

    line = inspect.currentframe().f_lineno + 1
    cuda.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    return line


if __name__ == "__main__":
    main()
