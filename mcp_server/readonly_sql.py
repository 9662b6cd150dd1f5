"""The guarded `run_sql` tool: one read-only SELECT/WITH/EXPLAIN statement, bounded in time and size.

Defences, each enough on its own for writes and all of them together for the rest:
- the file is opened read-only (store.db.open_store) and the connection is set to ``PRAGMA query_only = 1``;
- an authorizer (sqlite3 ``set_authorizer``) allows only reads, selects, recursive CTEs and the
  functions not in DENIED_FUNCTIONS; it denies every write, ATTACH/DETACH, transactions, schema
  changes, ``load_extension`` and every PRAGMA (SQLite authorizes even ``pragma_table_info()`` as an
  UPDATE of sqlite_master; the schema://tables resource describes the schema instead);
- the statement must start with SELECT, WITH or EXPLAIN and be the only one;
- it runs in a child process (forked from a forkserver started once) that is killed at the time
  limit, or as soon as the client cancels: a progress handler cannot interrupt one long SQL function
  call (instr/LIKE over megabyte strings), a kill can. The child also has a memory cap;
- SQLite's own limits cap a string or blob at MAX_VALUE_BYTES and forbid attached databases (Python
  3.11+; on 3.10 the other defences hold);
- at most ``max_rows`` rows come back, and at most MAX_RESULT_CHARS characters of JSON counted the way
  the result is sent (indented, every value marked), column names included; ``truncated`` says so.
"""

from __future__ import annotations

import multiprocessing
import re
import resource
import sqlite3
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import pydantic_core

from mcp_server import untrusted
from store.db import Store, damaged, open_store
from store.errors import UserError

DEFAULT_ROWS = 200
MAX_ROWS = 5000
MAX_RESULT_CHARS = 1_000_000
MAX_VALUE_BYTES = 1_000_000  # no single value can be longer than a whole result
MAX_COLUMN_CHARS = 256
CHILD_MEMORY_BYTES = 2 << 30  # address space of the query process
KILL_GRACE_S = 0.5  # after the time limit, for the child to answer with its own message
PROGRESS_STEPS = 1000  # VM instructions between time checks
SAFE_INTEGER = 2**53 - 1  # JavaScript numbers hold integers exactly up to here

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


def connect(path: str | Path) -> Store:
    """A read-only store with its views, its connection locked down for untrusted SQL."""
    store = open_store(path, readonly=True)  # TEMP views created before the lock-down
    conn = store.conn
    conn.execute("PRAGMA query_only = 1")
    # Connection.setlimit is Python 3.11+: on 3.10 the authorizer still refuses ATTACH and the child's
    # memory cap and time limit bound a value built too large
    if hasattr(conn, "setlimit"):
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)  # type: ignore[attr-defined]  # 3.11+, checked above
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)  # type: ignore[attr-defined]  # 3.11+
    conn.set_authorizer(_authorizer)
    return store


def json_chars(value: Any) -> int:
    """Characters of `value` as the SDK sends a result's text (pydantic_core JSON, indent 2)."""
    return len(pydantic_core.to_json(value, indent=2, fallback=str))


def cell(value: Any) -> Any:
    """One value as returned: text marked as data; an integer JavaScript would round also as text."""
    if isinstance(value, int) and abs(value) > SAFE_INTEGER:
        return {"integer": value, "text": str(value)}
    return untrusted.mark(value)


def timeout_message(time_limit_s: float) -> str:
    return (f"query stopped after the {time_limit_s:g} s time limit: narrow it (a time window, a LIMIT, "
            "or an index-friendly WHERE)")


def sql_error_message(e: sqlite3.Error, time_limit_s: float) -> str:
    text = str(e)
    if text == "interrupted":
        return timeout_message(time_limit_s)
    if "too big" in text:
        return (f"a value or the statement is longer than {MAX_VALUE_BYTES:,} bytes: return substr() of long "
                "values, or send a shorter statement")
    if "not authorized" in text:
        return "not authorized: run_sql only reads (no writes, ATTACH, PRAGMA writes, transactions or extensions)"
    if "one statement" in text:
        return "only one statement per call: send the others in separate calls"
    if damaged(e):  # by its code, not its words: "malformed JSON" is the statement's error
        return (f"the recording cannot be read ({text}): check it with 'sqlite3 FILE \"PRAGMA integrity_check\"'; "
                "'sqlite3 FILE .recover' saves the rows that are intact")
    return f"SQL error: {text}"


