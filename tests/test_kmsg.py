"""Kernel log reader and parsers (recorder/layers/kmsg/) and the 0002_kernel_log schema.

Fixtures in tests/fixtures/kmsg/*.txt are /dev/kmsg records in the exact shapes of
the kernel sources each parser names (old and new kernels); each record's seq keys its expected
parse in EXPECTED below. The real test writes the same lines to /dev/kmsg (root only) and reads
them back through KmsgReader.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from recorder.errors import NotPrivileged
from recorder.layers import kmsg
from recorder.layers.kmsg import (
    TABLE_COLUMNS,
    AerBit,
    AerBusError,
    AerMessage,
    AerStatusMask,
    AmdViEvent,
    BlockIOError,
    BufferIOError,
    DmarFault,
    DmarFaultStatus,
    DmarIntrRemapFault,
    KernelEvent,
    KernelLogEntry,
    KmsgReader,
    NvmeAbortStatus,
    NvmeControllerDown,
    NvmeNotReady,
    NvmePowerSavingHint,
    NvmeResetFailure,
    NvmeResetting,
    NvmeTimeout,
    OomConstraint,
    OomInvoked,
    OomKilled,
    OomReaped,
    OomVictimSelected,
    SwiotlbFull,
    UnknownSubsystemLine,
    XidError,
    classify,
    parse_record,
    rows_for,
    split_dump,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "kmsg"
MIGRATION = ROOT / "store" / "migrations" / "0002_kernel_log.sql"
INDEXES = ROOT / "store" / "indexes" / "0002_kernel_log.sql"


def load_fixtures() -> list[tuple[str, bytes]]:
    """(file stem, raw record) for every record of every fixture file."""
    out: list[tuple[str, bytes]] = []
    for path in sorted(FIXTURES.glob("*.txt")):
        out.extend((path.stem, raw) for raw in split_dump(path.read_bytes()))
    return out


def unknown(subsystem: str, text: str) -> UnknownSubsystemLine:
    return UnknownSubsystemLine(subsystem=subsystem, text=text)


X = "PTE Write access is not set"
# seq -> what classify() must return for that record's text.
EXPECTED: dict[int, Any] = {
    # NVMe, old format
    1001: NvmeTimeout(controller="nvme0", tag=4096, qid=7, action="aborting"),
    1002: NvmeTimeout(controller="nvme0", tag=4096, qid=7, action="reset controller"),
    1003: NvmeTimeout(controller="nvme0", tag=4096, qid=7, action="disable controller"),
    # NVMe, new format
    1004: NvmeTimeout(controller="nvme0", tag=489, command_id=0xD1E9, opcode=1,
                      opcode_name="I/O Cmd", qid=3, action="aborting", req_op="WRITE",
                      req_op_code=1, size_bytes=524288),
    1005: NvmeTimeout(controller="nvme1", tag=192, command_id=0x80C0, opcode=1,
                      opcode_name="I/O Cmd", qid=1, action="reset controller"),
    1006: NvmeTimeout(controller="nvme1", tag=28, command_id=0x301C, qid=0,
                      action="disable controller"),
    1007: NvmeAbortStatus(controller="nvme0", status=0),
    1008: NvmeAbortStatus(controller="nvme0", status=0x371),
    1009: NvmeResetting(controller="nvme0"),
    1010: NvmeControllerDown(controller="nvme0", csts=0xFFFFFFFF, pci_status=0xFFFF),
    1011: NvmeControllerDown(controller="nvme0", csts=0xFFFFFFFF, errno=-19),
    1012: NvmePowerSavingHint(
        controller="nvme0", action="Does your device have a faulty power saving mode enabled?"),
    1013: NvmePowerSavingHint(
        controller="nvme0",
        action='Try "nvme_core.default_ps_max_latency_us=0 pcie_aspm=off" and report a bug'),
    1014: NvmeNotReady(controller="nvme0", action="aborting reset", csts=1),
    1015: NvmeResetFailure(controller="nvme0", errno=-19),
    1016: unknown("nvme", "nvme nvme0: 8/0/0 default/read/poll queues"),
    # Block layer
    2001: BlockIOError(function="blk_update_request", error="I/O", dev="nvme0n1",
                       sector=18874368, op_code=0, op="READ", flags=0, phys_seg=1, prio_class=0),
    2002: BlockIOError(error="I/O", dev="nvme1n1", sector=6011360, op_code=1, op="WRITE",
                       flags=0x8800, phys_seg=1, prio_class=2),
    2003: BlockIOError(error="critical medium", dev="sdb", sector=123456, op_code=0, op="READ",
                       flags=0x80700, phys_seg=8, prio_class=0),
    2004: BlockIOError(error="timeout", dev="sdc", sector=77, op_code=1, op="WRITE", flags=0,
                       phys_seg=2, prio_class=0),
    2005: BlockIOError(function="blk_update_request", error="I/O", dev="sda", sector=2048),
    2006: BufferIOError(dev="sda1", logical_block=0, context="async page read"),
    2007: BufferIOError(dev="nvme0n1p2", logical_block=1234567, context="lost async page write"),
    2008: BufferIOError(dev="sdb1", logical_block=42),
    2009: unknown("block", "EXT4-fs warning (device nvme0n1p2): ext4_end_bio:343: I/O error 10 "
                           "writing to inode 12 starting block 1234)"),
    # SWIOTLB
    3001: SwiotlbFull(driver="nvme", device="0000:01:00.0", size_bytes=65536, total_slots=32768,
                      used_slots=32736),
    3002: SwiotlbFull(driver="mlx5_core", device="0000:3b:00.1", size_bytes=4096,
                      total_slots=524288, used_slots=524287),
    3003: SwiotlbFull(size_bytes=262144),
    3004: unknown("swiotlb", "PCI-DMA: Using software bounce buffering for IO (SWIOTLB)"),
    # Intel VT-d
    4001: DmarFaultStatus(status_reg=2),
    4002: DmarFault(access="read", device="00:1e.3", address=0xFFFFA000, fault_reason=6,
                    reason_text="PTE Read access is not set"),
    4003: DmarFault(access="write", device="5e:00.0", address=0x7F000, fault_reason=5,
                    reason_text=X),
    4004: DmarFault(access="read", pasid=1, device="3b:00.0", address=0x7FFFE000,
                    fault_reason=0x11,
                    reason_text="SM: Present bit in PASID directory entry is clear"),
    4005: DmarIntrRemapFault(device="f0:1f.0", fault_index=0x21, fault_reason=0x25,
                             reason_text="Blocked a compatibility format interrupt request"),
    4006: DmarFault(access="write", device="5e:00.0", address=0x7F000, fault_reason=5,
                    reason_text=X),
    4007: DmarFault(access="read", device="00:02.0", address=0x7FFF000, fault_reason=6,
                    reason_text="PTE Read access is not set"),
    4008: DmarIntrRemapFault(device="00:1f.0", fault_index=0x8000, fault_reason=0x22,
                             reason_text="Present field in the IRTE entry is clear"),
    4009: unknown("intel_iommu", "DMAR: IOMMU enabled"),
    # AMD-Vi
    5001: AmdViEvent(event_type="IO_PAGE_FAULT", driver="xhci_hcd", device="0000:15:00.0",
                     domain=0, address=0xFFF50000, flags=0x20),
    5002: AmdViEvent(event_type="IO_PAGE_FAULT", device="04:00.0", domain=0,
                     address=0x10B4A01E0, flags=0x70),
    5003: AmdViEvent(event_type="IO_PAGE_FAULT", device="0000:04:00.0", domain=0,
                     address=0x10B4A01E0, flags=0x70),
    5004: unknown("amd_iommu", "AMD-Vi: Interrupt remapping enabled"),
    # PCIe AER
    6001: AerMessage(driver="pcieport", device="0000:00:1c.4", multiple=False,
                     severity="Correctable", source="0000:07:00.0"),
    6002: AerBusError(driver="pcieport", device="0000:07:00.0", bus="PCIe",
                      severity="Correctable", error_type="Data Link Layer", agent="Receiver ID"),
    6003: AerStatusMask(driver="pcieport", device="0000:07:00.0", vendor_id=0x8086,
                        device_id=0x15EA, status=0x80, mask=0x2000),
    6004: AerBit(driver="pcieport", device="0000:07:00.0", bit=7, bit_name="BadDLLP",
                 first_error=False),
    6005: AerBit(driver="pcieport", device="0000:07:00.0", bit=0, bit_name="RxErr",
                 first_error=True),
    6006: AerMessage(driver="pcieport", device="0000:00:1c.4", multiple=True,
                     severity="Correctable", source="0000:07:00.0"),
    6007: AerMessage(driver="pcieport", device="0000:00:1c.0", multiple=False,
                     severity="Corrected", source_id=0xE0),
    6008: AerBusError(driver="pcieport", device="0000:00:1c.0", bus="PCIe", severity="Corrected",
                      error_type="Physical Layer", source_id=0xE0, agent="Receiver ID"),
    6009: AerMessage(driver="pcieport", device="0000:00:03.0", multiple=False,
                     severity="Uncorrected (Non-Fatal)", source="0000:03:00.0"),
    6010: AerBusError(driver="nvme", device="0000:03:00.0", bus="PCIe",
                      severity="Uncorrected (Non-Fatal)", error_type="Transaction Layer",
                      agent="Requester ID"),
    6011: AerStatusMask(driver="nvme", device="0000:03:00.0", vendor_id=0x144D, device_id=0xA808,
                        status=0x4000, mask=0x400000),
    6012: AerBit(driver="nvme", device="0000:03:00.0", bit=14, bit_name="CmpltTO",
                 first_error=True),
    6013: AerMessage(driver="pcieport", device="0000:00:01.0", multiple=False,
                     severity="Uncorrected (Fatal)", source="0000:01:00.0"),
    6014: AerBusError(driver="pcieport", device="0000:0c:00.0", bus="CXL",
                      severity="Uncorrected (Fatal)", error_type="Transaction Layer",
                      agent="Receiver ID"),
    6015: unknown("aer", "pcieport 0000:00:1c.4: AER: TLP Header: 04000001 0000000f 00000000 "
                         "00000000"),
    # NVIDIA Xid
    7001: XidError(device="0000:10:1c", xid=63, pid=1896,
                   message="Row Remapper: New row marked for remapping, reset gpu to activate.",
                   meaning="ECC page retirement or row remapping recording event",
                   category="memory"),
    7002: XidError(device="0000:01:00", xid=79, message="GPU has fallen off the bus.",
                   meaning="GPU has fallen off the bus", category="bus"),
    7003: XidError(device="0000:01:00", xid=32, message="Channel ID 00000009 intr 00800000",
                   meaning="Invalid or corrupted push buffer stream", category="driver"),
    7004: XidError(device="0000:01:00", xid=3, message="Ch 00000001, engmask 00000101"),
    7005: XidError(device="0000:3b:00", gpu_instance=1, compute_instance=0, xid=43, pid=23456,
                   process_name="python3", message="Ch 00000008",
                   meaning="GPU stopped processing", category="application"),
    7006: XidError(device="0000:86:00", xid=48, pid=4242, process_name="train.py",
                   message="An uncorrectable double bit error (DBE) has been detected on GPU in "
                           "the framebuffer at partition 6, subpartition 0.",
                   meaning="Double-bit ECC error", category="memory"),
    7007: XidError(device="0000:86:00", xid=94, pid=4242, process_name="python",
                   message="Contained: SM (0x1). RST: No, D-RST: No",
                   meaning="Contained ECC error", category="memory"),
    7008: XidError(device="0000:86:00", xid=95, message="Uncontained: FBHUB. RST: Yes, D-RST: No",
                   meaning="Uncontained ECC error", category="memory"),
    7009: XidError(device="0000:86:00", xid=13, pid=777, process_name="python",
                   message="Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range "
                           "Address",
                   meaning="Graphics engine exception", category="application"),
    7010: XidError(device="0000:86:00", xid=31, pid=777, process_name="python",
                   message="Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS "
                           "GPCCLIENT_T1_0 faulted @ 0x7f1e_00000000. Fault is of type "
                           "FAULT_PDE ACCESS_TYPE_VIRT_READ",
                   meaning="GPU memory page fault", category="application"),
    7011: XidError(device="0000:86:00", xid=64, pid=1, message="ECC page retirement failure",
                   meaning="ECC page retirement or row remapper recording failure",
                   category="memory"),
    7012: unknown("nvidia", "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  "
                            "Tue Mar  5 22:23:56 UTC 2024"),
    # OOM
    8001: OomInvoked(comm="python", gfp_mask=0xCC0, gfp_flags="GFP_KERNEL", alloc_order=0,
                     oom_score_adj=0),
    8002: OomConstraint(constraint_kind="CONSTRAINT_MEMCG", nodemask="(null)", cpuset="/",
                        mems_allowed="0", oom_memcg="/job42", task_memcg="/job42", comm="python",
                        pid=19289, uid=0),
    8003: OomKilled(scope="memcg", pid=19289, comm="python", total_vm_bytes=2676 * 1024,
                    anon_rss_bytes=84 * 1024, file_rss_bytes=1468 * 1024,
                    shmem_rss_bytes=4 * 1024, uid=0, pgtables_bytes=40 * 1024, oom_score_adj=0),
    8004: OomKilled(scope="system", pid=19290, comm="pt_data_worker",
                    total_vm_bytes=10485760 * 1024, anon_rss_bytes=8388608 * 1024,
                    file_rss_bytes=2048 * 1024, shmem_rss_bytes=0, uid=1000,
                    pgtables_bytes=16400 * 1024, oom_score_adj=200),
    8005: OomKilled(scope="system", pid=2592, comm="mysqld", total_vm_bytes=1543564 * 1024,
                    anon_rss_bytes=1209120 * 1024, file_rss_bytes=0, shmem_rss_bytes=0),
    8006: OomKilled(pid=2592, comm="mysqld", total_vm_bytes=1543564 * 1024,
                    anon_rss_bytes=1209120 * 1024, file_rss_bytes=0),
    8007: OomReaped(pid=19289, comm="python", anon_rss_bytes=0, file_rss_bytes=0,
                    shmem_rss_bytes=4 * 1024),
    8008: OomInvoked(comm="dockerd", gfp_mask=0x14200CA, gfp_flags="GFP_HIGHUSER_MOVABLE",
                     nodemask="(null)", alloc_order=0, oom_score_adj=-500),
    8009: OomInvoked(comm="java", gfp_mask=0x24201CA, alloc_order=0, oom_score_adj=0),
    8010: OomConstraint(constraint_kind="CONSTRAINT_NONE", nodemask="(null)", cpuset="/",
                        mems_allowed="0-1", global_oom=True, task_memcg="/user.slice",
                        comm="python", pid=4242, uid=1000),
    8011: OomVictimSelected(scope="system", pid=2592, comm="mysqld", score=923),
    8012: unknown("oom", " oom_kill_process.cold+0x10/0x15"),
    # Other subsystems: not ours
    9001: None,
    9002: None,
    9003: None,
    9004: None,  # "no room left" must not count as an oom line
    9005: None,
    # malformed.txt (only those with a readable seq)
    9102: None,
    9104: NvmeTimeout(controller="nvme0", tag=1, qid=1, action="aborting"),
    9105: NvmeAbortStatus(controller="nvme0", status=0),
}

FIXTURE_RECORDS = load_fixtures()
PARSEABLE = [(stem, raw) for stem, raw in FIXTURE_RECORDS if stem != "malformed"]


def _id(param: tuple[str, bytes]) -> str:
    return f"{param[0]}-{param[1].split(b',', 2)[1].decode()}"


# ---- every known variant, parsed into exactly the right typed fields ----------------


@pytest.mark.parametrize("fixture", PARSEABLE, ids=_id)
def test_fixture_record_parses_to_expected_event(fixture: tuple[str, bytes]) -> None:
    record = parse_record(fixture[1])
    assert not record.malformed, record.error
    assert record.seq in EXPECTED, "fixture record without an expectation"
    assert classify(record.text) == EXPECTED[record.seq]


def test_every_expectation_has_a_fixture_and_every_kind_is_covered() -> None:
    seqs = {parse_record(raw).seq for _, raw in FIXTURE_RECORDS}
    assert set(EXPECTED) <= seqs
    kinds = {type(e) for e in EXPECTED.values() if e is not None}
    every_model = {c for c in vars(kmsg).values()
                   if isinstance(c, type) and issubclass(c, KernelEvent) and c is not KernelEvent}
    assert every_model <= kinds, f"models without a fixture: {every_model - kinds}"


def test_parse_record_header_continuations_and_escapes() -> None:
    raw = (b"3,3001,50000001,-;nvme 0000:01:00.0: swiotlb buffer is full (sz: 65536 bytes), "
           b"total 32768 (slots), used 32736 (slots)\n SUBSYSTEM=pci\n DEVICE=+pci:0000:01:00.0\n")
    r = parse_record(raw)
    assert (r.facility, r.level, r.seq, r.usec, r.flag) == (0, 3, 3001, 50000001, "-")
    assert r.ts_ns == 50000001 * 1000
    assert r.properties == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:01:00.0"}
    assert r.text.startswith("nvme 0000:01:00.0: swiotlb") and not r.malformed

    r = parse_record(b"6,9004,110000004,-;no room\\x0a with \\x5c backslash \\xc3\\xa9 \\x01\n")
    assert r.text == "no room\n with \\ backslash \u00e9 \x01"

    r = parse_record(b"6,9005,110000005,c,caller=T123;usb 1-1: new device\n")
    assert (r.flag, r.caller, r.text) == ("c", "T123", "usb 1-1: new device")

    # prio of a record written by user space to /dev/kmsg: facility user (1)
    r = parse_record(b"11,346,189493244,-;hello\n")
    assert (r.facility, r.level) == (1, 3)

    # invalid UTF-8 is kept, visibly
    assert parse_record(b"6,1,1,-;bad \\xff byte\n").text == "bad \\xff byte"


@pytest.mark.parametrize("raw, error", [
    (b"this record has no header at all\n", "no ';'"),
    (b"6,9102,abc,-;usec is not a number\n", "not a decimal"),
    (b"6,9103;too few header fields\n", "fewer than 4"),
    (b"4,9105,1,-;nvme nvme0: Abort status: 0x0\n BROKEN_CONTINUATION\n", "continuation"),
    (b"", "no ';'"),
    (b"-1,2,3,-;negative prio\n", "not a decimal"),
    (b"6,1,2,--;flag too long\n", "flag"),
    (b"6,1,99999999999999999999,-;uptime of three million years\n", "usec beyond"),
    (b"6,99999999999999999999,2,-;seq too large\n", "seq beyond"),
    (b"99999,1,2,-;prio too large\n", "prio beyond"),
])
def test_malformed_records_never_raise_and_keep_raw(raw: bytes, error: str) -> None:
    r = parse_record(raw)
    assert r.malformed and r.raw == raw and error in (r.error or "")


def test_malformed_fixture_file() -> None:
    records = [parse_record(raw) for stem, raw in FIXTURE_RECORDS if stem == "malformed"]
    assert [r.malformed for r in records] == [True, True, True, False, True, True]


# ---- the schema and rows_for ----------------------------------------------------------------


def fresh_db(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path)
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("CREATE TABLE session(id INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO session(id) VALUES (1)")
    db.executescript(MIGRATION.read_text())
    return db


def insert_entry(db: sqlite3.Connection, entry: KernelLogEntry, session_id: int = 1) -> int:
    """What the store's writer does with rows_for: kernel_log first, then the typed row."""
    log_id = 0
    for table, row in rows_for(entry, session_id):
        if table != "kernel_log":
            row["kernel_log_id"] = log_id
        cols = ", ".join(row)
        marks = ", ".join("?" * len(row))
        cur = db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", list(row.values()))
        if table == "kernel_log":
            log_id = cur.lastrowid or 0
    return log_id


