"""`recorder steps` and `recorder top`: listings over the causal views (store/views/0008_causes.sql).

Both return plain dicts (the --json output) and render them as text tables.
"""

from __future__ import annotations

from store.analysis.causes import all_steps, find_stalls
from store.db import Store
from store.db.rules import stall_rule
from store.report.build import analyse_step, ms, session_row, utc
from store.text import printable

CAUSES_LISTED = 200  # stalls whose cause `steps --slow` works out (each is a few queries)
STALLS_ANALYSED = 100  # stalls `top` attributes to lines and devices


def steps(store: Store, session_id: int | None = None, slow_only: bool = False, limit: int = 0) -> dict:
    session = session_row(store, session_id)
    sid = session["id"]
    names = {r["thread_id"]: r for r in store.query(
        "SELECT thread_id, tid, pid, thread_name, process_name FROM thread_info WHERE thread_id IN"
        " (SELECT DISTINCT thread_id FROM step_mark WHERE session_id = ?)", (sid,))}
    rows = [{**r, **names.get(r["thread_id"], {})} for r in sorted(all_steps(store, sid), key=lambda r: r["ts"])
            if r["slow"] or not slow_only]
    rows = rows[:limit] if limit else rows
    out = []
    analysed = 0
    for r in rows:
        item = {"step": r["step"], "pid": r["pid"], "tid": r["tid"], "thread": r["thread_name"],
                "utc": utc(r["ts"] + session["wall_offset_ns"]), "ts": r["ts"], "dur_ns": r["dur"],
                "baseline_dur_ns": r["baseline_dur"], "ratio": r["ratio"], "slow": bool(r["slow"]),
                "complete": bool(r["complete"]), "inferred": bool(r["inferred"]), "cause": None}
        if r["slow"] and analysed < CAUSES_LISTED:
            analysed += 1
            p = analyse_step(store, session, r)["primary_cause"]
            item["cause"] = p["summary"] if p else "no recorded wait explains it"
        out.append(item)
    return {"session_id": sid, "steps": out, "count": len(out), "stalls": sum(1 for s in out if s["slow"]),
            "stall_rule": stall_rule(store).text()}


def render_steps(result: dict) -> str:
    if not result["steps"]:
        return (f"session {result['session_id']}: no steps (the script calls no recorder.step(n), and none "
                "could be inferred)")
    lines = [f"{'STEP':>8} {'PID':>7} {'START (UTC)':24} {'DUR':>9} {'BASELINE':>9} {'RATIO':>6}  CAUSE"]
    for s in result["steps"]:
        flags = ("!" if s["slow"] else " ") + ("~" if s["inferred"] else " ") + (" " if s["complete"] else "+")
        lines.append(f"{s['step']:>8} {s['pid'] or '?':>7} {s['utc']:24} {ms(s['dur_ns']):>9} "
                     f"{ms(s['baseline_dur_ns']):>9} {s['ratio'] if s['ratio'] is not None else '':>6}{flags} "
                     f"{s['cause'] or ''}")
    lines.append(f"{result['count']} steps, {result['stalls']} stalled "
                 f"(! stalled: {result['stall_rule']}; ~ inferred; + still running at stop)")
    return "\n".join(map(printable, lines))


