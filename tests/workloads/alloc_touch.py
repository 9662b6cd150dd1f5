"""A marked loop whose every step allocates and touches a buffer in pure Python (`bytearray`: the
C library zeroes it, one page fault a page), then waits on a later line (the step's "sync"). Run in a
memory cgroup whose limit leaves room for the buffer but not for a file's page cache besides:
the step before --reclaim-step reads --file (filling the cgroup with page cache up to its limit),
so in --reclaim-step the touches reclaim that cache (memcg direct reclaim inside the page faults of
the allocation's line). Prints JSON: pid, tid, the lines of the allocation and of the sync.

    python alloc_touch.py --file big.bin [--cgroup-procs /sys/fs/cgroup/memory/x/cgroup.procs]
                          [--steps 10] [--reclaim-step 6] [--mib 48]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import recorder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True, help="read in the step before --reclaim-step")
    ap.add_argument("--cgroup-procs", default=None, help="join this cgroup first")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reclaim-step", type=int, default=6)
    ap.add_argument("--mib", type=int, default=48, help="MiB touched in --reclaim-step")
    ap.add_argument("--step-mib", type=int, default=8, help="MiB touched in the other steps")
    ap.add_argument("--fill-mib", type=int, default=64)
    args = ap.parse_args()
    if args.cgroup_procs:
        with open(args.cgroup_procs, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(0.5)  # the recorder configures the walker for this process meanwhile
    for step in range(args.steps):
        recorder.step(step)
        buf = bytearray((args.mib if step == args.reclaim_step else args.step_mib) << 20)  # @alloc
        del buf
        time.sleep(0.002)  # @sync
        if step == args.reclaim_step - 1:
            with open(args.file, "wb") as f:
                for _ in range(args.fill_mib):
                    f.write(b"x" * (1 << 20))
    recorder.step(args.steps)
    lines = {tag: n for n, text in enumerate(open(__file__).read().splitlines(), 1)
             for tag in ("alloc", "sync") if text.endswith(f"# @{tag}")}
    print(json.dumps({"pid": os.getpid(), "tid": threading.get_native_id(), "lines": lines}), flush=True)


if __name__ == "__main__":
    main()
