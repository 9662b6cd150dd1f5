"""Block devices in `block_device`: the sysfs walk against fake sysfs trees laid out as the kernel
lays out NVMe (plain and multipath), SCSI, virtio and loop devices (there is no NVMe here); then
against this machine's real disks and loop devices (root), and in a real session, where a loop
device created during the recording is described when a request first names it (real BPF)."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

from recorder.layers.io.devices import BlockDevice, BlockDeviceTable, describe, present
from recorder.layers.io.layer import parse_rwbs
from store.db import Writer, open_store

# -- fake sysfs ---------------------------------------------------------------------------------


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _disk(sysfs: Path, path: str, majmin: str, device: Path | None = None, partition: bool = False) -> Path:
    """A block device directory at devices/PATH with its uevent, dev and /sys/dev/block link."""
    folder = sysfs / "devices" / path
    folder.mkdir(parents=True)
    major, minor = majmin.split(":")
    devtype = "partition" if partition else "disk"
    (folder / "uevent").write_text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={folder.name}\nDEVTYPE={devtype}\n")
    (folder / "dev").write_text(majmin + "\n")
    if partition:
        (folder / "partition").write_text("1\n")
    if device is not None:
        _link(folder / "device", device)
    _link(sysfs / "dev" / "block" / majmin, folder)
    return folder


def _device(sysfs: Path, path: str, driver: str | None = None, model: str | None = None) -> Path:
    folder = sysfs / "devices" / path
    folder.mkdir(parents=True, exist_ok=True)
    if driver:
        drv = sysfs / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        _link(folder / "driver", drv)
    if model is not None:
        (folder / "model").write_text(model)
    return folder


PORT = "pci0000:00/0000:00:1d.0"  # a root port (driver pcieport) above the endpoints


@pytest.fixture
def sysfs(tmp_path) -> Path:
    root = tmp_path / "sys"
    _device(root, PORT, driver="pcieport")
    return root


def test_rwbs_names_the_operation_and_an_empty_preflush_bio_is_a_flush():
    """(op, sync, metadata, fua, readahead, preflush) as the block layer's rwbs says; an empty bio
    with a preflush keeps its own rwbs ("FWS") when its flush request's issue was not seen, and is
    still a flush, not a write."""
    assert parse_rwbs("WS", 4096) == ("write", 1, 0, 0, 0, 0)
    assert parse_rwbs("FWFS", 4096) == ("write", 1, 0, 1, 0, 1)
    assert parse_rwbs("RA", 131072) == ("read", 0, 0, 0, 1, 0)
    assert parse_rwbs("RM", 4096) == ("read", 0, 1, 0, 0, 0)
    assert parse_rwbs("FF", 0) == ("flush", 0, 0, 0, 0, 1)
    assert parse_rwbs("FWS", 0) == ("flush", 1, 0, 0, 0, 1)
    assert parse_rwbs("DE", 8192) == ("secure_erase", 0, 0, 0, 0, 0)
    assert parse_rwbs("D", 8192)[0] == "discard" and parse_rwbs("N", 0)[0] == "other"


def test_nvme_namespace_and_partition(sysfs):
    _device(sysfs, f"{PORT}/0000:3d:00.0", driver="nvme")
    ctrl = _device(sysfs, f"{PORT}/0000:3d:00.0/nvme/nvme0", model="Samsung SSD 990 PRO 2TB                 \n")
    ns = _disk(sysfs, f"{PORT}/0000:3d:00.0/nvme/nvme0/nvme0n1", "259:0", device=ctrl)
    _disk(sysfs, f"{PORT}/0000:3d:00.0/nvme/nvme0/nvme0n1/nvme0n1p2", "259:2", partition=True)
    assert ns.exists()
    expected = dict(disk="nvme0n1", controller="nvme0", pci_address="0000:3d:00.0", driver="nvme",
                    model="Samsung SSD 990 PRO 2TB")
    assert describe(259, 0, sysfs) == BlockDevice("nvme0n1", 259, 0, **expected)
    # a partition takes everything from its disk
    assert describe(259, 2, sysfs) == BlockDevice("nvme0n1p2", 259, 2, **expected)


def test_nvme_multipath_paths_and_heads(sysfs):
    ctrls = []
    for i, fn in enumerate(("0000:3d:00.0", "0000:3e:00.0")):
        _device(sysfs, f"{PORT}/{fn}", driver="nvme")
        ctrls.append(_device(sysfs, f"{PORT}/{fn}/nvme/nvme{i}", model="Dual-port NVMe\n"))
    subsys = _device(sysfs, "virtual/nvme-subsystem/nvme-subsys0", model="Dual-port NVMe\n")
    # namespace 1 through controllers 0 and 1; namespace 2 through controller 1 only
    head1 = _disk(sysfs, "virtual/nvme-subsystem/nvme-subsys0/nvme0n1", "259:0", device=subsys)
    head2 = _disk(sysfs, "virtual/nvme-subsystem/nvme-subsys0/nvme0n2", "259:1", device=subsys)
    paths = {
        "nvme0c0n1": (0, "259:2", head1), "nvme0c1n1": (1, "259:3", head1), "nvme0c1n2": (1, "259:4", head2),
    }
    for name, (ctrl, majmin, head) in paths.items():
        path = _disk(sysfs, f"{PORT}/{('0000:3d:00.0', '0000:3e:00.0')[ctrl]}/nvme/nvme{ctrl}/{name}", majmin,
                     device=ctrls[ctrl])
        _link(head / "multipath" / name, path)
    # each path names its own controller (nvme0c1n1: subsystem 0, controller 1)
    assert describe(259, 2, sysfs).controller == "nvme0"
    p = describe(259, 3, sysfs)
    assert (p.name, p.disk, p.controller, p.pci_address, p.driver) == ("nvme0c1n1", "nvme0c1n1", "nvme1",
                                                                      "0000:3e:00.0", "nvme")
    # a head reached through two controllers names none; through one, that one
    h1 = describe(259, 0, sysfs)
    assert (h1.name, h1.controller, h1.pci_address, h1.driver, h1.model) == ("nvme0n1", None, None, None,
                                                                            "Dual-port NVMe")
    h2 = describe(259, 1, sysfs)
    assert (h2.controller, h2.pci_address, h2.driver) == ("nvme1", "0000:3e:00.0", "nvme")


def test_scsi_disk_names_the_host_adapter_driver(sysfs):
    _device(sysfs, "pci0000:00/0000:00:17.0", driver="ahci")
    scsi = _device(sysfs, "pci0000:00/0000:00:17.0/ata1/host0/target0:0:0/0:0:0:0", driver="sd",
                   model="Samsung SSD 860 \n")
    _disk(sysfs, "pci0000:00/0000:00:17.0/ata1/host0/target0:0:0/0:0:0:0/block/sda", "8:0", device=scsi)
    _disk(sysfs, "pci0000:00/0000:00:17.0/ata1/host0/target0:0:0/0:0:0:0/block/sda/sda1", "8:1", partition=True)
    assert describe(8, 1, sysfs) == BlockDevice("sda1", 8, 1, "sda", None, "0000:00:17.0", "ahci", "Samsung SSD 860")


def test_virtio_loop_and_missing(sysfs):
    _device(sysfs, "pci0000:00/0000:00:02.0", driver="virtio-pci")
    virtio = _device(sysfs, "pci0000:00/0000:00:02.0/virtio1", driver="virtio_blk")
    _disk(sysfs, "pci0000:00/0000:00:02.0/virtio1/block/vda", "254:0", device=virtio)
    _disk(sysfs, "virtual/block/loop3", "7:3")
    assert describe(254, 0, sysfs) == BlockDevice("vda", 254, 0, "vda", None, "0000:00:02.0", "virtio_blk", None)
    assert describe(7, 3, sysfs) == BlockDevice("loop3", 7, 3, "loop3", None, None, None, None)
    assert describe(7, 4, sysfs) is None
    assert [(d.dev_major, d.dev_minor) for d in present(sysfs)] == [(7, 3), (254, 0)]


def test_table_writes_each_device_once(tmp_path, sysfs):
    _disk(sysfs, "virtual/block/loop0", "7:0")
    store = open_store(tmp_path / "d.db", create=True)
    sid = store.db["session"].insert({
        "started_ts": 0, "wall_offset_ns": 0, "status": "recording", "recorder_pid": os.getpid(), "hostname": "h",
        "kernel_release": "r", "boot_id": "b", "cpu_count": 1, "target": "t", "command": "c", "tool_version": "0",
    }).last_pk
    writer = Writer(store)
    table = BlockDeviceTable(writer, sid, sysfs)
    assert table.record_present() == 1
    _disk(sysfs, "virtual/block/loop1", "7:1")  # set up after the start
    assert table.note(7, 0).name == "loop0"
    assert table.note(7, 1).name == "loop1"
    assert table.note(7, 1).name == "loop1"
    assert table.note(7, 9) is None
    assert table.record_present() == 0
    writer.close()
    assert q(tmp_path / "d.db", "SELECT name, dev_major, dev_minor, disk FROM block_device ORDER BY dev_minor") == [
        ("loop0", 7, 0, "loop0"), ("loop1", 7, 1, "loop1")]


# -- this machine's devices -----------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set up loop devices")
PCI = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def test_real_disks_match_sysfs():
    """Every disk sysfs lists: a PCI address that is a real PCI function on the device's path, and the
    driver that is really bound to the device (or the PCI function) behind it."""
    disks = sorted(Path("/sys/block").iterdir())
    if not disks:
        pytest.skip("no block devices in /sys/block")
    for entry in disks:
        major, minor = (int(x) for x in (entry / "dev").read_text().split(":"))
        found = describe(major, minor)
        assert found is not None and found.name == entry.name and found.disk == entry.name
        if not (entry / "device").exists():
            assert (found.controller, found.pci_address, found.driver) == (None, None, None), found
            continue
        behind = (entry / "device").resolve()
        on_path = [part for part in behind.parts if PCI.fullmatch(part)]
        if on_path:
            assert found.pci_address == on_path[-1], found
            assert Path("/sys/bus/pci/devices", found.pci_address).exists()
        if (behind / "driver").exists() and (behind / "driver").resolve().name not in ("sd", "sr"):
            assert found.driver == (behind / "driver").resolve().name, found


def _mbr_with_one_partition(img: Path, size_mib: int) -> None:
    """A disk image whose MBR holds one Linux partition from sector 2048 to the end."""
    sectors = size_mib * 2048
    entry = bytes([0, 0, 0, 0, 0x83, 0, 0, 0]) + (2048).to_bytes(4, "little") + (sectors - 2048).to_bytes(4, "little")
    with img.open("wb") as f:
        f.truncate(sectors * 512)
        f.seek(446)
        f.write(entry)
        f.seek(510)
        f.write(b"\x55\xaa")


def _kernel_reads_mbr() -> bool | None:
    """Whether the running kernel parses MBR partition tables (None: its config is not readable)."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return "CONFIG_MSDOS_PARTITION=y" in f.read()
    except OSError:
        return None


