"""The analysis behind a stall report: queries of the views (store/views/) and the rules
(store/db/rules.py) into a typed report (store/models.py, `analyse()`). It decides which call or step
is the stall, which cause explains it and with what evidence, and states it in sentences (summary,
symptom, negatives); store/report/render.py turns the result into text.
"""

from __future__ import annotations

from store.analysis import device, oncpu
from store.analysis.actions import CALL_ACTIONS, fill
from store.analysis.flight_dumps import flight_hang
from store.analysis.hangs import hang_facts
from store.analysis.jobs import thread_names
from store.analysis.kinds import KINDS, STEP_ACTIONS, cause_facts
from store.analysis.kinds.cuda import which_call
from store.analysis.losses import losses, lossy_layers, wording
from store.db import Store
from store.db.rules import cause_rule, slow_call_rule, stall_rule
from store.db.session import (
    KNOWN_LAYERS,
    has_steps,
    layer_words,
    recording_end,
    resolve_window,
    session_end,
    session_row,
    session_state,
)
from store.errors import UserError
from store.models import CallReport, Gpu, Hang, StallReport, StepReport
from store.units import NS, ms, utc

SLOW_LIMIT = 5  # slow calls listed in a report
CPU_SHARE_CAUSE = 0.2  # preempted share of a call above which CPU contention is the cause
BLOCKED_SHARE_CAUSE = 0.2
OTHER_STALLS = 5


# -- findings -------------------------------------------------------------------------------------
def slow_calls(store: Store, session_id: int, start: int, end: int, limit: int = SLOW_LIMIT,
               step: dict | None = None) -> list[dict]:
    """The slow CUDA calls of [start, end) (slow_cuda_call), the largest excess first; with `step`
    (its step_mark_id and excess_dur) also the step's calls judged by the step (step_cuda_call, no
    baseline of their own) whose own time is at least cause_rule.secondary_share of its excess."""
    calls = store.query(
        "SELECT *, 'baseline' AS judged FROM slow_cuda_call WHERE session_id = ? AND ts >= ? AND ts < ?"
        " ORDER BY excess_dur DESC LIMIT ?",
        (session_id, start, end, limit),
    )
    if step is not None:
        floor = cause_rule(store).secondary_share * max(step["excess_dur"] or 0, 0)
        calls += store.query(
            "SELECT d.*, d.offcpu_dur - d.cpu_wait_dur AS blocked_dur, s.judged, s.expected_dur, s.excess_dur"
            " FROM step_cuda_call s CROSS JOIN cuda_call_detail d ON d.id = s.cuda_call_id"
            " WHERE s.step_mark_id = ? AND s.judged = 'step' AND s.own_excess_dur >= ?",
            (step["step_mark_id"], floor))
        calls = sorted(calls, key=lambda c: -(c["excess_dur"] or 0))[:limit]
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
        call["which"] = which_call(store, {**call, "cuda_call_id": call["id"]}) if call["judged"] == "step" else None
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
    if call.get("which"):
        text = f"{call['api']} {ms(call['dur'])} ({call['which']}, no baseline of its own)"
    else:
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


def _capabilities(store: Store, session_id: int, layers: dict[str, str], outside: str | None = None) -> dict:
    """Which of `layers` (word -> what it observes, `layer_words()`) the session observed, and for the
    others why not; none when the window lies outside the recording (`outside` says so). `words`: what
    the observed layers observe where KNOWN_LAYERS says otherwise (a layer this store does not know),
    for the report to word them (left out of it when empty)."""
    rows = store.query(
        "SELECT layer, status, count(*) AS n FROM capability WHERE session_id = ? GROUP BY layer, status",
        (session_id,),
    )
    attached = {r["layer"] for r in rows if r["status"] == "attached"} if outside is None else set()
    observed = [k for k in layers if k in attached]
    not_observed = []
    for layer, label in layers.items():
        if layer in attached:
            continue
        if outside is not None:
            not_observed.append({"layer": layer, "what": label, "why": outside})
            continue
        reasons = store.query(
            "SELECT DISTINCT status || ': ' || probe"
            " || CASE WHEN detail != '' THEN ' (' || detail || ')' ELSE '' END AS why"
            " FROM capability WHERE session_id = ? AND layer = ? LIMIT 3", (session_id, layer))
        not_observed.append({"layer": layer, "what": label,
                             "why": "; ".join(r["why"] for r in reasons) or "not recorded by this session"})
    words = {k: layers[k] for k in observed if KNOWN_LAYERS.get(k) != layers[k]}
    return {"observed": observed, "not_observed": not_observed, **({"words": words} if words else {})}


def _next_actions(cause: dict | None, call: dict | None) -> list[str]:
    if cause is None:
        return []
    what = f"{cause.get('reason')}" + (f" in {cause['syscall']}" if cause.get("syscall") else "")
    return fill(CALL_ACTIONS, cause["kind"], {**(call or {}), **cause, "what": what})


