"""Block I/O from known threads, for tests/test_io_bpf.py: joins the given cgroups first, then
direct writes, an fsync'd buffered write and direct reads, each in a named thread; prints JSON
with each thread's tid and what it did."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time


def join(procs: str) -> None:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


def direct_write(path: str, count: int, size: int, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    buf = mmap.mmap(-1, size)
    buf.write(b"x" * size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    t0 = time.monotonic()
    for i in range(count):
        os.pwrite(fd, buf, i * size)
    os.close(fd)
    out["seconds"] = time.monotonic() - t0


def fsync_write(path: str, size: int, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    t0 = time.monotonic()
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    out["seconds"] = time.monotonic() - t0


def direct_read(path: str, count: int, size: int, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    buf = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    t0 = time.monotonic()
    for i in range(count):
        os.preadv(fd, [buf], i * size)
    os.close(fd)
    out["seconds"] = time.monotonic() - t0


def buffered_read(path: str, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def run(name: str, fn, *args) -> dict:
    out: dict = {}
    t = threading.Thread(target=fn, args=(*args, out), name=name)
    t.start()
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cgroup-procs", action="append", default=[])
    ap.add_argument("--mode", choices=["io", "reclaim"], default="io")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--size", type=int, default=65536)
    a = ap.parse_args()
    for procs in a.cgroup_procs:
        join(procs)
    time.sleep(0.5)  # the recorder is attached by now; the throttle applies from here on
    result = {"pid": os.getpid()}
    if a.mode == "io":
        result["direct_write"] = run("dwriter", direct_write, f"{a.dir}/direct.bin", a.count, a.size)
        result["fsync_write"] = run("fwriter", fsync_write, f"{a.dir}/fsync.bin", a.count * a.size)
        result["direct_read"] = run("dreader", direct_read, f"{a.dir}/direct.bin", a.count, a.size)
    else:
        result["reader"] = run("mreader", buffered_read, f"{a.dir}/big.bin")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
