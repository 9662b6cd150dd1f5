"""Network: the step's thread waited in a network call (step_cause 'blocked', detail net):
tcp_retransmit when its connections retransmitted meanwhile, else network_wait. A wait in poll() or
read() on a socket is found the same way by following the waits (kinds/waits.py uses
`own_retransmits` and `retransmit_candidate`)."""

from __future__ import annotations

from store.analysis.kinds.family import Facts, Family, Kind, RuleContext, row_base
from store.db import Store
from store.units import ms


def own_retransmits(store: Store, step: dict, reason: str) -> list[dict]:
    """TCP retransmits on connections of the step's own process while its thread waited (`reason`
    waits), at either end (a reply retransmitted by a local peer is the asker's wait): a socket read
    with a timeout waits in poll(), a buffered one in read(), not only in recv(); the retransmit's
    running task is rarely the owner (tcp_retransmit.process_id and peer_process_id are)."""
    return store.query(
        "SELECT e.daddr || ':' || e.dport AS peer, count(DISTINCT e.id) AS n, min(e.ts) AS first_ts,"
        " max(e.saddr || ':' || e.sport || ' -> ' || e.daddr || ':' || e.dport) AS connection"
        " FROM step_offcpu s JOIN tcp_retransmit e ON e.session_id = s.session_id"
        "  AND e.ts >= s.ts AND e.ts < s.ts + s.overlap_dur AND ? IN (e.process_id, e.peer_process_id)"
        " WHERE s.step_mark_id = ? AND s.reason = ? AND s.blocked_dur > 0"
        " GROUP BY e.daddr, e.dport ORDER BY n DESC", (step["process_id"], step["step_mark_id"], reason))


def candidate(ctx: RuleContext, row: dict) -> dict | None:
    if row["cause"] != "blocked" or row["detail"] != "net":
        return None
    store, step = ctx.store, ctx.step
    # retransmits on the process's own connections during its waits; else, in a network call, those
    # of the step whose owner is not known (never another process's)
    retrans = own_retransmits(store, step, "net") or store.query(
        "SELECT device AS peer, count(*) AS n, min(ts) AS first_ts, max(detail) AS connection"
        " FROM step_machine_event WHERE step_mark_id = ? AND kind = 'tcp_retransmit'"
        " AND event_id IN (SELECT id FROM tcp_retransmit WHERE session_id = ? AND process_id IS NULL)"
        " GROUP BY device ORDER BY n DESC", (step["step_mark_id"], step["session_id"]))
    return {**row_base(row), "kind": "tcp_retransmit" if retrans else "network_wait", "retransmits": retrans,
            "wait": ctx.longest_wait("net")}


def network(f: Facts) -> None:
    """tcp_retransmit, network_wait."""
    re_ = f.cand.get("retransmits") or []
    syscall = f.syscall
    f.facts.update(syscall=syscall, retransmits=sum(r["n"] for r in re_), peer=re_[0]["peer"] if re_ else None)
    if re_:
        f.facts["summary"] = (f"TCP retransmits: {f.facts['retransmits']} retransmits to {re_[0]['peer']} while the "
                              f"thread waited {ms(f.dur)} in {syscall or 'a network call'}")
        f.path = [f"{syscall}()" if syscall else "network wait", f"TCP retransmission to {re_[0]['peer']}"]
    else:
        f.facts["summary"] = f"waiting on the network in {syscall or 'a network call'} for {ms(f.dur)}"
        f.path = [f"{syscall}()" if syscall else "network wait"]
    f.context["peer_host"] = (f.facts.get("peer") or "").split(":")[0]


FAMILY = Family(
    name="network",
    kinds=(Kind("tcp_retransmit", network, explains=("blocked_io", "network_wait"), events_stated=("tcp_retransmit",)),
           Kind("network_wait", network)),
    row=candidate,
    actions={
        "tcp_retransmit": [
            "Check the path to {peer}: ss -ti dst {peer_host} (retrans, rto), "
            "interface errors (ip -s link), switch port counters",
            "Look for packet loss or congestion on that link at the time (NIC ring drops: ethtool -S)",
        ],
        "network_wait": ["Find the peer the thread waited for and its latency (ss -ti)"],
    },
)