def _loss(store: Store, sid: int, start: int, end: int, off: int, layers: dict[str, str]) -> tuple[dict, set[str]]:
    """The report's `loss`: the session's drops per probe and what was lost in [start, end); and the
    layers that lost records there (not checked: no negative is said of them)."""
    lost = store.query("SELECT probe, sum(dropped) AS dropped FROM loss WHERE session_id = ? GROUP BY probe", (sid,))
    window = losses(store, sid, start, end)
    in_window = []
    for x in window:
        first = utc(x["first_ts"] + off)
        in_window.append({"layer": x["layer"], "probe": x["probe"], "what": x["what"], "reason": x["reason"],
                          "count": x["count"], "first_utc": first, "last_utc": utc(x["last_ts"] + off),
                          "text": wording(x, layers.get(x["layer"], x["layer"]), first)})
    return ({"dropped_events": sum(r["dropped"] for r in lost), "by_probe": {r["probe"]: r["dropped"] for r in lost},
             "in_window": in_window}, lossy_layers(window))


def _io_negatives(store: Store, sid: int, start: int, end: int, observed: list[str]) -> list[str]:
    """Explicit negatives of the block and kernel-log layers for the window (`observed`: the layers
    observed without a loss in it)."""
    out = []
    span = {"s": sid, "a": start, "b": end}
    if "kmsg" in observed and not store.row(
            "SELECT count(*) AS n FROM nvme_event WHERE session_id = :s AND ts >= :a AND ts < :b"
            " AND kind IN ('timeout', 'resetting', 'controller_down', 'reset_failure', 'not_ready')", span)["n"]:
        out.append("no NVMe timeout or reset in the kernel log")
    errors = 0
    if "block" in observed:
        errors += store.row("SELECT count(*) AS n FROM block_request WHERE session_id = :s AND ts >= :a"
                            " AND ts < :b AND error != 0", span)["n"]
    if "kmsg" in observed:
        errors += store.row("SELECT count(*) AS n FROM block_error WHERE session_id = :s AND ts >= :a"
                            " AND ts < :b", span)["n"]
    if ("block" in observed or "kmsg" in observed) and not errors:
        out.append("no block I/O errors" if "block" in observed else "no block I/O errors in the kernel log")
    return out


def analyse(store: Store, session_id: int | None = None, window: str | None = None,
            since: str | None = None, worst: bool = False, step: int | None = None) -> StallReport:
    """The stall report of a session: per step when its threads mark steps (or `step` is given),
    else per slow CUDA call."""
    report = _report(store, session_id, window, since, worst, step)
    session = session_row(store, report.session.id)
    if isinstance(report, CallReport):
        timeline = device.timeline(store, report.session.id, report.window.start_ts, report.window.end_ts)
        if timeline is not None:
            report.gpu = Gpu.model_validate(timeline)
            if report.primary_cause is None:
                report.symptom = (f"no ProfilerStep#N to explain step by step; over the window, "
                                  f"{device.text(timeline).replace('of the step', 'of the window')}")
    hang = hang_facts(store, session)
    dumped = flight_hang(store, session) if hang is None else None
    if hang or dumped:
        report.hang = Hang.model_validate(hang or dumped)
    if dumped and report.primary_cause is None:
        report.symptom = "collectives had not completed when PyTorch dumped its Flight Recorder"
    return StallReport(report)


def explain(store: Store, session_id: int | None = None, window: str | None = None,
            since: str | None = None, worst: bool = False, step: int | None = None) -> dict:
    """The stall report as JSON values (what `--json` prints): `analyse(...).to_json()`."""
    return analyse(store, session_id, window, since, worst, step).to_json()


def _session_notes(store: Store, sid: int) -> dict:
    """What the session line needs said: {'incident': what saved it} for an incident recording
    (store/flight/__init__.py); {'ended': ...} for a recording nobody stopped (a full disk, a recorder that
    died); {'window_kept': ...} for a flight recording whose window was shorter than
    --keep because of --max-size."""
    out: dict[str, str | list[str]] = {}
    off = store.row("SELECT wall_offset_ns FROM session WHERE id = ?", (sid,))["wall_offset_ns"]
    row = store.one("SELECT trigger, detail, ts FROM incident WHERE session_id = ? AND own = 1 ORDER BY id LIMIT 1",
                    (sid,))
    if row is not None:
        out["incident"] = (f"saved by the flight recorder ({row['trigger']}, {utc(row['ts'] + off)}): {row['detail']}"
                           if row["trigger"] not in ("dump", "signal")
                           else f"saved on request ({row['trigger']}): {row['detail']}")
    ended = recording_end(store, store.row("SELECT * FROM session WHERE id = ?", (sid,)))
    if ended:
        out["ended"] = ended
    imported = store.one("SELECT path, format, rank, world_size FROM trace_import WHERE session_id = ?"
                         " AND joined_session_id IS NULL ORDER BY id LIMIT 1", (sid,))
    if imported is not None:
        what = "PyTorch profiler trace" if imported["format"] == "chrome_trace" else "NCCL Flight Recorder dump"
        rank = (f", rank {imported['rank']}" + (f" of {imported['world_size']}" if imported["world_size"] else "")
                if imported["rank"] is not None else "")
        out["imported"] = f"{what} {imported['path']}{rank}"
    joined = [(f"{r['path']}: {r['clock_note']}" if r["clock_offset_ns"] is not None else
               f"{r['path']}: no alignment was possible, so its device timeline is not in this report "
               f"({r['clock_note']}; it is session {r['session_id']})")
              for r in store.query("SELECT path, session_id, clock_offset_ns, clock_note FROM trace_import"
                                   " WHERE joined_session_id = ? ORDER BY id", (sid,))]
    if joined:
        out["joined"] = joined
    short = store.one("SELECT * FROM flight_window WHERE session_id = ? AND shortest_ns IS NOT NULL", (sid,))
    if short is not None:
        out["window_kept"] = (
            f"shorter than --keep {short['keep_ns'] / NS:g} s from {utc(short['first_short_ts'] + off)} to "
            f"{utc(short['last_short_ts'] + off)} (down to {short['shortest_ns'] / NS:.1f} s): --max-size "
            f"{short['max_bytes'] / 1e6:g} MB held no more at that event rate; what is older was deleted")
    return out