def entry_for(raw: bytes) -> KernelLogEntry:
    record = parse_record(raw)
    return KernelLogEntry(record=record, event=classify(record.text), read_ts_ns=123)


TYPED_TABLES = ("nvme_event", "block_error", "swiotlb_event", "iommu_fault", "aer_event",
                "gpu_xid", "oom_kill")


def test_migration_applies_with_sqlite3_shell_conventions(tmp_path: Path) -> None:
    db = fresh_db(tmp_path / "t.db")
    db.executescript(INDEXES.read_text())
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"kernel_log", *TYPED_TABLES} <= tables
    sql = MIGRATION.read_text()
    for table in ("kernel_log", *TYPED_TABLES):
        assert f"-- table: {table}\n" in sql
        cols = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
        assert cols[0] == "id" and "session_id" in cols
        if table != "kernel_log":
            assert "kernel_log_id" in cols and "ts" in cols
    # every column line carries a same-line comment
    body = re.findall(r"CREATE TABLE \w+ \((.*?)\n\);", sql, re.S)
    for block in body:
        for line in block.strip().splitlines():
            assert "--" in line, f"undocumented column: {line.strip()}"
    # and every secondary index lives in the indexes file
    assert "CREATE INDEX" not in sql


def test_table_columns_match_schema(tmp_path: Path) -> None:
    db = fresh_db(tmp_path / "t.db")
    for table, cols in TABLE_COLUMNS.items():
        schema = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
        if table != "kernel_log":
            schema.remove("id")
        assert set(cols) == set(schema), f"{table}: model/schema drift"


