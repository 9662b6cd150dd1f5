"""A recording made as root is read by another user in place, live or after its recorder died: the
lock file (root's, 0644, held by the recorder) is opened for reading only. Real files, a real
flock held by this process as the recorder holds it, and `nobody` running the readers."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest
from conftest import ROOT
from mcp import Client, StdioServerParameters

from recorder.demo import write_scenario
from store.db import lock_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                                reason="needs root to make a recording as root and read it as nobody (runuser)")


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-m", "recorder", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.fixture()
def live(request):
    """A recording whose session is still 'recording', its log holding pages, its lock held."""
    folder = Path(tempfile.mkdtemp(prefix="stall-other-user-"))
    folder.chmod(0o755)
    db = folder / "live.db"
    write_scenario("cpu-contention", db)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("UPDATE session SET status = 'recording', stopped_ts = NULL")
    conn.commit()  # in the log, not yet in the file: a reader must read the log too
    lock = lock_path(db).open("a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(str(os.getpid()))
    lock.flush()
    for p in folder.iterdir():
        p.chmod(0o644)
    yield db, lock
    lock.close()
    conn.close()
    shutil.rmtree(folder)


def test_explain_and_status_read_a_live_recording_as_another_user(live):
    db, _ = live
    report = as_nobody("explain", "--db", str(db), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["session"]["state"] == "recording"
    status = as_nobody("status", "--db", str(db), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["recorder_pid"] == os.getpid()


def test_a_killed_recording_reads_as_ended_for_another_user(live):
    db, lock = live
    fcntl.flock(lock, fcntl.LOCK_UN)  # the recorder died: its lock went with it
    report = as_nobody("explain", "--db", str(db))
    assert report.returncode == 0, report.stderr
    assert "(incomplete)" in report.stdout and "Recording: ended without a stop" in report.stdout
    status = as_nobody("status", "--db", str(db))
    assert status.returncode != 0 and "Traceback" not in status.stderr
    assert "no recorder is running" in status.stderr and "ended without a stop" in status.stderr


def test_the_mcp_server_serves_a_live_recording_to_another_user(live):
    db, _ = live
    params = StdioServerParameters(command="runuser", args=["-u", "nobody", "--", sys.executable, "-m", "recorder",
                                                            "mcp", "--db", str(db)], cwd=str(ROOT))

    async def go() -> list:
        async with Client(params) as c:
            return [await c.call_tool(name, args) for name, args in
                    (("list_sessions", {}), ("explain_stall", {"worst": True}), ("capabilities", {}))]

    for r in anyio.run(go):
        assert not r.is_error, r.content
