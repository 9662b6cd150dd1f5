"""The fleet: the causal model's answers in `recorder export --parquet`, `recorder cluster explain`
over the exports alone (the same text as over the recordings), the documented DuckDB queries, and
shipping to an S3-compatible store: a real server (moto's, started here on 127.0.0.1), never a mock
of the client, including the spool while it is down. One cluster demo (4 nodes x 8 ranks, rank 17
on node-02 late in step 80042 on an NVMe timeout) and one export serve every test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from conftest import ROOT, free_port, run_recorder

from recorder.cluster_demo import ClusterSpec, write_cluster
from store.cluster import explain_paths, render_explain
from store.exports.parquet import export_parquet, ship_incident
from store.models import StallReport

LATE, STEP, LINE = 17, 80_042, "save_checkpoint() at train.py:212"
NODES = ("node-00", "node-01", "node-02", "node-03")


def one(sql: str) -> tuple:
    (row,) = duckdb.sql(sql).fetchall()
    return row


def pq(folder: Path, table: str) -> str:
    return f"read_parquet('{folder}/{table}/*/*/*.parquet', hive_partitioning = true)"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The demo's recordings (job/), and their export (parquet/) made from copies that are then
    deleted, so that only the export's own answers can explain the late rank."""
    root = tmp_path_factory.mktemp("fleet")
    job, src, out = root / "job", root / "src", root / "parquet"
    write_cluster(job, ClusterSpec())
    shutil.copytree(job, src)
    for node in NODES:
        export_parquet(src / f"{node}.db", out)
    shutil.rmtree(src)
    return {"root": root, "job": job, "src": src, "parquet": out}


def test_the_export_holds_the_answers_with_a_schema_version(fleet):
    out = fleet["parquet"]
    assert (out / "stall" / "node=node-02" / "session=1" / "part-0.parquet").is_file()
    meta = duckdb.sql(f"SELECT node, schema_version, stalls, stalls_explained, reports, reports_cap "
                      f"FROM {pq(out, 'export_meta')} ORDER BY node").fetchall()
    assert meta == [(n, 2, 8, 8, 1, 16) for n in NODES]
    row = one(f"SELECT rank, pid, cause_kind, python, device, lineage_label, summary, kernel_path, "
                     f"explanation FROM {pq(out, 'stall')} WHERE node = 'node-02' AND step = {STEP} "
                     f"AND rank = {LATE}")
    assert row[:6] == (LATE, 4110, "nvme_timeout", LINE, "nvme0n1", f"checkpoint_write/run42/step{STEP}/rank{LATE}")
    assert "controller reset" in row[6] and "NVMe timeout" in row[7]
    assert json.loads(row[8])["python"] == LINE
    # the victims on node-02 name the rank they waited for
    waits = duckdb.sql(f"SELECT DISTINCT cause_kind, straggler_rank FROM {pq(out, 'stall')} "
                       f"WHERE node = 'node-02' AND rank != {LATE}").fetchall()
    assert waits == [("nccl_straggler", LATE)]
    (report,) = one(f"SELECT report FROM {pq(out, 'stall_report')} WHERE node = 'node-02'")
    model = StallReport.model_validate_json(report).root
    assert model.step.step == STEP and model.straggler.rank == LATE and model.straggler.python == LINE
    counts = {t: one(f"SELECT count(*) FROM {pq(out, t)} WHERE node = 'node-02'")[0]
              for t in ("step_cause", "causal_link", "wait_chain", "hang")}
    assert counts["step_cause"] > 0 and counts["causal_link"] > 0 and counts["hang"] == 0, counts


def test_cluster_explain_over_the_parquet_alone_says_what_the_recordings_say(fleet):
    over_parquet = run_recorder("cluster", "explain", str(fleet["parquet"]), check=True).stdout
    over_sqlite = run_recorder("cluster", "explain", str(fleet["job"]), check=True).stdout
    # the database named is each node's own recording, where it was when exported
    assert over_parquet.replace(str(fleet["src"]), str(fleet["job"])) == over_sqlite
    assert f"Late: rank {LATE} on node-02" in over_parquet and f"Python: {LINE}" in over_parquet
    assert "is not here" not in over_parquet


