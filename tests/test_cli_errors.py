"""Bad input: one-line errors that say what to do, a non-zero exit, and no recorded data lost."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, damage_pages, needs_bpf, profile_default_env, run_recorder

from store import open_store


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("recorder: ")
    for w in words:
        assert w in lines[0], (w, lines[0])


def as_nobody(args: list[str]) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "--inh-caps=-all", *RECORDER, *args],
                          capture_output=True, text=True, cwd="/tmp",
                          env={**profile_default_env(), "PYTHONPATH": str(ROOT), "HOME": "/tmp"})


def test_not_root_start_is_refused():
    one_line_error(as_nobody(["start", "-p", "1", "--db", "/tmp/x.db"]), "root", "CAP_BPF")


def test_not_root_doctor_says_what_is_missing():
    result = as_nobody(["doctor"])
    assert result.returncode == 1
    assert "FAIL privileges" in result.stdout and "FAIL bpf syscall" in result.stdout
    assert "warn on-CPU profile: needs privileges -> run as root or grant CAP_PERFMON" in result.stdout
    assert result.stdout.strip().endswith("recording cannot work until the FAIL lines are fixed")


@needs_bpf
def test_doctor_as_root_can_record():
    result = run_recorder("doctor", "--json", env=profile_default_env())
    import json

    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["can_record"] is True
    names = {c["name"] for c in report["checks"]}
    assert "tracepoint sched:sched_switch" in names and "uprobes" in names
    # the on-CPU profile is on by default, at 99 samples a second, where perf events can be opened
    profile = next(c for c in report["checks"] if c["name"] == "on-CPU profile")
    assert profile["ok"] and "99 samples a second on each CPU" in profile["detail"], profile


@needs_bpf
def test_pid_that_does_not_exist(tmp_path):
    one_line_error(run_recorder("start", "-p", "999999999", "--db", str(tmp_path / "r.db")),
                   "no process with pid 999999999")


@needs_bpf
def test_a_kernel_thread_a_thread_and_a_gone_process_are_refused(tmp_path):
    db = str(tmp_path / "r.db")
    kthreadd = 2  # the kernel's thread creator: a kernel thread on every Linux
    one_line_error(run_recorder("start", "-p", str(kthreadd), "--db", db), "pid 2 is a kernel thread")
    one_line_error(run_recorder("start", "--tree", str(kthreadd), "--db", db), "pid 2 is a kernel thread")
    script = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); print(1, flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        tid = max(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
        one_line_error(run_recorder("start", "-p", str(tid), "--db", db), f"thread of process {proc.pid}",
                       f"-p {proc.pid}")
    finally:
        proc.kill()
        proc.wait()
    # gone before the attach: an exited process, among live ones
    one_line_error(run_recorder("start", "-p", "1", str(proc.pid), "--db", db), f"no process with pid {proc.pid}")
    assert not (tmp_path / "r.db").exists()


@needs_bpf
def test_a_cgroup_that_is_not_a_cgroup_v2_folder_is_refused(tmp_path):
    db = str(tmp_path / "r.db")
    one_line_error(run_recorder("start", "-c", str(tmp_path / "nope"), "--db", db), "does not exist")
    v1 = Path("/sys/fs/cgroup/memory")
    if not (v1 / "cgroup.procs").exists() or (v1 / "cgroup.controllers").exists():
        pytest.skip("needs a cgroup v1 hierarchy at /sys/fs/cgroup/memory")
    one_line_error(run_recorder("start", "-c", str(v1), "--db", db), "not a cgroup v2 folder")


def test_pid_lists_are_read_in_every_spelling():
    from recorder.cli import build_parser

    args = build_parser().parse_args(["start", "-p", "1,2", "3", "-p", "4", "--tree", "5", "6,7"])
    assert args.pid == [[1, 2], [3], [4]] and args.tree == [[5], [6, 7]]
    result = run_recorder("start", "-p", "12x")
    assert result.returncode == 2 and "'12x' is not a process id" in result.stderr


@needs_bpf
def test_unwritable_db_path():
    one_line_error(run_recorder("start", "-p", "1", "--db", "/proc/stall.db"), "--db")


def test_foreign_database_is_refused_and_untouched(tmp_path):
    db = tmp_path / "shop.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE orders (id INTEGER)")
    conn.execute("INSERT INTO orders VALUES (1)")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    one_line_error(run_recorder("explain", "--db", str(db)), "not written by stall-recorder")
    assert db.read_bytes() == before


def test_explain_without_a_recording(tmp_path):
    one_line_error(run_recorder("explain", "--db", str(tmp_path / "none.db")), "recorder start")


def test_explain_bad_window_and_session(tmp_path):
    db = tmp_path / "r.db"
    with open_store(db, create=True) as s:
        s.db["session"].insert({"started_ts": 1, "stopped_ts": 10**10, "wall_offset_ns": 0,
                                "status": "complete", "recorder_pid": 1, "hostname": "h",
                                "kernel_release": "k", "boot_id": "b", "cpu_count": 1,
                                "target": "t", "command": "c", "tool_version": "v"})
        s.conn.commit()
    one_line_error(run_recorder("explain", "--db", str(db), "--window", "5..2"), "ends before")
    one_line_error(run_recorder("explain", "--db", str(db), "--window", "soon..later"), "--window")
    one_line_error(run_recorder("explain", "--db", str(db), "--since", "5 minutes"), "5m")
    one_line_error(run_recorder("explain", "--db", str(db), "--session", "7"), "no session 7")


def test_record_without_a_command(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the privilege check comes first")
    one_line_error(run_recorder("record", "--db", str(tmp_path / "r.db")), "nothing to run")


@needs_bpf
def test_target_without_cuda_library_warns_and_still_records(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    db = tmp_path / "r.db"
    try:
        start = run_recorder("start", "-p", str(sleeper.pid), "--db", str(db))
        assert start.returncode == 0, start.stderr
        assert "no CUDA library is mapped by the target yet" in start.stderr
        assert len(start.stderr.strip().splitlines()) == 1
        stop = run_recorder("stop", "--db", str(db))
        assert stop.returncode == 0 and "complete" in stop.stdout
    finally:
        sleeper.kill()
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "Not observed: CUDA runtime/driver calls" in report


# -- explain, steps, top and demo on synthetic recordings (no root needed) --------------------------
@pytest.fixture(scope="module")
def demo_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("demo") / "demo.db"
    result = run_recorder("demo", "--no-gpu", "cpu-contention", "--db", str(db), check=True)
    assert "Primary cause: CPU contention" in result.stdout
    return db


def test_explain_a_step_that_does_not_exist(demo_db):
    one_line_error(run_recorder("explain", "--db", str(demo_db), "--step", "7"),
                   "no step 7 in session 1", "80000..80059", "recorder steps")


def test_explain_a_step_that_is_not_a_stall(demo_db):
    result = run_recorder("explain", "--db", str(demo_db), "--step", "80010", check=True)
    assert "step 80010 took" in result.stdout and "not a stall" in result.stdout
    assert "Primary cause: none: no stall" in result.stdout


def test_steps_and_top_list_the_stall(demo_db):
    import json

    steps = json.loads(run_recorder("steps", "--db", str(demo_db), "--json", check=True).stdout)
    assert steps["count"] == 60 and steps["stalls"] == 1
    slow = [s for s in steps["steps"] if s["slow"]]
    assert slow[0]["step"] == 80042 and slow[0]["cause"].startswith("CPU contention")
    text = run_recorder("steps", "--db", str(demo_db), "--slow", check=True).stdout
    assert "80042" in text and "80041" not in text
    top = json.loads(run_recorder("top", "--db", str(demo_db), "--json", check=True).stdout)
    assert top["worst_stalls"][0]["step"] == 80042 and top["worst_stalls"][0]["cause"] == "cpu_contention"
    assert top["worst_lines"][0]["python"] == "Block.forward() at model.py:57"
    assert top["worst_devices"][0]["device"] == "nvme0n1"  # the disk it read from, clean


def test_demo_bad_input():
    one_line_error(run_recorder("demo", "--no-gpu", "no-such-scenario"), "no scenario 'no-such-scenario'",
                   "nvme-timeout-checkpoint")
    one_line_error(run_recorder("demo", "healthy"), "--no-gpu")
    one_line_error(run_recorder("demo", "--no-gpu"), "--list")
    listing = run_recorder("demo", "--no-gpu", "--list", check=True).stdout.splitlines()
    assert len(listing) == 9 and listing[-1].startswith("healthy")


def test_explain_an_empty_database(tmp_path):
    db = tmp_path / "empty.db"
    open_store(db, create=True).close()
    one_line_error(run_recorder("explain", "--db", str(db)), "holds no session yet")
    one_line_error(run_recorder("steps", "--db", str(db)), "holds no session yet")


def test_explain_an_incomplete_session(tmp_path):
    """A recorder that died leaves status 'recording' and no stop time: the report says so and
    still explains the steps it has (the last one ends at its last mark)."""
    import json

    db = tmp_path / "dead.db"
    run_recorder("demo", "--no-gpu", "oom-reclaim", "--db", str(db), check=True)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE session SET status = 'recording', stopped_ts = NULL")
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    assert report["session"]["state"] == "incomplete"
    assert report["primary_cause"]["kind"] == "memory_reclaim" and report["step"]["step"] == 80042


@pytest.fixture(params=["device", "fifo", "socket"])
def special_file(request, tmp_path):
    import socket

    if request.param == "device":
        yield "/dev/null", "is a device"
        return
    path = tmp_path / f"{request.param}.db"
    if request.param == "fifo":
        os.mkfifo(path)
        yield str(path), "is a FIFO"
        return
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    yield str(path), "is a socket"
    sock.close()


@pytest.mark.parametrize("command", [["explain"], ["status"], ["dump"], ["mcp"], ["record", "--", "true"]])
def test_a_special_file_as_db_is_refused_and_nothing_is_written_beside_it(special_file, command):
    path, kind = special_file
    folder = os.path.dirname(path)
    before = set(os.listdir(folder))
    if command[0] == "record" and os.geteuid() != 0:
        pytest.skip("record checks its privileges first")
    res = run_recorder(command[0], "--db", path, *command[1:], timeout=60)  # a FIFO used to hang here
    if command[0] == "status":  # no recorder on it: said as such, in one line
        one_line_error(res, "no recorder is running")
    else:
        one_line_error(res, path, kind, "pass a database file path with --db")
    assert set(os.listdir(folder)) == before


@pytest.mark.parametrize("where", [0.6, 0.8, 0.9, 0.97])
def test_damaged_pages_are_a_one_line_error_for_every_reader(tmp_path, where):
    """Three pages of a recording overwritten after it was written, at several places: every reader
    answers or says the file is damaged and how to check it, in one line; the file is untouched."""
    from recorder.demo import write_scenario

    db = tmp_path / "damaged.db"
    write_scenario("nvme-timeout-checkpoint", db)
    damage_pages(db, where)
    data = db.read_bytes()
    for args in (["explain"], ["steps"], ["top"], ["report", "--html", str(tmp_path / "p.html")],
                 ["export", "--perfetto", str(tmp_path / "t.pftrace")]):
        res = run_recorder(args[0], "--db", str(db), *args[1:], timeout=120)
        assert "Traceback" not in res.stderr, (args, res.stderr)
        if res.returncode != 0:
            one_line_error(res, str(db), "cannot be read", "PRAGMA integrity_check")
    assert db.read_bytes() == data
