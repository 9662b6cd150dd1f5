"""A workload calling the stand-in CUDA libraries with a known pattern, for tests and the demo.

    python cuda_calls.py --libdir build/native --calls 100 [--threads 2] [--work-us 600]
                         [--sleep-us 0] [--gil] [--dlopen-delay 0.5] [--ready-file F]

Prints one JSON line at the end with what it did (calls per thread, thread ids), so tests compare
the recording with the workload's own account.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--calls", type=int, default=100, help="cudaMalloc calls per thread")
    ap.add_argument("--threads", type=int, default=1, help="worker threads besides the main one")
    ap.add_argument("--work-us", type=int, default=600, help="CPU work per cudaMalloc")
    ap.add_argument("--sleep-us", type=int, default=0, help="sleep per cudaMalloc")
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--gil", action="store_true", help="call through the GIL-holding extension too")
    ap.add_argument("--extdir", help="folder with the _gilcall extension for this interpreter")
    ap.add_argument("--dlopen-delay", type=float, default=0.0,
                    help="seconds to wait before loading the library (tests late dlopen)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait after loading before calling")
    ap.add_argument("--driver", action="store_true", help="also call driver APIs")
    ap.add_argument("--wait-file", help="start calling once this file exists (a job already "
                    "running when the recorder attaches)")
    args = ap.parse_args()

    time.sleep(args.dlopen_delay)
    cudart = ctypes.CDLL(os.path.join(args.libdir, "libcudart.so.12"))
    cudart.standin_configure(b"cudaMalloc", ctypes.c_uint64(args.work_us * 1000),
                             ctypes.c_uint64(args.sleep_us * 1000), 0)
    cudart.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    cudart.cudaFree.argtypes = [ctypes.c_void_p]
    cudart.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    cuda = None
    if args.driver:
        cuda = ctypes.CDLL(os.path.join(args.libdir, "libcuda.so.1"))
        cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    gil = None
    if args.gil:
        sys.path.insert(0, args.extdir)
        import _gilcall

        _gilcall.open(os.path.join(args.libdir, "libcudart.so.12"))
        gil = _gilcall
    time.sleep(args.settle)
    while args.wait_file and not os.path.exists(args.wait_file):
        time.sleep(0.05)

    done: dict[int, dict] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        pointers = []
        for _ in range(args.calls):
            ptr = ctypes.c_void_p()
            assert cudart.cudaMalloc(ctypes.byref(ptr), args.size) == 0
            pointers.append(ptr.value)
        for p in pointers:
            cudart.cudaFree(p)
        cudart.cudaStreamSynchronize(ctypes.c_void_p(0x5000 + tid % 1000))
        extra = 0
        if gil is not None:
            err, p = gil.cudaMalloc(args.size)
            assert err == 0
            gil.cudaFree(p)
            extra += 1
        if cuda is not None:
            d = ctypes.c_uint64()
            assert cuda.cuMemAlloc_v2(ctypes.byref(d), args.size) == 0
        done[tid] = {"mallocs": args.calls + extra, "frees": args.calls + extra,
                     "first_pointer": pointers[0] if pointers else None}

    threads = [threading.Thread(target=worker, name=f"worker{i}") for i in range(args.threads)]
    for t in threads:
        t.start()
    worker()
    for t in threads:
        t.join()
    print(json.dumps({"pid": os.getpid(), "threads": done}), flush=True)


if __name__ == "__main__":
    main()
