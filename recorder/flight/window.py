"""The window a flight recording keeps: what fell out of it deleted (store/flight/__init__.py
`Retention`), and under --max-size the window cut to what the bound holds (`SizeBound`), with the
writer's backstop before each piece it inserts.

The Window is made before the session's writer, whose limits it gives (`writer_limits()`: pieces
the log's share holds, the log's limit, the backstop), and started once the session is written.
"""

from __future__ import annotations

import sqlite3

from recorder.core.participant import SessionHandle
from recorder.flight.options import NS, FlightOptions
from store.db import WriterLimits
from store.flight import (
    SECURE_DELETE_FAST,
    Retention,
    SizeBound,
    event_tables,
    file_bytes,
    used_bytes,
    wal_bytes,
)

VACUUM_PAGES_PER_TICK = 1024  # 4 MB a second at 4 KiB pages
ROW_BYTES = 160  # what a row takes in the database, at most, for the backstop's estimate of a piece
SIZED_INTERVAL_NS = NS // 10  # under --max-size the window is kept at every batch, not every second


def vacuum_statements(pages: int) -> list[str]:
    """Statements that give `pages` free pages back to the file system. sqlite3 steps a statement
    that returns no rows once, and PRAGMA incremental_vacuum frees one page per step: one statement
    per page (a few microseconds each)."""
    return ["PRAGMA incremental_vacuum(1)"] * pages


