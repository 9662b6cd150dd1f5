#!/usr/bin/env python3
"""A real GPU training job (benchmarks/bench_gpu_job.py): a 170M-parameter transformer LM in bf16 on one GPU,
DDP over NCCL (world size 1: real libnccl calls), a DataLoader with worker processes, AdamW, a
loss all-reduce and .item() per step. Optional injected faults at given steps (ground truth written
to --out): cpu (3 busy processes on the main thread's CPU for 1.5 s), data (a DataLoader worker
sleeps 1.2 s), ckpt (torch.save of the weights + fsync under a lineage label), alloc (empty the
caching allocator, then a 40 GB allocation: real cudaMalloc), gil (a Python thread spins 600 ms).
--graphs N replays a captured CUDA graph N times at the end. --cpu is a dry run of the same code on
the CPU (small shapes, gloo), for checking the benchmark without a GPU.

    python benchmarks/gpu_job.py --steps 300 --out /tmp/u.json [--markers] [--inject cpu:80,data:120]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--inject", default="")
p.add_argument("--out", required=True)
p.add_argument("--markers", action="store_true")
p.add_argument("--ckpt-dir", default="/var/tmp/gpuckpt")
p.add_argument("--workers", type=int, default=4)
p.add_argument("--graphs", type=int, default=0)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--mark", default="")  # DIR/LABEL: write DIR/started_LABEL at step 30, DIR/done_LABEL at the end
p.add_argument("--cpu", action="store_true")  # a local dry run without a GPU
a = p.parse_args()
V, T, B, D = 32000, 512, 16, 1024

mk = None
if a.markers:
    import recorder as mk

if a.cpu:
    V, T, B, D = 1000, 64, 8, 128
inj = {k: int(v) for k, v in (x.split(":") for x in a.inject.split(",") if x)}
FLAG = "/tmp/gpu_eval_data_stall"
def mono() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


truth = {"inject": inj, "events": [], "pid": os.getpid()}


class Tokens(Dataset):
    def __len__(self):
        return 10**7

    def __getitem__(self, i):
        try:
            os.unlink(FLAG)
            stalled = True
        except FileNotFoundError:
            stalled = False
        if stalled:
            time.sleep(1.2)  # EVAL-LINE data
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, V, (T,), generator=g)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 16, 4 * D, batch_first=True, norm_first=True, dropout=0.0)
        self.body = nn.TransformerEncoder(layer, a.layers)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x):
        return self.head(self.body(self.emb(x), is_causal=False))


def hog_cpu(cpu):
    hogs = [subprocess.Popen(["taskset", "-c", str(cpu), "nice", "-n", "-15", sys.executable, "-c",
                              "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"]) for _ in range(3)]
    return hogs


def spin():
    t = time.perf_counter()
    x = 0
    while time.perf_counter() - t < 0.6:  # EVAL-LINE gil-spinner
        x += 1


def main():
    dev = "cpu" if a.cpu else "cuda"
    dist.init_process_group("gloo" if a.cpu else "nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    if not a.cpu:
        torch.cuda.set_device(0)
    model = LM().to(dev)
    model = nn.parallel.DistributedDataParallel(model, device_ids=None if a.cpu else [0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not a.cpu)
    dl = DataLoader(Tokens(), batch_size=B, num_workers=a.workers, pin_memory=not a.cpu, persistent_workers=True)
    started = done = None
    if a.mark:
        mdir, mlabel = a.mark.rsplit("/", 1)
        started, done = os.path.join(mdir, "started_" + mlabel), os.path.join(mdir, "done_" + mlabel)
    it = iter(dl)
    next(it)
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[min(2, len(cpus) - 1)]
    os.sched_setaffinity(0, {cpu})  # the main thread only (threads and workers made before keep theirs)
    truth["main_cpu"] = cpu
    times = []
    hogs = []
    for step in range(a.steps):
        t0 = time.perf_counter_ns()
        if step == 30 and started:
            open(started, "w").close()
        if mk:
            mk.step(step)
        if inj.get("cpu") == step:
            truth["events"].append({"kind": "cpu", "step": step, "t": mono()})
            hogs = hog_cpu(cpu)
        if inj.get("data") == step:
            truth["events"].append({"kind": "data", "step": step, "t": mono()})
            open(FLAG, "w").close()
        if inj.get("gil") == step:
            truth["events"].append({"kind": "gil", "step": step, "t": mono()})
            threading.Thread(target=spin, name="spinner").start()
        tw = time.perf_counter_ns()
        x = next(it).to(dev, non_blocking=True)  # EVAL-LINE next-batch
        wait = time.perf_counter_ns() - tw
        if wait > 3e8:
            truth["events"].append({"kind": "data-wait", "step": step, "wait_ms": wait / 1e6, "t": mono()})
        with torch.autocast(dev, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reduced = loss.detach()
        dist.all_reduce(reduced)
        reduced.item()  # EVAL-LINE item
        if inj.get("ckpt") == step:
            truth["events"].append({"kind": "ckpt", "step": step, "t": mono()})
            os.makedirs(a.ckpt_dir, exist_ok=True)
            path = os.path.join(a.ckpt_dir, f"step{step}.pt")
            sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            ctx = mk.lineage(f"checkpoint_write/gpurun/step{step}/shard0") if mk else None
            if ctx:
                ctx.__enter__()
            with open(path, "wb") as f:
                torch.save(sd, f)  # EVAL-LINE ckpt
                f.flush()
                os.fsync(f.fileno())
            if ctx:
                ctx.__exit__(None, None, None)
        if inj.get("alloc") == step and not a.cpu:
            truth["events"].append({"kind": "alloc", "step": step, "t": mono()})
            torch.cuda.empty_cache()
            big = torch.empty(20 * 2**30, dtype=torch.bfloat16, device="cuda")  # EVAL-LINE alloc
            del big
            torch.cuda.empty_cache()
        times.append(time.perf_counter_ns() - t0)
    if done:
        open(done, "w").close()
        time.sleep(1.5)  # the sampler reads the recorder's figures while its programs are loaded
    for h in hogs:
        h.wait()
    if a.graphs and not a.cpu:
        s = torch.cuda.Stream()
        xs = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                ys = xs @ xs
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys = xs @ xs
            ys = ys.relu() @ xs
        t0 = time.perf_counter_ns()
        for _ in range(a.graphs):
            g.replay()
        torch.cuda.synchronize()
        truth["graphs"] = {"replays": a.graphs, "ms": (time.perf_counter_ns() - t0) / 1e6}
    w = times[30:]
    truth["steps"] = len(times)
    truth["step_ns"] = times
    truth["median_ms"] = statistics.median(w) / 1e6
    truth["mean_ms"] = statistics.mean(w) / 1e6
    truth["p95_ms"] = sorted(w)[int(len(w) * 0.95)] / 1e6
    truth["total_s"] = sum(w) / 1e9
    truth["cpu_s"] = time.process_time()
    json.dump(truth, open(a.out, "w"))
    print(f"TRAIN median {truth['median_ms']:.2f} ms mean {truth['mean_ms']:.2f} p95 {truth['p95_ms']:.2f} "
          f"loop {truth['total_s']:.2f} s", flush=True)
    dist.destroy_process_group()


main()
