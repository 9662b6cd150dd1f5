"""Waits followed across threads and processes: the wait chain of a blocked interval, and waits on
the interpreter lock.

A thread blocked on a queue, a pipe, a lock or the GIL is woken by the thread it waited for; what
that waker was itself waiting for before it woke it (its own off-CPU interval: a block request, TCP
retransmissions on its connections, the GIL...) explains the wait, and so on to the end of the
chain. The views do it in SQL (wait_hop, offcpu_wait, and the recursive wait_chain in
store/views/0009_waits.sql); a report follows the same hops one indexed lookup at a time, which on a
large session is much cheaper than the recursive view. The rule (how deep) is wait_chain_rule.
"""

from __future__ import annotations

from collections import Counter

from store.db import Store
from store.units import ms

HOLDER_LINE_NS = 100_000_000  # the GIL holder's line: its next blocking switch this soon after it dropped it
HOLDER_WINDOW_NS = 1_000_000_000  # else its lines this close to the waits


def max_depth(store: Store) -> int:
    return store.row("SELECT max_depth FROM wait_chain_rule")["max_depth"]


def chain(store: Store, offcpu_id: int) -> list[dict]:
    """The wait chain of one off-CPU interval, the rows of `wait_chain WHERE root_offcpu_id = ?`:
    the wait itself (depth 0), then each waker's wait; [] when its waker had no recorded wait."""
    root = store.one("SELECT * FROM offcpu_wait WHERE offcpu_id = ?", (offcpu_id,))
    if root is None:
        return []
    rule = store.row("SELECT max_depth, min_blocked_dur FROM wait_chain_rule")
    hops = [{"root_offcpu_id": offcpu_id, "depth": 0, "woke_offcpu_id": None, **root}]
    current = offcpu_id
    while len(hops) <= rule["max_depth"]:
        hop = store.one("SELECT waker_offcpu_id, wakeup_ts FROM wait_hop WHERE offcpu_id = ?", (current,))
        if hop is None or hop["waker_offcpu_id"] is None:
            break
        if len(hops) == 1 and hop["wakeup_ts"] - root["ts"] < rule["min_blocked_dur"]:
            break
        row = store.row("SELECT * FROM offcpu_wait WHERE offcpu_id = ?", (hop["waker_offcpu_id"],))
        hops.append({"root_offcpu_id": offcpu_id, "depth": len(hops), "woke_offcpu_id": current, **row})
        current = hop["waker_offcpu_id"]
    return hops if len(hops) > 1 else []


def who(hop: dict) -> str:
    """'loader-worker (pid 12)', with the thread when it is not the process's main thread."""
    if hop["tid"] == hop["pid"] or hop["pid"] is None:
        return f"{hop['thread_name']} (pid {hop['pid'] or hop['tid']})"
    return f"{hop['thread_name']} (tid {hop['tid']}) of {hop['process_name']} (pid {hop['pid']})"


def doing(hop: dict) -> str:
    """What the thread was blocked on in this wait, in words."""
    if hop["gil"]:  # gil_holder: the thread that handed it over, or the one awake through a timed-out wait
        return "waiting for the GIL" + (f" held by {hop['gil_holder_name']} (tid {hop['gil_holder_tid']})"
                                        if hop.get("gil_holder_tid") else "")
    if hop["retransmits"]:
        n = hop["retransmits"]
        return (f"waiting on the network in {hop['syscall_name'] or hop['reason']}(): {n} TCP retransmit"
                f"{'s' if n != 1 else ''} to {hop['retransmit_peer']}")
    if hop["block_request_id"] is not None:
        text = f"blocked on I/O on {hop['device']} ({hop['op']}"
        if hop["submitter_kind"] == "target_deferred" and (hop["queued_dur"] or 0) > (hop["device_dur"] or 0):
            text += f" queued {ms(hop['queued_dur'])} in blk-throttle, a cgroup I/O limit)"
        elif (hop["queued_dur"] or 0) > (hop["device_dur"] or 0):
            text += f" queued {ms(hop['queued_dur'])} in the block layer)"
        else:
            text += f" {ms(hop['device_dur'])} on the device)"
        return text
    if hop["reason"] in ("io", "uninterruptible"):
        return f"blocked on I/O in {hop['syscall_name'] or 'the kernel'}()"
    return f"blocked ({hop['reason']}{' in ' + hop['syscall_name'] + '()' if hop['syscall_name'] else ''})"


def _via(hop: dict) -> str:
    what = f"the {hop['syscall_name']}()" if hop["syscall_name"] else f"the {hop['reason']} wait"
    return what + (f" in {hop['python']}" if hop["python"] else "")


def chain_summary(hops: list[dict], dur: int) -> str:
    """'loader-worker (pid 12) blocked on I/O on loop3 (...) in read_chunk() at w.py:88: the thread
    waited 950 ms for it, via the read() in _recv() at connection.py:384 -> QueueFeederThread ...'"""
    end = hops[-1]
    at = f" in {end['python']}" if end["python"] else ""
    via = [_via(hops[0])] + [f"{who(h)} woken from {h['syscall_name'] or h['reason']}()" for h in hops[1:-1]]
    return f"{who(end)} {doing(end)}{at}: the thread waited {ms(dur)} for it, via " + " -> ".join(via)


