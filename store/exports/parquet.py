"""`recorder export --parquet DIR`: a recording as Parquet, one folder per table, hive-partitioned
by node and session (DIR/TABLE/node=HOST/session=ID/part-0.parquet), so DuckDB, Spark, Trino or
ClickHouse read the recordings of a whole fleet as one data set. Columns keep the SQLite names;
next to the tables go the causal model's answers (stalls and their causes, reports, hangs:
store/exports/answers.py). DIR may be s3://BUCKET/PREFIX (store/objectstore.py). The schema is
in docs/export.md.

Rows are read with Python's sqlite3 and written with pyarrow; nothing else is needed. A table or
view name becomes a folder name: only names of the recorder's own shape (TABLE_NAME) are exported,
and every folder written or replaced is checked to lie inside DIR.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import quote

from store import objectstore
from store.errors import UserError
from store.exports import answers

BATCH = 200_000  # rows per Arrow batch
# The views a fleet query needs most, exported next to the tables (their SQL runs once per session).
VIEWS = ("thread_info", "step_all", "nccl_collective", "python_call_site", "block_latency")
SKIP = {"sqlite_stat1"}
PARTITION_COLUMNS = ("node", "session")
TABLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")  # the names the recorder's schema uses
DECLARED = {"INTEGER": "int64", "INT": "int64", "REAL": "float64", "TEXT": "string", "BLOB": "binary"}


def _arrow_type(declared: str):
    import pyarrow as pa

    return {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(), "binary": pa.binary()}.get(
        DECLARED.get(declared.upper().split("(")[0].strip(), ""))


def _column(values: list, declared: str):
    """One Arrow column: the declared type when SQLite has one, else what the values are."""
    import pyarrow as pa

    kind = _arrow_type(declared)
    if kind is not None:
        try:
            return pa.array(values, type=kind)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass  # SQLite stores what it is given: fall back to what the values are
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([None if v is None else str(v) for v in values], type=pa.string())


def _declared_types(conn: sqlite3.Connection, name: str) -> dict[str, str]:
    return {r[1]: r[2] or "" for r in conn.execute("SELECT * FROM pragma_table_info(?)", (name,))}


def export_parquet(db: str | os.PathLike, out: str | os.PathLike, session_id: int | None = None,
                   reports: int = answers.REPORTS) -> dict:
    """Every table (and the views in VIEWS) of every session of `db` (or one session), and the
    causal model's answers (store/exports/answers.py), into the folder `out`, or to the object
    store at `out` (s3://BUCKET/PREFIX, through the spool DB.spool/: store/objectstore.py)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise UserError("recorder export --parquet needs pyarrow: reinstall stall-recorder "
                        "(pip install -e .)") from None
    if reports < 0:
        raise UserError("--reports must be 0 or more: pass e.g. --reports 16")
    if not objectstore.is_url(out):
        return _export_local(db, Path(out), session_id, reports)
    url = str(out)
    objectstore.check_url(url)
    db = Path(db).resolve()
    payload = objectstore.new_entry(objectstore.spool_folder(db), "parquet")
    try:
        result = _export_local(db, payload, session_id, reports)
    except BaseException:
        shutil.rmtree(payload.parent, ignore_errors=True)
        raise
    shipped = objectstore.ship_folder(payload, url, replace_folders=True)
    result.update(out=url, shipped=shipped, spool=str(payload.parent.parent))
    return result


def ship_incident(path: Path, url: str, host: str, spool: Path) -> dict:
    """Upload a saved incident (`recorder start --keep ... --ship URL`) through `spool`: the
    recording itself to URL/incidents/HOST/NAME.db and its Parquet export (answers included) to
    URL/incidents/HOST/NAME/ (TABLE/node=HOST/session=ID/ under it, what `recorder cluster explain`
    and DuckDB read). Returns {'url', 'uploaded', 'pending', 'error', 'spool'}."""
    stem = path.name.removesuffix(".db")
    base = objectstore.join(url, "incidents", host)
    payload = objectstore.new_entry(spool, stem + "-parquet")
    try:
        _export_local(path, payload, None, answers.REPORTS)
    except BaseException:
        shutil.rmtree(payload.parent, ignore_errors=True)
        raise
    first = objectstore.ship_file(path, objectstore.join(base, path.name), spool, destination=url)
    if first["pending"]:  # the store is down: the export waits in the spool too, behind the file
        objectstore.enqueue(payload, objectstore.join(base, stem), replace_folders=True)
        return {**first, "pending": first["pending"] + 1, "url": objectstore.join(base, stem), "spool": str(spool)}
    second = objectstore.ship_folder(payload, objectstore.join(base, stem), replace_folders=True, destination=url)
    return {"url": objectstore.join(base, stem), "uploaded": first["uploaded"] + second["uploaded"],
            "pending": second["pending"], "error": second["error"], "spool": str(spool),
            "quarantined": first["quarantined"] + second["quarantined"], "waiting": second["waiting"]}


