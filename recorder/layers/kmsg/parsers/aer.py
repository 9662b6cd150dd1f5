"""PCIe Advanced Error Reporting."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import _BDF, _PCI_PREFIX, KernelEvent, _hex, _opt_int

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


def _parse_aer(text: str) -> KernelEvent | None:
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
