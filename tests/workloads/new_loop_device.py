"""Creates a loop device that did not exist before (LOOP_CTL_ADD with a number above every existing
one), writes to it with O_DIRECT, keeps it a moment so a recorder stores its requests while it
exists, then removes it. Prints one JSON line: the device's name, major, minor and writes made.

    python tests/workloads/new_loop_device.py --image /tmp/new.img [--writes 64]   (root)
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

LOOP_CTL_ADD = 0x4C80
LOOP_CTL_REMOVE = 0x4C81


def add_loop(control: int) -> int:
    existing = [int(p.name[4:]) for p in Path("/sys/block").glob("loop*") if p.name[4:].isdigit()]
    number = max(existing, default=0) + 100
    while True:
        try:
            return fcntl.ioctl(control, LOOP_CTL_ADD, number)
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            number += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", required=True)
    ap.add_argument("--writes", type=int, default=64)
    a = ap.parse_args()
    with open(a.image, "wb") as f:
        f.truncate(8 * 1024 * 1024)
    control = os.open("/dev/loop-control", os.O_RDWR)
    number = add_loop(control)
    name = f"loop{number}"
    try:
        subprocess.run(["losetup", f"/dev/{name}", a.image], check=True)
        try:
            subprocess.run(["dd", "if=/dev/zero", f"of=/dev/{name}", "bs=4k", f"count={a.writes}", "oflag=direct"],
                           check=True, capture_output=True)
            time.sleep(0.6)  # the recorder stores requests every 100 ms: while the device still exists
        finally:
            subprocess.run(["losetup", "-d", f"/dev/{name}"], check=False)
        major, minor = (int(x) for x in Path(f"/sys/block/{name}/dev").read_text().split(":"))
    finally:
        for _ in range(20):  # detaching completes asynchronously; removal fails with EBUSY until then
            try:
                fcntl.ioctl(control, LOOP_CTL_REMOVE, number)
                break
            except OSError:
                time.sleep(0.1)
        os.close(control)
    print(json.dumps({"device": name, "major": major, "minor": minor, "writes": a.writes}))


if __name__ == "__main__":
    main()