def test_batched_writer_with_assigned_ids(tmp_path: Path) -> None:
    """The store's own migration runner and batched Writer (positional rows, no lastrowid)."""
    store_db = pytest.importorskip("store.db")
    store = store_db.open_store(tmp_path / "rec.db", create=True)
    conn = store.conn
    cols = {r[1]: r for r in conn.execute("PRAGMA table_info(session)")}
    conn.execute(f"INSERT INTO session (id, {', '.join(c for c in cols if c != 'id')}) VALUES "
                 f"(7, {', '.join('0' for c in cols if c != 'id')})")
    writer = store_db.Writer(store)
    for table, columns in TABLE_COLUMNS.items():
        writer.table(table, columns)
    for n, (_, raw) in enumerate(FIXTURE_RECORDS, start=1):
        for table, row in rows_for(entry_for(raw), 7, kernel_log_id=n):
            writer.add(table, tuple(row.get(c) for c in TABLE_COLUMNS[table]))
    writer.flush()
    store.build_indexes()
    assert conn.execute("SELECT count(*) FROM kernel_log").fetchone() == (len(FIXTURE_RECORDS),)
    # every typed row points at the kernel_log row of its own text
    for table in TYPED_TABLES:
        orphans = conn.execute(
            f"SELECT count(*) FROM {table} t LEFT JOIN kernel_log k ON k.id = t.kernel_log_id "
            f"WHERE k.event_kind IS NOT '{table}.' || t.kind").fetchone()[0]
        assert orphans == 0, table
    store.close()


