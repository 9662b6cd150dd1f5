"""The I/O and device layer of a session: block requests, memory pressure, TCP retransmits, DMA
and the patch series' tracepoints.

`IoLayer` owns the rows of bpf/block.bpf.c, mm.bpf.c, net.bpf.c and dma.bpf.c: the session hands it
the raw ring-buffer records and it turns them into rows of store/migrations/0004_io.sql, and
describes each device a request names in `block_device` (recorder/layers/io/devices.py).

Which block requests are recorded is the rule in bpf/block.bpf.c: those a target thread submits
(including its throttled I/O, queued later by a kworker, found from its I/O intent), and those
kernel threads submit (writeback, journal) on disks the targets used during the session.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from recorder.core.int64 import signed64
from recorder.core.layer import BaseLayer, BpfSource, Context, Observation, Phase, Sink
from recorder.core.settings import DEFAULT_INFLIGHT_MAX_AGE_S
from recorder.layers.io.devices import BlockDeviceTable
from recorder.layers.io.records import (
    AGED_OUT,
    BLOCK,
    BLOCK_AGED_OUT,
    CHECKPOINT,
    DIRTY,
    DMA,
    NVME_AI,
    OOM,
    RECLAIM,
    RECORDS,
    TCP,
    UNCOMPLETED,
)
from recorder.layers.io.sockets import SocketOwners

if TYPE_CHECKING:
    from recorder.core.loader import Probes
    from recorder.core.stacks import StackRecorder

# Tracepoints used when present (HAVE_TP_<system>_<name> is defined for the BPF source); each is
# recorded in `capability` as attached or absent.
OPTIONAL_TRACEPOINTS: dict[str, tuple[str, ...]] = {
    "block": (
        "block:block_rq_insert", "block:block_rq_requeue", "block:block_rq_error",
        "block:block_bio_backmerge", "block:block_bio_frontmerge", "block:block_rq_merge", "block:block_split",
        "block:block_bio_complete", "iomap:iomap_iter_dstmap", "ext4:ext4_ext_map_blocks_exit",
        "ext4:ext4_es_lookup_extent_exit", "nvme:nvme_timeout",
    ),
    "mm": (
        "vmscan:mm_vmscan_direct_reclaim_begin", "vmscan:mm_vmscan_direct_reclaim_end",
        "vmscan:mm_vmscan_memcg_reclaim_begin", "vmscan:mm_vmscan_memcg_reclaim_end",
        "writeback:balance_dirty_pages", "oom:mark_victim", "io_tag:io_tag_write",
    ),
    "net": ("tcp:tcp_retransmit_skb",),
    "dma": ("dma:dma_map_phys", "dma:dma_map_page", "swiotlb:swiotlb_bounced", "iommu:io_page_fault",
            "dma:dma_map_latency"),
}

# Fields read when the tracepoint's format has them (HAVE_TPF_<system>_<name>_<field>): the patch
# series appends io_tag to block_rq_complete.
OPTIONAL_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "block": (("block:block_rq_complete", "io_tag"),),
}

# Present in some kernels, not recorded yet: listed so `capability` says so.
NOT_RECORDED = {"block": ("nvme:nvme_setup_cmd", "nvme:nvme_complete_rq")}
# how often user space looks for in-flight block entries nothing ended (IoLayer.sweep)
SWEEP_INTERVAL_NS = 5_000_000_000
# At stop, requests issued in the last SETTLE_RECENT_S are waited for, up to SETTLE_MAX_S, polled
# every SETTLE_POLL_S (IoLayer.settle): a disk completes a request in well under that.
SETTLE_RECENT_S = 1
SETTLE_MAX_S = 0.5
SETTLE_POLL_S = 0.01

SOURCES = (
    BpfSource("block", "block.bpf.c", ("block:block_bio_queue", "block:block_rq_issue", "block:block_rq_complete"),
              OPTIONAL_TRACEPOINTS["block"], NOT_RECORDED["block"], OPTIONAL_FIELDS["block"]),
    BpfSource("mm", "mm.bpf.c", (), OPTIONAL_TRACEPOINTS["mm"]),
    BpfSource("net", "net.bpf.c", (), OPTIONAL_TRACEPOINTS["net"]),
    BpfSource("dma", "dma.bpf.c", (), OPTIONAL_TRACEPOINTS["dma"]),
)

BLOCK_COLUMNS = (
    "session_id", "ts", "dur", "thread_id", "submitter_kind", "device", "dev_major", "dev_minor",
    "sector", "size_bytes", "op", "rwbs", "sync", "metadata", "fua", "readahead", "preflush",
    "bio_queue_ts", "insert_ts", "issue_ts", "complete_ts", "queued_dur", "device_dur", "error",
    "requeues", "merges", "io_tag", "cgroup_id", "python_stack_id",
)
RECLAIM_COLUMNS = ("session_id", "ts", "dur", "thread_id", "kind", "alloc_order", "gfp_flags", "pages_reclaimed",
                   "cgroup_id", "python_stack_id")
DIRTY_COLUMNS = ("session_id", "ts", "dur", "thread_id", "bdi", "period_dur", "think_dur", "dirty_pages",
                 "limit_pages", "task_ratelimit_kbps", "pages_dirtied", "cgroup_ino")
OOM_COLUMNS = ("session_id", "ts", "pid", "comm", "uid", "oom_score_adj", "total_vm_bytes", "anon_rss_bytes",
               "file_rss_bytes", "shmem_rss_bytes", "pgtables_bytes", "killer_tid")
TCP_COLUMNS = ("session_id", "ts", "thread_id", "family", "saddr", "sport", "daddr", "dport", "state", "err",
               "cgroup_id", "process_id", "peer_process_id")
DMA_COLUMNS = ("session_id", "ts", "dur", "thread_id", "kind", "device", "addr", "dma_addr", "size_bytes",
               "nents", "direction", "attrs", "direct", "bounced", "forced", "fault_flags")
NVME_AI_COLUMNS = ("session_id", "ts", "controller", "disk", "qid", "command_id", "rq_tag", "opcode", "action",
                   "sector", "size_bytes", "io_tag", "req_pid", "req_tid")
CHECKPOINT_COLUMNS = ("session_id", "ts", "thread_id", "dev_major", "dev_minor", "ino", "name", "pos",
                      "size_bytes", "io_tag")

RINGS = {"block_events": "block", "mm_events": "mm", "net_events": "net", "dma_events": "dma",
         "nvme_ai_events": "nvme_ai"}
_OPS = {"R": "read", "W": "write", "D": "discard", "F": "flush", "N": "other"}
_DMA_KINDS = {1: "map", 2: "swiotlb_bounce", 3: "iommu_fault", 4: "map_latency"}
_DIRECTIONS = {0: "bidirectional", 1: "to_device", 2: "from_device", 3: "none"}
_NVME_ACTIONS = {0: "polled", 1: "abort", 2: "reset", 3: "disable", 4: "rearm"}
PF_KTHREAD = 0x00200000
C = RECORDS.constants


def dev_numbers(dev: int) -> tuple[int, int]:
    """(major, minor) of a dev_t in the kernel's internal encoding (major << 20 | minor)."""
    return dev >> 20, dev & 0xFFFFF


