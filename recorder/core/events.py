"""The one definition of every record the BPF programs send to user space.

Each layout is declared here once. `c_definitions()` renders the C structs that are prepended to the
BPF sources at load time, and `Layout.unpack` reads the same bytes in Python, so the two cannot
drift; tests/test_events.py compiles the rendered C with gcc and compares sizes and offsets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# C type -> (struct format char, size). Fields are ordered largest first in each layout so that
# the C compiler adds no padding and the Python format can be packed ("=").
_CTYPES: dict[str, tuple[str, int]] = {
    "u64": ("Q", 8),
    "s64": ("q", 8),
    "u32": ("I", 4),
    "s32": ("i", 4),
    "u16": ("H", 2),
    "char16": ("16s", 16),
    "char128": ("128s", 128),
    "char32": ("32s", 32),
    "char256": ("256s", 256),
}


_FRAMED: dict[str, struct.Struct] = {}  # layout name -> its struct after a ring header


@dataclass(frozen=True)
class Layout:
    """A fixed-size record: a C struct and its Python struct format from the same field list."""

    name: str
    fields: tuple[tuple[str, str], ...]
    doc: str
    _struct: struct.Struct = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = sum(_CTYPES[ctype][1] for _, ctype in self.fields)
        if size % 8:
            raise ValueError(f"{self.name}: {size} bytes; pad to a multiple of 8 so C adds none")
        fmt = "=" + "".join(_CTYPES[ctype][0] for _, ctype in self.fields)
        object.__setattr__(self, "_struct", struct.Struct(fmt))

    @property
    def size(self) -> int:
        return self._struct.size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)

    @property
    def fmt(self) -> str:
        """The struct format: '=' and one code per field."""
        return self._struct.format

    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for name, ctype in self.fields:
            out[name] = at
            at += _CTYPES[ctype][1]
        return out

    def unpack(self, data: bytes) -> tuple:
        return self._struct.unpack_from(data)

    def pack(self, *values) -> bytes:
        """The record's bytes from its field values, in order (tests feed layers with these)."""
        return self._struct.pack(*values)

    def iter_unpack(self, joined: bytes):
        return self._struct.iter_unpack(joined)

    @property
    def framed_size(self) -> int:
        """Bytes per record as a ring buffer holds it: its 8-byte header, then the record."""
        return self._struct.size + 8

    def iter_framed(self, joined: bytes):
        """Records read in blocks from a ring buffer (recorder/core/ringbuf.py), headers skipped."""
        framed = _FRAMED.get(self.name)
        if framed is None:
            framed = _FRAMED[self.name] = struct.Struct("=8x" + self._struct.format[1:])
        return framed.iter_unpack(joined)

    def c_struct(self) -> str:
        lines = [f"/* {self.doc} */", f"struct {self.name} {{"]
        for name, ctype in self.fields:
            if ctype.startswith("char"):
                lines.append(f"    char {name}[{_CTYPES[ctype][1]}];")
            else:
                lines.append(f"    {ctype} {name};")
        lines.append("};")
        return "\n".join(lines)


OFFCPU = Layout(
    "offcpu_event",
    (
        ("ts", "u64"),  # switch-out, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # until switch-in, ns
        ("cgroup_id", "u64"),
        ("state", "s64"),  # sched_switch prev_state as the tracepoint reports it
        ("wakeup_ts", "u64"),  # when it was woken (became runnable again), 0 if never asleep
        ("contender_run", "u64"),  # ns the contender ran on in_cpu while this thread was runnable
        # key (ts) of its Python stack record: the switch-out, an earlier capture in the same
        # syscall, or the one promised at the syscall's exit (OFFCPU_FLAG_PROMISED); 0: none
        # (preempted, a short wait in a syscall, or captures turned off)
        ("stack_ts", "u64"),
        ("futex_addr", "u64"),  # futex word of the futex() it blocked in (args[0]), 0 outside one
        ("pid", "u32"),
        ("tid", "u32"),
        ("cpu", "u32"),  # cpu it left
        ("next_tid", "u32"),  # task that took the cpu at switch-out
        ("waker_tid", "u32"),  # task that woke it (0: none seen, e.g. preempted)
        ("waker_cpu", "u32"),
        ("syscall", "s32"),  # syscall in progress at switch-out, -1 none
        ("flags", "u32"),  # OFFCPU_FLAG_*
        ("in_cpu", "u32"),  # cpu it came back on
        ("contender_tid", "u32"),  # task that ran longest on in_cpu while this one was runnable
        ("comm", "char16"),
        ("next_comm", "char16"),
        ("waker_comm", "char16"),
        ("contender_comm", "char16"),
    ),
    "one off-CPU interval of a traced thread, sent at switch-in",
)

