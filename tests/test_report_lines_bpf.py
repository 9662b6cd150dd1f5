"""What a report says of real recordings, with real BPF: the Python line of a cause without a stack of
its own (a hog that preempts the training thread inside a long kernel launch; memory reclaim in the
page faults of a pure-Python allocation), the names of threads that set none, and, for a script
without steps or CUDA calls, its longest waits and no negative it has no evidence for.
Skipped with the reason where root or BPF is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import (
    CGROUP_LAYOUTS,
    RECORDER,
    ROOT,
    limited_cgroup,
    memory_limit,
    needs_bpf,
    q,
    realtime,
    require_cgroup,
    run_recorder,
    workload_output,
)

pytestmark = [needs_bpf, pytest.mark.bpf]
LONG_LAUNCH = "long_launch() at train_steps.py"


@pytest.fixture(scope="module")
def hogged(tmp_path_factory, native):
    """A marked training loop on one CPU whose step 30 starts a helper (busy_loop, nice -15, on that
    CPU), sleeps 20 ms, runs 3 ms of Python and then makes a 150 ms (CPU time) launch: the hog's
    first preemptions land on the Python work after the sleep, most of them inside the launch. With a
    row per launch (--launch-rows): a preemption is put on the launch that it is inside by the launch's
    interval, which a counted launch does not have."""
    db = tmp_path_factory.mktemp("hog") / "h.db"
    cpu = max(os.sched_getaffinity(0))
    others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != cpu) or str(cpu)
    res = subprocess.run(
        ["taskset", "-c", others, *RECORDER, "record", "--db", str(db), "--launch-rows",
         "--cuda-lib", str(native["libcudart.so.12"]),
         "--", sys.executable, str(ROOT / "tests" / "workloads" / "train_steps.py"), "--libdir", str(native["dir"]),
         "--steps", "60", "--cpu", str(cpu), "--markers", "--hog-step", "30",
         "--hog", f"nice -n -15 {native['busy_loop']} 0.6", "--long-launch-ms", "150"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return db, workload_output(res.stdout)


def test_a_preemption_inside_a_long_launch_is_at_the_launchs_line(hogged):
    db, out = hogged
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", "30", "--json", check=True).stdout)
    cause = report["primary_cause"]
    assert cause["kind"] == "cpu_contention", cause
    lines = cause["python_lines"]
    assert lines and LONG_LAUNCH in lines[0]["python"] and lines[0]["how"] == "in_call", lines
    assert LONG_LAUNCH in cause["python"], cause["python"]
    # the time-weighted rule: the launch holds most of the wait, and the view gives every line its time
    step = q(db, "SELECT id FROM step_mark WHERE step = 30")[0][0]
    by_line = dict(q(db, "SELECT python_line, sum(dur) FROM step_lost_line WHERE step_mark_id = ?"
                         " AND cause = 'cpu_wait' GROUP BY python_line", (step,)))
    at_launch = sum(v for k, v in by_line.items() if k and LONG_LAUNCH in k)
    assert at_launch >= 0.5 * sum(by_line.values()) and at_launch == lines[0]["dur_ns"], by_line
    # the hog's first preemptions (on the sleep's wake-up and the Python work after it) are at other
    # lines: the line of the first one is not the answer
    assert any(k and LONG_LAUNCH not in k for k in by_line), by_line


def test_a_thread_gone_before_it_was_read_is_named_by_its_command(hogged):
    db, out = hogged
    [tid] = out["brief_thread_tids"]
    # it never set a name: it has its process's (the command's), even though it was gone before
    # the recorder read the fork
    rows = q(db, "SELECT t.name, i.process_name FROM thread t JOIN thread_info i ON i.thread_id = t.id"
                 " WHERE t.tid = ? AND t.traced", (tid,))
    assert len(rows) == 1 and rows[0][0] and rows[0][0] == rows[0][1], rows
    assert not q(db, "SELECT tid FROM thread_info WHERE thread_name IS NULL AND traced")


@pytest.fixture(scope="module", params=CGROUP_LAYOUTS)
def reclaimed(request, tmp_path_factory):
    """A marked loop in a memory cgroup (v1 or v2) limited to 96 MiB, each step touching 8 MiB: step 4 ends
    writing 72 MiB to a file (dirty page cache, charged to the cgroup) and step 5 allocates and
    touches 48 MiB in pure Python (bytearray) and then sleeps on a later line: the allocation's page
    faults reclaim the cache (memcg direct reclaim, waiting for its writeback). The loop runs as a
    real-time task (SCHED_FIFO): on a machine busy with other work it still never waits for a CPU,
    so the step's one cause is its reclaim."""
    require_cgroup(request.param, "memory")
    tmp = tmp_path_factory.mktemp("reclaim")
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp)], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        pytest.skip(f"needs a disk-backed temporary folder ({tmp} is on {fs}: its pages cannot be reclaimed)")
    gen = limited_cgroup(request.param, "memory", memory_limit(request.param, 96 << 20))
    cg = next(gen)
    try:
        db = tmp / "r.db"
        res = run_recorder("record", "--db", str(db), "--", *realtime(), sys.executable,
                           str(ROOT / "tests" / "workloads" / "alloc_touch.py"), "--file", str(tmp / "fill.bin"),
                           "--cgroup-procs", str(cg / "cgroup.procs"), "--steps", "8", "--reclaim-step", "5",
                           "--mib", "48", "--step-mib", "8", "--fill-mib", "72", timeout=300)
    finally:
        next(gen, None)
    assert res.returncode == 0, res.stderr
    return db, workload_output(res.stdout)


