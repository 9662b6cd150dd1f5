"""NVIDIA Xid errors (NVRM)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import KernelEvent, _opt_int

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




_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
    r"(?: GPU-I:(\d{1,4}))?(?: GPU-CI:(\d{1,4}))?\): (\d{1,6})(?:, (.*))?"
)
_XID_PID = re.compile(r"pid=(?:(\d{1,10})|'?<unknown>'?|'[^']*')(?:, name=([^,]*))?(?:, (.*))?")


def _parse_xid(text: str) -> KernelEvent | None:
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
