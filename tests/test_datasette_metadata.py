"""recorder export --datasette-metadata: metadata.json built from the schema's comments, checked
against the database and Datasette's metadata format, and served by Datasette itself."""

from __future__ import annotations

import json
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import q, run_recorder

from recorder.demo import write_scenario

# Keys Datasette's metadata format (0.x) gives meaning to, at each level.
TOP_KEYS = {"title", "description", "description_html", "license", "license_url", "source", "source_url",
            "about", "about_url", "databases", "plugins", "extra_css_urls", "extra_js_urls"}
TABLE_KEYS = {"title", "description", "description_html", "columns", "units", "sort", "sort_desc", "hidden",
              "size", "sortable_columns", "label_column", "facets", "fts_table", "fts_pk", "searchmode"}
QUERY_KEYS = {"sql", "title", "description", "description_html", "hide_sql", "fragment", "write",
              "on_success_message", "on_success_redirect", "on_error_message", "on_error_redirect", "params"}
HAVE_DATASETTE = shutil.which("datasette", path=str(Path(sys.executable).parent)) is not None


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> tuple[Path, dict, dict]:
    folder = tmp_path_factory.mktemp("ds")
    db = folder / "stall.db"
    write_scenario("nvme-timeout-checkpoint", db)
    meta = folder / "metadata.json"
    r = run_recorder("export", "--db", str(db), "--datasette-metadata", str(meta), "--json", check=True)
    return db, json.loads(meta.read_text()), json.loads(r.stdout)[0]


def test_format_and_columns_match_the_database(recording):
    db, meta, summary = recording
    assert set(meta) <= TOP_KEYS and list(meta["databases"]) == ["stall"] == [summary["database"]]
    tables = meta["databases"]["stall"]["tables"]
    names = {n for n, in q(db, "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    assert set(tables) <= names and {"cuda_call", "offcpu_interval", "block_request", "stall", "causal_link",
                                     "step_cause", "block_latency"} <= set(tables)
    for name, entry in tables.items():
        assert set(entry) <= TABLE_KEYS, name
        assert entry["description"], f"{name} has no description"
        cols = {r[1] for r in q(db, f'PRAGMA table_info("{name}")')}
        assert set(entry.get("columns", {})) <= cols, name
        assert set(entry.get("units", {})) <= cols, name
    assert summary["tables"] == len(tables)
    assert summary["columns"] == sum(len(e.get("columns", {})) for e in tables.values())


def test_descriptions_and_units_come_from_the_schema(recording):
    _, meta, _ = recording
    t = meta["databases"]["stall"]["tables"]
    schema = (Path(__file__).parent.parent / "store" / "migrations" / "0001_core.sql").read_text()
    body = schema.split("CREATE TABLE cuda_call (", 1)[1].split(");", 1)[0]
    commented = {line.split()[0]: line.split("--", 1)[1].strip() for line in body.splitlines() if "--" in line}
    assert len(commented) > 10 and {c: t["cuda_call"]["columns"].get(c) for c in commented} == commented
    assert t["cuda_call"]["columns"]["dur"] == "ns entry -> return"
    # columns added by a later migration (ALTER TABLE ... ADD COLUMN) keep their comment
    assert t["block_request"]["columns"]["python_stack_id"].startswith("Python stack of the submitting thread")
    assert t["cuda_call"]["description"] == (
        "One CUDA runtime or driver API call, recorded at its entry with its duration.")
    assert t["cuda_call"]["units"]["dur"] == "ns" and t["cuda_call"]["units"]["size_bytes"] == "B"
    assert t["offcpu"]["columns"]["contender_run_dur"] == "ns that task ran meanwhile"
    assert "ts" not in t["cuda_call"]["units"] and "ts" not in t["offcpu"]["units"]  # times, not durations
    assert t["gpu_sample"]["units"] == {"mem_used_bytes": "B", "mem_total_bytes": "B",
                                        "sm_clock_mhz": "MHz", "power_mw": "mW", "temperature_c": "degC"}
    assert "relation" in t["causal_link"]["columns"] and t["causal_link"]["units"] == {"dur": "ns"}
    if HAVE_DATASETTE:  # units are read by the pint Datasette ships
        from datasette.views.base import ureg

        for entry in t.values():
            for unit in entry.get("units", {}).values():
                ureg(unit)


def test_canned_queries_answer_the_questions(recording):
    db, meta, _ = recording
    queries = meta["databases"]["stall"]["queries"]
    assert len(queries) >= 10
    (step,) = q(db, "SELECT step FROM stall")[0]
    conn = sqlite3.connect(db)
    try:
        for name, query in queries.items():
            assert set(query) <= QUERY_KEYS and query["title"], name
            conn.execute(query["sql"], {"step": step}).fetchall()  # every one runs on a real recording
        stalls = conn.execute(queries["stalls"]["sql"]).fetchall()
        breakdown = conn.execute(queries["step_breakdown"]["sql"], {"step": step}).fetchall()
        links = conn.execute(queries["step_causal_links"]["sql"], {"step": step}).fetchall()
    finally:
        conn.close()
    assert [r[1] for r in stalls] == [step]
    assert breakdown[0][2:4] == ("blocked", "io")
    assert {r[0] for r in links} == {1, 2}
    assert any(r[4] == "hit_by" and r[5] == "nvme_event" for r in links)  # request -> NVMe event, one hop on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


@pytest.mark.skipif(not HAVE_DATASETTE, reason="needs datasette in the venv (pip install -e '.[test]')")
def test_datasette_serves_it(recording, tmp_path):
    db, meta, _ = recording
    meta_file = db.parent / "metadata.json"
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "datasette"), str(db), "-m", str(meta_file),
                             "-h", "127.0.0.1", "-p", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                fetch(f"{base}/-/versions.json")
                break
            except OSError:
                time.sleep(0.2)
        assert json.loads(fetch(f"{base}/-/metadata.json"))["databases"]["stall"]["queries"].keys() == \
            meta["databases"]["stall"]["queries"].keys()
        stalls = json.loads(fetch(f"{base}/stall/stalls.json?_shape=array"))
        assert [(r["step"], r["step_mark_id"]) for r in stalls] == q(db, "SELECT step, step_mark_id FROM stall")
        step = stalls[0]["step"]
        rows = json.loads(fetch(f"{base}/stall/step_breakdown.json?step={step}&_shape=array"))
        assert [(r["cause"], r["detail"]) for r in rows] == q(
            db, "SELECT cause, detail FROM step_cause c JOIN step_mark s ON s.id = c.step_mark_id"
                " WHERE s.step = ? ORDER BY c.dur DESC", (step,))
        page = fetch(f"{base}/stall/cuda_call?_size=5").decode()
        assert "One CUDA runtime or driver API call" in page
        assert 'data-column-description="ns entry -&gt; return"' in page
        assert re.search(r'<td class="col-dur type-Quantity">[0-9.]+&nbsp;[µm]?s</td>', page)  # with its unit
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bad_input(recording, tmp_path):
    db, _, _ = recording
    r = run_recorder("export", "--db", str(db), "--datasette-metadata", str(tmp_path / "no" / "m.json"))
    assert r.returncode == 2 and "does not exist" in r.stderr
