"""What every parser of kernel log lines shares: the event base class, the line of a watched
subsystem no parser knows, and the bounded number patterns.

Numbers are bounded (20 decimal / 16 hex digits) so a mangled line can never make int() slow or
raise; a line that does not fit becomes an UnknownSubsystemLine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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



# ---- Lines of those subsystems that no parser knows ----------------------------------------


@dataclass(slots=True, frozen=True)
class UnknownSubsystemLine:
    """A line that belongs to a watched subsystem but matches no parser: kept raw and counted."""

    subsystem: str  # nvme, block, swiotlb, intel_iommu, amd_iommu, aer, nvidia, oom
    text: str
    kind: ClassVar[str] = "unknown"



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
