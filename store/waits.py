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
    return store.one("SELECT max_depth FROM wait_chain_rule")["max_depth"]


def chain(store: Store, offcpu_id: int) -> list[dict]:
    """The wait chain of one off-CPU interval, the rows of `wait_chain WHERE root_offcpu_id = ?`:
    the wait itself (depth 0), then each waker's wait; [] when its waker had no recorded wait."""
    root = store.one("SELECT * FROM offcpu_wait WHERE offcpu_id = ?", (offcpu_id,))
    if root is None:
        return []
    rule = store.one("SELECT max_depth, min_blocked_dur FROM wait_chain_rule")
    hops = [{"root_offcpu_id": offcpu_id, "depth": 0, "woke_offcpu_id": None, **root}]
    current = offcpu_id
    while len(hops) <= rule["max_depth"]:
        hop = store.one("SELECT waker_offcpu_id, wakeup_ts FROM wait_hop WHERE offcpu_id = ?", (current,))
        if hop is None or hop["waker_offcpu_id"] is None:
            break
        if len(hops) == 1 and hop["wakeup_ts"] - root["ts"] < rule["min_blocked_dur"]:
            break
        row = store.one("SELECT * FROM offcpu_wait WHERE offcpu_id = ?", (hop["waker_offcpu_id"],))
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
    if hop["gil"]:  # the holder is the waker when it is a thread of the same process (not a timeout)
        return "waiting for the GIL" + (f" held by {hop['waker_name']} (tid {hop['waker_tid']})"
                                        if hop.get("waker_tid") and hop["waker_pid"] == hop["pid"] else "")
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
    time, and the thread that held it (the one that woke the waits, by time) with its line."""
    rows = store.query(
        "SELECT s.offcpu_id, s.blocked_dur, s.ts, o.wakeup_ts, o.waker_thread_id, o.thread_id,"
        " w.process_id = t.process_id AS same_process"
        " FROM step_offcpu s JOIN offcpu_interval o ON o.id = s.offcpu_id"
        " JOIN thread t ON t.id = o.thread_id JOIN process p ON p.id = t.process_id"
        " JOIN python_gil g ON g.session_id = o.session_id AND g.pid = p.pid"
        "   AND o.futex_addr >= g.lo AND o.futex_addr < g.hi"
        " LEFT JOIN thread w ON w.id = o.waker_thread_id"
        " WHERE s.step_mark_id = ? AND s.reason = 'futex'", (step_mark_id,))
    if not rows:
        return None
    by_waker: Counter[int] = Counter()
    for r in rows:
        # only a thread of the same process can hold its GIL: a wait that timed out (every switch
        # interval) is woken by whatever task the timer interrupt found running
        if r["same_process"] and r["waker_thread_id"] != r["thread_id"]:
            by_waker[r["waker_thread_id"]] += r["blocked_dur"]
    out = {"dur_ns": sum(r["blocked_dur"] for r in rows), "waits": len(rows),
           "longest": max(rows, key=lambda r: r["blocked_dur"])["offcpu_id"], "holder": None}
    if by_waker:
        holder, _ = by_waker.most_common(1)[0]
        names = store.one("SELECT tid, pid, thread_name, process_name FROM thread_info WHERE thread_id = ?", (holder,))
        lines: Counter[str] = Counter()
        for r in rows:
            if r["waker_thread_id"] != holder:
                continue
            # the holder blocks right after dropping the GIL (it waits for the waiter to take it): the
            # Python stack captured there is the line it was running while it held it
            nxt = store.one(
                "SELECT s.text FROM offcpu_interval x JOIN python_call_site s ON s.stack_id = x.python_stack_id"
                " WHERE x.thread_id = ? AND x.ts >= ? AND x.ts <= ? ORDER BY x.ts LIMIT 1",
                (holder, r["wakeup_ts"] - HOLDER_LINE_NS // 100, r["wakeup_ts"] + HOLDER_LINE_NS))
            if nxt:
                lines[nxt["text"]] += 1
        if not lines:  # it never blocked right after a wake: its lines around the waits
            lo = min(r["ts"] for r in rows) - HOLDER_WINDOW_NS
            hi = max(r["wakeup_ts"] or r["ts"] for r in rows) + HOLDER_WINDOW_NS
            lines.update({r["text"]: r["n"] for r in store.query(
                "SELECT s.text, count(*) AS n FROM offcpu_interval x JOIN python_call_site s"
                " ON s.stack_id = x.python_stack_id WHERE x.thread_id = ? AND x.ts >= ? AND x.ts <= ?"
                " GROUP BY s.text", (holder, lo, hi))})
        out["holder"] = {"thread_id": holder, "tid": names["tid"], "pid": names["pid"],
                         "name": names["thread_name"], "process": names["process_name"],
                         "python": lines.most_common(1)[0][0] if lines else None,
                         "dur_ns": by_waker[holder]}
    return out