def execute(path: str | Path, body: str, max_rows: int, time_limit_s: float) -> dict[str, Any]:
    """Run one checked statement in this process (the child's side of run_sql)."""
    store = connect(path)
    conn = store.conn
    deadline = time.monotonic() + time_limit_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_STEPS)
    started = time.monotonic()
    try:
        try:
            cur = conn.execute(body)
            columns = [str(d[0])[:MAX_COLUMN_CHARS] for d in cur.description or ()]
            rows: list[list[Any]] = []
            # the indented JSON of the result around the rows, then each row at its depth (two levels)
            chars = json_chars({"columns": columns, "rows": [], "row_count": 0, "truncated": True,
                                "max_rows": MAX_ROWS, "elapsed_ns": 2**63})
            truncated = False
            for row in iter(cur.fetchone, None):
                if len(rows) >= max_rows:
                    truncated = True
                    break
                marked = [cell(v) for v in row]
                text = pydantic_core.to_json(marked, indent=2, fallback=str)
                chars += len(text) + 4 * text.count(b"\n") + 6  # re-indented 4 deeper, ",\n" and indent
                if chars > MAX_RESULT_CHARS:
                    truncated = True
                    break
                rows.append(marked)
        except sqlite3.Error as e:
            raise RefusedQuery(sql_error_message(e, time_limit_s)) from None
        except (OverflowError, MemoryError) as e:
            raise RefusedQuery(f"SQL error: {e or type(e).__name__}") from None
    finally:
        store.close()
    return {"columns": columns, "rows": rows, "row_count": len(rows), "truncated": truncated,
            "max_rows": max_rows, "elapsed_ns": int((time.monotonic() - started) * 1e9)}


def _child(out: Connection, path: str, body: str, max_rows: int, time_limit_s: float) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    try:
        result: tuple[str, Any] = ("ok", execute(path, body, max_rows, time_limit_s))
    except UserError as e:
        result = ("error", str(e))
    except MemoryError:
        result = ("error", "the query needed more than the memory run_sql allows: narrow it")
    except Exception as e:  # noqa: BLE001 - whatever it is, the parent gets one line
        result = ("error", f"SQL error: {type(e).__name__}: {e}")
    out.send(result)
    out.close()


_context_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def _mp() -> multiprocessing.context.ForkServerContext:
    """A forkserver context: children are forked from a small single-threaded server (started on the
    first query) that has this module imported, not from the threaded MCP server."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["mcp_server.readonly_sql"])
            _context = ctx
        return _context


class Query:
    """One run_sql statement in its own process."""

    def __init__(self, path: str | Path, sql: str, max_rows: int, time_limit_s: float) -> None:
        self.max_rows = max(1, min(int(max_rows), MAX_ROWS))
        self.time_limit_s = time_limit_s
        body = check_statement(sql)
        ctx = _mp()
        self._recv, send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_child, args=(send, str(path), body, self.max_rows, time_limit_s),
                                   daemon=True)
        self.process.start()
        send.close()
        self.deadline = time.monotonic() + time_limit_s + KILL_GRACE_S

    def wait(self) -> dict[str, Any]:
        """The result, or RefusedQuery; the process is gone when this returns."""
        try:
            if not self._recv.poll(max(0.0, self.deadline - time.monotonic())):
                raise RefusedQuery(timeout_message(self.time_limit_s))
            try:
                status, value = self._recv.recv()
            except (EOFError, OSError):
                raise RefusedQuery("the query process ended without an answer (killed, or out of memory): "
                                   "narrow the query") from None
        finally:
            self.kill()
        if status != "ok":
            raise RefusedQuery(value)
        return value

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self._recv.close()


def run_sql(path: str | Path, sql: str, max_rows: int = DEFAULT_ROWS, time_limit_s: float = 5.0) -> dict[str, Any]:
    """Run one read-only statement in a child process killed at the time limit; rows come back as
    lists with every string marked as data."""
    return Query(path, sql, max_rows, time_limit_s).wait()


async def run_sql_async(path: str | Path, sql: str, max_rows: int = DEFAULT_ROWS,
                        time_limit_s: float = 5.0) -> dict[str, Any]:
    """run_sql for an async handler: when the request is cancelled (the client cancels or gives up),
    the query's process is killed at once instead of running to its time limit."""
    query = Query(path, sql, max_rows, time_limit_s)
    try:
        return await anyio.to_thread.run_sync(query.wait, abandon_on_cancel=True)
    finally:
        query.kill()
