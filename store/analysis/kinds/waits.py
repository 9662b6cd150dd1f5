"""Waits: the step's thread was blocked (step_cause 'blocked', a reason that is neither I/O nor the
network): followed to the thread that ended the wait, the cause is a wait on the interpreter lock
(gil_wait, the thread that held it), retransmits on the process's own connections during a poll or
read (tcp_retransmit, kinds/network.py), or a wait ended by a thread that was itself waiting
(wait_chain, to the end of the chain: store/analysis/waits.py); else the wait itself (blocked)."""

from __future__ import annotations

from store.analysis import waits
from store.analysis.kinds.family import Facts, Family, Kind, RuleContext, row_base
from store.analysis.kinds.network import own_retransmits
from store.units import ms

WAITED_FOR_REASONS = ("futex", "io", "poll", "blocked", "net")  # waits another task may end (not a sleep)


def candidate(ctx: RuleContext, row: dict) -> dict | None:
    """A wait of any other reason, as itself."""
    if row["cause"] != "blocked" or row["detail"] == "net" or row["detail"] in ctx.io_reasons:
        return None
    return {**row_base(row), "kind": "blocked", "reason": row["detail"], "wait": ctx.longest_wait(row["detail"])}


def followed(ctx: RuleContext) -> list[dict]:
    """Causes found by following the step's waits to other threads and processes."""
    store, step, sid = ctx.store, ctx.step, ctx.step["step_mark_id"]
    out: list[dict] = []
    for r in ctx.rows:
        if r["cause"] != "blocked" or r["detail"] not in WAITED_FOR_REASONS or not r["excess_dur_ns"]:
            continue
        reason = r["detail"]
        base = {"dur_ns": r["dur_ns"], "excess_dur_ns": r["excess_dur_ns"], "detail": reason, "reason": reason}
        if reason == "futex":
            gil = waits.gil_waits(store, sid)
            if gil and gil["dur_ns"] >= 0.5 * r["dur_ns"]:
                share = min(1.0, gil["dur_ns"] / max(r["dur_ns"], 1))
                wait = store.one("SELECT * FROM step_offcpu WHERE step_mark_id = ? AND offcpu_id = ?",
                                 (sid, gil["longest"]))
                out.append({**base, "kind": "gil_wait", "dur_ns": gil["dur_ns"],
                            "excess_dur_ns": int(r["excess_dur_ns"] * share), "gil": gil, "wait": wait})
                continue
        if reason in ("poll", "io", "blocked"):
            retrans = own_retransmits(store, step, reason)
            if retrans:
                out.append({**base, "kind": "tcp_retransmit", "retransmits": retrans,
                            "wait": ctx.longest_wait(reason)})
                continue
        # the longest waits of this reason, followed through their wakers
        for wait in store.query("SELECT * FROM step_offcpu WHERE step_mark_id = ? AND reason = ? AND blocked_dur > 0"
                                " ORDER BY blocked_dur DESC LIMIT 3", (sid, reason)):
            hops = waits.chain(store, wait["offcpu_id"])
            if hops:
                out.append({**base, "kind": "wait_chain", "wait": wait, "chain": hops})
                break
    return out


def wait_chain(f: Facts) -> None:
    hops = f.cand["chain"]
    end = hops[-1]
    f.facts.update(reason=f.cand.get("reason"), syscall=f.syscall, chain=[waits.hop_json(h) for h in hops],
                   waited_for=end["thread_name"])
    f.facts["summary"] = waits.chain_summary(hops, f.dur)
    f.path = waits.chain_path(hops)
    f.context.update(end_who=waits.who(end), end_text=waits.doing(end), end_pid=end["pid"],
                     end_device=end["device"] if end["block_request_id"] is not None else None,
                     end_peer=end["retransmit_peer"] if end["retransmits"] else None,
                     offcpu_id=hops[0]["offcpu_id"])


