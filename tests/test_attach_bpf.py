"""Attaching to jobs already running: `start -c CGROUP` and `start --all` configure a training
process that was running before the recorder (its CUDA library, its marker extension, its Python
frames) as `-p` does, and `-c` also one that enters the cgroup afterwards. Real probes, a real cgroup
v2 folder, real processes; skipped with the reason where root, BPF or cgroup v2 is missing."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, profile_default_env, q, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf, pytest.mark.slow]
TRAIN = str(ROOT / "tests" / "workloads" / "train_steps.py")
RECORD_S = 4


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A fresh cgroup v2 folder; its processes go back to the root and it is removed afterwards."""
    root = _cgroup2_root()
    if root is None or not (root / "cgroup.procs").exists():
        pytest.skip("needs a cgroup v2 hierarchy mounted (cgroup2 in /proc/mounts)")
    path = root / f"stall-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:  # exited meanwhile
                pass
        path.rmdir()


def _train(native: dict) -> subprocess.Popen:
    """A stand-in training loop with markers, running (library loaded, steps going) on return."""
    proc = subprocess.Popen([sys.executable, TRAIN, "--libdir", str(native["dir"]), "--markers", "--steps", "100000",
                             "--quiet"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while "libcudart" not in Path(f"/proc/{proc.pid}/maps").read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the workload did not start"
        time.sleep(0.1)
    return proc


def _record(db: Path, *target: str, during=None) -> None:
    # with the on-CPU profile at its default: its samples interrupt the calls' stack walks
    start = run_recorder("start", "--db", str(db), *target, timeout=300, env=profile_default_env())
    assert start.returncode == 0, start.stderr
    if during:
        during()
    time.sleep(RECORD_S)
    run_recorder("stop", "--db", str(db), check=True, timeout=300)


def _recorded_like_pid(db: Path, pid: int, found_by: str) -> None:
    """What `-p PID` records of the training loop: its CUDA calls each with its Python line, its
    steps, the library found, and one capability row saying what was attached to it."""
    # the probes attach one after the other while the job runs: what follows is checked from the
    # moment the last CUDA probe was attached (a loaded machine takes seconds to attach them all)
    # (the stop's row of the calls stored without a native stack is no probe's)
    attached = q(db, "SELECT max(ts) FROM capability WHERE layer = 'cuda' AND status = 'attached'"
                     " AND probe != 'native stacks'")[0][0]
    # kernel launches take their stack only when slow or sampled: every other call has its line
    calls = q(db, "SELECT c.python_status, c.python_file, count(*) FROM cuda_call_python c"
                  " JOIN thread t ON t.id = c.thread_id JOIN process p ON p.id = t.process_id"
                  " JOIN cuda_api a ON a.id = c.api_id WHERE p.pid = ? AND a.name != 'cudaLaunchKernel'"
                  " AND c.ts > ? GROUP BY 1, 2", (pid, attached))
    assert [(status, Path(f).name) for status, f, _ in calls] == [("ok", "train_steps.py")], calls
    steps, first, last = q(db, "SELECT count(*), min(s.ts), max(s.ts) FROM step s JOIN process p"
                               " ON p.id = s.process_id WHERE p.pid = ? AND s.ts > ?", (pid, attached))[0]
    # every step between the first and the last marker made its 6 calls (malloc, 3 launches, sync,
    # free): none was missed
    in_steps = q(db, "SELECT count(*) FROM cuda_call c JOIN thread t ON t.id = c.thread_id JOIN process p"
                     " ON p.id = t.process_id WHERE p.pid = ? AND c.ts >= ? AND c.ts < ?", (pid, first, last))[0][0]
    # (the launches are counted, not rows: exactly 3 a step)
    in_steps += q(db, "SELECT coalesce(sum(k.launches), 0) FROM cuda_launch_count k JOIN thread t"
                      " ON t.id = k.thread_id JOIN process p ON p.id = t.process_id WHERE p.pid = ? AND k.ts >= ?"
                      " AND k.ts < ?", (pid, first, last))[0][0]
    assert steps >= 30 and in_steps == 6 * (steps - 1), (in_steps, steps)
    lines = {line for line, in q(db, "SELECT python_line FROM python_lines")}
    assert any(line.startswith("main() at train_steps.py:") for line in lines), lines
    assert ("runtime", found_by) in q(db, "SELECT kind, found_by FROM library")
    caps = q(db, "SELECT status, detail FROM capability WHERE layer = 'target' AND target = ?", (f"pid {pid}",))
    assert len(caps) == 1 and caps[0][0] == "attached", caps
    assert {"CUDA runtime", "markers", "CPython"} <= set(caps[0][1].split(", ")), caps
    assert q(db, "SELECT status FROM capability WHERE layer = 'python' AND target = ?",
             (f"pid {pid}",)) == [("attached",)]


def test_cgroup_records_a_job_running_before_the_start_and_one_that_enters_later(tmp_path, native, cgroup):
    db = tmp_path / "c.db"
    before, later = _train(native), _train(native)
    sleeper = subprocess.Popen(["sleep", "60"])  # nothing to attach to: no capability row of its own
    try:
        for pid in (before.pid, sleeper.pid):
            (cgroup / "cgroup.procs").write_text(str(pid))
        _record(db, "-c", str(cgroup), during=lambda: (cgroup / "cgroup.procs").write_text(str(later.pid)))
    finally:
        for proc in (before, later, sleeper):
            proc.kill()
    assert q(db, "SELECT count(*) FROM capability WHERE target = ?", (f"pid {sleeper.pid}",)) == [(0,)]
    _recorded_like_pid(db, before.pid, "maps")
    # the library was attached for the first process: the second one's is the same file
    calls = q(db, "SELECT count(*) FROM cuda_call c JOIN thread t ON t.id = c.thread_id"
                  " JOIN process p ON p.id = t.process_id WHERE p.pid = ?", (later.pid,))[0][0]
    assert calls > 100
    assert q(db, "SELECT status FROM capability WHERE layer = 'target' AND target = ?",
             (f"pid {later.pid}",)) == [("attached",)]
    assert q(db, "SELECT status FROM capability WHERE layer = 'python' AND target = ?",
             (f"pid {later.pid}",)) == [("attached",)]


def test_all_records_a_job_running_before_the_start(tmp_path, native):
    db = tmp_path / "a.db"
    job = _train(native)
    try:
        _record(db, "--all")
    finally:
        job.kill()
    _recorded_like_pid(db, job.pid, "maps")
    # the recorder does not record itself
    recorder = q(db, "SELECT recorder_pid FROM session")[0][0]
    assert q(db, "SELECT count(*) FROM capability WHERE target = ?", (f"pid {recorder}",))[0][0] == 0


LAUNCHER = """
import subprocess, sys, time
from pathlib import Path
train, out, go = sys.argv[1:4]
rank = [sys.executable, train, *sys.argv[4:]]
first = subprocess.Popen(rank)
Path(out).write_text(str(first.pid))
while not Path(go).exists():
    time.sleep(0.05)
second = subprocess.Popen(rank)
Path(out).write_text(f"{first.pid} {second.pid}")
first.wait()
"""


def test_tree_records_a_launchers_running_rank_and_one_it_starts_later(tmp_path, native):
    db, out, go = tmp_path / "t.db", tmp_path / "pids", tmp_path / "go"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, TRAIN, str(out), str(go), "--libdir",
                                 str(native["dir"]), "--markers", "--steps", "100000", "--quiet"])
    try:
        deadline = time.monotonic() + 30
        while not out.exists() or "libcudart" not in Path(f"/proc/{out.read_text()}/maps").read_text():
            assert time.monotonic() < deadline, "the first rank did not start"
            time.sleep(0.1)
        first = int(out.read_text())
        _record(db, "--tree", str(launcher.pid), during=go.touch)
        second = int(out.read_text().split()[1])
    finally:
        for pid in out.read_text().split():
            subprocess.run(["kill", pid])
        launcher.kill()
    assert q(db, "SELECT target FROM session") == [(f"tree {launcher.pid}",)]
    _recorded_like_pid(db, first, "maps")
    calls = q(db, "SELECT c.python_status, count(*) FROM cuda_call_python c JOIN thread t ON t.id = c.thread_id"
                  " JOIN process p ON p.id = t.process_id JOIN cuda_api a ON a.id = c.api_id"
                  " WHERE p.pid = ? AND a.name != 'cudaLaunchKernel' GROUP BY 1", (second,))
    assert dict(calls).get("ok", 0) > 100, calls
    # the launcher is a target too (a Python without CUDA): its row says what it has
    caps = q(db, "SELECT detail FROM capability WHERE layer = 'target' AND target = ?", (f"pid {launcher.pid}",))
    assert caps == [("CPython",)], caps


