"""NVMe signals in the views the report reads: each kind says what it is (an abort's status, a
reset), never "queue ?, request tag ?" for a line that names neither. The demo's NVMe-timeout
recording (a real SQLite file) is read through the views."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from recorder.demo import write_scenario
from store.db import open_store


def test_nvme_signals_say_what_they_are(tmp_path: Path) -> None:
    path = tmp_path / "nvme.db"
    write_scenario("nvme-timeout-checkpoint", path)
    open_store(path).close()  # views of this tool
    conn = sqlite3.connect(path)
    for view in ("step_machine_event", "block_request_device_event"):
        details = dict(conn.execute(f"SELECT DISTINCT kind || ':' || detail, 1 FROM {view}"
                                    " WHERE kind LIKE 'nvme%'").fetchall())
        assert set(details) >= {"nvme_abort_status:abort status 0x371", "nvme_resetting:controller reset",
                                "nvme_timeout:timeout on queue 7, request tag 4096, aborting"}, (view, details)
        assert not any("?" in d for d in details), (view, details)
    conn.close()
