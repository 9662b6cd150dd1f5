"""The stall report of every demo scenario, pinned: text and JSON in tests/golden/.

Each scenario is a synthetic recording written through the store (recorder/demo.py) and explained
by the same views and code as a real one. A change to the wording, the numbers or the causal model
shows as a diff here. After an intended change, rewrite the files with

    STALL_RECORDER_UPDATE_GOLDEN=1 make test

and review the diff. Independently of the pinned text, each scenario must name its injected
cause, step, device and Python line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recorder.demo import SCENARIOS, write_scenario
from store.db import open_store
from store.report.build import explain, render_text

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("STALL_RECORDER_UPDATE_GOLDEN") == "1"

# scenario -> (device the cause names, Python line of the evidence)
EXPECTED = {
    "nvme-timeout-checkpoint": ("nvme0n1", "save_checkpoint() at train.py:212"),
    "p999-read-latency": ("nvme0n1", "load_batch() at data.py:88"),
    "cpu-contention": (None, "Block.forward() at model.py:57"),
    "dma-bounce": ("nvme0n1", "load_batch() at data.py:88"),
    "iommu-fault": ("nvme0n1", "load_batch() at data.py:88"),
    "nccl-straggler": (None, "all_reduce_grads() at train.py:166"),
    "oom-reclaim": (None, "collate() at data.py:120"),
    "tcp-retransmit": (None, "fetch_shard() at data.py:64"),
}


def _report(name: str, tmp_path: Path) -> dict:
    db = tmp_path / f"{name}.db"
    sid = write_scenario(name, db)
    with open_store(db, readonly=True) as store:
        return explain(store, sid)


def _pinned(path: Path, text: str) -> None:
    if UPDATE or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        if not UPDATE:
            pytest.fail(f"{path.name} did not exist and was written: review it and commit it")
    assert text == path.read_text(), f"report changed: diff against {path} (see this file's docstring)"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_is_pinned(name: str, tmp_path: Path) -> None:
    report = _report(name, tmp_path)
    _pinned(GOLDEN / f"{name}.txt", render_text(report) + "\n")
    _pinned(GOLDEN / f"{name}.json", json.dumps(report, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", sorted(s for s in SCENARIOS if s != "healthy"))
def test_the_injected_cause_is_primary(name: str, tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    report = _report(name, tmp_path)
    assert report["stall"] is True
    assert report["step"]["step"] == scenario.step
    cause = report["primary_cause"]
    assert cause["kind"] == scenario.cause, cause["summary"]
    device, line = EXPECTED[name]
    if device:
        assert cause["device"] == device
    assert cause["python"] == line
    assert cause["share_of_stall"] >= 0.9
    text = render_text(report)
    assert f"Python: {line}" in text and "Recommended next actions:" in text


def test_healthy_reports_no_stall(tmp_path: Path) -> None:
    report = _report("healthy", tmp_path)
    assert report["stall"] is False and report["primary_cause"] is None
    assert report["symptom"].startswith("no step stalled: 60 steps")
    assert "Primary cause: none: no stall" in render_text(report)


def test_nvme_report_carries_queue_tag_lineage_and_path(tmp_path: Path) -> None:
    cause = _report("nvme-timeout-checkpoint", tmp_path)["primary_cause"]
    assert (cause["controller"], cause["queue"], cause["request_tag"]) == ("nvme0", 7, 4096)
    assert cause["lineage"]["label"] == "checkpoint_write/run42/step80000/shard17"
    assert cause["lineage"]["checkpoint"] == "/ckpt/run42/step80000/shard17.pt"
    assert cause["kernel_path"][0] == "fsync()" and "NVMe timeout" in cause["kernel_path"]
    assert "controller reset" in cause["kernel_path"]


def test_straggler_report_explains_the_late_rank(tmp_path: Path) -> None:
    report = _report("nccl-straggler", tmp_path)
    assert report["step"]["thread"]["pid"] == 4100  # the rank that waited
    assert report["primary_cause"]["straggler_rank"] == 1
    late = report["straggler"]
    assert late["pid"] == 4200 and late["summary"].startswith("slow read on nvme1n1")
    assert late["python"] == "load_batch() at data.py:88"


def test_explicit_negatives_name_the_clean_layers(tmp_path: Path) -> None:
    report = _report("cpu-contention", tmp_path)
    assert "no SWIOTLB bounce detected" in report["negatives"]
    assert "no NVMe timeout or reset" in report["negatives"]
    # the demo samples no GPU and has no on-CPU profile
    assert [n["layer"] for n in report["not_observed"]] == ["gpu", "profile"]


@pytest.mark.parametrize("name", ["nccl-straggler", "cpu-contention"])
def test_report_baselines_equal_the_views(name: str, tmp_path: Path) -> None:
    """The report reads step baselines from the views; listings compute them in one pass in Python
    (store/causes.all_steps) for speed. Both must give the same rows (tests/test_rules.py: under
    changed rules too)."""
    from store.analysis.causes import all_steps, find_stalls, lookup_steps

    db = tmp_path / f"{name}.db"
    sid = write_scenario(name, db)
    keys = ("step_mark_id", "dur", "baseline_dur", "baseline_steps", "excess_dur", "ratio", "slow")
    with open_store(db, readonly=True) as store:
        view = [tuple(r[k] for k in keys) for r in store.query("SELECT * FROM step_baseline ORDER BY step_mark_id")]
        mine = sorted(tuple(r[k] for k in keys) for r in all_steps(store, sid))
        assert view == mine and any(r[-1] for r in view)
        stalls = {r["step_mark_id"] for r in store.query("SELECT step_mark_id FROM stall")}
        assert stalls == {r[0] for r in mine if r[-1]} == {r["step_mark_id"] for r in find_stalls(store, sid, 0, 2**62)}
        for number in (80_000, 80_017, 80_039):
            lookup = [tuple(r[k] for k in keys) for r in store.query(
                "SELECT * FROM step_baseline_lookup WHERE step = ? ORDER BY step_mark_id", (number,))]
            assert lookup == sorted(tuple(r[k] for k in keys) for r in lookup_steps(store, sid, number))


def test_gpu_utilisation_in_the_symptom_and_drops(tmp_path: Path) -> None:
    """With NVML samples in the session, the step's symptom quotes the GPU's utilisation during it
    against the session median, and gpu_util_drop finds the starved stretch."""
    import sqlite3

    from recorder.demo import MS, T0

    db = tmp_path / "gpu.db"
    sid = write_scenario("cpu-contention", db)
    with open_store(db, readonly=True) as store:
        step = store.one("SELECT ts, dur FROM step WHERE step = 80042")
    end = T0 + 30_000 * MS
    rows = [(sid, ts, 0, "0000:10:1c.0", "demo", 8 if step["ts"] <= ts < step["ts"] + step["dur"] else 97)
            for ts in range(T0, end, 100 * MS)]
    with sqlite3.connect(db) as conn:
        conn.executemany("INSERT INTO gpu_sample (session_id, ts, gpu_index, pci_address, name, util_gpu)"
                         " VALUES (?, ?, ?, ?, ?, ?)", rows)
    with open_store(db, readonly=True) as store:
        report = explain(store, sid)
        drops = store.query("SELECT * FROM gpu_util_drop")
    gpu = report["gpu"]
    assert gpu["util_gpu_pct"] == 8 and gpu["util_gpu_min_pct"] == 8 and gpu["neighbours_util_gpu_pct"] == 97
    assert gpu["neighbour_steps"] == 20
    assert "GPU utilisation 8.0% (lowest 8%) against 97.0% over 20 neighbouring steps" in report["symptom"]
    assert "median" not in report["symptom"].split("GPU")[1]
    with open_store(db, readonly=True) as store:  # the step view: mean and lowest sample per step
        rows = {r["step"]: r for r in store.query("SELECT * FROM step_gpu WHERE step IN (80041, 80042)")}
    assert rows[80042]["util_gpu_mean"] == 8 and rows[80042]["util_gpu_min"] == 8
    assert rows[80041]["util_gpu_mean"] == 97 and rows[80041]["samples"] >= 1
    assert len(drops) == 1 and drops[0]["usual_util_gpu"] == 97 and drops[0]["samples"] >= 6
    assert step["ts"] <= drops[0]["ts"] < step["ts"] + step["dur"]


def test_a_reclaim_takes_its_own_stack_else_a_wait_inside_it(tmp_path: Path) -> None:
    """step_lost_time puts a reclaim on the stack captured where it began ('own'); a reclaim without
    one (recorded before reclaims had stacks) on the stack of a wait of its thread inside it."""
    import sqlite3

    db = tmp_path / "r.db"
    write_scenario("oom-reclaim", db)
    sql = "SELECT python_line, how, intervals FROM step_lost_line WHERE cause = 'reclaim'"
    conn = sqlite3.connect(db)
    assert conn.execute(sql).fetchall() == [("collate() at data.py:120", "own", 3)]
    # its own stack first, whatever a wait inside it says
    conn.execute("UPDATE reclaim_interval SET python_stack_id = (SELECT python_stack_id FROM step_mark LIMIT 1)")
    [(line, how, _)] = conn.execute(sql).fetchall()
    assert how == "own" and line != "collate() at data.py:120" and line, line
    conn.execute("UPDATE reclaim_interval SET python_stack_id = NULL")
    assert conn.execute(sql).fetchall() == [("collate() at data.py:120", "in_wait", 3)]
    conn.close()
