"""A CPU stand-in of a real GPU training job's CUDA traffic, for tests and benchmarks without a GPU.

    python standin_gpu_job.py --libdir build/native [--rate 50000] [--seconds 10] [--depth 24]
                              [--launches-per-step 500] [--graphs 0] [--markers] [--worker-launches 0]
                              [--ready-file F] [--wait-file F] [--out F]

The shape is the one a PyTorch job has on a real GPU: kernel launches called from deep in a Python
stack (nn.Module calls nested --depth frames deep, then one of several ops, each calling from its own
line), through the stand-in runtime's `cudaLaunchKernel`, which calls the stand-in driver's exported
`cuLaunchKernel` through a trampoline in executable anonymous memory (as the real runtime calls the
real driver); per step a host-to-device copy, a few `cuLaunchKernelEx` launches straight at the driver
(as cuBLAS and cuDNN make them) and a `cudaStreamSynchronize` (the loss's `.item()`). Calls are paced
at --rate launches a second. `--graphs N` replays a captured CUDA graph N times after the steps;
`--graph-every-step` replays one in every step (before its synchronisation), as a
torch.compile(mode="reduce-overhead") model does, and `--slow-graph-step N` makes that step's
replay take 300 ms of CPU.

Writes one JSON document (to --out, else stdout) with what it did: calls per API, steps, the
interval it was calling in (CLOCK_MONOTONIC ns) and the launch rate it reached, so tests and
benchmarks compare the recording with the job's own account.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from collections import Counter


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("pad", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("num_attrs", ctypes.c_uint)]


class Cuda:
    """The stand-in libraries, with the calls the job makes counted."""

    def __init__(self, libdir: str) -> None:
        self.rt = ctypes.CDLL(os.path.join(libdir, "libcudart.so.12"))
        driver = os.path.join(libdir, "libcuda.so.1")
        if self.rt.standin_use_driver(driver.encode()) != 0:
            raise SystemExit(f"the stand-in runtime could not load {driver}")
        self.drv = ctypes.CDLL(driver)
        rt, drv = self.rt, self.drv
        rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_void_p]
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_void_p]
        rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        rt.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
        rt.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        rt.cudaGraphInstantiate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
        rt.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        drv.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p]
        self.launch = rt.cudaLaunchKernel
        self.stream = ctypes.c_void_p(0x5000)
        self.calls: Counter[str] = Counter()

    def configure(self, api: str, work_us: int = 0, sleep_us: int = 0) -> None:
        lib = self.drv if api.startswith("cu") and not api.startswith("cuda") else self.rt
        lib.standin_configure(api.encode(), ctypes.c_uint64(work_us * 1000), ctypes.c_uint64(sleep_us * 1000), 0)


# -- the model: a module tree as deep as a PyTorch one, ops at the leaves ------------------------
GRID, BLOCK = Dim3(128, 1, 1), Dim3(256, 1, 1)


def linear(cuda: Cuda) -> None:
    cuda.launch(0x7f0000001000, GRID, BLOCK, None, 0, cuda.stream)


def gelu(cuda: Cuda) -> None:
    cuda.launch(0x7f0000002000, GRID, BLOCK, None, 0, cuda.stream)


def layer_norm(cuda: Cuda) -> None:
    cuda.launch(0x7f0000003000, GRID, BLOCK, None, 0, cuda.stream)


def residual_add(cuda: Cuda) -> None:
    cuda.launch(0x7f0000004000, GRID, BLOCK, None, 0, cuda.stream)


OPS = (linear, gelu, layer_norm, residual_add)


class Module:
    def __init__(self, child: Module | None) -> None:
        self.child = child

    def __call__(self, cuda: Cuda, launches: int) -> int:
        return self.forward(cuda, launches)

    def forward(self, cuda: Cuda, launches: int) -> int:
        if self.child is not None:
            return self.child(cuda, launches)
        for i in range(launches):
            OPS[i & 3](cuda)
        return launches


def model(depth: int) -> Module:
    """Each Module adds two frames (__call__, forward)."""
    m = None
    for _ in range(max(1, depth // 2)):
        m = Module(m)
    return m


def capture_graph(cuda: Cuda) -> ctypes.c_void_p:
    graph, graph_exec = ctypes.c_void_p(), ctypes.c_void_p()
    cuda.rt.cudaStreamBeginCapture(cuda.stream, 0)
    cuda.rt.cudaStreamEndCapture(cuda.stream, ctypes.byref(graph))
    cuda.rt.cudaGraphInstantiate(ctypes.byref(graph_exec), graph, 0)
    return graph_exec


def step(cuda: Cuda, net: Module, launches: int, host: ctypes.Array, config: LaunchConfig,
         graph_exec: ctypes.c_void_p | None) -> None:
    cuda.rt.cudaMemcpyAsync(0x7f1000000000, ctypes.addressof(host), len(host), 1, cuda.stream)
    net(cuda, launches)
    for _ in range(4):  # a GEMM library's launches, straight at the driver
        cuda.drv.cuLaunchKernelEx(ctypes.byref(config), 0x7f0000005000, None, None)
    if graph_exec is not None:
        cuda.rt.cudaGraphLaunch(graph_exec, cuda.stream)
    cuda.rt.cudaStreamSynchronize(cuda.stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--rate", type=float, default=50_000, help="kernel launches a second (0: flat out)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--depth", type=int, default=24, help="Python frames above the ops")
    ap.add_argument("--launches-per-step", type=int, default=500)
    ap.add_argument("--graphs", type=int, default=0, help="CUDA graph replays after the steps")
    ap.add_argument("--graph-every-step", action="store_true", help="replay a CUDA graph in every step")
    ap.add_argument("--slow-graph-step", type=int, default=-1, help="this step's replay takes 300 ms of CPU")
    ap.add_argument("--markers", action="store_true", help="mark steps with recorder.step()")
    ap.add_argument("--worker-launches", type=int, default=0,
                    help="per step, a second thread makes this many cuLaunchKernelEx launches (as a backward "
                         "pass's thread does) while the step's thread waits for it")
    ap.add_argument("--slow-sync-step", type=int, default=-1, help="this step's synchronisation waits 300 ms")
    ap.add_argument("--slow-launch-step", type=int, default=-1,
                    help="this step's launches each take 400 us of CPU (a launch queue full, a lock)")
    ap.add_argument("--ready-file", help="written once the libraries are loaded")
    ap.add_argument("--wait-file", help="start calling once this file exists")
    ap.add_argument("--out")
    args = ap.parse_args()

    cuda = Cuda(args.libdir)
    marker = None
    if args.markers:
        import recorder
        marker = recorder.step
    net = model(args.depth)
    host = (ctypes.c_char * 65536)()
    config = LaunchConfig((64, 1, 1), (128, 1, 1), 0, 0, 0x5000, None, 0)
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(os.getpid()))
    while args.wait_file and not os.path.exists(args.wait_file):
        time.sleep(0.01)

    per_step = args.launches_per_step
    go, done = threading.Semaphore(0), threading.Semaphore(0)

    def worker() -> None:
        while True:
            go.acquire()
            for _ in range(args.worker_launches):
                cuda.drv.cuLaunchKernelEx(ctypes.byref(config), 0x7f0000006000, None, None)
            done.release()

    if args.worker_launches:
        threading.Thread(target=worker, name="backward", daemon=True).start()
    graph_exec = capture_graph(cuda) if args.graph_every_step or args.graphs else None
    start = time.monotonic_ns()
    until = start + int(args.seconds * 1e9)
    steps = launches = 0
    durations = []
    while time.monotonic_ns() < until:
        if steps == args.slow_sync_step:
            cuda.configure("cudaStreamSynchronize", sleep_us=300_000)
        if steps == args.slow_launch_step:
            cuda.configure("cudaLaunchKernel", work_us=400)
        if steps == args.slow_graph_step:
            cuda.configure("cudaGraphLaunch", work_us=300_000)
        t0 = time.monotonic_ns()
        if marker:
            marker(steps)
        if args.worker_launches:
            go.release()
            done.acquire()
        step(cuda, net, per_step, host, config, graph_exec if args.graph_every_step else None)
        if steps == args.slow_graph_step:
            cuda.configure("cudaGraphLaunch")
        if steps == args.slow_sync_step:
            cuda.configure("cudaStreamSynchronize")
        if steps == args.slow_launch_step:
            cuda.configure("cudaLaunchKernel")
        durations.append(time.monotonic_ns() - t0)
        steps += 1
        launches += per_step
        if args.rate:  # paced: wait until the launches made so far are due
            due = start + int(launches / args.rate * 1e9)
            ahead = due - time.monotonic_ns()
            if ahead > 0:
                time.sleep(ahead / 1e9)
    end = time.monotonic_ns()

    if args.graphs:
        for _ in range(args.graphs):
            cuda.rt.cudaGraphLaunch(graph_exec, cuda.stream)
        cuda.rt.cudaStreamSynchronize(cuda.stream)

    calls = {name: int(lib.standin_calls(name.encode())) for lib, names in (
        (cuda.rt, ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaStreamBeginCapture",
                   "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaGraphLaunch")),
        (cuda.drv, ("cuLaunchKernel", "cuLaunchKernelEx", "cuStreamSynchronize"))) for name in names}
    durations.sort()
    lines = {op.__name__: op.__code__.co_firstlineno + 1 for op in OPS}  # each op's launch line
    result = {
        "op_lines": lines, "file": os.path.abspath(__file__), "pid": os.getpid(), "tid": threading.get_native_id(),
        "start_ns": start, "end_ns": end, "steps": steps, "calls": calls,
        "launch_rate": launches / ((end - start) / 1e9),
        "step_median_ns": durations[len(durations) // 2] if durations else 0,
        "graph_exec": graph_exec.value if graph_exec is not None else 0,
        "graph_line": capture_graph.__code__.co_firstlineno + 4,  # the instantiation's line
    }
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
