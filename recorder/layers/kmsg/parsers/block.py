"""Block layer I/O errors and buffer I/O errors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import _D, _H, KernelEvent, _opt_int

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




_BLOCK_ERROR = re.compile(
    rf"(?:(\w+): )?([\w/ ]+?) error, dev ([^\s,]+), sector {_D}"
    rf"(?: op 0x{_H}:\((\w+)\) flags 0x{_H} phys_seg {_D} prio class {_D})?"
)
_BUFFER_ERROR = re.compile(rf"Buffer I/O error on dev(?:ice)? ([^\s,]+), logical block {_D}"
                           r"(?:, (.+))?")


def _parse_block(text: str) -> KernelEvent | None:
    if m := _BUFFER_ERROR.fullmatch(text):
        return BufferIOError(dev=m[1], logical_block=int(m[2]), context=m[3])
    if m := _BLOCK_ERROR.fullmatch(text):
        return BlockIOError(
            function=m[1], error=m[2], dev=m[3], sector=int(m[4]), op_code=_opt_int(m[5], 16),
            op=m[6], flags=_opt_int(m[7], 16), phys_seg=_opt_int(m[8]),
            prio_class=_opt_int(m[9]),
        )
    return None
