"""`recorder demo --no-gpu SCENARIO`: synthetic recordings of known stalls, no root, no BPF, no GPU.

Each scenario writes a session of a training job (steps of a few hundred ms: data loading reads,
kernel launches, a stream synchronisation, sometimes a collective) into the same tables a real
recording fills, injects one fault at one step, and is explained by the same views and report as
a real recording. Kernel log lines are written as the kernel prints them and go through the
recorder's own parser (recorder/layers/kmsg/). Everything is deterministic: the same scenario gives the
same database and the same report, which the golden tests pin.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from recorder import __version__ as VERSION
from recorder.layers import cuda, kmsg
from recorder.layers.workload import nccl
from store.db import Store, open_store

MS = 1_000_000
US = 1_000
T0 = 5_000 * 1_000_000_000  # ns of CLOCK_MONOTONIC at the session start (an hour and a half after boot)
WALL = 1_777_410_000 * 1_000_000_000 - T0  # 2026-04-28T20:20:00Z at T0
NVME_PCI = "0000:01:00.0"
FIRST_STEP = 80_000

# Python stacks of the synthetic training script, innermost first: (file, function, def line, line).
TRAIN = "/srv/job/train.py"
DATA = "/srv/job/data.py"
MODEL = "/srv/job/model.py"
MAIN_FRAME = (TRAIN, "main", 220, 236)
STACK_LOAD = [(DATA, "load_batch", 80, 88), (TRAIN, "train_step", 130, 141), MAIN_FRAME]
STACK_FETCH = [(DATA, "fetch_shard", 55, 64), (DATA, "load_batch", 80, 86), (TRAIN, "train_step", 130, 141),
               MAIN_FRAME]
STACK_COLLATE = [(DATA, "collate", 112, 120), (DATA, "load_batch", 80, 90), (TRAIN, "train_step", 130, 141),
                 MAIN_FRAME]
STACK_FORWARD = [(MODEL, "Block.forward", 50, 57), (TRAIN, "train_step", 130, 145), MAIN_FRAME]
STACK_SYNC = [(TRAIN, "train_step", 130, 152), MAIN_FRAME]
STACK_ALLREDUCE = [(TRAIN, "all_reduce_grads", 160, 166), (TRAIN, "train_step", 130, 149), MAIN_FRAME]
STACK_STEP = [(TRAIN, "main", 220, 231)]
STACK_CKPT = [(TRAIN, "save_checkpoint", 200, 212), MAIN_FRAME]

SYSCALL = {"read": 0, "pread64": 17, "fsync": 74, "recvfrom": 45, "futex": 202, "write": 1}
STATE_SLEEP, STATE_D, STATE_PREEMPTED = 1, 2, 256


@dataclass
class Job:
    """One process of the synthetic job and what its steps look like."""

    pid: int
    name: str
    thread_id: int = 0
    driver_thread_id: int = 0
    process_id: int = 0
    rank: int | None = None
    comm_handle: int = 0
    disk: str = "nvme0n1"
    sector: int = 2_000_000
    step_ms: float = 410.0
    reads_per_step: int = 16
    seq: int = 0
    before_sync: int = 90 * MS  # ns from the step start to the synchronisation in the last normal step
    steps: dict[int, int] = field(default_factory=dict)  # step -> ts


class Synth:
    """Writes one synthetic session through the store, table by table, as the recorder would."""

    def __init__(self, store: Store, scenario: str, seed: int = 42) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.rows: dict[str, list[dict]] = {}
        self.stacks: dict[str, int] = {}
        self.codes: dict[tuple, int] = {}
        self.next_thread = 1 + (store.one("SELECT max(id) AS m FROM thread")["m"] or 0)
        self.next_log = 1 + (store.one("SELECT max(id) AS m FROM kernel_log")["m"] or 0)
        self.kmsg_seq = 90_000
        self.session_id = store.db["session"].insert({
            "started_ts": T0, "wall_offset_ns": WALL, "status": "recording", "recorder_pid": 1,
            "hostname": "demo-node-07", "kernel_release": "6.18.0-demo", "boot_id": "demo", "cpu_count": 16,
            "target": f"demo scenario {scenario}", "command": f"recorder demo --no-gpu {scenario}",
            "tool_version": VERSION,
        }).last_pk
        store.conn.executemany(
            "INSERT OR IGNORE INTO cuda_api (id, name, family, library, arguments) VALUES (?,?,?,?,?)",
            [(i, a.name, a.family, a.library, a.layout) for i, a in enumerate(cuda.APIS)])
        store.conn.executemany("INSERT OR IGNORE INTO nccl_api (id, name, kind) VALUES (?, ?, ?)",
                               [(i, a.name, a.kind) for i, a in enumerate(nccl.APIS)])
        self.add("block_device", name="nvme0n1", dev_major=259, dev_minor=0, disk="nvme0n1", controller="nvme0",
                 pci_address=NVME_PCI, driver="nvme", model="DEMO NVMe 3.84TB")
        self.add("block_device", name="nvme1n1", dev_major=259, dev_minor=1, disk="nvme1n1", controller="nvme1",
                 pci_address="0000:02:00.0", driver="nvme", model="DEMO NVMe 3.84TB")

    # -- rows -------------------------------------------------------------------------------------
    def add(self, table: str, **row) -> None:
        row.setdefault("session_id", self.session_id)
        self.rows.setdefault(table, []).append(row)

    def capability(self, layer: str, probe: str, status: str = "attached", detail: str = "") -> None:
        self.add("capability", layer=layer, probe=probe, target="", status=status, detail=detail, ts=T0)

    def process(self, pid: int, name: str, cmdline: str) -> int:
        pk = self.store.db["process"].insert({
            "session_id": self.session_id, "pid": pid, "start_ticks": pid * 10, "parent_pid": 1, "name": name,
            "cmdline": cmdline, "first_ts": T0}).last_pk
        return pk

    def thread(self, process_id: int | None, tid: int, name: str, traced: int = 1) -> int:
        pk = self.next_thread
        self.next_thread += 1
        self.store.db["thread"].insert({"id": pk, "session_id": self.session_id, "tid": tid,
                                        "process_id": process_id, "name": name, "first_ts": T0, "traced": traced})
        return pk

    def stack(self, frames: list[tuple[str, str, int, int]] | None) -> int | None:
        if not frames:
            return None
        key = repr(frames)
        if key in self.stacks:
            return self.stacks[key]
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        sid = self.store.db["python_stack"].insert({"session_id": self.session_id, "hash": digest,
                                                    "depth": len(frames), "status": "ok"}).last_pk
        for depth, (filename, qualname, first, line) in enumerate(frames):
            code = self.codes.get((filename, qualname, first))
            if code is None:
                code = self.store.db["python_code"].insert({"session_id": self.session_id, "filename": filename,
                                                            "qualname": qualname, "first_line": first}).last_pk
                self.codes[(filename, qualname, first)] = code
            self.store.db["python_stack_frame"].insert({"stack_id": sid, "depth": depth, "code_id": code,
                                                        "line": line})
        self.stacks[key] = sid
        return sid

    def cuda(self, thread_id: int, ts: int, dur: int, api: str, stack=None, size: int | None = None,
             stream: int | None = None) -> None:
        self.add("cuda_call", ts=ts, dur=dur, thread_id=thread_id, api_id=cuda.API_INDEX[api], ret=0,
                 size_bytes=size, size_class=size.bit_length() if size else None, stream=stream,
                 cgroup_id=7, python_stack_id=self.stack(stack))

    def offcpu(self, thread_id: int, ts: int, dur: int, state: int, syscall: str | None = None,
               wakeup_ts: int | None = None, contender: int | None = None, waker: int | None = None,
               stack=None, cpu: int = 3) -> None:
        self.add("offcpu_interval", ts=ts, dur=dur, thread_id=thread_id, cpu=cpu, state=state,
                 syscall=SYSCALL.get(syscall) if syscall else None, next_thread_id=contender,
                 waker_thread_id=waker, waker_cpu=cpu if waker else None, wakeup_ts=wakeup_ts, in_cpu=cpu,
                 contender_thread_id=contender, contender_run_dur=dur if contender else None, cgroup_id=7,
                 python_stack_id=self.stack(stack) if stack else None)

    def block(self, thread_id: int | None, ts: int, queued: int, device_dur: int, job: Job, op: str,
              size: int, kind: str = "target", error: int = 0, stack=None, io_tag: int | None = None) -> int:
        """A block request; returns its completion ts."""
        major, minor = (259, 0) if job.disk == "nvme0n1" else (259, 1)
        job.sector += size // 512
        issue = ts + queued
        done = issue + device_dur
        self.add("block_request", ts=ts, dur=done - ts, thread_id=thread_id, submitter_kind=kind, device=job.disk,
                 dev_major=major, dev_minor=minor, sector=job.sector, size_bytes=size, op=op,
                 rwbs="R" if op == "read" else "WS", sync=int(op == "write"), metadata=0, fua=0, readahead=0,
                 preflush=0, bio_queue_ts=ts, insert_ts=ts + queued // 2, issue_ts=issue, complete_ts=done,
                 queued_dur=queued, device_dur=device_dur, error=error, requeues=0, merges=0, io_tag=io_tag,
                 cgroup_id=7, python_stack_id=self.stack(stack))
        return done

    def kernel_line(self, ts: int, text: str, level: int = 3, properties: str = "") -> None:
        """A kernel log record as /dev/kmsg gives it, through the recorder's own parser."""
        self.kmsg_seq += 1
        raw = f"{level},{self.kmsg_seq},{ts // 1000},-;{text}".encode() + properties.encode()
        entry = kmsg.KernelLogEntry(kmsg.parse_record(raw), kmsg.classify(text), ts)
        for table, row in kmsg.rows_for(entry, self.session_id, self.next_log):
            self.add(table, **row)
        self.next_log += 1

    # -- the training loop ------------------------------------------------------------------------
    def job(self, pid: int, name: str = "python3", rank: int | None = None, disk: str = "nvme0n1") -> Job:
        job = Job(pid=pid, name=name, rank=rank, disk=disk)
        job.process_id = self.process(pid, name, f"python3 {TRAIN} --run run42" +
                                      (f" --rank {rank}" if rank is not None else ""))
        job.thread_id = self.thread(job.process_id, pid, name)
        job.driver_thread_id = self.thread(job.process_id, pid + 3, "cuda-EvtHandlr")
        if rank is not None:
            job.comm_handle = 0x5600_0000 + pid
            self.add("nccl_comm", process_id=job.process_id, handle=job.comm_handle, comm_hash=0x1F2E3D4C5B6A7988,
                     rank=rank, nranks=2, init_ts=T0 + MS)
        return job

    def jitter(self, ns: float, spread: float = 0.01) -> int:
        return int(ns * (1 + self.rng.uniform(-spread, spread)))

    def load_batch(self, job: Job, t: int, device_dur: Callable[[int], int] | None = None,
                   queued: int = 40 * US) -> int:
        """Data loading: reads of 256 KiB from the job's disk, each blocking the thread."""
        for i in range(job.reads_per_step):
            dev = device_dur(i) if device_dur else self.jitter(1.8 * MS, 0.15)
            start = t + 20 * US
            done = self.block(job.thread_id, start, queued, dev, job, "read", 256 * 1024, stack=STACK_LOAD)
            self.offcpu(job.thread_id, start + 5 * US, done - start + 15 * US, STATE_D, "pread64",
                        wakeup_ts=done, waker=None, stack=STACK_LOAD)
            t = done + 30 * US
        return t

    def forward(self, job: Job, t: int, launches: int = 24, compute_ms: float = 60.0) -> int:
        gap = int(compute_ms * MS / launches)
        for _ in range(launches):
            self.cuda(job.thread_id, t, self.jitter(7 * US, 0.2), "cudaLaunchKernel", STACK_FORWARD, stream=0x7F01)
            t += self.jitter(gap, 0.05)
        return t

    def synchronize(self, job: Job, t: int, dur: int) -> int:
        """cudaStreamSynchronize: the thread sleeps on a futex until the driver thread wakes it."""
        self.cuda(job.thread_id, t, dur, "cudaStreamSynchronize", STACK_SYNC, stream=0x7F01)
        self.offcpu(job.thread_id, t + 30 * US, dur - 60 * US, STATE_SLEEP, "futex", wakeup_ts=t + dur - 40 * US,
                    waker=job.driver_thread_id, stack=STACK_SYNC)
        return t + dur

    def allreduce(self, job: Job, t: int, dur: int) -> int:
        job.seq += 1
        self.add("nccl_call", ts=t, dur=dur, thread_id=job.thread_id, api_id=nccl.API_INDEX["ncclAllReduce"], ret=0,
                 count=25_000_000, datatype=9, op=0, peer=None, handle=job.comm_handle, stream=0x7F01, cgroup_id=7,
                 python_stack_id=self.stack(STACK_ALLREDUCE))
        if dur > 2 * MS:  # a collective that waits sleeps in the proxy's futex
            self.offcpu(job.thread_id, t + 50 * US, dur - 100 * US, STATE_SLEEP, "futex",
                        wakeup_ts=t + dur - 60 * US, waker=job.driver_thread_id, stack=STACK_ALLREDUCE)
        return t + dur

    def step_mark(self, job: Job, n: int, t: int) -> None:
        job.steps[n] = t
        self.add("step_mark", ts=t, thread_id=job.thread_id, step=n, inferred=0, python_stack_id=self.stack(STACK_STEP))

    def run_steps(self, jobs: list[Job], steps: int, faults: dict[int, Callable] | None = None) -> int:
        """Steps of every job in lock step; `faults[i](job, t, phase)` may replace phases of step i.
        Returns the ts the last step ended."""
        faults = faults or {}
        t = T0 + 200 * MS
        for i in range(steps):
            n = FIRST_STEP + i
            ends = []
            arrive = []
            for job in jobs:
                fault = faults.get(n)
                tj = t
                self.step_mark(job, n, tj)
                tj = fault(self, job, tj, "load") if fault else self.load_batch(job, tj)
                tj = self.forward(job, tj)
                if fault:
                    tj = fault(self, job, tj, "compute")
                arrive.append(tj)
            if jobs[0].rank is not None:  # every rank leaves the collective when the last one arrives
                last = max(arrive)
                for job, tj in zip(jobs, arrive, strict=True):
                    arrive[arrive.index(tj)] = self.allreduce(job, tj, last - tj + self.jitter(3 * MS, 0.1))
            for job, tj in zip(jobs, arrive, strict=True):
                total = self.jitter(job.step_ms * MS)
                if n in faults and jobs[0].rank is None:
                    # the GPU work is the same as in any step: what the fault cost the CPU adds to the step
                    sync = max(2 * MS, total - 6 * MS - job.before_sync)
                else:
                    sync = max(2 * MS, t + total - 6 * MS - tj)
                    job.before_sync = tj - t
                tj = self.synchronize(job, tj, sync)
                tj += self.jitter(5 * MS, 0.1)  # optimizer step on the CPU
                fault = faults.get(n)
                if fault:
                    tj = fault(self, job, tj, "after")
                ends.append(tj)
            t = max(ends)
        return t

    def finish(self, end: int, layers: dict[str, str] | None = None) -> int:
        """Write every row, mark the session complete, store baselines and build indexes."""
        for layer, probe in {"sched": "sched:sched_switch", "cuda": "cudaLaunchKernel", "python": "pystack",
                             "block": "block:block_rq_complete", "mm": "vmscan:mm_vmscan_memcg_reclaim_begin",
                             "net": "tcp:tcp_retransmit_skb", "dma": "swiotlb:swiotlb_bounced",
                             "kmsg": "/dev/kmsg", "nccl": "ncclAllReduce"}.items():
            status = (layers or {}).get(layer, "attached")
            self.capability(layer, probe, status, "" if status == "attached" else "not in this demo scenario")
        self.capability("gpu", "nvml", "absent", "demo --no-gpu: no GPU sampled")
        for table, rows in self.rows.items():
            self.store.db[table].insert_all(rows)
        self.store.conn.execute("UPDATE session SET status = 'complete', stopped_ts = ? WHERE id = ?",
                                (end + 100 * MS, self.session_id))
        self.store.conn.commit()
        self.store.build_indexes()
        self.store.store_baselines(self.session_id)
        return self.session_id


