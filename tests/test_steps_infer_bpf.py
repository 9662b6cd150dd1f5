"""Steps without markers on real BPF recordings of tests/workloads/train_steps.py (stand-in CUDA
runtime): the heuristic (recorder/steps_infer.py) against the script's own markers, and against the
step start times the script prints when it calls no marker, with irregular steps and a stall."""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections import Counter
from itertools import pairwise

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

from recorder import _markers
from recorder.steps_infer import inferred_steps, sync_calls
from store.db import open_store

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "train_steps.py")
STEPS = 60


def record(db, native, *workload_args: str) -> dict:
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]),
                       "--cuda-lib", _markers.__file__, "--",
                       sys.executable, WORKLOAD, "--libdir", str(native["dir"]), "--steps", str(STEPS),
                       *workload_args, timeout=300)
    assert res.returncode == 0, res.stderr
    return workload_output(res.stdout)


def assert_close(inferred: list[int], truth: list[int]) -> None:
    """Within one step boundary: as many steps as the truth, within one, and each inferred start
    inside a different true step (at or after its start, before the next one's). An inferred step
    starts at the step's first wait for the device, so it can lag the true start by the host work
    before it, a stalled data loader included."""
    assert abs(len(inferred) - len(truth)) <= 1, (len(inferred), len(truth))
    steps = [bisect_right(truth, ts) - 1 for ts in inferred]
    assert steps[0] >= 0, "an inferred step before the first true one"
    assert all(a < b for a, b in pairwise(steps)), "two inferred starts in one true step"


def what_was_seen(db) -> str:
    """The synchronising calls per thread by key, their stacks' status, the losses: printed when an
    assertion fails, so that a failure says whether the recording or the heuristic went wrong."""
    with open_store(db, readonly=True) as store:
        calls = sync_calls(store, 1)
    keys = {t: Counter(c.key for c in cs) for t, cs in calls.items()}
    status = q(db, "SELECT s.status, count(*) FROM cuda_call c LEFT JOIN python_stack s"
                   " ON s.id = c.python_stack_id GROUP BY 1")
    return f"sync keys per thread {keys}; call stacks by status {status}; loss {q(db, 'SELECT * FROM loss')}"


def close_or_explain(db, inferred: list[int], truth: list[int]) -> None:
    try:
        assert_close(inferred, truth)
    except AssertionError as e:
        raise AssertionError(f"{e}; {what_was_seen(db)}") from e


def test_inferred_steps_match_the_markers(tmp_path, native):
    db = tmp_path / "marked.db"
    record(db, native, "--markers")
    marks = [ts for (ts,) in q(db, "SELECT ts FROM step_mark WHERE inferred = 0 ORDER BY ts")]
    assert len(marks) == STEPS, what_was_seen(db)
    # the process marks its own steps: nothing was inferred for it at stop
    assert q(db, "SELECT count(*) FROM step_mark WHERE inferred = 1") == [(0,)]
    with open_store(db, readonly=True) as store:
        found = inferred_steps(store, 1, skip_marked=False)
    marking = {t for (t,) in q(db, "SELECT DISTINCT thread_id FROM step_mark")}
    assert {thread for thread, _, _ in found} == marking, what_was_seen(db)
    close_or_explain(db, [ts for _, ts, _ in found], marks)


def test_irregular_steps_and_a_stall_without_markers(tmp_path, native):
    """Host work varying by +-30 % per step, and step 30 stalled 300 ms: the steps stored at stop
    (inferred = 1) are the script's, and the stall is step 30, whole."""
    db = tmp_path / "unmarked.db"
    truth = record(db, native, "--jitter", "0.3", "--slow-step", "30", "--slow-ms", "300")["step_start_ns"]
    rows = q(db, "SELECT step, ts, dur, inferred FROM step ORDER BY ts")
    assert {r[3] for r in rows} == {1}
    assert [r[0] for r in rows] == list(range(len(rows)))
    close_or_explain(db, [r[1] for r in rows], truth)
    slowest = max(rows[:-1], key=lambda r: r[2])  # the last step runs on to the session stop
    assert slowest[0] == 30 and slowest[2] >= 300_000_000


def test_two_ranks_steps_inferred_from_their_collectives(tmp_path, native):
    """tests/workloads/nccl_ranks.py: each rank synchronises, all-reduces and synchronises again per
    step (rank 1 late at steps 10 and 11). Ignoring the ranks' markers, each rank's inferred steps
    match its marked ones."""
    db = tmp_path / "ranks.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["dir"] / "libnccl.so.2"),
                       "--cuda-lib", str(native["libcudart.so.12"]), "--cuda-lib", _markers.__file__, "--",
                       sys.executable, str(ROOT / "tests" / "workloads" / "nccl_ranks.py"),
                       "--libdir", str(native["dir"]), "--steps", "20", "--slow-steps", "10,11", timeout=300)
    assert res.returncode == 0, res.stderr
    with open_store(db, readonly=True) as store:
        found = inferred_steps(store, 1, skip_marked=False)
    marks = q(db, "SELECT m.thread_id, m.ts FROM step_mark m WHERE m.inferred = 0 ORDER BY m.ts")
    threads = {t for t, _ in marks}
    assert len(threads) == 2 and {t for t, _, _ in found} == threads
    for thread in threads:
        close_or_explain(db, [ts for t, ts, _ in found if t == thread], [ts for t, ts in marks if t == thread])
