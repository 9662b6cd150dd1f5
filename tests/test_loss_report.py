"""The report on a recording with losses and with contenders of unknown process: the demo's
cpu-contention recording (a real SQLite file, store/migrations schema) with rows added the way the
recorder writes them."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import run_recorder

from recorder.demo import write_scenario
from store.analysis.losses import describe
from store.db import open_store
from store.report.build import analyse
from store.units import utc

NS = 1_000_000_000


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "cc.db"
    write_scenario("cpu-contention", path)
    return path


def _step(path: Path) -> tuple[int, int, int]:
    """(ts, end_ts, wall offset) of the stalled step the report explains."""
    report = analyse(open_store(path, readonly=True)).to_json()
    conn = sqlite3.connect(path)
    off = conn.execute("SELECT wall_offset_ns FROM session").fetchone()[0]
    conn.close()
    return report["window"]["start_ts"], report["window"]["end_ts"], off


def test_a_layer_that_lost_records_in_the_window_is_named_and_not_checked(recording: Path) -> None:
    start, end, off = _step(recording)
    second = start - start % NS
    conn = sqlite3.connect(recording)
    conn.executemany("INSERT INTO loss (session_id, ts, probe, dropped) VALUES (1, ?, ?, ?)", [
        (second, "block in-flight map full", 16000),
        (second + NS, "block in-flight map full", 680),
        (second - 3600 * NS, "mm ring buffer", 5),  # an hour before: not this window's
    ])
    conn.commit()
    conn.close()
    text = run_recorder("explain", "--db", str(recording), check=True).stdout
    first = utc(second + off)
    assert (f"Lost in this window: block I/O requests: 16,680 requests lost after {first} (in-flight map full)"
            in text), text
    clean = next(line for line in text.splitlines() if line.startswith("Checked and clean"))
    assert "no block I/O errors in the kernel log" in clean  # the kernel log was read; block requests were not all
    assert "no block I/O errors;" not in clean
    assert "no OOM kill" in clean and "no direct reclaim by the step's thread" in clean  # mm lost nothing here
    assert "block I/O requests (records lost in this window)" in text
    assert "memory pressure (reclaim, dirty throttling, OOM) (records" not in text
    assert "Data loss: 16685 events dropped" in text
    report = json.loads(run_recorder("explain", "--db", str(recording), "--json", check=True).stdout)
    assert report["loss"]["in_window"] == [{
        "layer": "block", "probe": "block in-flight map full", "what": "requests", "reason": "in-flight map full",
        "count": 16680, "first_utc": first, "last_utc": utc(second + 2 * NS + off),
        "text": f"block I/O requests: 16,680 requests lost after {first} (in-flight map full)"}]
    assert report["loss"]["dropped_events"] == 16685
    # MCP: the report is the same; the session's capabilities list every loss with its layer and time
    from test_mcp_tools import over_stdio

    stall, caps = over_stdio(recording, [("explain_stall", {}), ("capabilities", {})])
    assert stall["loss"]["in_window"] == report["loss"]["in_window"]
    by_probe = {x["probe"]: x for x in caps["dropped_by_probe"]}
    assert by_probe["block in-flight map full"] == {
        "probe": "block in-flight map full", "dropped": 16680, "layer": "block", "what": "requests",
        "reason": "in-flight map full", "first_utc": first, "last_utc": utc(second + 2 * NS + off)}
    assert by_probe["mm ring buffer"]["first_utc"] == utc(second - 3600 * NS + off)


def test_every_loss_name_the_recorder_writes_has_a_layer_and_a_reason() -> None:
    """Each layer declares its loss words with what they mean; those the store knew before read the
    same for a recording made before (no layer_vocabulary rows)."""
    from recorder.layers import LAYERS
    from store.analysis.losses import KNOWN

    declared = [loss for layer in LAYERS for loss in layer.losses]
    assert len({loss.probe for loss in declared}) == len(declared)
    for loss in declared:
        assert loss.layer and loss.what and loss.why and loss.why != loss.probe, loss
        if loss.probe in KNOWN:
            assert KNOWN[loss.probe] == (loss.layer, loss.what, loss.why), loss
        assert describe(loss.probe, {loss.probe: (loss.layer, loss.what, loss.why)}) == (loss.layer, loss.what,
                                                                                        loss.why)
    for name in ["ring record of unexpected size", "python stack ring buffer"]:
        layer, what, why = describe(name)
        assert layer in ("recorder", "python") and what and why and why != name, (name, layer, what, why)
    assert describe("bpf program tracepoint__sched__sched_waking skipped (sched)") == (
        "sched", "sched_waking runs", "the kernel skipped them: another BPF program was running on the CPU")


def test_the_capability_words_the_layers_declare_read_as_the_store_words_them(recording: Path) -> None:
    """Each layer declares the capability words reports list; a session writes them at its start. A
    recording with those rows reads exactly as one without them (made before, or a demo); a word the
    store does not know (a layer added since) is listed after the others, worded as declared, in the
    text and in the JSON it is rendered from."""
    from recorder.layers import LAYERS
    from recorder.session import vocabulary
    from store.db.session import KNOWN_LAYERS
    from store.report.build import render_text

    rows = vocabulary(LAYERS)
    words = [(word, what) for _, kind, word, what, _ in rows if kind == "capability"]
    assert sorted(words) == sorted(KNOWN_LAYERS.items())  # every word once, each meaning as before

    def report() -> tuple[str, dict]:
        with open_store(recording, readonly=True) as store:
            json_report = analyse(store).to_json()
        return render_text(json_report), json_report

    before = report()
    assert "Observed: scheduler (off-CPU intervals), CUDA runtime/driver calls, Python source lines" in before[0]
    conn = sqlite3.connect(recording)
    # in registry order, as the session writes them
    conn.executemany("INSERT INTO layer_vocabulary (session_id, layer, kind, word, what, why)"
                     " VALUES (1, ?, ?, ?, ?, ?)", rows)
    conn.commit()
    assert report() == before
    conn.execute("INSERT INTO layer_vocabulary VALUES (1, 'execve', 'capability', 'execve', 'execve calls', '')")
    conn.execute("INSERT INTO capability (session_id, layer, probe, target, status, detail, ts)"
                 " VALUES (1, 'execve', 'syscalls:sys_enter_execve', '', 'attached', '', 0)")
    conn.commit()
    conn.close()
    text, json_report = report()
    observed = next(line for line in text.splitlines() if line.startswith("Observed: "))
    assert observed.endswith(", execve calls") and observed.startswith(
        next(line for line in before[0].splitlines() if line.startswith("Observed: "))), observed
    assert json_report["observed_layers"][-1] == "execve" and json_report["layer_words"] == {"execve": "execve calls"}
    assert "layer_words" not in before[1]


def test_a_contender_of_unknown_process_is_not_given_another_tasks_pid(recording: Path) -> None:
    """The task that ran longest on the CPU (ffmpeg) is known by its thread only; the task that took
    the CPU at the switch is another process's. The contender keeps its own identity: no pid of the
    other task, and the report says its tid instead of '0 processes: pids None'."""
    conn = sqlite3.connect(recording)
    contender = conn.execute("SELECT DISTINCT contender_thread_id FROM offcpu_interval"
                             " WHERE contender_thread_id IS NOT NULL").fetchall()
    assert len(contender) == 1
    (cid,) = contender[0]
    tid = conn.execute("SELECT tid FROM thread WHERE id = ?", (cid,)).fetchone()[0]
    proc = conn.execute("INSERT INTO process (session_id, pid, name, first_ts) VALUES (1, 777, 'bash', 0)").lastrowid
    other = conn.execute("INSERT INTO thread (session_id, tid, process_id, name, first_ts, traced)"
                         " VALUES (1, 777, ?, 'bash', 0, 0)", (proc,)).lastrowid
    conn.execute("UPDATE thread SET process_id = NULL WHERE id = ?", (cid,))
    conn.execute("UPDATE offcpu_interval SET next_thread_id = ? WHERE contender_thread_id = ?", (other, cid))
    conn.commit()
    conn.close()
    text = run_recorder("explain", "--db", str(recording), check=True).stdout
    assert "0 processes" not in text and "pids None" not in text, text
    assert f"behind ffmpeg (tid {tid}; 240 ms)" in text, text
    assert "777" not in text and "None" not in text, text
    assert f"grep Tgid /proc/{tid}/status" in text


def test_a_process_whose_stacks_were_not_read_is_not_attached(recording: Path) -> None:
    """Every Python stack of one process could not be read: its 'cpython frames' row is 'failed'
    and says '0 of N stacks read' with the reason and why the reads failed; a process whose stacks were read keeps
    'attached' and says how many."""
    from recorder.core.stacks import CAPABILITY_PROBE, amend_stack_capabilities

    conn = sqlite3.connect(recording)
    # the events of pid 4100 that carry a stack: its CUDA and NCCL calls, off-CPU intervals, block requests
    n = sum(conn.execute(f"SELECT count(*) FROM {table} e JOIN thread t ON t.id = e.thread_id JOIN process p"
                         " ON p.id = t.process_id WHERE p.pid = 4100 AND e.python_stack_id IS NOT NULL").fetchone()[0]
            for table in ("cuda_call", "nccl_call", "offcpu_interval", "block_request"))
    # a second process with the same kind of calls, whose stacks all failed to read
    proc = conn.execute("INSERT INTO process (session_id, pid, name, first_ts) VALUES (1, 4200, 'python3', 0)"
                        ).lastrowid
    thread = conn.execute("INSERT INTO thread (session_id, tid, process_id, name, first_ts) VALUES (1, 4200, ?,"
                          " 'python3', 0)", (proc,)).lastrowid
    bad = conn.execute("INSERT INTO python_stack (session_id, hash, depth, status, failure) VALUES (1, 'x', 0,"
                       " 'read error', 'frame page swapped out')").lastrowid
    cols = [c[1] for c in conn.execute("PRAGMA table_info(cuda_call)") if c[1] not in ("id", "thread_id",
                                                                                      "python_stack_id")]
    conn.execute(f"INSERT INTO cuda_call ({', '.join(cols)}, thread_id, python_stack_id) SELECT {', '.join(cols)},"
                 " ?, ? FROM cuda_call WHERE python_stack_id IS NOT NULL LIMIT 400", (thread, bad))
    for pid in (4100, 4200):
        conn.execute("INSERT INTO capability (session_id, layer, probe, target, status, detail, ts)"
                     " VALUES (1, 'python', ?, ?, 'attached', 'CPython 3.12 (libpython3.12.so)', 0)",
                     (CAPABILITY_PROBE, f"pid {pid}"))
    assert amend_stack_capabilities(conn, 1) == 2
    rows = dict(((t, (s, d)) for t, s, d in conn.execute(
        "SELECT target, status, detail FROM capability WHERE probe = ?", (CAPABILITY_PROBE,))))
    conn.close()
    assert rows["pid 4200"] == ("failed", "walker attached, 0 of 400 stacks read (read error: 400 "
                                          "(frame page swapped out: 400)); "
                                          "CPython 3.12 (libpython3.12.so)")
    assert rows["pid 4100"] == ("attached", f"CPython 3.12 (libpython3.12.so); {n:,} of {n:,} stacks read")