# -- scenarios ---------------------------------------------------------------------------------------
STALL_STEP = 80_042


def healthy(s: Synth) -> int:
    return s.finish(s.run_steps([s.job(4100)], 60))


def cpu_contention(s: Synth) -> int:
    """A video encoder pinned to the training thread's CPU takes it for 8 ms slices during forward."""
    job = s.job(4100)
    hog_pid = s.process(31337, "ffmpeg", "ffmpeg -i /data/cam0.mp4 -c:v libx264 /scratch/out.mp4")
    hog = s.thread(hog_pid, 31337, "ffmpeg", traced=0)

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase == "load":
            return s.load_batch(job, t)
        if phase != "compute":
            return t
        for _ in range(30):  # 30 preemptions of 8 ms each while launching kernels
            s.offcpu(job.thread_id, t, 8 * MS, STATE_PREEMPTED, contender=hog, cpu=3)
            t += 8 * MS
            s.cuda(job.thread_id, t, 7 * US, "cudaLaunchKernel", STACK_FORWARD, stream=0x7F01)
            t += 300 * US
        return t

    return s.finish(s.run_steps([job], 60, {STALL_STEP: fault}))


def nvme_timeout_checkpoint(s: Synth) -> int:
    """A checkpoint shard's fsync waits on a write the NVMe controller never completes: timeout,
    abort, controller reset, then the write completes."""
    job = s.job(4100)
    label = "checkpoint_write/run42/step80000/shard17"
    tag = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little", signed=True)
    s.add("lineage_label", tag=tag, label=label)

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase == "load":
            return s.load_batch(job, t)
        if phase != "after":
            return t
        s.add("lineage_mark", ts=t, thread_id=job.thread_id, tag=tag, python_stack_id=s.stack(STACK_CKPT))
        s.add("checkpoint_mark", ts=t, thread_id=job.thread_id, path="/ckpt/run42/step80000/shard17.pt",
              phase=1, tag=tag, python_stack_id=s.stack(STACK_CKPT))
        t += 40 * MS  # write() into the page cache
        fsync = t
        done = fsync
        for i in range(8):  # fsync writes the shard back: 8 requests of 1 MiB
            dev = 3_400 * MS if i == 5 else s.jitter(2.5 * MS, 0.1)
            done = max(done, s.block(job.thread_id, fsync + 100 * US + i * 20 * US, 60 * US, dev, job, "write",
                                     1 << 20, stack=STACK_CKPT, io_tag=tag))
        stuck = fsync + 100 * US + 5 * 20 * US + 60 * US
        s.kernel_line(stuck + 3_000 * MS, "nvme nvme0: I/O tag 4096 (1000) opcode 0x1 (I/O Cmd) QID 7 timeout, "
                      "aborting req_op:WRITE(1) size:1048576", level=4)
        s.kernel_line(stuck + 3_000 * MS + 400 * US, "nvme nvme0: Abort status: 0x371", level=4)
        s.kernel_line(stuck + 3_001 * MS, "nvme nvme0: I/O tag 4096 (1000) opcode 0x1 (I/O Cmd) QID 7 timeout, "
                      "reset controller", level=4)
        s.kernel_line(stuck + 3_002 * MS, "nvme nvme0: resetting controller", level=4)
        s.offcpu(job.thread_id, fsync + 50 * US, done + 30 * US - fsync, STATE_D, "fsync", wakeup_ts=done,
                 stack=STACK_CKPT)
        t = done + 80 * US
        s.add("checkpoint_mark", ts=t, thread_id=job.thread_id, path="/ckpt/run42/step80000/shard17.pt",
              phase=2, tag=tag, python_stack_id=s.stack(STACK_CKPT))
        s.add("lineage_mark", ts=t, thread_id=job.thread_id, tag=0, python_stack_id=s.stack(STACK_CKPT))
        return t

    return s.finish(s.run_steps([job], 60, {STALL_STEP: fault}))