def test_rows_for_inserts_every_fixture(tmp_path: Path) -> None:
    db = fresh_db(tmp_path / "t.db")
    per_table: Counter[str] = Counter()
    for _, raw in FIXTURE_RECORDS:
        entry = entry_for(raw)
        insert_entry(db, entry)
        if isinstance(entry.event, KernelEvent):
            per_table[entry.event.table] += 1
    db.commit()
    assert db.execute("SELECT count(*) FROM kernel_log").fetchone()[0] == len(FIXTURE_RECORDS)
    for table in TYPED_TABLES:
        assert db.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == per_table[table] > 0
    # unknown subsystem lines are kept, with their subsystem
    unknown_rows = db.execute(
        "SELECT subsystem FROM kernel_log WHERE event_kind = 'unknown' ORDER BY seq").fetchall()
    assert [r[0] for r in unknown_rows] == [
        "nvme", "block", "swiotlb", "intel_iommu", "amd_iommu", "aer", "nvidia", "oom"]
    # malformed records keep their bytes; ts falls back to the read time when the header has none
    rows = db.execute("SELECT raw, ts, printk_ts FROM kernel_log WHERE malformed = 1").fetchall()
    assert len(rows) == 5 and all(raw for raw, _, _ in rows)
    assert {(ts, printk_ts) for _, ts, printk_ts in rows} == {(123, None),
                                                              (120000005000, 120000005000)}
    # typed columns, spot checks across tables
    assert db.execute(
        "SELECT n.controller, n.tag, n.command_id, n.qid, n.req_op, n.size_bytes, k.seq, k.ts, "
        "k.device, k.event_kind FROM nvme_event n JOIN kernel_log k ON k.id = n.kernel_log_id "
        "WHERE n.tag = 489").fetchone() == (
        "nvme0", 489, 0xD1E9, 3, "WRITE", 524288, 1004, 30000004000, "nvme0", "nvme_event.timeout")
    assert db.execute(
        "SELECT vendor, kind, device, address, flags FROM iommu_fault "
        "WHERE kind = 'io_page_fault' ORDER BY id LIMIT 1").fetchone() == (
        "amd", "io_page_fault", "0000:15:00.0", 0xFFF50000, 0x20)
    assert db.execute(
        "SELECT scope, pid, anon_rss_bytes, pgtables_bytes FROM oom_kill WHERE kind = 'killed' "
        "ORDER BY id LIMIT 1").fetchone() == ("memcg", 19289, 84 * 1024, 40 * 1024)
    assert db.execute("SELECT properties FROM kernel_log WHERE seq = 3001").fetchone() == (
        "SUBSYSTEM=pci\nDEVICE=+pci:0000:01:00.0",)
    assert db.execute("SELECT count(*) FROM aer_event WHERE first_error = 1").fetchone() == (2,)
    # a re-read record is refused by UNIQUE (session_id, seq)
    with pytest.raises(sqlite3.IntegrityError):
        insert_entry(db, entry_for(FIXTURE_RECORDS[0][1]))


