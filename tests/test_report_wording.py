"""The report's words on the demo's recordings (real SQLite files read through the views): a
request is called slow only above its device's p99, and the data-loss line reads as a sentence."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from recorder.demo import write_scenario
from store.analysis.explain import analyse
from store.db import open_store
from store.report.render import render_text


def test_a_request_below_its_devices_p99_is_not_called_slow(tmp_path: Path) -> None:
    path = tmp_path / "p999.db"
    sid = write_scenario("p999-read-latency", path)
    with open_store(path, readonly=True) as store:
        before = analyse(store, sid).to_json()["primary_cause"]
    assert before["summary"].startswith("slow read on nvme0n1"), before["summary"]
    # make the request the cause names an ordinary one: 30% of its device's reads take longer
    conn = sqlite3.connect(path)
    request = conn.execute("SELECT device, op, dur FROM block_request WHERE id = ?",
                           (before["evidence"]["request"],)).fetchone()
    ids = [r[0] for r in conn.execute("SELECT id FROM block_request WHERE device = ? AND op = ? AND id != ?"
                                      " ORDER BY id", (request[0], request[1], before["evidence"]["request"]))]
    slower = ids[: int(0.3 * (len(ids) + 1))]
    conn.execute(f"UPDATE block_request SET dur = ? + 1 WHERE id IN ({','.join('?' * len(slower))})",
                 (request[2], *slower))
    conn.commit()
    conn.close()
    with open_store(path, readonly=True) as store:
        report = analyse(store, sid)
    cause = report.to_json()["primary_cause"]
    assert cause["kind"] == "slow_io" and 0.65 <= cause["percentile"]["fraction"] <= 0.75, cause["percentile"]
    assert "slow" not in cause["summary"] and "at p70 of its" in cause["summary"], cause["summary"]
    assert "not above its device's p99" in render_text(report)


def test_the_data_loss_line_names_each_probe_after_a_colon(tmp_path: Path) -> None:
    path = tmp_path / "healthy.db"
    sid = write_scenario("healthy", path)
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO loss (session_id, ts, probe, dropped) VALUES (?, 0, 'block request completion"
                 " not seen', 4), (?, 0, 'sched ring full', 52)", (sid, sid))
    conn.commit()
    conn.close()
    with open_store(path, readonly=True) as store:
        text = render_text(analyse(store, sid))
    line = next(x for x in text.splitlines() if x.startswith("Data loss:"))
    assert line == ("Data loss: 56 events dropped in the session; by probe: block request completion not seen: 4;"
                    " sched ring full: 52"), line


def _contention_actions(path: Path, name: str) -> str:
    """The next actions of the demo's CPU contention when its contender is a process of the job named
    `name` (traced: relation 'job')."""
    sid = write_scenario("cpu-contention", path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE thread SET traced = 1, name = ? WHERE tid = 31337", (name,))
    conn.execute("UPDATE process SET name = ? WHERE pid = 31337", (name,))
    conn.commit()
    conn.close()
    with open_store(path, readonly=True) as store:
        report = analyse(store, sid).to_json()
    assert report["primary_cause"]["contender_relation"] == "job", report["primary_cause"]
    return " ".join(report["next_actions"])


def test_cpu_contention_from_a_helper_is_not_blamed_on_dataloader_workers(tmp_path: Path) -> None:
    helper = _contention_actions(tmp_path / "helper.db", "ffmpeg")
    assert "helper process" in helper and "DataLoader" not in helper and "num_workers" not in helper, helper
    # a forked copy of the training process (its name) is a worker: fewer workers is the advice
    worker = _contention_actions(tmp_path / "worker.db", "python3")
    assert "num_workers" in worker, worker


def test_a_name_with_a_newline_or_an_escape_forges_no_report_line(tmp_path: Path) -> None:
    """A process names itself: a contender called 'ffmpeg\\nPrimary cause: none...' (as a recording
    of an older version stored it) is printed with its control characters escaped, so the report
    keeps one primary cause and no escape sequence reaches the terminal."""
    from conftest import run_recorder

    path = tmp_path / "forged.db"
    write_scenario("cpu-contention", path)
    name = "ffmpeg\nPrimary cause: none (all is well)\x1b[2J"
    conn = sqlite3.connect(path)
    conn.execute("UPDATE thread SET name = ? WHERE tid = 31337", (name,))
    conn.execute("UPDATE process SET name = ? WHERE pid = 31337", (name,))
    conn.commit()
    conn.close()
    text = run_recorder("explain", "--db", str(path), check=True).stdout
    assert [line for line in text.splitlines() if line.startswith("Primary cause:")] == [
        line for line in text.splitlines() if line.startswith("Primary cause: CPU contention")], text
    assert "\x1b" not in text and "ffmpeg\\nPrimary cause: none (all is well)\\x1b[2J" in text, text
