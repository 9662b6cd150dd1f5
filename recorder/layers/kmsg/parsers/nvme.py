"""NVMe controller messages (drivers/nvme/host/pci.c and core.c)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import _D, _H, _SD, KernelEvent, _hex, _opt_int

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


def _parse_nvme(text: str) -> KernelEvent | None:
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