def _report(store: Store, session_id: int | None, window: str | None, since: str | None, worst: bool,
            step: int | None) -> StepReport | CallReport:
    session = session_row(store, session_id)
    sid = session["id"]
    state = session_state(store, session)
    start, end = resolve_window(store, session, window, since)
    if step is not None or has_steps(store, sid):
        return explain_steps(store, session, state, start, end, step, worst)
    off = session["wall_offset_ns"]
    limit = 1 if worst else SLOW_LIMIT
    calls = slow_calls(store, sid, start, end, limit)
    if worst and calls:
        start, end = calls[0]["ts"], calls[0]["ts"] + calls[0]["dur"]
    layers = layer_words(store, sid)
    caps = _capabilities(store, sid, layers, outside=_outside(store, session, start, end))
    lost, lossy = _loss(store, sid, start, end, off, layers)
    checked = [layer for layer in caps["observed"] if layer not in lossy]
    primary = calls[0] if calls else None
    cause = primary["cause"] if primary else None
    findings = _call_findings(calls, off)
    negatives = []
    # said only of calls that were made: a script that made none has no CUDA call to clear
    if "cuda" in checked and not calls and _cuda_calls(store, sid, start, end):
        negatives.append(f"no CUDA call took more than {slow_call_rule(store).times()} its baseline")
    return _call_report(store, session, state, sid, start, end, off, calls, primary, cause, findings, negatives,
                        caps, lost, checked)


def _outside(store: Store, session: dict, start: int, end: int) -> str | None:
    """Why nothing was observed in [start, end) when it lies outside the recording, else None."""
    first, last = session["started_ts"], session_end(store, session)
    if start < last and end > first:
        return None
    off = session["wall_offset_ns"]
    return f"the window lies outside the recording ({utc(first + off)} -> {utc(last + off)})"


def _cuda_calls(store: Store, sid: int, start: int, end: int) -> int:
    return store.row("SELECT count(*) AS n FROM cuda_call WHERE session_id = ? AND ts >= ? AND ts < ?",
                     (sid, start, end))["n"]


WAIT_LINES = 5  # lines listed in a report's longest waits


def longest_waits(store: Store, sid: int, start: int, end: int, limit: int = WAIT_LINES) -> list[dict]:
    """The traced threads' off-CPU waits in [start, end) (not preemptions: those are CPU waits) by
    Python line, the line with the most time first: where a script without steps or CUDA calls
    stalled."""
    rows = store.query(
        "SELECT s.text AS python, count(*) AS intervals, sum(o.dur - o.runq_dur) AS dur,"
        " max(o.dur - o.runq_dur) AS longest_dur,"
        " o.reason,"  # the longest's (the one max() picks: SQLite's bare column)
        " group_concat(DISTINCT o.syscall_name) AS syscalls,"
        " group_concat(DISTINCT i.thread_name || ' (tid ' || i.tid || ')') AS threads"
        " FROM offcpu o JOIN offcpu_interval oi ON oi.id = o.id"
        " JOIN thread_info i ON i.thread_id = o.thread_id"
        " LEFT JOIN python_call_site s ON s.stack_id = oi.python_stack_id"
        " WHERE o.session_id = ? AND o.ts >= ? AND o.ts < ? AND o.reason NOT IN ('preempted', 'yield')"
        " AND i.traced GROUP BY s.text ORDER BY dur DESC LIMIT ?", (sid, start, end, limit))
    for r in rows:
        r["syscalls"], r["threads"] = (x.replace(",", ", ") if x else x for x in (r["syscalls"], r["threads"]))
    return rows