@needs_root
def test_real_loop_device_and_its_partition(tmp_path):
    if not Path("/dev/loop-control").exists():
        pytest.skip("needs loop devices (/dev/loop-control)")
    if _kernel_reads_mbr() is False:
        pytest.skip("this kernel parses no MBR partition tables (CONFIG_MSDOS_PARTITION is not set)")
    img = tmp_path / "part.img"
    _mbr_with_one_partition(img, 8)
    loop = subprocess.run(["losetup", "-P", "-f", "--show", str(img)], capture_output=True, text=True,
                          check=True).stdout.strip()
    name = Path(loop).name
    try:
        part = Path(f"/sys/block/{name}/{name}p1")
        for _ in range(50):
            if part.exists():
                break
            subprocess.run(["sleep", "0.1"])
        if not part.exists() and _kernel_reads_mbr() is None:
            pytest.skip("the kernel did not scan the partition table (no MBR support?)")
        assert part.exists(), f"the kernel did not scan the partition table of {loop}"
        major, minor = (int(x) for x in (part / "dev").read_text().split(":"))
        assert describe(major, minor) == BlockDevice(f"{name}p1", major, minor, name, None, None, None, None)
        dmaj, dmin = (int(x) for x in Path(f"/sys/block/{name}/dev").read_text().split(":"))
        assert describe(dmaj, dmin).name == name
        assert {(d.name, d.disk) for d in present()} >= {(name, name), (f"{name}p1", name)}
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


