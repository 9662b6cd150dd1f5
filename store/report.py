"""The stall report: what `recorder explain` prints and the MCP server returns.

Everything here reads the views in store/views/; the Python only selects the window, orders the
findings and words them. `explain()` returns a plain dict (the JSON output), `render_text()` turns
that same dict into the text report, so both always carry the same content.
"""

from __future__ import annotations

import datetime as dt
import re

from store.db import Store, lock_holder
from store.errors import UserError

NS = 1_000_000_000
SLOW_LIMIT = 5  # slow calls listed in a report
CPU_SHARE_CAUSE = 0.2  # preempted share of a call above which CPU contention is the cause
BLOCKED_SHARE_CAUSE = 0.2

# Layers a session may observe, and the capability layer that says whether it did.
LAYERS = {
    "sched": "scheduler (off-CPU intervals)",
    "cuda": "CUDA runtime/driver calls",
    "python": "Python source lines",
    "nccl": "NCCL collectives",
    "block": "block I/O requests",
    "kmsg": "kernel log (NVMe, I/O errors, IOMMU, AER, Xid, OOM)",
}


def utc(ns_unix: int) -> str:
    t = dt.datetime.fromtimestamp(ns_unix / NS, tz=dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def ms(ns: float | int | None) -> str:
    if ns is None:
        return "?"
    v = ns / 1e6
    if v >= 100:
        return f"{v:.0f} ms"
    if v >= 1:
        return f"{v:.1f} ms"
    return f"{v:.2f} ms"


# -- sessions and windows -------------------------------------------------------------------------
def session_row(store: Store, session_id: int | None) -> dict:
    if session_id is None:
        row = store.one("SELECT * FROM session ORDER BY id DESC LIMIT 1")
        if row is None:
            raise UserError(f"{store.path} holds no session yet: record one with 'recorder start'")
        return row
    row = store.one("SELECT * FROM session WHERE id = ?", (session_id,))
    if row is None:
        ids = [r["id"] for r in store.query("SELECT id FROM session ORDER BY id")]
        raise UserError(f"no session {session_id} in {store.path}: sessions there are {ids}")
    return row


def session_state(store: Store, session: dict) -> str:
    """'complete', 'recording' (a live recorder holds it) or 'incomplete' (the recorder died)."""
    if session["status"] != "recording":
        return session["status"]
    return "recording" if lock_holder(store.path) else "incomplete"


def session_end(store: Store, session: dict) -> int:
    """Last ts of the session: its stop, or the last event of an incomplete one."""
    if session["stopped_ts"]:
        return session["stopped_ts"]
    row = store.one(
        "SELECT max(e) AS e FROM (SELECT max(ts + dur) AS e FROM cuda_call WHERE session_id = :s"
        " UNION ALL SELECT max(ts + dur) FROM offcpu_interval WHERE session_id = :s)",
        {"s": session["id"]},
    )
    return max(row["e"] or session["started_ts"], session["started_ts"])


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def parse_duration(text: str) -> int:
    m = _DURATION.match(text.strip())
    if not m:
        raise UserError(f"cannot read duration {text!r}: write e.g. 30s, 5m, 1h or 500ms")
    scale = {"ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _point(text: str, session: dict) -> int:
    """A window bound: seconds after the session start, or an ISO-8601 time (UTC if no zone)."""
    text = text.strip()
    try:
        return session["started_ts"] + int(float(text) * NS)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(
            f"cannot read {text!r} in --window: use seconds after the session start (5..12.5) "
            "or UTC times (2026-04-28T22:14:40Z..2026-04-28T22:15:10Z)"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return int(t.timestamp() * NS) - session["wall_offset_ns"]


def resolve_window(store: Store, session: dict, window: str | None = None,
                   since: str | None = None) -> tuple[int, int]:
    start, end = session["started_ts"], session_end(store, session)
    if window:
        if ".." not in window:
            raise UserError("--window takes A..B: seconds after the start (5..12.5) or UTC times")
        a, b = window.split("..", 1)
        start, end = _point(a, session), _point(b, session)
        if end <= start:
            raise UserError(f"--window {window} ends before it starts: give A..B with A < B")
    elif since:
        start = max(start, end - parse_duration(since))
    return start, end


# -- findings -------------------------------------------------------------------------------------
def slow_calls(store: Store, session_id: int, start: int, end: int, limit: int = SLOW_LIMIT) -> list[dict]:
    calls = store.query(
        "SELECT * FROM slow_cuda_call WHERE session_id = ? AND ts >= ? AND ts < ?"
        " ORDER BY excess_dur DESC LIMIT ?",
        (session_id, start, end, limit),
    )
    for call in calls:
        call["contenders"] = store.query(
            "SELECT contender_pid, contender_name, preemptions, delayed_wakeups, cpu_wait_dur, cpus"
            " FROM cuda_call_contender WHERE cuda_call_id = ? ORDER BY cpu_wait_dur DESC",
            (call["id"],),
        )
        call["blocked"] = store.query(
            "SELECT o.reason, o.syscall_name, count(*) AS intervals,"
            " sum(l.overlap_dur - l.runq_overlap_dur) AS dur"
            " FROM cuda_call_offcpu l JOIN offcpu o ON o.id = l.offcpu_id"
            " WHERE l.cuda_call_id = ? AND o.reason != 'preempted'"
            " GROUP BY o.reason, o.syscall_name ORDER BY dur DESC",
            (call["id"],),
        )
        call["python_stack"] = [r["text"] for r in store.query(
            "SELECT f.text FROM cuda_call c JOIN python_frame f ON f.stack_id = c.python_stack_id"
            " WHERE c.id = ? ORDER BY f.depth", (call["id"],))]
        site = store.one("SELECT python_line FROM cuda_call_python WHERE cuda_call_id = ?", (call["id"],))
        call["python"] = site["python_line"] if site else None
        call["cause"] = _call_cause(call)
        call["text"] = _call_text(call)
    return calls


def _call_cause(call: dict) -> dict:
    # Against the excess, not the whole call: a sync call that sleeps 4 ms by design and then waits
    # 6 ms for the CPU stalled because of the wait.
    excess = max(call["excess_dur"] or 0, 1)
    wait_share = call["cpu_wait_dur"] / excess
    blocked_share = call["blocked_dur"] / excess
    if wait_share >= CPU_SHARE_CAUSE and call["contenders"] and wait_share >= blocked_share / 2:
        top = call["contenders"][0]
        return {
            "kind": "cpu_contention",
            "summary": f"CPU contention: the thread waited for the CPU behind "
                       f"{top['contender_name']} (pid {top['contender_pid']}) on cpu {top['cpus']}",
            "contender_pid": top["contender_pid"], "contender_name": top["contender_name"],
            "cpus": top["cpus"], "cpu_wait_dur_ns": call["cpu_wait_dur"],
            "cpu_wait_share_of_call": round(call["cpu_wait_dur"] / (call["dur"] or 1), 3),
        }
    if blocked_share >= BLOCKED_SHARE_CAUSE and call["blocked"]:
        top = call["blocked"][0]
        what = top["reason"] + (f" in {top['syscall_name']}" if top["syscall_name"] else "")
        return {"kind": "blocked", "summary": f"blocked ({what}) inside the call",
                "reason": top["reason"], "syscall": top["syscall_name"],
                "blocked_share_of_call": round(call["blocked_dur"] / (call["dur"] or 1), 3)}
    return {"kind": "in_call", "summary": "time spent on-CPU inside the library (driver or device wait)",
            "oncpu_share_of_call": round(1 - call["offcpu_dur"] / (call["dur"] or 1), 3)}


def _call_text(call: dict) -> str:
    text = f"{call['api']} {ms(call['dur'])} (expected ~{ms(call['expected_dur'])})"
    dur = call["dur"] or 1
    if call["offcpu_dur"]:
        text += f": off-CPU {100 * call['offcpu_dur'] / dur:.0f}% of the call"
    else:
        text += ": on-CPU for the whole call"
    if call["contenders"]:
        top = call["contenders"][0]
        cpus = top["cpus"] or "?"
        who = f"{top['contender_name']} (pid {top['contender_pid']}) on cpu {cpus}"
        if top["preemptions"]:
            text += f", {top['preemptions']} preemption{'s' if top['preemptions'] != 1 else ''} by {who}"
            if top["delayed_wakeups"]:
                text += f" (and {top['delayed_wakeups']} delayed wakeups)"
        else:
            text += f", waited {ms(top['cpu_wait_dur'])} for the CPU after waking up, behind {who}"
    for b in call["blocked"][:1]:
        what = b["reason"] + (f" in {b['syscall_name']}" if b["syscall_name"] else "")
        if b["dur"]:
            text += f", blocked {ms(b['dur'])} ({what})"
    return text


def _capabilities(store: Store, session_id: int) -> dict:
    rows = store.query(
        "SELECT layer, status, count(*) AS n FROM capability WHERE session_id = ? GROUP BY layer, status",
        (session_id,),
    )
    attached = {r["layer"] for r in rows if r["status"] == "attached"}
    observed = [k for k in LAYERS if k in attached]
    not_observed = []
    for layer, label in LAYERS.items():
        if layer in attached:
            continue
        reasons = store.query(
            "SELECT DISTINCT status || ': ' || probe"
            " || CASE WHEN detail != '' THEN ' (' || detail || ')' ELSE '' END AS why"
            " FROM capability WHERE session_id = ? AND layer = ? LIMIT 3", (session_id, layer))
        not_observed.append({"layer": layer, "what": label,
                             "why": "; ".join(r["why"] for r in reasons) or "not recorded by this session"})
    return {"observed": observed, "not_observed": not_observed}


def _next_actions(cause: dict | None, call: dict | None) -> list[str]:
    if cause is None:
        return []
    if cause["kind"] == "cpu_contention":
        pid, name = cause["contender_pid"], cause["contender_name"]
        return [
            f"See what {name} (pid {pid}) is and why it runs on cpu {cause['cpus']}: "
            f"ps -o pid,psr,pcpu,cmd -p {pid}",
            f"Keep it off the training threads' CPUs: give the job an exclusive cpuset, or move it "
            f"with taskset -cp <other cpus> {pid}",
            f"Check that thread {call['tid']} ({call['thread_name']}) is pinned where you expect: "
            f"taskset -cp {call['tid']}",
        ]
    if cause["kind"] == "blocked":
        return [
            f"The call blocked ({cause['reason']}"
            + (f" in {cause['syscall']}" if cause["syscall"] else "")
            + "): look for lock or I/O contention in the same process at that time "
            f"(recorder explain --window around {call['ts']})",
        ]
    return [
        f"{call['api']} spent its time on-CPU in the library: compare with the driver's own timing "
        "(Nsight Systems) and check GPU health (nvidia-smi -q) for that period",
    ]


def _io_negatives(store: Store, sid: int, start: int, end: int, observed: list[str]) -> list[str]:
    """Explicit negatives of the block and kernel-log layers for the window."""
    out = []
    span = {"s": sid, "a": start, "b": end}
    if "kmsg" in observed and not store.one(
            "SELECT count(*) AS n FROM nvme_event WHERE session_id = :s AND ts >= :a AND ts < :b"
            " AND kind IN ('timeout', 'resetting', 'controller_down', 'reset_failure', 'not_ready')", span)["n"]:
        out.append("no NVMe timeout or reset in the kernel log")
    errors = 0
    if "block" in observed:
        errors += store.one("SELECT count(*) AS n FROM block_request WHERE session_id = :s AND ts >= :a"
                            " AND ts < :b AND error != 0", span)["n"]
    if "kmsg" in observed:
        errors += store.one("SELECT count(*) AS n FROM block_error WHERE session_id = :s AND ts >= :a"
                            " AND ts < :b", span)["n"]
    if ("block" in observed or "kmsg" in observed) and not errors:
        out.append("no block I/O errors")
    return out


def explain(store: Store, session_id: int | None = None, window: str | None = None,
            since: str | None = None, worst: bool = False) -> dict:
    session = session_row(store, session_id)
    sid = session["id"]
    state = session_state(store, session)
    start, end = resolve_window(store, session, window, since)
    off = session["wall_offset_ns"]
    limit = 1 if worst else SLOW_LIMIT
    calls = slow_calls(store, sid, start, end, limit)
    if worst and calls:
        start, end = calls[0]["ts"], calls[0]["ts"] + calls[0]["dur"]
    totals = store.one(
        "SELECT count(*) AS calls, coalesce(sum(dur), 0) AS dur FROM cuda_call"
        " WHERE session_id = ? AND ts >= ? AND ts < ?", (sid, start, end))
    slow_total = store.one(
        "SELECT count(*) AS n FROM slow_cuda_call WHERE session_id = ? AND ts >= ? AND ts < ?",
        (sid, start, end))["n"]
    offcpu = store.query(
        "SELECT reason, count(*) AS intervals, sum(dur) AS dur FROM offcpu"
        " WHERE session_id = ? AND ts >= ? AND ts < ? GROUP BY reason ORDER BY dur DESC",
        (sid, start, end))
    lost = store.query(
        "SELECT probe, sum(dropped) AS dropped FROM loss WHERE session_id = ? GROUP BY probe", (sid,))
    caps = _capabilities(store, sid)
    primary = calls[0] if calls else None
    cause = primary["cause"] if primary else None
    findings = [{
        "kind": "slow_cuda_call",
        "cuda_call_id": c["id"], "api": c["api"], "ts": c["ts"], "utc": utc(c["ts"] + off),
        "dur_ns": c["dur"], "expected_dur_ns": c["expected_dur"], "excess_dur_ns": c["excess_dur"],
        "baseline_calls": c["baseline_calls"], "size_bytes": c["size_bytes"], "ret": c["ret"],
        "thread": {"tid": c["tid"], "pid": c["pid"], "name": c["thread_name"],
                   "process": c["process_name"]},
        "offcpu_dur_ns": c["offcpu_dur"], "cpu_wait_dur_ns": c["cpu_wait_dur"],
        "blocked_dur_ns": c["blocked_dur"], "preemptions": c["preemptions"],
        "contenders": [{"pid": p["contender_pid"], "name": p["contender_name"],
                        "preemptions": p["preemptions"], "delayed_wakeups": p["delayed_wakeups"],
                        "cpu_wait_dur_ns": p["cpu_wait_dur"], "cpus": p["cpus"]}
                       for p in c["contenders"]],
        "blocked": [{"reason": b["reason"], "syscall": b["syscall_name"],
                     "intervals": b["intervals"], "dur_ns": b["dur"]} for b in c["blocked"]],
        "cause": c["cause"], "text": c["text"],
        "python": c["python"], "python_stack": c["python_stack"],
    } for c in calls]
    negatives = []
    if "cuda" in caps["observed"] and not calls:
        negatives.append("no CUDA call took more than twice its baseline")
    wait = store.one("SELECT coalesce(sum(runq_dur), 0) AS w FROM offcpu"
                     " WHERE session_id = ? AND ts >= ? AND ts < ?", (sid, start, end))["w"]
    if "sched" in caps["observed"] and wait < 0.05 * (end - start):
        negatives.append(f"traced threads waited only {ms(wait)} for a CPU in the window")
    negatives += _io_negatives(store, sid, start, end, caps["observed"])
    return {
        "session": {"id": sid, "state": state, "host": session["hostname"],
                    "kernel": session["kernel_release"], "target": session["target"]},
        "window": {"start_ts": start, "end_ts": end, "start_utc": utc(start + off),
                   "end_utc": utc(end + off), "dur_ns": end - start},
        "stall": primary is not None,
        "symptom": (f"{primary['api']} took {ms(primary['dur'])}, expected ~{ms(primary['expected_dur'])}"
                    f" (median of {primary['baseline_calls']} {primary['family']} calls of that size)"
                    if primary else "no CUDA call stalled in this window"),
        "primary_cause": None if primary is None else {
            **cause, "cuda_call_id": primary["id"], "text": primary["text"],
            "thread": f"{primary['thread_name']} (tid {primary['tid']}) of "
                      f"{primary['process_name']} (pid {primary['pid']})",
        },
        "findings": findings,
        "cuda": {"calls": totals["calls"], "slow_calls": slow_total, "dur_ns": totals["dur"]},
        "offcpu": [{"reason": r["reason"], "intervals": r["intervals"], "dur_ns": r["dur"]}
                   for r in offcpu],
        "cpu_wait_dur_ns": wait,
        "negatives": negatives,
        "observed_layers": caps["observed"],
        "not_observed": caps["not_observed"],
        "loss": {"dropped_events": sum(r["dropped"] for r in lost),
                 "by_probe": {r["probe"]: r["dropped"] for r in lost}},
        "next_actions": _next_actions(cause, primary),
    }


def _python_lines(finding: dict, stack: bool, indent: str) -> list[str]:
    """'at forward() at train.py:142' under a call, and with `stack` its frames, innermost first."""
    out = [f"{indent}at {finding['python']}"] if finding.get("python") else []
    if stack:
        out += [f"{indent}    {frame}" for frame in finding.get("python_stack") or []]
    return out


def render_text(report: dict, stack: bool = False) -> str:
    """The report as text; `stack` adds each slow call's whole Python stack under its line."""
    w = report["window"]
    s = report["session"]
    lines = [
        "Stall report",
        f"Session: {s['id']} on {s['host']} ({s['state']}), target {s['target']}",
        f"Window: {w['start_utc']} -> {w['end_utc']} ({w['dur_ns'] / NS:.1f} s)",
        f"Symptom: {report['symptom']}",
    ]
    p = report["primary_cause"]
    if p:
        lines.append(f"Primary cause: {p['summary']}")
        lines.append(f"  {p['text']}")
        lines += _python_lines(report["findings"][0], stack, "  ")
        lines.append(f"  thread {p['thread']}")
    else:
        lines.append("Primary cause: none: no stall found in this window")
    rest = report["findings"][1:]
    if rest:
        lines.append(f"Other slow calls ({report['cuda']['slow_calls']} in the window):")
        for f in rest:
            lines.append(f"  {f['utc']}  {f['text']}")
            lines += _python_lines(f, stack, "    ")
    if report["offcpu"]:
        parts = [f"{r['reason']} {ms(r['dur_ns'])} ({r['intervals']})" for r in report["offcpu"][:5]]
        lines.append("Off-CPU time of traced threads: " + ", ".join(parts))
    if report["negatives"]:
        lines.append("Checked and clean: " + "; ".join(report["negatives"]))
    lines.append("Observed: " + (", ".join(LAYERS[k] for k in report["observed_layers"]) or "nothing"))
    for n in report["not_observed"]:
        lines.append(f"Not observed: {n['what']} ({n['why']})")
    loss = report["loss"]
    lines.append("Data loss: " + ("none" if not loss["dropped_events"] else
                                  f"{loss['dropped_events']} events dropped "
                                  + ", ".join(f"{k}: {v}" for k, v in loss["by_probe"].items())))
    if report["next_actions"]:
        lines.append("Recommended next actions:")
        lines += [f"  {i}. {a}" for i, a in enumerate(report["next_actions"], 1)]
    return "\n".join(lines)
