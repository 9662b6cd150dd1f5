"""IOMMU faults: Intel VT-d (DMAR) and AMD-Vi events."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import _H, KernelEvent, _hex, _opt_int

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


def _parse_dmar(text: str) -> KernelEvent | None:
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


def _parse_amd(text: str) -> KernelEvent | None:
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