@needs_bpf
@pytest.mark.bpf
def test_session_describes_devices_present_and_new(tmp_path):
    """Devices present at the start get rows; a loop device created during the recording gets its row
    when the first request on it is stored; every device a request names has its row."""
    if not Path("/dev/loop-control").exists():
        pytest.skip("needs loop devices (/dev/loop-control)")
    db = tmp_path / "dev.db"
    workload = ROOT / "tests" / "workloads" / "new_loop_device.py"
    res = run_recorder("record", "--db", str(db), "--", sys.executable, str(workload), "--image",
                       str(tmp_path / "new.img"), timeout=300)
    assert res.returncode == 0, res.stderr
    made = workload_output(res.stdout)
    rows = q(db, "SELECT name, disk, controller, pci_address, driver, model FROM block_device"
                 " WHERE dev_major = ? AND dev_minor = ?", (made["major"], made["minor"]))
    assert rows == [(made["device"], made["device"], None, None, None, None)]
    writes = q(db, "SELECT count(*) FROM block_request WHERE dev_major = ? AND dev_minor = ? AND op = 'write'",
               (made["major"], made["minor"]))[0][0]
    assert writes >= made["writes"]
    assert q(db, "SELECT DISTINCT dev_major, dev_minor FROM block_request"
                 " EXCEPT SELECT dev_major, dev_minor FROM block_device") == []
    assert q(db, "SELECT count(*) FROM block_request r JOIN block_device d USING (session_id, dev_major, dev_minor)"
                 " WHERE r.device IS NOT d.name") == [(0,)]
    # everything present at the start (this machine's disks) is there too
    for entry in Path("/sys/block").iterdir():
        if entry.name != made["device"]:
            major, minor = (int(x) for x in (entry / "dev").read_text().split(":"))
            assert q(db, "SELECT name FROM block_device WHERE dev_major = ? AND dev_minor = ?",
                     (major, minor)) == [(entry.name,)]
