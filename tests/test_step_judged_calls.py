"""A CUDA call with no baseline of its own (fewer than slow_call_rule.min_baseline_calls calls of
its family and size class in the session) is judged by its step: the whole call against the API's
time in the neighbouring steps. On synthetic recordings (real SQLite files read through the views):
a once-only cudaDeviceSynchronize that sleeps through a checkpoint step, and a once-only call too
small to explain its step."""

from __future__ import annotations

from pathlib import Path

from recorder.demo import MS, STACK_CKPT, STALL_STEP, STATE_SLEEP, US, Job, Synth
from store.analysis.explain import analyse
from store.db import open_store
from store.report.render import render_text


def _write(path: Path, fault) -> int:
    with open_store(path, create=True) as store:
        s = Synth(store, "step-judged")
        return s.finish(s.run_steps([s.job(4100)], 40, {STALL_STEP - 20: fault}))


def _checkpoint_sync(s: Synth, job: Job, t: int, phase: str) -> int:
    """After the step's own work: one cudaDeviceSynchronize, the session's only one, asleep 400 ms
    on the driver's futex until the GPU is done."""
    if phase == "load":
        return s.load_batch(job, t)
    if phase != "after":
        return t
    s.cuda(job.thread_id, t, 400 * MS, "cudaDeviceSynchronize", STACK_CKPT)
    s.offcpu(job.thread_id, t + 20 * US, 400 * MS - 40 * US, STATE_SLEEP, "futex", wakeup_ts=t + 400 * MS - 30 * US,
             waker=job.driver_thread_id, stack=STACK_CKPT)
    return t + 400 * MS


def test_a_once_only_synchronisation_that_sleeps_through_the_step_is_named(tmp_path: Path) -> None:
    db = tmp_path / "sync.db"
    sid = _write(db, _checkpoint_sync)
    with open_store(db, readonly=True) as store:
        report = analyse(store, sid)
        # no call took more than twice its own baseline: the rule that judges calls by their baseline
        # alone finds nothing here
        assert store.row("SELECT count(*) AS n FROM slow_cuda_call")["n"] == 0
    out = report.to_json()
    assert out["step"]["step"] == STALL_STEP - 20
    cause = out["primary_cause"]
    assert cause["kind"] == "slow_cuda_call"
    assert cause["summary"] == ("400 ms in cudaDeviceSynchronize, the first of the session (no baseline of its own):"
                                " blocked inside the library for 400 ms (in futex())")
    assert cause["judged"] == "step" and cause["call_ordinal"] == 1 and cause["expected_dur_ns"] is None
    assert cause["python"] == "save_checkpoint() at train.py:212"
    assert cause["kernel_path"] == ["cudaDeviceSynchronize", "blocked in the CUDA library (in futex())"]
    assert cause["share_of_stall"] >= 0.95
    text = render_text(report)
    assert ("Primary cause: 400 ms in cudaDeviceSynchronize, the first of the session (no baseline of its own):"
            " blocked inside the library for 400 ms (in futex())") in text.splitlines()
    listed = next(x for x in text.splitlines() if "Z  cudaDeviceSynchronize" in x)
    assert listed.split("Z  ", 1)[1].startswith("cudaDeviceSynchronize 400 ms (the first of the session, no baseline"
                                                " of its own): off-CPU 100% of the call, ")
    assert listed.endswith(", blocked 400 ms (futex in futex)")
    assert cause["next_actions"][0].startswith("cudaDeviceSynchronize was made once here (the first of the session)")
    findings = out["findings"]
    assert [(f["api"], f["judged"], f["expected_dur_ns"]) for f in findings] == [
        ("cudaDeviceSynchronize", "step", None)]
    assert not any(n.startswith("no CUDA call took") for n in out["negatives"])


def _small_first_copy(s: Synth, job: Job, t: int, phase: str) -> int:
    """A data-loading stall of 300 ms (one read on the device that long) and, in the same step, the
    session's only cudaMemcpy: 2 ms on the CPU."""
    if phase == "load":
        return s.load_batch(job, t, device_dur=lambda i: 300 * MS if i == 3 else int(1.8 * MS))
    if phase != "compute":
        return t
    s.cuda(job.thread_id, t, 2 * MS, "cudaMemcpy", STACK_CKPT, size=64 << 20)
    return t + 2 * MS


def test_a_once_only_call_too_small_for_the_step_is_evidence_not_the_cause(tmp_path: Path) -> None:
    db = tmp_path / "copy.db"
    sid = _write(db, _small_first_copy)
    with open_store(db, readonly=True) as store:
        out = analyse(store, sid).to_json()
        rows = {(r["cause"], r["detail"]): r for r in out["breakdown"]}
    assert out["primary_cause"]["kind"] != "slow_cuda_call", out["primary_cause"]["summary"]
    assert rows[("cuda_call", "cudaMemcpy")]["dur_ns"] == 2 * MS
    assert rows[("cuda_call", "cudaMemcpy")]["usual_dur_ns"] == 0
    # 2 ms is under 5% of the step's excess (cause_rule.secondary_share): not listed as a slow call
    assert [f["api"] for f in out["findings"]] == []
