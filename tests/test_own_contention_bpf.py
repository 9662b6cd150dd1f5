"""CPU contention from the job itself is told apart from a foreign task, on real BPF: a training
loop pinned to one CPU stalls once behind a thread of its own process and once behind a process it
forked (as a data-loader worker); the report names each with what it is to the job and gives the
actions that fit (fewer threads or workers, not moving the job away from itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder, workload_output

pytestmark = [needs_bpf, pytest.mark.bpf]


def test_contention_from_own_thread_and_own_worker(tmp_path, native):
    db = tmp_path / "r.db"
    cpu = max(os.sched_getaffinity(0))
    # the recorder runs on the other CPUs, as `make demo` does, so that it is not the contender
    others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != cpu) or str(cpu)
    res = subprocess.run(["taskset", "-c", others, *RECORDER, "record", "--db", str(db), "--cuda-lib",
                          str(native["libcudart.so.12"]), "--", sys.executable,
                          str(ROOT / "tests" / "workloads" / "own_contention.py"), "--libdir", str(native["dir"]),
                          "--cpu", str(cpu), "--sibling-step", "40", "--child-step", "80"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    truth = workload_output(res.stdout)

    stalled = json.loads(run_recorder("steps", "--db", str(db), "--slow", "--json", check=True).stdout)["steps"]

    def worst(first: int) -> dict:
        """The report of the worst stall among the steps the spinner overlapped (it starts at `first`)."""
        steps = [s for s in stalled if first <= s["step"] < first + 20]
        assert steps, stalled
        step = max(steps, key=lambda s: s["dur_ns"])["step"]
        report = json.loads(run_recorder("explain", "--db", str(db), "--step", str(step), "--json",
                                         check=True).stdout)
        assert report["stall"] is True and report["primary_cause"]["kind"] == "cpu_contention", report
        return report["primary_cause"]

    cause = worst(40)
    # named as they named themselves after they started (task:task_rename)
    assert cause["contender_relation"] == "same_process" and cause["contender_name"] == "spinner", cause
    assert cause["contender_pid"] == truth["pid"]
    assert "of its own process" in cause["summary"], cause["summary"]
    assert any("set_num_threads" in a for a in cause["next_actions"]), cause["next_actions"]
    # never "move the job away from itself"
    assert not any(f"taskset -cp <other cpus> {truth['pid']}" in a for a in cause["next_actions"])

    cause = worst(80)
    assert cause["contender_relation"] == "job" and cause["contender_name"] == "worker-spin", cause
    assert cause["contender_pid"] == truth["child_pid"]
    assert "a process of the recorded job" in cause["summary"], cause["summary"]
    assert any("DataLoader workers" in a for a in cause["next_actions"]), cause["next_actions"]
    renames = q(db, "SELECT t.tid, n.name FROM thread_name n JOIN thread t ON t.id = n.thread_id ORDER BY n.ts")
    assert (truth["sibling_tid"], "spinner") in renames and (truth["child_pid"], "worker-spin") in renames, renames
