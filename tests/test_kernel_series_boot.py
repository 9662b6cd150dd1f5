"""The recorder's decoding on the records a kernel with the I/O tag series wrote (kernel-patches/).

The series' boot test (kernel-patches/check --boot, boot/init.c) causes tagged I/O in a qemu guest and,
last, writes the guest's raw trace records (each CPU's trace_pipe_raw pages: the bytes a tracepoint's
BPF program reads through `args`) to its raw disk. Here they are decoded with the series' `format`
files (tracefs-formats.txt, which the check compares with what the guest printed), turned into the
ring records the recorder's tracepoint programs send (bpf/block.bpf.c block_done and nvme_timeout,
bpf/dma.bpf.c dma_map_latency, bpf/mm.bpf.c io_tag_write: the same field copies), and handed to the
recorder's I/O layer, which writes its rows to a real SQLite store; the rows must carry the tags the
guest set, where it set them.

By default the records are the ones committed in tests/fixtures/kernel-series-boot/ (a boot of the
current series); `kernel-patches/check --boot` runs this file on the boot it just did by setting
STALL_RECORDER_KERNEL_BOOT to its boot directory (disk2.img and console.txt). That those programs
compile and pass the verifier against the same formats is tests/test_kernel_series_bpf.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from recorder.core.identity import Identity
from recorder.core.layer import Context
from recorder.layers.io import records
from recorder.layers.io.layer import IoLayer
from store.db import Writer, open_store
from tests import ftrace_raw
from tests.conftest import ROOT, q

FIXTURE = ROOT / "tests" / "fixtures" / "kernel-series-boot"
FORMATS = ROOT / "kernel-patches" / "tracefs-formats.txt"
DUMP_AT = 8 << 20  # where boot/init.c writes the dump on the raw disk
C = records.RECORDS.constants
MIB = 1 << 20

# the tags boot/init.c sets (TAG_*)
TAG = {name: int(value, 16) for name, value in (
    ("A", "5a5a00000000a001"), ("B", "5a5a00000000b002"), ("C", "5a5a00000000c003"),
    ("X", "5a5a00000000d004"), ("E", "5a5a00000000e005"), ("T", "5a5a00000000f006"),
    ("S", "5a5a000000001007"), ("M1", "5a5a000000002008"), ("M2", "5a5a000000003009"),
    ("P", "5a5a00000000400a"), ("Q", "5a5a00000000500b"))}


def boot_files() -> tuple[bytes, str]:
    """(the dump, the guest's console text): of the boot named by STALL_RECORDER_KERNEL_BOOT, else
    the committed fixture."""
    where = os.environ.get("STALL_RECORDER_KERNEL_BOOT")
    if not where:
        return (FIXTURE / "trace-dump.bin").read_bytes(), (FIXTURE / "console.txt").read_text()
    boot = Path(where)
    with open(boot / "disk2.img", "rb") as disk:
        disk.seek(DUMP_AT)
        data = disk.read(64 * MIB)
    return data, (boot / "console.txt").read_text(errors="replace")


@pytest.fixture(scope="module")
def boot() -> tuple[ftrace_raw.Dump, list[tuple[str, int, dict]], str]:
    data, console = boot_files()
    dump = ftrace_raw.read_dump(data)
    decoded = list(ftrace_raw.records(dump, ftrace_raw.parse_formats(FORMATS.read_text())))
    return dump, decoded, console


NO_SECTOR = 2**64 - 1  # blk_rq_pos() of a request without a start sector (flush, passthrough)


def ring_record(name: str, ts: int, f: dict) -> tuple[str, bytes] | None:
    """(ring name, bytes) the recorder's program for `name` sends for a record with fields `f`, or None
    when it sends nothing.

    The guest's pids mean nothing on this host, so submitter pid/tid are left 0 (the rows then name
    no thread), and block requests are sent as block_done sends one whose issue it did not see."""
    if name == "block/block_rq_complete":
        if f["sector"] == NO_SECTOR:
            # the flush machinery's own request or a passthrough command: no bio queues at that
            # sector, so block_done finds no in-flight entry for it and sends nothing
            return None
        nbytes = f["nr_sector"] << 9
        return "block_events", records.BLOCK.pack(
            ts, 0, 0, 0, ts, f["sector"], 0, f["io_tag"], 0, f["dev"], nbytes, 0, 0, f["error"], 0, 0,
            C["BLOCK_FLAG_AI"], f["rwbs"].encode(), b"")
    if name == "nvme/nvme_timeout":
        return "nvme_ai_events", records.NVME_AI.pack(
            ts, f["sector"], f["io_tag"], f["ctrl_id"], f["qid"], f["rq_tag"], f["nr_bytes"], 0, 0, f["cid"],
            f["opcode"], f["action"], 0, f["disk"].encode())
    if name == "dma/dma_map_latency":
        flags = (C["DMA_FLAG_DIRECT"] if f["direct"] else 0) | (C["DMA_FLAG_BOUNCED"] if f["bounced"] else 0)
        return "dma_events", records.DMA.pack(
            ts - f["latency_ns"], f["latency_ns"], f["phys_addr"], f["dma_addr"], f["size"], f["attrs"], 0, 0,
            C["DMA_KIND_AI_MAP"], f["dir"], f["nents"], flags, f["device"].encode(), b"")
    if name == "io_tag/io_tag_write":
        return "mm_events", records.CHECKPOINT.pack(
            ts, f["ino"], f["pos"], f["count"], f["io_tag"], f["dev"], 0, 0, 0, f["name"].encode())
    raise ValueError(f"no program of the recorder reads {name}")


@pytest.fixture(scope="module")
def rows(boot, tmp_path_factory):
    """The recorder's I/O layer fed with the guest's records: a query function on its store."""
    _, decoded, _ = boot
    db = tmp_path_factory.mktemp("boot") / "boot.db"
    store = open_store(db, create=True)
    sid = store.db["session"].insert({
        "started_ts": 1, "wall_offset_ns": time.time_ns(), "status": "recording", "recorder_pid": os.getpid(),
        "hostname": "guest", "kernel_release": "6.12 with the I/O tag series", "boot_id": "b", "cpu_count": 2,
        "target": "test", "command": "test", "tool_version": "t"}).last_pk
    writer = Writer(store)
    layer = IoLayer(Context(store, writer, sid, 0, Identity(store, writer, sid), {}))
    layer.prepare()
    sinks = layer.sinks()
    for name, ts, fields in decoded:  # the series' events (the dump's others have no format here)
        sent = ring_record(name, ts, fields)
        if sent:
            sinks[sent[0]](sent[1])
    layer.flush()
    writer.close()
    store.close()
    return lambda sql, params=(): q(db, sql, params)


def test_the_dump_holds_the_series_events(boot):
    dump, decoded, _ = boot
    assert dump.cpus, "no CPU's pages in the dump"
    assert all(len(pages) % 4096 == 0 for pages in dump.cpus.values())
    counts = Counter(name for name, _, _ in decoded)
    for name in ("block/block_rq_complete", "nvme/nvme_timeout", "dma/dma_map_latency", "io_tag/io_tag_write"):
        assert counts[name] > 0, (name, counts)
    # the guest counted the same completions and maps in its textual trace
    total = re.search(r"^ok: block_rq_complete fired \((\d+) completions\)", boot[2], re.M)
    maps = re.search(r"^ok: dma_map_latency fired \((\d+) maps\)", boot[2], re.M)
    assert total and maps, "the console lacks the guest's counts"
    assert counts["block/block_rq_complete"] == int(total.group(1))
    assert counts["dma/dma_map_latency"] == int(maps.group(1))
    for cpu in dump.cpus:
        stamps = [ts for ts, _ in ftrace_raw.page_records(dump.cpus[cpu], dump.header_page)]
        assert stamps == sorted(stamps), f"cpu{cpu}: timestamps go back"


def test_binary_completions_are_what_the_kernel_printed(boot):
    """Every tagged completion decoded from the binary records (offsets from the format file) is a line
    the guest printed from the kernel's own text rendering of the same record, and the reverse."""
    _, decoded, console = boot
    printed = Counter(re.findall(r"^completion: (\d+,\d+ \S+ sector=\d+ bytes=\d+ io_tag=0x[0-9a-f]+)$",
                                 console, re.M))
    assert printed, "the console has no completion lines"
    binary = Counter(
        f"{f['dev'] >> 20},{f['dev'] & 0xFFFFF} {f['rwbs']} sector={f['sector']} bytes={f['nr_sector'] * 512} "
        f"io_tag={f['io_tag']:#x}"
        for name, _, f in decoded if name == "block/block_rq_complete" and f["io_tag"])
    assert binary == printed


