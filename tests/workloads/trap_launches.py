"""Calls the launch entry points of the stand-in driver of tests/native/cuda_trap.c through ctypes:
`--launches` cuLaunchKernel (each with arguments of its own: function i, grid (i, 2, 3), block
(4, 5, i % 7 + 1), shared memory i * 16, stream i + 100: the last three on the stack), and as many
cuLaunchKernel_ptsz and cuLaunchKernel_ptds; prints one JSON line with its pid and the calls each
made (standin_calls)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os

ap = argparse.ArgumentParser()
ap.add_argument("--driver", required=True)
ap.add_argument("--launches", type=int, default=200)
args = ap.parse_args()

lib = ctypes.CDLL(args.driver)
lib.standin_configure(b"*", ctypes.c_uint64(0), ctypes.c_uint64(0), 0)
lib.standin_calls.restype = ctypes.c_uint64
u = ctypes.c_uint
names = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernel_ptds")
for name in names:
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    for i in range(1, args.launches + 1):
        ret = fn(0x1000 + i, i, 2, 3, 4, 5, i % 7 + 1, i * 16, i + 100, None, None)
        assert ret == 0, (name, ret)
print(json.dumps({"pid": os.getpid(), "calls": {n: lib.standin_calls(n.encode()) for n in names}}))