def p999_read_latency(s: Synth) -> int:
    """One read of a training shard takes 260 ms on the device (its p999), nothing else is wrong."""
    job = s.job(4100)

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase == "load":
            return s.load_batch(job, t, lambda i: 260 * MS if i == 9 else s.jitter(1.8 * MS, 0.15))
        return t

    return s.finish(s.run_steps([job], 80, {STALL_STEP: fault}))


def dma_bounce(s: Synth) -> int:
    """The NVMe device's DMA goes through SWIOTLB bounce buffers: every read of the step bounces and
    takes 20 ms on the device; the pool fills up once."""
    job = s.job(4100)

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase != "load":
            return t
        start = t
        t = s.load_batch(job, t, lambda i: s.jitter(20 * MS, 0.1))
        n = 0
        for ts in range(start + MS, t, 3 * MS):
            n += 1
            s.add("dma_event", ts=ts, dur=0, thread_id=None, kind="swiotlb_bounce", device=NVME_PCI, addr=None,
                  dma_addr=0xFFFF0000 + n * 4096, size_bytes=262144, nents=None, direction="from_device",
                  attrs=0xFFFFFFFF, direct=None, bounced=1, forced=0, fault_flags=None)
        s.kernel_line(start + 40 * MS, f"nvme {NVME_PCI}: swiotlb buffer is full (sz: 262144 bytes), "
                      "total 32768 (slots), used 32712 (slots)", level=3)
        return t

    return s.finish(s.run_steps([job], 60, {STALL_STEP: fault}))


