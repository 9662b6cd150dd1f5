"""The typed report (store/models.py): every pinned report is a valid StallReport that dumps back
to the same JSON, the checked-in docs/report-schema.json is the model's schema, and that schema
accepts the reports and refuses what they never carry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from recorder.demo import write_scenario
from store.analysis.explain import analyse
from store.db import open_store
from store.models import CallReport, StallReport, StepReport, json_schema
from store.report.build import render_text

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "docs" / "report-schema.json"
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))


def test_the_documented_schema_is_the_models() -> None:
    """After a change to store/models.py, rewrite it with `python -m store.models > docs/report-schema.json`
    (or STALL_RECORDER_UPDATE_GOLDEN=1) and review the diff."""
    text = json.dumps(json_schema(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("STALL_RECORDER_UPDATE_GOLDEN") == "1":
        SCHEMA.write_text(text)
    assert SCHEMA.read_text() == text, "docs/report-schema.json is not StallReport.model_json_schema()"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_every_pinned_report_is_a_stall_report(path: Path) -> None:
    report = json.loads(path.read_text())
    model = StallReport.model_validate(report)
    assert isinstance(model.root, StepReport if report["mode"] == "step" else CallReport)
    assert model.to_json() == report
    assert json.dumps(model.to_json(), indent=1, sort_keys=True) + "\n" == path.read_text()
    assert render_text(model) == render_text(report) == path.with_suffix(".txt").read_text().rstrip("\n")


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_the_schema_accepts_every_pinned_report(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(path.read_text()), json.loads(SCHEMA.read_text()))


def test_the_model_and_the_schema_refuse_what_a_report_never_carries() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    report = json.loads((ROOT / "tests" / "golden" / "nvme-timeout-checkpoint.json").read_text())
    bad = [
        {**report, "mode": "minute"},                                              # no such report
        {**report, "stall": "maybe"},                                              # not a bool
        {**report, "primary_cause": {**report["primary_cause"], "controler": "nvme0"}},  # a misspelt fact
        {k: v for k, v in report.items() if k != "symptom"},                       # a required field
        {**report, "step": {**report["step"], "dur_ns": "3844 ms"}},               # ns are integers
    ]
    for r in bad:
        with pytest.raises(ValidationError):
            StallReport.model_validate(r)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(r, schema)


def test_the_analysis_builds_the_model_a_call_report_too(tmp_path: Path) -> None:
    """A session without steps gets a CallReport; explain()'s JSON is its dump."""
    db = tmp_path / "calls.db"
    sid = write_scenario("cpu-contention", db)
    import sqlite3

    with sqlite3.connect(db) as conn:  # the same recording without its step markers
        conn.execute("DELETE FROM step_mark")
        conn.execute("UPDATE cuda_call SET dur = 3 * dur + 300000 WHERE id = (SELECT max(id) FROM cuda_call)")
    with open_store(db, readonly=True) as store:
        model = analyse(store, sid)
    assert isinstance(model.root, CallReport)
    assert model.root.stall is True and model.root.findings[0].kind == "slow_cuda_call"
    cause = model.root.primary_cause
    assert cause is not None and cause.cuda_call_id == model.root.findings[0].cuda_call_id
    again = StallReport.model_validate(json.loads(json.dumps(model.to_json())))
    assert again == model
    assert render_text(model).startswith("Stall report\n") and "Primary cause: " in render_text(again)
