"""The files beside a recording (its log, status file and reserved room) and the summary a stop prints:
what `recorder stop` and `status` need of a session without loading the recorder itself (its probes,
layers and BCC), so that a stop is not kept waiting for imports it does not use."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from recorder.errors import UserError
from store.db import Store
from store.flight import file_bytes


def status_path(db: Path) -> Path:
    return db.with_name(db.name + ".status.json")


def log_path(db: Path) -> Path:
    return db.with_name(db.name + ".log")


RESERVE_BYTES = 2 << 20


def reserve_path(db: Path) -> Path:
    """Room held on the recording's file system while it records, given back when the disk fills
    up: marking the session stopped (and the log's last lines) then still find space."""
    return db.with_name(db.name + ".reserve")


def make_reserve(db: Path) -> None:
    try:
        with open(reserve_path(db), "wb") as f:  # written, not sparse: the blocks are taken now
            f.write(bytes(RESERVE_BYTES))
    except OSError:  # already short of room: recording goes on without it
        reserve_path(db).unlink(missing_ok=True)


def give_back_reserve(db: Path) -> None:
    try:
        reserve_path(db).unlink(missing_ok=True)
    except OSError:
        pass


def already_recording(db: Path, holder: int | str) -> UserError:
    return UserError(f"a recorder (pid {holder}) is already recording into {db}: "
                     f"stop it with 'recorder stop --db {db}' or pass another --db")


def session_summary(store: Store, session_id: int) -> dict:
    s = store.row("SELECT * FROM session WHERE id = ?", (session_id,))
    counts = {
        table: store.row(f"SELECT count(*) AS n FROM {table} WHERE session_id = ?", (session_id,))["n"]
        for table in ("offcpu_interval", "cuda_call", "thread", "process", "library")
    }
    try:  # counted, not rows (a recording of an earlier version has no such table)
        counts["kernel_launches_counted"] = store.row(
            "SELECT coalesce(sum(launches), 0) AS n FROM cuda_launch_count WHERE session_id = ?", (session_id,))["n"]
    except sqlite3.OperationalError:
        counts["kernel_launches_counted"] = 0
    lost = store.row("SELECT coalesce(sum(dropped), 0) AS n FROM loss WHERE session_id = ?",
                     (session_id,))["n"]
    dur = ((s["stopped_ts"] or s["started_ts"]) - s["started_ts"]) / 1e9
    return {"session_id": session_id, "status": s["status"], "stop_reason": s["stop_reason"],
            "duration_s": round(dur, 3),
            "rows": counts, "dropped": lost, "db": str(store.path),
            "db_bytes": file_bytes(store.path)}
