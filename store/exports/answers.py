"""The causal model's answers of one session, as the rows `recorder export --parquet` writes next to
the recorded tables, so that DuckDB, Spark or Trino users (and `recorder cluster explain`) read the
causes instead of re-deriving them from rows:

- `stall`: every stalled step of every thread (the `stall` view), worst first, with its primary cause
  (kind, summary, Python line, device, lineage, kernel path, the straggler rank it waited for) and the
  explanation `recorder cluster explain` prints for that rank, for the STALLS_EXPLAINED worst;
- `stall_report`: the stall report (`recorder explain --step N --json`, store/models.py) of the
  `reports` worst stalled steps, as JSON; a session without steps gets its one report;
- `step_cause`: the breakdown of every step (view step_cause) with the step's number and thread;
- `causal_link`, `wait_chain`: the rows of those views for the session;
- `hang`: the calls in flight at the stop and the collectives they hold up (one row per open call);
- `export_meta`: the export's schema version and what was capped.

Each function returns an Arrow table; the columns and their meaning are in docs/export.md.
"""

from __future__ import annotations

import json
import time

from store.analysis.causes import find_stalls
from store.analysis.hangs import hang_facts
from store.db import Store
from store.report.build import analyse, session_row
from store.report.rank import materialise_nccl, rank_step_cause

SCHEMA_VERSION = 2  # 1: the recorded tables and five views; 2: and the answers of this module
STALLS_EXPLAINED = 256  # stalled steps per session whose cause is analysed (the worst by lost time)
REPORTS = 16  # stalled steps per session whose full report is written (default of --reports)
ALL_TIME = (0, 2**63 - 1)

# name -> [(column, Arrow type name)]: the schema written even when a session has no such rows
SCHEMAS: dict[str, list[tuple[str, str]]] = {
    "stall": [
        ("step_mark_id", "int64"), ("step", "int64"), ("process_id", "int64"), ("thread_id", "int64"),
        ("pid", "int64"), ("tid", "int64"), ("rank", "int64"), ("ts", "int64"), ("wall_ts", "int64"),
        ("dur", "int64"), ("baseline_dur", "int64"), ("ratio", "float64"), ("excess_dur", "int64"),
        ("complete", "int64"), ("inferred", "int64"), ("collective", "string"), ("collective_ts", "int64"),
        ("collective_wall_ts", "int64"), ("lost_rank", "int64"), ("explained", "int64"),
        ("cause_kind", "string"), ("summary", "string"), ("python", "string"), ("device", "string"),
        ("lineage_label", "string"), ("lineage_tag", "int64"), ("checkpoint", "string"),
        ("kernel_path", "string"), ("cause_dur", "int64"), ("share_of_stall", "float64"),
        ("straggler_rank", "int64"), ("straggler_pid", "int64"), ("next_actions", "string"),
        ("symptom", "string"), ("explanation", "string"),
    ],
    "stall_report": [
        ("step", "int64"), ("step_mark_id", "int64"), ("wall_ts", "int64"), ("mode", "string"),
        ("stall", "int64"), ("cause_kind", "string"), ("summary", "string"), ("python", "string"),
        ("report", "string"),
    ],
    "step_cause": [
        ("step_mark_id", "int64"), ("step", "int64"), ("thread_id", "int64"), ("cause", "string"),
        ("detail", "string"), ("dur", "int64"), ("events", "int64"),
    ],
    "causal_link": [
        ("from_table", "string"), ("from_id", "int64"), ("relation", "string"), ("to_table", "string"),
        ("to_id", "int64"), ("dur", "int64"),
    ],
    "wait_chain": [
        ("root_offcpu_id", "int64"), ("depth", "int64"), ("woke_offcpu_id", "int64"), ("offcpu_id", "int64"),
        ("thread_id", "int64"), ("tid", "int64"), ("pid", "int64"), ("thread_name", "string"),
        ("process_name", "string"), ("ts", "int64"), ("dur", "int64"), ("blocked_dur", "int64"),
        ("reason", "string"), ("syscall_name", "string"), ("wakeup_ts", "int64"), ("waker_tid", "int64"),
        ("waker_pid", "int64"), ("waker_name", "string"), ("device", "string"), ("python", "string"),
    ],
    "hang": [
        ("summary", "string"), ("layer", "string"), ("api", "string"), ("pid", "int64"), ("tid", "int64"),
        ("rank", "int64"), ("comm_hash", "int64"), ("since_ts", "int64"), ("since_utc", "string"),
        ("open_dur_ns", "int64"), ("python", "string"), ("text", "string"), ("collectives", "string"),
    ],
    "export_meta": [
        ("schema_version", "int64"), ("recorder_version", "string"), ("recording_schema", "int64"),
        ("exported_utc", "string"), ("source_db", "string"), ("stalls", "int64"), ("stalls_explained", "int64"),
        ("stalls_explained_cap", "int64"), ("reports", "int64"), ("reports_cap", "int64"),
        ("seconds", "float64"),
    ],
}


