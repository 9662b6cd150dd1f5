"""Steps without markers on real BPF recordings of tests/workloads/train_steps.py (stand-in CUDA
runtime): the heuristic (recorder/steps_infer.py) against the script's own markers, and against the
step start times the script prints when it calls no marker, with irregular steps and a stall."""

from __future__ import annotations

import sys
from bisect import bisect_right
from statistics import median

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

from recorder import _markers
from recorder.steps_infer import inferred_steps
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
    """As many steps as the truth, within one, and every inferred start within one step of the
    truth's step start before it (the inferred boundary is the step's synchronisation)."""
    assert abs(len(inferred) - len(truth)) <= 1, (len(inferred), len(truth))
    step = median(b - a for a, b in zip(truth, truth[1:], strict=False))
    for ts in inferred:
        before = truth[max(bisect_right(truth, ts) - 1, 0)]
        assert 0 <= ts - before < step, (ts - before, step)


def test_inferred_steps_match_the_markers(tmp_path, native):
    db = tmp_path / "marked.db"
    record(db, native, "--markers")
    marks = [ts for (ts,) in q(db, "SELECT ts FROM step_mark WHERE inferred = 0 ORDER BY ts")]
    assert len(marks) == STEPS
    # the process marks its own steps: nothing was inferred for it at stop
    assert q(db, "SELECT count(*) FROM step_mark WHERE inferred = 1") == [(0,)]
    with open_store(db, readonly=True) as store:
        found = inferred_steps(store, 1, skip_marked=False)
    assert {thread for thread, _, _ in found} == {t for (t,) in q(db, "SELECT DISTINCT thread_id FROM step_mark")}
    assert_close([ts for _, ts, _ in found], marks)


def test_irregular_steps_and_a_stall_without_markers(tmp_path, native):
    """Host work varying by +-30 % per step, and step 30 stalled 300 ms: the steps stored at stop
    (inferred = 1) are the script's, and the stall is step 30, whole."""
    db = tmp_path / "unmarked.db"
    truth = record(db, native, "--jitter", "0.3", "--slow-step", "30", "--slow-ms", "300")["step_start_ns"]
    rows = q(db, "SELECT step, ts, dur, inferred FROM step ORDER BY ts")
    assert {r[3] for r in rows} == {1}
    assert [r[0] for r in rows] == list(range(len(rows)))
    assert_close([r[1] for r in rows], truth)
    slowest = max(rows[:-1], key=lambda r: r[2])  # the last step runs on to the session stop
    assert slowest[0] == 30 and slowest[2] >= 300_000_000
