"""Opening, checking and migrating a recording database, and writing rows into it in batches.

A database is ours when its `PRAGMA application_id` is APPLICATION_ID. Its `PRAGMA user_version` is
the number of the last migration applied from `store/migrations/NNNN_*.sql`. Views are not stored
migrations: they are (re)created from `store/views/*.sql` whenever a writer opens the database, and
as TEMP views on read-only connections, so a report always uses the views of the running tool.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sqlite_utils

from store.errors import StoreError

HERE = Path(__file__).resolve().parent
APPLICATION_ID = 0x53544C52  # 'STLR'
SQLITE_MAGIC = b"SQLite format 3\x00"


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


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise StoreError(f"{path} is a directory: pass a database file path with --db")
    if not path.exists():
        return
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except PermissionError:
        raise StoreError(f"cannot read {path}: run as a user that can, or pass another --db") from None
    if head and head != SQLITE_MAGIC:
        raise StoreError(f"{path} is not a SQLite database: pass a recording made by 'recorder' with --db")


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

    def __post_init__(self) -> None:
        self.db = sqlite_utils.Database(self.conn)

    def close(self) -> None:
        self.conn.close()

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
    try:
        if readonly:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        else:
            conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 5000")
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path} is not a usable SQLite database ({e}): pass another --db") from None
    if app_id != APPLICATION_ID and (tables or not create):
        conn.close()
        raise StoreError(
            f"{path} was not written by stall-recorder: pass a recording made by 'recorder' with --db"
        )
    if version > SCHEMA_VERSION:
        conn.close()
        raise StoreError(
            f"{path} has schema v{version}, newer than this recorder's v{SCHEMA_VERSION}: "
            "upgrade stall-recorder to read it"
        )
    store = Store(path, conn, readonly)
    if readonly:
        if version < SCHEMA_VERSION:
            conn.close()
            raise StoreError(
                f"{path} has schema v{version}, older than v{SCHEMA_VERSION}: open it once with "
                "'recorder migrate --db PATH' (writes) to upgrade"
            )
        _views_to(conn, temp=True)
        return store
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = OFF")  # referential integrity is the writer's job; cheaper
    migrate(conn, version)
    return store


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """Apply every migration above `version` and recreate the views, each step atomically."""
    if version == 0:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    for number, path in MIGRATIONS:
        if number <= version:
            continue
        script = path.read_text()
        try:
            conn.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {number};\nCOMMIT;")
        except sqlite3.Error as e:
            conn.rollback()
            raise StoreError(f"migration {path.name} failed ({e}): report this as a bug") from None
    conn.execute("BEGIN")
    _drop_views(conn)
    _views_to(conn, temp=False)
    conn.commit()


class Writer:
    """Batches rows per table and writes them with executemany, committing once per flush.

    Plain tuples in the hot path: rows are positional in the column order given to `table()`.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._sql: dict[str, str] = {}
        self._pending: dict[str, list[Sequence]] = {}
        self.rows_written = 0

    def table(self, name: str, columns: Iterable[str]) -> None:
        cols = list(columns)
        marks = ",".join("?" * len(cols))
        self._sql[name] = f"INSERT INTO {name} ({','.join(cols)}) VALUES ({marks})"
        self._pending.setdefault(name, [])

    def add(self, name: str, row: Sequence) -> None:
        self._pending[name].append(row)

    def extend(self, name: str, rows: list[Sequence]) -> None:
        self._pending[name].extend(rows)

    def pending(self) -> int:
        return sum(len(rows) for rows in self._pending.values())

    def flush(self) -> int:
        conn = self.store.conn
        written = 0
        for name, rows in self._pending.items():
            if rows:
                conn.executemany(self._sql[name], rows)
                written += len(rows)
                rows.clear()
        conn.commit()
        self.rows_written += written
        return written
