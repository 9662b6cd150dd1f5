"""The kernel log layer: /dev/kmsg read from the session start, its lines parsed into typed events,
and their rows.

- record.py: `parse_record(raw)` splits one `/dev/kmsg` record (`prio,seq,usec,flag[,...];text` plus
  ` KEY=value` continuation lines) into a `KmsgRecord`; it never raises.
- parsers/: one module per family of messages a stall can come from (NVMe, block layer, SWIOTLB,
  Intel VT-d and AMD-Vi, PCIe AER, NVIDIA Xid, OOM); `classify(text)` returns one typed event per
  line, an `UnknownSubsystemLine` for a line of those subsystems that no parser knows (kept, never
  dropped), or None for every other line.
- reader.py: `KmsgReader` reads `/dev/kmsg` without blocking from a CLOCK_MONOTONIC start time and
  counts what it read, parsed, could not parse and lost.
- rows.py: `rows_for(entry, session_id)` turns what the reader yields into rows for the tables of
  store/migrations/0002_kernel_log.sql.
- layer.py: `KernelLog`, the session's layer.

Formats are those the kernel prints, old and new kernels; each parser module names the kernel
source it follows.
"""

from recorder.errors import NotPrivileged
from recorder.layers.kmsg.parsers import *  # noqa: F403
from recorder.layers.kmsg.parsers import __all__ as _parsers_all
from recorder.layers.kmsg.parsers import _subsystem_of  # noqa: F401  (tests check the subsystem rule)
from recorder.layers.kmsg.parsers.xid import xid_meaning
from recorder.layers.kmsg.reader import ClockOffset, KernelLogEntry, KmsgReader, KmsgStats
from recorder.layers.kmsg.record import KmsgRecord, parse_record, split_dump
from recorder.layers.kmsg.rows import TABLE_COLUMNS, rows_for

__all__ = [
    *_parsers_all, "ClockOffset", "KernelLogEntry", "KmsgReader", "KmsgRecord", "KmsgStats", "NotPrivileged",
    "TABLE_COLUMNS", "parse_record", "rows_for", "split_dump", "xid_meaning",
]
