"""Synthetic recordings of a multi-host job: one SQLite file per node, several ranks each, one rank
late in a known step for a known reason. No root, no BPF.

Every node writes what a real recorder on that host would: its own session (its hostname, its
own CLOCK_MONOTONIC, which began at its own boot, and the wall-clock offset it measured, off by
the host's clock error), and per rank a process, its main thread, its communicator (the same
comm_hash on every rank), step marks, and per step one all-reduce followed by the stream
synchronisation where, as with NCCL, the rank waits for the collective to complete. In the stall
step the late rank first writes a checkpoint shard and its fsync waits 3.4 s on an NVMe write
that times out (the kernel log lines the kernel prints, parsed by the recorder's own parser), so
every other rank waits for it in the collective. `recorder cluster explain` must name that rank,
its node and database, and the NVMe timeout under save_checkpoint() at train.py:212.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from recorder.demo import STACK_ALLREDUCE, STACK_CKPT, STACK_STEP, STACK_SYNC, STATE_D, Synth
from recorder.layers import cuda
from recorder.layers.workload import nccl
from store.db import open_store

MS = 1_000_000
US = 1_000
EPOCH = 1_777_410_000 * 1_000_000_000  # 2026-04-28T20:20:00Z: the job's first step, in Unix ns
COMM_HASH = 0x2C4B_71D0_93E5_A617
FIRST_STEP = 80_000
STALL_STEP = 80_042


@dataclass
class ClusterSpec:
    nodes: int = 4
    ranks_per_node: int = 8
    steps: int = 60
    late_rank: int = 17  # global rank made late (node late_rank // ranks_per_node)
    stall_step: int = STALL_STEP
    stall_ms: float = 3_400.0  # how long the late rank's fsync waits on the NVMe write
    clock_error_ms: float = 2.0  # each host's wall clock is off by up to this much
    skew_ms: dict[int, float] | None = None  # extra wall-clock error of given nodes (node index -> ms)
    exit_jitter_ms: float = 0.06  # how far apart the ranks leave a collective
    blocking_collectives: bool = False  # True: the collective call itself waits (as the test stand-in)
    hang: bool = False  # the late rank never comes back: the stall step is the last one
    seed: int = 7

    def node_name(self, n: int) -> str:
        return f"node-{n:02d}"


def _stall_step_valid(spec: ClusterSpec) -> None:
    if not FIRST_STEP <= spec.stall_step < FIRST_STEP + spec.steps:
        raise ValueError(f"stall step {spec.stall_step} is outside steps {FIRST_STEP}..{FIRST_STEP + spec.steps - 1}")


def write_cluster(folder: str | Path, spec: ClusterSpec | None = None) -> list[Path]:
    """Write one recording per node into `folder` (node-00.db, ...); returns their paths."""
    spec = spec or ClusterSpec()
    _stall_step_valid(spec)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    world = spec.nodes * spec.ranks_per_node
    # the job's timeline in true time (ns after EPOCH): per step, each rank's arrival at the
    # collective and the moment the collective completes on every rank
    steps = spec.steps if not spec.hang else spec.stall_step - FIRST_STEP + 1
    timeline = []
    t = 0
    for i in range(steps):
        n = FIRST_STEP + i
        start = [t + rng.randrange(0, 200 * US) for _ in range(world)]
        compute = [s + int(380 * MS * (1 + rng.uniform(-0.01, 0.01))) for s in start]
        if n == spec.stall_step:
            compute[spec.late_rank] += int(spec.stall_ms * MS) + 40 * MS
        done = max(compute) + 3 * MS  # the all-reduce itself, once every rank is in
        exits = [done + rng.randrange(0, max(1, int(spec.exit_jitter_ms * MS))) for _ in range(world)]
        timeline.append((n, start, compute, exits))
        t = done + 8 * MS
    end = t + 50 * MS
    if spec.hang:  # the late rank never arrives: nobody leaves the last collective
        n, start, compute, _ = timeline[-1]
        end = start[spec.late_rank] + 30_000 * MS  # the recorders were stopped 30 s later
        timeline[-1] = (n, start, [c if r != spec.late_rank else None for r, c in enumerate(compute)], None)
    paths = []
    for node in range(spec.nodes):
        boot = (node + 1) * 7_919 * NS_S + rng.randrange(0, NS_S)  # ns of true time each host booted before EPOCH
        error = int(rng.uniform(-spec.clock_error_ms, spec.clock_error_ms) * MS)
        error += int((spec.skew_ms or {}).get(node, 0) * MS)
        path = folder / f"{spec.node_name(node)}.db"
        path.unlink(missing_ok=True)
        with open_store(path, create=True) as store:
            _write_node(store, spec, node, boot, error, timeline, end)
        paths.append(path)
    return paths


NS_S = 1_000_000_000


def _write_node(store, spec: ClusterSpec, node: int, boot: int, error: int, timeline: list, end: int) -> None:
    s = Synth(store, "cluster")
    mono = lambda true_ns: true_ns + boot  # noqa: E731  this host's CLOCK_MONOTONIC
    store.conn.execute(
        "UPDATE session SET hostname = ?, started_ts = ?, wall_offset_ns = ?, boot_id = ?, target = ?, command = ?"
        " WHERE id = ?",
        (spec.node_name(node), mono(-200 * MS), EPOCH - boot + error, f"boot-{node:02d}",
         f"synthetic job: {spec.nodes} nodes x {spec.ranks_per_node} ranks",
         "recorder cluster demo", s.session_id))
    api_ar = nccl.API_INDEX["ncclAllReduce"]
    api_sync = cuda.API_INDEX["cudaStreamSynchronize"]
    st_step, st_ar, st_sync = s.stack(STACK_STEP), s.stack(STACK_ALLREDUCE), s.stack(STACK_SYNC)
    marks, calls, syncs, comms = [], [], [], []
    late_thread = None
    for j in range(spec.ranks_per_node):
        rank = node * spec.ranks_per_node + j
        pid = 4100 + 10 * j
        process_id = s.process(pid, "python3", f"python3 /srv/job/train.py --run run42 --local-rank {j}")
        thread_id = s.thread(process_id, pid, "python3")
        s.thread(process_id, pid + 3, "cuda-EvtHandlr")
        handle = 0x5600_0000 + pid
        stream = 0x7F00 + j
        comms.append((s.session_id, process_id, handle, COMM_HASH, rank, spec.nodes * spec.ranks_per_node,
                      mono(-150 * MS)))
        if rank == spec.late_rank:
            late_thread = (thread_id, pid)
        for n, start, compute, exits in timeline:
            marks.append((s.session_id, mono(start[rank]), thread_id, n, 0, st_step))
            if compute[rank] is None:
                continue
            arrive = mono(compute[rank])
            leave = mono(exits[rank]) if exits else None
            if spec.blocking_collectives:
                dur = (leave - arrive) if leave else None
                if dur is not None:
                    calls.append((s.session_id, arrive, dur, thread_id, api_ar, 0, 25_000_000, 9, 0, None, handle,
                                  stream, 7, st_ar))
                    syncs.append((s.session_id, leave + 10 * US, 2 * MS, thread_id, api_sync, 0, stream, 7, st_sync))
            else:  # NCCL enqueues and returns; the rank waits in the synchronisation that follows
                calls.append((s.session_id, arrive, 25 * US, thread_id, api_ar, 0, 25_000_000, 9, 0, None, handle,
                              stream, 7, st_ar))
                if leave:
                    syncs.append((s.session_id, arrive + 40 * US, leave - arrive - 40 * US, thread_id, api_sync, 0,
                                  stream, 7, st_sync))
    store.conn.executemany("INSERT INTO nccl_comm (session_id, process_id, handle, comm_hash, rank, nranks, init_ts)"
                           " VALUES (?,?,?,?,?,?,?)", comms)
    store.conn.executemany("INSERT INTO step_mark (session_id, ts, thread_id, step, inferred, python_stack_id)"
                           " VALUES (?,?,?,?,?,?)", marks)
    store.conn.executemany(
        "INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, count, datatype, op, peer, handle,"
        " stream, cgroup_id, python_stack_id) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", calls)
    store.conn.executemany(
        "INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, stream, cgroup_id, python_stack_id)"
        " VALUES (?,?,?,?,?,?,?,?,?)", syncs)
    if late_thread is not None:
        _checkpoint_stall(s, spec, late_thread[0], timeline, mono, mono(end))
    s.finish(mono(end) - 100 * MS)


def _checkpoint_stall(s: Synth, spec: ClusterSpec, thread_id: int, timeline: list, mono, stop: int) -> None:
    """The late rank's checkpoint shard: its fsync waits on an NVMe write that times out (and, for a
    hang, is still waiting when the recorder stops)."""
    from recorder.demo import Job

    n, start, compute, _ = next(x for x in timeline if x[0] == spec.stall_step)
    job = Job(pid=0, name="python3", thread_id=thread_id, disk="nvme0n1")
    label = f"checkpoint_write/run42/step{spec.stall_step}/rank{spec.late_rank}"
    tag = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little", signed=True)
    path = f"/ckpt/run42/step{spec.stall_step}/rank{spec.late_rank}.pt"
    s.add("lineage_label", tag=tag, label=label)
    t = mono(start[spec.late_rank]) + 20 * MS
    s.add("lineage_mark", ts=t, thread_id=thread_id, tag=tag, python_stack_id=s.stack(STACK_CKPT))
    s.add("checkpoint_mark", ts=t, thread_id=thread_id, path=path, phase=1, tag=tag,
          python_stack_id=s.stack(STACK_CKPT))
    fsync = t + 10 * MS
    stall = int(spec.stall_ms * MS) if not spec.hang else stop - fsync - 2 * MS
    done = fsync
    for i in range(4):  # fsync writes the shard back: 4 requests of 1 MiB, one stuck on the device
        dev = stall if i == 2 else int(2.5 * MS)
        done = max(done, s.block(thread_id, fsync + 100 * US + i * 20 * US, 60 * US, dev, job, "write", 1 << 20,
                                 stack=STACK_CKPT, io_tag=tag))
    stuck = fsync + 100 * US + 2 * 20 * US + 60 * US
    s.kernel_line(stuck + min(stall - 400 * MS, 3_000 * MS), "nvme nvme0: I/O tag 4096 (1000) opcode 0x1 (I/O Cmd) "
                  "QID 7 timeout, aborting req_op:WRITE(1) size:1048576", level=4)
    s.kernel_line(stuck + min(stall - 399 * MS, 3_001 * MS), "nvme nvme0: I/O tag 4096 (1000) opcode 0x1 (I/O Cmd) "
                  "QID 7 timeout, reset controller", level=4)
    s.kernel_line(stuck + min(stall - 398 * MS, 3_002 * MS), "nvme nvme0: resetting controller", level=4)
    if spec.hang:  # still in fsync at the stop
        s.offcpu(thread_id, fsync + 50 * US, stop - fsync - 50 * US, STATE_D, "fsync", stack=STACK_CKPT)
        s.rows["offcpu_interval"][-1]["open"] = 1
        return
    s.offcpu(thread_id, fsync + 50 * US, done + 30 * US - fsync, STATE_D, "fsync", wakeup_ts=done, stack=STACK_CKPT)
    t = done + 80 * US
    s.add("checkpoint_mark", ts=t, thread_id=thread_id, path=path, phase=2, tag=tag,
          python_stack_id=s.stack(STACK_CKPT))
    s.add("lineage_mark", ts=t, thread_id=thread_id, tag=0, python_stack_id=s.stack(STACK_CKPT))
