"""A real PyTorch CPU training job, the workload of bench_training_job.py.

A small CNN on synthetic images, trained with SGD from a `DataLoader` with worker processes
(persistent, as real jobs run them), torch's intra-op thread pool, a `torch.save` checkpoint every
`--checkpoint-every` steps, and about 30 stand-in CUDA runtime calls per step (allocations, kernel
launches, copies, one stream synchronisation) through the stand-in libcudart.so.12, so the
recorder's CUDA probes fire at the rate a GPU job's would. The stand-in calls do no work: the step's
time is PyTorch's.

It prints one JSON object at the end: the duration of every step (ns), the job's CPU time (this
process and its reaped DataLoader workers, seconds), its wall time and the number of CUDA calls.

    python benchmarks/training_job.py --libdir build/native [--steps 400] [--workers 2]
                                      [--markers] [--checkpoint-every 50] [--started-file F]
                                      [--done-file F --linger 1]

--markers calls recorder.step(n) at the top of each step. --started-file is written when the first
step starts and --done-file when the last one ends; the job then waits --linger seconds before it
exits, so a benchmark can read the recorder's CPU time and BPF statistics over the training loop
alone, while its programs are still loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parent.parent


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class SyntheticImages(Dataset):
    """Deterministic 3x32x32 images with some per-sample decoding work, as an image pipeline has."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        image = torch.rand(3, 40, 40, generator=generator)
        # crop, flip and normalise: the CPU work a worker does per sample
        top, left = index % 8, (index // 8) % 8
        image = image[:, top:top + 32, left:left + 32]
        if index % 2:
            image = image.flip(2)
        image = (image - 0.5) / 0.25
        return image, index % 10


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )


class StandinCuda:
    """The ~30 runtime calls a step of a GPU job makes, through the stand-in library."""

    def __init__(self, libdir: str) -> None:
        rt = ctypes.CDLL(os.path.join(libdir, "libcudart.so.12"))
        rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        rt.cudaFree.argtypes = [ctypes.c_void_p]
        rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_void_p]
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_void_p]
        rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.rt = rt
        self.stream = ctypes.c_void_p(0x5151)
        self.kernels = [ctypes.c_void_p(0x400000 + 0x40 * k) for k in range(8)]
        self.grid, self.block = Dim3(128, 1, 1), Dim3(256, 1, 1)
        self.calls = 0

    def step(self) -> None:
        rt, stream = self.rt, self.stream
        buf = ctypes.c_void_p()
        rt.cudaMalloc(ctypes.byref(buf), 8 << 20)
        rt.cudaMemcpyAsync(buf, None, 8 << 20, 1, stream)  # host to device: the batch
        for launch in range(24):  # forward and backward kernels
            rt.cudaLaunchKernel(self.kernels[launch % 8], self.grid, self.block, None, 0, stream)
        rt.cudaMemcpyAsync(None, buf, 4096, 2, stream)  # device to host: the loss
        rt.cudaStreamSynchronize(stream)
        rt.cudaFree(buf)
        self.calls += 29


def _cpu_and_switches(workers: list[int]) -> tuple[float, int]:
    """CPU seconds and context switches so far of this process (all threads) and its workers.

    Measured around the training loop only, so the interpreter's start and torch's import, the same
    traced or not, do not dilute the ratios.
    """
    own = resource.getrusage(resource.RUSAGE_SELF)
    cpu = own.ru_utime + own.ru_stime
    switches = own.ru_nvcsw + own.ru_nivcsw
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in workers:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return cpu, switches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libdir", required=True, help="folder of the stand-in libcudart.so.12")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--checkpoint-every", type=int, default=50, metavar="N")
    ap.add_argument("--markers", action="store_true", help="call recorder.step(n) at each step")
    ap.add_argument("--started-file", type=Path, help="written when the first step starts")
    ap.add_argument("--done-file", type=Path, help="written when the last step ends")
    ap.add_argument("--linger", type=float, default=0.0, help="seconds to wait after --done-file")
    args = ap.parse_args()

    step_marker = None
    if args.markers:
        sys.path.insert(0, str(ROOT))
        import recorder

        step_marker = recorder.step
    torch.manual_seed(0)
    cuda = StandinCuda(args.libdir)
    model = small_cnn()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = SyntheticImages(args.steps * args.batch)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                        persistent_workers=args.workers > 0, prefetch_factor=2 if args.workers else None)
    checkpoint_dir = tempfile.mkdtemp(prefix="training-job-")
    durations: list[int] = []
    batches = iter(loader)
    workers = [w.pid for w in getattr(batches, "_workers", [])]
    cpu0, switches0 = _cpu_and_switches(workers)
    if args.started_file:
        args.started_file.write_text("started\n")
    wall0 = time.monotonic_ns()
    for step in range(args.steps):
        start = time.monotonic_ns()
        if step_marker:
            step_marker(step)
        images, labels = next(batches)
        optimiser.zero_grad()
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimiser.step()
        cuda.step()
        if args.checkpoint_every and step % args.checkpoint_every == args.checkpoint_every - 1:
            torch.save(model.state_dict(), os.path.join(checkpoint_dir, "model.pt"))
        durations.append(time.monotonic_ns() - start)
    wall_s = (time.monotonic_ns() - wall0) / 1e9
    cpu1, switches1 = _cpu_and_switches(workers)
    cpu_s, ctx_switches = cpu1 - cpu0, switches1 - switches0
    del batches, loader
    gc.collect()
    if args.done_file:
        args.done_file.write_text("done\n")
        time.sleep(args.linger)
    print(json.dumps({"step_ns": durations, "cpu_s": cpu_s, "wall_s": wall_s, "cuda_calls": cuda.calls,
                      "ctx_switches": ctx_switches, "threads": torch.get_num_threads(), "workers": args.workers}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
