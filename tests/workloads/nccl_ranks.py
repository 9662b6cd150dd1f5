"""A data-parallel job in miniature: N rank processes, each running steps of
cudaLaunchKernel -> ncclAllReduce -> cudaStreamSynchronize through the stand-in libraries, with one
rank slowed before its collective at chosen steps (the straggler).

    python nccl_ranks.py --libdir build/native [--ranks 2] [--steps 20] [--slow-rank 1]
                         [--slow-steps 10,11] [--slow-ms 80] [--hang-rank 1 --hang-step 5]

With --hang-rank, that rank's GPU synchronisation before the collective of --hang-step never
returns (a dead kernel): it never enters the collective, and the other ranks wait in it for ever;
with --hang-step -2 it never calls ncclCommInitRank, and the others wait in theirs. The hung rank
prints {"hung": rank, "pid": ...} as it makes the call that does not return (or instead of the init).

Run without --rank it is the launcher: it creates the communicator's unique id and starts one
process per rank (children, so a recorder following the launcher records every rank), with the
environment torchrun gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RUN_ID --run-id). With --workers N each rank forks N DataLoader-like workers first
(same command line, feeding it through a pipe). Prints one JSON line per rank with its pid, its
workers' pids and step times.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def rank_main(args: argparse.Namespace) -> None:
    # A real rank spends seconds importing its framework before its first collective; this one
    # would call within ~50 ms of its exec, while the recorder may still be configuring its Python
    # stack walker (the call is then recorded with its stack "not configured")
    time.sleep(args.settle_s)
    import recorder  # the marker API: steps visible to the recorder

    workers = [_start_worker() for _ in range(args.workers)]

    nccl = ctypes.CDLL(os.path.join(args.libdir, "libnccl.so.2"))
    rt = ctypes.CDLL(os.path.join(args.libdir, "libcudart.so.12"))
    rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    # the GPU work of a step: the first synchronisation waits for the step's kernels
    rt.standin_configure(b"cudaStreamSynchronize", ctypes.c_uint64(0), ctypes.c_uint64(args.gpu_ms * 1_000_000), 0)
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    uid = UniqueId()
    uid.internal = bytes.fromhex(args.unique_id)
    comm = ctypes.c_void_p()
    if args.rank == args.hang_rank and args.hang_step == -2:  # never joins the communicator
        sys.stdout.write(json.dumps({"hung": args.rank, "pid": os.getpid(), "step": "init"}) + "\n")
        sys.stdout.flush()
        time.sleep(3600)
    assert nccl.ncclCommInitRank(ctypes.byref(comm), args.ranks, uid, args.rank) == 0
    stream = ctypes.c_void_p(0x7000 + args.rank)
    slow = {int(s) for s in args.slow_steps.split(",") if s} if args.rank == args.slow_rank else set()
    times = []
    for step in range(args.steps):
        t0 = time.monotonic()
        recorder.step(step)
        if step in slow:  # this rank is late to the collective: e.g. a slow data loader
            time.sleep(args.slow_ms / 1000)
        end = time.thread_time() + args.cpu_ms / 1000
        while time.thread_time() < end:  # the step's CPU work (a batch prepared on the CPU): a CPU's worth
            pass
        if args.rank == args.hang_rank and step == args.hang_step:  # the kernels never finish
            rt.standin_configure(b"cudaStreamSynchronize", ctypes.c_uint64(0), ctypes.c_uint64(3600 * 10**9), 0)
            sys.stdout.write(json.dumps({"hung": args.rank, "pid": os.getpid(), "step": step}) + "\n")
            sys.stdout.flush()
        for w in workers:  # the step's batch from the data loader
            w.recv()
        rt.cudaStreamSynchronize(stream)  # the step's kernels
        assert nccl.ncclAllReduce(None, None, 1 << 20, 7, 0, comm, stream) == 0
        rt.cudaStreamSynchronize(stream)
        times.append(round(time.monotonic() - t0, 4))
    nccl.ncclCommDestroy(comm)
    # one write per line: ranks share the pipe, and print() writes the newline separately
    sys.stdout.write(json.dumps({"rank": args.rank, "pid": os.getpid(), "step_s": times,
                                 "workers": [w.pid for w in workers]}) + "\n")
    sys.stdout.flush()


class _Worker:
    def __init__(self, pid: int, conn) -> None:
        self.pid, self.conn = pid, conn

    def recv(self) -> None:
        self.conn.recv_bytes()


def _start_worker() -> _Worker:
    """A forked DataLoader-like worker: sends a batch every 2 ms until its rank goes away."""
    import multiprocessing.connection

    ours, theirs = multiprocessing.Pipe()
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            while True:
                time.sleep(0.002)
                theirs.send_bytes(b"x" * 1024)
        except (BrokenPipeError, EOFError, OSError):
            os._exit(0)
    theirs.close()
    return _Worker(pid, ours)


def launcher(args: argparse.Namespace) -> None:
    nccl = ctypes.CDLL(os.path.join(args.libdir, "libnccl.so.2"))
    uid = UniqueId()
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    argv = [sys.executable, os.path.abspath(__file__), "--libdir", args.libdir, "--ranks", str(args.ranks),
            "--steps", str(args.steps), "--slow-rank", str(args.slow_rank), "--slow-steps", args.slow_steps,
            "--slow-ms", str(args.slow_ms), "--gpu-ms", str(args.gpu_ms), "--settle-s", str(args.settle_s),
            "--hang-rank", str(args.hang_rank), "--hang-step", str(args.hang_step), "--workers", str(args.workers),
            "--unique-id", bytes(uid.internal).hex()]
    while args.wait_file and not os.path.exists(args.wait_file):  # a recorder attaching to the launcher
        time.sleep(0.02)
    # what torchrun sets for each rank it starts
    env = {**os.environ, "WORLD_SIZE": str(args.ranks), "LOCAL_WORLD_SIZE": str(args.ranks),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": args.run_id}
    procs = [subprocess.Popen([*argv, "--rank", str(r)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(args.ranks)]
    codes = [p.wait() for p in procs]
    sys.exit(max(codes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--slow-steps", default="10")
    ap.add_argument("--slow-ms", type=int, default=80)
    ap.add_argument("--gpu-ms", type=int, default=4, help="device time per synchronisation")
    ap.add_argument("--cpu-ms", type=float, default=0, help="CPU time each step spends before its collective")
    ap.add_argument("--settle-s", type=float, default=0.5, help="pause before a rank's first call")
    ap.add_argument("--hang-rank", type=int, default=-1, help="rank whose synchronisation never returns")
    ap.add_argument("--hang-step", type=int, default=-1)
    ap.add_argument("--wait-file", help="the launcher starts the ranks once this file exists")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader-like workers each rank forks")
    ap.add_argument("--run-id", default="stall-test", help="TORCHELASTIC_RUN_ID of the ranks")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--unique-id")
    args = ap.parse_args()
    if args.rank is None:
        launcher(args)
    else:
        rank_main(args)


if __name__ == "__main__":
    main()
