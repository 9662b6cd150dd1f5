"""The rules as rows (store/migrations/0010_rules.sql): each threshold and map is stored once, the
views join it, the report applies and quotes what is stored. Changed here in plain SQL, through the
sqlite3 module on the recording file, as a user would in the sqlite3 shell."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from recorder.demo import write_scenario
from store.analysis import causes
from store.db import open_store
from store.report.build import explain, render_text
from tests.conftest import q

STALL_KEYS = ("step_mark_id", "dur", "baseline_dur", "baseline_steps", "excess_dur", "ratio", "slow")


def _sql(db: Path, *statements: str) -> None:
    conn = sqlite3.connect(db)
    try:
        for sql in statements:
            conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


def _stalls(db: Path) -> set[int]:
    return {r[0] for r in q(db, "SELECT step FROM stall")}


@pytest.fixture
def contention(tmp_path: Path) -> tuple[Path, int]:
    db = tmp_path / "cpu.db"
    return db, write_scenario("cpu-contention", db)


def test_the_stored_rules_are_the_documented_ones(contention: tuple[Path, int]) -> None:
    db, _ = contention
    assert q(db, "SELECT ratio, min_excess_dur, min_baseline_steps, neighbours FROM stall_rule") == [
        (1.5, 1_000_000, 3, 10)]
    assert q(db, "SELECT ratio, min_excess_dur, min_baseline_calls FROM slow_call_rule") == [(2.0, 200_000, 3)]
    assert q(db, "SELECT specific_share, explained_share, secondary_share FROM cause_rule") == [(0.5, 0.2, 0.05)]
    assert q(db, "SELECT cause FROM device_event_cause WHERE kind = 'nvme_timeout_abort'") == [("nvme_timeout",)]


def test_the_stall_threshold_row_decides_which_steps_are_stalls(contention: tuple[Path, int]) -> None:
    db, _ = contention
    assert _stalls(db) == {80042}
    slow_at_default = {r[0] for r in q(db, "SELECT step FROM step_baseline WHERE slow")}
    assert slow_at_default == {80042}
    _sql(db, "UPDATE stall_rule SET ratio = 100")  # no step is 100x its median
    assert _stalls(db) == set() and q(db, "SELECT count(*) FROM step_baseline WHERE slow") == [(0,)]
    _sql(db, "UPDATE stall_rule SET ratio = 1.5, min_excess_dur = 60000000000")  # nor a minute longer
    assert _stalls(db) == set()
    assert q(db, "SELECT count(*) FROM step_baseline_lookup WHERE slow") == [(0,)]
    _sql(db, "UPDATE stall_rule SET min_excess_dur = 1000000, min_baseline_steps = 21")  # 20 neighbours at most
    assert _stalls(db) == set()
    _sql(db, "UPDATE stall_rule SET min_baseline_steps = 3")
    assert _stalls(db) == {80042}


def test_a_lower_ratio_makes_more_stalls_in_the_views_and_the_report(tmp_path: Path) -> None:
    db = tmp_path / "healthy.db"
    sid = write_scenario("healthy", db)
    assert _stalls(db) == set()
    with open_store(db, readonly=True) as store:
        report = explain(store, sid)
    assert report["stall"] is False
    assert "(a stall is 1.5x the rolling median and 1 ms more)" in report["symptom"]
    # the healthy steps jitter by a few percent: a 1.01x rule with no minimum calls some stalls
    _sql(db, "UPDATE stall_rule SET ratio = 1.01, min_excess_dur = 0")
    loose = _stalls(db)
    assert loose
    with open_store(db, readonly=True) as store:
        assert {r["step"] for r in causes.find_stalls(store, sid, 0, 2**62)} == loose
        report = explain(store, sid)
    assert report["stall"] is True and report["step"]["step"] in loose
    _sql(db, "UPDATE stall_rule SET ratio = 100, min_excess_dur = 2500000")
    with open_store(db, readonly=True) as store:
        report = explain(store, sid)
    assert report["stall"] is False
    assert "(a stall is 100x the rolling median and 2.5 ms more)" in report["symptom"]


@pytest.mark.parametrize("rule", ["ratio = 1.5, min_excess_dur = 1000000", "ratio = 1.05, min_excess_dur = 0",
                                  "ratio = 1.2, min_excess_dur = 5000000, min_baseline_steps = 12"])
def test_the_listing_gives_the_views_rows_under_any_rule(contention: tuple[Path, int], rule: str) -> None:
    """all_steps computes a whole session's baselines in one pass (for listings): it must give the
    rows of step_baseline, and find_stalls those of stall, whatever the stored rule is."""
    db, sid = contention
    _sql(db, f"UPDATE stall_rule SET {rule}")
    with open_store(db, readonly=True) as store:
        view = [tuple(r[k] for k in STALL_KEYS)
                for r in store.query("SELECT * FROM step_baseline ORDER BY step_mark_id")]
        mine = sorted(tuple(r[k] for k in STALL_KEYS) for r in causes.all_steps(store, sid))
        assert view == mine
        stalls = {r["step_mark_id"] for r in store.query("SELECT step_mark_id FROM stall")}
        assert stalls == {r[0] for r in view if r[-1]}
        assert stalls == {r["step_mark_id"] for r in causes.find_stalls(store, sid, 0, 2**62)}


def test_the_window_is_fixed_by_the_views(contention: tuple[Path, int]) -> None:
    """The window frames of step_baseline and stall cannot take a value from a table: the row says
    10 and refuses another number rather than disagree with them."""
    db, _ = contention
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        _sql(db, "UPDATE stall_rule SET neighbours = 5")
    with pytest.raises(sqlite3.IntegrityError):
        _sql(db, "INSERT INTO stall_rule (id, ratio, min_excess_dur, min_baseline_steps, neighbours)"
                 " VALUES (2, 2, 0, 3, 10)")


def test_the_slow_call_rule_row_decides_which_calls_are_slow(contention: tuple[Path, int]) -> None:
    db, sid = contention
    assert q(db, "SELECT count(*) FROM slow_cuda_call") == [(0,)]  # the scenario's calls take their usual time
    _sql(db, "UPDATE cuda_call SET dur = 3 * dur + 300000 WHERE id = (SELECT max(id) FROM cuda_call)")
    assert q(db, "SELECT count(*) FROM slow_cuda_call") == [(1,)]
    _sql(db, "UPDATE slow_call_rule SET min_excess_dur = 60000000000")
    assert q(db, "SELECT count(*) FROM slow_cuda_call") == [(0,)]
    _sql(db, "UPDATE slow_call_rule SET min_excess_dur = 200000, ratio = 1000")
    assert q(db, "SELECT count(*) FROM slow_cuda_call") == [(0,)]
    with open_store(db, readonly=True) as store:
        report = explain(store, sid)
    assert report["findings"] == []
    assert "no CUDA call took more than 1000x its baseline" in report["negatives"]


def test_the_event_map_row_decides_the_root_cause(tmp_path: Path) -> None:
    db = tmp_path / "dma.db"
    sid = write_scenario("dma-bounce", db)
    with open_store(db, readonly=True) as store:
        assert explain(store, sid)["primary_cause"]["kind"] == "dma_bounce"
    # without the rows that make a bounce a cause, the same wait is a slow or queued request
    _sql(db, "DELETE FROM device_event_cause WHERE cause = 'dma_bounce'")
    with open_store(db, readonly=True) as store:
        report = explain(store, sid)
    assert report["primary_cause"]["kind"] in ("slow_io", "io_queued")
    assert "Primary cause: DMA through SWIOTLB" not in render_text(report)


CAUSE_KINDS = ("nvme_timeout", "io_error", "iommu_fault", "pcie_aer", "dma_bounce", "slow_io", "io_queued",
               "io_throttled", "blocked_io", "cpu_contention", "tcp_retransmit", "network_wait", "memory_reclaim",
               "dirty_throttle", "slow_cuda_call", "gpu_xid", "nccl_straggler", "nccl_wait", "wait_chain", "gil_wait",
               "blocked")


def test_every_mapped_cause_is_a_known_cause_kind(contention: tuple[Path, int]) -> None:
    db, _ = contention
    assert q(db, "SELECT kind, cause FROM device_event_cause WHERE cause NOT IN (SELECT kind FROM cause_kind)") == []
    # every cause a report can name, written out here: a kind dropped from the families
    # (store/analysis/kinds/) or from the recording's cause_kind table fails, and so does one added
    # without its row and its place in this list
    from store.analysis.kinds import KINDS

    assert sorted(KINDS) == sorted(CAUSE_KINDS)
    assert sorted(r[0] for r in q(db, "SELECT kind FROM cause_kind")) == sorted(CAUSE_KINDS)


def test_the_listings_quote_the_stored_rule(contention: tuple[Path, int]) -> None:
    from store.report.listing import render_steps, render_top, steps, top

    db, sid = contention
    with open_store(db, readonly=True) as store:
        text = render_steps(steps(store, sid))
    assert "1 stalled (! stalled: 1.5x the rolling median and 1 ms more;" in text
    _sql(db, "UPDATE stall_rule SET ratio = 50, min_excess_dur = 0")
    with open_store(db, readonly=True) as store:
        listed, worst = steps(store, sid), top(store, sid)
    assert listed["stalls"] == 0 and "(! stalled: 50x the rolling median and 0 ms more;" in render_steps(listed)
    assert worst["stalls_total"] == 0 and "none: no step took 50x its rolling median" in render_top(worst)


def test_a_v9_recording_gets_the_rules_when_migrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording made before the rules were rows: a writable open migrates it, adding the tables
    with the rules the views used to hard-code, and its stalls are the same."""
    monkeypatch.setenv("STALL_RECORDER_CACHE_DIR", str(tmp_path / "cache"))  # where a reader's migrated copy goes
    from store import db as store_db

    path = tmp_path / "old.db"
    write_scenario("cpu-contention", path)
    conn = sqlite3.connect(path)
    for table in ("stall_rule", "slow_call_rule", "device_event_cause", "cause_kind", "cause_rule",
                  "thread_name", "incident", "user_code_rule", "wait_chain_rule", "python_gil", "flight_window",
                  "causal_link_stored", "causal_link_session", "step_cause_stored", "layer_vocabulary",
                  "device_activity", "host_op", "collective_record", "trace_import", "cpu_sample",
                  "cuda_launch_count", "cuda_launch_sample"):
        conn.execute(f"DROP TABLE {table}")  # and what later versions added
    store_db._drop_views(conn)
    for table, column in (("offcpu_interval", "waker_context"), ("offcpu_interval", "futex_addr"),
                          ("offcpu_interval", "end_seen"), ("python_stack", "failure"), ("python_stack", "reread"),
                          ("tcp_retransmit", "process_id"), ("tcp_retransmit", "peer_process_id"),
                          ("cuda_call", "open"), ("nccl_call", "open"), ("cuda_call", "driver_api_id"),
                          ("session", "stop_reason"), ("session", "written_ts"),
                          ("reclaim_interval", "python_stack_id"), ("step_mark", "end_ts"),
                          *(("process", c) for c in ("environ_status", "job_rank", "job_local_rank",
                                                     "job_world_size", "master_addr", "run_id", "slurm_job_id",
                                                     "slurm_step_id", "pod_uid", "pod_namespace", "pod_name",
                                                     "cgroup"))):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.execute("PRAGMA user_version = 9")
    conn.commit()
    conn.close()
    with open_store(path, readonly=True) as store:  # read through a migrated copy; the file stays v9
        assert store.migrated_from == 9 and store.read_path != path
        assert store.row("SELECT ratio FROM stall_rule")["ratio"] == 1.5
    assert q(path, "PRAGMA user_version") == [(9,)]
    open_store(path).close()
    assert q(path, "PRAGMA user_version") == [(store_db.SCHEMA_VERSION,)]
    assert q(path, "SELECT ratio, min_excess_dur FROM stall_rule") == [(1.5, 1_000_000)]
    assert _stalls(path) == {80042}
