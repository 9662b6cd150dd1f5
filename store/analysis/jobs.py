"""The job identity of recorded processes (the `process` columns of schema v20: rank, world size,
run id, Slurm job and step, Kubernetes pod) as one phrase a report prints and as rows the MCP tools
return. Recordings older than v20 have none: their processes read as `environ_status` NULL."""

from __future__ import annotations

import sqlite3

from store.db import Store
from store.text import printable

JOB_FIELDS = ("environ_status", "job_rank", "job_local_rank", "job_world_size", "master_addr", "run_id", "slurm_job_id",
              "slurm_step_id", "pod_uid", "pod_namespace", "pod_name", "cgroup")


LABEL_MAX = 1024  # characters of a label


def job_label(row: dict) -> str | None:
    """'rank 1 of 2 (local rank 1), torchrun run r42, Slurm job 4711 step 0, pod ml/trainer-1' from a
    process row; what could not be read is said so ('RANK unreadable: ...'); None when the process
    carries nothing. Printable whatever the row holds (a recording of an older version kept values
    as the process gave them)."""
    status = row.get("environ_status")
    parts = []
    if row.get("job_rank") is not None:
        of = f" of {row['job_world_size']}" if row.get("job_world_size") is not None else ""
        local = f" (local rank {row['job_local_rank']})" if row.get("job_local_rank") is not None else ""
        parts.append(f"rank {row['job_rank']}{of}{local}")
    elif row.get("job_local_rank") is not None:
        parts.append(f"local rank {row['job_local_rank']}")
    if row.get("run_id"):
        parts.append(f"torchrun run {row['run_id']}")
    if row.get("slurm_job_id"):
        parts.append(f"Slurm job {row['slurm_job_id']}"
                     + (f" step {row['slurm_step_id']}" if row.get("slurm_step_id") else ""))
    if row.get("pod_name") or row.get("pod_uid"):
        name = "/".join(x for x in (row.get("pod_namespace"), row.get("pod_name")) if x)
        parts.append("pod " + (name or row["pod_uid"]) + (f" (uid {row['pod_uid']})" if name and row.get("pod_uid")
                                                          else ""))
    base, _, refused = (status or "").partition("; ")
    if base not in ("", "read", "empty"):
        parts.append(f"environment {status}: rank and job not known")
    elif refused:  # values present but not what their fields hold, or an environment cut at its cap
        parts.append(refused)
    return printable(", ".join(parts), LABEL_MAX) or None


def process_job(store: Store, process_id: int | None) -> dict:
    """The job fields of one process row and their `label`; {} for none (or before v20)."""
    if process_id is None:
        return {}
    try:
        row = store.one(f"SELECT {', '.join(JOB_FIELDS)} FROM process WHERE id = ?", (process_id,))
    except sqlite3.OperationalError:  # a recording older than v20, opened read-only
        return {}
    return {**row, "label": job_label(row)} if row else {}


def thread_names(store: Store, thread_id: int) -> dict:
    """A thread's tid, pid, thread and process names (thread_info) and its process's job label."""
    names = store.one("SELECT tid, pid, thread_name, process_name FROM thread_info WHERE thread_id = ?",
                      (thread_id,)) or {}
    process = store.one("SELECT process_id FROM thread WHERE id = ?", (thread_id,)) or {}
    return {**names, "job": process_job(store, process.get("process_id")).get("label")}


def forked_copy(store: Store, sid: int, pid: int | None, training_pid: int | None) -> bool:
    """Whether process `pid` is a copy of the training process forked without an exec (what a
    data-loader worker is, whatever name it gives itself): its command line is the training
    process's. A helper the job started (a compiler, a script) runs another command."""
    if pid is None or training_pid is None or pid == training_pid:
        return False
    rows = store.query("SELECT pid, cmdline FROM process WHERE session_id = ? AND pid IN (?, ?)"
                       " AND cmdline IS NOT NULL", (sid, pid, training_pid))
    lines = {r["pid"]: r["cmdline"] for r in rows}
    return len(lines) == 2 and lines[pid] == lines[training_pid]


def processes(store: Store, session_id: int) -> list[dict]:
    """Every process of a session with its command line and job identity, first seen first."""
    cols = ", ".join(f"p.{c}" for c in JOB_FIELDS)
    try:
        rows = store.query(f"SELECT p.id AS process_id, p.pid, p.parent_pid, p.name, p.cmdline, p.first_ts,"
                           f" p.exit_ts, {cols} FROM process p WHERE p.session_id = ? ORDER BY p.id", (session_id,))
    except sqlite3.OperationalError:  # older than v20
        rows = store.query("SELECT p.id AS process_id, p.pid, p.parent_pid, p.name, p.cmdline, p.first_ts,"
                           " p.exit_ts FROM process p WHERE p.session_id = ? ORDER BY p.id", (session_id,))
    return [{**r, "job": job_label(r)} for r in rows]


def labels_by_pid(path: str, session_id: int) -> dict[int, str]:
    """pid -> job label of a recording's session, for the processes that carry one (the last
    process image of a pid wins); {} when the file cannot say (older than v20, unreadable)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return {}
    try:
        conn.row_factory = sqlite3.Row
        rows = conn.execute(f"SELECT pid, {', '.join(JOB_FIELDS)} FROM process WHERE session_id = ? ORDER BY id",
                            (session_id,)).fetchall()
    except sqlite3.Error:
        return {}
    finally:
        conn.close()
    return {r["pid"]: label for r in rows if (label := job_label(dict(r)))}
