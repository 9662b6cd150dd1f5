"""A recording made as root is read by another user in place, live or after its recorder died: the
lock file (root's, held by the recorder) is opened for reading only. A real recorder (`recorder
start`, as root with root's default umask) writes the recording, its log and its lock file with the
modes it gives them, and holds the lock; `nobody` runs the readers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest
from conftest import ROOT, needs_bpf, run_recorder
from mcp import Client, StdioServerParameters

from store.db import lock_path

pytestmark = [needs_bpf, pytest.mark.bpf,
              pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser to read as nobody")]


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-m", "recorder", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def holders(path: Path) -> set[int]:
    """The processes with `path` open, found in /proc (not through the recorder's own lock file)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                out.add(int(pid))
        except OSError:
            continue
    return out


def start_recording(folder: Path, name: str) -> tuple[Path, subprocess.Popen, int]:
    """(db, target, recorder pid) of a recording of a sleeping process, started as root starts it:
    from a shell whose umask is the default one, into a folder others may enter (/var/lib's mode)."""
    db = folder / name
    target = subprocess.Popen(["sleep", "600"])
    res = run_recorder("start", "--db", str(db), "-p", str(target.pid), preexec_fn=lambda: os.umask(0o022))
    if res.returncode != 0:
        target.kill()
        raise AssertionError(res.stderr)
    [pid] = holders(lock_path(db))
    return db, target, pid


@pytest.fixture(scope="module")
def folder():
    path = Path(tempfile.mkdtemp(prefix="stall-other-user-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def live(folder):
    """(db, recorder pid) of a recording whose recorder is running."""
    db, target, pid = start_recording(folder, "live.db")
    try:
        yield db, pid
    finally:
        run_recorder("stop", "--db", str(db))
        target.kill()
        target.wait()


def test_explain_and_status_read_a_live_recording_as_another_user(live):
    db, pid = live
    # what the recorder made: the recording, its log and its lock, none of them writable by others
    modes = {p.name: p.stat().st_mode & 0o777 for p in db.parent.iterdir() if p.name.startswith(db.name)}
    assert {f"{db.name}", f"{db.name}.lock"} <= set(modes) and all(m & 0o002 == 0 for m in modes.values()), modes
    report = as_nobody("explain", "--db", str(db), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["session"]["state"] == "recording"
    status = as_nobody("status", "--db", str(db), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["recorder_pid"] == pid


def test_a_killed_recording_reads_as_ended_for_another_user(folder):
    db, target, pid = start_recording(folder, "killed.db")
    try:
        # the recorder died: its lock goes with it once the kernel let the process go (it closes the
        # probes' files first, which takes seconds)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}"), "the killed recorder is still there after 60 s"
        report = as_nobody("explain", "--db", str(db))
        assert report.returncode == 0, report.stderr
        assert "(incomplete)" in report.stdout and "Recording: ended without a stop" in report.stdout
        status = as_nobody("status", "--db", str(db))
        assert status.returncode != 0 and "Traceback" not in status.stderr
        assert "no recorder is running" in status.stderr and "ended without a stop" in status.stderr
    finally:
        target.kill()
        target.wait()


def test_the_mcp_server_serves_a_live_recording_to_another_user(live):
    db, _pid = live
    params = StdioServerParameters(command="runuser", args=["-u", "nobody", "--", sys.executable, "-m", "recorder",
                                                            "mcp", "--db", str(db)], cwd=str(ROOT))

    async def go() -> list:
        async with Client(params) as c:
            return [await c.call_tool(name, args) for name, args in
                    (("list_sessions", {}), ("explain_stall", {"worst": True}), ("capabilities", {}))]

    for r in anyio.run(go):
        assert not r.is_error, r.content
