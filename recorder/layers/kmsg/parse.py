"""Kernel log (`/dev/kmsg`) reader and the parsers that turn its records into typed events.

Three layers, each usable on its own:

- `parse_record(raw)` splits one `/dev/kmsg` record (`prio,seq,usec,flag[,...];text` plus
  ` KEY=value` continuation lines) into a `KmsgRecord`. It never raises: a record it cannot read is
  returned with `malformed=True` and its raw bytes.
- `classify(text)` recognises the lines of the subsystems a stall can come from (NVMe, block layer,
  SWIOTLB, Intel VT-d, AMD-Vi, PCIe AER, NVIDIA Xid, OOM) and returns one typed event per line, an
  `UnknownSubsystemLine` for a line of those subsystems that no parser knows (kept, never dropped),
  or None for every other line.
- `KmsgReader` reads `/dev/kmsg` without blocking from a CLOCK_MONOTONIC start time and counts what
  it read, parsed, could not parse and lost; `rows_for(entry, session_id)` turns what it yields into
  rows for the tables of `store/migrations/0002_kernel_log.sql`.

Formats are those of shared/research/kernel-log-formats.md, old and new kernels.
"""

from __future__ import annotations

import errno
import os
import re
import select
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from recorder.errors import NotPrivileged

__all__ = [
    "AerBit",
    "AerBusError",
    "AerMessage",
    "AerStatusMask",
    "AmdViEvent",
    "BlockIOError",
    "BufferIOError",
    "DmarFault",
    "DmarFaultStatus",
    "DmarIntrRemapFault",
    "KernelEvent",
    "ClockOffset",
    "KernelLogEntry",
    "KmsgReader",
    "KmsgRecord",
    "KmsgStats",
    "NvmeAbortStatus",
    "NvmeControllerDown",
    "NvmeNotReady",
    "NvmePowerSavingHint",
    "NvmeResetFailure",
    "NvmeResetting",
    "NvmeTimeout",
    "OomConstraint",
    "OomInvoked",
    "OomKilled",
    "OomReaped",
    "OomVictimSelected",
    "ParsedEvent",
    "SwiotlbFull",
    "TABLE_COLUMNS",
    "UnknownSubsystemLine",
    "XidError",
    "classify",
    "parse_record",
    "rows_for",
    "split_dump",
    "xid_meaning",
]

KMSG_PATH = "/dev/kmsg"
# A record is at most CONSOLE_EXT_LOG_MAX (8 KiB); a smaller buffer makes read() fail with EINVAL.
READ_SIZE = 16384

_INT64_MAX = 2**63 - 1

LEVEL_NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class KmsgRecord:
    """One `/dev/kmsg` record. Fields the header did not give are None."""

    raw: bytes  # the record as read, kept so a malformed one can be stored verbatim
    text: str  # message text, `\\xNN` escapes undone, decoded as UTF-8 (bad bytes backslashed)
    facility: int | None = None  # syslog facility (prio >> 3); 0 kernel, 1 user (writes to kmsg)
    level: int | None = None  # syslog level (prio & 7): 0 emerg .. 7 debug
    seq: int | None = None  # kernel sequence number; gaps mean records were overwritten
    usec: int | None = None  # printk timestamp in microseconds (see ts_ns)
    flag: str = ""  # '-' normal, 'c' continuation fragment (older kernels), '+' continued
    caller: str | None = None  # `caller=T123` / `C2` header field (CONFIG_PRINTK_CALLER)
    properties: dict[str, str] = field(default_factory=dict)  # continuation ` KEY=value` lines
    malformed: bool = False
    error: str | None = None  # why the record is malformed

    @property
    def ts_ns(self) -> int | None:
        """The record's own stamp in ns. printk stamps with local_clock() (sched_clock), which
        runs at CLOCK_MONOTONIC's rate but is not the same clock: on the development VM it was
        ~0.4 ms ahead of clock_gettime(CLOCK_MONOTONIC), and NTP slewing lets the two drift.
        `KmsgReader.calibrate()` measures the offset; `KernelLogEntry.ts_ns` applies it."""
        return None if self.usec is None else self.usec * 1000


_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
_DIGITS = re.compile(rb"[0-9]{1,20}")


def _unescape(data: bytes) -> bytes:
    # The kernel writes every byte < 0x20, >= 0x7f and the backslash itself as \xNN.
    if b"\\x" not in data:
        return data
    return _ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), data)


def _decode(data: bytes) -> str:
    return _unescape(data).decode("utf-8", "backslashreplace")


def _header_int(value: bytes) -> int | None:
    return int(value) if _DIGITS.fullmatch(value) else None


def parse_record(raw: bytes) -> KmsgRecord:
    """Parse one `/dev/kmsg` record. Never raises; unreadable records come back malformed."""
    head, sep, body = raw.partition(b";")
    if not sep:
        return KmsgRecord(raw=raw, text=_decode(raw.rstrip(b"\n")), malformed=True,
                          error="no ';' between header and text")
    lines = body.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    text = _decode(lines[0]) if lines else ""
    problems: list[str] = []
    properties: dict[str, str] = {}
    for line in lines[1:]:
        key, eq, value = line[1:].partition(b"=")
        if line[:1] != b" " or not eq or not key:
            problems.append("continuation line is not ' KEY=value'")
            continue
        properties[_decode(key)] = _decode(value)

    parts = head.split(b",")
    if len(parts) < 4:
        return KmsgRecord(raw=raw, text=text, properties=properties, malformed=True,
                          error="header has fewer than 4 fields (prio,seq,usec,flag)")
    prio, seq, usec = (_header_int(p) for p in parts[:3])
    if prio is None or seq is None or usec is None:
        problems.append("prio, seq or usec is not a decimal number")
    # Out of range for the kernel's own types (u64 seq, ns in s64): not a real header.
    if seq is not None and seq >= 2**64:
        problems.append("seq beyond 64 bits")
        seq = None
    if usec is not None and usec * 1000 > _INT64_MAX:
        problems.append("usec beyond 64-bit nanoseconds")
        usec = None
    if prio is not None and prio >= 2**11:  # facility is a u8, level 3 bits
        problems.append("prio beyond facility 255")
        prio = None
    flag = parts[3].decode("ascii", "backslashreplace")
    if len(flag) != 1:
        problems.append("flag is not one character")
    caller = None
    for extra in parts[4:]:
        if extra.startswith(b"caller="):
            caller = extra[7:].decode("ascii", "backslashreplace")
    return KmsgRecord(
        raw=raw,
        text=text,
        facility=None if prio is None else prio >> 3,
        level=None if prio is None else prio & 7,
        seq=seq,
        usec=usec,
        flag=flag,
        caller=caller,
        properties=properties,
        malformed=bool(problems),
        error="; ".join(problems) or None,
    )


