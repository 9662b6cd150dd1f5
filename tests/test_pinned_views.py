"""The main views' rows on every demo scenario, pinned: tests/pinned/<scenario>/<view>.csv.

Where tests/test_explain_golden.py pins what the report says, this pins what the causal model
computes underneath it (step_baseline, step_cause, causal_link, wait_chain), so a change to a view's
SQL shows as a row-level diff even when the report's wording does not move. The demo scenarios
(recorder/demo.py) are synthetic and deterministic; none has a wait chain, so the chain written by
tests/test_wait_chain.py is pinned too, as 'wait-chain'.

What is left out or normalised, so that the files depend only on what the scenario writes:
session_id (always the one session of a fresh database), and every timestamp (`ts`, `*_ts`), which
is written relative to the session's start. Row ids are kept: each scenario is written alone into a
fresh database in one fixed order, so they are the same on every run, and they tie the views' rows
together (step_mark_id, offcpu_id ...). Rows are sorted on every column; NULL is written as NULL.

After an intended change (to a view, or to what a scenario writes), rewrite the files with

    STALL_RECORDER_UPDATE_PINNED=1 .venv/bin/python -m pytest -q tests/test_pinned_views.py

and review `git diff tests/pinned` before committing it.
"""

from __future__ import annotations

import csv
import difflib
import io
import os
import sqlite3
from pathlib import Path

import pytest
from test_wait_chain import _session as write_wait_chain

from recorder.demo import SCENARIOS, write_scenario

PINNED = Path(__file__).resolve().parent / "pinned"
UPDATE = os.environ.get("STALL_RECORDER_UPDATE_PINNED") == "1"
VIEWS = ("step_baseline", "step_cause", "causal_link", "wait_chain")
DROPPED = {"session_id"}
MAX_DIFF_LINES = 80


@pytest.fixture(scope="module", params=[*sorted(SCENARIOS), "wait-chain"])
def scenario(request, tmp_path_factory) -> tuple[str, Path]:
    """One fresh database per scenario, shared by the four views' tests."""
    name = request.param
    db = tmp_path_factory.mktemp("pinned") / f"{name}.db"
    if name == "wait-chain":
        write_wait_chain(db)
    else:
        write_scenario(name, db)
    return name, db


def view_csv(db: Path, view: str) -> str:
    """The view's rows as CSV, normalised as the module docstring says."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (started,) = conn.execute("SELECT started_ts FROM session").fetchone()
        names = [d[0] for d in conn.execute(f"SELECT * FROM {view} LIMIT 0").description]
        kept = [n for n in names if n not in DROPPED]
        columns = ", ".join(f'"{n}" - {started} AS "{n}"' if n == "ts" or n.endswith("_ts") else f'"{n}"'
                            for n in kept)
        order = ", ".join(str(i + 1) for i in range(len(kept)))
        rows = conn.execute(f"SELECT {columns} FROM {view} ORDER BY {order}").fetchall()
    finally:
        conn.close()
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(kept)
    writer.writerows(["NULL" if v is None else v for v in row] for row in rows)
    return out.getvalue()


def _diff(pinned: str, now: str, path: Path) -> str:
    lines = list(difflib.unified_diff(pinned.splitlines(), now.splitlines(), f"{path} (pinned)", "now",
                                      lineterm="", n=1))
    shown = "\n".join(lines[:MAX_DIFF_LINES])
    more = f"\n... {len(lines) - MAX_DIFF_LINES} more diff lines" if len(lines) > MAX_DIFF_LINES else ""
    return (f"{path.relative_to(PINNED.parent.parent)} changed; if intended, rewrite with "
            f"STALL_RECORDER_UPDATE_PINNED=1 (see tests/test_pinned_views.py) and review the diff:\n{shown}{more}")


@pytest.mark.parametrize("view", VIEWS)
def test_view_is_pinned(scenario: tuple[str, Path], view: str) -> None:
    name, db = scenario
    path = PINNED / name / f"{view}.csv"
    now = view_csv(db, view)
    if UPDATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(now)
        if not UPDATE:
            pytest.fail(f"{path} did not exist and was written: review it and commit it")
        return
    pinned = path.read_text()
    if now != pinned:
        pytest.fail(_diff(pinned, now, path), pytrace=False)


def test_the_pins_cover_the_stalls_and_the_chain() -> None:
    """The pinned files hold what each scenario is about: the stalled step is slow in step_baseline
    and has causes in step_cause, and the chain's hops are in wait_chain and causal_link."""
    for name, scenario in SCENARIOS.items():
        baseline = list(csv.DictReader((PINNED / name / "step_baseline.csv").open()))
        slow = {int(r["step"]) for r in baseline if r["slow"] == "1"}
        assert slow == ({scenario.step} if scenario.step else set()), name
        if scenario.step:
            marks = {r["step_mark_id"] for r in baseline if r["slow"] == "1"}
            causes = list(csv.DictReader((PINNED / name / "step_cause.csv").open()))
            assert any(r["step_mark_id"] in marks and int(r["dur"]) > 0 for r in causes), name
    chain = list(csv.DictReader((PINNED / "wait-chain" / "wait_chain.csv").open()))
    assert sorted({int(r["depth"]) for r in chain}) == [0, 1, 2]
    links = list(csv.DictReader((PINNED / "wait-chain" / "causal_link.csv").open()))
    assert sum(r["relation"] == "woken_after" for r in links) >= 2