CUDA = Layout(
    "cuda_event",
    (
        ("ts", "u64"),  # entry, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # entry -> return, ns
        ("cgroup_id", "u64"),
        ("ret", "s64"),  # return value (cudaError_t / CUresult)
        ("size", "u64"),  # bytes for alloc/memcpy, 0 when not meaningful
        ("stream", "u64"),
        ("function", "u64"),  # kernel function pointer / CUfunction
        ("pointer", "u64"),  # device/host pointer allocated or freed
        ("handle", "u64"),  # event handle for event synchronisation
        # digest of its Python stack when the stack was sent before (no pystacks record this
        # time, bpf/pystack.h), 0 when its record was sent: joined by (ts, pid, tid)
        ("py_digest", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("api", "u32"),  # index into recorder.layers.cuda.APIS
        ("memcpy_kind", "s32"),
        ("grid_x", "u32"),
        ("grid_y", "u32"),
        ("grid_z", "u32"),
        ("block_x", "u32"),
        ("block_y", "u32"),
        ("block_z", "u32"),
        ("shared_mem", "u32"),
        ("flags", "u32"),  # CUDA_FLAG_*
        # a runtime call that went through the driver's exported API: that driver API's index
        # (its own probes saw it inside this call, bpf/cuda.bpf.c), else CUDA_NO_API
        ("driver_api", "u32"),
        ("reserved", "u32"),
        # native stack: its digest in the native_stacks map (bpf/cuda.bpf.c), 0 if none
        ("native_digest", "u64"),
    ),
    "one CUDA runtime or driver call, sent at return",
)

TASK = Layout(
    "task_event",
    (
        ("ts", "u64"),
        ("kind", "u32"),  # TASK_FORK / TASK_EXEC / TASK_EXIT / TASK_DLOPEN / TASK_RENAME
        ("pid", "u32"),  # tgid of the task doing it
        ("tid", "u32"),
        ("child_tid", "u32"),  # fork: the new task
        ("comm", "char16"),  # the task's name; for TASK_RENAME its new name
    ),
    "process lifecycle of traced tasks, their renames, and library loads that need a rescan",
)

LAYOUTS = (OFFCPU, CUDA, TASK)

# Constants shared by C and Python.
CONSTANTS: dict[str, int] = {
    "TASK_FORK": 1,
    "TASK_EXEC": 2,
    "TASK_EXIT": 3,
    "TASK_DLOPEN": 4,
    "TASK_RENAME": 5,  # tid is the renamed task, which may be another thread of the process
    "OFFCPU_FLAG_OPEN": 1,  # still off-CPU when the session stopped: dur runs to the stop
    "OFFCPU_FLAG_PROMISED": 2,  # stack_ts is captured at the syscall's exit (bpf/sched.bpf.c)
    # the kernel reported no switch-in (bpf/sched.bpf.c): the end is the return from the syscall it
    # blocked in, or else its wake-up (0 when it was never woken: its end is not known)
    "OFFCPU_FLAG_END_SYSCALL": 4,
    "OFFCPU_FLAG_END_WAKEUP": 8,
    "CUDA_FLAG_POINTER_UNREAD": 1,  # the allocated pointer could not be read at return
    # a kernel launch fast enough, and not sampled, to be kept without stacks (bpf/cuda.bpf.c)
    "CUDA_FLAG_NO_STACK": 2,
    "CUDA_FLAG_LATE_STACK": 4,  # its stacks were taken at its return (a launch: slow or sampled)
    "CUDA_NO_API": 0xFFFFFFFF,
    "MODE_PIDS": 0,
    "MODE_CGROUP": 1,
    "MODE_ALL": 2,
    # probe ids for the drop counters (index into the `drops` per-cpu array)
    "PROBE_SCHED": 0,
    "PROBE_CUDA": 1,
    "PROBE_TASK": 2,
    "PROBE_CUDA_MAP": 3,
    "PROBE_SCHED_MAP": 4,
    "PROBE_COUNT": 5,
}

PROBE_NAMES = {
    CONSTANTS["PROBE_SCHED"]: "sched:offcpu ring buffer",
    CONSTANTS["PROBE_CUDA"]: "cuda ring buffer",
    CONSTANTS["PROBE_TASK"]: "task ring buffer",
    CONSTANTS["PROBE_CUDA_MAP"]: "cuda in-flight map full",
    CONSTANTS["PROBE_SCHED_MAP"]: "sched off-CPU map full",
}


def c_definitions() -> str:
    """C text with every layout and constant, prepended to each BPF program."""
    parts = [f"#define {name} {value}" for name, value in CONSTANTS.items()]
    parts += [layout.c_struct() for layout in LAYOUTS]
    return "\n".join(parts) + "\n"


def comm(raw: bytes) -> str:
    """A task name from a 16-byte, NUL-padded kernel buffer."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# -- the I/O and device layer (bpf/block.bpf.c, mm.bpf.c, net.bpf.c, dma.bpf.c) ---------------------
BLOCK = Layout(
    "block_event",
    (
        ("ts", "u64"),  # submission: bio queued in the submitter's context, or its I/O intent
        ("bio_queue_ts", "u64"),  # block_bio_queue (after blk-throttle: a kworker's for throttled bios)
        ("insert_ts", "u64"),  # block_rq_insert, 0 when issued directly
        ("issue_ts", "u64"),  # block_rq_issue (last one after a requeue)
        ("complete_ts", "u64"),
        ("sector", "u64"),
        ("cgroup_id", "u64"),  # cgroup v2 id of the submitter
        ("io_tag", "u64"),  # I/O tag from block_rq_complete (patch series), 0 without it
        ("stack_ts", "u64"),  # key (ts) of the submitter's Python stack record, 0: none (kernel thread)
        ("dev", "u32"),  # whole-disk dev_t, kernel encoding (major << 20 | minor)
        ("nr_bytes", "u32"),
        ("pid", "u32"),  # submitter
        ("tid", "u32"),
        ("error", "s32"),  # 0 or negative errno
        ("requeues", "u32"),
        ("merges", "u32"),  # bios front-merged into the request after it was queued
        ("flags", "u32"),  # BLOCK_FLAG_*
        ("rwbs", "char16"),
        ("comm", "char16"),  # submitter
    ),
    "one block request of a traced submitter, sent at completion",
)

RECLAIM = Layout(
    "reclaim_event",
    (
        ("ts", "u64"),
        ("dur", "u64"),
        ("gfp_flags", "u64"),
        ("nr_reclaimed", "u64"),  # pages
        ("cgroup_id", "u64"),
        # key (ts) of the thread's Python stack record: captured where the reclaim began (the
        # allocating line), or the capture made earlier in the same syscall
        ("stack_ts", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("order", "s32"),
        ("kind", "u32"),  # RECLAIM_DIRECT (global memory short) or RECLAIM_MEMCG (its memory cgroup's limit)
        ("comm", "char16"),
        # the mm ring tells its records apart by size (MM_RING_LAYOUTS): not oom_event's nor checkpoint_event's
        ("pad", "char16"),
    ),
    "one direct-reclaim interval of a traced thread, sent at its end",
)

DIRTY = Layout(
    "dirty_event",
    (
        ("ts", "u64"),  # when the pause starts (the tracepoint fires just before it)
        ("pause", "s64"),  # ns the task is put to sleep
        ("period", "s64"),  # ns
        ("think", "s64"),  # ns
        ("dirty", "u64"),  # pages dirty globally
        ("limit", "u64"),  # pages: dirty limit
        ("task_ratelimit", "u64"),  # KiB/s the task is throttled to
        ("cgroup_ino", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("dirtied", "u32"),  # pages this task dirtied since the last pause
        ("pad", "u32"),
        ("bdi", "char32"),
        ("comm", "char16"),
    ),
    "one balance_dirty_pages() pause of a traced thread",
)

OOM = Layout(
    "oom_event",
    (
        ("ts", "u64"),
        ("total_vm", "u64"),  # KiB
        ("anon_rss", "u64"),  # KiB
        ("file_rss", "u64"),  # KiB
        ("shmem_rss", "u64"),  # KiB
        ("pgtables", "u64"),  # KiB
        ("pid", "u32"),  # victim
        ("uid", "u32"),
        ("oom_score_adj", "s32"),
        ("killer_tid", "u32"),  # task running when the victim was marked
        ("comm", "char16"),  # victim
    ),
    "oom:mark_victim, every victim (the kernel chooses it, not us)",
)

TCP = Layout(
    "tcp_event",
    (
        ("ts", "u64"),
        ("cgroup_id", "u64"),
        ("pid", "u32"),  # task running at the retransmit (often a softirq on behalf of others)
        ("tid", "u32"),
        ("state", "s32"),
        ("err", "s32"),
        ("sport", "u16"),
        ("dport", "u16"),
        ("family", "u16"),
        ("pad", "u16"),
        ("saddr", "char16"),  # IPv6 form (IPv4 as ::ffff:a.b.c.d)
        ("daddr", "char16"),
        ("comm", "char16"),
    ),
    "tcp:tcp_retransmit_skb",
)

DMA = Layout(
    "dma_event",
    (
        ("ts", "u64"),  # start: for dma_map_latency ts - latency
        ("dur", "u64"),  # mapping latency (dma_map_latency), else 0
        ("addr", "u64"),  # physical address (map), I/O virtual address (iommu fault), dev_addr (bounce)
        ("dma_addr", "u64"),
        ("size", "u64"),
        ("attrs", "u64"),  # DMA_ATTR_* (map), dma_mask (bounce)
        ("pid", "u32"),
        ("tid", "u32"),
        ("kind", "u32"),  # DMA_KIND_*
        ("dir", "s32"),
        ("nents", "s32"),
        ("flags", "u32"),  # DMA_FLAG_*; fault flags for iommu faults in the upper 16 bits
        ("device", "char32"),
        ("comm", "char16"),
    ),
    "DMA mapping, SWIOTLB bounce or IOMMU fault",
)

NVME_AI = Layout(
    "nvme_ai_event",
    (
        ("ts", "u64"),
        ("sector", "u64"),
        ("io_tag", "u64"),
        ("ctrl_id", "s32"),
        ("qid", "s32"),
        ("rq_tag", "s32"),
        ("nr_bytes", "u32"),
        ("req_pid", "u32"),  # tgid that allocated the request
        ("req_tid", "u32"),
        ("cid", "u16"),
        ("opcode", "u16"),
        ("action", "u16"),  # 0 polled, 1 abort, 2 reset, 3 disable, 4 rearm
        ("pad", "u16"),
        ("disk", "char32"),
    ),
    "nvme:nvme_timeout from the patch series: one NVMe timeout decision",
)

CHECKPOINT = Layout(
    "checkpoint_event",
    (
        ("ts", "u64"),
        ("ino", "u64"),
        ("pos", "s64"),
        ("count", "u64"),
        ("io_tag", "u64"),
        ("dev", "u32"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("pad", "u32"),
        ("name", "char32"),  # last path component, cut at 31 bytes
    ),
    "io_tag:io_tag_write from the patch series: one write extent of a thread with an I/O tag",
)

LAYOUTS = (*LAYOUTS, BLOCK, RECLAIM, DIRTY, OOM, TCP, DMA, NVME_AI, CHECKPOINT)
# the records of bpf/mm.bpf.c's one ring, which user space tells apart by their size
MM_RING_LAYOUTS = (RECLAIM, DIRTY, OOM, CHECKPOINT)

_IO_PROBES = ("PROBE_BLOCK", "PROBE_BLOCK_MAP", "PROBE_MM", "PROBE_NET", "PROBE_DMA", "PROBE_BLOCK_UNCOMPLETED",
              "PROBE_MM_MAP")
for _i, _name in enumerate(_IO_PROBES):
    CONSTANTS[_name] = CONSTANTS["PROBE_COUNT"] + _i
CONSTANTS["PROBE_COUNT"] += len(_IO_PROBES)
CONSTANTS.update({
    "BLOCK_FLAG_KTHREAD": 1,  # queued by a kernel thread (writeback, journal, throttle dispatch)
    "BLOCK_FLAG_INTENT": 2,  # submitter found from its I/O intent (bio queued later by a kworker)
    "BLOCK_FLAG_ERROR": 4,  # block_rq_error fired for it
    "BLOCK_FLAG_FRONT_MERGE": 8,  # its first sector came from a front-merged bio
    "BLOCK_FLAG_AI": 16,  # block_rq_complete had the io_tag field (io_tag valid)
    "BLOCK_FLAG_SPLIT": 32,  # a part of a bio the block layer split (block_split)
    "BLOCK_FLAG_PARTIAL": 64,  # completed in several block_rq_complete calls (summed into one row)
    "BLOCK_FLAG_BIO": 128,  # ended by block_bio_complete: a device that completes bios without requests
    "RECLAIM_DIRECT": 0,
    "RECLAIM_MEMCG": 1,
    "DMA_KIND_MAP": 1,
    "DMA_KIND_BOUNCE": 2,
    "DMA_KIND_IOMMU_FAULT": 3,
    "DMA_KIND_AI_MAP": 4,
    "DMA_FLAG_DIRECT": 1,
    "DMA_FLAG_BOUNCED": 2,
    "DMA_FLAG_FORCE": 4,
})
PROBE_NAMES.update({
    CONSTANTS["PROBE_BLOCK"]: "block ring buffer",
    CONSTANTS["PROBE_BLOCK_MAP"]: "block in-flight map full",
    CONSTANTS["PROBE_MM"]: "mm ring buffer",
    CONSTANTS["PROBE_NET"]: "net ring buffer",
    CONSTANTS["PROBE_DMA"]: "dma ring buffer",
    # issued, and its completion never reached the probe: the kernel skips a tracepoint's BPF program
    # while another one runs on that CPU (completions run in softirq context and interrupt them)
    CONSTANTS["PROBE_BLOCK_UNCOMPLETED"]: "block request completion not seen",
    CONSTANTS["PROBE_MM_MAP"]: "mm reclaim map full",
})
# not a BPF counter: in-flight entries user space removed because nothing ended them in time
# (recorder/layers/io/layer.py, IoLayer.sweep)
BLOCK_AGED_OUT = "block request aged out"


# -- NCCL and the training-script markers (bpf/nccl.bpf.c, bpf/lineage.bpf.c) -----------------------
NCCL = Layout(
    "nccl_event",
    (
        ("ts", "u64"),  # entry, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # entry -> return, ns
        ("cgroup_id", "u64"),
        ("ret", "s64"),  # ncclResult_t
        ("count", "u64"),  # elements
        ("comm", "u64"),  # ncclComm_t handle (written by ncclCommInitRank* at return)
        ("stream", "u64"),
        ("comm_hash", "u64"),  # hash of the ncclUniqueId: the same on every rank (init only)
        ("pid", "u32"),
        ("tid", "u32"),
        ("api", "u32"),  # index into recorder.layers.workload.nccl.APIS
        ("datatype", "s32"),
        ("op", "s32"),  # reduction op, -1 when none
        ("peer", "s32"),  # root or peer rank, -1 when none
        ("nranks", "s32"),  # init only
        ("rank", "s32"),  # init only
    ),
    "one NCCL call, sent at return",
)

MARKER = Layout(
    "marker_event",
    (
        ("ts", "u64"),
        ("value", "u64"),  # step number (MARKER_STEP) or phase 1/2 (MARKER_CHECKPOINT)
        ("tag", "u64"),  # lineage tag, 0 = none
        ("text_addr", "u64"),  # address of the label or path in the process
        ("text_len", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("kind", "u32"),  # MARKER_*
        ("pad", "u32"),
        ("text", "char128"),  # the first 127 bytes of the label or path
    ),
    "one call of a training-script marker (recorder.step / lineage / checkpoint)",
)

LAYOUTS = (*LAYOUTS, NCCL, MARKER)
_MARK_PROBES = ("PROBE_NCCL", "PROBE_NCCL_MAP", "PROBE_MARKER")
for _i, _name in enumerate(_MARK_PROBES):
    CONSTANTS[_name] = CONSTANTS["PROBE_COUNT"] + _i
CONSTANTS["PROBE_COUNT"] += len(_MARK_PROBES)
CONSTANTS.update({"MARKER_STEP": 1, "MARKER_LINEAGE": 2, "MARKER_CHECKPOINT": 3})
PROBE_NAMES.update({
    CONSTANTS["PROBE_NCCL"]: "nccl ring buffer",
    CONSTANTS["PROBE_NCCL_MAP"]: "nccl in-flight map full",
    CONSTANTS["PROBE_MARKER"]: "marker ring buffer",
})


# -- checkpoint integrity (bpf/checkpoint.bpf.c, recorder/layers/checkpoint.py) ---------------------------
CKPT_OPEN = Layout(
    "ckpt_open_event",
    (
        ("ts", "u64"),  # openat entered
        ("dur", "u64"),  # entry -> return, ns
        ("open_id", "u64"),  # with pid and fd, names this open until its close
        ("flags", "u64"),  # O_* flags as passed
        ("pid", "u32"),
        ("tid", "u32"),
        ("fd", "s32"),  # the new descriptor (opens that failed are not sent)
        ("dirfd", "s32"),  # directory a relative path is relative to, -100 = AT_FDCWD
        ("in_scope", "u32"),  # 1: the opening thread was inside recorder.checkpoint()
        ("pad", "u32"),
        ("path", "char256"),  # as passed, cut at 255 bytes
    ),
    "a target opened a file for writing (classified by user space unless in a checkpoint scope)",
)

CKPT_IO = Layout(
    "ckpt_io_event",
    (
        ("ts", "u64"),  # syscall entered
        ("dur", "u64"),  # entry -> return, ns
        ("open_id", "u64"),
        ("offset", "s64"),  # file offset written at (writes), new length (ftruncate); -1 unknown (O_APPEND)
        ("count", "u64"),  # bytes asked for (writes)
        ("ret", "s64"),  # the syscall's return: bytes written, 0, or -errno
        ("pid", "u32"),
        ("tid", "u32"),
        ("fd", "s32"),
        ("op", "u32"),  # CKPT_OP_*
    ),
    "a write, fsync, fdatasync, ftruncate or close on a file opened for writing",
)

CKPT_RENAME = Layout(
    "ckpt_rename_event",
    (
        ("ts", "u64"),
        ("dur", "u64"),
        ("ret", "s64"),  # 0 or -errno
        ("pid", "u32"),
        ("tid", "u32"),
        ("olddirfd", "s32"),  # -100 = AT_FDCWD
        ("newdirfd", "s32"),
        ("flags", "u32"),  # renameat2 RENAME_* flags
        ("pad", "u32"),
        ("oldpath", "char256"),
        ("newpath", "char256"),
    ),
    "rename/renameat/renameat2 by a target",
)

CKPT_SCOPE = Layout(
    "ckpt_scope_event",
    (
        ("ts", "u64"),
        ("phase", "u64"),  # 1 begin, 2 end
        ("tag", "u64"),  # lineage tag current on the thread
        ("path_addr", "u64"),  # the path stays alive in the process during the scope
        ("path_len", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("path", "char256"),  # the first 255 bytes of the path
    ),
    "recorder.checkpoint(path) entered or left (uprobe on stall_recorder_checkpoint)",
)

LAYOUTS = (*LAYOUTS, CKPT_OPEN, CKPT_IO, CKPT_RENAME, CKPT_SCOPE)
_CKPT_PROBES = ("PROBE_CKPT", "PROBE_CKPT_MAP")
for _i, _name in enumerate(_CKPT_PROBES):
    CONSTANTS[_name] = CONSTANTS["PROBE_COUNT"] + _i
CONSTANTS["PROBE_COUNT"] += len(_CKPT_PROBES)
CONSTANTS.update({
    "CKPT_OP_WRITE": 1, "CKPT_OP_PWRITE64": 2, "CKPT_OP_WRITEV": 3, "CKPT_OP_PWRITEV": 4,
    "CKPT_OP_PWRITEV2": 5, "CKPT_OP_SENDFILE": 6, "CKPT_OP_COPY_FILE_RANGE": 7, "CKPT_OP_FSYNC": 8,
    "CKPT_OP_FDATASYNC": 9, "CKPT_OP_FTRUNCATE": 10, "CKPT_OP_CLOSE": 11,
    "CKPT_OP_OPEN": 12, "CKPT_OP_LSEEK": 13, "CKPT_OP_RENAME": 14,  # stashed between entry and exit only
    "CKPT_PENDING": 0,  # not classified by user space yet: its events are sent and held there
    "CKPT_OPTED": 1,  # a checkpoint file: events sent
    "CKPT_IGNORED": 2,  # not a checkpoint: nothing sent
})
PROBE_NAMES.update({
    CONSTANTS["PROBE_CKPT"]: "checkpoint ring buffer",
    CONSTANTS["PROBE_CKPT_MAP"]: "checkpoint map full",  # its descriptors or calls in flight
})

# a CUDA call whose API the per-API program noted was overwritten before its body read it (another
# thread's call on the same CPU in between; bpf/cuda.bpf.c cuda_dispatch): the call is not recorded
CONSTANTS["PROBE_CUDA_DISPATCH"] = CONSTANTS["PROBE_COUNT"]
CONSTANTS["PROBE_COUNT"] += 1
PROBE_NAMES[CONSTANTS["PROBE_CUDA_DISPATCH"]] = "cuda call's API note overwritten"
# the same for an NCCL call (bpf/nccl.bpf.c nccl_dispatch)
CONSTANTS["PROBE_NCCL_DISPATCH"] = CONSTANTS["PROBE_COUNT"]
CONSTANTS["PROBE_COUNT"] += 1
PROBE_NAMES[CONSTANTS["PROBE_NCCL_DISPATCH"]] = "nccl call's API note overwritten"


def probe_names(*constants: str) -> tuple[str, ...]:
    """The `loss.probe` names of the drop counters named by their PROBE_* constants."""
    return tuple(PROBE_NAMES[CONSTANTS[c]] for c in constants)