def _call_findings(calls: list[dict], off: int) -> list[dict]:
    return [{
        "kind": "slow_cuda_call",
        "cuda_call_id": c["id"], "api": c["api"], "ts": c["ts"], "utc": utc(c["ts"] + off),
        "dur_ns": c["dur"], "expected_dur_ns": c["expected_dur"], "excess_dur_ns": c["excess_dur"],
        "baseline_calls": c["baseline_calls"], "judged": c["judged"], "size_bytes": c["size_bytes"], "ret": c["ret"],
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


def _machine_negatives(store: Store, sid: int, start: int, end: int, observed: list[str]) -> list[str]:
    """Explicit negatives of the memory, network and DMA layers for the window of a session without
    steps (`observed`: the layers observed without a loss in it)."""
    span = {"s": sid, "a": start, "b": end}

    def none(*tables: str, where: str = "") -> bool:
        return not any(store.row(f"SELECT count(*) AS n FROM {t} WHERE session_id = :s AND ts >= :a AND ts < :b"
                                 + where, span)["n"] for t in tables)

    out = []
    if "mm" in observed:
        if none("oom_kill", "oom_victim"):
            out.append("no OOM kill")
        if none("reclaim_interval"):
            out.append("no direct reclaim by the traced threads")
    if "net" in observed and none("tcp_retransmit"):
        out.append("no TCP retransmits")
    if "dma" in observed:
        if none("swiotlb_event") and none("dma_event", where=" AND kind = 'swiotlb_bounce'"):
            out.append("no SWIOTLB bounce detected")
        if none("iommu_fault") and none("dma_event", where=" AND kind = 'iommu_fault'"):
            out.append("no IOMMU fault")
    return out


def _call_report(store: Store, session: dict, state: str, sid: int, start: int, end: int, off: int,
                 calls: list[dict], primary: dict | None, cause: dict | None, findings: list[dict],
                 negatives: list[str], caps: dict, lost: dict, checked: list[str]) -> CallReport:
    totals = store.row(
        "SELECT count(*) AS calls, coalesce(sum(dur), 0) AS dur FROM cuda_call"
        " WHERE session_id = ? AND ts >= ? AND ts < ?", (sid, start, end))
    slow_total = store.row(
        "SELECT count(*) AS n FROM slow_cuda_call WHERE session_id = ? AND ts >= ? AND ts < ?",
        (sid, start, end))["n"]
    offcpu = store.query(
        "SELECT reason, count(*) AS intervals, sum(dur) AS dur FROM offcpu"
        " WHERE session_id = ? AND ts >= ? AND ts < ? GROUP BY reason ORDER BY dur DESC",
        (sid, start, end))
    wait = store.row("SELECT coalesce(sum(runq_dur), 0) AS w FROM offcpu"
                     " WHERE session_id = ? AND ts >= ? AND ts < ?", (sid, start, end))["w"]
    if "sched" in checked and wait < 0.05 * (end - start):
        negatives.append(f"traced threads waited only {ms(wait)} for a CPU in the window")
    negatives += _io_negatives(store, sid, start, end, checked)
    negatives += _machine_negatives(store, sid, start, end, checked)
    # waits found are evidence whatever was lost besides them
    waits = longest_waits(store, sid, start, end) if "sched" in caps["observed"] else []
    outside = next((n["why"] for n in caps["not_observed"] if not caps["observed"]
                    and n["why"].startswith("the window lies outside")), None)
    if outside:
        symptom = f"nothing recorded: {outside}"
    elif primary:
        symptom = (f"{primary['api']} took {ms(primary['dur'])}, expected ~{ms(primary['expected_dur'])}"
                   f" (median of {primary['baseline_calls']} {primary['family']} calls of that size)")
    elif "cuda" in checked and totals["calls"]:
        symptom = "no CUDA call stalled in this window"
    else:
        symptom = "no CUDA calls recorded in this window"
    if not primary and waits and waits[0]["python"]:
        w = waits[0]
        symptom += (f"; the traced threads' longest wait: {ms(w['longest_dur'])} ({w['reason']}) at {w['python']}"
                    f" ({ms(w['dur'])} there in all)")
    return CallReport(
        mode="call",
        session={"id": sid, "state": state, "host": session["hostname"],
                 "kernel": session["kernel_release"], "target": session["target"], **_session_notes(store, sid)},
        window={"start_ts": start, "end_ts": end, "start_utc": utc(start + off),
                "end_utc": utc(end + off), "dur_ns": end - start},
        stall=primary is not None,
        symptom=symptom,
        primary_cause=None if primary is None else {
            **(cause or {}), "cuda_call_id": primary["id"], "text": primary["text"],
            "thread": f"{primary['thread_name']} (tid {primary['tid']}) of "
                      f"{primary['process_name']} (pid {primary['pid']})",
        },
        findings=findings,
        cuda={"calls": totals["calls"], "slow_calls": slow_total, "dur_ns": totals["dur"]},
        offcpu=[{"reason": r["reason"], "intervals": r["intervals"], "dur_ns": r["dur"]}
                for r in offcpu],
        cpu_wait_dur_ns=wait,
        waits=[{"python": w["python"], "dur_ns": w["dur"], "longest_dur_ns": w["longest_dur"],
                "intervals": w["intervals"], "reason": w["reason"], "syscalls": w["syscalls"],
                "threads": w["threads"]} for w in waits],
        negatives=negatives,
        observed_layers=caps["observed"],
        not_observed=caps["not_observed"],
        **({"layer_words": caps["words"]} if "words" in caps else {}),
        loss=lost,
        next_actions=_next_actions(cause, primary),
    )


# == step reports ====================================================================================
# A session whose threads mark steps (recorder.step, or inferred) is explained step by step: the
# stalled step, its breakdown by cause against its neighbours (store/analysis/causes.py), the root cause
# and its evidence down to the device event and the Python line.


def _step_rows(store: Store, sid: int, number: int) -> list[dict]:
    from store.analysis.causes import lookup_steps

    rows = lookup_steps(store, sid, number)
    if not rows:
        span = store.row("SELECT min(step) AS a, max(step) AS b, count(*) AS n FROM step_mark WHERE session_id = ?",
                         (sid,))
        raise UserError(f"no step {number} in session {sid}: its {span['n']} steps run {span['a']}..{span['b']}"
                        " ('recorder steps' lists them)")
    return rows


def _step_negatives(store: Store, sid: int, a: int, b: int, observed: set[str], primary_kind: str | None,
                    rows: list[dict]) -> list[str]:
    span = {"s": sid, "a": a, "b": b}

    def none(sql: str) -> bool:
        return not store.row(sql, span)["n"]

    out = []
    kmsg = "kmsg" in observed
    if kmsg and primary_kind != "nvme_timeout" and none(
            "SELECT count(*) AS n FROM nvme_event WHERE session_id = :s AND ts >= :a AND ts < :b"):
        out.append("no NVMe timeout or reset")
    if ("block" in observed or kmsg) and primary_kind != "io_error" and none(
            "SELECT (SELECT count(*) FROM block_request WHERE session_id = :s AND ts >= :a AND ts < :b AND error != 0)"
            " + (SELECT count(*) FROM block_error WHERE session_id = :s AND ts >= :a AND ts < :b) AS n"):
        out.append("no block I/O errors" if "block" in observed else "no block I/O errors in the kernel log")
    if ("dma" in observed or kmsg) and primary_kind != "dma_bounce" and none(
            "SELECT (SELECT count(*) FROM dma_event WHERE session_id = :s AND ts >= :a AND ts < :b"
            " AND kind = 'swiotlb_bounce') + (SELECT count(*) FROM swiotlb_event WHERE session_id = :s"
            " AND ts >= :a AND ts < :b) AS n"):
        out.append("no SWIOTLB bounce detected")
    if ("dma" in observed or kmsg) and primary_kind != "iommu_fault" and none(
            "SELECT (SELECT count(*) FROM dma_event WHERE session_id = :s AND ts >= :a AND ts < :b"
            " AND kind = 'iommu_fault') + (SELECT count(*) FROM iommu_fault WHERE session_id = :s"
            " AND ts >= :a AND ts < :b) AS n"):
        out.append("no IOMMU fault")
    if kmsg and primary_kind != "pcie_aer" and none(
            "SELECT count(*) AS n FROM aer_event WHERE session_id = :s AND ts >= :a AND ts < :b"):
        out.append("no PCIe AER error")
    if kmsg and primary_kind != "gpu_xid" and none(
            "SELECT count(*) AS n FROM gpu_xid WHERE session_id = :s AND ts >= :a AND ts < :b"):
        out.append("no GPU Xid")
    if ("mm" in observed or kmsg) and none(
            "SELECT (SELECT count(*) FROM oom_kill WHERE session_id = :s AND ts >= :a AND ts < :b)"
            " + (SELECT count(*) FROM oom_victim WHERE session_id = :s AND ts >= :a AND ts < :b) AS n"):
        out.append("no OOM kill")
    if "mm" in observed and primary_kind != "memory_reclaim" and not any(r["cause"] == "reclaim" for r in rows):
        out.append("no direct reclaim by the step's thread")
    if "net" in observed and primary_kind != "tcp_retransmit" and none(
            "SELECT count(*) AS n FROM tcp_retransmit WHERE session_id = :s AND ts >= :a AND ts < :b"):
        out.append("no TCP retransmits")
    if "sched" in observed and primary_kind != "cpu_contention" and rows:
        wait = sum(r["dur_ns"] for r in rows if r["cause"] == "cpu_wait")
        out.append(f"CPU wait normal ({ms(wait)} in the step)")
    if "cuda" in observed and primary_kind not in ("slow_cuda_call", "gpu_xid") and none(
            "SELECT count(*) AS n FROM slow_cuda_call WHERE session_id = :s AND ts >= :a AND ts < :b"):
        out.append(f"no CUDA call took more than {slow_call_rule(store).times()} its baseline")
    if "nccl" in observed and primary_kind != "nccl_straggler" and not any(
            r["cause"] == "nccl_wait" and "waiting for rank" in (r["detail"] or "") for r in rows):
        out.append("no NCCL straggler")
    return out


def _gpu_during(store: Store, sid: int, a: int, b: int, step: dict | None = None) -> dict | None:
    """GPU utilisation (gpu_sample) over [a, b): the mean and the lowest sample; for a step, against
    the median of its neighbouring steps' means (step_gpu: up to stall_rule.neighbours each side)."""
    during = store.one("SELECT avg(util_gpu) AS u, min(util_gpu) AS lo, count(*) AS n FROM gpu_sample"
                       " WHERE session_id = ? AND ts >= ? AND ts < ? AND util_gpu IS NOT NULL", (sid, a, b))
    if not during or not during["n"]:
        return None
    near: list[float] = []
    if step is not None:
        mark = store.row("SELECT thread_id, ts FROM step_mark WHERE id = ?", (step["step_mark_id"],))
        n = stall_rule(store).neighbours
        ids = [r["id"] for r in store.query(
            "SELECT id FROM (SELECT id FROM step_mark WHERE thread_id = :t AND ts < :ts ORDER BY ts DESC LIMIT :n)"
            " UNION ALL SELECT id FROM (SELECT id FROM step_mark WHERE thread_id = :t AND ts > :ts ORDER BY ts"
            " LIMIT :n)", {"t": mark["thread_id"], "ts": mark["ts"], "n": n})]
        for i in ids:  # one step at a time: each is an index lookup (an IN list is not pushed into the view)
            row = store.one("SELECT sum(util_gpu_mean * samples) / sum(samples) AS u FROM step_gpu"
                            " WHERE step_mark_id = ?", (i,))
            if row and row["u"] is not None:
                near.append(row["u"])
    near.sort()
    return {"util_gpu_pct": round(during["u"], 1), "util_gpu_min_pct": during["lo"], "samples": during["n"],
            "neighbours_util_gpu_pct": round(near[(len(near) - 1) // 2], 1) if near else None,
            "neighbour_steps": len(near)}


def gpu_text(gpu: dict) -> str:
    """'GPU utilisation 8.0% (lowest 5%) against 97.0% over 20 neighbouring steps'; with a device
    timeline, 'device busy 42.0% of the step (bound by the host: ...)'."""
    parts = []
    if gpu.get("util_gpu_pct") is not None:
        text = f"GPU utilisation {gpu['util_gpu_pct']}% (lowest {gpu['util_gpu_min_pct']}%)"
        if gpu.get("neighbours_util_gpu_pct") is not None:
            text += f" against {gpu['neighbours_util_gpu_pct']}% over {gpu['neighbour_steps']} neighbouring steps"
        parts.append(text)
    if gpu.get("busy_pct") is not None:
        parts.append(device.text(gpu))
    return "; ".join(parts)


def _gpu_and_device(store: Store, sid: int, a: int, b: int, step: dict | None = None) -> dict | None:
    """NVML's samples (_gpu_during) and the device's own timeline (store/analysis/device.py) over [a, b),
    as one `gpu` part; None when neither was recorded."""
    gpu = _gpu_during(store, sid, a, b, step)
    thread = process = None
    if step is not None:
        row = store.one("SELECT m.thread_id, t.process_id FROM step_mark m JOIN thread t ON t.id = m.thread_id"
                        " WHERE m.id = ?", (step["step_mark_id"],))
        if row is not None:
            thread, process = row["thread_id"], row["process_id"]
    timeline = device.timeline(store, sid, a, b, thread, process)
    if timeline is None:
        return gpu
    return {**(gpu or {}), **timeline}


def analyse_step(store: Store, session: dict, step: dict) -> dict:
    """Everything a report says about one step (stalled or not)."""
    from store.analysis import causes

    sid = session["id"]
    off = session["wall_offset_ns"]
    rows = causes.breakdown(store, step)
    excess = max(step["excess_dur"] or 0, 0)
    cands = causes.candidates(store, step, rows)
    rule = cause_rule(store)
    chosen = causes.primary(cands, excess, rule) if step["slow"] else None
    names = thread_names(store, step["thread_id"])
    primary_cause = None
    if chosen is not None:
        kind = KINDS[chosen["kind"]]
        facts = cause_facts(store, chosen, step)
        at = causes.evidence_ts(chosen, step)
        lines = causes.lost_lines(store, step, chosen)
        # a cause without a stack of its own is at the line where its time went, the others at their
        # evidence's line (the request's submitter, the call, the longest wait)
        top = lines[0]["python_stack_id"] if lines and lines[0]["python"] else None
        own = None if kind.own_stack else causes.evidence_stack(chosen)
        stack = own or top or causes.nearest_stack(store, step["thread_id"], at, step["ts"])
        if kind.stack is not None:  # the kind says where it is (a wait chain: where it ends)
            stack = kind.stack(chosen) or stack
        site, frames = causes.python_site(store, stack)
        request = chosen.get("request") or {}
        facts.update(
            python=site, python_stack=frames,
            python_lines=[{k: r[k] for k in ("python", "dur_ns", "intervals", "how")}
                          for r in lines[:causes.LINES_LISTED]
                          if r["dur_ns"] >= causes.LINE_SHARE_LISTED * sum(x["dur_ns"] for x in lines)],
            lineage=causes.lineage_at(store, sid, step["thread_id"], at, request.get("io_tag")),
            share_of_stall=round(min(chosen["excess_dur_ns"] / max(excess, 1), 1.0), 3),
            evidence={k: chosen[k].get(i) for k, i in (("request", "block_request_id"), ("wait", "offcpu_id"),
                                                         ("call", "cuda_call_id")) if chosen.get(k)},
            utc=utc(at + off),
        )
        if kind.evidence is not None:
            facts["evidence"].update(kind.evidence(chosen))
        primary_cause = facts
    secondary = []
    for c in cands:
        if c is chosen or c["excess_dur_ns"] < rule.secondary_share * max(excess, 1) or not step["slow"]:
            continue
        if chosen is not None and (KINDS[c["kind"]].quiet or c["kind"] in KINDS[chosen["kind"]].explains):
            continue  # the sleep the primary cause is made of, or the wait it explains
        secondary.append(cause_facts(store, c, step)["summary"])
    used = set(KINDS[chosen["kind"]].events_stated) if chosen is not None else set()
    for e in store.query("SELECT e.kind, count(*) AS n, min(e.detail) AS detail, c.cause FROM step_machine_event e"
                         " LEFT JOIN device_event_cause c ON c.kind = e.kind"
                         " WHERE e.step_mark_id = ? GROUP BY e.kind", (step["step_mark_id"],)):
        if e["kind"] in used or (primary_cause and e["cause"] == primary_cause["kind"]):
            continue
        secondary.append(f"{e['n']} {e['kind'].replace('_', ' ')} event{'s' if e['n'] != 1 else ''} "
                         f"during the step ({e['detail']})")
    for c in store.query(
            "SELECT final_path, status, reasons FROM checkpoint_integrity WHERE session_id = ? AND pid = ?"
            " AND open_ts >= ? AND open_ts < ? AND status IN ('incomplete', 'changed', 'missing')",
            (sid, names.get("pid"), step["ts"], step["ts"] + step["dur"])):
        secondary.append(f"checkpoint {c['final_path']} written in this step is {c['status']}"
                         + (f" ({c['reasons']})" if c["reasons"] else ""))
    # the excess no wait explains: where the thread's CPU time went (the on-CPU profile)
    cpu = oncpu.on_cpu(store, step, chosen["excess_dur_ns"] if chosen is not None
                       and chosen["kind"] not in oncpu.PLACED_KINDS else 0)
    return {
        **({"on_cpu": cpu} if cpu else {}),
        "step": step["step"], "step_mark_id": step["step_mark_id"], "ts": step["ts"], "utc": utc(step["ts"] + off),
        "dur_ns": step["dur"], "baseline_dur_ns": step["baseline_dur"], "baseline_steps": step["baseline_steps"],
        "ratio": step["ratio"], "excess_dur_ns": step["excess_dur"], "slow": bool(step["slow"]),
        "complete": bool(step["complete"]), "inferred": bool(step["inferred"]),
        "thread": {"tid": names.get("tid"), "pid": names.get("pid"), "name": names.get("thread_name"),
                   "process": names.get("process_name"), "job": names.get("job")},
        "breakdown": rows, "primary_cause": primary_cause, "secondary": secondary,
        "candidates": [c["kind"] for c in cands],
    }


def _choose(store: Store, session: dict, rows: list[dict]) -> tuple[dict, dict | None]:
    """Among the processes' rows of one step number: the one whose wait another rank explains
    (the collective's victim, with the straggler analysed too), else the most stalled."""
    analyses = [analyse_step(store, session, r) for r in rows[:8]]
    for a in analyses:
        p = a["primary_cause"]
        if p and p["kind"] == "nccl_straggler":
            late = next((b for b in analyses if b["thread"]["pid"] == p.get("straggler_pid")), None)
            return a, late
    return analyses[0], None


def explain_steps(store: Store, session: dict, state: str, start: int, end: int, step: int | None,
                  worst: bool) -> StepReport:
    sid = session["id"]
    off = session["wall_offset_ns"]
    stalls: list[dict] = []
    if step is not None:
        rows = _step_rows(store, sid, step)
    else:
        from store.analysis.causes import find_stalls

        stalls = find_stalls(store, sid, start, end)
        rows = [r for r in stalls if r["step"] == stalls[0]["step"]] if stalls else []
    outside = _outside(store, session, start, end) if step is None else None
    layers = layer_words(store, sid)
    caps = _capabilities(store, sid, layers, outside=outside)
    observed = set(caps["observed"])
    base = {
        "mode": "step",
        "session": {"id": sid, "state": state, "host": session["hostname"], "kernel": session["kernel_release"],
                    "target": session["target"], **_session_notes(store, sid)},
        "observed_layers": caps["observed"], "not_observed": caps["not_observed"],
        **({"layer_words": caps["words"]} if "words" in caps else {}),
    }
    if not rows:
        summary = store.row("SELECT count(*) AS n, min(dur) AS lo, max(dur) AS hi FROM step_all"
                            " WHERE session_id = ? AND ts >= ? AND ts < ?", (sid, start, end))
        med = store.query("SELECT dur FROM step_all WHERE session_id = ? AND ts >= ? AND ts < ? AND complete"
                          " ORDER BY dur", (sid, start, end))
        typical = med[(len(med) - 1) // 2]["dur"] if med else None
        lost, lossy = _loss(store, sid, start, end, off, layers)
        return StepReport(
            **base, loss=lost, window=_window(start, end, off), stall=False, step=None,
            symptom=f"nothing recorded: {outside}" if outside else
                    f"no step stalled: {summary['n']} steps, median {ms(typical)}, slowest {ms(summary['hi'])}"
                    f" (a stall is {stall_rule(store).text()})",
            primary_cause=None, findings=[], secondary=[], other_stalls=[],
            negatives=_step_negatives(store, sid, start, end, observed - lossy, None, []),
            gpu=_gpu_and_device(store, sid, start, end), next_actions=[], straggler=None)
    chosen, late = _choose(store, session, rows)
    a, b = chosen["ts"], chosen["ts"] + chosen["dur_ns"]
    lost, lossy = _loss(store, sid, a, b, off, layers)
    p = chosen["primary_cause"]
    gpu = _gpu_and_device(store, sid, a, b, chosen)
    symptom = (f"step {chosen['step']} took {ms(chosen['dur_ns'])}, {chosen['ratio']}x its median of "
               f"{ms(chosen['baseline_dur_ns'])} over {chosen['baseline_steps']} neighbouring steps"
               if chosen["slow"] else
               f"step {chosen['step']} took {ms(chosen['dur_ns'])}, within its median of "
               f"{ms(chosen['baseline_dur_ns'])}: not a stall")
    if not chosen["complete"]:
        symptom += " (still running when the recording stopped)"
    if gpu:
        symptom += f"; {gpu_text(gpu)}"
    others: list[dict] = []
    if step is None and not worst:
        seen = {chosen["step"]}
        for r in stalls:
            if r["step"] in seen or len(others) >= OTHER_STALLS:
                continue
            seen.add(r["step"])
            others.append({"step": r["step"], "dur_ns": r["dur"], "baseline_dur_ns": r["baseline_dur"],
                           "ratio": r["ratio"]})
    straggler = None
    if late is not None:
        lp = late["primary_cause"]
        straggler = {"rank": p.get("straggler_rank"), "pid": late["thread"]["pid"], "step": late["step"],
                     "dur_ns": late["dur_ns"], "summary": lp["summary"] if lp else "no recorded wait explains it",
                     "python": lp.get("python") if lp else None, "kernel_path": lp.get("kernel_path") if lp else []}
    next_actions = list(p["next_actions"]) if p else (fill(STEP_ACTIONS, "unexplained", {}) if chosen["slow"] else [])
    return StepReport(
        **base, loss=lost, window=_window(a, b, off), stall=chosen["slow"],
        step={k: chosen[k] for k in ("step", "step_mark_id", "utc", "dur_ns", "baseline_dur_ns", "baseline_steps",
                                     "ratio", "excess_dur_ns", "complete", "inferred", "thread")},
        symptom=symptom,
        primary_cause=p,
        breakdown=chosen["breakdown"],
        findings=_call_findings(slow_calls(store, sid, a, b, step={"step_mark_id": chosen["step_mark_id"],
                                                                          "excess_dur": chosen["excess_dur_ns"]}), off),
        secondary=chosen["secondary"],
        straggler=straggler,
        other_stalls=others,
        negatives=_step_negatives(store, sid, a, b, observed - lossy, p["kind"] if p else None, chosen["breakdown"]),
        gpu=gpu,
        next_actions=next_actions,
        **({"on_cpu": chosen["on_cpu"]} if "on_cpu" in chosen else {}),
        **({"launches": launches} if (launches := step_launches(store, chosen["step_mark_id"])) else {}))


def step_launches(store: Store, step_mark_id: int) -> dict | None:
    """The step's kernel launches where they were counted (step_launch), None for a recording with
    a row per launch."""
    row = store.one("SELECT launches, sampled, how FROM step_launch WHERE step_mark_id = ?", (step_mark_id,))
    if row is None or row["how"] != "counted":
        return None
    kernels = store.row(
        "SELECT count(DISTINCT coalesce(k.api_id, -1) || ':' || coalesce(k.function, 0)) AS n"
        " FROM cuda_launch_count k JOIN thread t ON t.id = k.thread_id JOIN step st ON st.step_mark_id = ?"
        " WHERE t.process_id = st.process_id AND k.ts >= st.ts AND k.ts < st.end_ts", (step_mark_id,))["n"]
    return {"launches": row["launches"], "sampled": row["sampled"], "kernels": kernels}


def _window(a: int, b: int, off: int) -> dict:
    return {"start_ts": a, "end_ts": b, "start_utc": utc(a + off), "end_utc": utc(b + off), "dur_ns": b - a}
