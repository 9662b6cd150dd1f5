"""Queries only the MCP tools need: listings and drill-downs over the store's tables and views.

The stall report itself is store.report.build.explain(); these functions add the listings an assistant
walks through (sessions, capabilities, kernel-log events, the rows behind a causal link) and answer
for layers this recorder does not record yet by saying so, from the capability table, instead of
returning numbers that do not exist. Times are ns of CLOCK_MONOTONIC (``*_ns``), with UTC next to them.
"""

from __future__ import annotations

from typing import Any

from store.analysis import jobs
from store.analysis.causes import all_steps, find_stalls
from store.analysis.losses import losses
from store.db import Store
from store.db.rules import slow_call_rule, stall_rule
from store.errors import UserError
from store.report.build import analyse_step, layer_words, resolve_window, session_row, session_state, slow_calls, utc
from store.report.listing import STALLS_ANALYSED

MAX_LIMIT = 500
SLOWEST_REQUESTS = 5  # per device and op in io_latency
WORST_SECONDS = 5  # one-second windows per device and op in io_latency


def _limit(n: int) -> int:
    return max(1, min(int(n), MAX_LIMIT))


def has_table(store: Store, name: str) -> bool:
    return store.one("SELECT 1 AS x FROM sqlite_master WHERE name = ? AND type IN ('table', 'view')",
                     (name,)) is not None


def window_of(store: Store, session_id: int | None, window: str | None) -> tuple[dict, int, int]:
    session = session_row(store, session_id)
    start, end = resolve_window(store, session, window)
    return session, start, end


def _window_out(session: dict, start: int, end: int) -> dict:
    off = session["wall_offset_ns"]
    return {"session_id": session["id"], "start_ns": start, "end_ns": end,
            "start_utc": utc(start + off), "end_utc": utc(end + off)}


def processes(store: Store, session_id: int | None, limit: int) -> dict:
    """The session's processes with their job identity: the targets (their threads were traced)
    first, then the others the session saw (preemptors, wakers), each first seen first."""
    session = session_row(store, session_id)
    traced = {r["process_id"] for r in store.query(
        "SELECT DISTINCT process_id FROM thread WHERE session_id = ? AND traced = 1", (session["id"],))}
    rows = jobs.processes(store, session["id"])
    rows.sort(key=lambda r: r["process_id"] not in traced)
    return {"session_id": session["id"], "processes": rows[:max(1, min(limit, 1000))]}


def sessions(store: Store) -> list[dict]:
    out = []
    for s in store.query("SELECT * FROM session ORDER BY id"):
        counts = store.row(
            "SELECT (SELECT count(*) FROM cuda_call WHERE session_id = :s) AS cuda_calls,"
            " (SELECT coalesce(sum(launches), 0) FROM kernel_launch_count WHERE session_id = :s) AS kernel_launches,"
            " EXISTS (SELECT 1 FROM cuda_launch_count WHERE session_id = :s) AS launches_counted,"
            " (SELECT count(*) FROM offcpu_interval WHERE session_id = :s) AS offcpu_intervals,"
            " (SELECT count(*) FROM kernel_log WHERE session_id = :s) AS kernel_log_records,"
            " (SELECT coalesce(sum(dropped), 0) FROM loss WHERE session_id = :s) AS dropped_events",
            {"s": s["id"]})
        end = s["stopped_ts"]
        out.append({
            "session_id": s["id"], "state": session_state(store, s), "host": s["hostname"],
            "kernel": s["kernel_release"], "target": s["target"],
            "start_utc": utc(s["started_ts"] + s["wall_offset_ns"]),
            "dur_ns": None if end is None else end - s["started_ts"],
            **counts,
        })
    return out


