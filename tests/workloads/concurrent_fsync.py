"""Concurrent fsyncs of a block device, for tests/test_losses_bpf.py: each fsync of the device
sends one empty flush bio, and flushes of several threads are in flight at once.

    python concurrent_fsync.py DEVICE [--threads N] [--rounds M]

N threads each write 4 KiB at an offset of their own and fsync the device, M times. The writes are
direct (O_DIRECT): each is a request of its own writer (a buffered write's page could be written back
by another thread's fsync, which writes every dirty page of the device), and no two are adjacent (none
merges into another's request). Prints one JSON line: pid and the tids of the writers.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("device")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    tids: list[int] = []
    start = threading.Barrier(args.threads)

    def writer(i: int) -> None:
        tids.append(threading.get_native_id())
        fd = os.open(args.device, os.O_WRONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4096)  # page-aligned, as direct I/O needs
        start.wait()
        for n in range(args.rounds):
            buf[:] = os.urandom(4096)
            os.pwritev(fd, [buf], (i * args.rounds + n) * 2 * 4096)
            os.fsync(fd)
        os.close(fd)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"pid": os.getpid(), "writers": sorted(tids), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
