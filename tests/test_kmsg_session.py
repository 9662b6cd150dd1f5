"""The kernel log in a real recording: records written to /dev/kmsg while `recorder record` runs
(every format tests/test_kmsg.py knows, old and new) come back as typed rows with
timestamps inside the session and in the order they were written."""

from __future__ import annotations

import sqlite3
import sys

import pytest
from conftest import needs_bpf, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf]

# (line, typed table, kind, column checks)
LINES = [
    ("nvme nvme0: I/O 4096 QID 7 timeout, aborting", "nvme_event", "timeout", {"tag": 4096, "qid": 7}),
    ("nvme nvme0: I/O tag 489 (d1e9) opcode 0x1 (I/O Cmd) QID 3 timeout, aborting req_op:WRITE(1) size:524288",
     "nvme_event", "timeout", {"tag": 489, "qid": 3, "command_id": 0xD1E9, "size_bytes": 524288}),
    ("nvme nvme1: I/O tag 28 (301c) QID 0 timeout, disable controller", "nvme_event", "timeout", {"qid": 0}),
    ("nvme nvme0: Abort status: 0x371", "nvme_event", "abort_status", {"status": 0x371}),
    ("nvme nvme0: resetting controller", "nvme_event", "resetting", {}),
    ("nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0xffff", "nvme_event",
     "controller_down", {"csts": 0xFFFFFFFF}),
    ("blk_update_request: I/O error, dev nvme0n1, sector 18874368 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0",
     "block_error", "io_error", {"dev": "nvme0n1", "sector": 18874368}),
    ("I/O error, dev nvme1n1, sector 6011360 op 0x1:(WRITE) flags 0x8800 phys_seg 1 prio class 2",
     "block_error", "io_error", {"sector": 6011360, "op": "WRITE"}),
    ("Buffer I/O error on dev sda1, logical block 0, async page read", "block_error", "buffer_io_error",
     {"dev": "sda1"}),
    ("nvme 0000:01:00.0: swiotlb buffer is full (sz: 65536 bytes), total 32768 (slots), used 32736 (slots)",
     "swiotlb_event", "buffer_full", {"size_bytes": 65536}),
    ("DMAR: [DMA Read NO_PASID] Request device [00:1e.3] fault addr 0xffffa000 [fault reason 0x06] "
     "PTE Read access is not set", "iommu_fault", "dma_fault", {"fault_reason": 6}),
    ("AMD-Vi: Event logged [IO_PAGE_FAULT device=0000:04:00.0 domain=0x0000 address=0x10b4a01e0 flags=0x0070]",
     "iommu_fault", "io_page_fault", {"flags": 0x70}),
    ("pcieport 0000:07:00.0: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Receiver ID)",
     "aer_event", "bus_error", {"severity": "Correctable"}),
    ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
     "gpu_xid", "xid", {"xid": 63, "pid": 1896}),
    ("NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     "gpu_xid", "xid", {"xid": 79}),
    ("Memory cgroup out of memory: Killed process 19289 (python) total-vm:2676kB, anon-rss:84kB, "
     "file-rss:1468kB, shmem-rss:4kB, UID:0 pgtables:40kB oom_score_adj:0", "oom_kill", "killed", {"pid": 19289}),
]

WRITER = """
import os, sys, time
time.sleep(0.5)
for line in sys.argv[1:]:
    fd = os.open("/dev/kmsg", os.O_WRONLY)  # one open per record: printk_devkmsg rate-limits per open
    os.write(fd, ("<3>" + line + "\\n").encode())
    os.close(fd)
    time.sleep(0.01)
time.sleep(0.3)
"""


def test_kmsg_records_become_typed_rows_in_the_session(tmp_path):
    db = tmp_path / "k.db"
    res = run_recorder("record", "--db", str(db), "--", sys.executable, "-c", WRITER,
                       *[line for line, *_ in LINES], timeout=300)
    assert res.returncode == 0, res.stderr
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    session = conn.execute("SELECT started_ts, stopped_ts FROM session").fetchone()
    cap = conn.execute("SELECT status FROM capability WHERE layer = 'kmsg'").fetchone()
    assert cap["status"] == "attached"
    last_ts = 0
    for line, table, kind, checks in LINES:
        log = conn.execute("SELECT * FROM kernel_log WHERE text = ? ORDER BY seq", (line,)).fetchall()
        assert len(log) == 1, line
        log = log[0]
        assert session["started_ts"] <= log["ts"] <= session["stopped_ts"], line
        assert log["ts"] >= last_ts - 2_000_000  # written in order; printk stamps may differ per CPU
        last_ts = log["ts"]
        typed = conn.execute(f"SELECT * FROM {table} WHERE kernel_log_id = ?", (log["id"],)).fetchone()
        assert typed is not None, (line, log["event_kind"])
        assert typed["kind"] == kind and typed["ts"] == log["ts"]
        for column, value in checks.items():
            assert typed[column] == value, (line, column, typed[column])
    conn.close()