def _export_local(db: str | os.PathLike, out: Path, session_id: int | None, reports: int) -> dict:
    from store.db import open_store

    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file: pass a folder for --parquet (it is created if missing)")
    db = Path(db).resolve()
    summaries = {}
    import pyarrow.parquet as pq

    with open_store(db, readonly=True) as store:
        conn = store.conn
        sessions = conn.execute("SELECT id, hostname FROM session" + (" WHERE id = ?" if session_id else "")
                                + " ORDER BY id", (session_id,) if session_id else ()).fetchall()
        if not sessions:
            raise UserError(f"{db} holds no session {session_id or ''}".strip() + ": pass another --db or --session")
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                 if r[0] not in SKIP and not r[0].startswith("sqlite_")]
        # a name becomes a folder: one not of the recorder's shape ('../x', 'a/b') is left out, said
        tables = [n for n in names if TABLE_NAME.fullmatch(n)]
        skipped = [n for n in names if not TABLE_NAME.fullmatch(n)]
        views = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'")}
        tables_written = set(tables) | set(VIEWS)
        written: dict[str, int] = {}
        for sid, host in sessions:
            part = Path(f"node={quote(host, safe='')}") / f"session={sid}"
            for name in tables + [v for v in VIEWS if v in views]:
                types = _declared_types(conn, name)
                clash = set(types) & set(PARTITION_COLUMNS)
                if clash:
                    raise UserError(f"{name} has a column named {sorted(clash)[0]}, which the partition folders use")
                folder = _inside(out, name, part)
                if folder.exists():  # a new export of this node's session replaces the old one
                    shutil.rmtree(folder)
                cols = ", ".join('"{}"'.format(c.replace('"', '""')) for c in types)
                params: tuple[int, ...]
                if "session_id" in types:
                    sql, params = f'SELECT {cols} FROM "{name}" WHERE session_id = ?', (sid,)
                elif name == "session":
                    sql, params = f'SELECT {cols} FROM "{name}" WHERE id = ?', (sid,)
                else:  # a lookup table (API names, strings, stack frames): whole, in every session
                    sql, params = f'SELECT {cols} FROM "{name}"', ()
                # a view's columns have no declared type: its rows go in one batch, typed by their values
                n = _write_typed(conn, sql, params, folder, types,
                                 {"source_db": str(db)} if name == "session" else None,
                                 BATCH if name in tables else None)
                written[name] = written.get(name, 0) + n
            answer_tables = answers.session_answers(store, sid, str(db), reports)
            summary = answer_tables.pop("summary")
            summaries[sid] = summary
            answer_tables["export_meta"] = answers.arrow_table("export_meta", [{
                "schema_version": answers.SCHEMA_VERSION, "recorder_version": _version(),
                "recording_schema": store.migrated_from or conn.execute("PRAGMA user_version").fetchone()[0],
                "exported_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "source_db": str(db), **summary}])
            for name, table in answer_tables.items():
                if name in tables_written:
                    raise UserError(f"{db} has a table named {name}, which the export's answers use")
                folder = _inside(out, name, part)
                if folder.exists():
                    shutil.rmtree(folder)
                folder.mkdir(parents=True)
                pq.write_table(table, folder / "part-0.parquet", compression="zstd")
                written[name] = written.get(name, 0) + table.num_rows
    return {"db": str(db), "out": str(out.resolve()), "sessions": [s[0] for s in sessions],
            "nodes": sorted({s[1] for s in sessions}), "rows": written, "schema_version": answers.SCHEMA_VERSION,
            "answers": summaries, "skipped_tables": skipped}


def _inside(out: Path, name: str, part: Path) -> Path:
    """out/NAME/node=HOST/session=ID, refused unless it stays inside `out` (through links too)."""
    folder = out / name / part
    root = out.resolve()
    if not TABLE_NAME.fullmatch(name) or not folder.resolve().is_relative_to(root) or folder.resolve() == root:
        raise UserError(f"{name!r} would be written outside {out}: not exported (a table name must be letters, "
                        "digits and _, and no folder of the export may be a link out of it)")
    return folder


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stall-recorder")
    except PackageNotFoundError:
        return "unknown"


def _write_typed(conn: sqlite3.Connection, sql: str, params: tuple, folder: Path, types: dict[str, str],
                 extra: dict | None, batch_rows: int | None) -> int:
    """Rows of `sql` into folder/part-0.parquet, typed by the declared column types where SQLite has
    them; returns the row count (no rows still writes a file, with the columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cur = conn.execute(sql, params)
    names = [d[0] for d in cur.description]
    declared = [types.get(n, "") for n in names]
    folder.mkdir(parents=True, exist_ok=True)
    writer = None
    total = 0
    while True:
        rows = cur.fetchmany(batch_rows) if batch_rows else cur.fetchall()
        cols = list(zip(*rows, strict=True)) if rows else [() for _ in names]
        arrays = [_column(list(c), declared[i]) for i, c in enumerate(cols)]
        if extra:
            arrays += [pa.array([v] * len(rows), type=pa.string()) for v in extra.values()]
        batch = pa.table(arrays, names=names + list(extra or {}))
        if writer is None:
            writer = pq.ParquetWriter(folder / "part-0.parquet", batch.schema, compression="zstd")
        elif batch.schema != writer.schema:
            batch = batch.cast(writer.schema)
        writer.write_table(batch)
        total += len(rows)
        if not batch_rows or len(rows) < batch_rows:
            break
    writer.close()
    return total