def top(store: Store, session_id: int | None = None, limit: int = 5) -> dict:
    """The worst stalls with their causes, and the Python lines and devices they are attributed to."""
    session = session_row(store, session_id)
    sid = session["id"]
    stalls = find_stalls(store, sid, 0, 2**63 - 1)[:STALLS_ANALYSED]
    worst: list[dict] = []
    by_line: dict = {}
    by_device: dict = {}
    for r in stalls:
        a = analyse_step(store, session, r)
        p = a["primary_cause"] or {}
        excess = r["excess_dur"] or 0
        line = p.get("python") or "(no Python line)"
        entry = by_line.setdefault(line, {"python": line, "stalls": 0, "excess_dur_ns": 0, "causes": {}})
        entry["stalls"] += 1
        entry["excess_dur_ns"] += excess
        kind = p.get("kind", "unexplained")
        entry["causes"][kind] = entry["causes"].get(kind, 0) + 1
        device = p.get("device") or p.get("event_device")
        if device:
            d = by_device.setdefault(device, {"device": device, "stalls": 0, "excess_dur_ns": 0, "causes": {}})
            d["stalls"] += 1
            d["excess_dur_ns"] += excess
            d["causes"][kind] = d["causes"].get(kind, 0) + 1
        if len(worst) < limit:
            worst.append({"step": r["step"], "pid": a["thread"]["pid"], "utc": a["utc"], "dur_ns": r["dur"],
                          "baseline_dur_ns": r["baseline_dur"], "ratio": r["ratio"], "cause": kind,
                          "summary": p.get("summary", "no recorded wait explains it"), "python": p.get("python")})
    latency = {r["device"]: r for r in store.query(
        "SELECT device, sum(requests) AS requests, max(p999_dur) AS p999_dur, max(max_dur) AS max_dur"
        " FROM block_latency WHERE session_id = ? GROUP BY device", (sid,))}
    events = {r["disk"]: r["n"] for r in store.query(
        "SELECT r.disk, count(DISTINCT e.event_table || e.event_id) AS n FROM block_request_device r"
        " JOIN block_request_device_event e ON e.block_request_id = r.block_request_id"
        " WHERE r.session_id = ? GROUP BY r.disk", (sid,))}
    for name in latency:
        by_device.setdefault(name, {"device": name, "stalls": 0, "excess_dur_ns": 0, "causes": {}})
    devices = []
    for d in by_device.values():
        lat = latency.get(d["device"], {})
        devices.append({**d, "requests": lat.get("requests"), "p999_dur_ns": lat.get("p999_dur"),
                        "max_dur_ns": lat.get("max_dur"), "device_events": events.get(d["device"], 0)})
    devices.sort(key=lambda d: (-d["excess_dur_ns"], -(d["device_events"] or 0), -(d["p999_dur_ns"] or 0)))
    lines = sorted(by_line.values(), key=lambda e: -e["excess_dur_ns"])
    return {"session_id": sid, "stalls_total": len(stalls), "worst_stalls": worst, "worst_lines": lines[:limit],
            "worst_devices": devices[:limit], "stall_ratio": stall_rule(store).ratio}


def render_top(result: dict) -> str:
    n = result["stalls_total"]
    out = [f"Worst stalls (session {result['session_id']}, {n} stalled step{'s' if n != 1 else ''}"
           f"{'+' if result['stalls_total'] >= STALLS_ANALYSED else ''}):"]
    if not result["worst_stalls"]:
        out.append(f"  none: no step took {result['stall_ratio']:g}x its rolling median")
    for s in result["worst_stalls"]:
        out.append(f"  step {s['step']} (pid {s['pid']}) {ms(s['dur_ns'])}, {s['ratio']}x: {s['summary']}"
                   + (f" at {s['python']}" if s["python"] else ""))
    out.append("Worst Python lines (time above baseline in stalls attributed to them):")
    for e in result["worst_lines"]:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(e["causes"].items(), key=lambda kv: -kv[1]))
        out.append(f"  {ms(e['excess_dur_ns']):>9} in {e['stalls']} stall{'s' if e['stalls'] != 1 else ''}  "
                   f"{e['python']}  ({kinds})")
    if not result["worst_lines"]:
        out.append("  none")
    out.append("Worst devices:")
    for d in result["worst_devices"]:
        out.append(f"  {d['device']}: {ms(d['excess_dur_ns'])} of stalls, {d['device_events']} device events hitting "
                   f"requests, p999 {ms(d['p999_dur_ns'])} over {d['requests'] or 0} requests")
    if not result["worst_devices"]:
        out.append("  none recorded")
    return "\n".join(map(printable, out))