def parse_rwbs(rwbs: str, nbytes: int) -> tuple[str, int, int, int, int, int]:
    """(op, sync, metadata, fua, readahead, preflush) of a request of `nbytes` from the block
    layer's rwbs string. An empty bio with a preflush ("FWS", 0 bytes) is a cache flush: its row
    has the flush request's rwbs ("FF") once that request's issue was seen, its own otherwise."""
    preflush = 0
    if len(rwbs) > 1 and rwbs[0] == "F" and rwbs[1] in "RWDFN":
        preflush, rwbs = 1, rwbs[1:]
    op = "flush" if preflush and not nbytes else _OPS.get(rwbs[:1], "other")
    rest = rwbs[2:] if rwbs.startswith("DE") else rwbs[1:]
    if rwbs.startswith("DE"):
        op = "secure_erase"
    return op, int("S" in rest), int("M" in rest), int("F" in rest), int("A" in rest), preflush


def partition_table() -> dict[int, tuple[int, int, int]]:
    """dev_t (kernel encoding) -> (whole-disk dev_t, start sector, fs block shift) for every block
    device: partitions map to their disk; file systems mounted on a device give their block size."""
    out: dict[int, tuple[int, int, int]] = {}
    root = Path("/sys/class/block")
    for entry in root.iterdir() if root.exists() else ():
        try:
            major, minor = (int(x) for x in (entry / "dev").read_text().split(":"))
            dev = major << 20 | minor
            if (entry / "partition").exists():
                start = int((entry / "start").read_text())
                pmaj, pmin = (int(x) for x in (entry.resolve().parent / "dev").read_text().split(":"))
                out[dev] = (pmaj << 20 | pmin, start, 0)
            else:
                out[dev] = (dev, 0, 0)
        except (OSError, ValueError):
            continue
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        mounts = []
    for line in mounts:
        parts = line.split()
        major, minor = (int(x) for x in parts[2].split(":"))
        dev = major << 20 | minor
        if dev not in out:
            continue
        try:
            bsize = os.statvfs(parts[4]).f_bsize
        except OSError:
            continue
        if bsize >= 512:
            disk, start, _ = out[dev]
            out[dev] = (disk, start, (bsize // 512).bit_length() - 1)
    return out


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _ip(raw: bytes, family: int) -> str:
    import ipaddress

    addr = ipaddress.IPv6Address(raw)
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


class IoLayer(BaseLayer):
    """Rows for the I/O layer's ring buffers; one per session."""

    name = "io"
    sources = SOURCES
    tables = ("block_request", "reclaim_interval", "dirty_throttle", "oom_victim", "tcp_retransmit", "dma_event",
              "nvme_timeout_action", "checkpoint_write", "block_device")
    records = RECORDS
    losses = (*RECORDS.losses(), AGED_OUT)
    observes = (Observation("block", "block I/O requests"),
                Observation("mm", "memory pressure (reclaim, dirty throttling, OOM)"),
                Observation("net", "TCP retransmits"),
                Observation("dma", "DMA mapping, SWIOTLB bounces, IOMMU faults"))
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.writer = context.writer
        self.identity = context.identity
        self.session_id = context.session_id
        self.raw: dict[str, list[bytes]] = {kind: [] for kind in RINGS.values()}
        self._names: dict[int, str | None] = {}
        self.devices = BlockDeviceTable(self.writer, self.session_id)
        self._kthread: dict[int, bool] = {}
        self.events = 0
        self.probes: Probes | None = None
        # the recorded process that owns a retransmitted connection (the running task rarely does)
        self.sockets = SocketOwners(lambda: self.identity.processes)
        self.stacks: StackRecorder | None = None  # submitters' Python stacks (None: not joined)
        self.max_age_ns = DEFAULT_INFLIGHT_MAX_AGE_S * 1_000_000_000
        self._last_sweep = 0

    def prepare(self) -> None:
        for table, cols in (("block_request", BLOCK_COLUMNS), ("reclaim_interval", RECLAIM_COLUMNS),
                            ("dirty_throttle", DIRTY_COLUMNS), ("oom_victim", OOM_COLUMNS),
                            ("tcp_retransmit", TCP_COLUMNS), ("dma_event", DMA_COLUMNS),
                            ("nvme_timeout_action", NVME_AI_COLUMNS),
                            ("checkpoint_write", CHECKPOINT_COLUMNS)):
            self.writer.table(table, cols)

    def attach(self) -> None:
        self.probes = probes = self.context.probes
        if probes is not None:
            self.max_age_ns = probes.settings.inflight_max_age_s * 1_000_000_000
        self.stacks = self.context.stacks
        if probes is not None and "block" in probes.layers:
            self._fill_partitions(probes.bpf)
        self.devices.record_present()

    def settle(self, ts: int) -> None:
        self.wait_for_recent(ts)

    def wait_for_recent(self, now: int) -> int:
        """At stop, before `unfinished`, with the probes still attached: wait (at most SETTLE_MAX_S)
        for the requests issued in the last SETTLE_RECENT_S to complete, reading the rings, so a
        request in flight when the workload ended (a journal commit, a writeback of the target's
        pages) is a row rather than a completion not seen. Older issued entries are left alone: a
        request that has not completed in a second is hung or its completion program was skipped
        (bpf/block.bpf.c, block_done), and waiting would not change it. Returns how many were
        still waited for when it gave up."""
        if self.probes is None or "block" not in self.probes.layers:
            return 0
        table = self.probes.bpf["block_inflight"]
        deadline = time.monotonic() + SETTLE_MAX_S
        recent = now - SETTLE_RECENT_S * 1_000_000_000
        while True:
            try:
                waiting = sum(1 for e in table.values() if e.issue_ts and e.issue_ts >= recent)
            except Exception:  # the map could not be read: finish counts what is left
                return 0
            if not waiting or time.monotonic() >= deadline:
                return waiting
            time.sleep(SETTLE_POLL_S)
            self.probes.consume()

    def unfinished(self, ts: int) -> None:
        self.count_uncompleted(ts)

    def count_uncompleted(self, ts: int) -> int:
        """At stop, after the last records were read: requests issued whose completion never
        reached the probe (still in flight after `settle`, or their completion program skipped:
        bpf/block.bpf.c, block_done) go to `loss`; returns how many."""
        if self.probes is None or "block" not in self.probes.layers:
            return 0
        try:
            uncompleted = sum(1 for e in self.probes.bpf["block_inflight"].values() if e.issue_ts)
        except Exception:  # the map could not be read: nothing to add
            return 0
        if uncompleted:
            self.writer.add("loss", (self.session_id, ts - ts % 1_000_000_000,
                                     UNCOMPLETED, uncompleted))
        return uncompleted

    def tick(self, ts: int) -> None:
        self.sweep(ts)  # in-flight block requests nothing ended, into `loss`

    def close(self, ts: int) -> None:
        self.flush()

    def counted(self) -> dict[str, int]:
        return {"block": self.events}

    def sweep(self, now: int, force: bool = False) -> int:
        """Remove the in-flight block entries nothing ended within the session's INFLIGHT_MAX_AGE_S
        (a device whose completions no tracepoint reports, a completion program the kernel skipped)
        so the map never fills with them; each one is a `loss` row in the second its bio was queued.
        Runs every SWEEP_INTERVAL_S (the map walk is a few syscalls per entry); returns how many."""
        if self.probes is None or "block" not in self.probes.layers:
            return 0
        if not force and now - self._last_sweep < SWEEP_INTERVAL_NS:
            return 0
        self._last_sweep = now
        table = self.probes.bpf["block_inflight"]
        cutoff = now - self.max_age_ns
        old: list[tuple[object, int]] = []
        try:
            for key, entry in table.items():
                queued = entry.bio_queue_ts or entry.ts
                if queued < cutoff:
                    old.append((key, queued))
        except Exception:  # the map could not be read this time: the next sweep tries again
            return 0
        per_second: dict[int, int] = {}
        for key, queued in old:
            try:
                del table[key]
            except KeyError:  # ended (completed) since it was read
                continue
            second = queued - queued % 1_000_000_000
            per_second[second] = per_second.get(second, 0) + 1
        for second, n in sorted(per_second.items()):
            self.writer.add("loss", (self.session_id, second, BLOCK_AGED_OUT, n))
        return sum(per_second.values())

    def _fill_partitions(self, bpf) -> None:
        import ctypes

        table = bpf["part_disk"]
        for dev, (disk, start, shift) in partition_table().items():
            leaf = table.Leaf()
            leaf.start, leaf.disk, leaf.block_shift = start, disk, shift
            table[ctypes.c_uint32(dev)] = leaf

    def sinks(self) -> dict[str, Sink]:
        return {ring: self.raw[kind].append for ring, kind in RINGS.items()}

    def _device(self, dev: int) -> str | None:
        """Kernel name of a request's device (loop0, nvme0n1p2); its block_device row the first time."""
        if dev not in self._names:
            found = self.devices.note(*dev_numbers(dev))
            self._names[dev] = found.name if found else None
        return self._names[dev]

    def _is_kthread(self, tid: int) -> bool:
        known = self._kthread.get(tid)
        if known is None:
            try:
                data = Path(f"/proc/{tid}/stat").read_bytes()
                flags = int(data[data.rfind(b")") + 2:].split()[6])
                known = bool(flags & PF_KTHREAD)
            except (OSError, ValueError, IndexError):
                known = True  # gone already: the BPF side only sends kernel-thread-named tasks
            self._kthread[tid] = known
        return known

    def _thread(self, tid: int, pid: int, comm: bytes, ts: int, traced: bool = True) -> int | None:
        if not tid:
            return None
        ident = self.identity
        return ident.threads.get(tid) or ident.thread(tid, pid, comm, ts, traced)

    def flush(self) -> None:
        raw = self.raw
        sid = self.session_id
        if raw["block"] or (self.stacks and self.stacks.held("block")):
            rows = []
            records = BLOCK.iter_unpack(b"".join(raw["block"]))
            joined = (self.stacks.join("block", records, _block_stack_key, shared=True) if self.stacks
                      else ((rec, None) for rec in records))
            for rec, py_stack in joined:
                (ts, bio_ts, insert_ts, issue_ts, complete_ts, sector, cg, io_tag, stack_ts, dev, nbytes, pid,
                 tid, error, requeues, merges, flags, rwbs, comm) = rec
                if flags & C["BLOCK_FLAG_INTENT"]:
                    kind, traced = "target_deferred", True
                elif flags & C["BLOCK_FLAG_KTHREAD"] and self._is_kthread(tid):
                    kind, traced = "kernel_thread", False
                else:
                    kind, traced = "target", True
                rw = _text(rwbs)
                op, sync, meta, fua, ra, preflush = parse_rwbs(rw, nbytes)
                major, minor = dev_numbers(dev)
                issued = issue_ts or None
                rows.append((
                    sid, ts, complete_ts - ts, self._thread(tid, pid, comm, ts, traced), kind, self._device(dev),
                    major, minor, sector, nbytes, op, rw, sync, meta, fua, ra, preflush, bio_ts,
                    insert_ts or None, issued, complete_ts, (issue_ts - ts) if issued else None,
                    (complete_ts - issue_ts) if issued else None, error, requeues, merges,
                    signed64(io_tag) if flags & C["BLOCK_FLAG_AI"] else None, cg, py_stack))
            self.writer.extend("block_request", rows)
            self.events += len(rows)
            raw["block"].clear()
        if raw["mm"] or (self.stacks and self.stacks.held("reclaim")):
            reclaims = []
            for chunk in raw["mm"]:
                if len(chunk) == RECLAIM.size:
                    reclaims.append(RECLAIM.unpack(chunk))
                else:
                    self._mm_row(chunk)
            raw["mm"].clear()
            # a reclaim's stack record was sent at its begin, before the reclaim's own record
            joined = (self.stacks.join("reclaim", reclaims, _reclaim_stack_key, shared=True) if self.stacks
                      else ((rec, None) for rec in reclaims))
            for rec, py_stack in joined:
                ts, dur, gfp, pages, cg, _stack_ts, pid, tid, order, kind, comm, _pad = rec
                self.writer.add("reclaim_interval", (sid, ts, dur, self._thread(tid, pid, comm, ts),
                                                     "memcg" if kind == C["RECLAIM_MEMCG"] else "direct", order,
                                                     gfp, pages, cg, py_stack))
        if raw["net"]:
            for rec in TCP.iter_unpack(b"".join(raw["net"])):
                ts, cg, pid, tid, state, err, sport, dport, family, _pad, saddr, daddr, comm = rec
                src, dst = _ip(saddr, family), _ip(daddr, family)
                self.writer.add("tcp_retransmit", (
                    sid, ts, self._thread(tid, pid, comm, ts, False), family, src, sport,
                    dst, dport, state, err, cg, self.sockets.owner((src, sport, dst, dport)),
                    self.sockets.owner((dst, dport, src, sport))))
            raw["net"].clear()
        if raw["dma"]:
            for rec in DMA.iter_unpack(b"".join(raw["dma"])):
                (ts, dur, addr, dma_addr, size, attrs, pid, tid, kind, direction, nents, flags, device,
                 comm) = rec
                self.writer.add("dma_event", (
                    sid, ts, dur, self._thread(tid, pid, comm, ts, False), _DMA_KINDS.get(kind, str(kind)),
                    _text(device), signed64(addr), signed64(dma_addr), size, nents or None,
                    _DIRECTIONS.get(direction), signed64(attrs), int(bool(flags & C["DMA_FLAG_DIRECT"])),
                    int(bool(flags & C["DMA_FLAG_BOUNCED"])), int(bool(flags & C["DMA_FLAG_FORCE"])),
                    flags >> 16 if kind == C["DMA_KIND_IOMMU_FAULT"] else None))
            raw["dma"].clear()
        if raw["nvme_ai"]:
            for rec in NVME_AI.iter_unpack(b"".join(raw["nvme_ai"])):
                (ts, sector, io_tag, ctrl, qid, rq_tag, nbytes, req_pid, req_tid, cid, opcode, action, _pad,
                 disk) = rec
                self.writer.add("nvme_timeout_action", (
                    sid, ts, f"nvme{ctrl}", _text(disk) or None, qid, cid, rq_tag, opcode,
                    _NVME_ACTIONS.get(action, str(action)), sector, nbytes, signed64(io_tag), req_pid or None,
                    req_tid or None))
            raw["nvme_ai"].clear()

    def _mm_row(self, chunk: bytes) -> None:
        sid = self.session_id
        size = len(chunk)
        if size == DIRTY.size:
            (ts, pause, period, think, dirty, limit, ratelimit, cg_ino, pid, tid, dirtied, _pad, bdi,
             comm) = DIRTY.unpack(chunk)
            self.writer.add("dirty_throttle", (sid, ts, pause, self._thread(tid, pid, comm, ts), _text(bdi),
                                               period, think, dirty, limit, ratelimit, dirtied, cg_ino))
        elif size == OOM.size:
            ts, vm, anon, file, shmem, pgt, pid, uid, adj, killer, comm = OOM.unpack(chunk)
            self.writer.add("oom_victim", (sid, ts, pid, _text(comm), uid, adj, vm * 1024, anon * 1024,
                                           file * 1024, shmem * 1024, pgt * 1024, killer))
        elif size == CHECKPOINT.size:
            ts, ino, pos, count, io_tag, dev, pid, tid, _pad, name = CHECKPOINT.unpack(chunk)
            major, minor = dev_numbers(dev)
            self.writer.add("checkpoint_write", (sid, ts, self._thread(tid, pid, b"", ts), major, minor, ino,
                                                 _text(name), pos, count, signed64(io_tag)))


_STACK_TS, _PID, _TID = (BLOCK.names.index(n) for n in ("stack_ts", "pid", "tid"))


def _block_stack_key(rec: tuple) -> tuple[int, int, int] | None:
    """(stack_ts, pid, tid) of a block request's submitter stack record; None for kernel threads."""
    return (rec[_STACK_TS], rec[_PID], rec[_TID]) if rec[_STACK_TS] else None


_RECLAIM_STACK_TS, _RECLAIM_PID, _RECLAIM_TID = (RECLAIM.names.index(n) for n in ("stack_ts", "pid", "tid"))


def _reclaim_stack_key(rec: tuple) -> tuple[int, int, int] | None:
    """(stack_ts, pid, tid) of the Python stack record of a reclaim's thread where it began."""
    return (rec[_RECLAIM_STACK_TS], rec[_RECLAIM_PID], rec[_RECLAIM_TID]) if rec[_RECLAIM_STACK_TS] else None

