"""Opening, checking and migrating a recording database, and writing rows into it in batches.

A database is ours when its `PRAGMA application_id` is APPLICATION_ID. Its `PRAGMA user_version` is
the number of the last migration applied from `store/migrations/NNNN_*.sql`. Views are not stored
migrations: they are (re)created from `store/views/*.sql` whenever a writer opens the database, and
as TEMP views on read-only connections, so a report always uses the views of the running tool.
A read-only open of a recording of an earlier schema reads a migrated copy of it, never writing the
file (store/db/older.py); `recorder upgrade` migrates the file itself.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import queue
import shutil
import sqlite3
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import quote

import sqlite_utils

from store.errors import StoreError

HERE = Path(__file__).resolve().parent.parent  # store/: migrations/, views/ and indexes/ live there


def _bind_none(value: None) -> None:
    return value


# sqlite3 adapts every parameter that is not int, float, str or bytes: for None, without an adapter,
# that is a failed __conform__ lookup (an exception raised and cleared) per NULL bound, ~0.3 us each.
# With this (identity) adapter a 19-column cuda_call row with 5 NULLs binds ~1 us faster
# (docs/benchmarks.md); the value bound is the same NULL.
sqlite3.register_adapter(type(None), _bind_none)
APPLICATION_ID = 0x53544C52  # 'STLR'
ROWS_PER_STATEMENT = 50
# what one bad row makes SQLite (or the binding of its values) raise: it is refused alone
ROW_REFUSED = (OverflowError, UnicodeError, sqlite3.IntegrityError, sqlite3.DataError, sqlite3.InterfaceError)
SQLITE_MAGIC = b"SQLite format 3\x00"
# SQLite result codes (the sqlite3 module names them from Python 3.11 on)
SQLITE_IOERR, SQLITE_CORRUPT, SQLITE_FULL = 10, 11, 13


def _sqlite_library() -> str | None:
    """The libsqlite3 file the sqlite3 module uses, or None when it has SQLite built in."""
    import _sqlite3

    mapped = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(None, 5)[5:]
            if path and os.path.basename(path[0]).startswith("libsqlite3.so"):
                mapped.add(path[0])
    if len(mapped) != 1:
        return None
    lib = mapped.pop()
    try:
        from elftools.elf.dynamic import DynamicSection
        from elftools.elf.elffile import ELFFile

        def tags(path: str, kind: str) -> set[str]:
            with open(path, "rb") as f:
                return {getattr(tag, kind.lower()[3:]) for section in ELFFile(f).iter_sections()
                        if isinstance(section, DynamicSection)
                        for tag in section.iter_tags() if tag.entry.d_tag == kind}

        needed = tags(_sqlite3.__file__, "DT_NEEDED")
        soname = tags(lib, "DT_SONAME") or {os.path.basename(lib)}
    except (OSError, AttributeError, ImportError, ValueError):
        return None
    return lib if soname & needed else None


def packed_inserter(store: Store) -> Callable | None:
    """store.db._insert.insert bound to this process's SQLite when it is safe to use on
    `store.conn` (the extension is built, the sqlite3 module links SQLite as a shared library,
    CPython's connection object has its known layout, and SQLite confirms the handle is this
    store's), else None: Writer.extend_packed is then not offered and callers build tuples."""
    if store.readonly or not (3, 8) <= sys.version_info[:2] <= (3, 14):
        return None
    try:
        from store.db import _insert  # type: ignore[attr-defined]  # the C extension, built by setup.py when it can
    except ImportError:
        return None
    lib = _sqlite_library()
    if lib is None:
        return None
    try:
        _insert.bind(lib)
        name = _insert.filename(store.conn)
        if not name or os.path.realpath(name) != os.path.realpath(store.path):
            return None
        _insert.register(store.conn)
    except (OSError, RuntimeError, ValueError):
        return None
    return _insert.insert


def _numbered(folder: str) -> list[tuple[int, Path]]:
    out = []
    for path in sorted((HERE / folder).glob("*.sql")):
        number = path.name.split("_", 1)[0]
        if number.isdigit():
            out.append((int(number), path))
    return out


MIGRATIONS = _numbered("migrations")
SCHEMA_VERSION = MIGRATIONS[-1][0] if MIGRATIONS else 0


def view_sql() -> list[str]:
    """Every view definition, in file order (a view only uses views from earlier files or above)."""
    return [path.read_text() for _, path in _numbered("views")]


def index_sql() -> list[str]:
    return [path.read_text() for _, path in _numbered("indexes")]


def lock_path(db: Path) -> Path:
    """The file a recording process holds an exclusive flock on while it writes `db`."""
    return db.with_name(db.name + ".lock")


def lock_holder(db: Path) -> int | None:
    """pid of the recorder holding the database's lock (-1 if unreadable), or None when none does.

    The lock file is opened for reading only (a shared lock needs no more), so a user who may read
    a recording but not write the recorder's files (made as root) is told the same: any lock held
    by the recorder, which holds it exclusively, refuses the shared one."""
    try:
        f = lock_path(db).open("rb")
    except FileNotFoundError:
        return None
    except OSError:  # a lock this user cannot read: the recording still can be, as it stands
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def sqlite_uri(path: Path, **params: str) -> str:
    """A `file:` URI for `path` with every character SQLite's URI parser treats specially
    ('?', '#', '%') escaped, so the file opened is the one named."""
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"file:{quote(str(path.absolute()))}" + (f"?{query}" if query else "")


def being_written(db: Path) -> bool:
    """Whether a process holds the recording's lock, checked without creating the lock file."""
    try:
        f = lock_path(db).open("rb")
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _has_pending_log(db: Path) -> bool:
    """A write-ahead log or rollback journal with content: pages not yet in the main file."""
    for suffix in ("-wal", "-journal"):
        try:
            if os.stat(f"{db}{suffix}").st_size > 0:
                return True
        except OSError:
            continue
    return False


def _connect_readonly(path: Path) -> tuple[sqlite3.Connection, tempfile.TemporaryDirectory | None]:
    """A read-only connection that creates nothing next to the recording and works for a user
    who cannot write its folder (recordings are made as root and read by users).

    A complete recording (no writer, no log content, no -shm) is opened `immutable`: no locks, no
    -wal/-shm files. A recording still being written, or one whose log holds pages, is opened `mode=ro`,
    which reads the log through the writer's -shm; when that is refused (the -shm cannot be made
    or opened by this user), the main file and its log are copied to a private folder and the
    copy is read, so no recorded page is skipped.
    """
    # a -shm file means a connection may be open (or was, and died): a writer that holds no lock
    # could checkpoint into the main file under an immutable reader, so only a quiet file is immutable
    if not being_written(path) and not _has_pending_log(path) and not os.path.exists(f"{path}-shm"):
        return sqlite3.connect(sqlite_uri(path, mode="ro", immutable="1"), uri=True,
                               check_same_thread=False), None
    conn = sqlite3.connect(sqlite_uri(path, mode="ro"), uri=True, check_same_thread=False)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn, None
    except sqlite3.OperationalError as e:
        conn.close()
        if "readonly" not in str(e) and "unable to open" not in str(e):
            raise
    snapshot = tempfile.TemporaryDirectory(prefix="stall-recorder-")
    copy = Path(snapshot.name) / "recording.db"
    try:
        shutil.copyfile(path, copy)
        for suffix in ("-wal", "-journal"):
            if os.path.exists(f"{path}{suffix}"):
                shutil.copyfile(f"{path}{suffix}", f"{copy}{suffix}")
    except OSError as e:
        snapshot.cleanup()
        raise StoreError(f"cannot read {path} or its log ({e.strerror}): run as a user that can, "
                         "or pass another --db") from None
    return sqlite3.connect(sqlite_uri(copy, mode="ro"), uri=True, check_same_thread=False), snapshot


def _check_file(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise StoreError(f"cannot reach {path} ({e.strerror}): run as a user that can read it and its "
                         "folders, or pass another --db") from None
    if path.is_dir():
        raise StoreError(f"{path} is a directory: pass a database file path with --db")
    check_regular(path, mode)
    if not path.exists():
        return
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except PermissionError:
        raise StoreError(f"cannot read {path}: run as a user that can, or pass another --db") from None
    if head and head != SQLITE_MAGIC:
        raise StoreError(f"{path} is not a SQLite database: pass a recording made by 'recorder' with --db")


def check_regular(path: Path, mode: int | None = None) -> None:
    """A recording is a regular file: a device (/dev/null), a FIFO (opening it waits for a writer)
    or a socket is refused before anything opens it or writes beside it."""
    if mode is None:
        try:
            mode = path.stat().st_mode
        except OSError:
            return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise StoreError(f"{path} is {kind}, not a recording: pass a database file path with --db")


def _views_to(conn: sqlite3.Connection, temp: bool) -> None:
    for text in view_sql():
        if temp:
            text = text.replace("CREATE VIEW", "CREATE TEMP VIEW")
        conn.executescript(text)


def _drop_views(conn: sqlite3.Connection) -> None:
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'")]
    for name in names:
        conn.execute(f'DROP VIEW IF EXISTS "{name}"')


@dataclass
class Store:
    """An open recording database."""

    path: Path
    conn: sqlite3.Connection
    readonly: bool
    db: sqlite_utils.Database = field(init=False)
    snapshot: tempfile.TemporaryDirectory | None = None  # a private copy read instead of `path`
    # the file SQLite reads: `path`, or a migrated copy of it when it was recorded by an earlier version
    read_path: Path = field(init=False)
    migrated_from: int | None = field(init=False, default=None)  # that version's schema

    def __post_init__(self) -> None:
        self.db = sqlite_utils.Database(self.conn)
        self.read_path = self.path

    def close(self) -> None:
        self.conn.close()
        if self.snapshot is not None:
            self.snapshot.cleanup()
            self.snapshot = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- small helpers used by the recorder and the queries --------------------------------------
    def query(self, sql: str, params: Sequence | dict = ()) -> list[dict]:
        cur = self.conn.execute(sql, params)
        names = [d[0] for d in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def one(self, sql: str, params: Sequence | dict = ()) -> dict | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def row(self, sql: str, params: Sequence | dict = ()) -> dict:
        """The first row of a query that always gives one (an aggregate, a rule table)."""
        rows = self.query(sql, params)
        if not rows:
            raise StoreError(f"no row where one is always expected: {sql}")
        return rows[0]

    def store_baselines(self, session_id: int) -> None:
        """Compute the session's baselines once (at stop) instead of at every report."""
        self.conn.execute("DELETE FROM cuda_baseline_stored WHERE session_id = ?", (session_id,))
        self.conn.execute(
            "INSERT INTO cuda_baseline_stored (session_id, family, size_class, calls, median_dur)"
            " SELECT session_id, family, size_class, calls, median_dur FROM cuda_baseline WHERE session_id = ?",
            (session_id,))
        self.store_links(session_id)
        self.conn.commit()

    def store_links(self, session_id: int) -> None:
        """Write the session's causal links and step causes (views causal_link_live, step_cause_live)
        into causal_link_stored and step_cause_stored, which the causal_link and step_cause views
        then read instead of joining every layer again. Runs after the
        baselines (a slow call is slow against them) and the indexes (the joins use them)."""
        self.conn.execute("DELETE FROM causal_link_session WHERE session_id = ?", (session_id,))
        self.conn.execute("DELETE FROM causal_link_stored WHERE session_id = ?", (session_id,))
        links = self.conn.execute(
            "INSERT INTO causal_link_stored (session_id, from_table, from_id, relation, to_table, to_id, dur)"
            " SELECT session_id, from_table, from_id, relation, to_table, to_id, dur FROM causal_link_live"
            " WHERE session_id = ?", (session_id,)).rowcount
        self.conn.execute("DELETE FROM step_cause_stored WHERE session_id = ?", (session_id,))
        self.conn.execute("INSERT INTO step_cause_stored (session_id, step_mark_id, cause, detail, dur, events)"
                          " SELECT m.session_id, c.step_mark_id, c.cause, c.detail, c.dur, c.events FROM step_mark m"
                          " JOIN step_cause_live c ON c.step_mark_id = m.id WHERE m.session_id = ?", (session_id,))
        self.conn.execute(
            "INSERT INTO causal_link_session (session_id, links, stored_ts) SELECT id, ?,"
            " coalesce(stopped_ts, written_ts, started_ts) FROM session WHERE id = ?", (links, session_id))

    def build_indexes(self) -> None:
        for text in index_sql():
            self.conn.executescript(text)
        self.conn.execute("ANALYZE")
        self.conn.commit()


def open_store(path: str | os.PathLike, *, create: bool = False, readonly: bool = False) -> Store:
    """Open a recording database, creating and migrating it when `create` is set.

    Raises StoreError with a one-line message for a missing, foreign, corrupt or newer database
    and for a path that cannot be written.
    """
    path = Path(path)
    _check_file(path)
    if not path.exists() and not create:
        raise StoreError(f"no recording at {path}: record one with 'recorder start' or pass --db")
    if create and not path.exists():
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise StoreError(f"folder {parent} does not exist: create it or pass another --db")
        if not os.access(parent, os.W_OK):
            raise StoreError(f"cannot write in {parent}: pass a writable --db path")
    elif not readonly and not os.access(path, os.W_OK):
        raise StoreError(f"cannot write {path}: run with permission to write it or pass another --db")
    snapshot = None
    conn = None
    try:
        if readonly:
            conn, snapshot = _connect_readonly(path)
        else:
            conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 5000")
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.DatabaseError as e:
        if conn is not None:
            conn.close()
        if snapshot is not None:
            snapshot.cleanup()
        if damaged(e):
            raise StoreError(damaged_message(path, e)) from None
        raise StoreError(f"{path} is not a usable SQLite database ({e}): pass another --db") from None
    store = Store(path, conn, readonly, snapshot)
    if app_id != APPLICATION_ID and (tables or not create):
        store.close()
        raise StoreError(
            f"{path} was not written by stall-recorder: pass a recording made by 'recorder' with --db"
        )
    if version > SCHEMA_VERSION:
        store.close()
        raise StoreError(
            f"{path} has schema v{version}, newer than this recorder's v{SCHEMA_VERSION}: "
            "upgrade stall-recorder to read it"
        )
    if readonly:
        if version < SCHEMA_VERSION:
            store.close()
            return _open_older(path, version)
        _views_to(conn, temp=True)
        return store
    if not tables:
        # before the first table or never: a flight recording (recorder start --keep) deletes old rows
        # all the time, and gives the free pages back with PRAGMA incremental_vacuum
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = OFF")  # referential integrity is the writer's job; cheaper
    migrate(conn, version)
    return store


def _open_older(path: Path, version: int) -> Store:
    """A recording of an earlier schema, read as it is: through a migrated copy of it in a private
    cache folder (store/db/older.py), never by writing the file. The Store names `path`; its
    `read_path` is the copy."""
    from store.db.older import readable_copy

    copy, temporary = readable_copy(path, version, SCHEMA_VERSION)
    try:
        conn, snapshot = _connect_readonly(copy)
    except BaseException:
        if temporary is not None:
            temporary.cleanup()
        raise
    if snapshot is not None:  # only a copy still being written is snapshotted, and ours is not
        snapshot.cleanup()
    conn.execute("PRAGMA busy_timeout = 5000")
    _views_to(conn, temp=True)
    store = Store(path, conn, True, temporary)
    store.read_path = copy
    store.migrated_from = version
    return store


def migrate(conn: sqlite3.Connection, version: int, name: str | os.PathLike | None = None) -> None:
    """Apply every migration above `version` and recreate the views, each step atomically.
    `name`: the recording's path, for the message when its pages are damaged."""
    if version == 0:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    for number, path in MIGRATIONS:
        if number <= version:
            continue
        script = path.read_text()
        try:
            conn.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {number};\nCOMMIT;")
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.rollback()
            if damaged(e):
                raise StoreError(damaged_message(name or "the recording", e)) from None
            if cannot_write(e):
                raise StoreError(f"migration {path.name} of {name or 'the recording'} could not be written ({e}): "
                                 "free space where it is (or set STALL_RECORDER_CACHE_DIR for a reader's copy)"
                                 ) from None
            raise StoreError(f"migration {path.name} failed ({e}): report this as a bug") from None
    conn.execute("BEGIN")
    _drop_views(conn)
    _views_to(conn, temp=False)
    conn.commit()


def damaged(e: sqlite3.Error) -> bool:
    """Whether an error says a recording's pages are damaged (a file that is no database at all
    is not: that is said as such)."""
    code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
    return code == SQLITE_CORRUPT or "database disk image is malformed" in str(e)


def damaged_message(path: str | os.PathLike, e: sqlite3.Error) -> str:
    return (f"{path} cannot be read ({e}): check it with 'sqlite3 {path} \"PRAGMA integrity_check\"'; "
            f"'sqlite3 {path} .recover' saves the rows that are intact")


def cannot_write(e: sqlite3.Error) -> bool:
    """Whether an error means the file system took no more: full, or failing writes."""
    code = getattr(e, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in (SQLITE_FULL, SQLITE_IOERR)


@dataclass(frozen=True)
class WriterLimits:
    """How a Writer bounds what it writes, given where it is made (a size bound's, store/flight/__init__.py;
    none by default)."""

    # at most this many rows per transaction (None: a batch is one): a bounded write-ahead log
    txn_rows: int | None = None
    # the write-ahead log's size past which a commit checkpoints it and truncates it at once
    # (a reader that held it back from the automatic checkpoints lets it grow), None: never
    wal_limit: int | None = None
    # called (with the writer's connection and the piece's row count) before each piece of a
    # batch is inserted: where a size bound deletes old rows to make room
    make_room: Callable[[sqlite3.Connection, int], None] | None = None


class Writer:
    """Batches rows per table and writes them with executemany, one transaction per flush.

    Plain tuples in the hot path: rows are positional in the column order given to `table()`.
    With `background=True` a flush hands the batch to a writer thread and returns at once, so the
    recorder keeps draining its ring buffers while SQLite works (sqlite3 releases the GIL while it
    steps a statement). At most `max_batches` batches wait; a further flush blocks, which is the
    back-pressure that shows up as counted ring-buffer drops instead of unbounded memory. Every
    write to the database during a session goes through here, rows and statements in order.
    """

    def __init__(self, store: Store, background: bool = False, max_batches: int = 8,
                 limits: WriterLimits | None = None) -> None:
        self.store = store
        limits = limits or WriterLimits()
        self._sql: dict[str, str] = {}
        self._multi_sql: dict[str, str] = {}
        self._pending: dict[str, list[Sequence]] = {}
        self._columns: dict[str, list[str]] = {}
        self._packed: dict[str, list[bytes]] = {}
        self._programs: dict[str, tuple[str, int, str]] = {}  # name -> (program, slots, INSERT)
        self._insert_packed = packed_inserter(store)
        self._statements: list[tuple[str, Sequence]] = []
        self._first: list[tuple[str, Sequence, bool]] = []
        # the limits (WriterLimits) hold for the writer's life: set here, never afterwards
        self.txn_rows: Final = limits.txn_rows
        self.make_room: Final = limits.make_room
        self.wal_limit: Final = limits.wal_limit
        # why the writer stopped writing (the disk was full, or would not take a write), and when
        # (CLOCK_MONOTONIC ns) it last committed: later batches are counted in rows_not_written
        self.stopped: str | None = None
        self.last_commit_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.rows_not_written = 0
        self.rows_written = 0
        # rows SQLite refused (_insert_rows), and the first reason per table
        self.rows_refused = 0
        self.refused: dict[str, str] = {}
        self.rows_handed = 0  # rows_handed - rows_written: handed to the writer thread, not yet committed
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_batches)
            self._thread = threading.Thread(target=self._run, name="stall-writer", daemon=True)
            self._thread.start()

    def table(self, name: str, columns: Iterable[str]) -> None:
        cols = self._columns[name] = list(columns)
        head = f"INSERT INTO {name} ({','.join(cols)}) VALUES "
        one = "(" + ",".join("?" * len(cols)) + ")"
        self._sql[name] = head + one
        # One statement inserting ROWS_PER_STATEMENT rows costs a third less per row than as many
        # one-row statements (measured: 197k -> 277k rows/s for cuda_call).
        self._multi_sql[name] = head + ",".join([one] * ROWS_PER_STATEMENT)
        self._pending.setdefault(name, [])

    @property
    def packs(self) -> bool:
        """Whether extend_packed() can be used (store.db._insert is built and safe here)."""
        return self._insert_packed is not None

    def packed_table(self, name: str, program: str) -> None:
        """Declare how packed rows of table `name` (declared with table()) become its columns:
        a letter per column, 'i' one integer slot, 'd' three slots as 'x,y,z' text
        (store/db/_insert.c)."""
        cols = self._columns[name]
        if len(program) != len(cols):
            raise ValueError(f"{name}: the program has {len(program)} columns, the table {len(cols)}")
        select = ",".join(f"c{i}" for i in range(len(program)))
        self._programs[name] = (program, sum(3 if c == "d" else 1 for c in program),
                                f"INSERT INTO {name} ({','.join(cols)}) SELECT {select} FROM stall_packed(?1)")
        self._packed.setdefault(name, [])

    def extend_packed(self, name: str, packed: bytes) -> None:
        """Add packed rows (per row: the program's int64 slots, then a NULL mask)."""
        if packed:
            self._packed[name].append(packed)

    def add(self, name: str, row: Sequence) -> None:
        self._pending[name].append(row)

    def extend(self, name: str, rows: Iterable[Sequence]) -> None:
        self._pending[name].extend(rows)

    def execute(self, sql: str, params: Sequence = ()) -> None:
        """Queue a statement, run after this batch's rows in the same transaction."""
        self._statements.append((sql, params))

    def execute_first(self, sql: str, params: Sequence = (), *, until_done: bool = False) -> None:
        """Queue a statement run before this batch's rows, in the same transaction: deletions whose
        pages the rows then reuse instead of growing the file. `until_done`: a deletion of a bounded
        number of rows, run again until it deletes none, each run its own transaction under a
        wal_limit (a deletion writes the pages it frees to the log)."""
        self._first.append((sql, params, until_done))

    def pending(self) -> int:
        return sum(len(rows) for rows in self._pending.values()) + sum(
            self._packed_rows(name, sum(map(len, chunks))) for name, chunks in self._packed.items())

    def _packed_rows(self, name: str, nbytes: int) -> int:
        return nbytes // ((self._programs[name][1] + 1) * 8)  # slots and the NULL mask, 8 bytes each

    def flush(self) -> int:
        """Write (or hand over) everything added since the last flush; returns the row count."""
        if self._error:
            raise self._error
        batch: list[tuple[str, list[Sequence] | bytes]] = [(n, rows) for n, rows in self._pending.items() if rows]
        count = sum(len(rows) for _, rows in batch)
        for name, chunks in self._packed.items():
            if chunks:
                packed = b"".join(chunks)
                self._packed[name] = []
                batch.append((name, packed))
                count += self._packed_rows(name, len(packed))
        statements: list[tuple[str, Sequence] | tuple[str, Sequence, bool] | None] = list(self._statements)
        self._statements = []
        if self._first:
            statements = [None, *self._first, None, *statements]  # None brackets the ones run first
            self._first = []
        for name in self._pending:
            if self._pending[name]:
                self._pending[name] = []
        if not batch and not statements:
            return 0
        self.rows_handed += count
        if self._queue is None:
            self._write_unless_stopped(batch, statements, count)
        else:
            self._queue.put((batch, statements, count))
        return count

    def sync(self) -> None:
        """Wait until every batch handed over is committed."""
        if self._queue is not None:
            self._queue.join()
        if self._error:
            raise self._error

    def close(self) -> None:
        self.flush()
        self.sync()
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None

    def _write(self, batch: list, statements: list) -> None:
        conn = self.store.conn
        first: list[tuple[str, Sequence, bool]] = []
        if statements and statements[0] is None:
            end = statements.index(None, 1)
            first, statements = statements[1:end], statements[end + 1:]
        for sql, params, until_done in first:
            while True:
                changes = conn.total_changes
                conn.execute(sql, params)
                if not until_done or conn.total_changes == changes:
                    break
                if self.wal_limit is not None:
                    # a window cut short at once deletes many rows: their pages reach the log in
                    # pieces, each checkpointed before the next (a transaction's pages are one append)
                    self.commit_piece()
        written = 0
        for name, rows in self._pieces(batch):
            if self.make_room is not None:
                changes = conn.total_changes
                self.make_room(conn, self._packed_rows(name, len(rows)) if isinstance(rows, bytes) else len(rows))
                if conn.total_changes != changes:  # the backstop deleted: the rows so far and that, committed
                    self.commit_piece(written)
                    written = 0
            if isinstance(rows, bytes):  # packed (extend_packed); the GIL is released inside
                program, slots, sql = self._programs[name]
                assert self._insert_packed is not None  # packed rows are offered only with the inserter
                written += self._insert_packed(conn, sql, program, slots, rows)
            else:
                written += self._insert_rows(conn, name, rows)
            if self.txn_rows and written >= self.txn_rows:
                conn.commit()
                self._committed(written)
                written = 0
        for sql, params in statements:
            conn.execute(sql, params)
        conn.commit()
        self._committed(written)

    def _insert_rows(self, conn: sqlite3.Connection, name: str, rows: list[Sequence]) -> int:
        """Insert one table's rows (ROWS_PER_STATEMENT to a statement); returns how many went in.
        A row SQLite refuses (an integer past int64, a text it cannot encode, a constraint) costs
        only itself: the piece is rolled back to its savepoint and inserted row by row, the refused
        rows counted in rows_refused and said once per table. The recorder reads values from
        processes it does not control; one of them must not end the writing."""
        k = ROWS_PER_STATEMENT
        if not conn.in_transaction:
            conn.execute("BEGIN")  # else the savepoint would be a transaction of its own
        conn.execute("SAVEPOINT stall_rows")
        try:
            full = len(rows) // k * k
            if full:
                chain = itertools.chain.from_iterable
                conn.executemany(self._multi_sql[name], [tuple(chain(rows[i:i + k])) for i in range(0, full, k)])
            if full < len(rows):
                conn.executemany(self._sql[name], rows[full:])
            good = len(rows)
        except ROW_REFUSED:
            conn.execute("ROLLBACK TO stall_rows")
            good = 0
            for row in rows:
                try:
                    conn.execute(self._sql[name], row)
                    good += 1
                except ROW_REFUSED as e:
                    self._refused(name, e)
        conn.execute("RELEASE stall_rows")
        return good

    def _refused(self, table: str, e: BaseException) -> None:
        self.rows_refused += 1
        if table not in self.refused:
            self.refused[table] = why = f"{type(e).__name__}: {e}"
            print(f"recorder: a {table} row was not written ({why}); the recording goes on, such rows are "
                  "counted", flush=True)

    def commit_piece(self, rows: int = 0) -> None:
        """Commit what the writer's transaction holds so far (`rows` of it inserted rows), and
        checkpoint the log where it passed wal_limit: under a size bound a transaction of
        deletions is kept apart from the inserts, so that no single append outgrows the log's share."""
        conn = self.store.conn
        if conn.in_transaction:
            conn.commit()
        self._committed(rows)

    def _committed(self, rows: int) -> None:
        self.rows_written += rows
        self.last_commit_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self.wal_limit is not None:
            try:
                size = os.stat(f"{self.store.path}-wal").st_size
            except OSError:
                size = 0
            if size > self.wal_limit:
                # readers reading an older snapshot are waited for: briefly (the next commit tries
                # again), and as long as they take once the log is half as large again as its limit
                # (the bound is a promise; the ring buffers hold the events meanwhile, or count them)
                conn = self.store.conn
                conn.execute(f"PRAGMA busy_timeout = {200 if size <= self.wal_limit * 3 // 2 else 5000}")
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                except sqlite3.OperationalError as e:
                    if cannot_write(e):
                        raise
                finally:
                    conn.execute("PRAGMA busy_timeout = 5000")

    def _write_unless_stopped(self, batch: list, statements: list, count: int) -> None:
        """_write(), or count the rows once the disk stopped taking them: a full disk ends the
        writing, not the recorder (it says why and when; what was committed stays readable)."""
        if self.stopped is not None:
            self.rows_not_written += count
            return
        try:
            self._write(batch, statements)
        except sqlite3.OperationalError as e:
            if not cannot_write(e):
                raise
            try:
                self.store.conn.rollback()
            except sqlite3.Error:
                pass
            self.rows_not_written += count
            full = getattr(e, "sqlite_errorcode", 0) == SQLITE_FULL
            self.stopped = f"disk full ({e})" if full else f"cannot write ({e})"

    def _pieces(self, batch: list) -> Iterable[tuple[str, list | bytes]]:
        """The batch's rows, in order, in pieces of at most txn_rows rows when that is set."""
        n = self.txn_rows
        for name, rows in batch:
            if not n:
                yield name, rows
                continue
            size = (self._programs[name][1] + 1) * 8 if isinstance(rows, bytes) else 1
            step = n * size
            for i in range(0, len(rows), step):
                yield name, rows[i:i + step]

    def _run(self) -> None:
        assert self._queue is not None  # the thread runs only with a queue
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._write_unless_stopped(*item)
            except BaseException as e:  # surfaced to the recorder on its next flush or sync
                self._error = e
                try:
                    self.store.conn.rollback()
                except sqlite3.Error:
                    pass
            finally:
                self._queue.task_done()
