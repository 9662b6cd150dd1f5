"""The three exports of a real recording: a stand-in training loop with step markers and one slow
step, recorded with real BPF (uprobes on the stand-in CUDA runtime, sched_switch, block), then
exported to Perfetto, HTML and Datasette metadata and checked against the database."""

from __future__ import annotations

import json
import sqlite3
import sys

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder
from test_datasette_metadata import QUERY_KEYS
from test_export_perfetto import read_trace, thread_track
from test_html_report import external_refs

pytestmark = [needs_bpf, pytest.mark.bpf]


@pytest.fixture(scope="module")
def recording(tmp_path_factory, native):
    folder = tmp_path_factory.mktemp("real")
    db = folder / "real.db"
    r = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]), "--",
                     sys.executable, str(ROOT / "tests" / "workloads" / "train_steps.py"), "--libdir",
                     str(native["dir"]), "--steps", "60", "--markers", "--slow-step", "40", "--slow-ms", "300",
                     timeout=300)
    assert r.returncode == 0, r.stderr
    return db


def test_perfetto_of_a_real_recording(recording, tmp_path):
    db = recording
    out = tmp_path / "real.pftrace"
    r = run_recorder("export", "--db", str(db), "--perfetto", str(out), "--json", check=True)
    summary = json.loads(r.stdout)[0]
    t = read_trace(out)
    calls = q(db, "SELECT c.id, c.ts, c.dur, t.tid FROM cuda_call c JOIN thread t ON t.id = c.thread_id")
    assert len(calls) > 100
    for rid, ts, dur, tid in calls:
        s = t["by_row"][f"cuda_call {rid}"]
        assert (s["ts"], s["dur"], s["track"]) == (ts, dur, thread_track(t, tid))
    steps = q(db, "SELECT step_mark_id, step FROM step_all")
    assert len(steps) == 60 and all(f"step_mark {i}" in t["by_row"] for i, _ in steps)
    stalled = {n for n, in q(db, "SELECT step FROM stall")}
    assert 40 in stalled
    assert {s["args"]["step"] for s in t["slices"] if s["name"].endswith("(stall)")} == stalled
    (links,) = q(db, "SELECT count(*) FROM causal_link")[0]
    assert links > 0 and summary["flows"] == len(t["flows"]) == links - summary["links_outside"]
    assert summary["links_outside"] == 0


def test_html_of_a_real_recording(recording, tmp_path):
    page = tmp_path / "real.html"
    r = run_recorder("report", "--db", str(recording), "--html", str(page), "--json", check=True)
    info = json.loads(r.stdout)
    text = page.read_text()
    assert info["stall"] and info["plots"]["steps"] and info["plots"]["timeline"] and info["plots"]["breakdown"]
    assert external_refs(text) == [] and "Timeline of step 40 " in text


def test_datasette_metadata_of_a_real_recording(recording, tmp_path):
    meta_file = tmp_path / "m.json"
    run_recorder("export", "--db", str(recording), "--datasette-metadata", str(meta_file), check=True)
    meta = json.loads(meta_file.read_text())
    db_meta = meta["databases"]["real"]
    assert {"cuda_call", "offcpu_interval", "stall", "causal_link"} <= set(db_meta["tables"])
    conn = sqlite3.connect(recording)
    try:
        for name, query in db_meta["queries"].items():
            assert set(query) <= QUERY_KEYS, name
            conn.execute(query["sql"], {"step": 40}).fetchall()
        stalls = conn.execute(db_meta["queries"]["stalls"]["sql"]).fetchall()
    finally:
        conn.close()
    assert 40 in [r[1] for r in stalls]
