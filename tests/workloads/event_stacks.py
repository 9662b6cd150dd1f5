"""Events at known Python lines, for tests/test_event_stacks_bpf.py: each line the test looks for
ends with a tag comment (`# @sleep`), and the test reads its line number from this file.

    python event_stacks.py --libdir build/native [--dir MOUNT] [--cgroup-procs FILE]

The main thread sleeps, waits on a pipe, marks steps, lineage and checkpoint scopes, makes an NCCL
collective (one rank, the stand-in libnccl) and, with --dir, writes a file and fsyncs it, then
writes with O_DIRECT. Prints one JSON line with its pid and tid.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import recorder  # noqa: E402  (the marker API)

SETTLE_S = 1.0  # the recorder detects the interpreter and attaches the markers meanwhile


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def wait_for_pipe() -> None:
    r, w = os.pipe()
    threading.Timer(0.2, os.write, (w, b"x")).start()
    os.read(r, 1)  # @pipe
    os.close(r)
    os.close(w)


def collective(libdir: str) -> None:
    nccl = ctypes.CDLL(os.path.join(libdir, "libnccl.so.2"))
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    uid = UniqueId()
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    comm = ctypes.c_void_p()
    assert nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
    assert nccl.ncclAllReduce(None, None, 1024, 7, 0, comm, None) == 0  # @allreduce
    nccl.ncclCommDestroy(comm)


def checkpoint_write(path: str, size: int) -> None:
    with recorder.checkpoint(path):  # @checkpoint
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())  # @fsync


def direct_write(path: str, count: int, size: int) -> None:
    buf = mmap.mmap(-1, size)
    buf.write(b"y" * size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    for i in range(count):
        os.pwrite(fd, buf, i * size)  # @direct
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--dir", help="a folder on the disk to write to (a loop device in the tests)")
    ap.add_argument("--cgroup-procs", help="join this cgroup v1 first (a blkio throttle)")
    ap.add_argument("--size", type=int, default=1 << 20)
    a = ap.parse_args()
    if a.cgroup_procs:
        with open(a.cgroup_procs, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(SETTLE_S)
    for step in range(3):
        recorder.step(step)  # @step
    time.sleep(0.2)  # @sleep
    wait_for_pipe()
    collective(a.libdir)
    with recorder.lineage("event_stacks/run1"):  # @lineage
        if a.dir:
            checkpoint_write(os.path.join(a.dir, "ckpt.bin"), a.size)
            direct_write(os.path.join(a.dir, "direct.bin"), 8, 65536)
    time.sleep(0.5)  # stacks are resolved from the live process
    sys.stdout.write(json.dumps({"pid": os.getpid(), "tid": threading.get_native_id()}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