def split_dump(data: bytes) -> list[bytes]:
    """Split a saved `/dev/kmsg` dump (records back to back, as `cat /dev/kmsg` writes them) into
    records: a record starts at each line that does not begin with a space."""
    records: list[bytes] = []
    for line in data.splitlines(keepends=True):
        if line.startswith(b" ") and records:
            records[-1] += line
        elif line.strip():
            records.append(line)
    return records


# --------------------------------------------------------------------------------------------
# Typed events. Field names are the column names of the typed tables in
# store/migrations/0002_kernel_log.sql; `kind` goes into the table's `kind` column.
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class KernelEvent:
    """Base of every typed kernel-log event."""

    kind: ClassVar[str]
    table: ClassVar[str]
    subsystem: ClassVar[str]
    device_field: ClassVar[str | None] = None  # field naming the device, for kernel_log.device

    @property
    def device_name(self) -> str | None:
        return getattr(self, self.device_field) if self.device_field else None


# ---- NVMe (drivers/nvme/host/pci.c) --------------------------------------------------------


@dataclass(slots=True, frozen=True)
class NvmeTimeout(KernelEvent):
    """`I/O 4096 QID 7 timeout, aborting` (old) or `I/O tag 489 (d1e9) opcode 0x1 (I/O Cmd) QID 3
    timeout, aborting req_op:WRITE(1) size:524288` (new). The request was issued about
    nvme_core.io_timeout (30 s by default) before this line."""

    kind: ClassVar[str] = "timeout"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    tag: int
    qid: int
    action: str  # what the driver does next: aborting, reset controller, disable controller, ...
    command_id: int | None = None
    opcode: int | None = None
    opcode_name: str | None = None
    req_op: str | None = None
    req_op_code: int | None = None
    size_bytes: int | None = None


@dataclass(slots=True, frozen=True)
class NvmeAbortStatus(KernelEvent):
    """`Abort status: 0x371`: completion status of the abort command sent after a timeout."""

    kind: ClassVar[str] = "abort_status"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    status: int


@dataclass(slots=True, frozen=True)
class NvmeResetting(KernelEvent):
    """`resetting controller` (possibly with a reason after it)."""

    kind: ClassVar[str] = "resetting"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    action: str | None = None  # anything printed after `resetting controller`


@dataclass(slots=True, frozen=True)
class NvmeControllerDown(KernelEvent):
    """`controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0xffff` or
    `..., PCI_STATUS read failed (-19)`."""

    kind: ClassVar[str] = "controller_down"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    csts: int
    pci_status: int | None = None
    errno: int | None = None  # when the PCI status register could not be read


@dataclass(slots=True, frozen=True)
class NvmePowerSavingHint(KernelEvent):
    """The advice lines printed after a controller went down (`Does your device have a faulty
    power saving mode enabled?`, `Try "nvme_core.default_ps_max_latency_us=0 ..." ...`)."""

    kind: ClassVar[str] = "power_saving_hint"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    action: str  # the advice text


@dataclass(slots=True, frozen=True)
class NvmeNotReady(KernelEvent):
    """`Device not ready; aborting reset, CSTS=0x1`."""

    kind: ClassVar[str] = "not_ready"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    action: str  # `aborting reset`, `aborting initialisation`
    csts: int


@dataclass(slots=True, frozen=True)
class NvmeResetFailure(KernelEvent):
    """`Disabling device after reset failure: -19`: the controller is gone."""

    kind: ClassVar[str] = "reset_failure"
    table: ClassVar[str] = "nvme_event"
    subsystem: ClassVar[str] = "nvme"
    device_field: ClassVar[str | None] = "controller"
    controller: str
    errno: int


# ---- Block layer --------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class BlockIOError(KernelEvent):
    """`[blk_update_request: ]I/O error, dev nvme0n1, sector 18874368 op 0x0:(READ) flags 0x0
    phys_seg 1 prio class 0`; the first words come from the block status table (`I/O`,
    `timeout`, `critical medium`, ...). Older kernels stop after the sector."""

    kind: ClassVar[str] = "io_error"
    table: ClassVar[str] = "block_error"
    subsystem: ClassVar[str] = "block"
    device_field: ClassVar[str | None] = "dev"
    dev: str
    sector: int
    error: str  # error name: I/O, timeout, critical medium, ...
    function: str | None = None  # kernel function prefix of older kernels (blk_update_request)
    op_code: int | None = None
    op: str | None = None
    flags: int | None = None
    phys_seg: int | None = None
    prio_class: int | None = None


@dataclass(slots=True, frozen=True)
class BufferIOError(KernelEvent):
    """`Buffer I/O error on dev sda1, logical block 0, async page read`."""

    kind: ClassVar[str] = "buffer_io_error"
    table: ClassVar[str] = "block_error"
    subsystem: ClassVar[str] = "block"
    device_field: ClassVar[str | None] = "dev"
    dev: str
    logical_block: int
    context: str | None = None  # async page read, lost async page write, ...


# ---- SWIOTLB -------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class SwiotlbFull(KernelEvent):
    """`nvme 0000:01:00.0: swiotlb buffer is full (sz: 65536 bytes), total 32768 (slots), used
    32736 (slots)`: a DMA mapping needed a bounce buffer and none was free."""

    kind: ClassVar[str] = "buffer_full"
    table: ClassVar[str] = "swiotlb_event"
    subsystem: ClassVar[str] = "swiotlb"
    device_field: ClassVar[str | None] = "device"
    size_bytes: int
    driver: str | None = None
    device: str | None = None
    total_slots: int | None = None
    used_slots: int | None = None


# ---- IOMMU: Intel VT-d and AMD-Vi ----------------------------------------------------------


@dataclass(slots=True, frozen=True)
class DmarFaultStatus(KernelEvent):
    """`DMAR: DRHD: handling fault status reg 2`: the fault lines that follow came from it."""

    kind: ClassVar[str] = "fault_status"
    table: ClassVar[str] = "iommu_fault"
    subsystem: ClassVar[str] = "intel_iommu"
    vendor: ClassVar[str] = "intel"
    status_reg: int


@dataclass(slots=True, frozen=True)
class DmarFault(KernelEvent):
    """`DMAR: [DMA Read NO_PASID] Request device [00:1e.3] fault addr 0xffffa000 [fault reason
    0x06] PTE Read access is not set`, with the `PASID 0x1`, `[0x5e:0x00.0]` and older
    `[DMA Read] ... fault addr 7fff000 [fault reason 06]` forms."""

    kind: ClassVar[str] = "dma_fault"
    table: ClassVar[str] = "iommu_fault"
    subsystem: ClassVar[str] = "intel_iommu"
    device_field: ClassVar[str | None] = "device"
    vendor: ClassVar[str] = "intel"
    access: str  # read, write, ...
    device: str  # bus:dev.fn as printed (VT-d prints no PCI segment)
    address: int
    pasid: int | None = None
    fault_reason: int | None = None
    reason_text: str | None = None