def test_rows_for_large_numbers_fit_sqlite(tmp_path: Path) -> None:
    db = fresh_db(tmp_path / "t.db")
    insert_entry(db, entry_for(
        b"3,1,1,-;AMD-Vi: Event logged [IO_PAGE_FAULT device=04:00.0 domain=0x0000 "
        b"address=0xfffffffffffff000 flags=0x0070]\n"))
    insert_entry(db, entry_for(
        b"3,2,1,-;I/O error, dev sda, sector 99999999999999999999\n"))
    # two's complement above 2^63; a number beyond 64 bits is no kernel line: kept as unknown
    assert db.execute("SELECT address FROM iommu_fault").fetchone() == (-0x1000,)
    assert db.execute("SELECT count(*) FROM block_error").fetchone() == (0,)
    assert db.execute("SELECT event_kind FROM kernel_log WHERE seq = 2").fetchone() == (
        "unknown",)


# ---- the reader ----------------------------------------------------------------------------


def test_reader_counts_epipe_and_sequence_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    script: list[bytes | BaseException] = [
        b"6,10,1000,-;first, before start\n",
        b"4,11,5000,-;nvme nvme0: I/O 4096 QID 7 timeout, aborting\n",
        OSError(errno.EPIPE, "Broken pipe"),
        b"4,15,6000,-;nvme nvme0: resetting controller\n",
        b"4,16,6001,-;nvme nvme0: something new\n",
        b"garbage\n",
        BlockingIOError(),
    ]

    def fake_read(fd: int, n: int) -> bytes:
        item = script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    reader = KmsgReader(start_ns=2_000_000)
    monkeypatch.setattr(reader, "fileno", lambda: 99)
    monkeypatch.setattr(os, "read", fake_read)
    entries = reader.read_available()
    assert [type(e.event).__name__ for e in entries] == [
        "NvmeTimeout", "NvmeResetting", "UnknownSubsystemLine", "NoneType"]
    s = reader.stats
    assert (s.records_read, s.skipped_before_start, s.lost, s.overruns) == (5, 1, 3, 1)
    assert (s.unknown, s.malformed) == (1, 1)
    assert s.parsed == {"nvme_event.timeout": 1, "nvme_event.resetting": 1}
    assert entries[0].ts_ns == 5_000_000
    assert entries[-1].ts_ns == entries[-1].read_ts_ns  # malformed: read time stands in


