"""Waits followed across threads and processes, on real BPF: a queue fed by a worker process whose
read a cgroup throttles, a thread holding the GIL (on every supported CPython), a client waiting for
its peer behind TCP retransmissions (in poll() and in recvfrom()), and the clean runs that must not
produce these causes. The report's words and the rows of wait_chain, offcpu_wait and causal_link are
checked against what each workload says it did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder, workload_output
from test_io_bpf import ext4_loop, throttled  # noqa: F401 - fixtures

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "waits.py")
PYENV = Path("/root/.pyenv/versions")


def record(db: Path, *cmd: str, python: str = sys.executable) -> dict:
    res = subprocess.run([*RECORDER, "record", "--db", str(db), "--", python, WORKLOAD, *cmd],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return workload_output(res.stdout)


def explain_worst(db: Path, first: int, last: int) -> dict:
    """The report of the worst stalled step in [first, last]."""
    stalled = json.loads(run_recorder("steps", "--db", str(db), "--slow", "--json", check=True).stdout)["steps"]
    steps = [s for s in stalled if first <= s["step"] <= last]
    assert steps, stalled
    step = max(steps, key=lambda s: s["dur_ns"])["step"]
    return json.loads(run_recorder("explain", "--db", str(db), "--step", str(step), "--json", check=True).stdout)


def _chain_rows(db: Path, root: int) -> list[tuple]:
    return q(db, "SELECT depth, offcpu_id, tid, pid FROM wait_chain WHERE root_offcpu_id = ? ORDER BY depth", (root,))


# -- a queue fed by a throttled worker ----------------------------------------------------------------
def _data_file(mnt: Path) -> Path:
    data = mnt / "batches.bin"
    with open(data, "wb") as f:
        f.write(os.urandom(4 << 20))
        os.fsync(f.fileno())
    return data


def test_queue_wait_is_explained_by_the_workers_throttled_read(tmp_path, throttled):  # noqa: F811
    mnt, _majmin, disk, cg = throttled
    data = _data_file(mnt)
    db = tmp_path / "chain.db"
    truth = record(db, "chain", "--file", str(data), "--cgroup-procs", str(cg / "cgroup.procs"))
    report = explain_worst(db, 24, 27)
    cause = report["primary_cause"]
    assert report["stall"] and cause["kind"] == "wait_chain", json.dumps(cause, indent=1)
    hops = cause["chain"]
    # it starts at the main thread's queue read and ends at the worker's throttled read
    assert hops[0]["thread"]["tid"] == truth["tid"] and hops[0]["depth"] == 0
    assert hops[0]["reason"] == "io" and hops[0]["syscall"] == "read", hops[0]
    end = hops[-1]
    assert end["thread"]["pid"] == truth["worker_pid"] and end["thread"]["name"] == "loader-worker", end
    assert end["device"] == disk and end["queued_dur_ns"] > end["device_dur_ns"], end
    assert end["python"].endswith(f"waits.py:{truth['read_line']}"), end
    assert len(hops) >= 2 and all(h["thread"]["tid"] != truth["tid"] for h in hops[1:])
    assert cause["waited_for"] == "loader-worker"
    assert cause["summary"].startswith(f"loader-worker (pid {truth['worker_pid']}) blocked on I/O on {disk}"), \
        cause["summary"]
    assert "blk-throttle" in cause["summary"] and f"waits.py:{truth['read_line']}" in cause["summary"]
    assert cause["python"].endswith(f"waits.py:{truth['read_line']}")
    assert any("blkio.throttle" in a for a in cause["next_actions"]), cause["next_actions"]
    # the view gives the same hops, and causal_link has one 'woken_after' row per hop
    root = hops[0]["offcpu_id"]
    assert _chain_rows(db, root) == [(h["depth"], h["offcpu_id"], h["thread"]["tid"], h["thread"]["pid"])
                                     for h in hops]
    for a, b in zip(hops, hops[1:], strict=False):
        assert q(db, "SELECT count(*) FROM causal_link WHERE from_table = 'offcpu_interval' AND from_id = ?"
                     " AND relation = 'woken_after' AND to_id = ?", (a["offcpu_id"], b["offcpu_id"]))[0][0] == 1
    # the root is the step's own wait (step -> off_cpu -> woken_after ...)
    assert q(db, "SELECT count(*) FROM causal_link WHERE from_table = 'step_mark' AND relation = 'off_cpu'"
                 " AND to_id = ?", (root,))[0][0] == 1
    text = run_recorder("explain", "--db", str(db), "--step", str(report["step"]["step"]), check=True).stdout
    assert f"Primary cause: loader-worker (pid {truth['worker_pid']}) blocked on I/O on {disk}" in text, text
    assert "Kernel path: read() -> woken by" in text, text


def test_clean_queue_run_has_no_throttled_chain(tmp_path, throttled):  # noqa: F811
    mnt, _majmin, disk, cg = throttled
    data = _data_file(mnt)
    db = tmp_path / "clean.db"
    record(db, "chain", "--file", str(data), "--cgroup-procs", str(cg / "cgroup.procs"), "--big", "4096")
    # the worker's small reads are never queued long, so no wait ends at one
    assert q(db, "SELECT count(*) FROM wait_chain WHERE device = ? AND queued_dur > 100000000", (disk,))[0][0] == 0
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    cause = report.get("primary_cause") or {}
    assert not (cause.get("kind") == "wait_chain" and cause["chain"][-1]["device"] == disk
                and cause["chain"][-1]["queued_dur_ns"] > 100e6), cause
