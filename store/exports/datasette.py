"""`recorder export --datasette-metadata FILE`: metadata.json for browsing a recording in Datasette.

`datasette stall.db -m metadata.json` then shows every table and view with its description, every
column with what it holds and its unit, and canned queries for the questions the recorder answers
(which steps stalled, where a step's time went, what explains it, who took the CPU, which disk was
slow). Descriptions come from the schema's own comments (store/migrations and store/views), so they
say what `recorder explain` relies on; columns are checked against the database, so the file only
names what exists.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from store.db import Store
from store.db.rules import stall_rule
from store.errors import UserError

HEADER = re.compile(r"^-- (table|view): (\w+)\s*$")
ALTER = re.compile(r"^ALTER TABLE (\w+) ADD COLUMN (\w+)[^-]*--(.*)$", re.I)
KEYWORDS = {"PRIMARY", "UNIQUE", "FOREIGN", "CHECK", "CONSTRAINT", "SELECT", "FROM", "JOIN", "WHERE", "CASE",
            "WHEN", "THEN", "ELSE", "END", "AND", "OR", "ON", "AS", "NULL", "NOT", "IS", "IN", "BY"}

# Canned queries: the questions a recording answers, with the view that answers each.
QUERIES: dict[str, dict] = {
    "stalls": {
        "title": "Which steps stalled?",
        "description": "Steps that took at least {rule}, worst first (the stall_rule table).",
        "sql": "SELECT session_id, step, thread_id, ts, dur / 1e6 AS dur_ms, baseline_dur / 1e6 AS baseline_ms, "
               "ratio, step_mark_id FROM stall ORDER BY excess_dur DESC",
    },
    "step_breakdown": {
        "title": "Where did a step's time go?",
        "description": "The time of the step's thread by cause (cpu_wait, blocked, reclaim, cuda_call, nccl_wait...).",
        "sql": "SELECT s.session_id, s.step, c.cause, c.detail, c.dur / 1e6 AS ms, c.events FROM step_cause c "
               "JOIN step_mark s ON s.id = c.step_mark_id WHERE s.step = :step ORDER BY c.dur DESC",
    },
    "step_causal_links": {
        "title": "What explains a step?",
        "description": "Every causal_link from the step, and the links one hop further (the contender, "
                       "the straggler's call, the device event).",
        # causal_link's two halves apart, each joined through its index: the links stored at the
        # stop, and those computed for a session not stored (still recording); a join on the
        # causal_link view itself would read every link of the session
        "sql": "WITH steps AS (SELECT id, session_id FROM step_mark WHERE step = :step), "
               "live AS (SELECT * FROM steps WHERE session_id NOT IN (SELECT session_id FROM causal_link_session)), "
               "first AS (SELECT l.* FROM steps s CROSS JOIN causal_link_stored l ON l.from_table = 'step_mark' "
               "AND l.from_id = s.id UNION ALL SELECT l.* FROM live s CROSS JOIN causal_link_live l "
               "ON l.from_table = 'step_mark' AND l.from_id = s.id) "
               "SELECT 1 AS hop, * FROM first UNION ALL SELECT 2, l.* FROM first f CROSS JOIN causal_link_stored l "
               "ON l.from_table = f.to_table AND l.from_id = f.to_id UNION ALL SELECT 2, l.* FROM first f "
               "CROSS JOIN causal_link_live l ON l.from_table = f.to_table AND l.from_id = f.to_id "
               "WHERE f.session_id IN (SELECT session_id FROM live) ORDER BY hop, dur DESC",
    },
    "slow_cuda_calls": {
        "title": "Which CUDA calls took far longer than usual?",
        "description": "Calls at least twice the median of their API and size class, by excess.",
        # the candidates first, through the (session_id, api_id, size_class, dur) index: the calls at
        # least slow_call_rule.ratio x their family's stored baseline; slow_cuda_call decides
        "sql": "SELECT session_id, api, ts, dur / 1e6 AS ms, expected_dur / 1e6 AS expected_ms, "
               "excess_dur / 1e6 AS excess_ms, offcpu_dur / 1e6 AS offcpu_ms, id FROM slow_cuda_call "
               "WHERE id IN (SELECT c.id FROM cuda_baseline b JOIN cuda_api a ON a.family = b.family "
               "JOIN cuda_call c ON c.session_id = b.session_id AND c.api_id = a.id "
               "AND c.size_class IS nullif(b.size_class, -1) "
               "AND c.dur >= (SELECT ratio FROM slow_call_rule) * b.median_dur) "
               "ORDER BY excess_dur DESC LIMIT 200",
    },
    "cpu_contenders": {
        "title": "Who took the CPU from the recorded threads?",
        "description": "Time the recorded threads waited for a CPU, by the task that held it.",
        "sql": "SELECT session_id, contender_name, contender_pid, count(*) AS waits, sum(runq_dur) / 1e6 AS waited_ms "
               "FROM offcpu WHERE runq_dur > 0 GROUP BY 1, 2, 3 ORDER BY waited_ms DESC",
    },
    "block_latency": {
        "title": "How slow was each disk?",
        "description": "Exact p50/p99/p99.9/max of block requests per device and operation, and their stages.",
        "sql": "SELECT session_id, device, op, requests, p50_dur / 1e6 AS p50_ms, p99_dur / 1e6 AS p99_ms, "
               "p999_dur / 1e6 AS p999_ms, max_dur / 1e6 AS max_ms, max_queued_dur / 1e6 AS max_queued_ms, "
               "max_device_dur / 1e6 AS max_device_ms FROM block_latency ORDER BY max_dur DESC",
    },
    "slowest_block_requests": {
        "title": "Which block requests were in the slowest 0.1%?",
        "description": "Requests at or above their device's p99.9, with the thread that submitted them.",
        "sql": "SELECT session_id, device, op, ts, dur / 1e6 AS ms, size_bytes, tid, process_name, submitter_kind, "
               "id FROM block_request_percentile WHERE percentile >= 0.999 ORDER BY dur DESC LIMIT 200",
    },
    "device_events": {
        "title": "What did the kernel log say about devices?",
        "description": "Kernel log lines of the watched subsystems (NVMe, block, IOMMU, AER, SWIOTLB, GPU, OOM).",
        "sql": "SELECT session_id, ts, subsystem, device, event_kind, text FROM kernel_log "
               "WHERE subsystem IS NOT NULL ORDER BY ts",
    },
    "nccl_stragglers": {
        "title": "Which rank entered collectives last?",
        "description": "Per collective, the straggler rank and how late it was (ranks recorded into one database).",
        "sql": "SELECT * FROM nccl_straggler ORDER BY lateness_dur DESC LIMIT 200",
    },
    "python_lines": {
        "title": "Which Python lines spent the most time in CUDA calls?",
        "description": "CUDA time per Python call site.",
        "sql": "SELECT session_id, python_line, calls, dur / 1e6 AS ms, max_dur / 1e6 AS max_ms "
               "FROM python_lines ORDER BY dur DESC LIMIT 100",
    },
    "gpu_util_drops": {
        "title": "When did a GPU starve?",
        "description": "Stretches where GPU utilisation fell below half its session median.",
        "sql": "SELECT session_id, gpu_index, pci_address, ts, dur / 1e6 AS ms, util_gpu, usual_util_gpu "
               "FROM gpu_util_drop ORDER BY dur DESC",
    },
    "coverage": {
        "title": "What was not observed, and what was lost?",
        "description": "Probes that did not attach (and why), and events the recorder knows it dropped.",
        "sql": "SELECT session_id, 'not attached' AS what, layer || ' ' || probe AS source, status || ': ' || detail "
               "AS detail FROM capability WHERE status != 'attached' UNION ALL SELECT session_id, 'lost', probe, "
               "sum(dropped) || ' events' FROM loss GROUP BY session_id, probe",
    },
}


# Views whose columns are words over others, described here.
EXTRA_COLUMNS = {
    "causal_link": {
        "from_table": "table of the row being explained (step_mark, cuda_call, nccl_call, offcpu_interval, ...)",
        "from_id": "its id",
        "relation": "how the rows are linked: off_cpu, waited_behind, slow_call, collective_wait, "
                    "waited_for_rank, io, hit_by, reclaim, dirty_throttle, during",
        "to_table": "table of the row that explains it ('thread' for the task a thread waited behind)",
        "to_id": "its id",
        "dur": "ns of the from row this link accounts for; NULL for events without a duration",
    },
    "step_cause": {
        "cause": "cpu_wait, blocked, reclaim, dirty_throttle, cuda_call or nccl_wait",
        "detail": "who or what: the process that held the CPU, the blocking reason, the API, the straggler rank",
        "dur": "ns of the step's thread this cause accounts for (causes may overlap)",
        "events": "rows summed",
    },
}


def unit_of(column: str, comment: str) -> str | None:
    """The unit of a column, from the schema's naming rules (dur in ns, *_bytes in bytes).

    Timestamps (ts, *_ts) get none: Datasette would print a CLOCK_MONOTONIC ns value as '5.0 ks'."""
    if column == "ts" or column.endswith("_ts"):
        return None
    if column == "dur" or column.endswith("_dur") or re.match(r"ns\b", comment):
        return "ns"
    if column.endswith("_bytes"):
        return "B"
    for suffix, unit in (("_mhz", "MHz"), ("_mw", "mW"), ("temperature_c", "degC")):
        if column.endswith(suffix):
            return unit
    return None


def schema_docs() -> dict[str, dict]:
    """{name: {kind, description, columns: {column: comment}}} from the schema's SQL comments."""
    docs: dict[str, dict] = {}
    for folder in ("migrations", "views"):
        for path in sorted((Path(__file__).resolve().parent.parent / folder).glob("*.sql")):
            cur: dict | None = None
            in_body = False
            for line in path.read_text().splitlines():
                alter = ALTER.match(line)
                if alter:  # a column added later, commented where it is added
                    docs.setdefault(alter.group(1), {"kind": "table", "description": "", "columns": {}, "body": ""})
                    docs[alter.group(1)]["columns"][alter.group(2)] = alter.group(3).strip()
                    continue
                m = HEADER.match(line)
                if m:
                    cur = docs.setdefault(m.group(2), {"kind": m.group(1), "description": "", "columns": {},
                                                       "body": ""})
                    in_body = False
                    continue
                if cur is None:
                    continue
                if not in_body:
                    if line.startswith("-- "):
                        cur["description"] = (cur["description"] + " " + line[3:].strip()).strip()
                        continue
                    if line.startswith("CREATE"):
                        in_body = True
                    continue
                code, _, comment = line.partition("--")
                cur["body"] += code + "\n"
                if comment and code.strip():
                    words = re.findall(r"[A-Za-z_]\w*", code)
                    if cur["kind"] == "table":
                        name = words[0] if words and words[0].upper() not in KEYWORDS else None
                    else:  # a view's column is the name just before the comment (after AS, or a.name)
                        name = words[-1] if words else None
                    if name and name not in cur["columns"]:
                        cur["columns"][name] = comment.strip()
                if line.rstrip().endswith(";"):
                    cur, in_body = None, False
    return docs


