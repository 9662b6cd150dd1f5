"""The flight recorder's store side: keep only the last DURATION of a recording, and cut a time
window out of a recording into an incident recording of its own (docs/flight-recorder.md).

Old rows are found by insertion order, not by time: every second the recorder notes the highest
row id of each event table with the time it noted it (a TEMP table of its own connection). A row
is written after its event ended, so every row at or below the id noted at time T is about
something over by T; once T falls out of the window those rows go, a bounded range of row ids
per table at a time. Rowid ranges need no index (the recording builds its indexes at stop) and
each deletion costs the same whatever the table's size.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from store.db import Store, open_store, sqlite_uri
from store.errors import UserError

# Event tables (id, session_id, ts) whose rows are kept whatever their age: decisions and
# identities later rows refer to (capability rows, thread renames, checkpoint files), incidents.
NEVER_PRUNED = frozenset({"capability", "checkpoint_file", "thread_name", "incident"})
NS = 1_000_000_000
# Distributions build SQLite with secure deletion on: every page a deletion frees is overwritten
# with zeros, so pruning the window's oldest rows writes as many pages to the log as it frees (a
# cut of a tenth of a second's rows took 5 MB of a 16 MB bound's log). FAST zeroes deleted content
# only on pages written anyway; freed pages keep theirs until reused, in a file of the recorder's
# own modes (docs/security.md).
SECURE_DELETE_FAST = "PRAGMA secure_delete = FAST"


def columns(conn: sqlite3.Connection, table: str, schema: str = "main") -> list[str]:
    return [r[1] for r in conn.execute(f'PRAGMA "{schema}".table_info("{table}")')]


def tables(conn: sqlite3.Connection, schema: str = "main") -> list[str]:
    return [r[0] for r in conn.execute(
        f"SELECT name FROM \"{schema}\".sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name")]


def event_tables(conn: sqlite3.Connection) -> list[str]:
    """The tables whose rows are events in time: what a window keeps or cuts."""
    out = []
    for name in tables(conn):
        cols = columns(conn, name)
        if cols[:1] == ["id"] and "session_id" in cols and "ts" in cols and name not in NEVER_PRUNED:
            out.append(name)
    return out


class Retention:
    """The statements that keep a recording's last `keep_ns`: run by the session's Writer, after a
    batch's rows and in its transaction, so deleting never races inserting.

    `loss` is not pruned with the events: a loss row counts what was dropped in its second, so it
    stays while any row kept began before that second ended (an interval that began before the
    window is kept, and so are the losses of its time). Each mark also notes the earliest `ts` of
    the rows written since the mark before (a rowid range, the last second's rows), so the start of
    the oldest row kept is known without an index on `ts`.
    """

    def __init__(self, event_tables: Sequence[str], floors: dict[str, int] | None = None) -> None:
        self.tables = [t for t in event_tables if t != "loss"]
        # rows at or below a table's floor are earlier sessions': a flight recording never deletes them
        self.floors = {t: (floors or {}).get(t, 0) for t in [*self.tables, "loss"]}
        self.setup = ("CREATE TEMP TABLE IF NOT EXISTS flight_mark "
                      "(ts INTEGER NOT NULL, tbl TEXT NOT NULL, max_id INTEGER, min_ts INTEGER)",
                      "CREATE INDEX IF NOT EXISTS temp.flight_mark_id ON flight_mark (tbl, max_id)",
                      "CREATE INDEX IF NOT EXISTS temp.flight_mark_ts ON flight_mark (tbl, ts)")
        self.mark = "INSERT INTO temp.flight_mark (ts, tbl, max_id, min_ts) " + " UNION ALL ".join(
            f"SELECT ?1, '{t}', (SELECT max(id) FROM \"{t}\"), (SELECT min(ts) FROM \"{t}\" WHERE id > "
            f"coalesce((SELECT max(max_id) FROM temp.flight_mark WHERE tbl = '{t}'), {self.floors[t]}))"
            for t in self.tables)
        # every row written by the newest mark at or before the cutoff, however many: a row budget
        # let rows linger past the window, and the file past --max-size, above its rate
        # at most ?3 rows a run (the oldest): a run's freed pages are written to the log, so under a
        # size bound a large cut is deleted in runs, each its own transaction (Writer.execute_first)
        self.prune = {t: (f'DELETE FROM "{t}" WHERE id > ?2 AND id <= min('
                          f"(SELECT max(max_id) FROM temp.flight_mark WHERE tbl = '{t}' AND ts <= ?1), "
                          f'(SELECT min(id) FROM "{t}" WHERE id > ?2) + ?3 - 1)')
                      for t in self.tables}
        self.chunk_rows = 1 << 62  # rows a prune deletes at most a run: set under --max-size
        # the start of the oldest row kept: the earliest start noted by a mark whose rows are not
        # all deleted yet
        oldest = "min(" + ", ".join(
            f"coalesce((SELECT min(min_ts) FROM temp.flight_mark WHERE tbl = '{t}' AND max_id >= "
            f"(SELECT min(id) FROM \"{t}\" WHERE id > {self.floors[t]})), ?1)" for t in self.tables) + ", ?1)"
        self.prune_loss = f"DELETE FROM loss WHERE id > ?2 AND ts + 1000000000 <= {oldest}"
        # marks older than the cutoff whose rows are all gone are of no more use
        self.forget = [(f"DELETE FROM temp.flight_mark WHERE tbl = '{t}' AND ts < ?1 AND max_id < coalesce("
                        f"(SELECT min(id) FROM \"{t}\" WHERE id > {self.floors[t]}), 9223372036854775807)")
                       for t in self.tables]

    def make_room(self, conn: sqlite3.Connection, room: int, incoming: int,
                  commit: Callable[[], None] | None = None) -> int | None:
        """The size bound's backstop, run by the writer before it inserts a piece of a batch: while
        the pages in use and the `incoming` bytes would pass `room`, delete the oldest rows, a
        mark's worth at a time (the rows of its tenth of a second), then, where one mark holds more
        than the room (a burst since the last mark), the older half of each table's rows. The
        feedback of SizeBound.next_keep keeps the window short enough that this rarely runs; a
        burst faster than it can react (the rings' backlog at a start on a loaded machine, a writer
        far behind) is still bounded. `commit`, where given, ends the transaction after each
        mark's or half's deletions: their pages reach the log in pieces the log's share holds, each
        checkpointed before the next. Returns the cutoff applied (ns; the newest mark's time for a
        cut by halves), None when nothing had to go."""
        page = conn.execute("PRAGMA page_size").fetchone()[0]

        def over() -> bool:
            used = (conn.execute("PRAGMA page_count").fetchone()[0]
                    - conn.execute("PRAGMA freelist_count").fetchone()[0]) * page
            return used + incoming > room

        if not over():
            return None
        cutoff = None
        for (ts,) in conn.execute("SELECT DISTINCT ts FROM temp.flight_mark ORDER BY ts").fetchall():
            for t, sql in self.prune.items():
                while True:
                    changes = conn.total_changes
                    conn.execute(sql, (ts, self.floors[t], self.chunk_rows))
                    if conn.total_changes == changes:
                        break
                    if commit is not None:
                        commit()
            cutoff = ts
            if not over():
                break
        for _ in range(8):
            if not over():
                break
            for t in self.tables:
                floor = self.floors[t]
                lo, hi = conn.execute(f'SELECT min(id), max(id) FROM "{t}" WHERE id > ?', (floor,)).fetchone()
                mid = (lo + hi) // 2 if lo is not None else -1
                while lo is not None and lo <= mid:
                    top = min(mid, lo + self.chunk_rows - 1)
                    conn.execute(f'DELETE FROM "{t}" WHERE id > ?1 AND id <= ?2', (floor, top))
                    if commit is not None:
                        commit()
                    lo = top + 1
            cutoff = conn.execute("SELECT max(ts) FROM temp.flight_mark").fetchone()[0] or cutoff
        if cutoff is not None:
            conn.execute(self.prune_loss, (cutoff, self.floors["loss"]))
        return cutoff if cutoff is not None else 0

    def statements(self, now_ns: int, cutoff_ns: int) -> list[tuple[str, tuple, bool]]:
        """This tick's statements, each with whether it is run until it deletes nothing (the
        prunes, chunk_rows at a time): note the ids written by `now_ns`, delete what was written
        before `cutoff_ns`, then the losses no row kept is of."""
        out: list[tuple[str, tuple, bool]] = [(self.mark, (now_ns,), False)]
        out += [(sql, (cutoff_ns, self.floors[t], self.chunk_rows), True) for t, sql in self.prune.items()]
        out.append((self.prune_loss, (cutoff_ns, self.floors["loss"]), False))
        out += [(sql, (cutoff_ns - 10_000_000_000,), False) for sql in self.forget]
        return out


@dataclass(frozen=True)
class SizeBound:
    """--max-size: the database and its write-ahead log together stay within `max_bytes` whatever
    the event rate. The log gets an eighth (checkpointed at half of it, truncated back to it) and as
    much again for what runs over it; the database the rest, and while its pages in use pass 85% of
    that the window kept is cut to what fits (the window spanned now times the room over the pages
    used, less a quarter for headroom), growing back towards --keep while they are under 60%. Where
    a burst comes faster than that, the writer deletes the oldest rows before it inserts
    (Retention.make_room, at 90%). Free pages beyond a tenth of the room, or where the file passes
    95% of it, are given back to the file system, a few at a time (moving pages writes them to the log)."""

    max_bytes: int
    keep_ns: int
    min_keep_ns: int = NS // 2  # the window is never cut below half a second

    @property
    def wal_bytes(self) -> int:
        return max(self.max_bytes // 8, 1 << 20)

    def pragmas(self, page_size: int) -> list[str]:
        return [SECURE_DELETE_FAST, f"PRAGMA journal_size_limit = {self.wal_bytes}",
                f"PRAGMA wal_autocheckpoint = {max(self.wal_bytes // 2 // page_size, 16)}"]

    def room(self, wal: int) -> int:
        """Bytes the database may take next to a log of `wal` bytes: the log's share is twice its
        size limit (a transaction on top of a log not yet checkpointed, a checkpoint held back
        by a reader), and where the log is larger still the database gets less."""
        return self.max_bytes - max(2 * self.wal_bytes, wal)

    def next_keep(self, keep_now: int, span_ns: int, used: int, wal: int, elapsed_ns: int,
                  lag_ns: int = 0) -> int:
        """The window to keep from now: `span_ns` is the time the rows kept span now (shorter than
        keep_now while the window fills), `elapsed_ns` the time since the last call, `lag_ns` how
        much recorded time is on its way to the database and not in `used` yet (the writer's
        queue): at the rate of the rows kept it takes room too."""
        room = self.room(wal)
        span = max(min(keep_now, span_ns), 1)
        coming = used * lag_ns // span
        if used + coming > 0.85 * room:
            return max(self.min_keep_ns, int(span * 0.75 * room / used) - lag_ns)
        if used + coming < 0.6 * room and keep_now < self.keep_ns:
            grow = keep_now * 0.05 * elapsed_ns / NS + elapsed_ns / 10  # 5% and 0.1 s a second
            return min(self.keep_ns, int(keep_now + grow))
        return keep_now

    def pages_to_give_back(self, used: int, free: int, wal: int, page_size: int, most: int = 64) -> int:
        """Free pages to give back now: beyond a tenth of the room, or where the file nears the room
        (above the writer's backstop, Retention.make_room at 90%, so that pages freed by its
        deletions are reused rather than given back and taken again: each page moved is written
        to the log)."""
        over = used + free - int(0.95 * self.room(wal))
        if free <= 0.1 * self.room(wal) and over <= 0:
            return 0
        return min(free // page_size, max(over // page_size, (free - self.room(wal) // 10) // page_size), most)


def used_bytes(conn: sqlite3.Connection) -> tuple[int, int]:
    """(bytes in pages holding data, bytes in free pages) of the database `conn` reads."""
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    count = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    return (count - free) * page, free * page


def wal_bytes(db: Path) -> int:
    """The write-ahead log's size on disk (0 when there is none)."""
    try:
        return db.with_name(db.name + "-wal").stat().st_size
    except OSError:
        return 0