def layer_status(store: Store, session_id: int, layer: str) -> dict:
    """Whether a session observed a layer, with the capability rows that say why not."""
    rows = store.query("SELECT probe, target, status, detail FROM capability WHERE session_id = ? AND layer = ?",
                       (session_id, layer))
    attached = sum(r["status"] == "attached" for r in rows)
    return {
        "layer": layer, "what": layer_words(store, session_id).get(layer, layer), "observed": attached > 0,
        "probes_attached": attached, "probes_not_attached": len(rows) - attached,
        "not_attached": [{"probe": r["probe"], "target": r["target"], "status": r["status"],
                          "detail": r["detail"]} for r in rows if r["status"] != "attached"][:20],
    }


def capabilities(store: Store, session_id: int | None) -> dict:
    session = session_row(store, session_id)
    sid = session["id"]
    layers = [row["layer"] for row in store.query(
        "SELECT DISTINCT layer FROM capability WHERE session_id = ? ORDER BY layer", (sid,))]
    words = layer_words(store, sid)
    all_layers = list(words) + [x for x in layers if x not in words]
    loss = losses(store, sid)
    off = session["wall_offset_ns"]
    return {
        "session_id": sid, "state": session_state(store, session),
        "layers": [layer_status(store, sid, layer) for layer in all_layers],
        "dropped_events": sum(r["count"] for r in loss),
        "dropped_by_probe": [{"probe": r["probe"], "dropped": r["count"], "layer": r["layer"], "what": r["what"],
                              "reason": r["reason"], "first_utc": utc(r["first_ts"] + off),
                              "last_utc": utc(r["last_ts"] + off)} for r in loss],
    }


def not_recorded(store: Store, session_id: int, layer: str, table: str, what: str) -> dict:
    """`note` for a layer with no rows (is the table missing, or was the layer not attached?) and, in
    `not_recorded_because`, the capability rows that say why. Their probe, target and detail can hold
    text from the traced system (library paths, executable names), so they stay out of the note, which
    is the recorder's own words, and are marked as data with the rest of the result."""
    status = layer_status(store, session_id, layer)
    if not has_table(store, table):
        base = f"{what} are not recorded by this version of stall-recorder (no {table} table in this database)"
    elif not status["observed"]:
        base = f"{what}: the {layer} layer was not observed in session {session_id}"
    else:
        return {"note": f"{what}: the {layer} layer was observed and recorded none in this window"}
    because = status["not_attached"][:3]
    return {"note": base + (" (why: not_recorded_because)" if because else "") + ". Nothing here is estimated.",
            "not_recorded_because": because}


def steps(store: Store, session_id: int | None, limit: int) -> dict:
    """Steps of the session, most stalled first, against their rolling baseline (step_baseline:
    the median of the 10 steps before and after), with the id to pass to evidence(kind='step')."""
    session = session_row(store, session_id)
    sid = session["id"]
    off = session["wall_offset_ns"]
    pids = {r["id"]: r["pid"] for r in store.query("SELECT id, pid FROM process WHERE session_id = ?", (sid,))}
    ranked = sorted(all_steps(store, sid), key=lambda r: (-r["slow"], -(r["excess_dur"] or 0), r["ts"]))
    rows = [{**r, "pid": pids.get(r["process_id"])} for r in ranked[:_limit(limit)]]
    out = [{"step": r["step"], "step_mark_id": r["step_mark_id"], "pid": r["pid"], "ts": r["ts"],
            "utc": utc(r["ts"] + off), "dur_ns": r["dur"], "baseline_dur_ns": r["baseline_dur"],
            "ratio_to_baseline": r["ratio"], "stalled": bool(r["slow"]), "complete": bool(r["complete"]),
            "inferred": bool(r["inferred"])} for r in rows]
    if out:
        return {"session_id": sid, "threshold": stall_rule(store).threshold(), "steps": out}
    why = not_recorded(store, sid, "markers", "step_mark", "training steps (recorder.step markers)")
    why["note"] += " Use top_stalls for the slowest CUDA calls and explain_stall with a window instead."
    return {"session_id": sid, "steps": [], **why}


