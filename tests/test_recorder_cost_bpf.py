"""The recorder must not become a cause of what it records: with real BPF, a job whose threads
block tens of thousands of times gets every blocked interval recorded while the recorder itself
wakes up only a small fraction as often (its rings wake it in batches, bpf/common.h). Before the
batching it woke for about every third record and preempted the threads it traced."""

from __future__ import annotations

import resource
import sys

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

pytestmark = [needs_bpf, pytest.mark.bpf]
PINGPONG = str(ROOT / "tests" / "workloads" / "pingpong.py")


def test_every_blocked_interval_recorded_without_waking_the_recorder_for_each(tmp_path):
    db = tmp_path / "r.db"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = run_recorder("record", "--db", str(db), "--", sys.executable, PINGPONG, "--round-trips", "20000",
                          timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.returncode == 0, result.stderr
    job = workload_output(result.stdout)
    # the kernel's count of the job's voluntary switches is the truth; each is one blocked interval,
    # less the switches in which the threads exited (a dead task never comes back)
    blocked = q(db, "SELECT count(*) FROM offcpu_interval o JOIN thread t ON t.id = o.thread_id"
                    " JOIN task_state s ON s.state = o.state WHERE s.reason != 'preempted' AND t.traced = 1")[0][0]
    # a sched_switch run the kernel skipped (another BPF program was running on the CPU) is counted
    skipped = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe ="
                    " 'bpf program tracepoint__sched__sched_switch skipped (sched)'")[0][0]
    assert job["voluntary_switches"] - 2 - skipped <= blocked <= job["voluntary_switches"], (blocked, job, skipped)
    assert blocked > 20000
    assert q(db, "SELECT count(*) FROM loss WHERE probe NOT LIKE 'bpf program %'")[0][0] == 0, q(
        db, "SELECT * FROM loss")
    # the recorder (everything `recorder record` reaped, less the job's own switches)
    recorder_switches = (after.ru_nvcsw - before.ru_nvcsw) - job["voluntary_switches"]
    assert recorder_switches < blocked / 10, (recorder_switches, blocked)
