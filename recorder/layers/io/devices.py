"""The block devices behind the events: name, whole disk, NVMe controller, PCI function, driver and
model of a (major, minor), read from sysfs into `block_device` (store/migrations/0007_devices.sql).

How a device is found in sysfs (every path relative to the sysfs root, /sys unless a test gives
another):
- `dev/block/M:m` links to the device's directory; its `uevent` has DEVNAME. A partition's
  directory has a `partition` file and sits inside its disk's directory.
- The disk's `device` link is the device the disk hangs off: the NVMe controller (`nvme0` for
  `nvme0n1`), a SCSI device, a virtio device; loop, zram and device-mapper disks have none.
- NVMe multipath: a namespace head (`nvme0n1` made by the subsystem) hangs off `nvme-subsys0`, and
  each path to it is a hidden disk `nvme0c1n1` (subsystem 0, controller 1, namespace 1) hanging off
  its controller; requests are issued on the paths. A head reached through one controller gets that
  controller; through several it gets none (its paths' rows name each).
- The PCI function is the nearest component of the resolved device path that looks like
  `dddd:bb:dd.f`; the driver is the first one bound to the device or an ancestor, skipping the SCSI
  upper-level drivers (`sd`, `sr`, ...) that say nothing about the hardware.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass
from pathlib import Path

from store.db import Writer

SYSFS = Path("/sys")
COLUMNS = ("session_id", "name", "dev_major", "dev_minor", "disk", "controller", "pci_address", "driver",
           "model")

_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_NVME_CONTROLLER = re.compile(r"nvme\d+")
_GENERIC_DRIVERS = {"sd", "sr", "st", "sg", "ses", "ch", "osst"}


@dataclass(frozen=True)
class BlockDevice:
    """One row of `block_device` without its session."""

    name: str
    dev_major: int
    dev_minor: int
    disk: str
    controller: str | None
    pci_address: str | None
    driver: str | None
    model: str | None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _devname(directory: Path) -> str:
    for line in (_read(directory / "uevent") or "").splitlines():
        if line.startswith("DEVNAME="):
            return line.split("=", 1)[1]
    return directory.name


def _pci_address(device: Path) -> Path | None:
    """The nearest PCI function at or above `device` (a resolved path)."""
    for part in (device, *device.parents):
        if _PCI_ADDRESS.fullmatch(part.name):
            return part
    return None


def _driver(device: Path, sysfs: Path) -> str | None:
    devices = sysfs / "devices"
    for part in (device, *device.parents):
        if part == devices or devices not in part.parents:
            return None
        link = part / "driver"
        if link.is_symlink():
            name = link.resolve().name
            if name not in _GENERIC_DRIVERS:
                return name
    return None


def _controller(disk_dir: Path, device: Path) -> tuple[str | None, Path | None]:
    """(NVMe controller name, its resolved directory) of a disk, or (None, None)."""
    if _NVME_CONTROLLER.fullmatch(device.name):
        return device.name, device
    if device.name.startswith("nvme-subsys"):  # a multipath head: the controllers of its paths
        paths = sorted((disk_dir / "multipath").glob("nvme*")) if (disk_dir / "multipath").is_dir() else []
        controllers = {(disk_dir / "multipath" / p.name / "device").resolve() for p in paths}
        if len(controllers) == 1:
            ctrl = controllers.pop()
            return ctrl.name, ctrl
    return None, None


def describe(major: int, minor: int, sysfs: Path = SYSFS) -> BlockDevice | None:
    """The device `major:minor` as sysfs describes it now, or None when there is none."""
    link = sysfs / "dev" / "block" / f"{major}:{minor}"
    if not link.exists():
        return None
    directory = link.resolve()
    name = _devname(directory)
    disk_dir = directory.parent if (directory / "partition").exists() else directory
    disk = _devname(disk_dir)
    device_link = disk_dir / "device"
    if not device_link.exists():  # loop, zram, device mapper: nothing behind them in sysfs
        return BlockDevice(name, major, minor, disk, None, None, None, None)
    device = device_link.resolve()
    controller, controller_dir = _controller(disk_dir, device)
    behind = controller_dir or device
    pci = _pci_address(behind)
    model = _read(device / "model") or (_read(controller_dir / "model") if controller_dir else None)
    return BlockDevice(name, major, minor, disk, controller, pci.name if pci else None, _driver(behind, sysfs),
                       model or None)


def present(sysfs: Path = SYSFS) -> list[BlockDevice]:
    """Every block device sysfs lists now (disks, partitions, hidden NVMe paths), by number."""
    numbers = []
    folder = sysfs / "dev" / "block"
    for entry in folder.iterdir() if folder.is_dir() else ():
        major, _, minor = entry.name.partition(":")
        if major.isdigit() and minor.isdigit():
            numbers.append((int(major), int(minor)))
    return [found for found in (describe(major, minor, sysfs) for major, minor in sorted(numbers)) if found]


class BlockDeviceTable:
    """Writes each device of a session once: all present at the start, then any new one a block
    request names (a loop device set up during the recording, a hot-plugged disk)."""

    def __init__(self, writer: Writer, session_id: int, sysfs: Path = SYSFS) -> None:
        self.writer = writer
        self.session_id = session_id
        self.sysfs = sysfs
        self.known: dict[tuple[int, int], BlockDevice | None] = {}
        writer.table("block_device", COLUMNS)

    def record_present(self) -> int:
        """Rows for every device present now and not written yet; returns how many."""
        added = 0
        for found in present(self.sysfs):
            if (found.dev_major, found.dev_minor) not in self.known:
                self._add(found)
                added += 1
        return added

    def note(self, major: int, minor: int) -> BlockDevice | None:
        """The device a request names, described (and written) the first time it is named; None when
        sysfs does not know it. Looked up once: a device gone by then is not re-read per request."""
        key = (major, minor)
        if key not in self.known:
            found = describe(major, minor, self.sysfs)
            self.known[key] = found
            if found:
                self._add(found)
        return self.known[key]

    def _add(self, found: BlockDevice) -> None:
        self.known[(found.dev_major, found.dev_minor)] = found
        self.writer.add("block_device", (self.session_id, *astuple(found)))
