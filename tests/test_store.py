"""The store: migrations, refusing databases that are not ours, views usable from plain sqlite3."""

import sqlite3
import subprocess

import pytest

from store import SCHEMA_VERSION, StoreError, open_store
from store.db import APPLICATION_ID
from store.report.build import explain, render_text


def test_new_database_is_migrated_and_marked(tmp_path):
    db = tmp_path / "r.db"
    with open_store(db, create=True) as s:
        assert s.one("PRAGMA user_version")["user_version"] == SCHEMA_VERSION
        assert s.one("PRAGMA application_id")["application_id"] == APPLICATION_ID
        views = {r["name"] for r in s.query("SELECT name FROM sqlite_master WHERE type='view'")}
    assert {"offcpu", "cuda_call_detail", "slow_cuda_call", "cuda_call_contender"} <= views


def test_foreign_database_is_refused(tmp_path):
    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE customers (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="not written by stall-recorder"):
        open_store(db)
    with pytest.raises(StoreError, match="not written by stall-recorder"):
        open_store(db, create=True)
    # and nothing of it was touched
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 0


def test_non_sqlite_file_is_refused(tmp_path):
    db = tmp_path / "notes.db"
    db.write_text("hello, not a database\n")
    with pytest.raises(StoreError, match="not a SQLite database"):
        open_store(db)


def test_corrupt_database_is_refused(tmp_path):
    db = tmp_path / "r.db"
    open_store(db, create=True).close()
    data = bytearray(db.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)  # the schema page
    db.write_bytes(bytes(data))
    with pytest.raises(StoreError):
        with open_store(db, readonly=True) as s:
            s.query("SELECT * FROM session")


def test_newer_schema_is_refused(tmp_path):
    db = tmp_path / "r.db"
    open_store(db, create=True).close()
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this recorder"):
        open_store(db)


def test_missing_database_and_folder(tmp_path):
    with pytest.raises(StoreError, match="no recording at"):
        open_store(tmp_path / "none.db")
    with pytest.raises(StoreError, match="does not exist"):
        open_store(tmp_path / "nope" / "r.db", create=True)


def _session(s, **kw):
    row = {"started_ts": 1_000_000_000, "stopped_ts": 11_000_000_000, "wall_offset_ns": 1_700_000_000 * 10**9,
           "status": "complete", "recorder_pid": 1, "hostname": "h", "kernel_release": "k",
           "boot_id": "b", "cpu_count": 2, "target": "pids 10", "command": "test", "tool_version": "t"}
    row.update(kw)
    return s.db["session"].insert(row).last_pk


