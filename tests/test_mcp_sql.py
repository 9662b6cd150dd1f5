"""run_sql against hostile queries: every write, escape and resource attack is refused or bounded, and
the database file is byte-for-byte unchanged afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError
from test_mcp_recording import make_recording

from mcp_server import readonly_sql
from mcp_server.readonly_sql import RefusedQuery, run_sql
from mcp_server.server import build_server

ROOT = Path(__file__).resolve().parent.parent

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


# -- through a real client: bounds that hold for any single SQL function, cancellation, result size ----
def tool_call(server, name: str, args: dict, timeout_s: float | None = None):
    async def go():
        async with Client(server) as c:
            return await c.call_tool(name, args, read_timeout_seconds=timeout_s)
    return anyio.run(go)


LONG_FUNCTIONS = [
    "SELECT instr(printf('%.*c', 999000, 'a'), printf('%.*c', 499000, 'a') || 'b')",
    "SELECT printf('%.*c', 999000, 'a') LIKE ('%' || printf('%.*c', 40000, 'a') || 'b%')",
    "SELECT instr(printf('%.*c', 1600000, 'a'), printf('%.*c', 800000, 'a') || 'b')",  # over the length cap
]


def test_one_long_sql_function_call_stops_at_the_time_limit(db):
    server = build_server(db, sql_time_limit_s=1.0)
    for sql in LONG_FUNCTIONS:
        started = time.monotonic()
        r = tool_call(server, "run_sql", {"sql": sql})
        took = time.monotonic() - started
        assert took < 1.0 + readonly_sql.KILL_GRACE_S + 2.5, (sql, took)  # unbounded: 10-20 s
        if r.is_error:
            assert "time limit" in r.content[0].text, r.content[0].text
        else:  # a string over MAX_VALUE_BYTES is NULL, so the function has nothing to chew on
            assert r.structured_content["rows"] == [[None]], sql


def query_processes() -> set[int]:
    """Our descendants forked by a run_sql forkserver to run one query."""
    parents, cmdlines = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdlines[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    ours, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - ours
        ours |= frontier
    return {p for p in ours if b"forkserver" in cmdlines.get(p, b"")
            and b"forkserver" in cmdlines.get(parents[p], b"")}


def test_a_query_the_client_gives_up_on_is_killed_at_once_over_stdio(db):
    """`recorder mcp` over real stdio (time limit 5 s): the client stops waiting after 1 s and sends
    its cancel; the query's process is gone long before the time limit would have ended it."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", str(db)],
                                   cwd=str(ROOT))
    endless = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"

    async def go() -> tuple[set[int], float]:
        async with Client(params) as c:
            assert not (await c.call_tool("run_sql", {"sql": "SELECT 1"})).is_error  # forkserver up
            started = time.monotonic()
            with pytest.raises(MCPError):
                await c.call_tool("run_sql", {"sql": endless}, read_timeout_seconds=1.0)
            running = query_processes()
            while query_processes() and time.monotonic() - started < 10:
                await anyio.sleep(0.05)
            return running, time.monotonic() - started
    running, gone_after = anyio.run(go)
    assert running, "the query was not running when the client gave up"
    assert gone_after < 4.0, f"the query process outlived the cancel: gone {gone_after:.1f} s after the call"


def test_the_result_cap_counts_what_the_client_receives(db):
    server = build_server(db)
    escapes = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 5000) "
               "SELECT n, printf('%.500c', char(1)) AS ctl, printf('%.500c', char(233)) AS accented FROM r")
    r = tool_call(server, "run_sql", {"sql": escapes, "max_rows": 5000})
    assert not r.is_error
    out = r.structured_content
    assert out["truncated"] is True and 0 < out["row_count"] < 5000
    assert len(r.content[0].text) <= readonly_sql.MAX_RESULT_CHARS
    assert len(json.dumps(out, ensure_ascii=False)) <= readonly_sql.MAX_RESULT_CHARS
    name = "c" * 900_000
    r = tool_call(server, "run_sql", {"sql": f'SELECT 1 AS "{name}"'})
    assert not r.is_error
    assert len(r.content[0].text) < 10_000
    assert r.structured_content["columns"] == ["c" * readonly_sql.MAX_COLUMN_CHARS]
    r = tool_call(server, "run_sql", {"sql": f'SELECT 1 AS "{"c" * 5_000_000}"'})
    assert r.is_error and "longer than" in r.content[0].text and len(r.content[0].text) < 300


def test_integers_beyond_javascript_precision_also_come_back_as_text(db):
    r = tool_call(build_server(db), "run_sql", {"sql": "SELECT 9007199254740993 AS big, -9223372036854775808, 42"})
    assert r.structured_content["rows"] == [[{"integer": 9007199254740993, "text": "9007199254740993"},
                                             {"integer": -9223372036854775808, "text": "-9223372036854775808"}, 42]]


def test_a_statement_error_with_malformed_in_it_is_not_a_damaged_recording(db):
    with pytest.raises(RefusedQuery) as e:
        run_sql(db, "SELECT json('{')")
    assert str(e.value).startswith("SQL error: malformed JSON"), e.value
    assert "cannot be read" not in str(e.value)


def test_a_damaged_recording_is_said_to_be_one(db, tmp_path):
    bad = tmp_path / "bad.db"
    data = bytearray(Path(db).read_bytes())
    page = int.from_bytes(data[16:18], "big")
    start = len(data) // page // 2 * page
    data[start:] = b"\xff" * (len(data) - start)  # the last half of the pages overwritten
    bad.write_bytes(bytes(data))
    with pytest.raises(RefusedQuery) as e:
        for table in ("cuda_call", "offcpu_interval", "thread", "strings", "python_stack_frame"):
            run_sql(bad, f"SELECT count(*), max(rowid) FROM {table}")
    assert "cannot be read" in str(e.value) or "not a usable SQLite database" in str(e.value), e.value
