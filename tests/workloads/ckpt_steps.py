"""A training loop in miniature for tests/test_explain_real.py: steps of ~30 ms of "work" (a
sleep), and at one step a checkpoint shard written and fsync'd under recorder.lineage and
recorder.checkpoint. Joins a blkio cgroup first when asked (so the write is throttled), and can
write a kernel log record while the fsync is in flight. Prints JSON: pid, tid, the checkpoint
step, and the line numbers of the fsync and of the step marker.

    python ckpt_steps.py --dir MOUNT [--steps 30] [--ckpt-step 20] [--size 1048576]
                         [--cgroup-procs PATH] [--kmsg TEXT]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import recorder  # noqa: E402  (the marker API)

LABEL = "checkpoint_write/run7/step{step}/shard0"


def kmsg_later(text: str, delay: float) -> None:
    time.sleep(delay)
    with open("/dev/kmsg", "w") as f:
        f.write(f"<4>{text}\n")


def save_checkpoint(path: str, size: int, step: int, kmsg: str | None) -> None:
    with recorder.lineage(LABEL.format(step=step)), recorder.checkpoint(path):
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            if kmsg:
                threading.Thread(target=kmsg_later, args=(kmsg, 0.1), daemon=True).start()
            os.fsync(f.fileno())  # FSYNC_LINE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ckpt-step", type=int, default=20)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--cgroup-procs")
    ap.add_argument("--kmsg")
    args = ap.parse_args()
    if args.cgroup_procs:
        with open(args.cgroup_procs, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(0.5)  # let the recorder look at this process before the first step
    for step in range(args.steps):
        recorder.step(step)  # STEP_LINE
        time.sleep(0.03)  # the step's work
        if step == args.ckpt_step:
            save_checkpoint(os.path.join(args.dir, f"shard0-step{step}.pt"), args.size, step, args.kmsg)
    source = inspect.getsource(sys.modules[__name__]).splitlines()
    lines = {tag: next(n for n, t in enumerate(source, 1) if t.rstrip().endswith(f"# {tag}"))
             for tag in ("FSYNC_LINE", "STEP_LINE")}
    print(json.dumps({"pid": os.getpid(), "tid": threading.get_native_id(), "ckpt_step": args.ckpt_step,
                      "label": LABEL.format(step=args.ckpt_step), **lines}))


if __name__ == "__main__":
    main()
