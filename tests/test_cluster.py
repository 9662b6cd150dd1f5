"""`recorder cluster` on synthetic node recordings (recorder/cluster_demo.py): one SQLite file per
node, 8 ranks each, rank 17 on node-02 late in step 80042 because its checkpoint fsync waited
3.4 s on an NVMe timeout. The view must name that rank, its node and database, and the cause and
Python line from its own recording; realign a node whose wall clock is 5 s off; name a rank that
never entered the collective; refuse when the clocks cannot be aligned closely enough; read a
Parquet export the same way; and run with no network and no DuckDB extension."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import anyio
import duckdb
import pytest
from conftest import ROOT, damage_pages, run_recorder

from recorder.cluster_demo import ClusterSpec, write_cluster
from store.cluster import Cluster

LATE = 17
STEP = 80_042
LINE = "save_checkpoint() at train.py:212"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("job")
    write_cluster(folder, ClusterSpec())
    return folder


def explain_json(*args: str, code: int = 0) -> dict:
    res = run_recorder("cluster", "explain", *map(str, args), "--json")
    assert res.returncode == code, res.stderr
    return json.loads(res.stdout)


def assert_rank17(report: dict, db: str) -> None:
    assert report["step"] == STEP and report["stall"] is True
    assert report["verdict"] == "late"
    assert [(r["rank"], r["node"], r["db"]) for r in report["late_ranks"]] == [(LATE, "node-02", db)]
    late = report["late_ranks"][0]
    assert 3_400e6 <= late["lateness_ns"] <= 3_460e6  # 3.4 s fsync + 40 ms of writes, minus arrival jitter
    why = late["explanation"]
    assert why["kind"] == "nvme_timeout" and why["device"] == "nvme0n1", why
    assert why["python"] == LINE
    assert "controller reset" in why["summary"]
    assert report["hung_ranks"] == [] and report["unrecorded_ranks"] == []


def test_names_the_late_rank_its_node_database_cause_and_line(job):
    report = explain_json(job)  # a folder: every node-*.db in it; the worst step by default
    assert_rank17(report, str(job / "node-02.db"))
    c = report["collective"]
    assert (c["api"], c["nranks"], c["ranks_entered"]) == ("ncclAllReduce", 32, 32)
    clock = report["clock"]
    assert clock["residual_skew_ns"] < 200_000  # the ranks leave within 60 us by construction
    assert "synchronisation" in clock["anchor"]  # NCCL returns at once: the wait ends in the sync
    text = run_recorder("cluster", "explain", *sorted(str(p) for p in job.glob("*.db")), "--step", str(STEP),
                        check=True).stdout
    assert f"Late: rank {LATE} on node-02 ({job / 'node-02.db'}, session 1, pid 4110)" in text
    assert f"Python: {LINE}" in text and "NVMe timeout on nvme0n1" in text


def test_one_rank_per_node_uses_the_recordings_own_report(tmp_path):
    write_cluster(tmp_path, ClusterSpec(nodes=2, ranks_per_node=1, late_rank=1))
    report = explain_json(tmp_path / "node-00.db", tmp_path / "node-01.db")
    (late,) = report["late_ranks"]
    assert (late["rank"], late["node"]) == (1, "node-01")
    own = json.loads(run_recorder("explain", "--db", str(tmp_path / "node-01.db"), "--step", str(STEP), "--json",
                                  check=True).stdout)
    assert late["explanation"]["summary"] == own["primary_cause"]["summary"]
    assert late["explanation"]["python"] == own["primary_cause"]["python"] == LINE
    assert late["explanation"]["symptom"] == own["symptom"]


def test_a_node_whose_clock_is_5s_off_is_realigned_on_the_collectives(tmp_path):
    write_cluster(tmp_path, ClusterSpec(skew_ms={1: 5_000.0}))
    report = explain_json(tmp_path)
    assert_rank17(report, str(tmp_path / "node-02.db"))
    corr = {c["node"]: c["correction_ns"] for c in report["clock"]["corrections"]}
    assert abs(corr["node-01"] + 5_000e6) < 10e6, corr  # the shift undone, within the hosts' 2 ms errors
    assert all(abs(v) < 10e6 for n, v in corr.items() if n != "node-01"), corr
    # by the wall clocks alone, node-01's ranks would arrive 5 s late in every step
    raw = Cluster([tmp_path])
    raw.con.execute("UPDATE arrival SET e_ts = w_ts")
    first = raw.con.execute("SELECT min(w_ts) FROM arrival WHERE step = ?", (STEP,)).fetchone()[0]
    late_raw = raw.con.execute("SELECT rank FROM arrival WHERE step = ? AND w_ts - ? > 4e9 ORDER BY rank",
                               (STEP, first)).fetchall()
    assert [r for (r,) in late_raw] == list(range(8, 16))


def test_blocking_collectives_align_on_their_return(tmp_path):
    write_cluster(tmp_path, ClusterSpec(blocking_collectives=True, skew_ms={3: -800.0}))
    report = explain_json(tmp_path)
    assert_rank17(report, str(tmp_path / "node-02.db"))
    assert "return of each collective" in report["clock"]["anchor"]


def test_a_rank_that_never_entered_is_named_as_hung_with_its_own_cause(tmp_path):
    write_cluster(tmp_path, ClusterSpec(hang=True))
    report = explain_json(tmp_path)
    assert report["verdict"] == "hung" and report["step"] == STEP
    assert report["late_ranks"] == []  # the 31 others arrived within their usual spread
    (hung,) = report["hung_ranks"]
    assert (hung["rank"], hung["node"], hung["last_step"]) == (LATE, "node-02", STEP)
    assert hung["explanation"]["kind"] == "nvme_timeout" and hung["explanation"]["python"] == LINE
    assert report["collective"]["ranks_entered"] == 31
    text = run_recorder("cluster", "explain", str(tmp_path), check=True).stdout
    assert f"Hung: rank {LATE} on node-02" in text and "never entered the collective" in text


def test_refuses_to_name_a_rank_when_the_residual_skew_is_too_large(tmp_path):
    # ranks leave each collective up to 50 ms apart: a 46 ms late arrival cannot be told from skew
    write_cluster(tmp_path, ClusterSpec(exit_jitter_ms=50.0, stall_ms=0.5))
    report = explain_json(tmp_path, "--step", STEP, code=1)
    assert report["verdict"] == "clock_skew_too_large"
    assert report["late_ranks"] == []
    assert report["clock"]["residual_skew_ns"] > 20e6
    assert any("cannot say who was late" in n for n in report["notes"])
    # the same job with tight clocks names rank 17, 46 ms late (its 40 ms of checkpoint writes)
    tight = tmp_path / "tight"
    write_cluster(tight, ClusterSpec(stall_ms=0.5))
    report = explain_json(tight, "--step", STEP)
    assert [r["rank"] for r in report["late_ranks"]] == [LATE]
    assert 40e6 <= report["late_ranks"][0]["lateness_ns"] <= 50e6


def test_steps_lists_the_stall_and_its_late_rank(job):
    res = json.loads(run_recorder("cluster", "steps", str(job), "--json", check=True).stdout)
    assert res["count"] == 60 and res["stalls"] == 1
    (stall,) = [s for s in res["steps"] if s["slow"]]
    assert (stall["step"], stall["late_rank"], stall["late_node"], stall["ranks"]) == (STEP, LATE, "node-02", 32)
    assert stall["ratio"] > 5
    assert all(s["ranks_missing"] == 0 for s in res["steps"])
    text = run_recorder("cluster", "steps", str(job), "--slow", check=True).stdout
    assert f"rank {LATE} on node-02" in text and "1 steps, 1 stalled" in text


def test_parquet_export_is_partitioned_and_reads_back_the_same(job, tmp_path):
    out = tmp_path / "pq"
    for db in sorted(job.glob("*.db")):
        res = run_recorder("export", "--parquet", str(out), "--db", str(db), check=True)
        assert "exported" in res.stdout
    assert (out / "nccl_call" / "node=node-02" / "session=1" / "part-0.parquet").is_file()
    assert (out / "step_all" / "node=node-02" / "session=1" / "part-0.parquet").is_file()
    con = duckdb.connect()
    pq = lambda t: f"read_parquet('{out}/{t}/**/*.parquet', hive_partitioning = true)"  # noqa: E731
    counts = dict(con.execute(f"SELECT node, count(*) FROM {pq('nccl_call')} GROUP BY node").fetchall())
    import sqlite3
    for db in job.glob("*.db"):
        n = sqlite3.connect(db).execute("SELECT count(*) FROM nccl_call").fetchone()[0]
        assert counts[db.stem] == n == 8 * 60
    # same columns as the SQLite table, plus the partition columns; SQLite's types
    described = con.execute(f"DESCRIBE SELECT * FROM {pq('nccl_call')}").fetchall()
    cols = dict(row[:2] for row in described)
    sqlite_cols = [r[1] for r in sqlite3.connect(job / "node-00.db").execute("PRAGMA table_info(nccl_call)")]
    assert list(cols)[:len(sqlite_cols)] == sqlite_cols and {"node", "session"} <= set(cols)
    assert cols["ts"] == "BIGINT" and cols["session"] == "BIGINT"
    # a re-export of a node replaces its partition instead of doubling it
    run_recorder("export", "--parquet", str(out), "--db", str(job / "node-00.db"), check=True)
    assert con.execute(f"SELECT count(*) FROM {pq('step_mark')} WHERE node = 'node-00'").fetchone()[0] == 480
    report = explain_json(out)
    assert_rank17(report, str(job / "node-02.db"))  # explained from the SQLite file the export names


def test_runs_offline_without_any_duckdb_extension(job, tmp_path):
    """No network namespace, an empty HOME (no cached extensions): the view still answers."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to run without a network")
    env = {**os.environ, "HOME": str(tmp_path)}
    res = subprocess.run(["unshare", "-n", sys.executable, "-m", "recorder", "cluster", "explain", str(job), "--json"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["late_ranks"][0]["rank"] == LATE
    assert not (tmp_path / ".duckdb").exists()  # nothing installed
    c = Cluster([job])
    settings = dict(c.con.execute("SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access',"
                                  " 'autoinstall_known_extensions', 'autoload_known_extensions', 'lock_configuration')"
                                  ).fetchall())
    assert settings == {"enable_external_access": "false", "autoinstall_known_extensions": "false",
                        "autoload_known_extensions": "false", "lock_configuration": "true"}
    with pytest.raises(duckdb.Error, match="disabled by configuration"):  # no extension can be listed or loaded
        c.con.execute("SELECT extension_name FROM duckdb_extensions()").fetchall()
    c.close()


def test_bad_input_is_one_line_that_says_what_to_do(tmp_path, job):
    res = run_recorder("cluster", "explain", str(tmp_path / "missing.db"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no recording at" in res.stderr
    (tmp_path / "empty").mkdir()
    res = run_recorder("cluster", "explain", str(tmp_path / "empty"))
    assert res.returncode == 2 and "holds no *.db recording" in res.stderr
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    res = run_recorder("cluster", "explain", str(tmp_path / "junk.db"))
    assert res.returncode == 2 and "not a stall-recorder recording" in res.stderr, res.stderr
    res = run_recorder("cluster", "explain", str(job), "--step", "5")
    assert res.returncode == 2 and "no rank marked step 5" in res.stderr
    res = run_recorder("export", "--db", str(job / "node-00.db"))
    assert res.returncode == 2 and "--parquet DIR" in res.stderr


def test_mcp_cluster_explain_is_the_cli_json(job, monkeypatch):
    from mcp import Client

    from mcp_server import untrusted
    from mcp_server.server import build_server

    monkeypatch.setenv("STALL_RECORDER_CLUSTER", str(job))

    async def go():
        async with Client(build_server(job / "node-00.db"), raise_exceptions=True) as c:
            names = {t.name for t in (await c.list_tools()).tools}
            r = await c.call_tool("cluster_explain", {"step": STEP})
            return names, r
    names, r = anyio.run(go)
    assert "cluster_explain" in names and not r.is_error
    got = untrusted.unmark(r.structured_content)
    assert got == explain_json(job, "--step", STEP)
    assert r.structured_content["late_ranks"][0]["node"] == {"untrusted_text": "node-02"}


def test_materialised_nccl_views_give_the_report_the_same_rows(tmp_path):
    """A node's recording with 8 ranks and 1,040 collectives: the late rank's explanation reads the
    NCCL views from indexed temporary tables; every analysis must equal the one over the views."""
    from store.analysis.causes import lookup_steps
    from store.cluster import _materialise_nccl
    from store.db import open_store
    from store.report.build import analyse_step, session_row

    (db,) = write_cluster(tmp_path, ClusterSpec(nodes=1, steps=130, late_rank=3, stall_step=80_100))
    results = []
    for materialise in (False, True):
        with open_store(db, readonly=True) as store:
            if materialise:
                _materialise_nccl(store)
                kinds = dict(store.conn.execute("SELECT name, type FROM sqlite_temp_master WHERE name IN"
                                                " ('nccl_collective', 'nccl_straggler', 'nccl_collective_wait')"))
                assert set(kinds.values()) == {"table"}, kinds
            session = session_row(store, 1)
            rows = lookup_steps(store, 1, 80_100) + lookup_steps(store, 1, 80_050)
            results.append([analyse_step(store, session, r) for r in rows])
    assert results[0] == results[1]
    causes = {a["primary_cause"]["kind"] for a in results[0] if a["primary_cause"]}
    assert {"nvme_timeout", "nccl_straggler"} <= causes  # the late rank, and the ranks that waited for it


def test_nodes_without_a_recording_are_listed_and_the_late_rank_still_named(job):
    report = explain_json(job / "node-00.db", job / "node-02.db", job / "node-03.db", job / "node-02.db")
    assert [r["node"] for r in report["recordings"]] == ["node-00", "node-02", "node-03"]  # named twice: once
    assert report["unrecorded_ranks"] == list(range(8, 16))
    assert [r["rank"] for r in report["late_ranks"]] == [LATE]
    text = run_recorder("cluster", "explain", str(job / "node-00.db"), str(job / "node-02.db"), check=True).stdout
    assert "Not recorded: 16 rank(s) of the communicator have no recording here (8-15, 24-31)" in text


def test_parquet_export_whose_source_is_elsewhere_explains_from_its_answers_or_says_where_to_look(job, tmp_path):
    out = tmp_path / "pq"
    moved = tmp_path / "elsewhere" / "node-02.db"
    moved.parent.mkdir()
    shutil.copy(job / "node-02.db", moved)
    for db in [job / "node-00.db", job / "node-01.db", moved, job / "node-03.db"]:
        run_recorder("export", "--parquet", str(out), "--db", str(db), check=True)
    moved.unlink()
    report = explain_json(out)
    (late,) = report["late_ranks"]
    assert (late["rank"], late["node"], late["db"]) == (LATE, "node-02", str(moved))
    # the answer node-02's export holds explains it ...
    assert late["explanation"]["available"] and late["explanation"]["python"] == LINE
    # ... and an export without answers (made before they were exported) says where to look
    shutil.rmtree(out / "stall" / "node=node-02")
    (late,) = explain_json(out)["late_ranks"]
    assert late["explanation"]["available"] is False
    assert f"recorder explain --step {STEP} --session 1' on node-02" in late["explanation"]["summary"]


def test_parquet_export_names_ranks_by_their_job_identity_as_the_recordings_do(job, tmp_path):
    """Ranks that carry their job identity (RANK, WORLD_SIZE, ...) and a communicator whose init was
    not recorded (an attach to a running job): an export whose recordings are gone here names every
    rank, and takes the communicator's ranks from the environment, exactly as the SQLite files do."""
    import sqlite3

    from store.exports.parquet import export_parquet

    nodes, out = tmp_path / "nodes", tmp_path / "pq"
    nodes.mkdir()
    for db in sorted(job.glob("*.db")):
        shutil.copy(db, nodes / db.name)
        conn = sqlite3.connect(nodes / db.name)
        conn.execute("UPDATE process SET environ_status = 'read', job_world_size = 32, run_id = 'run42',"
                     " slurm_job_id = '4711', slurm_step_id = '0', pod_namespace = 'ml',"
                     " job_rank = (SELECT k.rank FROM nccl_comm k WHERE k.process_id = process.id),"
                     " job_local_rank = (SELECT k.rank % 8 FROM nccl_comm k WHERE k.process_id = process.id),"
                     " pod_name = (SELECT 'trainer-' || (k.rank / 8) FROM nccl_comm k WHERE k.process_id = process.id)")
        conn.execute("DELETE FROM nccl_comm")
        conn.commit()
        conn.close()
    from_sqlite = Cluster([nodes]).steps()
    for db in sorted(nodes.glob("*.db")):
        export_parquet(db, out)
        db.unlink()
    from_parquet = Cluster([out]).steps()

    def named(steps: dict) -> dict:
        return {p["rank"]: (r["node"], p["pid"], p["job"]) for r in steps["recordings"] for p in r["processes"]}

    assert named(from_parquet) == named(from_sqlite)
    assert {rank: job for rank, (_, _, job) in named(from_parquet).items()} == {
        r: f"rank {r} of 32 (local rank {r % 8}), torchrun run run42, Slurm job 4711 step 0, pod ml/trainer-{r // 8}"
        for r in range(32)}
    (stall,) = [s for s in from_parquet["steps"] if s["slow"]]
    assert (stall["step"], stall["late_rank"], stall["late_node"]) == (STEP, LATE, "node-02")
    assert stall["late_job"].startswith(f"rank {LATE} of 32 (local rank 1)")
    assert any("taken from their environment" in n for n in from_parquet["notes"])


def test_one_recording_of_several_ranks_is_explained_without_alignment(tmp_path):
    """One recorder following every rank of a node: one file, one clock."""
    write_cluster(tmp_path, ClusterSpec(nodes=1, late_rank=5))
    report = explain_json(tmp_path / "node-00.db")
    assert report["clock"]["method"] == "one recording: one clock, nothing to align"
    assert [(r["rank"], r["node"]) for r in report["late_ranks"]] == [(5, "node-00")]
    assert report["late_ranks"][0]["explanation"]["kind"] == "nvme_timeout"


def test_mcp_cluster_explain_over_stdio_reads_the_operators_recordings(job, tmp_path):
    """`recorder mcp` as a client starts it: the recordings come from $STALL_RECORDER_CLUSTER."""
    from mcp import Client, StdioServerParameters

    from mcp_server import untrusted

    pq = tmp_path / "pq"
    for db in sorted(job.glob("*.db")):
        run_recorder("export", "--parquet", str(pq), "--db", str(db), check=True)
    env = {**os.environ, "STALL_RECORDER_CLUSTER": f"{pq}"}
    params = StdioServerParameters(command=sys.executable, cwd=str(ROOT), env=env,
                                   args=["-m", "recorder", "mcp", "--db", str(job / "node-01.db")])

    async def go():
        async with Client(params) as c:
            return await c.call_tool("cluster_explain", {})
    r = anyio.run(go)
    assert not r.is_error, r.content
    got = untrusted.unmark(r.structured_content)
    assert_rank17(got, str(job / "node-02.db"))  # from the Parquet export, explained from the SQLite file


@pytest.mark.parametrize("where", [0.6, 0.8, 0.9, 0.97])
def test_a_damaged_recording_of_the_job_is_one_line(tmp_path, monkeypatch, where):
    """Pages of one node's recording overwritten: `cluster explain` and the MCP tool say it cannot be
    read and how to check it, in one line, never a traceback or an 'internal error'."""
    from mcp import Client

    from mcp_server.server import build_server

    write_cluster(tmp_path, ClusterSpec(nodes=2, ranks_per_node=1, late_rank=1))
    db = tmp_path / "node-01.db"
    damage_pages(db, where)
    res = run_recorder("cluster", "explain", str(tmp_path))
    assert "Traceback" not in res.stderr, res.stderr
    if res.returncode != 0:
        assert res.stderr.count("\n") == 1 and "cannot be read" in res.stderr, res.stderr
    monkeypatch.setenv("STALL_RECORDER_CLUSTER", str(tmp_path))

    async def go():
        async with Client(build_server(tmp_path / "node-00.db")) as c:
            return await c.call_tool("cluster_explain", {"worst": True})
    r = anyio.run(go)
    text = " ".join(getattr(c, "text", "") for c in r.content)
    assert "internal error" not in text
    if r.is_error:
        assert "cannot be read" in text, text