def test_cluster_explain_over_recordings_and_exports_mixed(fleet, tmp_path):
    part = tmp_path / "parquet"
    src = tmp_path / "src"
    src.mkdir()
    for node in ("node-02", "node-03"):  # the late rank's node known by its export only
        shutil.copy(fleet["job"] / f"{node}.db", src)
        export_parquet(src / f"{node}.db", part)
    shutil.rmtree(src)
    mixed = explain_paths([fleet["job"] / "node-00.db", fleet["job"] / "node-01.db", part])
    (late,) = mixed["late_ranks"]
    assert (late["rank"], late["node"]) == (LATE, "node-02")
    why = late["explanation"]
    assert why["available"] and why["kind"] == "nvme_timeout" and why["python"] == LINE
    assert "Why: NVMe timeout on nvme0n1" in render_explain(mixed)


def docs_queries() -> dict[str, str]:
    text = (ROOT / "docs" / "cluster.md").read_text()
    blocks = re.findall(r"```sql\n(-- query: ([^\n]+)\n.*?)```", text, re.S)
    return {name: sql for sql, name in blocks}


def test_the_documented_duckdb_queries_answer_the_operators_questions(fleet):
    queries = docs_queries()
    assert set(queries) == {"late ranks of a step", "top causes this week by node",
                            "p999 of checkpoint writes by device"}

    def run(name: str) -> list[tuple]:
        # the demo's job ran on 2026-04-28: "this week" is the week after it
        sql = queries[name].replace("DIR", str(fleet["parquet"])).replace(
            "now()", "TIMESTAMPTZ '2026-04-30 00:00:00+00'")
        return duckdb.sql(sql).fetchall()

    late = run("late ranks of a step")
    assert [r[:2] for r in late] == [("node-02", LATE)]
    assert late[0][3] > 3_400 and late[0][4] == "nvme_timeout" and late[0][6] == LINE
    top = run("top causes this week by node")
    assert ("node-02", "nvme_timeout", 1) in [r[:3] for r in top]
    assert all(r[1] not in ("nccl_straggler", "nccl_wait") for r in top)
    (p999,) = run("p999 of checkpoint writes by device")
    assert p999[:3] == ("node-02", "nvme0n1", 4) and p999[3] >= 3_400


