"""A checkpoint write under a lineage tag, and an untagged write, for tests/test_lineage_bpf.py.

In step 7 a thread writes a checkpoint shard inside `recorder.lineage(LABEL)` (buffered write,
then fsync, so the fsync submits the requests from that thread) and calls cudaMalloc there; in
step 8 another thread, in no lineage scope, does the same with another file. Prints JSON with the
pid, each thread's tid, the label and its tag.

    python tagged_io.py --dir MOUNTPOINT --libdir build/native [--mib 4]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import recorder  # noqa: E402

LABEL = "checkpoint_write/run42/step7/shard3"


def write_shard(path: str, mib: int, rt: ctypes.CDLL, out: dict) -> None:
    out["tid"] = threading.get_native_id()
    ptr = ctypes.c_void_p()
    rt.cudaMalloc(ctypes.byref(ptr), 1 << 20)  # e.g. a staging buffer for the copy to the host
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())


def tagged(path: str, mib: int, rt: ctypes.CDLL, out: dict) -> None:
    with recorder.lineage(LABEL) as scope:
        out["tag"] = scope.tag
        write_shard(path, mib, rt, out)


def run(target, *args) -> dict:
    out: dict = {}
    t = threading.Thread(target=target, args=(*args, out))
    t.start()
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--mib", type=int, default=4)
    a = ap.parse_args()
    rt = ctypes.CDLL(os.path.join(a.libdir, "libcudart.so.12"))
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    recorder.step(7)
    shard = run(tagged, os.path.join(a.dir, "shard3.pt"), a.mib, rt)
    recorder.step(8)
    other = run(write_shard, os.path.join(a.dir, "other.bin"), a.mib, rt)
    print(json.dumps({"pid": os.getpid(), "tagged": shard, "untagged": other, "label": LABEL}), flush=True)


if __name__ == "__main__":
    main()