def iommu_fault(s: Synth) -> int:
    """A DMA read by the NVMe device faults in the IOMMU; the read is retried after recovery."""
    job = s.job(4100)

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase != "load":
            return t
        start = t
        t = s.load_batch(job, t, lambda i: 1_200 * MS if i == 3 else s.jitter(1.8 * MS, 0.15))
        s.kernel_line(start + 150 * MS, "DMAR: DRHD: handling fault status reg 2", level=3)
        s.kernel_line(start + 150 * MS + 20 * US, "DMAR: [DMA Write NO_PASID] Request device [01:00.0] fault addr "
                      "0xffd40000 [fault reason 0x05] PTE Write access is not set", level=3)
        return t

    return s.finish(s.run_steps([job], 60, {STALL_STEP: fault}))


def nccl_straggler(s: Synth) -> int:
    """Two ranks; rank 1's shard read is slow on its own disk, so it enters the all-reduce late and
    rank 0 waits for it."""
    jobs = [s.job(4100, rank=0), s.job(4200, rank=1, disk="nvme1n1")]

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase == "load":
            if job.rank == 1:
                return s.load_batch(job, t, lambda i: 600 * MS if i == 7 else s.jitter(1.8 * MS, 0.15))
            return s.load_batch(job, t)
        return t

    return s.finish(s.run_steps(jobs, 40, {80_017: fault}))