def test_a_local_export_and_cluster_explain_never_make_an_s3_client(fleet, tmp_path):
    # any S3 client made in the process (pyarrow's only way to the store) fails the run
    code = ("import pyarrow.fs as f\n"
            "def refuse(*a, **k): raise SystemExit('an S3 client was made')\n"
            "f.S3FileSystem = refuse\n"
            "from store.exports.parquet import export_parquet; from store.cluster import explain_paths\n"
            f"export_parquet({str(fleet['job'] / 'node-02.db')!r}, {str(tmp_path / 'out')!r})\n"
            f"print(explain_paths([{str(tmp_path / 'out')!r}])['verdict'])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "late", res.stderr


# -- the object store -----------------------------------------------------------------------------
def test_cluster_explain_over_the_parquet_of_4_nodes_in_s3_names_the_late_rank_and_why(fleet, s3, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fleet["job"], src)
    res = run_recorder("export", "--parquet", "s3://fleet/run42", "--db", str(src / "node-00.db"), check=True)
    assert "into s3://fleet/run42" in res.stdout and "export schema 2" in res.stdout
    for node in NODES[1:]:
        assert export_parquet(src / f"{node}.db", "s3://fleet/run42")["shipped"]["pending"] == 0
    assert not any(p.name.endswith(".spool") for p in src.iterdir())  # drained, and gone once empty
    shutil.rmtree(src)  # only the objects in the store are left
    report = json.loads(run_recorder("cluster", "explain", "s3://fleet/run42", "--json", check=True).stdout)
    assert report["verdict"] == "late" and report["step"] == STEP
    (late,) = report["late_ranks"]
    assert (late["rank"], late["node"]) == (LATE, "node-02")
    why = late["explanation"]
    assert why["kind"] == "nvme_timeout" and why["device"] == "nvme0n1" and why["python"] == LINE, why
    assert "controller reset" in why["summary"]


def test_while_the_store_is_down_the_export_waits_in_the_spool_and_goes_with_the_next(fleet, s3, tmp_path):
    db = tmp_path / "node-03.db"
    shutil.copy(fleet["job"] / "node-03.db", db)
    down = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    res = run_recorder("export", "--parquet", "s3://fleet/spooled", "--db", str(db), env=down)
    assert res.returncode == 1 and "the store did not take it" in res.stderr and len(res.stderr.splitlines()) == 1
    spool = tmp_path / "node-03.db.spool"
    assert len([p for p in spool.iterdir() if (p / "manifest.json").is_file()]) == 1
    assert s3["fs"].get_file_info("fleet/spooled").type.name == "NotFound"
    # the store is back: an export elsewhere sends only its own, the spooled one waits for its destination
    result = export_parquet(db, "s3://fleet/other")
    assert result["shipped"] == {"uploaded": ["s3://fleet/other"], "pending": 0, "error": None, "quarantined": [],
                                 "waiting": 1}
    assert s3["fs"].get_file_info("fleet/spooled").type.name == "NotFound"
    result = export_parquet(db, "s3://fleet/spooled")  # the next export there: the spooled one, then this one
    assert result["shipped"] == {"uploaded": ["s3://fleet/spooled", "s3://fleet/spooled"], "pending": 0,
                                 "error": None, "quarantined": [], "waiting": 0}
    assert not spool.exists()
    for prefix in ("spooled", "other"):
        info = s3["fs"].get_file_info(f"fleet/{prefix}/stall/node=node-03/session=1/part-0.parquet")
        assert info.type.name == "File" and info.size > 0


def test_an_incident_is_shipped_as_its_recording_and_its_export(fleet, s3, tmp_path):
    incident = tmp_path / "flight.db.incidents" / "20260428T202730.123Z-stall.db"
    incident.parent.mkdir()
    shutil.copy(fleet["job"] / "node-02.db", incident)
    result = ship_incident(incident, "s3://fleet/flight", "node-02", tmp_path / "flight.db.spool")
    assert result["pending"] == 0, result
    base = "fleet/flight/incidents/node-02/20260428T202730.123Z-stall"
    assert s3["fs"].get_file_info(base + ".db").size == incident.stat().st_size
    report = explain_paths(["s3://fleet/flight/incidents/node-02/20260428T202730.123Z-stall"])
    (late,) = report["late_ranks"]
    assert late["rank"] == LATE and late["explanation"]["python"] == LINE


@pytest.mark.parametrize(("args", "message"), [
    (("export", "--parquet", "gs://bucket/x"), "only s3:// URLs"),
    (("start", "--all", "--ship", "s3://bucket/x"), "--ship uploads the incidents of a flight recording"),
    (("start", "--all", "--keep", "10m", "--ship", "http://host/x"), "only s3:// URLs"),
])
def test_bad_store_urls_are_one_line(fleet, args, message):
    res = run_recorder(*args, "--db", str(fleet["job"] / "node-00.db"))
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_database_with_several_sessions_exports_each_with_its_answers(tmp_path):
    from recorder.demo import SCENARIOS, write_scenario
    from store.exports.parquet import export_parquet

    db = tmp_path / "two.db"
    names = sorted(SCENARIOS)[:2]
    sids = [write_scenario(name, db) for name in names]
    export_parquet(db, tmp_path / "out")
    for sid in sids:
        assert list((tmp_path / "out" / "export_meta").glob(f"*/session={sid}/*.parquet")), sid
        assert list((tmp_path / "out" / "step_cause").glob(f"*/session={sid}/*.parquet")), sid


def test_a_spool_entry_left_half_filled_by_a_dead_process_is_cleared_but_one_being_filled_is_kept(tmp_path):
    from store import objectstore

    spool = tmp_path / "x.db.spool"
    dead = objectstore.new_entry(spool, "dead")
    live = objectstore.new_entry(spool, "live")
    (dead / "part-0.parquet").write_bytes(b"half")
    old = time.time() - objectstore.ABANDONED_S - 60
    os.utime(dead.parent, (old, old))
    assert objectstore.drain(spool, "s3://fleet/x") == {"uploaded": [], "pending": 0, "error": None,
                                                        "quarantined": [], "waiting": 0}
    assert not dead.parent.exists() and live.is_dir()