def queries(store: Store) -> dict[str, dict]:
    """The canned queries, quoting the recording's own stall rule."""
    out = {name: dict(q) for name, q in QUERIES.items()}
    out["stalls"]["description"] = out["stalls"]["description"].format(rule=stall_rule(store).text())
    return out


def build_metadata(store: Store, database: str) -> dict:
    docs = schema_docs()
    present = {r["name"]: r["type"] for r in store.query(
        "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view') UNION "
        "SELECT name, type FROM sqlite_temp_master WHERE type = 'view'")}
    names = [n for n in sorted(docs) if n in present]
    columns = {n: [r["name"] for r in store.query(f'PRAGMA table_info("{n}")')] for n in names}
    for n in names:
        for c, text in EXTRA_COLUMNS.get(n, {}).items():
            docs[n]["columns"].setdefault(c, text)
    # a view's column passed through from a table or view it reads keeps that one's description;
    # repeated so that it carries through views built on views
    for _ in range(4):
        for n in names:
            doc = docs[n]
            sources = [docs[m] for m in re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", doc["body"], re.I) if m in docs]
            for c in columns[n]:
                if not doc["columns"].get(c) and not re.search(rf"\bAS\s+{c}\b", doc["body"], re.I):
                    found = next((d["columns"][c] for d in sources if d["columns"].get(c)), None)
                    if found:
                        doc["columns"][c] = found
    tables: dict[str, dict] = {}
    for name in names:
        doc = docs[name]
        described = {c: doc["columns"][c] for c in columns[name] if doc["columns"].get(c)}
        units = {c: u for c in columns[name] if (u := unit_of(c, described.get(c, "")))}
        entry: dict = {"title": name.replace("_", " "), "description": doc["description"]}
        if described:
            entry["columns"] = described
        if units:
            entry["units"] = units
        if doc["kind"] == "table" and "ts" in columns[name]:
            entry["sort"] = "ts"
        tables[name] = entry
    return {
        "title": "stall-recorder recording",
        "description": "What a GPU training job went through, layer by layer (scheduler, CUDA, NCCL, block and "
                       "NVMe, DMA, kernel log, Python), and why its steps stalled. Times are ns of "
                       "CLOCK_MONOTONIC (session.wall_offset_ns turns them into Unix time); start with the "
                       "queries below or with the views stall, step_cause and causal_link.",
        "databases": {database: {"tables": tables, "queries": queries(store)}},
    }


def export_datasette_metadata(store: Store, out: Path) -> dict:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"folder {parent} does not exist: create it or write the metadata elsewhere")
    database = Path(store.path).stem  # the name datasette gives a database file
    meta = build_metadata(store, database)
    tmp = out.with_name(out.name + ".part")
    try:
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {out}: {e.strerror}; pass a writable path") from None
    t = meta["databases"][database]["tables"]
    # Datasette reads the file itself: an earlier version's recording is browsed through its migrated
    # copy (same file name, so the same database name), kept in the reader's cache; None: no copy is kept
    kept = store.read_path == store.path or store.snapshot is None
    return {"file": str(out), "database": database, "database_file": str(store.read_path) if kept else None,
            "tables": len(t),
            "columns": sum(len(x.get("columns", {})) for x in t.values()), "queries": len(QUERIES)}
