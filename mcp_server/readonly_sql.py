"""The guarded `run_sql` tool: one read-only SELECT/WITH/EXPLAIN statement, bounded in time and size.

Defences, each enough on its own for writes and all of them together for the rest:
- the file is opened with ``mode=ro`` and the connection is set to ``PRAGMA query_only = 1``;
- an authorizer (sqlite3 ``set_authorizer``) allows only reads, selects, recursive CTEs and the
  functions not in DENIED_FUNCTIONS; it denies every write, ATTACH/DETACH, transactions, schema
  changes, ``load_extension`` and every PRAGMA (SQLite authorizes even ``pragma_table_info()`` as an
  UPDATE of sqlite_master; the schema://tables resource describes the schema instead);
- the statement must start with SELECT, WITH or EXPLAIN and be the only one;
- a progress handler interrupts it after the time limit; at most ``max_rows`` rows and MAX_RESULT_CHARS
  characters come back, with ``truncated`` set when more were there;
- SQLite's own limits cap a string or blob at MAX_VALUE_BYTES and forbid attached databases.
"""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from typing import Any

from mcp_server import untrusted
from store.db import open_store
from store.errors import UserError

DEFAULT_ROWS = 200
MAX_ROWS = 5000
MAX_RESULT_CHARS = 1_000_000
MAX_VALUE_BYTES = 10_000_000
PROGRESS_STEPS = 1000  # VM instructions between time checks

DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit",
                              "sqlite_dbpage", "zipfile"})
_LEADING = re.compile(r"^\s*(?:(?:--[^\n]*(?:\n|$))|(?:/\*.*?\*/)|\s)*", re.S)
FIRST_WORDS = ("SELECT", "WITH", "EXPLAIN")


class RefusedQuery(UserError):
    """A run_sql statement that is not a single read-only query."""


def _authorizer(action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None) -> int:
    if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION:
        return sqlite3.SQLITE_DENY if (arg2 or "").lower() in DENIED_FUNCTIONS else sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def check_statement(sql: str) -> str:
    """The statement without leading comments, or RefusedQuery saying why not."""
    body = _LEADING.sub("", sql, count=1)
    first = body.split(None, 1)[0].upper() if body.strip() else ""
    first = re.split(r"[^A-Z]", first, maxsplit=1)[0]
    if first not in FIRST_WORDS:
        raise RefusedQuery(f"only one SELECT, WITH or EXPLAIN statement is allowed (got {first or 'nothing'!r})")
    return body


def connect(path: str | Path) -> sqlite3.Connection:
    """A read-only connection with the store's views, locked down for untrusted SQL."""
    store = open_store(path, readonly=True)  # mode=ro, TEMP views created before the lock-down
    conn = store.conn
    conn.execute("PRAGMA query_only = 1")
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.set_authorizer(_authorizer)
    return conn


def run_sql(path: str | Path, sql: str, max_rows: int = DEFAULT_ROWS, time_limit_s: float = 5.0) -> dict[str, Any]:
    """Run one read-only statement; rows come back as lists with every string marked as data."""
    max_rows = max(1, min(int(max_rows), MAX_ROWS))
    body = check_statement(sql)
    conn = connect(path)
    deadline = time.monotonic() + time_limit_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_STEPS)
    started = time.monotonic()
    try:
        try:
            cur = conn.execute(body)
            columns = [d[0] for d in cur.description or ()]
            rows: list[list[Any]] = []
            chars = 0
            truncated = False
            for row in iter(cur.fetchone, None):
                if len(rows) >= max_rows:
                    truncated = True
                    break
                marked = [untrusted.mark(v) for v in row]
                chars += len(repr(marked))
                if chars > MAX_RESULT_CHARS:
                    truncated = True
                    break
                rows.append(marked)
        except sqlite3.OperationalError as e:
            if str(e) == "interrupted":
                raise RefusedQuery(f"query stopped after the {time_limit_s:g} s time limit: narrow it "
                                   "(a time window, a LIMIT, or an index-friendly WHERE)") from None
            if "not authorized" in str(e):
                raise RefusedQuery("not authorized: run_sql only reads (no writes, ATTACH, PRAGMA "
                                   "writes, transactions or extensions)") from None
            raise RefusedQuery(f"SQL error: {e}") from None
        except sqlite3.ProgrammingError as e:
            if "one statement" in str(e):
                raise RefusedQuery("only one statement per call: send the others in separate calls") from None
            raise RefusedQuery(f"SQL error: {e}") from None
        except (sqlite3.DatabaseError, OverflowError, MemoryError) as e:
            raise RefusedQuery(f"SQL error: {e}") from None
    finally:
        conn.close()
    return {"columns": columns, "rows": rows, "row_count": len(rows), "truncated": truncated,
            "max_rows": max_rows, "elapsed_ns": int((time.monotonic() - started) * 1e9)}