def stalled_steps(store: Store, session: dict, start: int, end: int, limit: int) -> tuple[list[dict], int]:
    """The stalled steps starting in [start, end), worst first, each with the primary cause the step
    report gives it (store.report.build.analyse_step), and how many stalled steps the window holds."""
    stalls = find_stalls(store, session["id"], start, end)
    out = []
    for r in stalls[:limit]:
        a = analyse_step(store, session, r)
        p = a["primary_cause"] or {}
        out.append({
            "step": r["step"], "step_mark_id": r["step_mark_id"], "pid": a["thread"]["pid"],
            "tid": a["thread"]["tid"], "thread_name": a["thread"]["name"], "ts_ns": r["ts"], "utc": a["utc"],
            "dur_ns": r["dur"], "baseline_dur_ns": r["baseline_dur"], "excess_dur_ns": r["excess_dur"],
            "ratio_to_baseline": r["ratio"], "cause": p.get("kind", "unexplained"),
            "summary": p.get("summary", "no recorded wait explains it"), "python_line": p.get("python"),
            "device": p.get("device") or p.get("event_device"),
        })
    return out, len(stalls)


def top_stalls(store: Store, session_id: int | None, window: str | None, limit: int) -> dict:
    session, start, end = window_of(store, session_id, window)
    steps, stalled = stalled_steps(store, session, start, end, _limit(limit))
    calls = slow_calls(store, session["id"], start, end, _limit(limit))
    off = session["wall_offset_ns"]
    out = {
        **_window_out(session, start, end),
        "step_threshold": stall_rule(store).threshold(),
        "stalled_steps_in_window": stalled,
        "steps": steps,
        "threshold": slow_call_rule(store).threshold(),
        "stalls": [{
            "cuda_call_id": c["id"], "api": c["api"], "ts_ns": c["ts"], "utc": utc(c["ts"] + off),
            "dur_ns": c["dur"], "expected_dur_ns": c["expected_dur"], "excess_dur_ns": c["excess_dur"],
            "offcpu_dur_ns": c["offcpu_dur"], "cpu_wait_dur_ns": c["cpu_wait_dur"],
            "blocked_dur_ns": c["blocked_dur"], "tid": c["tid"], "pid": c["pid"],
            "thread_name": c["thread_name"], "cause": c["cause"]["kind"], "summary": c["cause"]["summary"],
        } for c in calls],
    }
    if not steps and not has_steps_recorded(store, session["id"]):
        out["note"] = "no training steps recorded (recorder.step markers or inferred steps): stalls are CUDA calls only"
    return out


def has_steps_recorded(store: Store, session_id: int) -> bool:
    return store.one("SELECT 1 AS x FROM step_mark WHERE session_id = ? LIMIT 1", (session_id,)) is not None


def nvme_events(store: Store, session_id: int | None, window: str | None, controller: str | None,
                limit: int) -> dict:
    session, start, end = window_of(store, session_id, window)
    rows = store.query(
        "SELECT e.*, k.text FROM nvme_event e JOIN kernel_log k ON k.id = e.kernel_log_id"
        " WHERE e.session_id = ? AND e.ts >= ? AND e.ts < ? AND (? IS NULL OR e.controller = ?)"
        " ORDER BY e.ts LIMIT ?",
        (session["id"], start, end, controller, controller, _limit(limit) + 1))
    off = session["wall_offset_ns"]
    hit: dict[int, list[int]] = {}
    if rows:
        for r in store.query(
                "SELECT event_id, block_request_id FROM block_request_device_event WHERE session_id = ?"
                " AND event_table = 'nvme_event' AND ts >= ? AND ts < ? ORDER BY block_request_id",
                (session["id"], start, end)):
            hit.setdefault(r["event_id"], []).append(r["block_request_id"])
    events = [{"nvme_event_id": r["id"], "kernel_log_id": r["kernel_log_id"], "ts_ns": r["ts"],
               "utc": utc(r["ts"] + off), "kind": r["kind"], "controller": r["controller"], "tag": r["tag"],
               "qid": r["qid"], "command_id": r["command_id"], "opcode": r["opcode"], "req_op": r["req_op"],
               "size_bytes": r["size_bytes"], "status": r["status"], "action": r["action"], "text": r["text"],
               "block_request_ids": hit.get(r["id"], [])[:50]}
              for r in rows]
    status = layer_status(store, session["id"], "kmsg")
    return {
        **_window_out(session, start, end), "kernel_log_observed": status["observed"],
        "events": events[:_limit(limit)], "truncated": len(events) > _limit(limit),
        "note": "block_request_ids: the block requests in flight on the controller when the event came "
                "(evidence(kind='block_request', id=...) for each, with the step behind it); a timeout line "
                "means the command was issued about nvme_core.io_timeout (30 s by default) before ts_ns",
    }