@dataclass(slots=True, frozen=True)
class DmarIntrRemapFault(KernelEvent):
    """`DMAR: [INTR-REMAP] Request device [f0:1f.0] fault index 0x21 [fault reason 0x25] ...`."""

    kind: ClassVar[str] = "intr_remap_fault"
    table: ClassVar[str] = "iommu_fault"
    subsystem: ClassVar[str] = "intel_iommu"
    device_field: ClassVar[str | None] = "device"
    vendor: ClassVar[str] = "intel"
    device: str
    fault_index: int
    fault_reason: int | None = None
    reason_text: str | None = None


@dataclass(slots=True, frozen=True)
class AmdViEvent(KernelEvent):
    """`[xhci_hcd 0000:15:00.0: ]AMD-Vi: Event logged [IO_PAGE_FAULT [device=04:00.0 ]domain=0x0000
    address=0x10b4a01e0 flags=0x0070]`; `kind` is the event type in lower case."""

    table: ClassVar[str] = "iommu_fault"
    subsystem: ClassVar[str] = "amd_iommu"
    device_field: ClassVar[str | None] = "device"
    vendor: ClassVar[str] = "amd"
    event_type: str  # IO_PAGE_FAULT, ILLEGAL_DEV_TABLE_ENTRY, ...
    device: str | None = None  # from `device=` or from the driver prefix
    driver: str | None = None
    domain: int | None = None
    address: int | None = None
    flags: int | None = None
    pasid: int | None = None

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.event_type.lower()


# ---- PCIe AER ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class AerMessage(KernelEvent):
    """`pcieport 0000:00:1c.4: AER: [Multiple ]Correctable error message received from
    0000:07:00.0` (older: `Corrected error received: id=00e0`)."""

    kind: ClassVar[str] = "message"
    table: ClassVar[str] = "aer_event"
    subsystem: ClassVar[str] = "aer"
    device_field: ClassVar[str | None] = "device"
    severity: str
    multiple: bool
    driver: str | None = None
    device: str | None = None  # the reporting port
    source: str | None = None  # the device the error came from
    source_id: int | None = None  # older kernels: requester id (bus << 8 | devfn)


@dataclass(slots=True, frozen=True)
class AerBusError(KernelEvent):
    """`PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Receiver ID)` (older
    `id=00e0(Receiver ID)`; CXL ports print `CXL Bus Error`)."""

    kind: ClassVar[str] = "bus_error"
    table: ClassVar[str] = "aer_event"
    subsystem: ClassVar[str] = "aer"
    device_field: ClassVar[str | None] = "device"
    bus: str  # PCIe or CXL
    severity: str
    error_type: str  # Physical Layer, Data Link Layer, Transaction Layer, Inaccessible
    agent: str | None = None  # Receiver ID, Requester ID, Completer ID, Transmitter ID
    driver: str | None = None
    device: str | None = None
    source_id: int | None = None


@dataclass(slots=True, frozen=True)
class AerStatusMask(KernelEvent):
    """`  device [8086:15ea] error status/mask=00000080/00002000`."""

    kind: ClassVar[str] = "status"
    table: ClassVar[str] = "aer_event"
    subsystem: ClassVar[str] = "aer"
    device_field: ClassVar[str | None] = "device"
    vendor_id: int
    device_id: int
    status: int
    mask: int
    driver: str | None = None
    device: str | None = None


@dataclass(slots=True, frozen=True)
class AerBit(KernelEvent):
    """`   [ 7] BadDLLP`, `   [ 0] RxErr                  (First)`: one set bit of the status."""

    kind: ClassVar[str] = "bit"
    table: ClassVar[str] = "aer_event"
    subsystem: ClassVar[str] = "aer"
    device_field: ClassVar[str | None] = "device"
    bit: int
    bit_name: str
    first_error: bool  # the bit the First Error Pointer names
    driver: str | None = None
    device: str | None = None


# ---- NVIDIA Xid ----------------------------------------------------------------------------

# (meaning, category); category is what a person would check first.
XID_MEANINGS: dict[int, tuple[str, str]] = {
    13: ("Graphics engine exception", "application"),
    31: ("GPU memory page fault", "application"),
    32: ("Invalid or corrupted push buffer stream", "driver"),
    43: ("GPU stopped processing", "application"),
    45: ("Preemptive cleanup, due to previous errors", "driver"),
    48: ("Double-bit ECC error", "memory"),
    61: ("Internal micro-controller breakpoint/warning", "hardware"),
    62: ("Internal micro-controller halt", "hardware"),
    63: ("ECC page retirement or row remapping recording event", "memory"),
    64: ("ECC page retirement or row remapper recording failure", "memory"),
    74: ("NVLink error", "interconnect"),
    79: ("GPU has fallen off the bus", "bus"),
    92: ("High single-bit ECC error rate", "memory"),
    94: ("Contained ECC error", "memory"),
    95: ("Uncontained ECC error", "memory"),
}


def xid_meaning(xid: int) -> tuple[str | None, str | None]:
    """(meaning, category) for an Xid code, (None, None) when the table does not know it."""
    return XID_MEANINGS.get(xid, (None, None))


@dataclass(slots=True, frozen=True)
class XidError(KernelEvent):
    """`NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: ...`, MIG `(PCI:0000:3b:00 GPU-I:01
    GPU-CI:00)`, older `32, Channel ID 00000009 intr 00800000` and very old `Xid (0000:01:00)`."""

    kind: ClassVar[str] = "xid"
    table: ClassVar[str] = "gpu_xid"
    subsystem: ClassVar[str] = "nvidia"
    device_field: ClassVar[str | None] = "device"
    device: str  # PCI domain:bus:device as NVRM prints it (no function)
    xid: int
    message: str
    gpu_instance: int | None = None
    compute_instance: int | None = None
    pid: int | None = None
    process_name: str | None = None
    meaning: str | None = None
    category: str | None = None


# ---- OOM -----------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class OomInvoked(KernelEvent):
    """`python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0`."""

    kind: ClassVar[str] = "invoked"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    comm: str  # the allocating task, not the victim
    gfp_mask: int
    alloc_order: int  # log2 of the pages the failed allocation asked for
    oom_score_adj: int
    gfp_flags: str | None = None
    nodemask: str | None = None


