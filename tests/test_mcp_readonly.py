"""Reading a recording as users do: made by root, read by an unprivileged user (nobody) from a folder
it cannot write, through `recorder mcp` over stdio and the read-only CLI commands. Covers a complete
recording, one whose write-ahead log still holds pages (a recorder that died), one still being
written, and paths SQLite's URI syntax would misread ('#', '?', '%')."""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters
from test_mcp_recording import make_recording

from store.db import lock_path, open_store

ROOT = Path(__file__).resolve().parent.parent
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to read a root-made recording as user nobody")


@pytest.fixture
def root_dir():
    """A root-owned 0755 folder nobody can read but not write (pytest's own tmp folders are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="stall-recorder-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def as_nobody_mcp(db: Path, sql: str) -> tuple[list, dict]:
    """list_sessions and one run_sql through `recorder mcp` run as nobody, over real stdio."""
    params = StdioServerParameters(command=NOBODY[0], args=[*NOBODY[1:], sys.executable, "-m", "recorder", "mcp",
                                                            "--db", str(db)], cwd=str(ROOT))

    async def go():
        async with Client(params) as c:
            sessions = await c.call_tool("list_sessions", {})
            rows = await c.call_tool("run_sql", {"sql": sql})
            assert not sessions.is_error, sessions.content
            assert not rows.is_error, rows.content
            return sessions.structured_content["sessions"], rows.structured_content
    return anyio.run(go)


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, sys.executable, "-m", "recorder", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def to_wal(db: Path) -> None:
    c = sqlite3.connect(db)
    c.execute("PRAGMA journal_mode = WAL")
    c.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)


@needs_root
@pytest.mark.parametrize("name", ["plain.db", "hash#1.db", "what?mode=rw.db", "pct%41.db"])
def test_nobody_reads_a_complete_root_recording_and_leaves_no_files(root_dir, name):
    db = make_recording(root_dir / name)
    to_wal(db)
    before = sorted(os.listdir(root_dir))
    sessions, rows = as_nobody_mcp(db, "SELECT count(*) FROM cuda_call")
    assert [s["session_id"] for s in sessions] == [1]
    assert rows["rows"] == [[10]]
    r = as_nobody("explain", "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    for cmd in ("steps", "top"):
        r = as_nobody(cmd, "--db", str(db))
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(root_dir)) == before  # no -wal, -shm, stray 'hash' or lock file


@needs_root
def test_nobody_reads_the_pages_still_in_the_log_of_a_recording_whose_writer_died(root_dir):
    db = make_recording(root_dir / "died.db")
    to_wal(db)
    # A writer that committed and exited without a checkpoint: the rows live only in the -wal.
    code = ("import os, sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA wal_autocheckpoint = 0');"
            "c.execute(\"UPDATE session SET target = 'from the log'\"); c.commit(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(db)], check=True)
    assert Path(f"{db}-wal").stat().st_size > 0
    Path(f"{db}-shm").unlink()  # nobody cannot create it in this folder
    before = sorted(os.listdir(root_dir))
    sessions, _ = as_nobody_mcp(db, "SELECT 1")
    assert sessions[0]["target"] == {"untrusted_text": "from the log"}
    assert sorted(os.listdir(root_dir)) == before


@needs_root
def test_nobody_reads_a_recording_a_writer_left_its_shm_next_to(root_dir):
    """A writer that checkpointed and exited without closing leaves an empty -wal and its -shm: such a
    file is read through them (a writer without the lock may still be there), creating nothing."""
    db = make_recording(root_dir / "left.db")
    to_wal(db)
    code = ("import os, sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute(\"UPDATE session SET target = 'x'\");"
            "c.commit(); c.execute('PRAGMA wal_checkpoint(TRUNCATE)'); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(db)], check=True)
    assert Path(f"{db}-shm").exists() and Path(f"{db}-wal").stat().st_size == 0
    before = sorted(os.listdir(root_dir))
    sessions, rows = as_nobody_mcp(db, "SELECT count(*) FROM cuda_call")
    assert sessions[0]["target"] == {"untrusted_text": "x"} and rows["rows"] == [[10]]
    assert sorted(os.listdir(root_dir)) == before


@needs_root
def test_nobody_reads_a_recording_while_it_is_being_written(root_dir):
    db = make_recording(root_dir / "live.db")
    lock = lock_path(db).open("a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the recorder does while it records
    try:
        writer = open_store(db)  # WAL mode, -wal and -shm made by root
        writer.conn.execute("PRAGMA wal_autocheckpoint = 0")
        writer.conn.execute("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, cgroup_id) "
                            "SELECT session_id, ts + 1, dur, thread_id, api_id, ret, cgroup_id FROM cuda_call"
                            " WHERE id = 1")
        writer.conn.commit()
        _, rows = as_nobody_mcp(db, "SELECT count(*) FROM cuda_call")
        assert rows["rows"] == [[11]]
        writer.close()
    finally:
        lock.close()


@pytest.mark.parametrize("name", ["hash#1.db", "what?mode=rwc.db", "pct%2541.db"])
def test_paths_sqlite_would_read_as_uri_syntax_open_the_file_named(tmp_path, name):
    """As any user: the server and the read-only commands read the file named, create no stray file
    (before, 'hash#1.db' opened or created 'hash') and leave no -wal/-shm behind."""
    db = make_recording(tmp_path / name)
    to_wal(db)
    before = sorted(os.listdir(tmp_path))
    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", str(db)],
                                   cwd=str(ROOT))

    async def go():
        async with Client(params) as c:
            return (await c.call_tool("run_sql", {"sql": "SELECT count(*) FROM cuda_call"})).structured_content
    assert anyio.run(go)["rows"] == [[10]]
    r = subprocess.run([sys.executable, "-m", "recorder", "explain", "--db", str(db), "--json"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == before
