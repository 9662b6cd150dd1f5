"""Why one rank was slow in one step, from its own recording: what `recorder cluster explain` says of
a late or hung rank, and what `recorder export --parquet` stores of every stalled step (the
`stall` table's `explanation`), so that a fleet's exports give the same text as its recordings."""

from __future__ import annotations

import sqlite3

from store.analysis.causes import lookup_steps
from store.db import Store
from store.errors import UserError
from store.report.build import analyse_step, explain, ms, session_row


def rank_step(store: Store, session_id: int, process_id: int, step: int, source: str) -> dict:
    """The explanation of `process_id`'s step `step` (rank_step_cause without the cause's facts)."""
    return rank_step_cause(store, session_id, process_id, step, source)[0]


def rank_step_cause(store: Store, session_id: int, process_id: int, step: int,
                    source: str) -> tuple[dict, dict | None]:
    """The explanation of `process_id`'s step `step`: its primary cause, device, Python line, kernel
    path and next actions; and the primary cause's facts (None without one). Where the session holds
    only this rank's row of the step, the recording's own report (as `recorder explain --step` gives
    it); else the report's analysis of that row."""
    pid = store.one("SELECT pid FROM process WHERE id = ?", (process_id,))
    pid = pid["pid"] if pid else None
    try:
        rows = lookup_steps(store, session_id, step)
        mine = [r for r in rows if r["process_id"] == process_id]
        if not mine:
            return {"available": False, "summary": f"rank process {pid} marked no step {step} in {source}"}, None
        if len(rows) == len(mine):  # the recording's only rank: its own report, as 'recorder explain' gives it
            report = explain(store, session_id, step=step)
            cause, symptom, stall = report["primary_cause"], report["symptom"], report["stall"]
            dur = report["step"]["dur_ns"]
        else:  # several ranks in one recording: the report's analysis of this rank's row only
            a = analyse_step(store, session_row(store, session_id), mine[0])
            cause, stall, dur = a["primary_cause"], a["slow"], a["dur_ns"]
            symptom = (f"step {step} took {ms(dur)}, {a['ratio']}x its median of {ms(a['baseline_dur_ns'])}"
                       if a["baseline_dur_ns"] else f"step {step} took {ms(dur)}")
            if not a["complete"]:
                symptom += " (still running when the recording stopped)"
    except UserError as e:
        return {"available": False, "summary": str(e)}, None
    out = {"available": True, "step_dur_ns": dur, "stall": stall, "symptom": symptom,
           "summary": cause["summary"] if cause else "no recorded wait explains it", "kind": None, "device": None,
           "python": None, "kernel_path": [], "utc": None}
    if cause:
        out.update(kind=cause.get("kind"), device=cause.get("device"), python=cause.get("python"),
                   kernel_path=cause.get("kernel_path") or [], utc=cause.get("utc"),
                   next_actions=cause.get("next_actions") or [])
    return out, cause


# The session-wide NCCL views a step's breakdown joins (window functions over every collective of
# the recording, so SQLite recomputes them in full for each of the ~20 queries of one step), with the
# columns they are looked up by: computed once per connection as indexed temporary tables.
MATERIALISED = {
    "nccl_collective": ("id", "comm_hash, seq, rank"),
    "nccl_collective_wait": ("nccl_call_id",),
    "nccl_straggler": ("comm_hash, seq",),
}


def materialise_nccl(store: Store) -> None:
    """Replace this read-only connection's temporary NCCL views by tables of the same rows. A
    recording of one node holds every collective of its 8 ranks: without this, explaining one rank's
    step re-reads all of them ~20 times. Left as views if anything differs from what is expected."""
    conn = store.conn
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_temp_master WHERE type = 'view'")}
    if not set(MATERIALISED) <= names or conn.execute("SELECT count(*) FROM nccl_call").fetchone()[0] < 1000:
        return
    try:
        conn.execute("SAVEPOINT materialise")
        for name, keys in MATERIALISED.items():  # in dependency order: wait and straggler read the collectives
            conn.execute(f"CREATE TEMP TABLE _m_{name} AS SELECT * FROM {name}")
            conn.execute(f"DROP VIEW temp.{name}")
            conn.execute(f"ALTER TABLE temp._m_{name} RENAME TO {name}")
            for i, cols in enumerate(keys):
                conn.execute(f"CREATE INDEX temp.{name}_k{i} ON {name} ({cols})")
        conn.execute("RELEASE materialise")
    except sqlite3.Error:
        conn.execute("ROLLBACK TO materialise")
        conn.execute("RELEASE materialise")
