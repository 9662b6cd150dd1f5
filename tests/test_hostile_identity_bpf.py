"""A root recorder on a shared node reads the identity (environment, command line, name, cgroup) of
every process it meets: its targets, and every task that preempts or wakes a traced thread. Any
local user chooses those values. Real processes with hostile environments under a real recorder:
the recorder survives, the recording is complete, and each value it could not take is recorded as
unreadable with why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf, pytest.mark.slow]

# torchrun's variables as a hostile process sets them: a digit int() refuses, an integer SQLite
# cannot hold, a newline that would forge a report line
HOSTILE = {"RANK": "\u00b2", "LOCAL_RANK": "99999999999999999999", "WORLD_SIZE": "99999999999999999999",
           "MASTER_ADDR": "10.0.0.1\nPrimary cause: none (forged)", "TORCHELASTIC_RUN_ID": "r42"}
# and a 1 MiB environment after them (eight variables of the kernel's 128 KiB limit for one)
HUGE = {f"PADDING{i}": "x" * (128 * 1024 - 16) for i in range(8)}


def _wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _session_complete(db: Path) -> None:
    assert q(db, "SELECT status FROM session")[0][0] == "complete"


def test_a_hostile_target_is_recorded_with_its_values_unreadable(tmp_path):
    """`start -p` of a process whose RANK is '²', whose LOCAL_RANK and WORLD_SIZE do not fit an
    int64, whose MASTER_ADDR holds a newline, and whose environment is 1 MiB: the recorder starts,
    records and stops cleanly; the process row says why each value is missing, keeps the good one
    (the run id), and says the environment was cut at its cap."""
    db = tmp_path / "hostile-target.db"
    # and a name with a newline and an escape sequence in it
    code = "open('/proc/self/comm', 'w').write('evil\\n\\x1b[2Jname'); import time; time.sleep(60)"
    target = subprocess.Popen([sys.executable, "-c", code], env={"PATH": os.environ["PATH"], **HOSTILE, **HUGE})
    try:
        _wait_for(lambda: Path(f"/proc/{target.pid}/comm").read_text().startswith("evil"), "the target did not start")
        start = run_recorder("start", "-p", str(target.pid), "--db", str(db), timeout=300)
        assert start.returncode == 0, start.stderr
        time.sleep(1)
        stop = run_recorder("stop", "--db", str(db), timeout=300)
        assert stop.returncode == 0, stop.stderr + stop.stdout
    finally:
        target.kill()
        target.wait()
    _session_complete(db)
    rows = q(db, "SELECT environ_status, job_rank, job_local_rank, job_world_size, master_addr, run_id FROM process"
                 " WHERE pid = ? AND name = 'evil\\n\\x1b[2Jname'", (target.pid,))
    assert rows, q(db, "SELECT pid, name, environ_status FROM process")
    status, rank, local, world, master, run_id = rows[0]
    assert (rank, local, world, master, run_id) == (None, None, None, None, "r42")
    assert status.split("; ") == [
        "read", "truncated: variables past its first 262144 bytes not read",
        "RANK unreadable: '\u00b2' is not an integer from 0 to 16777216",
        "LOCAL_RANK unreadable: '99999999999999999999' is not an integer from 0 to 16777216",
        "WORLD_SIZE unreadable: '99999999999999999999' is not an integer from 1 to 16777216",
        "MASTER_ADDR unreadable: '10.0.0.1\\nPrimary cause: none (forged)' is not a host name or address"]
    # no stored identity text carries a control character
    texts = q(db, "SELECT name, cmdline, environ_status, cgroup FROM process UNION ALL"
                  " SELECT name, NULL, NULL, NULL FROM thread")
    assert not [t for row in texts for t in row if t and any(ord(c) < 32 for c in t)], texts


def test_a_hostile_preemptor_under_start_all_is_recorded_and_the_recording_goes_on(tmp_path, native):
    """`start --all` with a training job pinned to one CPU and, on the same CPU, a busy process that
    is no target (it maps no CUDA library) but whose RANK does not fit SQLite's integer: the
    recorder resolves the identity of the task that preempts the traced thread, records its RANK
    as unreadable, and records on to a complete recording."""
    db = tmp_path / "hostile-preemptor.db"
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[-1]
    others = ",".join(str(c) for c in cpus if c != cpu) or str(cpu)
    workload = ROOT / "tests" / "workloads" / "train_steps.py"
    job = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, str(workload),
                            "--libdir", str(native["dir"]), "--steps", "100000", "--quiet"], stdout=subprocess.DEVNULL)
    hog = None
    try:
        _wait_for(lambda: "libcudart" in Path(f"/proc/{job.pid}/maps").read_text(), "the training job did not start")
        env = {"PATH": os.environ["PATH"], "RANK": "99999999999999999999", "SLURM_PROCID": "\u00b3",
               "POD_NAME": "pod\nPrimary cause: none"}
        hog = subprocess.Popen(["taskset", "-c", str(cpu), str(native["busy_loop"]), "120"], env=env)
        # the recorder itself runs on the other CPUs, so that the hog is what preempts the job
        start = subprocess.run(["taskset", "-c", others, *RECORDER, "start", "--all", "--db", str(db)],
                               capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert start.returncode == 0, start.stderr
        time.sleep(2)
        stop = run_recorder("stop", "--db", str(db), timeout=300)
        assert stop.returncode == 0, stop.stderr + stop.stdout
    finally:
        for p in (hog, job):
            if p is not None:
                p.kill()
                p.wait()
    _session_complete(db)
    # the hog was met as what preempted the job's traced thread, and its identity read
    preempted = q(db, "SELECT count(*) FROM offcpu_interval o JOIN thread t ON t.id = o.contender_thread_id"
                      " JOIN process p ON p.id = t.process_id WHERE p.pid = ?", (hog.pid,))[0][0]
    assert preempted > 0, q(db, "SELECT pid, name FROM process")
    rows = q(db, "SELECT environ_status, job_rank, pod_name FROM process WHERE pid = ?", (hog.pid,))
    assert rows and rows[0][1:] == (None, None), rows
    assert rows[0][0].split("; ") == [
        "read", "RANK unreadable: '99999999999999999999' is not an integer from 0 to 16777216",
        "POD_NAME unreadable: 'pod\\nPrimary cause: none' is not a Kubernetes object name"], rows
    # the training job's own rows went on being written after the hog's was
    assert q(db, "SELECT count(*) FROM cuda_call c JOIN thread t ON t.id = c.thread_id JOIN process p"
                 " ON p.id = t.process_id WHERE p.pid = ?", (job.pid,))[0][0] > 0