def gil_wait(f: Facts) -> None:
    g = f.cand["gil"]
    h = g["holder"] or {}
    holder = (f"{h['name']} (tid {h['tid']}) of {h['process']} (pid {h['pid']})" if h else "another thread")
    f.facts.update(reason="futex", syscall=f.syscall, gil_waits=g["waits"],
                   holder={"tid": h.get("tid"), "pid": h.get("pid"), "name": h.get("name"),
                           "process": h.get("process"), "python": h.get("python"),
                           "woke_dur_ns": h.get("dur_ns"), "held_dur_ns": h.get("held_dur_ns"),
                           "waits": h.get("waits"), "timed_out_waits": h.get("timed_out")} if h else None)
    # how the holder is known: it handed the lock over (woke the waits), or the waits timed out
    # while it was the one thread of the process awake (only one thread holds the GIL)
    if not h:
        held = ""
    elif h["timed_out"] == h["waits"]:
        held = f"; all {h['waits']} of its waits timed out while it ran"
    elif h["timed_out"]:
        held = f"; {h['timed_out']} of its {h['waits']} waits timed out while it ran, it handed the rest over"
    else:
        held = f"; it handed the lock over at each of its {h['waits']} waits"
    held = f" (awake through {ms(h['held_dur_ns'])} of the {ms(g['dur_ns'])} waited{held})" if h else ""
    f.facts["summary"] = (f"waiting for the GIL: the thread waited {ms(f.dur)} for the interpreter lock "
                          f"({g['waits']} waits), held by {holder}"
                          + (f" running {h['python']}" if h.get("python") else "") + held)
    f.path = ["futex() on the GIL", f"held by {holder}"]
    f.context.update(holder=holder, holder_at=f" at {h['python']}" if h.get("python") else "")


def blocked(f: Facts) -> None:
    wait, syscall, reason = f.wait, f.syscall, f.cand.get("reason")
    f.facts.update(reason=reason, syscall=syscall, waker=wait.get("waker_name"))
    how = f"in {syscall}()" if syscall == reason else (f"{reason}" + (f" in {syscall}()" if syscall else ""))
    f.facts["summary"] = (f"blocked {how} for {ms(f.dur)}"
                          + (f", woken by {wait.get('waker_name')}"
                             + (f" (pid {wait.get('waker_pid')})" if wait.get("waker_pid") is not None else "")
                             if wait.get("waker_name") else ""))
    f.path = [f"{syscall}()" if syscall else str(reason)]


def chain_end(cand: dict) -> int | None:
    """A wait chain is at the line where it ends: the wait that explains it."""
    return cand["chain"][-1]["python_stack_id"]


EXPLAINED = ("blocked_io", "network_wait")  # the waits a followed cause explains
FAMILY = Family(
    name="waits",
    kinds=(Kind("wait_chain", wait_chain, explains=EXPLAINED, stack=chain_end),
           Kind("gil_wait", gil_wait, lost_time=("blocked", ("futex",)), explains=EXPLAINED),
           Kind("blocked", blocked, quiet=True)),
    row=candidate,
    followed=followed,
    actions={
        "wait_chain": [
            "The training thread waited for {end_who}, which was {end_text}: fix that wait, not the queue or "
            "lock the training thread blocked on",
            ("Check the I/O limits of {end_who}'s cgroup (io.max, blkio.throttle.*) and its reads on {end_device}: "
             "SELECT * FROM block_request_named WHERE pid = {end_pid} AND device = '{end_device}'", "end_device"),
            ("Check the path to {end_peer}: ss -ti dst {end_peer} (retrans, rto), interface errors (ip -s link)",
             "end_peer"),
            "Let the producer run ahead of the training loop: more DataLoader workers or a larger "
            "prefetch_factor, data read ahead or cached closer to the job",
            "Follow the chain yourself: SELECT * FROM wait_chain WHERE root_offcpu_id = {offcpu_id} ORDER BY depth",
        ],
        "gil_wait": [
            "{holder} held the interpreter lock{holder_at}: move that CPU work out of the training process "
            "(a worker process, or native code that releases the GIL), or make it yield more often",
            "Check the switch interval (sys.getswitchinterval(), 5 ms by default): a thread that holds the GIL "
            "delays every other thread of the process by up to that much at each wait",
        ],
        "blocked": ["Find what the thread waited for: the waker above, or the lock or event at the Python line"],
    },
)
