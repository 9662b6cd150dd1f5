"""Writes and reads of known sizes, each from its own thread, for tests/test_io_bpf.py: buffered
writes of 2 MiB and 8 MiB (each fsync'd, so the fsync submits the writeback from that thread), an
O_DIRECT write of 1 MiB and one of 4 MiB (one pwrite each), and an O_DIRECT read of the 4 MiB file
(one pread). Prints JSON with each thread's tid and the bytes it wrote or read.

    python sized_io.py --dir MOUNTPOINT
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time

MIB = 1 << 20


def buffered_write(path: str, size: int, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    out["bytes"] = size


def direct_write(path: str, size: int, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(size))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        out["bytes"] = os.pwrite(fd, buf, 0)
    finally:
        os.close(fd)


def direct_read(path: str, size: int, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    buf = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        out["bytes"] = os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)


def run(fn, *args) -> dict:
    out: dict = {}
    t = threading.Thread(target=fn, args=(*args, out))
    t.start()
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    time.sleep(0.5)  # the recorder is attached by now
    d = a.dir
    result = {
        "pid": os.getpid(),
        "buffered_2m": run(buffered_write, f"{d}/b2.bin", 2 * MIB),
        "buffered_8m": run(buffered_write, f"{d}/b8.bin", 8 * MIB),
        "direct_1m": run(direct_write, f"{d}/d1.bin", 1 * MIB),
        "direct_4m": run(direct_write, f"{d}/d4.bin", 4 * MIB),
        "direct_read_4m": run(direct_read, f"{d}/d4.bin", 4 * MIB),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