def test_reclaim_in_a_pure_python_allocation_is_at_the_allocations_line(reclaimed):
    db, out = reclaimed
    alloc, sync = (f"alloc_touch.py:{out['lines'][k]}" for k in ("alloc", "sync"))
    # every reclaim of the step carries the stack captured where it began: the allocation's line
    step = q(db, "SELECT id FROM step_mark WHERE step = 5")[0][0]
    sites = q(db, "SELECT s.text, count(*), sum(r.overlap_dur) FROM step_reclaim r"
                  " JOIN reclaim_interval x ON x.id = r.reclaim_id"
                  " LEFT JOIN python_call_site s ON s.stack_id = x.python_stack_id"
                  " WHERE r.step_mark_id = ? GROUP BY s.text", (step,))
    assert len(sites) == 1 and sites[0][0] and sites[0][0].endswith(alloc), sites
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", "5", "--json", check=True).stdout)
    cause = report["primary_cause"]
    assert cause["kind"] == "memory_reclaim", (cause["kind"], report["breakdown"])
    # the report's line is the allocation's, with the reclaim's time on it; not the later sleep's
    assert cause["python"].endswith(alloc) and sync not in cause["python"], cause["python"]
    lines = cause["python_lines"]
    assert [(x["python"], x["dur_ns"], x["how"]) for x in lines] == [(sites[0][0], sites[0][2], "own")], lines


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """An unmarked script that makes no CUDA call: two 600 ms sleeps, and a thread blocked in read()."""
    db = tmp_path_factory.mktemp("plain") / "p.db"
    res = run_recorder("record", "--db", str(db), "--", sys.executable,
                       str(ROOT / "tests" / "workloads" / "syscall_waits.py"), "--rounds", "2", "--burst", "50",
                       "--sleep-ms", "600", timeout=300)
    assert res.returncode == 0, res.stderr
    return db, workload_output(res.stdout)


def test_a_script_without_steps_or_cuda_reports_its_longest_waits(plain):
    db, out = plain
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    assert report["mode"] == "call"
    sleeps = [w for w in report["waits"] if w["python"] and "syscall_waits.py:43" in w["python"]]
    assert sleeps and sleeps[0]["reason"] == "sleep" and sleeps[0]["intervals"] == 2, report["waits"]
    assert 550e6 <= sleeps[0]["longest_dur_ns"] and 1100e6 <= sleeps[0]["dur_ns"], sleeps
    assert f"(tid {out['main']})" in sleeps[0]["threads"]
    text = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "Longest waits by Python line:" in text and "syscall_waits.py:43" in text, text
    # no CUDA was recorded: nothing is said of CUDA calls; the memory, network and DMA layers are listed
    assert "no CUDA call stalled" not in text and "CUDA call took" not in text, text
    assert report["symptom"].startswith("no CUDA calls recorded in this window; the traced threads' longest wait")
    listed = set(report["observed_layers"]) | {n["layer"] for n in report["not_observed"]}
    assert {"mm", "net", "dma"} <= listed, listed


def test_a_window_outside_the_recording_checks_nothing(plain):
    db, _ = plain
    report = json.loads(run_recorder("explain", "--db", str(db), "--window", "1000..1100", "--json",
                                     check=True).stdout)
    assert report["negatives"] == [] and report["observed_layers"] == [], report
    assert "outside the recording" in report["symptom"]
    text = run_recorder("explain", "--db", str(db), "--window", "1000..1100", check=True).stdout
    assert "Checked and clean" not in text and "Observed: nothing" in text, text
