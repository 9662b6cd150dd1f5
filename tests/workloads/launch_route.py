"""Kernel launches through a stand-in CUDA runtime, for the recorder's launch route and its launch
returns: --launches runtime launches (through the stand-in driver with --driver), then, with
--abandon, a driver launch left by longjmp (as an exception thrown through the driver leaves it)
followed by --copies cudaMemcpyAsync calls that launch their copy kernel through the driver, then
--after seconds idle. Prints {"pid", "launches", "copies"} as JSON.

    python launch_route.py --libdir build/native [--driver build/native/libcuda.so.1] [--launches 3000]
                           [--abandon --copies 5] [--after 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libdir", required=True, help="the folder of the libcudart.so.12 to load")
    ap.add_argument("--driver", default=None, help="the libcuda.so.1 the runtime launches through")
    ap.add_argument("--launches", type=int, default=0)
    ap.add_argument("--abandon", action="store_true")
    ap.add_argument("--copies", type=int, default=0)
    ap.add_argument("--after", type=float, default=0.0)
    args = ap.parse_args()
    rt = ctypes.CDLL(os.path.join(args.libdir, "libcudart.so.12"))
    if args.driver and rt.standin_use_driver(args.driver.encode()) != 0:
        raise SystemExit(f"the stand-in runtime could not load {args.driver}")
    rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    kernel, stream = ctypes.c_void_p(0x4000AA), ctypes.c_void_p(0x5151)
    for _ in range(args.launches):
        rt.cudaLaunchKernel(kernel, Dim3(128, 1, 1), Dim3(256, 1, 1), None, 0, stream)
    if args.abandon:
        if rt.standin_abandon_driver_launch() != 0:
            raise SystemExit("the driver launch did not leave by longjmp")
        rt.standin_use_copy_kernels(1)
        for _ in range(args.copies):
            rt.cudaMemcpyAsync(ctypes.c_void_p(0x7000), ctypes.c_void_p(0x8000), 4096, 3, stream)
    time.sleep(args.after)
    print(json.dumps({"pid": os.getpid(), "launches": args.launches, "copies": args.copies}), flush=True)


if __name__ == "__main__":
    main()
