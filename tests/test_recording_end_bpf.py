"""How a recording ends when nobody stops it, on real probes and real file systems: a disk that
fills up (a small tmpfs) stops the writing, not the traced command, and the recording says why and
when; a recorder killed with SIGKILL is found dead by the next stop or status, which finalizes its
session with the last second written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder

from recorder.daemon import stop_background
from recorder.errors import UserError
from store.db import lock_holder

pytestmark = [needs_bpf, pytest.mark.bpf, pytest.mark.slow]

S = 1_000_000_000
PIPE_PAIRS = str(ROOT / "tests" / "workloads" / "pipe_pairs.py")  # tens of thousands of switches a second


@pytest.fixture()
def small_fs(tmp_path):
    """A 24 MiB tmpfs (2 MiB of it the recorder's reserve): filled in seconds by the load above."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_record_on_a_full_disk_stops_recording_and_waits_for_the_command(small_fs, tmp_path):
    db = small_fs / "full.db"
    done, end = tmp_path / "done", tmp_path / "end"
    rec = subprocess.Popen([*RECORDER, "record", "--db", str(db), "--", sys.executable, PIPE_PAIRS, "30", "40",
                            str(done), str(end)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the command runs until the recorder has stopped recording (its lock given back), then a
        # second more: up to 40 s where the disk does not fill, and then the recording ends whole
        deadline = time.monotonic() + 120
        while not lock_holder(db) and rec.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        while lock_holder(db) and time.monotonic() < deadline:
            time.sleep(0.2)
        end.touch()
        stdout, stderr = rec.communicate(timeout=400)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    res = subprocess.CompletedProcess(rec.args, rec.returncode, stdout, stderr)
    # the command ran to its end, untouched, and its exit status is record's
    assert done.read_text() == "done"
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert "stopped recording into" in res.stdout and "disk full" in res.stdout, res.stdout
    assert "runs on unrecorded; waiting for it to exit" in res.stderr
    assert "recording stopped early: disk full" in res.stdout
    (status, stopped, reason, started), = q(db, "SELECT status, stopped_ts, stop_reason, started_ts FROM session")
    assert status == "incomplete" and stopped > started and reason.startswith("disk full (database or disk is full)")
    assert q(db, "SELECT count(*) FROM offcpu_interval")[0][0] > 1000
    # readable where it lies, and the report says from when nothing was recorded
    report = run_recorder("explain", "--db", str(db))
    assert report.returncode == 0, report.stderr
    assert "Recording: stopped recording at " in report.stdout and ": disk full (" in report.stdout
    status_now = run_recorder("status", "--db", str(db))
    assert status_now.returncode != 0 and "Traceback" not in status_now.stderr
    assert "session 1 stopped recording at " in status_now.stderr and "disk full" in status_now.stderr


def test_a_flight_recorder_on_a_full_disk_stops_and_says_so(small_fs, tmp_path):
    db = small_fs / "flight.db"
    work = subprocess.Popen([sys.executable, PIPE_PAIRS, "30", "300"])
    try:
        res = run_recorder("start", "--db", str(db), "-p", str(work.pid), "--keep", "2m", "--before", "4s",
                           "--after", "2s", "--triggers", "", "--json")
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 120
        while lock_holder(db) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not lock_holder(db), "the recorder did not stop on a full disk"
        assert work.poll() is None  # the traced process runs on
        status = run_recorder("status", "--db", str(db))
        assert status.returncode != 0 and "Traceback" not in status.stderr
        assert "stopped recording at" in status.stderr and "disk full" in status.stderr, status.stderr
        stop = run_recorder("stop", "--db", str(db))
        assert "disk full" in stop.stderr and "Traceback" not in stop.stderr
        report = run_recorder("explain", "--db", str(db))
        assert report.returncode == 0, report.stderr
        assert "Recording: stopped recording at " in report.stdout
        dump = run_recorder("dump", "--db", str(db), "-o", str(tmp_path / "after.db"), "--json")
        assert dump.returncode == 0, dump.stderr
        assert json.loads(dump.stdout)["end_ts"] == q(db, "SELECT stopped_ts FROM session")[0][0]
    finally:
        work.kill()
        work.wait()
    log = Path(f"{db}.log").read_text()
    assert "stopped recording into" in log and "disk full" in log, log


def test_a_recorder_killed_is_found_dead_and_its_session_finalized(tmp_path):
    db = tmp_path / "killed.db"
    work = subprocess.Popen([sys.executable, PIPE_PAIRS, "2", "300"])
    try:
        res = run_recorder("start", "--db", str(db), "-p", str(work.pid), "--json")
        assert res.returncode == 0, res.stderr
        pid = json.loads(res.stdout)["recorder_pid"]
        # killed once it has committed a second (on a loaded machine the first can take a while)
        deadline = time.monotonic() + 60
        while q(db, "SELECT written_ts FROM session")[0][0] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        killed_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        os.kill(pid, signal.SIGKILL)
        # the kernel detaches its probes in its exit, one by one: seconds, more on a loaded machine
        deadline = time.monotonic() + 60
        while lock_holder(db) and time.monotonic() < deadline:
            time.sleep(0.1)
        report = run_recorder("explain", "--db", str(db))  # a reader before anyone finalizes it
        assert report.returncode == 0, report.stderr
        assert f"Recording: ended without a stop (the recorder, pid {pid}, died): nothing was recorded after " \
            in report.stdout
        status = run_recorder("status", "--db", str(db))
        assert status.returncode != 0 and "Traceback" not in status.stderr
        assert f"the recorder (pid {pid}) died without a stop" in status.stderr, status.stderr
        (state, started, stopped, written), = q(db, "SELECT status, started_ts, stopped_ts, written_ts FROM session")
        assert state == "incomplete" and written is not None
        # it ends at the last second committed, or at the last event if that is later
        last_event = q(db, "SELECT max(ts + dur) FROM offcpu_interval")[0][0]
        assert started < written <= stopped <= killed_at and stopped == max(written, last_event)
        stop = run_recorder("stop", "--db", str(db))
        assert stop.returncode != 0 and "died without a stop" in stop.stderr
        report = run_recorder("explain", "--db", str(db))
        assert "Recording: stopped recording at " in report.stdout and "died without a stop" in report.stdout
        assert "(incomplete)" in report.stdout
    finally:
        work.kill()
        work.wait()



def _start_and_kill(db: Path, target: int) -> tuple[int, int]:
    """A recorder started on `target`, killed with SIGKILL once it committed a second: (its pid, when)."""
    res = run_recorder("start", "--db", str(db), "-p", str(target), "--json")
    assert res.returncode == 0, res.stderr
    pid = json.loads(res.stdout)["recorder_pid"]
    sid = json.loads(res.stdout)["session_id"]
    deadline = time.monotonic() + 60
    while q(db, "SELECT written_ts FROM session WHERE id = ?", (sid,))[0][0] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    killed_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    os.kill(pid, signal.SIGKILL)
    return pid, killed_at


def test_a_stop_that_meets_the_recorder_dying_finalizes_its_session(tmp_path):
    """A recorder killed with SIGKILL keeps its lock while the kernel detaches its probes (seconds,
    in the D state): a stop made then waits for the lock, and must not call the session stopped.
    And the next recorder on the file finalizes a session a dead one left: its lock must not make
    that session read as live."""
    db = tmp_path / "dying.db"
    work = subprocess.Popen([sys.executable, PIPE_PAIRS, "2", "300"])
    try:
        first, _ = _start_and_kill(db, work.pid)
        deadline = time.monotonic() + 60
        while lock_holder(db) and time.monotonic() < deadline:
            time.sleep(0.1)
        pid, killed_at = _start_and_kill(db, work.pid)  # the second start finalized the first session
        # `recorder stop`'s own function, called at once: a new process would take a second to start
        met_dying = lock_holder(db) == pid
        with pytest.raises(UserError) as stopped:
            stop_background(db)
        rows = q(db, "SELECT id, status, started_ts, stopped_ts, stop_reason FROM session ORDER BY id")
        assert [r[:2] + r[4:] for r in rows] == [
            (1, "incomplete", f"the recorder (pid {first}) died without a stop"),
            (2, "incomplete", f"the recorder (pid {pid}) died without a stop")], rows
        assert rows[0][3] <= rows[1][2] and rows[1][2] < rows[1][3] <= killed_at
        if not met_dying:
            pytest.skip("the kernel released the killed recorder's lock at once: the stop did not meet it dying")
        assert f"the recorder (pid {pid}) on {db} ended without finishing its session" in str(stopped.value)
        assert f"the recorder (pid {pid}) died without a stop" in str(stopped.value)
        stop = run_recorder("stop", "--db", str(db))  # and a stop after that says the same
        assert stop.returncode != 0 and "died without a stop" in stop.stderr and "Traceback" not in stop.stderr
    finally:
        work.kill()
        work.wait()