def oom_reclaim(s: Synth) -> int:
    """The job's memory cgroup is at its limit: collating a batch stalls in direct reclaim, and the
    OOM killer ends a data-loader worker."""
    job = s.job(4100)
    worker = s.process(4242, "pt_data_worker", f"python3 {DATA} --worker 3")
    s.thread(worker, 4242, "pt_data_worker")

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase != "load":
            return t
        t = s.load_batch(job, t)
        for i in range(3):  # three allocations, each reclaiming for ~300 ms
            dur = 300 * MS + i * 10 * MS
            s.add("reclaim_interval", ts=t, dur=dur, thread_id=job.thread_id, kind="memcg", alloc_order=0,
                  gfp_flags=0xCC0, pages_reclaimed=12 + i, cgroup_id=7, python_stack_id=s.stack(STACK_COLLATE))
            s.offcpu(job.thread_id, t + 2 * MS, dur - 4 * MS, STATE_D, None, wakeup_ts=t + dur - 2 * MS,
                     stack=STACK_COLLATE)
            t += dur + 200 * US
        k = t - 100 * MS
        s.kernel_line(k, "python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0", 4)
        s.kernel_line(k + 200 * US, "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
                      "oom_memcg=/job42,task_memcg=/job42/worker3,task=pt_data_worker,pid=4242,uid=1000", 6)
        s.kernel_line(k + 300 * US, "Memory cgroup out of memory: Killed process 4242 (pt_data_worker) "
                      "total-vm:18234112kB, anon-rss:15728640kB, file-rss:10240kB, shmem-rss:0kB, UID:1000 "
                      "pgtables:31200kB oom_score_adj:0", 3)
        s.add("oom_victim", ts=k + 250 * US, pid=4242, comm="pt_data_worker", uid=1000, oom_score_adj=0,
              total_vm_bytes=18234112 * 1024, anon_rss_bytes=15728640 * 1024, file_rss_bytes=10240 * 1024,
              shmem_rss_bytes=0, pgtables_bytes=31200 * 1024, killer_tid=4100)
        return t

    return s.finish(s.run_steps([job], 60, {STALL_STEP: fault}))