def test_views_explain_a_contended_call_from_rows(tmp_path):
    """Rows written by hand (known truth): one cudaMalloc of 10 calls is 20x slower because its
    thread waited behind 'hog'; the views and the report must say exactly that."""
    db = tmp_path / "r.db"
    with open_store(db, create=True) as s:
        sid = _session(s)
        s.db["process"].insert_all([
            {"id": 1, "session_id": sid, "pid": 10, "name": "train", "first_ts": 0},
            {"id": 2, "session_id": sid, "pid": 20, "name": "hog", "first_ts": 0}])
        s.db["thread"].insert_all([
            {"id": 1, "session_id": sid, "tid": 10, "process_id": 1, "name": "train", "first_ts": 0,
             "traced": 1},
            {"id": 2, "session_id": sid, "tid": 20, "process_id": 2, "name": "hog", "first_ts": 0,
             "traced": 0}])
        s.db["capability"].insert_all([
            {"session_id": sid, "layer": "sched", "probe": "sched:sched_switch", "status": "attached", "ts": 0},
            {"session_id": sid, "layer": "cuda", "probe": "cudaMalloc", "status": "attached", "ts": 0}])
        s.db["cuda_api"].insert({"id": 0, "name": "cudaMalloc", "family": "cudaMalloc",
                                 "library": "runtime", "arguments": "malloc"})
        calls = []
        for i in range(10):
            ts = 2_000_000_000 + i * 100_000_000
            dur = 600_000 if i != 7 else 12_000_000
            calls.append({"session_id": sid, "ts": ts, "dur": dur, "thread_id": 1, "api_id": 0, "ret": 0,
                          "size_bytes": 1 << 20, "size_class": 21, "cgroup_id": 0})
        s.db["cuda_call"].insert_all(calls)
        slow_ts = 2_700_000_000
        # two preemptions by the hog inside the slow call: 5 ms and 6 ms
        s.db["offcpu_interval"].insert_all([
            {"session_id": sid, "ts": slow_ts + 100_000, "dur": 5_000_000, "thread_id": 1, "cpu": 1,
             "state": 256, "next_thread_id": 2, "in_cpu": 1, "contender_thread_id": 2,
             "contender_run_dur": 5_000_000, "cgroup_id": 0},
            {"session_id": sid, "ts": slow_ts + 5_500_000, "dur": 6_000_000, "thread_id": 1, "cpu": 1,
             "state": 256, "next_thread_id": 2, "in_cpu": 1, "contender_thread_id": 2,
             "contender_run_dur": 6_000_000, "cgroup_id": 0}])
        s.conn.commit()
    with open_store(db, readonly=True) as s:
        report = explain(s)
    assert report["stall"] is True
    cause = report["primary_cause"]
    assert cause["kind"] == "cpu_contention"
    assert (cause["contender_name"], cause["contender_pid"]) == ("hog", 20)
    finding = report["findings"][0]
    assert finding["dur_ns"] == 12_000_000 and finding["expected_dur_ns"] == 600_000
    assert finding["cpu_wait_dur_ns"] == 11_000_000 and finding["preemptions"] == 2
    text = render_text(report)
    assert ("cudaMalloc 12.0 ms (expected ~0.60 ms): off-CPU 92% of the call, "
            "2 preemptions by hog (pid 20) on cpu 1") in text
    assert "Not observed: NCCL collectives" in text


def test_views_work_in_the_plain_sqlite3_shell(tmp_path):
    db = tmp_path / "r.db"
    with open_store(db, create=True) as s:
        _session(s)
    out = subprocess.run(["sqlite3", str(db), "SELECT count(*) FROM slow_cuda_call; SELECT count(*) FROM offcpu;"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "0"]


def test_empty_session_reports_no_stall(tmp_path):
    db = tmp_path / "r.db"
    with open_store(db, create=True) as s:
        _session(s)
    with open_store(db, readonly=True) as s:
        report = explain(s)
    assert report["stall"] is False and report["primary_cause"] is None
    assert "Primary cause: none" in render_text(report)


@pytest.mark.parametrize("background", [False, True])
def test_the_writer_refuses_a_bad_row_alone_and_writes_on(tmp_path, capsys, background):
    """A row SQLite cannot take (an integer past int64, a text that cannot be encoded) costs only
    itself: the rows around it, in the same batch and in later ones, are written, the refused row
    is counted and said once, and the writer goes on (it used to raise at the next flush)."""
    from store.db import Writer

    store = open_store(tmp_path / "w.db", create=True)
    store.conn.execute("CREATE TABLE t (a INTEGER, b TEXT)")
    store.conn.commit()
    writer = Writer(store, background=background)
    writer.table("t", ("a", "b"))
    writer.extend("t", [(i, "before") for i in range(120)] + [(10**20, "too large"), (1, "\ud800")]
                  + [(i, "after") for i in range(3)])
    writer.flush()
    writer.sync()
    writer.add("t", (7, "next batch"))
    writer.close()
    rows = store.conn.execute("SELECT b, count(*) FROM t GROUP BY b ORDER BY b").fetchall()
    assert rows == [("after", 3), ("before", 120), ("next batch", 1)]
    assert writer.rows_refused == 2 and writer.rows_written == 124
    assert writer.refused == {"t": "OverflowError: Python int too large to convert to SQLite INTEGER"}
    assert capsys.readouterr().out.count("row was not written") == 1
