"""Parsers of kernel log lines, one module per family of messages; `classify(text)` picks the
family by cheap substring tests and returns its typed event, an `UnknownSubsystemLine` for a
line of a watched subsystem that no parser knows, or None for every other line.

Field names are the column names of the typed tables in store/migrations/0002_kernel_log.sql;
`kind` goes into the table's `kind` column."""

from __future__ import annotations

import re
from dataclasses import fields

from recorder.layers.kmsg.parsers.aer import AerBit, AerBusError, AerMessage, AerStatusMask, _parse_aer
from recorder.layers.kmsg.parsers.block import BlockIOError, BufferIOError, _parse_block
from recorder.layers.kmsg.parsers.common import _BDF, KernelEvent, UnknownSubsystemLine
from recorder.layers.kmsg.parsers.iommu import (
    AMD_VI_EVENT_TYPES,
    AmdViEvent,
    DmarFault,
    DmarFaultStatus,
    DmarIntrRemapFault,
    _parse_amd,
    _parse_dmar,
)
from recorder.layers.kmsg.parsers.nvme import (
    NvmeAbortStatus,
    NvmeControllerDown,
    NvmeNotReady,
    NvmePowerSavingHint,
    NvmeResetFailure,
    NvmeResetting,
    NvmeTimeout,
    _parse_nvme,
)
from recorder.layers.kmsg.parsers.oom import (
    OomConstraint,
    OomInvoked,
    OomKilled,
    OomReaped,
    OomVictimSelected,
    _parse_oom,
)
from recorder.layers.kmsg.parsers.swiotlb import SwiotlbFull, _parse_swiotlb
from recorder.layers.kmsg.parsers.xid import XID_MEANINGS, XidError, _parse_xid

ParsedEvent = (
    NvmeTimeout | NvmeAbortStatus | NvmeResetting | NvmeControllerDown | NvmePowerSavingHint
    | NvmeNotReady | NvmeResetFailure | BlockIOError | BufferIOError | SwiotlbFull
    | DmarFaultStatus | DmarFault | DmarIntrRemapFault | AmdViEvent | AerMessage | AerBusError
    | AerStatusMask | AerBit | XidError | OomInvoked | OomConstraint | OomKilled
    | OomVictimSelected | OomReaped
)



_OOM_WORD = re.compile(r"(?<![A-Za-z])oom")
# blk_print_req_error(): "<what> error, dev <disk>, sector <n> ..."; no other subsystem prints this
_BLOCK_ERROR_LINE = re.compile(r" error, dev [^,\s]+, sector \d")
_AER_OLD_BIT = re.compile(rf"\S+ {_BDF}: +\[")


def _subsystem_of(text: str) -> str | None:
    """Which watched subsystem a line belongs to, by cheap substring tests; None for others.
    Order matters: a PCI driver prefix (`nvme 0000:01:00.0: swiotlb ...`) must not win, and a block
    error line names a device the administrator named (`dev swiotlb0`, `dev oom1`), so its own shape
    is tested before any keyword."""
    if _BLOCK_ERROR_LINE.search(text):
        return "block"
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
    return event  # type: ignore[return-value]  # each parser returns one of ParsedEvent's kinds, typed as their base


def _fits_64_bits(event: KernelEvent) -> bool:
    # The kernel prints no number beyond 64 bits; a line that has one is not what it looks like.
    for name in _field_names(type(event)):
        value = getattr(event, name)
        if type(value) is int and not -(2**63) <= value < 2**64:
            return False
    return True


__all__ = [
    "AMD_VI_EVENT_TYPES",
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
    "UnknownSubsystemLine",
    "XID_MEANINGS",
    "XidError",
    "classify",
]