@dataclass(slots=True, frozen=True)
class OomConstraint(KernelEvent):
    """`oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,
    oom_memcg=/job42,task_memcg=/job42,task=python,pid=19289,uid=0`."""

    kind: ClassVar[str] = "constraint"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    constraint_kind: str | None = None  # CONSTRAINT_NONE, CONSTRAINT_MEMCG, ...
    nodemask: str | None = None
    cpuset: str | None = None
    mems_allowed: str | None = None
    oom_memcg: str | None = None
    task_memcg: str | None = None
    comm: str | None = None  # `task=`
    pid: int | None = None
    uid: int | None = None
    global_oom: bool = False


@dataclass(slots=True, frozen=True)
class OomKilled(KernelEvent):
    """`Memory cgroup out of memory: Killed process 19289 (python) total-vm:2676kB, anon-rss:84kB,
    file-rss:1468kB, shmem-rss:4kB, UID:0 pgtables:40kB oom_score_adj:0`; `Out of memory:` for a
    system OOM; older kernels omit the fields after file-rss/shmem-rss."""

    kind: ClassVar[str] = "killed"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    pid: int
    comm: str
    total_vm_bytes: int
    anon_rss_bytes: int
    file_rss_bytes: int
    scope: str | None = None  # memcg or system; None when the line has no prefix (old kernels)
    shmem_rss_bytes: int | None = None
    uid: int | None = None
    pgtables_bytes: int | None = None
    oom_score_adj: int | None = None


@dataclass(slots=True, frozen=True)
class OomVictimSelected(KernelEvent):
    """Older kernels: `Out of memory: Kill process 19289 (python) score 923 or sacrifice child`."""

    kind: ClassVar[str] = "selected"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    pid: int
    comm: str
    score: int
    scope: str


@dataclass(slots=True, frozen=True)
class OomReaped(KernelEvent):
    """`oom_reaper: reaped process 19289 (python), now anon-rss:0kB, file-rss:0kB,
    shmem-rss:4kB`."""

    kind: ClassVar[str] = "reaped"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    pid: int
    comm: str
    anon_rss_bytes: int
    file_rss_bytes: int
    shmem_rss_bytes: int


# ---- Lines of those subsystems that no parser knows ----------------------------------------


@dataclass(slots=True, frozen=True)
class UnknownSubsystemLine:
    """A line that belongs to a watched subsystem but matches no parser: kept raw and counted."""

    subsystem: str  # nvme, block, swiotlb, intel_iommu, amd_iommu, aer, nvidia, oom
    text: str
    kind: ClassVar[str] = "unknown"


ParsedEvent = (
    NvmeTimeout | NvmeAbortStatus | NvmeResetting | NvmeControllerDown | NvmePowerSavingHint
    | NvmeNotReady | NvmeResetFailure | BlockIOError | BufferIOError | SwiotlbFull
    | DmarFaultStatus | DmarFault | DmarIntrRemapFault | AmdViEvent | AerMessage | AerBusError
    | AerStatusMask | AerBit | XidError | OomInvoked | OomConstraint | OomKilled
    | OomVictimSelected | OomReaped
)


# --------------------------------------------------------------------------------------------
# Parsers. Numbers are bounded (20 decimal / 16 hex digits) so a mangled line can never make
# int() slow or raise; a line that does not fit becomes an UnknownSubsystemLine.
# --------------------------------------------------------------------------------------------

_D = r"(\d{1,20})"
_SD = r"(-?\d{1,20})"
_H = r"([0-9a-fA-F]{1,16})"
_BDF = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
# `driver 0000:01:00.0: ` as dev_printk prefixes a PCI device's messages.
_PCI_PREFIX = rf"(?:(\S+) ({_BDF}): )?"


def _hex(value: str) -> int:
    return int(value, 16)


def _opt_int(value: str | None, base: int = 10) -> int | None:
    return None if value is None else int(value, base)


_NVME_PREFIX = re.compile(r"nvme (\S+): ")
_NVME_TIMEOUT_NEW = re.compile(
    rf"I/O tag {_D} \({_H}\)(?: opcode 0x{_H} \(([^)]*)\))? QID {_D} timeout, (.+?)"
    rf"(?: req_op:(\w+)\({_D}\) size:{_D})?"
)
_NVME_TIMEOUT_OLD = re.compile(rf"I/O {_D} QID {_D} timeout, (.+)")
_NVME_ABORT = re.compile(rf"Abort status: 0x{_H}")
_NVME_RESETTING = re.compile(r"resetting controller(?:[ :,]+(.+))?")
_NVME_DOWN = re.compile(
    rf"controller is down; will reset: CSTS=0x{_H}, "
    rf"(?:PCI_STATUS=0x{_H}|PCI_STATUS read failed \({_SD}\))"
)
_NVME_NOT_READY = re.compile(rf"Device not ready; ([^,]+), CSTS=0x{_H}")
_NVME_RESET_FAILURE = re.compile(rf"Disabling device after reset failure: {_SD}")


def _parse_nvme(text: str) -> ParsedEvent | None:
    prefix = _NVME_PREFIX.match(text)
    if prefix is None:
        return None
    ctrl = prefix.group(1)
    rest = text[prefix.end():]
    if rest.startswith("I/O "):
        m = _NVME_TIMEOUT_NEW.fullmatch(rest)
        if m:
            return NvmeTimeout(
                controller=ctrl, tag=int(m[1]), command_id=_hex(m[2]),
                opcode=_opt_int(m[3], 16), opcode_name=m[4], qid=int(m[5]), action=m[6],
                req_op=m[7], req_op_code=_opt_int(m[8]), size_bytes=_opt_int(m[9]),
            )
        m = _NVME_TIMEOUT_OLD.fullmatch(rest)
        if m:
            return NvmeTimeout(controller=ctrl, tag=int(m[1]), qid=int(m[2]), action=m[3])
        return None
    if m := _NVME_ABORT.fullmatch(rest):
        return NvmeAbortStatus(controller=ctrl, status=_hex(m[1]))
    if m := _NVME_RESETTING.fullmatch(rest):
        return NvmeResetting(controller=ctrl, action=m[1])
    if m := _NVME_DOWN.fullmatch(rest):
        return NvmeControllerDown(controller=ctrl, csts=_hex(m[1]),
                                  pci_status=_opt_int(m[2], 16), errno=_opt_int(m[3]))
    if rest.startswith(("Does your device have a faulty power saving mode", 'Try "nvme_core.')):
        return NvmePowerSavingHint(controller=ctrl, action=rest)
    if m := _NVME_NOT_READY.fullmatch(rest):
        return NvmeNotReady(controller=ctrl, action=m[1], csts=_hex(m[2]))
    if m := _NVME_RESET_FAILURE.fullmatch(rest):
        return NvmeResetFailure(controller=ctrl, errno=int(m[1]))
    return None


