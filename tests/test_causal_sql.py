"""The causal SQL at scale: a complete session's causal links and step causes are stored at the stop
(causal_link_stored, step_cause_stored) and the causal_link and step_cause views read them, equal
to what the views compute from the recorded rows (causal_link_live, step_cause_live); a session not
stored (still recording) or whose rules changed is computed again. benchmarks/bench_causal_sql.py
measures the time on an hour of a job."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from conftest import q

from recorder.demo import write_scenario
from store.exports.datasette import QUERIES

LINK = "session_id, from_table, from_id, relation, to_table, to_id, dur"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("causal") / "nvme.db"
    write_scenario("nvme-timeout-checkpoint", path)
    return path


def _canned(db: Path, name: str) -> list:
    step = q(db, "SELECT step FROM stall")[0][0]
    return sorted(q(db, QUERIES[name]["sql"].replace(":step", str(step))), key=repr)


def _same(db: Path) -> int:
    links = sorted(q(db, f"SELECT {LINK} FROM causal_link"), key=repr)
    assert links == sorted(q(db, f"SELECT {LINK} FROM causal_link_live"), key=repr)
    causes = sorted(q(db, "SELECT * FROM step_cause"), key=repr)
    assert causes == sorted(q(db, "SELECT * FROM step_cause_live"), key=repr)
    return len(links)


def test_stored_at_the_stop_and_equal_to_the_live_views(db: Path) -> None:
    ((sid, stored),) = q(db, "SELECT session_id, links FROM causal_link_session")
    assert stored == q(db, "SELECT count(*) FROM causal_link_stored")[0][0] == _same(db) > 0
    relations = {r for (r,) in q(db, "SELECT DISTINCT relation FROM causal_link_stored")}
    assert {"off_cpu", "io", "hit_by"} <= relations
    assert q(db, "SELECT count(*) FROM step_cause_stored")[0][0] > 0
    # a step's links come from the stored table's index; the live views are not computed
    plan = " | ".join(r[3] for r in q(db, "EXPLAIN QUERY PLAN SELECT * FROM causal_link WHERE"
                                          " from_table = 'step_mark' AND from_id = 1"))
    assert "causal_link_stored USING INDEX causal_link_stored_from" in plan
    assert {h[0] for h in _canned(db, "step_causal_links")} == {1, 2}


def test_live_and_changed_rules_are_computed_again(db: Path, tmp_path: Path) -> None:
    copy = tmp_path / "live.db"
    copy.write_bytes(db.read_bytes())
    before = _same(copy)
    canned = {name: _canned(copy, name) for name in ("step_causal_links", "step_breakdown")}
    conn = sqlite3.connect(copy)
    assert conn.execute("SELECT count(*) FROM causal_link WHERE relation = 'slow_call'").fetchone()[0] == 0
    conn.execute("UPDATE slow_call_rule SET ratio = 1.01, min_excess_dur = 0")  # the stored links no longer hold
    conn.commit()
    assert conn.execute("SELECT count(*) FROM causal_link_session").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM causal_link_stored").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM causal_link WHERE relation = 'slow_call'").fetchone()[0] > 0
    conn.execute("UPDATE slow_call_rule SET ratio = 2, min_excess_dur = 200000")
    conn.commit()
    conn.close()
    assert _same(copy) == before  # computed from the rows, as while recording
    assert {name: _canned(copy, name) for name in canned} == canned
