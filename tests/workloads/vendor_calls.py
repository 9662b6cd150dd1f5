"""Calls into the real vendor libraries right after loading them, as a training script's first
`import torch` does: waits for --wait-file (a recorder attaching to this process), then dlopens
libcudart and at once makes --calls cudaMalloc calls (size 1000 + i) and cudaStreamSynchronize
calls (stream 0x1000 + i), then dlopens libnccl and makes as many ncclAllReduce calls (count
1000 + i, stream 0x2000 + i). No driver here: every call fails, with the code it prints.

    python vendor_calls.py --cudart PATH --nccl PATH [--calls 500] [--wait-file PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cudart", required=True)
    ap.add_argument("--nccl", required=True)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--wait-file")
    args = ap.parse_args()
    while args.wait_file and not os.path.exists(args.wait_file):
        time.sleep(0.02)
    t0 = time.monotonic()
    rt = ctypes.CDLL(args.cudart)
    load_cudart = time.monotonic() - t0
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    ptr = ctypes.c_void_p()
    malloc_ret = [rt.cudaMalloc(ctypes.byref(ptr), 1000 + i) for i in range(args.calls)]
    sync_ret = [rt.cudaStreamSynchronize(0x1000 + i) for i in range(args.calls)]
    t0 = time.monotonic()
    nccl = ctypes.CDLL(args.nccl)
    load_nccl = time.monotonic() - t0
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_void_p]
    nccl_ret = [nccl.ncclAllReduce(None, None, 1000 + i, 7, 0, None, 0x2000 + i) for i in range(args.calls)]
    sys.stdout.write(json.dumps({"pid": os.getpid(), "malloc": sorted(set(malloc_ret)),
                                 "sync": sorted(set(sync_ret)), "allreduce": sorted(set(nccl_ret)),
                                 "load_s": {"cudart": round(load_cudart, 4), "nccl": round(load_nccl, 4)}}) + "\n")
    sys.stdout.flush()
    time.sleep(1)  # live long enough for the recorder to read the process, as a real job does


if __name__ == "__main__":
    main()