_BLOCK_ERROR = re.compile(
    rf"(?:(\w+): )?([\w/ ]+?) error, dev ([^\s,]+), sector {_D}"
    rf"(?: op 0x{_H}:\((\w+)\) flags 0x{_H} phys_seg {_D} prio class {_D})?"
)
_BUFFER_ERROR = re.compile(rf"Buffer I/O error on dev(?:ice)? ([^\s,]+), logical block {_D}"
                           r"(?:, (.+))?")


def _parse_block(text: str) -> ParsedEvent | None:
    if m := _BUFFER_ERROR.fullmatch(text):
        return BufferIOError(dev=m[1], logical_block=int(m[2]), context=m[3])
    if m := _BLOCK_ERROR.fullmatch(text):
        return BlockIOError(
            function=m[1], error=m[2], dev=m[3], sector=int(m[4]), op_code=_opt_int(m[5], 16),
            op=m[6], flags=_opt_int(m[7], 16), phys_seg=_opt_int(m[8]),
            prio_class=_opt_int(m[9]),
        )
    return None


_SWIOTLB_FULL = re.compile(
    rf"(?:(\S+) (\S+): )?swiotlb buffer is full \(sz: {_D} bytes\)"
    rf"(?:, total {_D} \(slots\), used {_D} \(slots\))?"
)


def _parse_swiotlb(text: str) -> ParsedEvent | None:
    if m := _SWIOTLB_FULL.fullmatch(text):
        return SwiotlbFull(driver=m[1], device=m[2], size_bytes=int(m[3]),
                           total_slots=_opt_int(m[4]), used_slots=_opt_int(m[5]))
    return None


# `[00:1e.3]`, `[0x5e:0x00.0]`, and with a segment `[0000:00:1e.3]`.
_DMAR_DEV = (r"\[(?:([0-9a-fA-F]{4}):)?(?:0x)?([0-9a-fA-F]{1,2}):(?:0x)?([0-9a-fA-F]{1,2})"
             r"\.(?:0x)?([0-7])\]")
_DMAR_REASON = r"(?: ?\[fault reason (0x)?([0-9a-fA-F]{1,4})\] ?(.*))?"
_DMAR_STATUS = re.compile(rf"DMAR: ?DRHD: handling fault status reg {_H}")
_DMAR_FAULT = re.compile(
    rf"DMAR: ?\[DMA (\w+)(?: NO_PASID| PASID (?:0x)?{_H})?\] Request device {_DMAR_DEV}"
    rf"(?: PASID (?:0x)?{_H})? fault addr (?:0x)?{_H}{_DMAR_REASON}\s*"
)
_DMAR_INTR = re.compile(
    rf"(?:DMAR: ?)?\[INTR-REMAP\] Request device {_DMAR_DEV} fault index (?:0x)?{_H}"
    rf"{_DMAR_REASON}"
)


def _dmar_device(seg: str | None, bus: str, dev: str, fn: str) -> str:
    # One spelling for every form so faults join on device: bus:dev.fn in lower-case hex.
    bdf = f"{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"
    return f"{seg.lower()}:{bdf}" if seg else bdf


def _dmar_reason(is_hex: str | None, value: str | None) -> int | None:
    # Newer kernels print the reason as 0x%02x, older ones as %02d.
    if value is None:
        return None
    return int(value, 16) if is_hex or not value.isdigit() else int(value)


def _parse_dmar(text: str) -> ParsedEvent | None:
    if m := _DMAR_FAULT.fullmatch(text):
        pasid = m[2] if m[2] is not None else m[7]
        return DmarFault(
            access=m[1].lower(), pasid=_opt_int(pasid, 16),
            device=_dmar_device(m[3], m[4], m[5], m[6]), address=_hex(m[8]),
            fault_reason=_dmar_reason(m[9], m[10]), reason_text=m[11] or None,
        )
    if m := _DMAR_INTR.fullmatch(text):
        return DmarIntrRemapFault(
            device=_dmar_device(m[1], m[2], m[3], m[4]), fault_index=_hex(m[5]),
            fault_reason=_dmar_reason(m[6], m[7]), reason_text=m[8] or None,
        )
    if m := _DMAR_STATUS.fullmatch(text):
        return DmarFaultStatus(status_reg=_hex(m[1]))
    return None


_AMD_EVENT = re.compile(r"(?:(\S+) (\S+): )?AMD-Vi: Event logged \[(\w+)((?: [\w]+=\S+?)*)\]")
_AMD_FIELD = re.compile(r" (\w+)=(\S+)")
_AMD_HEX = re.compile(r"0x([0-9a-fA-F]{1,16})")
_AMD_DEV = re.compile(r"(?:([0-9a-fA-F]{4}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


# Event types drivers/iommu/amd/iommu.c prints (iommu_print_event); others are not AMD-Vi lines.
AMD_VI_EVENT_TYPES = frozenset({
    "ILLEGAL_DEV_TABLE_ENTRY", "IO_PAGE_FAULT", "DEV_TAB_HARDWARE_ERROR",
    "PAGE_TAB_HARDWARE_ERROR", "ILLEGAL_COMMAND_ERROR", "COMMAND_HARDWARE_ERROR",
    "IOTLB_INV_TIMEOUT", "INVALID_DEVICE_REQUEST", "INVALID_PPR_REQUEST", "RMP_PAGE_FAULT",
    "RMP_HW_ERROR", "UNKNOWN",
})


def _parse_amd(text: str) -> ParsedEvent | None:
    m = _AMD_EVENT.fullmatch(text)
    if m is None or m[3] not in AMD_VI_EVENT_TYPES:
        return None
    values: dict[str, int] = {}
    device = m[2]
    for key, value in _AMD_FIELD.findall(m[4]):
        if key == "device":
            d = _AMD_DEV.fullmatch(value)
            if d is None:
                return None
            device = value.lower()
        elif key in ("domain", "address", "flags", "pasid"):
            h = _AMD_HEX.fullmatch(value)
            if h is None:
                return None
            values[key] = _hex(h[1])
    return AmdViEvent(event_type=m[3], device=device, driver=m[1], domain=values.get("domain"),
                      address=values.get("address"), flags=values.get("flags"),
                      pasid=values.get("pasid"))


_AER_PREFIX = re.compile(rf"{_PCI_PREFIX}(?:AER: ?)?")
_AER_MESSAGE = re.compile(
    rf"(Multiple )?(.+?) error (?:message )?received(?: from|:) (?:id=([0-9a-fA-F]{{4}})|({_BDF}))"
    r"(?: .*)?"
)
_AER_BUS = re.compile(
    r"(PCIe|CXL) Bus Error: severity=([^,]+), type=([^,]+), "
    r"(?:id=([0-9a-fA-F]{4}) ?)?(?:\(([^)]*)\))?"
)
_AER_STATUS = re.compile(
    r" *device \[([0-9a-fA-F]{4}):([0-9a-fA-F]{4})\] error status/mask=([0-9a-fA-F]{8})"
    r"/([0-9a-fA-F]{8})"
)
_AER_BIT = re.compile(r" *\[ ?(\d{1,2})\] (.+?) *(\(First\))?")


def _parse_aer(text: str) -> ParsedEvent | None:
    prefix = _AER_PREFIX.match(text)
    assert prefix is not None  # every part of the pattern is optional
    driver, device = prefix[1], prefix[2]
    rest = text[prefix.end():]
    if m := _AER_BUS.fullmatch(rest):
        return AerBusError(bus=m[1], severity=m[2], error_type=m[3], source_id=_opt_int(m[4], 16),
                           agent=m[5], driver=driver, device=device)
    if m := _AER_MESSAGE.fullmatch(rest):
        return AerMessage(multiple=m[1] is not None, severity=m[2], source_id=_opt_int(m[3], 16),
                          source=m[4], driver=driver, device=device)
    if m := _AER_STATUS.fullmatch(rest):
        return AerStatusMask(vendor_id=_hex(m[1]), device_id=_hex(m[2]), status=_hex(m[3]),
                             mask=_hex(m[4]), driver=driver, device=device)
    if device is not None and (m := _AER_BIT.fullmatch(rest)):
        return AerBit(bit=int(m[1]), bit_name=m[2], first_error=m[3] is not None, driver=driver,
                      device=device)
    return None


_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
    r"(?: GPU-I:(\d{1,4}))?(?: GPU-CI:(\d{1,4}))?\): (\d{1,6})(?:, (.*))?"
)
_XID_PID = re.compile(r"pid=(?:(\d{1,10})|'?<unknown>'?|'[^']*')(?:, name=([^,]*))?(?:, (.*))?")