def tcp_retransmit(s: Synth) -> int:
    """Shards come from a remote store; one fetch loses packets and waits on TCP retransmission."""
    job = s.job(4100)

    def fault(s: Synth, job: Job, t: int, phase: str) -> int:
        if phase != "load":
            return t
        wait = 1_450 * MS
        s.offcpu(job.thread_id, t + 10 * US, wait, STATE_SLEEP, "recvfrom", wakeup_ts=t + wait, stack=STACK_FETCH)
        for k, after in enumerate((210, 630, 1_050, 1_260)):  # RTO backs off
            s.add("tcp_retransmit", ts=t + after * MS, thread_id=None, family=2, saddr="10.0.3.21",
                  sport=51_812, daddr="10.0.3.7", dport=8470, state=1, err=0, cgroup_id=7 + k * 0)
        return s.load_batch(job, t + wait + 30 * US)

    return s.finish(s.run_steps([job], 60, {STALL_STEP: fault}))


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    build: Callable[[Synth], int]
    cause: str  # the cause kind the report must name as primary ('' for healthy)
    step: int | None  # the stalled step


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("nvme-timeout-checkpoint", "NVMe timeout and controller reset under a checkpoint fsync",
             nvme_timeout_checkpoint, "nvme_timeout", STALL_STEP),
    Scenario("p999-read-latency", "one shard read at the disk's p999 latency", p999_read_latency,
             "slow_io", STALL_STEP),
    Scenario("cpu-contention", "another process takes the training thread's CPU", cpu_contention,
             "cpu_contention", STALL_STEP),
    Scenario("dma-bounce", "reads bounce through SWIOTLB and the pool fills up", dma_bounce,
             "dma_bounce", STALL_STEP),
    Scenario("iommu-fault", "an IOMMU fault on the NVMe device during a read", iommu_fault,
             "iommu_fault", STALL_STEP),
    Scenario("nccl-straggler", "rank 1 enters the all-reduce late; rank 0 waits", nccl_straggler,
             "nccl_straggler", 80_017),
    Scenario("oom-reclaim", "memory cgroup at its limit: direct reclaim, then an OOM kill", oom_reclaim,
             "memory_reclaim", STALL_STEP),
    Scenario("tcp-retransmit", "a remote shard fetch waits on TCP retransmissions", tcp_retransmit,
             "tcp_retransmit", STALL_STEP),
    Scenario("healthy", "no stall: every step within its baseline", healthy, "", None),
)}


def write_scenario(name: str, db: Path) -> int:
    """Write scenario `name` as a new session of `db`; returns the session id."""
    scenario = SCENARIOS[name]
    with open_store(db, create=True) as store:
        return scenario.build(Synth(store, name))