def test_a_drifted_format_misreads_the_records(boot):
    """The comparison above can fail: with io_tag read 8 bytes early (where a format that lost a field
    before it would put it), the binary records no longer give what the kernel printed."""
    dump, _, _ = boot
    formats = ftrace_raw.parse_formats(FORMATS.read_text())
    fields = formats["block/block_rq_complete"].fields
    fields["io_tag"] = dataclasses.replace(fields["io_tag"], offset=fields["io_tag"].offset - 8)
    tags = {f["io_tag"] for name, _, f in ftrace_raw.records(dump, formats) if name == "block/block_rq_complete"}
    assert not tags & set(TAG.values())


def test_block_requests_carry_the_tag_of_who_caused_them(rows):
    got = {tag: (size, n) for tag, size, n in rows(
        "SELECT io_tag, SUM(size_bytes), COUNT(*) FROM block_request WHERE op = 'write' AND io_tag != 0 "
        "GROUP BY io_tag")}
    assert got[TAG["A"]][0] >= MIB  # written back by an untagged sync()
    assert got[TAG["B"]][0] >= MIB  # fsync()ed by a task tagged C
    assert TAG["C"] not in got
    assert got[TAG["X"]][0] >= 16 * MIB  # XFS writeback
    assert got[TAG["T"]][0] == 4 * MIB  # throttled, sent by a worker
    assert got[TAG["S"]][0] == MIB and got[TAG["S"]][1] >= 16  # split
    assert got[TAG["M1"]][0] == 32 * 1024 and got[TAG["M1"]][1] < 8  # 8 writes merged, one tag
    assert got[TAG["M2"]][0] == 32 * 1024
    # adjacent writes tagged P, Q, P, P, Q under one plug: only P+P merged
    assert got[TAG["P"]] == (12 * 1024, 2)
    assert got[TAG["Q"]] == (8 * 1024, 2)
    assert set(got) <= set(TAG.values()), "a tag the guest never set"
    devices = rows("SELECT DISTINCT dev_major FROM block_request WHERE io_tag != 0")
    assert devices == [(259,)]  # blkext: the guest's NVMe namespaces