def _parse_xid(text: str) -> ParsedEvent | None:
    m = _XID.fullmatch(text)
    if m is None:
        return None
    xid = int(m[4])
    message = m[5] or ""
    pid = name = None
    if message.startswith("pid=") and (p := _XID_PID.fullmatch(message)):
        pid = _opt_int(p[1])
        name = None if p[2] in (None, "<unknown>") else p[2]
        message = p[3] or ""
    meaning, category = xid_meaning(xid)
    return XidError(device=m[1].lower(), gpu_instance=_opt_int(m[2]),
                    compute_instance=_opt_int(m[3]), xid=xid, pid=pid, process_name=name,
                    message=message, meaning=meaning, category=category)


_OOM_INVOKED = re.compile(
    rf"(.+) invoked oom-killer: gfp_mask=0x{_H}(?:\(([^)]*)\))?, (?:nodemask=(\S+), )?"
    rf"order={_SD}, (?:oom_adj={_SD}, )?oom_score_adj={_SD}"
)
_OOM_KILLED = re.compile(
    r"(?:(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): )?"
    rf"Killed process {_D} \((.*)\) total-vm:{_D}kB, anon-rss:{_D}kB, file-rss:{_D}kB"
    rf"(?:, shmem-rss:{_D}kB)?(?:,? UID:{_D})?(?:,? pgtables:{_D}kB)?(?:,? oom_score_adj:{_SD})?"
)
_OOM_SELECTED = re.compile(
    rf"(Memory cgroup out of memory|Out of memory): Kill process {_D} \((.*)\) score {_D} "
    r"or sacrifice child"
)
_OOM_REAPED = re.compile(
    rf"oom_reaper: reaped process {_D} \((.*)\), now anon-rss:{_D}kB, file-rss:{_D}kB, "
    rf"shmem-rss:{_D}kB"
)
_OOM_CONSTRAINT_KEYS = {"constraint", "nodemask", "cpuset", "mems_allowed", "oom_memcg",
                        "task_memcg", "task", "pid", "uid"}
_NODE_LIST = re.compile(r"[0-9-]+")