def arrow_table(name: str, rows: list[dict]):
    import pyarrow as pa

    kinds = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}
    schema = pa.schema([(c, kinds[t]) for c, t in SCHEMAS[name]])
    return pa.Table.from_pylist([{c: r.get(c) for c, _ in SCHEMAS[name]} for r in rows], schema=schema)


def session_answers(store: Store, session_id: int, source: str, reports: int = REPORTS) -> dict:
    """{table name: Arrow table} of the session's answers, and 'summary' (what was capped)."""
    begun = time.monotonic()
    session = session_row(store, session_id)
    off = session["wall_offset_ns"]
    materialise_nccl(store)
    ranks = {r[0]: r[1] for r in store.conn.execute(
        "SELECT process_id, min(rank) FROM nccl_comm WHERE session_id = ? GROUP BY process_id", (session_id,))}
    names = {r[0]: (r[1], r[2]) for r in store.conn.execute(
        "SELECT t.id, t.tid, p.pid FROM thread t LEFT JOIN process p ON p.id = t.process_id"
        " WHERE t.session_id = ?", (session_id,))}
    stalls = find_stalls(store, session_id, *ALL_TIME)
    stall_rows = []
    for i, s in enumerate(stalls):
        tid, pid = names.get(s["thread_id"], (None, None))
        row = {k: s[k] for k in ("step_mark_id", "step", "process_id", "thread_id", "ts", "dur", "baseline_dur",
                                 "ratio", "excess_dur", "complete", "inferred")}
        row.update(pid=pid, tid=tid, rank=ranks.get(s["process_id"]), wall_ts=s["ts"] + off, lost_rank=i + 1,
                   explained=0)
        entered = store.conn.execute(
            "SELECT c.ts, a.name FROM nccl_call c JOIN nccl_api a ON a.id = c.api_id WHERE c.thread_id = ?"
            " AND c.ts >= ? AND c.ts < ? AND a.kind = 'collective' ORDER BY c.ts LIMIT 1",
            (s["thread_id"], s["ts"], s["ts"] + s["dur"])).fetchone()
        if entered:
            row.update(collective=entered[1], collective_ts=entered[0], collective_wall_ts=entered[0] + off)
        if i < STALLS_EXPLAINED:
            explanation, cause = rank_step_cause(store, session_id, s["process_id"], s["step"], source)
            row.update(explained=1, symptom=explanation.get("symptom"), explanation=json.dumps(explanation),
                       summary=explanation["summary"])
            if cause:
                lineage = cause.get("lineage") or {}
                row.update(cause_kind=cause.get("kind"), python=cause.get("python"), device=cause.get("device"),
                           lineage_label=lineage.get("label"), lineage_tag=lineage.get("tag"),
                           checkpoint=lineage.get("checkpoint"),
                           kernel_path=" -> ".join(cause.get("kernel_path") or []) or None,
                           cause_dur=cause.get("excess_dur_ns"), share_of_stall=cause.get("share_of_stall"),
                           straggler_rank=cause.get("straggler_rank"), straggler_pid=cause.get("straggler_pid"),
                           next_actions=json.dumps(cause.get("next_actions") or []))
        stall_rows.append(row)
    report_rows = _reports(store, session_id, off, stalls, reports)
    out = {
        "stall": arrow_table("stall", stall_rows),
        "stall_report": arrow_table("stall_report", report_rows),
        "step_cause": arrow_table("step_cause", store.query(
            "SELECT c.step_mark_id, m.step, m.thread_id, c.cause, c.detail, c.dur, c.events FROM step_mark m"
            " JOIN step_cause c ON c.step_mark_id = m.id WHERE m.session_id = ? ORDER BY m.ts, c.dur DESC",
            (session_id,))),
        "causal_link": arrow_table("causal_link", store.query(
            "SELECT from_table, from_id, relation, to_table, to_id, dur FROM causal_link WHERE session_id = ?",
            (session_id,))),
        "wait_chain": arrow_table("wait_chain", _wait_chains(store, session_id)),
        "hang": arrow_table("hang", _hangs(store, session)),
    }
    explained = min(len(stalls), STALLS_EXPLAINED)
    summary = {"stalls": len(stalls), "stalls_explained": explained, "stalls_explained_cap": STALLS_EXPLAINED,
               "reports": sum(1 for r in report_rows if r["step"] is not None) or len(report_rows),
               "reports_cap": reports, "seconds": round(time.monotonic() - begun, 3)}
    out["summary"] = summary
    return out