def chain_path(hops: list[dict]) -> list[str]:
    """The kernel path of a chain: each wait and who ended it."""
    out = [f"{hops[0]['syscall_name'] or hops[0]['reason']}()"]
    for h in hops[1:]:
        out.append(f"woken by {who(h)} after its {h['syscall_name'] or h['reason']}() ({ms(h['blocked_dur'])})")
    end = hops[-1]
    if end["block_request_id"] is not None:
        if end["submitter_kind"] == "target_deferred":
            out.append(f"blk-throttle (queued {ms(end['queued_dur'])})")
        out.append(f"{end['device']} (on device {ms(end['device_dur'])})")
    elif end["retransmits"]:
        out.append(f"TCP retransmission to {end['retransmit_peer']}")
    elif end["gil"]:
        out.append("GIL")
    return out


def hop_json(hop: dict) -> dict:
    """A hop as the report's `chain` lists it (store/models.py WaitHop)."""
    return {
        "depth": hop["depth"], "offcpu_id": hop["offcpu_id"], "ts": hop["ts"], "blocked_dur_ns": hop["blocked_dur"],
        "thread": {"tid": hop["tid"], "pid": hop["pid"], "name": hop["thread_name"], "process": hop["process_name"]},
        "reason": hop["reason"], "syscall": hop["syscall_name"], "python": hop["python"],
        "waker": {"tid": hop["waker_tid"], "pid": hop["waker_pid"], "name": hop["waker_name"]},
        "gil": bool(hop["gil"]), "block_request_id": hop["block_request_id"], "device": hop["device"],
        "queued_dur_ns": hop["queued_dur"], "device_dur_ns": hop["device_dur"],
        "retransmits": hop["retransmits"], "retransmit_peer": hop["retransmit_peer"],
        "text": doing(hop),
    }


# -- the interpreter lock -----------------------------------------------------------------------------
def gil_waits(store: Store, step_mark_id: int) -> dict | None:
    """The step's waits on the GIL of its own process (futex on the python_gil range): their blocked
    time, and the thread that held it with its line. Each wait's holder is gil_holder's: the thread of
    the process that woke it (a hand-over), or for a wait that timed out the one other thread of the
    process (not a native one) awake through it; the step's holder is the one awake through most of its waits."""
    rows = store.query(
        "SELECT s.offcpu_id, s.blocked_dur, s.ts, h.holder_thread_id, h.holder_how, h.holder_awake_dur,"
        " coalesce(o.wakeup_ts, o.ts + o.dur) AS end_ts"
        " FROM step_offcpu s JOIN gil_holder h ON h.offcpu_id = s.offcpu_id"
        " JOIN offcpu_interval o ON o.id = s.offcpu_id"
        " WHERE s.step_mark_id = ? AND s.reason = 'futex'", (step_mark_id,))
    if not rows:
        return None
    held: Counter[int] = Counter()
    for r in rows:
        if r["holder_thread_id"] is not None:
            held[r["holder_thread_id"]] += min(r["holder_awake_dur"] or 0, r["blocked_dur"])
    out = {"dur_ns": sum(r["blocked_dur"] for r in rows), "waits": len(rows),
           "longest": max(rows, key=lambda r: r["blocked_dur"])["offcpu_id"], "holder": None}
    if not held:
        return out
    holder, held_ns = held.most_common(1)[0]
    mine = [r for r in rows if r["holder_thread_id"] == holder]
    names = store.row("SELECT tid, pid, thread_name, process_name FROM thread_info WHERE thread_id = ?", (holder,))
    out["holder"] = {"thread_id": holder, "tid": names["tid"], "pid": names["pid"],
                     "name": names["thread_name"], "process": names["process_name"],
                     "python": _holder_line(store, holder, mine), "held_dur_ns": held_ns, "waits": len(mine),
                     "timed_out": sum(r["holder_how"] == "awake" for r in mine),
                     "dur_ns": sum(r["blocked_dur"] for r in mine if r["holder_how"] == "handed_over")}
    return out


def _holder_line(store: Store, holder: int, waits: list[dict]) -> str | None:
    """The line the GIL's holder ran while it held it: the Python stack of its first blocking switch
    right after each wait ended (it drops the lock when asked and waits for the waiter to take it),
    else its lines around the waits, else its stack nearest to them."""
    lines: Counter[str] = Counter()
    for r in waits:
        nxt = store.one(
            "SELECT s.text FROM offcpu_interval x JOIN python_call_site s ON s.stack_id = x.python_stack_id"
            " WHERE x.thread_id = ? AND x.ts >= ? AND x.ts <= ? ORDER BY x.ts LIMIT 1",
            (holder, r["end_ts"] - HOLDER_LINE_NS // 100, r["end_ts"] + HOLDER_LINE_NS))
        if nxt:
            lines[nxt["text"]] += 1
    if lines:
        return lines.most_common(1)[0][0]
    lo = min(r["ts"] for r in waits) - HOLDER_WINDOW_NS
    hi = max(r["end_ts"] for r in waits) + HOLDER_WINDOW_NS
    lines.update({r["text"]: r["n"] for r in store.query(
        "SELECT s.text, count(*) AS n FROM offcpu_interval x JOIN python_call_site s"
        " ON s.stack_id = x.python_stack_id WHERE x.thread_id = ? AND x.ts >= ? AND x.ts <= ?"
        " GROUP BY s.text", (holder, lo, hi))})
    if lines:
        return lines.most_common(1)[0][0]
    near = [store.one(
        "SELECT s.text, abs(x.ts - ?) AS d FROM offcpu_interval x JOIN python_call_site s"
        " ON s.stack_id = x.python_stack_id WHERE x.thread_id = ? AND x.ts " + op + " ? ORDER BY x.ts " + order
        + " LIMIT 1", (at, holder, at)) for op, order, at in ((">=", "ASC", hi), ("<", "DESC", lo))]
    found = [n for n in near if n is not None]
    return min(found, key=lambda n: n["d"])["text"] if found else None