def _scope(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    return "memcg" if prefix.startswith("Memory cgroup") else "system"


def _parse_oom_constraint(body: str) -> OomConstraint | None:
    values: dict[str, str] = {}
    global_oom = False
    last: str | None = None
    for token in body.split(","):
        key, eq, value = token.partition("=")
        if eq and key in _OOM_CONSTRAINT_KEYS:
            values[key] = value
            last = key
        elif token == "global_oom":
            global_oom = True
        elif last in ("mems_allowed", "cpuset", "nodemask") and _NODE_LIST.fullmatch(token):
            # A node list like 0,2-3 is printed with commas of its own.
            values[last] += "," + token
        else:
            return None
    pid, uid = values.get("pid"), values.get("uid")
    if (pid is not None and not (pid.isdigit() and len(pid) <= 20)) or (
        uid is not None and not (uid.isdigit() and len(uid) <= 20)
    ):
        return None
    return OomConstraint(
        constraint_kind=values.get("constraint"), nodemask=values.get("nodemask"),
        cpuset=values.get("cpuset"), mems_allowed=values.get("mems_allowed"),
        oom_memcg=values.get("oom_memcg"), task_memcg=values.get("task_memcg"),
        comm=values.get("task"), pid=_opt_int(pid), uid=_opt_int(uid), global_oom=global_oom,
    )


def _kib(value: str | None) -> int | None:
    return None if value is None else int(value) * 1024


def _parse_oom(text: str) -> ParsedEvent | None:
    if text.startswith("oom-kill:"):
        return _parse_oom_constraint(text[9:])
    if m := _OOM_KILLED.fullmatch(text):
        return OomKilled(
            scope=_scope(m[1]), pid=int(m[2]), comm=m[3], total_vm_bytes=int(m[4]) * 1024,
            anon_rss_bytes=int(m[5]) * 1024, file_rss_bytes=int(m[6]) * 1024,
            shmem_rss_bytes=_kib(m[7]), uid=_opt_int(m[8]), pgtables_bytes=_kib(m[9]),
            oom_score_adj=_opt_int(m[10]),
        )
    if m := _OOM_INVOKED.fullmatch(text):
        return OomInvoked(comm=m[1], gfp_mask=_hex(m[2]), gfp_flags=m[3], nodemask=m[4],
                          alloc_order=int(m[5]), oom_score_adj=int(m[7]))
    if m := _OOM_REAPED.fullmatch(text):
        return OomReaped(pid=int(m[1]), comm=m[2], anon_rss_bytes=int(m[3]) * 1024,
                         file_rss_bytes=int(m[4]) * 1024, shmem_rss_bytes=int(m[5]) * 1024)
    if m := _OOM_SELECTED.fullmatch(text):
        return OomVictimSelected(scope=_scope(m[1]) or "system", pid=int(m[2]), comm=m[3],
                                 score=int(m[4]))
    return None


_OOM_WORD = re.compile(r"(?<![A-Za-z])oom")
_AER_OLD_BIT = re.compile(rf"\S+ {_BDF}: +\[")


def _subsystem_of(text: str) -> str | None:
    """Which watched subsystem a line belongs to, by cheap substring tests; None for others.
    Order matters: a PCI driver prefix (`nvme 0000:01:00.0: swiotlb ...`) must not win."""
    if "NVRM:" in text:
        return "nvidia"
    if text.startswith(("DMAR", "INTR-REMAP")) or "DMAR:" in text:
        return "intel_iommu"
    if "AMD-Vi" in text:
        return "amd_iommu"
    if ("AER:" in text or "Bus Error:" in text or "error status/mask=" in text
            or _AER_OLD_BIT.match(text)):
        return "aer"
    if "swiotlb" in text or "SWIOTLB" in text:
        return "swiotlb"
    if ("Killed process" in text or "Kill process" in text or "out of memory" in text
            or "Out of memory" in text or ("oom" in text and _OOM_WORD.search(text))):
        return "oom"
    if "I/O error" in text or " error, dev " in text:
        return "block"
    if text.startswith("nvme"):  # `nvme nvme0: ...`, and `nvme0n1: ...` error lines
        return "nvme"
    return None


_PARSERS = {
    "nvidia": _parse_xid,
    "intel_iommu": _parse_dmar,
    "amd_iommu": _parse_amd,
    "aer": _parse_aer,
    "swiotlb": _parse_swiotlb,
    "oom": _parse_oom,
    "block": _parse_block,
    "nvme": _parse_nvme,
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def classify(text: str) -> ParsedEvent | UnknownSubsystemLine | None:
    """The typed event for one kernel log line; UnknownSubsystemLine for a line of a watched
    subsystem that no parser knows; None for a line of any other subsystem."""
    subsystem = _subsystem_of(text)
    if subsystem is None:
        return None
    event = _PARSERS[subsystem](text)
    if event is None or not _fits_64_bits(event):
        return UnknownSubsystemLine(subsystem=subsystem, text=text)
    return event


def _fits_64_bits(event: KernelEvent) -> bool:
    # The kernel prints no number beyond 64 bits; a line that has one is not what it looks like.
    for name in _field_names(type(event)):
        value = getattr(event, name)
        if type(value) is int and not -(2**63) <= value < 2**64:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class KernelLogEntry:
    """What the reader yields: the record, what it parsed into, and when the reader read it."""

    record: KmsgRecord
    event: ParsedEvent | UnknownSubsystemLine | None
    read_ts_ns: int  # CLOCK_MONOTONIC ns at read time; stands in for ts when the header had none
    clock_offset_ns: int = 0  # printk clock minus CLOCK_MONOTONIC, from KmsgReader.calibrate()

    @property
    def ts_ns(self) -> int:
        """CLOCK_MONOTONIC ns (the clock of bpf_ktime_get_ns) of the record."""
        ts = self.record.ts_ns
        return self.read_ts_ns if ts is None else ts - self.clock_offset_ns


@dataclass(slots=True, frozen=True)
class ClockOffset:
    """printk clock (local_clock) minus CLOCK_MONOTONIC, measured by writing a record."""

    offset_ns: int
    uncertainty_ns: int  # half the width of the interval the offset is known to lie in
    samples: int


@dataclass(slots=True)
class KmsgStats:
    """Counters of one reader, for the session's loss statistics."""

    records_read: int = 0  # every record read, including skipped ones
    skipped_before_start: int = 0  # records older than the start time
    parsed: dict[str, int] = field(default_factory=dict)  # per event table.kind
    unknown: int = 0  # lines of watched subsystems no parser knows (kept raw)
    malformed: int = 0  # records whose header or continuation lines could not be read
    lost: int = 0  # records overwritten before we read them (sequence-number gaps)
    overruns: int = 0  # times read() failed with EPIPE


def _event_key(event: KernelEvent) -> str:
    return f"{event.table}.{event.kind}"


class KmsgReader:
    """Non-blocking reader of `/dev/kmsg` from a CLOCK_MONOTONIC start time.

    Use `fileno()` with the main loop's own select/poll and call `read_available()`, or call
    `poll(timeout)`; iterating blocks and yields entries forever. Records with a timestamp before
    `start_ns` are skipped (only the leading run of them: printk stamps are per-CPU and may step
    back a little, and a record after the start is never dropped for that). `start_ns=None` reads
    only records that arrive after open().
    """

    def __init__(self, start_ns: int | None = None, path: str = KMSG_PATH) -> None:
        self.start_ns = start_ns
        self.path = path
        self.stats = KmsgStats()
        self._fd: int | None = None
        self._next_seq: int | None = None
        self._started = start_ns is None
        self.clock_offset: ClockOffset | None = None  # set by calibrate()

    def open(self) -> KmsgReader:
        # O_RDONLY: writing is not needed, and each open of /dev/kmsg has its own read position,
        # so this reader never disturbs journald or dmesg.
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:
            raise NotPrivileged(
                f"cannot read {self.path}: run as root or with CAP_SYSLOG "
                "(or set kernel.dmesg_restrict=0)") from None
        if self.start_ns is None:
            os.lseek(self._fd, 0, os.SEEK_END)  # SEEK_END: only records written from now on
        else:
            # SEEK_SET 0 is the oldest record still in the buffer. SEEK_DATA would be the first
            # record after the last `dmesg -c`, which can skip records after our start.
            os.lseek(self._fd, 0, os.SEEK_SET)
        return self

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> KmsgReader:
        return self.open() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        if self._fd is None:
            raise RuntimeError("KmsgReader is not open: call open() or use it as a context manager")
        return self._fd

    def read_available(self) -> list[KernelLogEntry]:
        """Every record readable now, parsed; returns at once when there is none."""
        fd = self.fileno()
        entries: list[KernelLogEntry] = []
        while True:
            try:
                raw = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:
                    # Records were overwritten under us; the next read returns the oldest one
                    # left, and the sequence gap tells how many were lost.
                    self.stats.overruns += 1
                    continue
                raise
            if not raw:
                break
            entry = self.ingest(raw)
            if entry is not None:
                entries.append(entry)
        return entries

    def poll(self, timeout: float | None = 0.0) -> list[KernelLogEntry]:
        """Wait up to `timeout` seconds (None: forever) for records, then read all available."""
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        return self.read_available()

    def __iter__(self) -> Iterator[KernelLogEntry]:
        while True:
            yield from self.poll(None)

    def calibrate(self, samples: int = 5, timeout: float = 1.0) -> ClockOffset:
        """Measure the printk clock against CLOCK_MONOTONIC and apply it to what this reader
        yields from now on. Writes `samples` debug-level records (`stall-recorder: clock sync`)
        to /dev/kmsg, so it needs root; each is stamped by the kernel between two
        clock_gettime() calls, and the narrowest bracket wins. Call it again now and then over
        a long session: the two clocks can drift apart under NTP slewing."""
        nonce = os.urandom(6).hex()
        probe = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        best: tuple[int, int] | None = None
        try:
            os.lseek(probe, 0, os.SEEK_END)
            for i in range(samples):
                text = f"stall-recorder: clock sync {nonce} {i}"
                # A fresh open per write dodges the per-open ratelimit of printk_devkmsg.
                try:
                    out = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
                except PermissionError:
                    raise NotPrivileged(
                        f"cannot write {self.path} to measure the printk clock: run as root, "
                        "with kernel.printk_devkmsg not 'off'") from None
                try:
                    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                    os.write(out, f"<7>{text}\n".encode())
                    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                finally:
                    os.close(out)
                ts = _find_stamp(probe, text, timeout)
                if ts is None:
                    continue
                # The stamp is truncated to whole microseconds: the true one is in [ts, ts+999].
                lo, hi = ts - t1, ts + 999 - t0
                if best is None or hi - lo < best[1] - best[0]:
                    best = (lo, hi)
        finally:
            os.close(probe)
        if best is None:
            raise RuntimeError(f"clock sync records written to {self.path} never came back")
        self.clock_offset = ClockOffset(offset_ns=(best[0] + best[1]) // 2,
                                        uncertainty_ns=(best[1] - best[0] + 1) // 2,
                                        samples=samples)
        return self.clock_offset

    def ingest(self, raw: bytes) -> KernelLogEntry | None:
        """Parse and count one raw record as if it had just been read (also for replaying a
        saved dump); None when it precedes the start time."""
        stats = self.stats
        stats.records_read += 1
        record = parse_record(raw)
        if record.seq is not None:
            if self._next_seq is not None and record.seq > self._next_seq:
                stats.lost += record.seq - self._next_seq
            self._next_seq = record.seq + 1
        ts = record.ts_ns
        if ts is not None and self.clock_offset is not None:
            ts -= self.clock_offset.offset_ns
        if not self._started:
            if ts is not None and ts < self.start_ns:  # type: ignore[operator]
                stats.skipped_before_start += 1
                return None
            self._started = True
        if record.malformed:
            stats.malformed += 1
        event = classify(record.text)
        if isinstance(event, UnknownSubsystemLine):
            stats.unknown += 1
        elif event is not None:
            key = _event_key(event)
            stats.parsed[key] = stats.parsed.get(key, 0) + 1
        offset = self.clock_offset.offset_ns if self.clock_offset is not None else 0
        return KernelLogEntry(record=record, event=event, clock_offset_ns=offset,
                              read_ts_ns=time.clock_gettime_ns(time.CLOCK_MONOTONIC))


def _find_stamp(fd: int, text: str, timeout: float) -> int | None:
    """Read records from fd until the one with this text; its printk stamp in ns."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        try:
            raw = os.read(fd, READ_SIZE)
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            poller.poll(int(left * 1000) + 1)
            continue
        except OSError as e:
            if e.errno == errno.EPIPE:
                continue
            raise
        record = parse_record(raw)
        if record.text == text:
            return record.ts_ns


# --------------------------------------------------------------------------------------------
# Rows for the store
# --------------------------------------------------------------------------------------------

def _sql_value(value: Any) -> Any:
    # SQLite integers are signed 64-bit: addresses >= 2^63 are stored two's-complement (as
    # Perfetto does); a number too large even for that is left NULL (the text keeps it).
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value > _INT64_MAX:
        return value - 2**64 if value < 2**64 else None
    if isinstance(value, int) and value < -_INT64_MAX - 1:
        return None
    return value


def _event_row(event: KernelEvent) -> dict[str, Any]:
    cls = type(event)
    row = {name: _sql_value(getattr(event, name)) for name in _field_names(cls)}
    row["kind"] = event.kind
    vendor = getattr(cls, "vendor", None)
    if vendor is not None:
        row["vendor"] = vendor
    return row


def rows_for(entry: KernelLogEntry, session_id: int,
             kernel_log_id: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Rows to insert for one entry: always the `kernel_log` row first, then the typed row when
    the line parsed. A batched writer passes `kernel_log_id` (the id it assigns to the
    `kernel_log` row, which the typed row then references); without it the typed row's
    `kernel_log_id` is None and the writer sets it to the `cursor.lastrowid` of the first row.
    `TABLE_COLUMNS` gives a fixed column order for positional inserts."""
    record, event = entry.record, entry.event
    subsystem = device = event_kind = None
    if isinstance(event, UnknownSubsystemLine):
        subsystem, event_kind = event.subsystem, event.kind
    elif event is not None:
        subsystem, event_kind, device = event.subsystem, _event_key(event), event.device_name
    if device is None:
        device = record.properties.get("DEVICE")
    props = record.properties
    log_row: dict[str, Any] = {
        "id": kernel_log_id,
        "session_id": session_id,
        "ts": entry.ts_ns,
        "printk_ts": record.ts_ns,
        "seq": _sql_value(record.seq),
        "level": record.level,
        "facility": _sql_value(record.facility),
        "flag": record.flag or None,
        "caller": record.caller,
        "subsystem": subsystem,
        "event_kind": event_kind,
        "device": device,
        "text": record.text,
        "properties": "\n".join(f"{k}={v}" for k, v in props.items()) if props else None,
        "malformed": int(record.malformed),
        "raw": record.raw if record.malformed else None,
    }
    rows: list[tuple[str, dict[str, Any]]] = [("kernel_log", log_row)]
    if isinstance(event, KernelEvent):
        typed = _event_row(event)
        typed.update(session_id=session_id, kernel_log_id=kernel_log_id, ts=entry.ts_ns)
        rows.append((event.table, typed))
    return rows


def _table_columns() -> dict[str, tuple[str, ...]]:
    kernel_log = ("id", "session_id", "ts", "printk_ts", "seq", "level", "facility", "flag",
                  "caller", "subsystem", "event_kind", "device", "text", "properties",
                  "malformed", "raw")
    out: dict[str, list[str]] = {}
    for model in KernelEvent.__subclasses__():
        cols = out.setdefault(model.table, ["session_id", "kernel_log_id", "ts", "kind"])
        if hasattr(model, "vendor") and "vendor" not in cols:
            cols.append("vendor")
        cols.extend(name for name in _field_names(model) if name not in cols)
    return {"kernel_log": kernel_log, **{table: tuple(cols) for table, cols in out.items()}}


# Columns rows_for can fill, per table (typed tables: without `id`, which SQLite assigns).
TABLE_COLUMNS: dict[str, tuple[str, ...]] = _table_columns()
