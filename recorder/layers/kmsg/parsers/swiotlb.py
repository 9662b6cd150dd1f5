"""SWIOTLB bounce buffer exhaustion."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import _D, KernelEvent, _opt_int

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




_SWIOTLB_FULL = re.compile(
    rf"(?:(\S+) (\S+): )?swiotlb buffer is full \(sz: {_D} bytes\)"
    rf"(?:, total {_D} \(slots\), used {_D} \(slots\))?"
)


def _parse_swiotlb(text: str) -> KernelEvent | None:
    if m := _SWIOTLB_FULL.fullmatch(text):
        return SwiotlbFull(driver=m[1], device=m[2], size_bytes=int(m[3]),
                           total_slots=_opt_int(m[4]), used_slots=_opt_int(m[5]))
    return None