def kernel_log(store: Store, session_id: int | None, window: str | None, subsystem: str | None,
               max_level: int | None, contains: str | None, limit: int) -> dict:
    session, start, end = window_of(store, session_id, window)
    rows = store.query(
        "SELECT id, ts, level, subsystem, event_kind, device, text, malformed FROM kernel_log"
        " WHERE session_id = ? AND ts >= ? AND ts < ? AND (? IS NULL OR subsystem = ?)"
        " AND (? IS NULL OR level <= ?) AND (? IS NULL OR instr(text, ?) > 0) ORDER BY ts, seq LIMIT ?",
        (session["id"], start, end, subsystem, subsystem, max_level, max_level, contains, contains,
         _limit(limit) + 1))
    off = session["wall_offset_ns"]
    records = [{"kernel_log_id": r["id"], "ts_ns": r["ts"], "utc": utc(r["ts"] + off), "level": r["level"],
                "subsystem": r["subsystem"], "event_kind": r["event_kind"], "device": r["device"],
                "text": r["text"], "malformed": r["malformed"]} for r in rows]
    status = layer_status(store, session["id"], "kmsg")
    out = {**_window_out(session, start, end), "kernel_log_observed": status["observed"],
           "records": records[:_limit(limit)], "truncated": len(records) > _limit(limit)}
    if not status["observed"] and not records:
        out.update(not_recorded(store, session["id"], "kmsg", "kernel_log", "kernel log records"))
    return out


# block_latency (store/views/0003_io.sql) restricted to requests that start in [:a, :b): the same
# exact nearest-rank percentiles over the same columns.
_BLOCK_LATENCY_IN_WINDOW = """
WITH q AS (
  SELECT device, op, dur, queued_dur, device_dur, size_bytes,
         cume_dist() OVER (PARTITION BY device, op ORDER BY dur) AS cd,
         cume_dist() OVER (PARTITION BY device, op ORDER BY queued_dur) AS cq,
         cume_dist() OVER (PARTITION BY device, op ORDER BY device_dur) AS cv
  FROM block_request WHERE session_id = :s AND ts >= :a AND ts < :b
)
SELECT device, op, count(*) AS requests, sum(size_bytes) AS bytes,
       min(dur) FILTER (WHERE cd >= 0.5) AS p50_dur,
       min(dur) FILTER (WHERE cd >= 0.99) AS p99_dur,
       min(dur) FILTER (WHERE cd >= 0.999) AS p999_dur,
       max(dur) AS max_dur,
       min(queued_dur) FILTER (WHERE cq >= 0.99) AS p99_queued_dur,
       max(queued_dur) AS max_queued_dur,
       min(device_dur) FILTER (WHERE cv >= 0.99) AS p99_device_dur,
       max(device_dur) AS max_device_dur
FROM q GROUP BY device, op ORDER BY max_dur DESC"""