def test_nvme_timeout_decisions_decode(rows):
    got = rows("SELECT controller, disk, qid, opcode, action, size_bytes, io_tag FROM nvme_timeout_action "
               "ORDER BY ts")
    assert [r[4] for r in got] == ["abort", "reset"]
    for controller, disk, qid, opcode, _, size, tag in got:
        assert (controller, disk, opcode, size, tag) == ("nvme0", "nvme0n1", 2, 4096, TAG["E"])  # 2: read
        assert qid > 0  # an I/O queue, not the admin queue
    assert rows("SELECT SUM(size_bytes) FROM block_request WHERE op = 'read' AND io_tag = ?",
                (TAG["E"],)) == [(4096,)]  # the read completes after the reset, still tagged


def test_tagged_write_extents_decode(rows):
    x = rows("SELECT pos, size_bytes, dev_major FROM checkpoint_write WHERE name = 'x' AND io_tag = ? ORDER BY pos",
             (TAG["X"],))
    assert x == [(i * MIB, MIB, 259) for i in range(16)]
    assert rows("SELECT COUNT(*) FROM checkpoint_write WHERE name = 'plain'") == [(0,)]  # untagged writer
    assert rows("SELECT COUNT(*) FROM checkpoint_write WHERE io_tag = 0") == [(0,)]


def test_dma_map_latency_decodes(rows):
    maps = rows("SELECT COUNT(*), SUM(bounced), SUM(direct), MIN(dur), MIN(size_bytes), MAX(nents), "
                "COUNT(DISTINCT device) FROM dma_event WHERE kind = 'map_latency'")
    count, bounced, direct, min_dur, min_size, max_nents, devices = maps[0]
    assert count > 0
    assert bounced == direct == count  # swiotlb=force: every dma-direct mapping bounces
    assert min_dur >= 0 and min_size > 0  # (the guest's clock may tick in jiffies: 0 is a latency)
    assert max_nents > 1  # scatterlists of multi-page requests
    names = [name for (name,) in rows("SELECT DISTINCT device FROM dma_event")]
    assert devices >= 1 and all(re.fullmatch(r"0000:00:[0-9a-f]{2}\.[0-7]", n) for n in names), names
    directions = {d for (d,) in rows("SELECT DISTINCT direction FROM dma_event")}
    assert directions <= {"to_device", "from_device"} and "to_device" in directions