class Window:
    """The window kept of one session, and its size bound."""

    def __init__(self, options: FlightOptions) -> None:
        self.options = options
        self.keep_now = options.keep_ns  # shrinks while the database is above --max-size
        self.bound = SizeBound(options.max_bytes, options.keep_ns) if options.max_bytes else None
        # a burst (the rings' backlog) in transactions the log's share holds (~100 bytes a row)
        self._limits = (WriterLimits(txn_rows=max(self.bound.wal_bytes // 4 // ROW_BYTES, 500),
                                     wal_limit=self.bound.wal_bytes, make_room=self._make_room)
                        if self.bound else WriterLimits())
        self._last_keep = 0
        self._cut: int | None = None  # the cutoff the writer's backstop last applied (ns), until keep() reads it
        self._pages: tuple[int, int] | None = None  # (bytes in use, bytes free) as the writer last saw them
        self._page_size = 4096
        self._last_handed = 0
        self._row_rate = 0.0  # rows a second handed to the writer, smoothed
        self.short_since: int | None = None  # the window is shorter than --keep because of the size
        self.shortest: int | None = None
        self._session: SessionHandle | None = None
        self._monitor: sqlite3.Connection | None = None
        self.retention: Retention  # from start() on
        self._room_made = False  # the backstop runs from start() on

    def writer_limits(self) -> WriterLimits:
        """The limits the session's writer is made with."""
        return self._limits

    def start(self, session: SessionHandle, monitor: sqlite3.Connection) -> None:
        """Once the session is written: the retention's marks from here on, the size bound's pragmas,
        the window's row."""
        self._session, self._monitor = session, monitor
        writer = session.writer
        tables = event_tables(monitor)
        # what earlier sessions left in the file is theirs: the window only applies to this one
        floors = {t: monitor.execute(f'SELECT coalesce(max(id), 0) FROM "{t}"').fetchone()[0] for t in tables}
        self.retention = Retention(tables, floors=floors)
        for sql in self.retention.setup:
            writer.execute(sql)
        if self.bound:
            page = self._page_size = monitor.execute("PRAGMA page_size").fetchone()[0]
            for sql in self.bound.pragmas(page):
                writer.execute(sql)
            assert self._limits.txn_rows is not None  # set with the bound
            self.retention.chunk_rows = self._limits.txn_rows  # a deletion's pages go to the log too
        else:
            writer.execute("PRAGMA journal_size_limit = 67108864")  # the log shrinks after a burst
            writer.execute(SECURE_DELETE_FAST)  # pruning writes no freed page to the log
        writer.execute("INSERT OR REPLACE INTO flight_window (session_id, keep_ns, max_bytes) VALUES (?, ?, ?)",
                       (session.session_id, self.options.keep_ns, self.options.max_bytes))
        writer.flush()  # the mark table exists before the first deletion runs
        writer.sync()
        self._room_made = self.bound is not None

    def stop(self) -> None:
        self._monitor = None

    def tick(self, now: int) -> None:
        """Once a second: the window kept (without a bound; with one at every batch), or how short
        the bound holds it noted."""
        if self.bound is None:
            self.keep(now)
        elif self.short_since is not None and self._session is not None:
            self._session.writer.execute(
                "UPDATE flight_window SET shortest_ns = ?1, first_short_ts = coalesce(first_short_ts, ?2), "
                "last_short_ts = ?3 WHERE session_id = ?4",
                (self.shortest, self.short_since, now, self._session.session_id))

    def keep(self, now: int) -> None:
        """Delete what fell out of the window: once a second from tick(), and under --max-size at
        every batch (the session's flush), so a high event rate cannot outrun the bound."""
        session = self._session
        if self._monitor is None or session is None:
            return
        writer = session.writer
        opts = self.options
        if self.bound is not None:
            elapsed = now - self._last_keep
            if elapsed < SIZED_INTERVAL_NS * 9 // 10:
                return
            # the pages as the writer saw them before its last insert (no read of the file here: a
            # reader ten times a second holds the log back from its checkpoints)
            used, free = self._pages or used_bytes(self._monitor)
            wal = wal_bytes(session.db_path)
            span = now - session.started_ts
            handed = writer.rows_handed + writer.pending()
            if self._last_keep:
                rate = (handed - self._last_handed) * NS / max(elapsed, 1)
                self._row_rate = rate if not self._row_rate else 0.7 * self._row_rate + 0.3 * rate
            self._last_handed = handed
            lag = int((handed - writer.rows_written) * NS / self._row_rate) if self._row_rate else 0
            cut, self._cut = self._cut, None
            if cut is not None:  # the backstop deleted rows the window still held: it is that short now
                self.keep_now = min(self.keep_now, max(self.bound.min_keep_ns, now - cut))
            self.keep_now = self.bound.next_keep(self.keep_now, span, used, wal, min(elapsed, NS), min(lag, 10 * NS))
            for sql in vacuum_statements(self.bound.pages_to_give_back(used, free, wal, self._page_size)):
                writer.execute(sql)
            if self.keep_now < opts.keep_ns:
                self.short_since = self.short_since or now
                self.shortest = min(self.shortest or self.keep_now, self.keep_now)
            elif self.short_since is not None:
                self.short_since = None
        else:
            used, free = used_bytes(self._monitor)
            if free > max(used // 4, 8 << 20):  # a burst left many pages free: give them back
                for sql in vacuum_statements(VACUUM_PAGES_PER_TICK):
                    writer.execute(sql)
        self._last_keep = now
        # deleted before the batch's rows are inserted: they reuse the pages freed
        for sql, params, until_done in self.retention.statements(now, now - self.keep_now):
            writer.execute_first(sql, params, until_done=until_done)

    def _make_room(self, conn: sqlite3.Connection, rows: int) -> None:
        """The writer's backstop under --max-size (Retention.make_room), before each piece it inserts;
        nothing before start() (the session's own rows at its start)."""
        bound, session = self.bound, self._session
        if not self._room_made or bound is None or session is None:
            return
        room = int(bound.room(wal_bytes(session.db_path)) * 0.9)
        cut = self.retention.make_room(conn, room, rows * ROW_BYTES, commit=session.writer.commit_piece)
        if cut is not None:
            self._cut = cut if self._cut is None else max(self._cut, cut)
        self._pages = used_bytes(conn)

    def status(self, now: int) -> dict:
        """The window's part of the status file."""
        window = None
        if self._monitor is not None:
            try:  # the oldest row kept, found by its id (no index on ts while recording)
                window = self._monitor.execute(
                    "SELECT ts FROM offcpu_interval WHERE id = (SELECT min(id) FROM offcpu_interval WHERE id > ?)",
                    (self.retention.floors.get("offcpu_interval", 0),)).fetchone()
                window = window[0] if window else None
            except sqlite3.Error:
                pass
        return {
            "kept_s": round(self.keep_now / NS, 1),
            # the window is shorter than --keep: --max-size holds no more at this event rate
            "short_by_size": self.short_since is not None,
            "shortest_kept_s": round(self.shortest / NS, 1) if self.shortest else None,
            "oldest_event_s": round((now - window) / NS, 1) if window else None,  # None: no event kept yet
            "db_file_bytes": file_bytes(self._session.db_path) if self._session else None,
        }