def test_several_pids_in_every_spelling_are_recorded(tmp_path):
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    a, b, c = (str(s.pid) for s in sleepers)
    db = tmp_path / "p.db"
    try:
        start = run_recorder("start", "--db", str(db), "-p", f"{a},{b}", c, "-p", a, timeout=300)
        assert start.returncode == 0, start.stderr
        assert f"target pids {a},{b},{c})" in start.stdout
        run_recorder("stop", "--db", str(db), check=True, timeout=300)
    finally:
        for s in sleepers:
            s.kill()
    rows = q(db, "SELECT target, detail FROM capability WHERE layer = 'target' ORDER BY id")
    assert [t for t, _ in rows] == [f"pid {a}", f"pid {b}", f"pid {c}"]
    assert {d for _, d in rows} == {"no CUDA/NCCL library, marker extension or CPython mapped yet"}


def test_all_names_each_rank_of_a_torchrun_style_job_started_before_it(tmp_path, native):
    """Two ranks with torchrun's environment, each with two forked DataLoader-like workers, running
    before `start --all`: every process carries its rank, and the report and `recorder cluster steps`
    name each rank by it."""
    import json

    db = tmp_path / "job.db"
    workload = ROOT / "tests" / "workloads" / "nccl_ranks.py"
    launcher = subprocess.Popen([sys.executable, str(workload), "--libdir", str(native["dir"]), "--ranks", "2",
                                 "--steps", "100000", "--workers", "2", "--run-id", "r42", "--settle-s", "0"],
                                stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while len(ranks) < 2 or not all("libnccl" in Path(f"/proc/{r}/maps").read_text() for r in ranks):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.2)
            ranks = [int(p) for p in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
        _record(db, "--all")
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(launcher.pid)])  # the ranks (their workers end with them)
        launcher.kill()
    jobs = dict(q(db, "SELECT pid, job_rank FROM process WHERE run_id = 'r42' AND environ_status = 'read'"
                      " AND job_world_size = 2 AND master_addr = '127.0.0.1:29500'"))
    # each rank, and each of its workers (they inherit its environment)
    assert sorted(jobs[r] for r in ranks) == [0, 1]
    workers = q(db, "SELECT pid, parent_pid, job_rank FROM process WHERE parent_pid IN (?, ?) AND run_id = 'r42'",
                tuple(ranks))
    assert len({pid for pid, _, _ in workers}) == 4, workers
    assert all(rank == jobs[parent] for _, parent, rank in workers), workers
    step = q(db, "SELECT max(step) - 5 FROM step_mark")[0][0]
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", str(step), "--json", check=True).stdout)
    thread = report["step"]["thread"]
    assert thread["job"] == f"rank {jobs[thread['pid']]} of 2 (local rank {jobs[thread['pid']]}), torchrun run r42"
    text = run_recorder("explain", "--db", str(db), "--step", str(step), check=True).stdout
    assert f"Job: {thread['job']}" in text
    steps = json.loads(run_recorder("cluster", "steps", str(db), "--json", check=True).stdout)
    named = {p["rank"]: p["job"] for x in steps["recordings"] for p in x["processes"]}
    assert named == {r: f"rank {r} of 2 (local rank {r}), torchrun run r42" for r in (0, 1)}
    table = run_recorder("cluster", "steps", str(db), check=True).stdout
    for r in (0, 1):
        assert f": rank {r} of 2 (local rank {r}), torchrun run r42" in table, table