def test_reader_needs_open() -> None:
    with pytest.raises(RuntimeError, match="open"):
        KmsgReader().read_available()


def test_reader_without_privilege_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(NotPrivileged, match="run as root"):
        KmsgReader(start_ns=0).open()


def _kmsg_writable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to write /dev/kmsg"
    try:
        os.close(os.open("/dev/kmsg", os.O_WRONLY))
    except OSError as e:
        return f"cannot open /dev/kmsg for writing ({e}); printk_devkmsg may be off"
    return None


def _write_kmsg(line: bytes) -> None:
    # A fresh open per write: with printk_devkmsg=ratelimit the kernel silently drops writes past
    # 10 per 5 s per open file. The trailing newline matters: without it the record stays open
    # for continuation and readers do not see it until the next record arrives.
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, line + b"\n")
    finally:
        os.close(fd)


def test_real_kmsg_roundtrip(tmp_path: Path) -> None:
    """Write every fixture line to the real /dev/kmsg and read it back through KmsgReader."""
    reason = _kmsg_writable()
    if reason:
        pytest.skip(reason)
    marker = uuid.uuid4().hex
    begin = f"stall-recorder kmsg test begin {marker}"
    end = f"stall-recorder kmsg test end {marker}"
    written: list[tuple[int, str]] = []  # (level, text), in write order
    expected: list[Any] = []
    for _, raw in PARSEABLE:
        record = parse_record(raw)
        written.append((record.level or 0, record.text))
        expected.append(EXPECTED[record.seq or 0])
    # one line with a control byte, to see the kernel's \xNN escaping undone end to end
    written.append((4, "nvme nvme7: Abort status: 0x2 \x01"))
    expected.append(unknown("nvme", "nvme nvme7: Abort status: 0x2 \x01"))

    t_before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    with KmsgReader(start_ns=t_before) as reader:
        offset = reader.calibrate()
        _write_kmsg(f"<6>{begin}".encode())
        for level, text in written:
            _write_kmsg(f"<{level}>{text}".encode())
        _write_kmsg(f"<6>{end}".encode())
        t_after = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        entries: list[KernelLogEntry] = []
        deadline = time.monotonic() + 10
        while not any(e.record.text == end for e in entries) and time.monotonic() < deadline:
            entries.extend(reader.poll(0.5))
    stats = reader.stats

    texts = [e.record.text for e in entries]
    assert begin in texts and end in texts, "markers not read back"
    ours = entries[texts.index(begin) + 1: texts.index(end)]
    wanted = {text for _, text in written}
    ours = [e for e in ours if e.record.text in wanted]  # drop unrelated kernel messages
    assert [e.record.text for e in ours] == [text for _, text in written]
    assert stats.skipped_before_start > 0  # boot records exist and precede the start
    assert stats.lost == 0 and stats.malformed == 0

    seqs = [e.record.seq for e in ours]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stamps = [e.ts_ns for e in ours]
    assert stamps == sorted(stamps), "timestamps not monotonic"
    # printk's clock is not exactly CLOCK_MONOTONIC: the reader measured the offset, within
    # offset.uncertainty_ns (which also covers the stamps' truncation to whole microseconds)
    assert abs(offset.offset_ns) < 50_000_000 and offset.uncertainty_ns < 5_000_000, offset
    slack = offset.uncertainty_ns
    assert all(t_before - slack <= ts <= t_after + slack for ts in stamps), (
        t_before, stamps, t_after, offset)
    assert all(e.ts_ns == (e.record.ts_ns or 0) - offset.offset_ns for e in ours)
    for entry, (level, _), want in zip(ours, written, expected, strict=True):
        # user-space writes are stored with facility user (1) and the level we asked for
        assert (entry.record.facility, entry.record.level) == (1, level)
        assert entry.event == want, entry.record.text

    # and they land in the schema as the right typed rows
    db = fresh_db(tmp_path / "real.db")
    for entry in ours:
        insert_entry(db, entry)
    counts = dict(db.execute(
        "SELECT event_kind, count(*) FROM kernel_log WHERE event_kind IS NOT NULL "
        "GROUP BY event_kind").fetchall())
    want_counts = Counter("unknown" if isinstance(w, UnknownSubsystemLine) else
                          f"{w.table}.{w.kind}" for w in expected if w is not None)
    assert counts == dict(want_counts)
    assert db.execute("SELECT min(ts) >= ?, max(ts) <= ? FROM nvme_event",
                      (t_before - slack, t_after + slack)).fetchone() == (1, 1)
