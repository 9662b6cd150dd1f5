"""`recorder cluster`: one step explained across the ranks of a multi-host job.

Real jobs span hosts and each host records itself (one SQLite file per node, possibly several
ranks each). This module reads many recordings without copying them into one file, lines their
ranks up through the NCCL communicator (`nccl_comm.comm_hash` is equal on every rank) and the step
numbers the ranks mark, names the rank(s) that entered the step's collective late (or never),
and asks each late rank's own recording why (`store.report.build.explain`).

Exports are input from whoever can write the folder or the bucket: only the layout the project
writes is read (store/objectstore.py), within ExportLimits (files, bytes, DuckDB's memory and
spill), by a DuckDB that can read only the named exports and its own private folder and loads no
extension; an explanation an export stored is read through a fixed schema (EXPLANATION_FIELDS), and
the recording an export names (`source_db`) is opened only when it is the same recording.

The engine is DuckDB, embedded: the few columns the alignment needs (communicators, collective
calls, stream synchronisations, step marks) are read from each SQLite file with Python's sqlite3
into Arrow tables, or straight from a Parquet export (`recorder export --parquet`, hive folders
node=/session=), and every cross-rank query runs in DuckDB. No DuckDB extension is loaded, so
nothing is downloaded (extensions are neither installed nor loaded automatically).

Clocks. Each host has its own CLOCK_MONOTONIC. A row's wall time is ts + the session's
wall_offset_ns (taken from the host's realtime clock, so as good as its NTP/PTP sync). That is
then refined with the collectives themselves: every rank leaves a collective at nearly the same
moment (it completes when the last rank arrives), so each recording gets the correction that
lines its ranks' exits up with the other recordings' (the median over all its collectives). What
is left, the spread of exits after correction, is reported as the residual skew, and lateness
smaller than a few times it is not attributed to anyone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import stat
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from store import objectstore
from store.analysis import jobs
from store.cluster import device
from store.db import damaged, damaged_message
from store.db.rules import default_stall_rule
from store.errors import UserError
from store.report.rank import materialise_nccl as _materialise_nccl

NS = 1_000_000_000
LATE_SHARE = 0.5  # a rank is late when it entered at least half as late as the latest one ...
LATE_MIN_NS = 1_000_000  # ... and at least 1 ms after the first rank ...
USUAL_SPREAD = 2.0  # ... and twice the usual spread of arrivals
SKEW_REFUSE = 2.0  # lateness below this many residual skews: no rank is named
SKEW_WARN = 5.0  # below this many: named, with a warning
EXPLAINED = 8  # late or hung ranks whose own recordings are asked why
NAMED = 64  # late ranks listed by name
ITERATIONS = 4  # rounds of the collective-based clock refinement
SYNC_FAMILIES = ("cudaStreamSynchronize", "cuStreamSynchronize")
ENV_COMM_HASH = -1  # the communicator of ranks known by their environment only (its init not recorded)

# What each input relation holds (the same columns from SQLite files and from Parquet exports).
RELATIONS = {
    "rec": "rec INTEGER, node VARCHAR, session_id BIGINT, source VARCHAR, db VARCHAR, wall_offset_ns BIGINT,"
           " started_ts BIGINT, stopped_ts BIGINT, boot_id VARCHAR",
    "comm": "rec INTEGER, process_id BIGINT, pid BIGINT, handle BIGINT, comm_hash BIGINT, rank INTEGER,"
            " nranks INTEGER",
    "coll": "rec INTEGER, process_id BIGINT, thread_id BIGINT, handle BIGINT, api VARCHAR, ts BIGINT, dur BIGINT,"
            " stream BIGINT",
    "sync": "rec INTEGER, thread_id BIGINT, stream BIGINT, ts BIGINT, dur BIGINT",
    "mark": "rec INTEGER, process_id BIGINT, step BIGINT, ts BIGINT, inferred INTEGER, exit_ts BIGINT",
}

# The explanations a Parquet export stored (its `stall` table), read only from exports.
ANSWER = "rec INTEGER, process_id BIGINT, step BIGINT, explanation VARCHAR"
# The tables of an export this module reads (those copied from an object store).
PARQUET_TABLES = ("session", "process", "thread", "nccl_comm", "nccl_call", "nccl_api", "cuda_call", "cuda_api",
                  "step_mark", "stall")

# An explanation an export stored (its `stall` table's JSON, written by store/report/rank.py): what
# is read of it, each key with its type and longest length; other keys are dropped.
EXPLANATION_FIELDS: dict[str, tuple[str, int]] = {
    "available": ("bool", 0), "stall": ("bool", 0), "step_dur_ns": ("int", 0), "symptom": ("str", 512),
    "summary": ("str", 1024), "kind": ("name", 64), "device": ("str", 128), "python": ("str", 512),
    "kernel_path": ("list", 256), "utc": ("utc", 40), "next_actions": ("list", 512),
}
EXPLANATION_LIST_ITEMS = 32
NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
UTC = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]{2,20}Z?")
EXPORT_TEXT_MAX = 512  # longest host name or path taken from an export


# The SQLite side: one query per relation, per session, its columns named a0, a1, ... in the order
# of RELATIONS (after rec).
SQLITE_QUERIES = {
    "comm": "SELECT k.process_id a0, p.pid a1, k.handle a2, k.comm_hash a3, k.rank a4, k.nranks a5 FROM nccl_comm k"
            " JOIN process p ON p.id = k.process_id WHERE k.session_id = ?",
    # A job attached to after its ncclCommInitRank has collectives on a communicator the recording
    # never saw created: a process that used exactly one, and carries RANK and WORLD_SIZE (schema
    # v20), is that communicator's rank by its environment (comm_hash ENV_COMM_HASH)
    "comm_from_environment":
            "SELECT k.process_id a0, p.pid a1, k.handle a2, k.comm_hash a3, k.rank a4, k.nranks a5 FROM nccl_comm k"
            " JOIN process p ON p.id = k.process_id WHERE k.session_id = ?1"
            " UNION ALL SELECT x.process_id, p.pid, min(x.handle), {env_comm}, p.job_rank, p.job_world_size"
            " FROM (SELECT DISTINCT t.process_id, c.handle FROM nccl_call c JOIN thread t ON t.id = c.thread_id"
            "       WHERE c.session_id = ?1) x JOIN process p ON p.id = x.process_id"
            " WHERE p.job_rank IS NOT NULL AND p.job_world_size IS NOT NULL"
            " AND NOT EXISTS (SELECT 1 FROM nccl_comm k WHERE k.session_id = ?1 AND k.process_id = x.process_id)"
            " GROUP BY x.process_id HAVING count(*) = 1",
    # plain scans, no per-row lookups: a recording that did not stop cleanly has no indexes
    "coll": "SELECT t.process_id a0, c.thread_id a1, c.handle a2, a.name a3, c.ts a4, c.dur a5, c.stream a6"
            " FROM nccl_call c JOIN nccl_api a ON a.id = c.api_id JOIN thread t ON t.id = c.thread_id"
            " WHERE c.session_id = ? AND a.kind = 'collective'",
    "sync": "SELECT c.thread_id a0, c.stream a1, c.ts a2, c.dur a3 FROM cuda_call c"
            " WHERE c.session_id = ? AND c.api_id IN ({syncs})",
    # one row per mark; a step marked by several threads of a process is grouped in DuckDB (cheaper)
    "mark": "SELECT t.process_id a0, m.step a1, m.ts a2, m.inferred a3, coalesce(t.exit_ts, p.exit_ts) a4"
            " FROM step_mark m JOIN thread t ON t.id = m.thread_id LEFT JOIN process p ON p.id = t.process_id"
            " WHERE m.session_id = ?",
}


def _columns(relation: str) -> list[tuple[str, str]]:
    return [(name, kind) for name, kind in (c.split() for c in RELATIONS[relation].split(","))]


def _as_csv(relation: str, conn: sqlite3.Connection) -> str:
    """The relation's query returning its rows as one CSV text: SQLite formats them in C and Arrow
    parses them in C, instead of a Python tuple per row (millions of rows for a large job)."""
    n = len(_columns(relation)) - 1
    query = SQLITE_QUERIES[relation]
    if relation == "comm" and "job_rank" in {r[1] for r in conn.execute("PRAGMA table_info(process)")}:
        query = SQLITE_QUERIES["comm_from_environment"]
    line = " || ',' || ".join(f"coalesce(a{i}, '')" for i in range(n))
    ids = {"syncs": f"SELECT id FROM cuda_api WHERE family IN {SYNC_FAMILIES!r}"}
    lists = {k: ",".join(str(r[0]) for r in conn.execute(sql)) or "-1" for k, sql in ids.items()}
    return f"SELECT group_concat({line}, char(10)) FROM ({query.format(**lists, env_comm=ENV_COMM_HASH)})"


@dataclass
class Recording:
    rec: int
    node: str
    session_id: int
    source: str  # the file or Parquet folder it was read from
    db: str | None  # the SQLite recording, where its own explanation is read
    wall_offset_ns: int


def _duckdb():
    try:
        import duckdb
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise UserError(f"recorder cluster needs {e.name}: reinstall stall-recorder (pip install -e .)") from None
    return duckdb


def _printable(value: object, limit: int = EXPORT_TEXT_MAX) -> str:
    """Text from an export as one printable line, cut to `limit` characters."""
    return "".join(c if c.isprintable() else "?" for c in str(value))[:limit]


def explanation_from_export(answer: str) -> dict | None:
    """The explanation an export stored, read through EXPLANATION_FIELDS: known keys of the right
    type, cut to their length, control characters replaced; None when it is no such object."""
    try:
        data = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("available"), bool) \
            or not isinstance(data.get("summary"), str):
        return None
    out: dict = {}
    for key, (kind, limit) in EXPLANATION_FIELDS.items():
        v = data.get(key)
        if kind == "bool":
            out[key] = v if isinstance(v, bool) else None
        elif kind == "int":
            out[key] = v if isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63 else None
        elif kind == "list":
            items = v if isinstance(v, list) else []
            out[key] = [_printable(x, limit) for x in items[:EXPLANATION_LIST_ITEMS] if isinstance(x, str)]
        elif not isinstance(v, str):
            out[key] = None
        elif kind == "name":
            out[key] = v if NAME.fullmatch(v) else None
        elif kind == "utc":
            out[key] = v if UTC.fullmatch(v) else None
        else:
            out[key] = _printable(v, limit)
    if not out["available"]:
        return {"available": False, "summary": out["summary"]}
    out["from_export"] = True
    return out


def same_recording(path: str, session: dict) -> bool:
    """True when the SQLite file at `path` holds `session` (an export's session row): the same host,
    boot, start and recorder process. An export names the file it was made from, but the same path
    on another machine (every node of a fleet has /var/lib/stall-recorder/...) is another recording."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    if not stat.S_ISREG(st.st_mode):  # never a FIFO or a device an export names
        return False
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
    except sqlite3.Error:
        return False
    try:
        row = conn.execute("SELECT hostname, boot_id, started_ts, recorder_pid FROM session WHERE id = ?",
                           (session["session"],)).fetchone()
    except (sqlite3.Error, OverflowError):
        return False
    finally:
        conn.close()
    return row is not None and row == (session["hostname"], session["boot_id"], session["started_ts"],
                                       session["recorder_pid"])


def _export_size(folder: Path, tables: tuple[str, ...], limits) -> None:
    """Refuse a local export beyond `limits`, or one whose tables hold a symbolic link (it could
    point anywhere on this machine)."""
    files = size = 0
    for table in tables:
        for top, dirs, names in os.walk(folder / table):
            for name in dirs + names:
                if os.path.islink(os.path.join(top, name)):
                    raise UserError(f"{folder} holds a symbolic link ({os.path.join(top, name)}): an export is "
                                    "folders and files only; copy the export without links")
            for name in names:
                if name.endswith(".parquet"):
                    files += 1
                    size += os.lstat(os.path.join(top, name)).st_size
            if files > limits.max_objects or size > limits.max_bytes:
                what = (f"more than {limits.max_objects} files" if files > limits.max_objects
                        else f"more than {limits.max_bytes} bytes")
                flag = "--max-export-objects" if files > limits.max_objects else "--max-export-size"
                raise UserError(f"the export {folder} holds {what}: nothing of it was used; name a smaller "
                                f"export, or raise {flag} if it is trusted")


def _is_parquet_export(path: Path) -> bool:
    return (path / "session").is_dir() and (path / "nccl_call").is_dir()


def find_inputs(paths: list[str | os.PathLike]) -> tuple[list[Path], list[Path]]:
    """SQLite recordings and Parquet exports named by PATHS: files, folders of *.db files, exports."""
    dbs: list[Path] = []
    exports: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            if _is_parquet_export(p):
                exports.append(p)
                continue
            found = sorted(x for x in p.iterdir() if x.suffix in (".db", ".sqlite") and x.is_file())
            if not found:
                raise UserError(f"{p} holds no *.db recording and is no Parquet export: pass recordings "
                                "(one per node) or folders of them")
            dbs += found
        elif p.is_file():
            dbs.append(p)
        else:
            raise UserError(f"no recording at {p}: pass SQLite recordings, folders of them, or Parquet exports")
    dbs = list(dict.fromkeys(p.resolve() for p in dbs))  # a file named twice (and in its folder) counts once
    exports = list(dict.fromkeys(p.resolve() for p in exports))
    if not dbs and not exports:
        raise UserError("name the recordings: recorder cluster explain NODE1.db NODE2.db ... (or a folder)")
    return dbs, exports


class Cluster:
    """Many recordings loaded into one in-memory DuckDB database (only the alignment columns)."""

    def __init__(self, paths: list[str | os.PathLike],
                 limits: objectstore.ExportLimits = objectstore.DEFAULT_LIMITS) -> None:
        duckdb = _duckdb()
        self.recordings: list[Recording] = []
        self.notes: list[str] = []
        self._labels: dict[tuple[int, int], str] | None = None
        self._parquet_labels: dict[tuple[int, int], str] = {}  # (rec, pid) -> label, from exports' process tables
        urls = [str(p) for p in paths if objectstore.is_url(p)]
        for url in urls:
            objectstore.check_url(url)
        dbs, exports = find_inputs([p for p in paths if not objectstore.is_url(p)]) if len(urls) < len(paths) \
            else ([], [])
        for folder in exports:
            _export_size(folder, PARQUET_TABLES, limits)
        # DuckDB's spill and the exports copied from a store go in a private folder (0700); DuckDB
        # reads only there and in the exports named, in bounded memory, and loads no extension
        self._private = tempfile.TemporaryDirectory(prefix="stall-cluster-")
        private = Path(self._private.name)
        (private / "spill").mkdir(mode=0o700)
        self.con = duckdb.connect(":memory:", config={
            "memory_limit": limits.memory, "temp_directory": str(private / "spill"),
            "max_temp_directory_size": limits.spill, "autoinstall_known_extensions": False,
            "autoload_known_extensions": False})
        allowed = [f"{p}/" for p in [private, *exports]]
        self.con.execute("SET allowed_directories = ?", (allowed,))
        self.con.execute("SET enable_external_access = false")
        self.con.execute("SET enable_progress_bar = false")
        self.con.execute("SET lock_configuration = true")
        for name, cols in RELATIONS.items():
            self.con.execute(f"CREATE TABLE {name} ({cols})")
        self.con.execute(f"CREATE TABLE answer ({ANSWER})")
        self._load_sqlite(dbs)
        for folder in exports:
            self._load_export(duckdb, folder)
        for i, url in enumerate(urls):  # an export in an object store: the tables read here, copied privately
            tmp = private / f"export-{i}"
            tmp.mkdir(mode=0o700)
            self.notes += objectstore.download_export(url, tmp, PARQUET_TABLES, limits)
            self._load_export(duckdb, tmp, label=objectstore.shown(url))
            shutil.rmtree(tmp, ignore_errors=True)
        if not self.recordings:
            raise UserError("none of the recordings holds a session: record each node with 'recorder start'")
        if self.con.execute("SELECT count(*) FROM comm WHERE comm_hash = ?", (ENV_COMM_HASH,)).fetchone()[0]:
            self.notes.append("the ranks' communicator was created before the recording started: its ranks are "
                              "taken from their environment (RANK, WORLD_SIZE)")
        self._prepare()

    def close(self) -> None:
        """Close DuckDB and remove its private folder (spill, downloaded exports)."""
        self.con.close()
        self._private.cleanup()

    # -- loading ----------------------------------------------------------------------------------
    def _load_sqlite(self, dbs: list[Path]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import pyarrow as pa

        # sqlite3 releases the GIL while SQLite runs a query: one thread per core reads the files; each
        # file's rows go into DuckDB as they come, so only a few files' Arrow tables are held at once
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
            for path, sessions in zip(dbs, pool.map(_read_sqlite, dbs), strict=True):
                for (sid, host, off, started, stopped, boot), tables in sessions:
                    rec = len(self.recordings)
                    self.recordings.append(Recording(rec, host, sid, str(path), str(path), off))
                    self.con.execute("INSERT INTO rec VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                     (rec, host, sid, str(path), str(path), off, started, stopped, boot))
                    for name, table in tables.items():
                        self.con.register("_arrow_in", table.add_column(0, "rec", pa.array([rec] * len(table),
                                                                                            pa.int64())))
                        self.con.execute(
                            f"INSERT INTO {name} SELECT * FROM _arrow_in" if name != "mark" else
                            "INSERT INTO mark SELECT rec, process_id, step, min(ts), max(inferred), max(exit_ts)"
                            " FROM _arrow_in GROUP BY rec, process_id, step")
                        self.con.unregister("_arrow_in")

    def _load_export(self, duckdb, folder: Path, label: str | None = None) -> None:
        """One export, whole or not at all: one that cannot be read (a damaged or foreign file, a
        column of another type) is left out with a note, and the others are still explained."""
        base = len(self.recordings)
        self.con.execute("BEGIN TRANSACTION")
        try:
            self._load_parquet(folder, label)
        except (duckdb.Error, ValueError, TypeError, OverflowError) as e:
            self.con.execute("ROLLBACK")
            del self.recordings[base:]
            self._parquet_labels = {k: v for k, v in self._parquet_labels.items() if k[0] < base}
            why = _printable(" ".join(str(e).split()), 200)
            self.notes.append(f"the export {label or folder} cannot be read ({why}): it is left out")
        else:
            self.con.execute("COMMIT")

    def _load_parquet(self, folder: Path, label: str | None = None) -> None:
        def scan(table: str) -> str:
            pattern = str(folder / table / "**" / "*.parquet").replace("'", "''")
            return f"read_parquet('{pattern}', hive_partitioning = true, union_by_name = true)"

        base = len(self.recordings)
        cur = self.con.execute(
            f"SELECT node, session, hostname, wall_offset_ns, started_ts, stopped_ts, boot_id, source_db,"
            f" recorder_pid FROM {scan('session')} ORDER BY node, session")
        names = [d[0] for d in cur.description]
        sessions = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        keys = []
        elsewhere = []
        for i, x in enumerate(sessions):
            rec = base + i
            host = _printable(x["hostname"])
            source_db = _printable(x["source_db"]) if x["source_db"] else None
            # the recording the export was made from, where it is the same recording on this machine
            db = x["source_db"] if x["source_db"] and same_recording(x["source_db"], x) else None
            if x["source_db"] and db is None and os.path.lexists(x["source_db"]):
                elsewhere.append(source_db)
            self.recordings.append(Recording(rec, host, int(x["session"]), source_db or label or str(folder), db,
                                             x["wall_offset_ns"]))
            self.con.execute("INSERT INTO rec VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (rec, host, int(x["session"]), label or str(folder), source_db, x["wall_offset_ns"],
                              x["started_ts"], x["stopped_ts"], x["boot_id"]))
            keys.append((str(x["node"]), int(x["session"]), rec))
        if elsewhere:
            self.notes.append(f"{len(elsewhere)} session(s) of the export name a recording that is here but holds "
                              f"another recording (e.g. {elsewhere[0]!r}): they are explained from the export alone")
        if not keys:
            return
        self.con.execute("CREATE OR REPLACE TEMP TABLE _keys (node VARCHAR, session BIGINT, rec INTEGER)")
        self.con.executemany("INSERT INTO _keys VALUES (?, ?, ?)", keys)
        j = "JOIN _keys k ON k.node = CAST(x.node AS VARCHAR) AND k.session = x.session"
        self.con.execute(
            f"INSERT INTO comm SELECT k.rec, x.process_id, p.pid, x.handle, x.comm_hash, x.rank, x.nranks"
            f" FROM {scan('nccl_comm')} x {j} JOIN {scan('process')} p ON p.node = x.node AND p.session = x.session"
            f" AND p.id = x.process_id")
        job_columns = {r[0] for r in self.con.execute(f"DESCRIBE SELECT * FROM {scan('process')}").fetchall()}
        if {"job_rank", "job_world_size"} <= job_columns:
            # as comm_from_environment for SQLite: a process with one communicator whose init was not recorded
            self.con.execute(
                f"INSERT INTO comm SELECT k.rec, x.process_id, p.pid, min(x.handle), {ENV_COMM_HASH}, p.job_rank,"
                f" p.job_world_size"
                f" FROM (SELECT DISTINCT c.node, c.session, t.process_id, c.handle FROM {scan('nccl_call')} c"
                f"       JOIN {scan('thread')} t ON t.node = c.node AND t.session = c.session AND t.id = c.thread_id) x"
                f" {j} JOIN {scan('process')} p ON p.node = x.node AND p.session = x.session AND p.id = x.process_id"
                f" WHERE p.job_rank IS NOT NULL AND p.job_world_size IS NOT NULL AND NOT EXISTS"
                f" (SELECT 1 FROM {scan('nccl_comm')} n WHERE n.node = x.node AND n.session = x.session"
                f"  AND n.process_id = x.process_id)"
                f" GROUP BY k.rec, x.process_id, p.pid, p.job_rank, p.job_world_size HAVING count(*) = 1")
        fields = [f for f in jobs.JOB_FIELDS if f in job_columns]
        if fields:
            # the ranks' names from the export itself: its source recording need not be readable here
            rows = self.con.execute(
                f"SELECT k.rec, p.pid, {', '.join(f'p.{f}' for f in fields)} FROM {scan('process')} p"
                f" JOIN _keys k ON k.node = CAST(p.node AS VARCHAR) AND k.session = p.session ORDER BY k.rec, p.id")
            for rec, pid, *values in rows.fetchall():
                label = jobs.job_label(dict(zip(fields, values, strict=True)))
                if label:  # the last process image of a pid wins, as labels_by_pid has it
                    self._parquet_labels[(rec, pid)] = _printable(label)
        self.con.execute(
            # an API name is an identifier: anything else an export holds there is not shown as written
            f"INSERT INTO coll SELECT k.rec, t.process_id, x.thread_id, x.handle,"
            f" left(regexp_replace(a.name, '[^A-Za-z0-9_]', '_', 'g'), 64), x.ts, x.dur, x.stream"
            f" FROM {scan('nccl_call')} x {j}"
            f" JOIN {scan('nccl_api')} a ON a.node = x.node AND a.session = x.session AND a.id = x.api_id"
            f" JOIN {scan('thread')} t ON t.node = x.node AND t.session = x.session AND t.id = x.thread_id"
            f" WHERE a.kind = 'collective'")
        if (folder / "cuda_call").is_dir():
            self.con.execute(
                f"INSERT INTO sync SELECT k.rec, x.thread_id, x.stream, x.ts, x.dur FROM {scan('cuda_call')} x {j}"
                f" JOIN {scan('cuda_api')} a ON a.node = x.node AND a.session = x.session AND a.id = x.api_id"
                f" WHERE a.family IN {SYNC_FAMILIES!r}")
        if (folder / "stall").is_dir():  # the export's answers: each stalled step explained from its recording
            self.con.execute(
                f"INSERT INTO answer SELECT k.rec, x.process_id, x.step, x.explanation FROM {scan('stall')} x {j}"
                f" WHERE x.explanation IS NOT NULL")
        if (folder / "step_mark").is_dir():
            self.con.execute(
                f"INSERT INTO mark SELECT k.rec, t.process_id, x.step, min(x.ts), max(x.inferred),"
                f" max(coalesce(t.exit_ts, p.exit_ts)) FROM {scan('step_mark')} x {j}"
                f" JOIN {scan('thread')} t ON t.node = x.node AND t.session = x.session AND t.id = x.thread_id"
                f" LEFT JOIN {scan('process')} p ON p.node = x.node AND p.session = x.session AND p.id = t.process_id"
                f" GROUP BY k.rec, t.process_id, x.step")

    # -- alignment --------------------------------------------------------------------------------
    def _prepare(self) -> None:
        q = self.con.execute
        inferred = q("SELECT count(*) FROM mark WHERE inferred = 1").fetchone()[0]
        # The k-th collective of a step on a communicator is the same operation on every rank; step
        # numbers come from the script, so a recording that began late still lines up. Inferred
        # steps are numbered per recording: then the call order on the communicator is the key.
        self.by_step = inferred == 0 and q("SELECT count(*) FROM mark").fetchone()[0] > 0
        if inferred:
            self.notes.append("some steps are inferred, not marked: collectives are matched by their order on "
                              "the communicator (every recording must have started before the first one)")
        step_key = "coalesce(x.step, -1)" if self.by_step else "-1"
        q(f"""
        CREATE TABLE c AS
        WITH x AS (
            SELECT x.rec, x.process_id, k.pid, k.comm_hash, k.rank, k.nranks, x.thread_id, x.api, x.ts, x.dur,
                   x.stream, x.ts + x.dur AS end_ts,
                   lead(x.ts) OVER (PARTITION BY x.rec, x.thread_id ORDER BY x.ts) AS next_ts
            FROM coll x JOIN comm k ON k.rec = x.rec AND k.process_id = x.process_id AND k.handle = x.handle
        ), s AS (
            SELECT x.*, m.step FROM x ASOF LEFT JOIN mark m
                ON x.rec = m.rec AND x.process_id = m.process_id AND x.ts >= m.ts
        ), y AS (
            -- the first stream synchronisation on the thread and stream after the call returned, and
            -- before the thread's next collective: where an enqueueing call's rank waits
            SELECT s.*, CASE WHEN y.ts IS NOT NULL AND (s.next_ts IS NULL OR y.ts < s.next_ts)
                             THEN y.ts + y.dur END AS sync_end
            FROM s ASOF LEFT JOIN sync y
                ON s.rec = y.rec AND s.thread_id = y.thread_id AND s.stream = y.stream AND s.end_ts <= y.ts
        )
        SELECT y.rec, y.process_id, y.pid, y.comm_hash, y.rank, y.nranks, y.thread_id, y.api, y.step,
               {step_key.replace('x.', 'y.')} AS kstep,
               row_number() OVER (PARTITION BY y.rec, y.process_id, y.comm_hash, {step_key.replace('x.', 'y.')}
                                  ORDER BY y.ts) AS k,
               y.ts + r.wall_offset_ns AS w_ts, y.dur,
               y.end_ts + r.wall_offset_ns AS w_end,
               y.sync_end + r.wall_offset_ns AS w_sync_end
        FROM y JOIN rec r ON r.rec = y.rec
        """)
        q("DROP TABLE coll; DROP TABLE sync")  # in c now; memory for the next steps
        self.clock = self._align()
        q("DROP TABLE c")  # arrival holds its columns

    def _refine(self, anchor: str) -> tuple[dict[int, int], dict]:
        """Per-recording corrections that line up `anchor` (the moment ranks leave a collective).
        Ranks of one recording share its clock, so each recording takes part with one value per
        collective (the median over its ranks) and its extremes for the spread."""
        q = self.con.execute
        q("CREATE OR REPLACE TEMP TABLE corr AS SELECT rec, CAST(0 AS BIGINT) AS corr FROM rec")
        q(f"""CREATE OR REPLACE TEMP TABLE per_rec AS
              WITH x AS (SELECT rec, comm_hash, kstep, k, quantile_disc({anchor}, 0.5) AS t, min({anchor}) AS lo,
                                max({anchor}) AS hi, min(w_ts) AS elo, max(w_ts) AS ehi
                         FROM c WHERE {anchor} IS NOT NULL GROUP BY rec, comm_hash, kstep, k)
              SELECT * FROM x QUALIFY count(*) OVER (PARTITION BY comm_hash, kstep, k) > 1""")
        shared = q("SELECT count(*) FROM (SELECT DISTINCT comm_hash, kstep, k FROM per_rec)").fetchone()[0]
        if shared:
            for _ in range(ITERATIONS):
                q("""
                CREATE OR REPLACE TEMP TABLE corr AS
                WITH a AS (SELECT p.rec, p.comm_hash, p.kstep, p.k, p.t + corr.corr AS t
                           FROM per_rec p JOIN corr USING (rec)),
                g AS (SELECT comm_hash, kstep, k, quantile_disc(t, 0.5) AS mt FROM a GROUP BY ALL),
                d AS (SELECT a.rec, quantile_disc(g.mt - a.t, 0.5) AS delta FROM a JOIN g USING (comm_hash, kstep, k)
                      GROUP BY a.rec)
                SELECT corr.rec, corr.corr + coalesce(d.delta, 0) AS corr FROM corr LEFT JOIN d USING (rec)
                """)
            # the corrections are relative: keep the recordings' median where the wall clocks put it
            mid = q("SELECT quantile_disc(corr, 0.5) FROM corr").fetchone()[0] or 0
            q(f"UPDATE corr SET corr = corr - {int(mid)}")
        spread = q("""
            WITH g AS (SELECT max(p.hi + corr.corr) - min(p.lo + corr.corr) AS spread,
                              max(p.ehi + corr.corr) - min(p.elo + corr.corr) AS arrivals
                       FROM per_rec p JOIN corr USING (rec) GROUP BY p.comm_hash, p.kstep, p.k)
            SELECT quantile_disc(spread, 0.5), quantile_disc(spread, 0.95), count(*), quantile_disc(arrivals, 0.5)
            FROM g""").fetchone()
        corr = dict(q("SELECT rec, corr FROM corr").fetchall())
        return corr, {"anchor": anchor, "residual_ns": spread[0], "residual_p95_ns": spread[1],
                      "collectives": spread[2] or 0, "shared": shared, "arrival_spread_ns": spread[3]}

    def _align(self) -> dict:
        best = None
        for anchor in ("w_end", "w_sync_end"):
            corr, info = self._refine(anchor)
            if info["collectives"] == 0:
                continue
            # A call that returns as soon as it is enqueued (NCCL on a GPU) leaves when it arrived: its
            # return lines up the arrivals, not the exits, and would hide the late rank
            if anchor == "w_end" and info["residual_ns"] * 2 > (info["arrival_spread_ns"] or 0):
                continue
            if best is None or info["residual_ns"] < best[1]["residual_ns"]:
                best = (corr, info)
        if best is None:
            corr, info = {r.rec: 0 for r in self.recordings}, {"anchor": None, "residual_ns": None,
                                                               "residual_p95_ns": None, "collectives": 0}
            if len(self.recordings) > 1:
                self.notes.append("no collective is seen by more than one recording: clocks are aligned by the "
                                  "hosts' wall clocks only, and the residual skew is unknown")
        else:
            corr, info = best
        self.con.execute("CREATE OR REPLACE TEMP TABLE corr (rec INTEGER, corr BIGINT)")
        self.con.executemany("INSERT INTO corr VALUES (?, ?)", list(corr.items()))
        self.con.execute("""
            CREATE OR REPLACE TABLE arrival AS
            SELECT c.*, c.w_ts + corr.corr AS e_ts,
                   c.w_ts + corr.corr - min(c.w_ts + corr.corr) OVER (PARTITION BY comm_hash, kstep, k) AS lateness,
                   count(*) OVER (PARTITION BY comm_hash, kstep, k) AS ranks_seen
            FROM c JOIN corr USING (rec)""")
        anchors = {"w_end": "the return of each collective call", "w_sync_end":
                   "the end of the stream synchronisation after each collective"}
        return {
            "method": ("one recording: one clock, nothing to align" if len(self.recordings) == 1 else
                       "wall-clock offsets" + (f", refined on {info['collectives']} collectives seen by more than "
                                               f"one recording" if info["collectives"] else "")),
            "anchor": anchors.get(info["anchor"]) if info["anchor"] else None,
            "residual_skew_ns": info["residual_ns"], "residual_skew_p95_ns": info["residual_p95_ns"],
            "corrections": [{"node": r.node, "db": r.source, "session": r.session_id, "correction_ns": corr[r.rec]}
                            for r in self.recordings],
        }

    # -- steps --------------------------------------------------------------------------------------
    def step_table(self) -> list[dict]:
        """Every step of the job: ranks seen, median duration over the ranks, the latest arrival, and
        the ranks of the communicator that never entered one of its collectives."""
        rows = self.con.execute("""
            WITH d AS (SELECT m.rec, m.process_id, m.step, m.ts,
                              lead(m.ts) OVER (PARTITION BY m.rec, m.process_id ORDER BY m.ts) AS next_ts,
                              coalesce(m.exit_ts, r.stopped_ts) AS stop_ts
                       FROM mark m JOIN rec r USING (rec)),
            s AS (SELECT step, count(*) AS ranks,
                         quantile_disc(coalesce(next_ts, stop_ts) - ts, 0.5) AS dur,
                         max(coalesce(next_ts, stop_ts) - ts) AS max_dur, count(next_ts) AS complete
                  FROM d GROUP BY step),
            members AS (SELECT comm_hash, count(DISTINCT rank) AS n FROM comm GROUP BY comm_hash),
            keys AS (SELECT a.step, a.comm_hash, a.kstep, a.k, max(a.lateness) AS lateness,
                            arg_max(a.rank, a.lateness) AS late_rank, arg_max(a.rec, a.lateness) AS late_rec,
                            min(a.api) AS api, m.n - count(*) AS missing
                     FROM arrival a JOIN members m USING (comm_hash) WHERE a.step IS NOT NULL
                     GROUP BY a.step, a.comm_hash, a.kstep, a.k, m.n),
            l AS (SELECT step, max(lateness) AS lateness, arg_max(late_rank, lateness) AS late_rank,
                         arg_max(late_rec, lateness) AS late_rec, arg_max(api, lateness) AS api,
                         max(missing) AS missing
                  FROM keys GROUP BY step)
            SELECT s.step, s.ranks, s.dur, s.max_dur, s.complete, l.lateness, l.late_rank, l.late_rec, l.api,
                   coalesce(l.missing, 0)
            FROM s LEFT JOIN l USING (step) ORDER BY s.step""").fetchall()
        out = []
        durs = [r[2] if r[4] == r[1] else None for r in rows]  # baselines from complete steps only
        rule, n = default_stall_rule(), default_stall_rule().neighbours  # a stall as for one recording
        for i, (step, ranks, dur, max_dur, complete, lateness, late_rank, late_rec, api, missing) in enumerate(rows):
            near = [d for d in durs[max(0, i - n):i] + durs[i + 1:i + 1 + n] if d is not None]
            base = int(statistics.median(near)) if len(near) >= rule.min_baseline_steps else None
            slow = bool(dur is not None and base and rule.stalled(dur, base))
            rec = self.recordings[late_rec] if late_rec is not None else None
            late_job = self.rank_job(late_rec, late_rank) if rec else None
            out.append({"step": step, "ranks": ranks, "dur_ns": dur, "max_dur_ns": max_dur, "baseline_dur_ns": base,
                        "ratio": round(dur / base, 2) if dur is not None and base else None, "slow": slow,
                        "complete": complete == ranks, "lateness_ns": lateness, "late_rank": late_rank,
                        "late_node": rec.node if rec else None, "late_db": rec.source if rec else None,
                        "late_job": late_job, "collective": api, "ranks_missing": missing})
        return out

    def answer(self, rec: int, process_id: int, step: int) -> str | None:
        """The explanation a Parquet export stored for this rank's step (JSON), if any."""
        row = self.con.execute("SELECT explanation FROM answer WHERE rec = ? AND process_id = ? AND step = ?",
                               (rec, process_id, step)).fetchone()
        return row[0] if row else None

    def job_label(self, rec: int, pid: int) -> str | None:
        """The job identity a rank's process carried (its environment and cgroup, read by its
        recorder): known for SQLite recordings of schema v20 and later."""
        if self._labels is None:
            from_parquet = {rec for rec, _ in self._parquet_labels}
            self._labels = {(r.rec, pid): label for r in self.recordings if r.db and r.rec not in from_parquet
                            for pid, label in jobs.labels_by_pid(r.db, r.session_id).items()}
            self._labels.update(self._parquet_labels)
        return self._labels.get((rec, pid))

    def rank_job(self, rec: int, rank: int | None) -> str | None:
        row = self.con.execute("SELECT min(pid) FROM comm WHERE rec = ? AND rank = ?", (rec, rank)).fetchone()
        return self.job_label(rec, row[0]) if row and row[0] is not None else None

    def steps(self, slow_only: bool = False, limit: int = 0) -> dict:
        table = self.step_table()
        rows = [r for r in table if r["slow"] or not slow_only]
        rows = rows[:limit] if limit else rows
        return {"recordings": self._recordings(), "clock": self.clock, "notes": self.notes, "steps": rows,
                "count": len(rows), "stalls": sum(1 for r in table if r["slow"])}

    def _recordings(self) -> list[dict]:
        ranks = dict(self.con.execute("SELECT rec, list(DISTINCT rank ORDER BY rank) FROM comm GROUP BY rec")
                     .fetchall())
        members: dict[int, list[dict]] = {}
        rows = self.con.execute("SELECT DISTINCT rec, rank, pid FROM comm ORDER BY rank, pid").fetchall()
        for rec, rank, pid in rows:
            members.setdefault(rec, []).append({"rank": rank, "pid": pid, "job": self.job_label(rec, pid)})
        return [{"node": r.node, "db": r.source, "session": r.session_id, "ranks": ranks.get(r.rec, []),
                 "processes": members.get(r.rec, [])} for r in self.recordings]

    # -- explain ----------------------------------------------------------------------------------
    def choose_step(self, step: int | None, worst: bool) -> tuple[int, dict | None]:
        table = self.step_table()
        if not table:
            raise UserError("no recording marks steps: the cluster view lines ranks up by step "
                            "(recorder.step(n) in the script, or steps inferred by the recorder)")
        by_step = {r["step"]: r for r in table}
        if step is not None:
            if step not in by_step:
                raise UserError(f"no rank marked step {step}: the recorded steps run "
                                f"{table[0]['step']}..{table[-1]['step']} ('recorder cluster steps' lists them)")
            return step, by_step[step]
        # a collective some recorded rank never entered (a hang) first, then the worst stall, else the
        # step with the latest arrival
        hung = [r for r in table if r["ranks_missing"]]
        stalled = [r for r in table if r["slow"]]
        if hung:
            pick = max(hung, key=lambda r: (r["ranks_missing"], r["step"]))
        elif stalled:
            pick = max(stalled, key=lambda r: (r["dur_ns"] - r["baseline_dur_ns"], r["lateness_ns"] or 0))
        else:
            pick = max(table, key=lambda r: r["lateness_ns"] or 0)
        return pick["step"], pick

    def explain(self, step: int | None = None, worst: bool = False) -> dict:
        number, row = self.choose_step(step, worst)
        q = self.con.execute
        clock = self.clock
        residual = clock["residual_skew_ns"] or 0
        # the collective of the step with the latest arrival
        key = q("SELECT a.comm_hash, a.kstep, a.k, min(a.api), max(a.lateness) AS late,"
                " (SELECT count(DISTINCT m.rank) FROM comm m WHERE m.comm_hash = a.comm_hash) - count(*) AS missing"
                " FROM arrival a WHERE a.step = ? GROUP BY a.comm_hash, a.kstep, a.k"
                " ORDER BY missing DESC, late DESC LIMIT 1", (number,)).fetchone()
        recs = {r.rec: r for r in self.recordings}
        result: dict = {
            "step": number, "stall": bool(row and row["slow"]), "step_stats": row,
            "recordings": self._recordings(), "clock": clock, "notes": list(self.notes),
            "collective": None, "late_ranks": [], "hung_ranks": [], "unrecorded_ranks": [], "verdict": None,
        }
        if key is None:
            result["verdict"] = "no_collective"
            result["notes"].append(f"no rank recorded a collective in step {number}: nothing to line the ranks up "
                                   "on; explain each node with 'recorder explain --step'")
            return result
        comm_hash, kstep, k, api, max_late, _ = key
        arrivals = q("SELECT rec, rank, pid, process_id, e_ts, lateness, dur FROM arrival"
                     " WHERE comm_hash = ? AND kstep = ? AND k = ? ORDER BY lateness DESC",
                     (comm_hash, kstep, k)).fetchall()
        nranks = q("SELECT max(nranks) FROM comm WHERE comm_hash = ?", (comm_hash,)).fetchone()[0]
        members = q("SELECT rec, rank, pid, process_id FROM comm WHERE comm_hash = ? ORDER BY rank",
                    (comm_hash,)).fetchall()
        entered = {a[1] for a in arrivals}
        result["collective"] = {
            "comm_hash": f"{comm_hash & (2**64 - 1):#018x}", "api": api, "index_in_step": k, "nranks": nranks,
            "ranks_entered": len(arrivals), "ranks_recorded": len({m[1] for m in members}),
            "max_lateness_ns": max_late,
            "on_time_spread_ns": None,
        }
        # late: well beyond how far apart ranks usually arrive (the median over the job's collectives)
        usual = q("SELECT quantile_disc(l, 0.5) FROM (SELECT max(lateness) AS l FROM arrival"
                  " GROUP BY comm_hash, kstep, k)").fetchone()[0] or 0
        result["collective"]["usual_arrival_spread_ns"] = usual
        threshold = max(LATE_SHARE * max_late, LATE_MIN_NS, USUAL_SPREAD * usual, SKEW_REFUSE * residual)
        late = [a for a in arrivals if a[5] >= threshold]
        on_time = [a for a in arrivals if a[5] < threshold]
        if on_time:
            result["collective"]["on_time_spread_ns"] = max(a[5] for a in on_time) - min(a[5] for a in on_time)
        if residual and max_late < SKEW_REFUSE * residual:
            result["verdict"] = "clock_skew_too_large"
            result["notes"].append(
                f"cannot say who was late: after alignment the ranks still leave a collective {_ms(residual)} apart "
                f"(median), more than half of the {_ms(max_late)} between the first and the last arrival; check the "
                "hosts' time sync (chronyc tracking) or record longer so more collectives refine the clocks")
            late = []
        elif residual and max_late < SKEW_WARN * residual:
            result["notes"].append(f"the lateness ({_ms(max_late)}) is less than {SKEW_WARN:.0f}x the residual clock "
                                   f"skew ({_ms(residual)}): the late rank is named with little margin")
        for a in late[:NAMED]:
            rec = recs[a[0]]
            item = {"rank": a[1], "node": rec.node, "db": rec.source, "session": rec.session_id, "pid": a[2],
                    "job": self.job_label(a[0], a[2]), "lateness_ns": a[5], "entered_utc": _utc(a[4]),
                    "explanation": None}
            if len(result["late_ranks"]) < EXPLAINED:
                item["explanation"] = rank_explanation(rec, a[3], number, self.answer(a[0], a[3], number))
            result["late_ranks"].append(item)
        # ranks of the communicator with a recording that never entered this collective (a hang)
        for m_rec, m_rank, m_pid, m_proc in members:
            if m_rank in entered:
                continue
            rec = recs[m_rec]
            last = q("SELECT max(step) FROM mark WHERE rec = ? AND process_id = ?", (m_rec, m_proc)).fetchone()[0]
            item = {"rank": m_rank, "node": rec.node, "db": rec.source, "session": rec.session_id, "pid": m_pid,
                    "job": self.job_label(m_rec, m_pid), "last_step": last, "explanation": None}
            if len(result["hung_ranks"]) < EXPLAINED and last is not None:
                at = min(last, number)
                item["explanation"] = rank_explanation(rec, m_proc, at, self.answer(m_rec, m_proc, at))
            result["hung_ranks"].append(item)
        if nranks:
            result["unrecorded_ranks"] = sorted(set(range(nranks)) - {m[1] for m in members})
        if result["verdict"] is None:
            result["verdict"] = ("hung" if result["hung_ranks"] else "late" if result["late_ranks"]
                                 else "no_late_rank")
        if result["verdict"] == "no_late_rank":
            result["notes"].append(f"every rank entered {api} within {_ms(max_late)} of the first: no rank held the "
                                   "others up; the step was slow on every rank (explain a node with "
                                   f"'recorder explain --step {number}')")
        return result


def _read_sqlite(path: Path) -> list[tuple[tuple, dict]]:
    """The sessions of one recording, each with its relations as Arrow tables (rec not yet set)."""
    import io

    import pyarrow as pa
    from pyarrow import csv

    types = {"INTEGER": pa.int64(), "BIGINT": pa.int64(), "VARCHAR": pa.string()}
    from store.db import APPLICATION_ID, SCHEMA_VERSION, Store, open_store

    store: Store | None = None
    conn = None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        if (conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
                and conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION):
            conn.close()  # an earlier version's recording: read through a migrated copy, the file as it is
            store = open_store(path, readonly=True)
            conn = store.conn
        sessions = conn.execute("SELECT id, hostname, wall_offset_ns, started_ts, stopped_ts, boot_id"
                                " FROM session ORDER BY id").fetchall()
    except sqlite3.DatabaseError as e:
        if conn is not None:
            conn.close()
        if store is not None:
            store.close()
        if damaged(e):
            raise UserError(damaged_message(path, e)) from None
        raise UserError(f"{path} is not a stall-recorder recording ({e}): pass the nodes' recordings") from None
    out = []
    try:
        for session in sessions:
            tables = {}
            for name in RELATIONS:
                if name == "rec":
                    continue
                text = conn.execute(_as_csv(name, conn), (session[0],)).fetchone()[0]
                if not text:
                    continue
                cols = _columns(name)[1:]
                tables[name] = csv.read_csv(
                    io.BytesIO(text.encode()), read_options=csv.ReadOptions(column_names=[c for c, _ in cols]),
                    convert_options=csv.ConvertOptions(column_types={c: types[t] for c, t in cols},
                                                       strings_can_be_null=True))
            out.append((session, tables))
    except sqlite3.OperationalError as e:
        raise UserError(f"{path} cannot be read as a recording ({e}): pass the nodes' recordings") from None
    finally:
        conn.close()
        if store is not None:
            store.close()
    return out


def rank_explanation(rec: Recording, process_id: int, step: int, answer: str | None = None) -> dict:
    """Why one rank was slow in `step`, from its own recording (the per-recording report,
    store/report/rank.py); without the recording, from the same explanation its Parquet export
    stored (`answer`, the `stall` table's `explanation`), else where to look."""
    from store.db import open_store
    from store.report.rank import rank_step

    if rec.db is None or not Path(rec.db).is_file():
        stored = explanation_from_export(answer) if answer else None
        if stored:
            return stored
        return {"available": False,
                "summary": f"the recording of {rec.node} is not here: run 'recorder explain --step {step} --session "
                           f"{rec.session_id}' on {rec.node} (or pass its database)"}
    with open_store(rec.db, readonly=True) as store:
        _materialise_nccl(store)
        return rank_step(store, rec.session_id, process_id, step, rec.db)


def _ms(ns: float | int | None) -> str:
    from store.report.build import ms

    return ms(ns)


def _utc(ns: int) -> str:
    from store.report.build import utc

    return utc(ns)


# -- text -----------------------------------------------------------------------------------------
def render_clock(clock: dict) -> str:
    text = "Clocks: " + clock["method"]
    if clock["anchor"]:
        text += f" (anchor: {clock['anchor']})"
    if clock["residual_skew_ns"] is not None:
        text += (f"; residual skew {_ms(clock['residual_skew_ns'])} (p95 {_ms(clock['residual_skew_p95_ns'])})")
    big = max(clock["corrections"], key=lambda c: abs(c["correction_ns"]), default=None)
    if big and big["correction_ns"]:
        text += f"; largest correction {_ms(abs(big['correction_ns']))} ({big['node']})"
    return text


def render_explain(r: dict) -> str:
    if r.get("mode") == "device":
        return device.render(r)
    if r.get("mode") == "flight_recorder":
        return device.render_dumps(r)
    hosts = {x["node"] for x in r["recordings"]}
    ranks = sum(len(x["ranks"]) for x in r["recordings"])
    lines = ["Cluster stall report",
             f"Recordings: {len(r['recordings'])} ({len(hosts)} node{'s' if len(hosts) != 1 else ''}, "
             f"{ranks} rank{'s' if ranks != 1 else ''})",
             render_clock(r["clock"])]
    s = r["step_stats"] or {}
    head = f"Step {r['step']}: "
    if s.get("dur_ns") is not None:
        head += f"{_ms(s['dur_ns'])} (median over {s['ranks']} ranks)"
        if s.get("baseline_dur_ns"):
            head += f", {s['ratio']}x the median of its neighbouring steps ({_ms(s['baseline_dur_ns'])})"
    else:
        head += f"still running on {s.get('ranks', '?')} ranks when the recordings stopped"
    lines.append(head + ("" if r["stall"] else ": not a stall"))
    c = r["collective"]
    if c:
        lines.append(f"Collective: {c['api']} #{c['index_in_step']} of the step on communicator {c['comm_hash']}: "
                     f"{c['ranks_entered']} of {c['nranks']} ranks entered ({c['ranks_recorded']} recorded); "
                     f"last arrival {_ms(c['max_lateness_ns'])} after the first")
    for x in r["late_ranks"]:
        lines.append(f"Late: rank {x['rank']} on {x['node']} ({x['db']}, session {x['session']}, pid {x['pid']}) "
                     f"entered {_ms(x['lateness_ns'])} after the first rank")
        if x.get("job"):
            lines.append(f"  Job: {x['job']}")
        lines += _explanation_lines(x["explanation"])
    for x in r["hung_ranks"]:
        lines.append(f"Hung: rank {x['rank']} on {x['node']} ({x['db']}, session {x['session']}, pid {x['pid']}) "
                     f"never entered the collective; its last step is {x['last_step']}")
        if x.get("job"):
            lines.append(f"  Job: {x['job']}")
        lines += _explanation_lines(x["explanation"])
    if r["unrecorded_ranks"]:
        shown = _ranges(r["unrecorded_ranks"])
        lines.append(f"Not recorded: {len(r['unrecorded_ranks'])} rank(s) of the communicator have no recording "
                     f"here ({shown})")
    if c and c["on_time_spread_ns"] is not None and r["late_ranks"] and c["ranks_entered"] - len(r["late_ranks"]) > 1:
        lines.append(f"Other ranks: {c['ranks_entered'] - len(r['late_ranks'])} entered within "
                     f"{_ms(c['on_time_spread_ns'])} of each other")
    for n in r["notes"]:
        lines.append(f"Note: {n}")
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    """0-3, 8, 10-12: a list of ranks as ranges."""
    out: list[str] = []
    for r in ranks:
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = out[-1].split("-")[0] + f"-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _explanation_lines(e: dict | None) -> list[str]:
    if not e:
        return []
    if not e["available"]:
        return [f"  Why: {e['summary']}"]
    out = [f"  Why: {e['summary']}"]
    if e.get("python"):
        out.append(f"  Python: {e['python']}")
    if e.get("kernel_path"):
        out.append("  Kernel path: " + " -> ".join(e["kernel_path"]))
    out.append(f"  Its step: {e['symptom']}")
    return out


RANKS_LISTED = 16  # ranks named one a line above the steps table


def _rank_lines(recordings: list[dict]) -> list[str]:
    """'Rank 1 on node-03 (pid 4242): rank 1 of 2 (local rank 1), torchrun run r42', the ranks in order."""
    ranks = sorted(((p["rank"], x["node"], p["pid"], p["job"]) for x in recordings for p in x.get("processes", [])),
                   key=lambda t: (t[0] is None, t[0] or 0, t[1], t[2] or 0))
    out = [f"Rank {rank} on {node} (pid {pid})" + (f": {job}" if job else "")
           for rank, node, pid, job in ranks[:RANKS_LISTED]]
    if len(ranks) > RANKS_LISTED:
        out.append(f"... and {len(ranks) - RANKS_LISTED} more ranks (--json lists them)")
    return out


def render_steps(r: dict) -> str:
    if r.get("mode") == "device":
        return device.render_steps(r)
    lines = [render_clock(r["clock"]), *_rank_lines(r["recordings"]),
             f"{'STEP':>8} {'RANKS':>6} {'DUR':>9} {'BASELINE':>9} {'RATIO':>6}  {'LATEST ARRIVAL':>14}  LATE RANK"]
    for s in r["steps"]:
        late = (f"rank {s['late_rank']} on {s['late_node']}" + (f" ({s['late_job']})" if s.get("late_job") else "")
                if s["late_rank"] is not None and s["lateness_ns"] else "")
        ratio = s["ratio"] if s["ratio"] is not None else ""
        lines.append(f"{s['step']:>8} {s['ranks']:>6} {_ms(s['dur_ns']):>9} {_ms(s['baseline_dur_ns']):>9} "
                     f"{ratio:>6}{'!' if s['slow'] else ' '} {_ms(s['lateness_ns']):>14}  {late}")
    lines.append(f"{r['count']} steps, {r['stalls']} stalled (! {default_stall_rule().text()}; "
                 "latest arrival: the last rank into the step's collective, after the first)")
    for n in r["notes"]:
        lines.append(f"Note: {n}")
    return "\n".join(lines)


def explain_paths(paths: list[str | os.PathLike], step: int | None = None, worst: bool = False,
                  limits: objectstore.ExportLimits = objectstore.DEFAULT_LIMITS) -> dict:
    """The cluster report; over imported profiler traces (no NCCL calls), lined up on the collective
    kernels instead (store/cluster/device.py); over imported Flight Recorder dumps, their hang."""
    if not any(objectstore.is_url(p) for p in paths):
        dbs, exports = find_inputs(paths)
        if not exports and device.applies(dbs):
            return device.explain(dbs, step)
        if not exports and device.flight_dumps_only(dbs):
            return device.explain_dumps(dbs)
    c = Cluster(paths, limits)
    try:
        return c.explain(step, worst)
    finally:
        c.close()


def steps_paths(paths: list[str | os.PathLike], slow_only: bool = False, limit: int = 0,
                limits: objectstore.ExportLimits = objectstore.DEFAULT_LIMITS) -> dict:
    if not slow_only and not any(objectstore.is_url(p) for p in paths):
        dbs, exports = find_inputs(paths)
        if not exports and device.applies(dbs):
            return device.steps(dbs, limit)
    c = Cluster(paths, limits)
    try:
        return c.steps(slow_only, limit)
    finally:
        c.close()