def file_bytes(db: Path) -> int:
    """The database and its write-ahead log, as they take space on disk."""
    total = 0
    for p in (db, db.with_name(db.name + "-wal")):
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def save_window(src: Path, out: Path, session_id: int, start: int, end: int, *, trigger: str,
                detail: str, ts: int) -> dict:
    """Copy session `session_id`'s rows of [start, end] from recording `src` (live or not) into a
    new recording `out`: the events that overlap the window, every identity, stack, capability and
    library of the session, and the session row ending at `end`. Calls in flight at the save are
    the rows the session's drain wrote with open = 1 just before: they come along like any other.

    The copy is written next to `out` and renamed into place when complete: a reader never sees
    half an incident. Returns the incident row (with the copied row count).
    """
    if out.exists():
        raise UserError(f"{out} exists: pass another -o FILE (a dump never overwrites a recording)")
    if not out.parent.is_dir():
        raise UserError(f"folder {out.parent} does not exist: create it or pass another -o FILE")
    partial = out.with_name(out.name + ".partial")
    for p in (partial, partial.with_name(partial.name + "-wal"), partial.with_name(partial.name + "-shm")):
        p.unlink(missing_ok=True)
    open_store(partial, create=True).close()  # the schema and views of this tool version
    conn = sqlite3.connect(sqlite_uri(partial), uri=True)  # URIs on: the ATTACH below is one
    rows = 0
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("ATTACH DATABASE ? AS src", (sqlite_uri(src, mode="ro"),))
        if conn.execute("SELECT 1 FROM src.session WHERE id = ?", (session_id,)).fetchone() is None:
            raise UserError(f"no session {session_id} in {src}: pass the session a recorder wrote there")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO main.session SELECT * FROM src.session WHERE id = ?", (session_id,))
        conn.execute("UPDATE main.session SET started_ts = max(started_ts, ?), stopped_ts = ?, "
                     "status = 'complete' WHERE id = ?", (start, end, session_id))
        windowed = set(event_tables(conn))
        source_tables = set(tables(conn, "src"))
        # losses last: those of every second a copied row is of come along
        for name in sorted(tables(conn), key=lambda t: t == "loss"):
            if name in ("session", "incident") or name not in source_tables:
                continue
            cols = columns(conn, name)
            if cols != columns(conn, name, "src"):
                raise UserError(f"{src} has another schema than this recorder: dump it with the version that "
                                "recorded it")
            listed = ",".join(f'"{c}"' for c in cols)
            head = f'INSERT INTO main."{name}" ({listed}) SELECT {listed} FROM src."{name}"'
            if name == "loss":
                first = min([start, *(conn.execute(f'SELECT min(ts) FROM main."{t}"').fetchone()[0] or start
                                      for t in windowed if t != "loss")])
                cur = conn.execute(f"{head} WHERE session_id = :s AND ts <= :b AND ts + 1000000000 > :a",
                                   {"s": session_id, "a": first, "b": end})
            elif name in windowed:
                overlap = "ts + dur >= :a" if "dur" in cols else "ts >= :a"
                cur = conn.execute(f"{head} WHERE session_id = :s AND ts <= :b AND {overlap}",
                                   {"s": session_id, "a": start, "b": end})
            elif "session_id" in cols:
                cur = conn.execute(f"{head} WHERE session_id = ?", (session_id,))
            elif conn.execute(f'SELECT 1 FROM main."{name}" LIMIT 1').fetchone() is None:
                cur = conn.execute(head)  # stacks, interned text, the API tables
            else:
                continue  # filled by the migrations (rules, decodings): this tool's copy is there
            rows += max(cur.rowcount, 0)
        incident = {"session_id": session_id, "ts": ts, "trigger": trigger, "detail": detail,
                    "start_ts": start, "end_ts": end, "file": str(out)}
        conn.execute("INSERT INTO incident (session_id, ts, trigger, detail, start_ts, end_ts, file, own) "
                     "VALUES (:session_id, :ts, :trigger, :detail, :start_ts, :end_ts, :file, 1)", incident)
        conn.commit()
        conn.execute("DETACH DATABASE src")
    except BaseException:
        conn.close()
        for p in (partial, partial.with_name(partial.name + "-wal"), partial.with_name(partial.name + "-shm")):
            p.unlink(missing_ok=True)
        raise
    conn.close()
    with open_store(partial) as store:
        finish_recording(store, session_id)
    os.replace(partial, out)
    return {**incident, "rows": rows, "bytes": out.stat().st_size}


def finish_recording(store: Store, session_id: int) -> None:
    """What a stop does to a recording (indexes, baselines), then one file with no log beside it."""
    store.build_indexes()
    store.store_baselines(session_id)
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.conn.execute("PRAGMA journal_mode = DELETE")


def incidents_dir(db: Path) -> Path:
    """Where a flight recording's incidents go: <db>.incidents/ next to it."""
    return db.with_name(db.name + ".incidents")


def list_incidents(db: Path) -> list[dict]:
    """The incidents listed in recording `db`, oldest first (empty for a recording that has none)."""
    with open_store(db, readonly=True) as store:
        return store.query("SELECT * FROM incident ORDER BY id")
