"""run_sql against hostile queries: every write, escape and resource attack is refused or bounded, and
the database file is byte-for-byte unchanged afterwards."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_mcp_recording import make_recording

from mcp_server import readonly_sql
from mcp_server.readonly_sql import RefusedQuery, run_sql

REFUSED = [
    "DELETE FROM session",
    "UPDATE session SET status = 'x'",
    "INSERT INTO string (value) VALUES ('x')",
    "REPLACE INTO string (id, value) VALUES (1, 'x')",
    "DROP TABLE session",
    "DROP VIEW offcpu",
    "CREATE TABLE t (x)",
    "CREATE TEMP TABLE t (x)",
    "CREATE TEMP VIEW v AS SELECT 1",
    "ALTER TABLE session ADD COLUMN x",
    "WITH x AS (SELECT 1) DELETE FROM session",
    "WITH x AS (SELECT 1) INSERT INTO string (value) SELECT 'y' FROM x",
    "EXPLAIN DELETE FROM session",
    "/* looks harmless */ DELETE FROM session",
    "-- comment\nDROP TABLE session",
    "ATTACH DATABASE '/tmp/mcp-attack.db' AS evil",
    "SELECT * FROM evil.sqlite_master",
    "DETACH DATABASE main",
    "PRAGMA user_version = 99",
    "PRAGMA journal_mode = DELETE",
    "PRAGMA query_only = 0",
    "SELECT * FROM pragma_writable_schema",
    "SELECT * FROM pragma_table_info('session')",  # authorized by SQLite as an UPDATE of sqlite_master
    "SELECT * FROM pragma_user_version",
    "SELECT load_extension('/tmp/mcp-attack.so')",
    "SELECT load_extension('/tmp/mcp-attack.so', 'sqlite3_extension_init')",
    "BEGIN IMMEDIATE",
    "COMMIT",
    "VACUUM",
    "VACUUM INTO '/tmp/mcp-attack-copy.db'",
    "ANALYZE",
    "REINDEX",
    "SELECT 1; DELETE FROM session",
    "SELECT 1; SELECT 2",
    "SELECT zeroblob(2000000000)",
    "",
]


def digest(db: Path) -> str:
    h = hashlib.sha256()
    for path in (db, db.with_name(db.name + "-wal")):
        if path.exists():
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture
def db(tmp_path) -> Path:
    return make_recording(tmp_path / "r.db")


def test_hostile_queries_are_refused_and_the_database_is_unchanged(db):
    before = digest(db)
    for sql in REFUSED:
        with pytest.raises(RefusedQuery):
            run_sql(db, sql)
    assert not Path("/tmp/mcp-attack-copy.db").exists()
    assert digest(db) == before


def test_endless_recursive_cte_stops_at_the_time_limit(db):
    before = digest(db)
    endless = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
    with pytest.raises(RefusedQuery, match="time limit"):
        run_sql(db, endless, time_limit_s=0.5)
    # also when the rows stream out one by one and the client never stops reading
    with pytest.raises(RefusedQuery, match="time limit"):
        run_sql(db, "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r "
                    "WHERE n % 100000000 = 0", time_limit_s=0.5)
    assert digest(db) == before


def test_huge_results_are_capped_with_a_flag(db):
    many = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 1000000) SELECT n FROM r"
    out = run_sql(db, many, max_rows=50)
    assert out["row_count"] == 50 and out["truncated"] is True
    out = run_sql(db, many, max_rows=10**9)  # asking for more than the cap gets the cap
    assert out["max_rows"] == readonly_sql.MAX_ROWS and out["truncated"] is True
    wide = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 5000) "
            "SELECT n, printf('%.5000c', 'x') AS big FROM r")
    out = run_sql(db, wide, max_rows=5000)
    assert out["truncated"] is True and out["row_count"] < 5000
    assert all(len(row[1]["untrusted_text"]) <= 512 and row[1]["original_chars"] == 5000 for row in out["rows"])


def test_reads_work_and_text_comes_back_marked(db):
    out = run_sql(db, "-- the contended call\nSELECT api, dur, thread_name FROM cuda_call_detail "
                      "WHERE dur > 1000000;")
    assert out["columns"] == ["api", "dur", "thread_name"]
    assert out["rows"] == [[{"untrusted_text": "cudaMalloc"}, 12_000_000, {"untrusted_text": "train"}]]
    assert run_sql(db, "EXPLAIN QUERY PLAN SELECT * FROM slow_cuda_call")["row_count"] > 0
    assert run_sql(db, "SELECT count(*) FROM sqlite_master WHERE name = 'session'")["rows"] == [[1]]