def io_latency(store: Store, session_id: int | None, window: str | None) -> dict:
    """Per device and op: exact p50/p99/p999/max latency of the block requests that started in the
    window, its slowest requests (with their rank among the session's requests of that device and op,
    from block_request_percentile) and its worst one-second windows (block_latency_window)."""
    session, start, end = window_of(store, session_id, window)
    sid = session["id"]
    off = session["wall_offset_ns"]
    first_s = max(0, (start - session["started_ts"]) // 1_000_000_000)
    last_s = (end - session["started_ts"]) // 1_000_000_000
    devices = []
    for d in store.query(_BLOCK_LATENCY_IN_WINDOW, {"s": sid, "a": start, "b": end}):
        slowest = store.query(
            "SELECT id, ts, dur, queued_dur, device_dur, size_bytes, sector, rwbs, error, io_tag, pid, tid,"
            " process_name, thread_name, percentile, requests FROM block_request_percentile"
            " WHERE session_id = ? AND device = ? AND op = ? AND ts >= ? AND ts < ? ORDER BY dur DESC LIMIT ?",
            (sid, d["device"], d["op"], start, end, SLOWEST_REQUESTS))
        seconds = store.query(
            "SELECT window_s, requests, p50_dur, p99_dur, p999_dur, max_dur FROM block_latency_window"
            " WHERE session_id = ? AND device = ? AND op = ? AND window_s >= ? AND window_s <= ?"
            " ORDER BY max_dur DESC LIMIT ?", (sid, d["device"], d["op"], first_s, last_s, WORST_SECONDS))
        devices.append({
            "device": d["device"], "op": d["op"], "requests": d["requests"], "bytes": d["bytes"],
            "p50_dur_ns": d["p50_dur"], "p99_dur_ns": d["p99_dur"], "p999_dur_ns": d["p999_dur"],
            "max_dur_ns": d["max_dur"], "p99_queued_dur_ns": d["p99_queued_dur"],
            "max_queued_dur_ns": d["max_queued_dur"], "p99_device_dur_ns": d["p99_device_dur"],
            "max_device_dur_ns": d["max_device_dur"],
            "slowest_requests": [{
                "block_request_id": r["id"], "ts_ns": r["ts"], "utc": utc(r["ts"] + off), "dur_ns": r["dur"],
                "queued_dur_ns": r["queued_dur"], "device_dur_ns": r["device_dur"], "size_bytes": r["size_bytes"],
                "sector": r["sector"], "rwbs": r["rwbs"], "error": r["error"], "io_tag": r["io_tag"],
                "pid": r["pid"], "tid": r["tid"], "process_name": r["process_name"],
                "thread_name": r["thread_name"], "session_percentile": r["percentile"],
                "session_requests": r["requests"]} for r in slowest],
            "worst_seconds": [{
                "window_s": w["window_s"], "requests": w["requests"], "p50_dur_ns": w["p50_dur"],
                "p99_dur_ns": w["p99_dur"], "p999_dur_ns": w["p999_dur"], "max_dur_ns": w["max_dur"]}
                for w in seconds],
        })
    errors = store.query(
        "SELECT dev, count(*) AS errors FROM block_error WHERE session_id = ? AND ts >= ? AND ts < ?"
        " GROUP BY dev ORDER BY errors DESC", (sid, start, end))
    out = {
        **_window_out(session, start, end),
        "percentiles": "exact nearest-rank over the requests that started in the window (as block_latency); "
                       "window_s: whole seconds since the session start",
        "devices": devices,
        "block_errors_from_kernel_log": [{"dev": r["dev"], "errors": r["errors"]} for r in errors],
    }
    if not devices:
        out.update(not_recorded(store, sid, "block", "block_request", "block I/O request latencies"))
    return out


# python_lines (store/views/0002_python.sql) restricted to CUDA calls that start in [:a, :b).
_PYTHON_LINES_IN_WINDOW = """
SELECT p.filename AS python_file, p.line AS python_lineno, p.qualname AS python_function,
       p.text AS python_line, sum(x.calls) AS calls, sum(x.dur) AS dur, max(x.max_dur) AS max_dur
FROM (
    SELECT python_stack_id, count(*) AS calls, sum(dur) AS dur, max(dur) AS max_dur
    FROM cuda_call WHERE python_stack_id IS NOT NULL AND session_id = :s AND ts >= :a AND ts < :b
    GROUP BY python_stack_id
) x
JOIN python_call_site p ON p.stack_id = x.python_stack_id
GROUP BY p.filename, p.line, p.qualname
ORDER BY dur DESC LIMIT :n"""


# the counted launches' samples (cuda_launch_sample) by call site, in [:a, :b)
_SAMPLED_LAUNCH_LINES = """
SELECT python_file, python_lineno, python_function, python_line, count(*) AS sampled
FROM cuda_launch_sample_python WHERE python_line IS NOT NULL AND session_id = :s AND ts >= :a AND ts < :b
GROUP BY python_file, python_lineno, python_function, python_line
ORDER BY sampled DESC LIMIT :n"""


def python_lines(store: Store, session_id: int | None, window: str | None, limit: int = 20) -> dict:
    """Python call sites ranked two ways: by the time above baseline of the stalled steps whose
    primary cause the step report attributes to them (as `recorder top`), and by the time spent
    inside the CUDA calls made from them (the python_lines view)."""
    session, start, end = window_of(store, session_id, window)
    sid = session["id"]
    stalls = find_stalls(store, sid, start, end)
    by_line: dict[str, dict] = {}
    for r in stalls[:STALLS_ANALYSED]:
        p = analyse_step(store, session, r)["primary_cause"] or {}
        line = p.get("python")
        if line is None:
            continue
        e = by_line.setdefault(line, {"python_line": line, "stalls": 0, "excess_dur_ns": 0, "causes": {},
                                      "steps": []})
        e["stalls"] += 1
        e["excess_dur_ns"] += r["excess_dur"] or 0
        kind = p.get("kind", "unexplained")
        e["causes"][kind] = e["causes"].get(kind, 0) + 1
        e["steps"].append(r["step"])
    stall_lines = sorted(by_line.values(), key=lambda e: -e["excess_dur_ns"])[:_limit(limit)]
    for e in stall_lines:
        e["causes"] = [{"cause": k, "stalls": n} for k, n in sorted(e["causes"].items(), key=lambda kv: -kv[1])]
    rows = store.query(_PYTHON_LINES_IN_WINDOW, {"s": sid, "a": start, "b": end, "n": _limit(limit)})
    lines = [{"python_line": r["python_line"], "python_file": r["python_file"], "python_lineno": r["python_lineno"],
              "python_function": r["python_function"], "cuda_calls": r["calls"], "cuda_dur_ns": r["dur"],
              "max_cuda_dur_ns": r["max_dur"], "sampled_launches": 0} for r in rows]
    by_text = {line["python_line"]: line for line in lines}
    for r in store.query(_SAMPLED_LAUNCH_LINES, {"s": sid, "a": start, "b": end, "n": _limit(limit)}):
        line = by_text.get(r["python_line"])
        if line is None:
            line = by_text[r["python_line"]] = {
                "python_line": r["python_line"], "python_file": r["python_file"], "python_lineno": r["python_lineno"],
                "python_function": r["python_function"], "cuda_calls": 0, "cuda_dur_ns": 0, "max_cuda_dur_ns": 0}
            lines.append(line)
        line["sampled_launches"] = r["sampled"]
    out = {**_window_out(session, start, end),
           "stalled_steps_in_window": len(stalls),
           "stall_lines": stall_lines,
           "stall_lines_rank": "time above baseline (excess_dur_ns) of stalled steps whose primary cause is at "
                               "the line, as `recorder top`" + (f"; the worst {STALLS_ANALYSED} stalls analysed"
                                                                 if len(stalls) > STALLS_ANALYSED else ""),
           "lines": lines,
           "lines_rank": "time inside CUDA calls made from the line (python_lines view)"}
    if not lines and not stall_lines:
        out.update(not_recorded(store, sid, "python", "python_stack", "Python source lines"))
    return out


def nccl_collectives(store: Store, session_id: int | None, window: str | None) -> dict:
    """Collectives in the window whose ranks arrived far apart (the straggler and how late it was),
    and the longest waits ranks spent in collectives."""
    session, start, end = window_of(store, session_id, window)
    sid = session["id"]
    late = store.query(
        "SELECT s.* FROM nccl_straggler s JOIN nccl_collective c ON c.comm_hash = s.comm_hash AND c.seq = s.seq"
        " AND c.ts = s.straggler_ts WHERE c.session_id = ? AND s.straggler_ts >= ? AND s.straggler_ts < ?"
        " ORDER BY s.lateness_dur DESC LIMIT 20", (sid, start, end))
    waits = store.query(
        "SELECT w.* FROM nccl_collective_wait w JOIN nccl_call c ON c.id = w.nccl_call_id"
        " WHERE c.session_id = ? AND w.ts >= ? AND w.ts < ? ORDER BY w.wait_dur DESC LIMIT 20", (sid, start, end))
    out = {**_window_out(session, start, end),
           "collectives": [{"api": r["api"], "seq": r["seq"], "step": r["step"], "straggler_rank": r["straggler_rank"],
                            "straggler_pid": r["straggler_pid"], "lateness_dur_ns": r["lateness_dur"],
                            "ranks_seen": r["ranks_seen"], "comm_hash": r["comm_hash"]} for r in late],
           "waits": [{"nccl_call_id": r["nccl_call_id"], "api": r["api"], "rank": r["rank"], "pid": r["pid"],
                      "step": r["step"], "wait_dur_ns": r["wait_dur"], "call_dur_ns": r["call_dur"],
                      "sync_dur_ns": r["sync_dur"]} for r in waits]}
    if not late and not waits:
        out.update(not_recorded(store, sid, "nccl", "nccl_call", "NCCL collectives"))
    return out


def device_timeline(store: Store, session_id: int | None, window: str | None, step: int | None) -> dict:
    """The device's own timeline (an imported profiler trace) over a step or window: busy share per
    device, the top kernels, what the launching thread did while the device was idle."""
    from store.analysis import device

    session, start, end = window_of(store, session_id, window)
    sid = session["id"]
    thread = process = None
    if step is not None:
        row = store.one("SELECT st.ts, st.end_ts, st.thread_id, st.process_id FROM step st WHERE st.session_id = ?"
                        " AND st.step = ? ORDER BY st.ts LIMIT 1", (sid, step))
        if row is None:
            raise UserError(f"no step {step} in session {sid}: list_steps names them")
        start, end, thread, process = row["ts"], row["end_ts"], row["thread_id"], row["process_id"]
    out: dict[str, Any] = {**_window_out(session, start, end), "step": step}
    imports = store.query("SELECT path, format, rank, world_size, runtime FROM trace_import WHERE session_id = ?",
                          (sid,))
    out["imported_from"] = imports
    timeline = device.timeline(store, sid, start, end, thread, process)
    if timeline is None:
        out.update(not_recorded(store, sid, "profiler", "device_activity", "the device's kernels, copies and memsets"))
        return out
    out.update(timeline)
    return out


TYPED_KERNEL_TABLES = ("nvme_event", "block_error", "swiotlb_event", "iommu_fault", "aer_event", "gpu_xid",
                       "oom_kill")


def evidence(store: Store, kind: str, row_id: int) -> dict[str, Any]:
    """The rows behind a finding: a CUDA call with its off-CPU intervals and contenders, one off-CPU
    interval with who was involved, or a kernel log record with the typed event parsed from it."""
    if kind == "cuda_call":
        call = store.one("SELECT * FROM cuda_call_detail WHERE id = ?", (row_id,))
        if call is None:
            raise UserError(f"no CUDA call {row_id}: take ids from top_stalls or explain_stall")
        links = store.query(
            "SELECT l.offcpu_id, l.reason, l.overlap_dur AS overlap_dur_ns, l.runq_overlap_dur AS cpu_wait_dur_ns,"
            " l.contender_pid, l.contender_name, l.contended_cpu, o.ts AS ts_ns, o.dur AS dur_ns, o.state_letter,"
            " o.syscall_name, o.waker_tid, o.waker_name FROM cuda_call_offcpu l JOIN offcpu o ON o.id = l.offcpu_id"
            " WHERE l.cuda_call_id = ? ORDER BY o.ts LIMIT 200", (row_id,))
        contenders = store.query(
            "SELECT contender_pid, contender_name, preemptions, delayed_wakeups, cpu_wait_dur AS cpu_wait_dur_ns,"
            " cpus FROM cuda_call_contender WHERE cuda_call_id = ? ORDER BY cpu_wait_dur DESC", (row_id,))
        return {"kind": kind, "link": "cuda_call -> offcpu (same thread, interval starts inside the call)",
                "cuda_call": _units(call), "offcpu_intervals": links, "contenders": contenders}
    if kind == "offcpu":
        row = store.one("SELECT * FROM offcpu WHERE id = ?", (row_id,))
        if row is None:
            raise UserError(f"no off-CPU interval {row_id}: take ids from evidence(kind='cuda_call')")
        calls = store.query("SELECT cuda_call_id, overlap_dur AS overlap_dur_ns FROM cuda_call_offcpu"
                            " WHERE offcpu_id = ?", (row_id,))
        return {"kind": kind, "offcpu": _units(row), "inside_cuda_calls": calls}
    if kind == "kernel_log":
        row = store.one("SELECT * FROM kernel_log WHERE id = ?", (row_id,))
        if row is None:
            raise UserError(f"no kernel log record {row_id}: take ids from kernel_log or nvme_events")
        typed = {}
        for table in TYPED_KERNEL_TABLES:
            hit = store.one(f"SELECT * FROM {table} WHERE kernel_log_id = ?", (row_id,))
            if hit:
                typed = {"table": table, "row": _units(hit)}
        row.pop("raw", None)  # bytes of a malformed record; its text is kept
        return {"kind": kind, "kernel_log": _units(row), "parsed_event": typed or None}
    if kind == "step":
        row = store.one("SELECT * FROM step_baseline_lookup WHERE step_mark_id = ?", (row_id,))
        if row is None:
            raise UserError(f"no step with step_mark_id {row_id}: take ids from list_steps or explain_stall")
        links = store.query("SELECT relation, to_table, to_id, dur AS dur_ns FROM causal_link"
                            " WHERE from_table = 'step_mark' AND from_id = ? ORDER BY dur DESC LIMIT 200", (row_id,))
        causes = store.query("SELECT cause, detail, dur AS dur_ns, events FROM step_cause WHERE step_mark_id = ?"
                             " ORDER BY dur DESC", (row_id,))
        return {"kind": kind, "link": "step -> rows inside it (causal_link); follow to_table/to_id",
                "step": _units(row), "breakdown": causes, "links": links}
    if kind == "block_request":
        row = store.one("SELECT * FROM block_request_named WHERE id = ?", (row_id,))
        if row is None:
            raise UserError(f"no block request {row_id}: take ids from evidence(kind='step') or io_latency")
        events = store.query("SELECT event_table, event_id, ts AS ts_ns, kind, device, match, detail"
                             " FROM block_request_device_event WHERE block_request_id = ? ORDER BY ts", (row_id,))
        return {"kind": kind, "link": "block_request -> device events that hit it in flight",
                "block_request": _units(row), "device_events": events}
    raise UserError(f"unknown evidence kind {kind!r}: use step, cuda_call, offcpu, block_request or kernel_log")


def _units(row: dict) -> dict:
    """Store rows name ns columns ts, dur, *_ts and *_dur; MCP results spell the unit out."""
    out = {}
    for k, v in row.items():
        if k in ("ts", "dur", "printk_ts", "wakeup_ts") or k.endswith("_dur"):
            k = f"{k}_ns"
        out[k] = v
    return out
