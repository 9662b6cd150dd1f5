"""`recorder import`: what other tools recorded, read into a recording so every command answers on it.

- PyTorch profiler traces (store/traces/chrome.py): each file becomes a session of its own, with the
  trace's processes and threads, host ops (host_op), the device's kernels, copies and memsets
  (device_activity) and ProfilerStep#N as the steps (step_mark, the step ending where its
  annotation ends). One file per rank gives one session per rank; `recorder cluster explain` reads
  them side by side.
- NCCL Flight Recorder dumps (store/traces/flight_recorder.py): each rank's dump becomes a session
  whose collective_record rows say how far every collective got on that rank.

Every file is read and checked before anything is written; the rows then go in one transaction
(into a new database: a temporary file renamed into place), so a bad file leaves the database as it
was. A file already imported (same bytes, same rank) is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from store.db import Store, being_written, open_store
from store.db.session import KNOWN_LAYERS
from store.errors import UserError
from store.traces import chrome, flight_recorder
from store.traces.chrome import Trace, TraceError
from store.traces.flight_recorder import Dump
from store.traces.join import align

PROFILER_LAYER = ("profiler", "the device's kernels, copies and memsets and the host's ops (an imported PyTorch "
                  "profiler trace)")
FLIGHT_LAYER = ("flight_recorder", "the collectives in flight per process group (an imported NCCL Flight Recorder "
                "dump)")
STRINGS_PER_QUERY = 500

__all__ = ["TraceError", "import_files", "read_file"]


@dataclass
class Read:
    """One file, read and checked, not yet written."""

    path: Path
    sha256: str
    size_bytes: int
    content: Trace | Dump

    @property
    def rank(self) -> int | None:
        if isinstance(self.content, Dump):
            return self.content.rank
        return chrome._int((self.content.distributed or {}).get("rank"))

    @property
    def key(self) -> tuple[str, int | None]:
        """What makes a file the same as another: its bytes and its rank (a dump's rank is in its name)."""
        return self.sha256, self.rank


def read_file(path: str | os.PathLike) -> Read:
    """Read and check one file (a trace or a dump, told apart by content); TraceError when unusable."""
    path = Path(path).absolute()
    try:
        if path.is_dir():
            raise TraceError(f"{path} is a directory: pass the trace files in it (e.g. {path}/*.json.gz)")
        with path.open("rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TraceError(f"no file {path}: pass a profiler trace (.json, .json.gz) or a Flight Recorder dump") from None
    except OSError as e:
        raise TraceError(f"cannot read {path} ({e.strerror or e})") from None
    if not raw:
        raise TraceError(f"{path} is empty: pass a complete trace")
    digest = hashlib.sha256(raw).hexdigest()
    size = len(raw)
    content: Trace | Dump
    if flight_recorder.looks_like_pickle(raw):
        content = flight_recorder.read(path, flight_recorder.load_pickle(path, raw))
    else:
        del raw  # load_json reads the file again: a large trace is not held twice while it is parsed
        doc = chrome.load_json(path)
        if flight_recorder.is_dump(doc):
            content = flight_recorder.read(path, doc)
        else:
            content = chrome.read(path, doc)
    return Read(path, digest, size, content)


def import_files(db: str | os.PathLike, paths: list[str | os.PathLike], join: int | bool | None = None) -> list[dict]:
    """Import every file into `db` (created when missing), all or nothing; one summary per file.

    `join`: a session of `db` recorded by the recorder (True: its latest) to line each trace up with
    (store/traces/join.py); a trace that lines up goes into that session on its clock, one that does
    not becomes a session of its own, and why is kept (trace_import.clock_note)."""
    if not paths:
        raise UserError("name at least one trace or dump to import")
    reads = [read_file(p) for p in paths]
    seen: dict[tuple[str, int | None], Path] = {}
    for r in reads:
        if r.key in seen:
            raise UserError(f"{r.path} has the same content as {seen[r.key]}: name each file once")
        seen[r.key] = r.path
    db = Path(db)
    if join is not None and join is not False and not db.exists():
        raise UserError(f"--join lines traces up with a recording in --db, and there is none at {db}")
    if db.exists():
        if being_written(db):
            raise UserError(f"{db} is being recorded into: import into another --db")
        with open_store(db) as store:
            out = _write(store, reads, _joined_session(store, join))
        return [{**summary, "db": str(db)} for summary in out]
    parent = db.parent if str(db.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"folder {parent} does not exist: create it or pass another --db")
    fd, tmp = tempfile.mkstemp(prefix=f".{db.name}.", suffix=".importing", dir=parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        with open_store(tmp, create=True) as store:
            out = _write(store, reads)
            store.conn.execute("PRAGMA journal_mode = DELETE")  # one file to rename, no -wal beside it
        os.replace(tmp, db)
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + suffix)
    for summary in out:
        summary["db"] = str(db)
    return out


def _joined_session(store: Store, join: int | bool | None) -> dict | None:
    if join is None or join is False:
        return None
    recorded = "command NOT LIKE 'recorder import %'"
    if join is True:
        row = store.one(f"SELECT * FROM session WHERE {recorded} ORDER BY id DESC LIMIT 1")
        if row is None:
            raise UserError(f"{store.path} holds no recorded session to join: record one with 'recorder start'")
        return row
    row = store.one(f"SELECT * FROM session WHERE id = ? AND {recorded}", (join,))
    if row is None:
        raise UserError(f"no recorded session {join} in {store.path} to join ('recorder steps --session N' "
                        "lists a session; imported ones cannot be joined)")
    return row


def _write(store: Store, reads: list[Read], join: dict | None = None) -> list[dict]:
    for r in reads:
        old = store.one("SELECT session_id FROM trace_import WHERE sha256 = ? AND rank IS ?", r.key)
        if old is not None:
            raise UserError(f"{r.path} is already imported into {store.path} as session {old['session_id']}")
    conn = store.conn
    out = []
    try:
        for r in reads:
            if isinstance(r.content, Trace):
                out.append(_write_trace(store, r, r.content, join))
            else:
                out.append(_write_dump(store, r, r.content))
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    store.build_indexes()
    for sid in dict.fromkeys(summary["session_id"] for summary in out):
        store.store_baselines(sid)
    return out


def _next_id(store: Store, table: str) -> int:
    return int(store.row(f"SELECT coalesce(max(id), 0) + 1 AS n FROM {table}")["n"])


def _strings(store: Store, values: set[str]) -> dict[str, int]:
    conn = store.conn
    conn.executemany("INSERT OR IGNORE INTO string (value) VALUES (?)", ((v,) for v in values))
    ids: dict[str, int] = {}
    items = list(values)
    for i in range(0, len(items), STRINGS_PER_QUERY):
        chunk = items[i:i + STRINGS_PER_QUERY]
        marks = ",".join("?" * len(chunk))
        ids.update((v, k) for k, v in conn.execute(f"SELECT id, value FROM string WHERE value IN ({marks})", chunk))
    return ids


def _session(store: Store, path: Path, start: int, end: int, wall_offset_ns: int, layer: tuple[str, str],
             host: str | None = None) -> int:
    """A complete session for one imported file, observing `layer` only; `host` where the file names it."""
    sid = _next_id(store, "session")
    store.conn.execute(
        "INSERT INTO session (id, started_ts, stopped_ts, wall_offset_ns, status, recorder_pid, hostname,"
        " kernel_release, boot_id, cpu_count, target, command, tool_version, written_ts)"
        " VALUES (?, ?, ?, ?, 'complete', ?, ?, '', '', 0, ?, ?, ?, ?)",
        (sid, start, end, wall_offset_ns, os.getpid(), host or "unknown", f"import {path}",
         f"recorder import {path}", _version(), end))
    store.conn.execute("INSERT INTO layer_vocabulary (session_id, layer, kind, word, what, why)"
                       " VALUES (?, ?, 'capability', ?, ?, '')", (sid, layer[0], layer[0], layer[1]))
    store.conn.execute("INSERT INTO capability (session_id, layer, probe, target, status, detail, ts)"
                       " VALUES (?, ?, ?, ?, 'attached', '', ?)", (sid, layer[0], f"import {path.name}", str(path),
                                                                 start))
    return sid


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("stall-recorder")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown"


def _write_trace(store: Store, r: Read, t: Trace, join: dict | None = None) -> dict:
    """One trace as a session of its own, or, joined and aligned, into the recording `join` (a session
    row): its ts shifted onto the recording's clock, its threads the recording's where they are."""
    conn = store.conn
    aligned = None
    if join is not None:
        aligned = align(store, join, t)
    shift = aligned.offset_ns if aligned is not None and aligned.offset_ns is not None else 0
    if aligned is not None and aligned.offset_ns is not None:
        assert join is not None
        sid = join["id"]
        _declare(store, sid, PROFILER_LAYER, r.path, t.start_ts + shift)
    else:
        sid = _session(store, r.path, t.start_ts, t.end_ts, t.base_ns, PROFILER_LAYER, t.host_name)
    dist = t.distributed or {}
    rank = chrome._int(dist.get("rank"))
    world = chrome._int(dist.get("world_size"))
    backend = dist.get("backend") if isinstance(dist.get("backend"), str) else None
    import_id = _next_id(store, "trace_import")
    conn.execute(
        "INSERT INTO trace_import (id, session_id, path, format, sha256, size_bytes, events, skipped, rank,"
        " world_size, backend, runtime, distributed, joined_session_id, clock_offset_ns, clock_matches, clock_note,"
        " imported_ts) VALUES (?, ?, ?, 'chrome_trace', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (import_id, sid, str(r.path), r.sha256, r.size_bytes, t.events, t.skipped, rank, world, backend, t.runtime,
         json.dumps(t.distributed) if t.distributed else None, join["id"] if join else None,
         aligned.offset_ns if aligned else None, aligned.matches if aligned else None,
         aligned.note if aligned else None, time.time_ns()))
    # processes and threads: the trace's pids and tids, first seen at their first op; joined, the
    # recording's own rows where it has them
    first: dict[tuple[int, int], int] = {}
    for op in t.host:
        key = (op.pid, op.tid)
        if key not in first or op.ts < first[key]:
            first[key] = op.ts
    known_threads: dict[tuple[int, int], int] = {}
    known_processes: dict[int, int] = {}
    if join is not None and sid == join["id"]:
        for row in store.query("SELECT t.id, t.tid, p.pid, p.id AS process_id FROM thread t"
                               " JOIN process p ON p.id = t.process_id WHERE t.session_id = ?", (sid,)):
            known_threads[(row["pid"], row["tid"])] = row["id"]
            known_processes[row["pid"]] = row["process_id"]
    pids = sorted({pid for pid, _ in t.threads})
    process_ids: dict[int, int] = {}
    next_process = _next_id(store, "process")
    for pid in pids:
        if pid in known_processes:
            process_ids[pid] = known_processes[pid]
            continue
        process_ids[pid] = next_process
        seen = min((ts for (p, _), ts in first.items() if p == pid), default=t.start_ts) + shift
        conn.execute("INSERT INTO process (id, session_id, pid, name, first_ts, job_rank, job_world_size,"
                     " environ_status) VALUES (?, ?, ?, ?, ?, ?, ?, 'read')",
                     (next_process, sid, pid, t.processes.get(pid), seen, rank, world))
        next_process += 1
    thread_ids: dict[tuple[int, int], int] = {}
    next_thread = _next_id(store, "thread")
    for key, name in sorted(t.threads.items()):
        if key in known_threads:
            thread_ids[key] = known_threads[key]
            continue
        thread_ids[key] = next_thread
        conn.execute("INSERT INTO thread (id, session_id, tid, process_id, name, first_ts, traced)"
                     " VALUES (?, ?, ?, ?, ?, ?, 1)", (next_thread, sid, key[1], process_ids[key[0]], name,
                                                       first.get(key, t.start_ts) + shift))
        next_thread += 1
    names = _strings(store, {op.name for op in t.host} | {a.name for a in t.device})
    next_op = _next_id(store, "host_op")
    launches: dict[int, tuple[int, int]] = {}  # correlation -> (host_op id, process id)
    rows = []
    for i, op in enumerate(t.host):
        op_id = next_op + i
        thread = thread_ids[(op.pid, op.tid)]
        if op.kind == "runtime" and op.correlation is not None:
            launches[op.correlation] = (op_id, process_ids[op.pid])
        rows.append((op_id, sid, op.ts + shift, op.dur, thread, op.kind, names[op.name], op.correlation,
                     op.external_id))
    conn.executemany("INSERT INTO host_op (id, session_id, ts, dur, thread_id, kind, name_id, correlation,"
                     " external_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    # device rows belong to the process that launched them; without the launch, to the trace's
    # process that ran the most ops (the training process)
    busiest = _busiest_process(t)
    fallback = process_ids.get(busiest) if busiest is not None else None
    linked = 0
    drows = []
    for a in t.device:
        launch = launches.get(a.correlation) if a.correlation is not None else None
        linked += launch is not None
        drows.append((sid, a.ts + shift, a.dur, launch[1] if launch else fallback, a.kind, names[a.name], a.device,
                      a.stream, a.correlation, launch[0] if launch else None, a.size_bytes, a.grid, a.block))
    conn.executemany("INSERT INTO device_activity (session_id, ts, dur, process_id, kind, name_id, device, stream,"
                     " correlation, launch_op_id, size_bytes, grid, block) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
                     " ?)", drows)
    # joined into a recording that marks its own steps, the profiler's are not added beside them
    own_steps = join is not None and sid == join["id"] and store.one(
        "SELECT 1 AS x FROM step_mark WHERE session_id = ? LIMIT 1", (sid,)) is not None
    step_rows = [] if own_steps else [(sid, ts + shift, thread_ids[(pid, tid)], step, end + shift)
                                      for pid, tid, step, ts, end in chrome.steps(t)]
    conn.executemany("INSERT INTO step_mark (session_id, ts, thread_id, step, inferred, end_ts) VALUES (?, ?, ?, ?,"
                     " 0, ?)", step_rows)
    work = [a for a in t.device if a.kind in ("kernel", "memcpy", "memset")]
    out = {"file": str(r.path), "format": "chrome_trace", "session_id": sid, "rank": rank, "world_size": world,
           "runtime": t.runtime, "events": t.events, "skipped": t.skipped, "host_ops": len(t.host),
           "device_activities": len(t.device), "kernels": sum(1 for a in work if a.kind == "kernel"),
           "launches_linked": linked, "steps": sorted({s[3] for s in step_rows}),
           "devices": sorted({a.device for a in work}), "start_ts": t.start_ts + shift, "end_ts": t.end_ts + shift}
    if join is not None and aligned is not None:
        out["join"] = {"session_id": join["id"], "aligned": aligned.offset_ns is not None,
                       "clock_offset_ns": aligned.offset_ns, "matches": aligned.matches,
                       "candidates": aligned.candidates, "residual_ns": aligned.residual_ns, "note": aligned.note}
    return out


def _declare(store: Store, sid: int, layer: tuple[str, str], path: Path, ts: int) -> None:
    """The recording `sid` observes the imported layer too (its word and a capability row). A recording
    that declared no words reads the store's (KNOWN_LAYERS): they are declared first, so that adding
    this one does not hide them."""
    if store.one("SELECT 1 AS x FROM layer_vocabulary WHERE session_id = ? AND kind = 'capability'", (sid,)) is None:
        store.conn.executemany("INSERT OR IGNORE INTO layer_vocabulary (session_id, layer, kind, word, what, why)"
                               " VALUES (?, ?, 'capability', ?, ?, '')",
                               [(sid, word, word, what) for word, what in KNOWN_LAYERS.items()])
    store.conn.execute("INSERT OR IGNORE INTO layer_vocabulary (session_id, layer, kind, word, what, why)"
                       " VALUES (?, ?, 'capability', ?, ?, '')", (sid, layer[0], layer[0], layer[1]))
    store.conn.execute("INSERT INTO capability (session_id, layer, probe, target, status, detail, ts)"
                       " VALUES (?, ?, ?, ?, 'attached', '', ?)", (sid, layer[0], f"import {path.name}", str(path), ts))


def _busiest_process(t: Trace) -> int | None:
    counts: dict[int, int] = {}
    for op in t.host:
        counts[op.pid] = counts.get(op.pid, 0) + 1
    return max(counts, key=lambda p: counts[p]) if counts else None


def _write_dump(store: Store, r: Read, d: Dump) -> dict:
    conn = store.conn
    times = [x for rec in d.records for x in (rec.ts, rec.started_ts, rec.completed_ts) if x]
    start, end = (min(times), max(times)) if times else (0, 0)
    # the dump's times are Unix ns: the session's clock is Unix time (offset 0)
    sid = _session(store, r.path, start, end, 0, FLIGHT_LAYER)
    import_id = _next_id(store, "trace_import")
    sizes = {str(k): v for k, v in d.pg_config.items()} if d.pg_config else None
    world = None
    for cfg in d.pg_config.values() if d.pg_config else ():
        if isinstance(cfg, dict) and cfg.get("desc") == "default_pg":
            with contextlib.suppress(ValueError, TypeError):
                world = len(json.loads(str(cfg.get("ranks"))))
    conn.execute(
        "INSERT INTO trace_import (id, session_id, path, format, sha256, size_bytes, events, skipped, rank,"
        " world_size, backend, runtime, distributed, imported_ts) VALUES (?, ?, ?, 'flight_recorder', ?, ?, ?, 0, ?,"
        " ?, ?, NULL, ?, ?)",
        (import_id, sid, str(r.path), r.sha256, r.size_bytes, len(d.records), d.rank, world,
         _backend(d), json.dumps(sizes, default=str) if sizes else None, time.time_ns()))
    process_id = _next_id(store, "process")
    conn.execute("INSERT INTO process (id, session_id, pid, name, first_ts, job_rank, job_world_size, environ_status)"
                 " VALUES (?, ?, 0, ?, ?, ?, ?, 'read')", (process_id, sid, f"rank {d.rank}", start, d.rank, world))
    conn.executemany(
        "INSERT INTO collective_record (session_id, trace_import_id, rank, pg_name, pg_desc, collective_seq_id,"
        " p2p_seq_id, op_id, profiling_name, state, ts, started_ts, completed_ts, timeout_ms, input_sizes,"
        " output_sizes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(sid, import_id, d.rank, x.pg_name, x.pg_desc, x.collective_seq_id, x.p2p_seq_id, x.op_id, x.profiling_name,
          x.state, x.ts, x.started_ts, x.completed_ts, x.timeout_ms, x.input_sizes, x.output_sizes)
         for x in d.records])
    pending = [x for x in d.records if x.state != "completed"]
    return {"file": str(r.path), "format": "flight_recorder", "session_id": sid, "rank": d.rank, "world_size": world,
            "version": d.version, "records": len(d.records), "not_completed": len(pending)}


def _backend(d: Dump) -> str | None:
    for rec in d.records:
        if ":" in rec.profiling_name:
            return rec.profiling_name.split(":", 1)[0]
    return None