def _reports(store: Store, session_id: int, off: int, stalls: list[dict], cap: int) -> list[dict]:
    """The full report of the `cap` worst stalled step numbers (one report per number, as
    `recorder explain --step N`); a session that marks no step: its one report."""
    numbers: list[int] = []
    for s in stalls:
        if s["step"] not in numbers:
            numbers.append(s["step"])
    has_steps = store.one("SELECT 1 AS x FROM step_mark WHERE session_id = ? LIMIT 1", (session_id,)) is not None
    todo: list[int | None] = list(numbers[:cap]) if has_steps else ([None] if cap else [])
    out = []
    for number in todo:
        report = analyse(store, session_id, step=number).root
        data = report.model_dump(exclude_unset=True)
        cause = data.get("primary_cause") or {}
        step = data.get("step") or {}
        first = next((s for s in stalls if s["step"] == number), None)
        out.append({"step": number, "step_mark_id": step.get("step_mark_id") if isinstance(step, dict) else None,
                    "wall_ts": first["ts"] + off if first else None, "mode": data.get("mode"),
                    "stall": int(bool(data.get("stall"))), "cause_kind": cause.get("kind"),
                    "summary": cause.get("summary") or data.get("symptom"), "python": cause.get("python"),
                    "report": report.model_dump_json(exclude_unset=True)})
    return out


def _wait_chains(store: Store, session_id: int) -> list[dict]:
    """The wait_chain rows of the session's blocked waits (a recursive view: per root, as reports ask)."""
    roots = [r[0] for r in store.conn.execute(
        "SELECT h.offcpu_id FROM wait_hop h JOIN offcpu_interval o ON o.id = h.offcpu_id"
        " WHERE h.session_id = ? AND h.waker_offcpu_id IS NOT NULL"
        " AND h.wakeup_ts - o.ts >= (SELECT min_blocked_dur FROM wait_chain_rule)", (session_id,))]
    cols = [c for c, _ in SCHEMAS["wait_chain"]]
    have = {r[1] for r in store.conn.execute("PRAGMA table_info(wait_chain)")}
    select = ", ".join(c if c in have else f"NULL AS {c}" for c in cols)
    out = []
    for root in roots:
        out += store.query(f"SELECT {select} FROM wait_chain WHERE root_offcpu_id = ? ORDER BY depth", (root,))
    return out


def _hangs(store: Store, session: dict) -> list[dict]:
    facts = hang_facts(store, session)
    if not facts:
        return []
    collectives = json.dumps(facts["collectives"])
    return [{**{k: c.get(k) for k in ("layer", "api", "pid", "tid", "rank", "comm_hash", "since_ts", "since_utc",
                                     "open_dur_ns", "python", "text")},
             "summary": facts["summary"], "collectives": collectives} for c in facts["open_calls"]]
