"""Why a step was slow: the step's breakdown by cause against its neighbours, and the evidence.

The numbers come from the views in store/views/0008_causes.sql (step_cause and the step_* link
views); this module decides which cause made the step slow and gathers what a report says about
it. A cause's share of a stall is its time in the step minus its median time in the neighbouring
steps (the same 20 steps the step's baseline is taken over): 300 ms asleep in a synchronisation
that every step has is not a cause, 3 s blocked on I/O that no other step has is.
"""

from __future__ import annotations

from statistics import median

from store.db import Store

NEIGHBOURS = 10  # steps on each side, as in step_baseline
SPECIFIC_SHARE = 0.5  # a more specific cause wins when it explains this share of the top excess
EXPLAINED_SHARE = 0.2  # below this share of the stall, no recorded cause explains it

# How specific each cause kind is: among causes of similar size, the deeper one is the root cause
# (a futex sleep inside a collective is explained by the rank that was late, D state inside
# reclaim by the reclaim, an I/O wait by the NVMe timeout that hit its request).
SPECIFICITY = {
    "nvme_timeout": 9, "io_error": 9, "iommu_fault": 9, "pcie_aer": 9, "gpu_xid": 9,
    "dma_bounce": 8, "nccl_straggler": 7, "memory_reclaim": 7, "tcp_retransmit": 7, "dirty_throttle": 6,
    "io_throttled": 5, "io_queued": 5, "slow_io": 5, "cpu_contention": 4, "slow_cuda_call": 4,
    "nccl_wait": 3, "network_wait": 3, "blocked_io": 2, "blocked": 1,
}
EVENT_KIND = {  # device event kind (block_request_device_event.kind) -> cause kind
    "nvme_timeout": "nvme_timeout", "nvme_abort_status": "nvme_timeout", "nvme_resetting": "nvme_timeout",
    "nvme_controller_down": "nvme_timeout", "nvme_reset_failure": "nvme_timeout", "nvme_not_ready": "nvme_timeout",
    "nvme_timeout_abort": "nvme_timeout", "nvme_timeout_reset": "nvme_timeout",
    "nvme_timeout_disable": "nvme_timeout", "nvme_timeout_polled": "nvme_timeout",
    "io_error": "io_error", "iommu_fault": "iommu_fault", "pcie_aer": "pcie_aer",
    "dma_bounce": "dma_bounce", "swiotlb_full": "dma_bounce", "dma_map_slow": "dma_bounce",
}
IO_REASONS = ("io", "uninterruptible")


def neighbour_ids(store: Store, step: dict) -> list[int]:
    before = store.query("SELECT step_mark_id FROM step WHERE thread_id = ? AND ts < ? ORDER BY ts DESC LIMIT ?",
                         (step["thread_id"], step["ts"], NEIGHBOURS))
    after = store.query("SELECT step_mark_id FROM step WHERE thread_id = ? AND ts > ? AND complete"
                        " ORDER BY ts LIMIT ?", (step["thread_id"], step["ts"], NEIGHBOURS))
    return [r["step_mark_id"] for r in before + after]


def breakdown(store: Store, step: dict) -> list[dict]:
    """step_cause rows of the step, each with its median over the neighbours and its excess."""
    others = neighbour_ids(store, step)
    rows = []
    for i in (step["step_mark_id"], *others):  # one by one: `=` reaches into every arm of the view, IN does not
        rows += store.query("SELECT * FROM step_cause WHERE step_mark_id = ?", (i,))
    usual: dict[tuple, list[int]] = {}
    for r in rows:
        if r["step_mark_id"] != step["step_mark_id"]:
            usual.setdefault((r["cause"], r["detail"]), []).append(r["dur"] or 0)
    out = []
    for r in rows:
        if r["step_mark_id"] != step["step_mark_id"]:
            continue
        seen = usual.get((r["cause"], r["detail"]), [])
        typical = median(seen + [0] * (len(others) - len(seen))) if others else 0
        out.append({"cause": r["cause"], "detail": r["detail"], "dur_ns": r["dur"] or 0, "events": r["events"],
                    "usual_dur_ns": int(typical), "excess_dur_ns": max(0, int((r["dur"] or 0) - typical))})
    out.sort(key=lambda r: -r["dur_ns"])
    return out


# -- candidates -------------------------------------------------------------------------------------
def _io_candidate(store: Store, step: dict, excess: int, dur: int) -> dict:
    sid = step["step_mark_id"]
    every = store.query("SELECT * FROM step_block_request WHERE step_mark_id = ? ORDER BY overlap_dur DESC", (sid,))
    requests = every[:5]
    events = []
    for r in every:  # per request: `=` reaches into every arm of the link view
        events += store.query("SELECT * FROM block_request_device_event WHERE block_request_id = ?",
                              (r["block_request_id"],))
    events.sort(key=lambda e: e["ts"])
    waits = store.query(
        "SELECT * FROM step_offcpu WHERE step_mark_id = ? AND reason IN ('io', 'uninterruptible')"
        " ORDER BY blocked_dur DESC LIMIT 1", (sid,))
    cand = {"dur_ns": dur, "excess_dur_ns": excess, "events": events, "requests": requests,
            "wait": waits[0] if waits else None}
    kinds = [EVENT_KIND[e["kind"]] for e in events if e["kind"] in EVENT_KIND]
    if kinds:
        kind = max(kinds, key=lambda k: SPECIFICITY[k])
        hit = [e for e in events if EVENT_KIND.get(e["kind"]) == kind]
        request = next(r for r in every if r["block_request_id"] == hit[0]["block_request_id"])
        cand.update(kind=kind, request=request, hit=hit)
    elif requests:
        worst = max(requests, key=lambda r: r["dur"])
        if worst["submitter_kind"] == "target_deferred" and (worst["queued_dur"] or 0) > (worst["device_dur"] or 0):
            kind = "io_throttled"
        elif (worst["queued_dur"] or 0) > (worst["device_dur"] or 0):
            kind = "io_queued"
        else:
            kind = "slow_io"
        cand.update(kind=kind, request=worst)
    else:
        cand.update(kind="blocked_io", request=None)
    return cand


def percentile(store: Store, session_id: int, request: dict) -> dict:
    """Where the request's latency falls among the session's requests of its device and op."""
    span = {"s": session_id, "d": request["device"], "o": request["op"], "v": request["dur"]}
    n = store.one("SELECT count(*) AS n FROM block_request WHERE session_id = :s AND device = :d AND op = :o",
                  span)["n"]
    below = store.one("SELECT count(*) AS n FROM block_request WHERE session_id = :s AND device = :d AND op = :o"
                      " AND dur <= :v", span)["n"]
    mid = store.one("SELECT dur FROM block_request WHERE session_id = :s AND device = :d AND op = :o"
                    " ORDER BY dur LIMIT 1 OFFSET :h", {**span, "h": max(n - 1, 0) // 2})
    return {"requests": n, "rank": below, "fraction": round(below / n, 5) if n else None,
            "median_dur_ns": mid["dur"] if mid else None}


def candidates(store: Store, step: dict, rows: list[dict]) -> list[dict]:
    """One candidate cause per kind, with the excess it explains and its evidence rows."""
    sid = step["step_mark_id"]
    out: list[dict] = []
    # D state inside direct reclaim is the reclaim's, not I/O's
    reasons = ("io",) if any(r["cause"] == "reclaim" for r in rows) else IO_REASONS
    io = [r for r in rows if r["cause"] == "blocked" and r["detail"] in reasons]
    if io:
        out.append(_io_candidate(store, step, sum(r["excess_dur_ns"] for r in io), sum(r["dur_ns"] for r in io)))
    waits = [r for r in rows if r["cause"] == "cpu_wait"]
    if waits:
        # every task that held the CPU counts: three copies of a hog split the wait between them
        contenders = store.query(
            "SELECT contender_name, group_concat(DISTINCT contender_pid) AS pids, count(DISTINCT contender_pid) AS n,"
            " min(contender_pid) AS contender_pid, group_concat(DISTINCT contended_cpu) AS cpus,"
            " sum(reason = 'preempted') AS preemptions, sum(reason != 'preempted') AS delayed_wakeups,"
            " sum(runq_dur) AS dur, min(ts) AS first_ts FROM step_offcpu WHERE step_mark_id = ? AND runq_dur > 0"
            " AND contender_name IS NOT NULL GROUP BY contender_name ORDER BY dur DESC", (sid,))
        out.append({"dur_ns": sum(r["dur_ns"] for r in waits), "excess_dur_ns": sum(r["excess_dur_ns"] for r in waits),
                    "detail": None, "kind": "cpu_contention", "contender": contenders[0] if contenders else None,
                    "contenders": contenders})
    for r in rows:
        cause, detail = r["cause"], r["detail"]
        base = {"dur_ns": r["dur_ns"], "excess_dur_ns": r["excess_dur_ns"], "detail": detail}
        if cause == "cpu_wait":
            continue
        elif cause == "blocked" and detail == "net":
            retrans = store.query(
                "SELECT device AS peer, count(*) AS n, min(ts) AS first_ts, max(detail) AS connection"
                " FROM step_machine_event WHERE step_mark_id = ? AND kind = 'tcp_retransmit'"
                " GROUP BY device ORDER BY n DESC", (sid,))
            wait = store.one("SELECT * FROM step_offcpu WHERE step_mark_id = ? AND reason = 'net'"
                             " ORDER BY blocked_dur DESC LIMIT 1", (sid,))
            out.append({**base, "kind": "tcp_retransmit" if retrans else "network_wait", "retransmits": retrans,
                        "wait": wait})
        elif cause == "blocked" and detail not in reasons:
            wait = store.one("SELECT * FROM step_offcpu WHERE step_mark_id = ? AND reason = ?"
                             " ORDER BY blocked_dur DESC LIMIT 1", (sid, detail))
            out.append({**base, "kind": "blocked", "reason": detail, "wait": wait})
        elif cause == "reclaim":
            kills = store.query("SELECT * FROM step_machine_event WHERE step_mark_id = ? AND kind = 'oom_kill'"
                                " ORDER BY ts", (sid,))
            wait = store.one("SELECT * FROM step_offcpu WHERE step_mark_id = ? AND python_stack_id IS NOT NULL"
                             " AND ts >= (SELECT min(ts) FROM step_reclaim WHERE step_mark_id = ?)"
                             " ORDER BY ts LIMIT 1", (sid, sid))
            out.append({**base, "kind": "memory_reclaim", "scope": detail, "oom_kills": kills, "wait": wait})
        elif cause == "dirty_throttle":
            out.append({**base, "kind": "dirty_throttle", "bdi": detail})
        elif cause == "cuda_call":
            call = store.one("SELECT * FROM step_cuda_call WHERE step_mark_id = ? AND api = ?"
                             " ORDER BY oncpu_excess_dur DESC LIMIT 1", (sid, detail))
            xids = store.query("SELECT * FROM step_machine_event WHERE step_mark_id = ?"
                               " AND kind IN ('gpu_xid') ORDER BY ts", (sid,))
            out.append({**base, "kind": "gpu_xid" if xids else "slow_cuda_call", "call": call, "xids": xids})
        elif cause == "nccl_wait":
            straggling = " waiting for rank " in (detail or "")
            wait = store.one(
                "SELECT * FROM step_nccl_wait WHERE step_mark_id = ? ORDER BY wait_dur DESC LIMIT 1", (sid,))
            out.append({**base, "kind": "nccl_straggler" if straggling else "nccl_wait", "wait": wait})
    merged: dict[str, dict] = {}
    for c in out:  # one candidate per kind: the largest (cpu_wait rows are per contender)
        have = merged.get(c["kind"])
        if have is None or c["excess_dur_ns"] > have["excess_dur_ns"]:
            merged[c["kind"]] = c
    return sorted(merged.values(), key=lambda c: -c["excess_dur_ns"])


def primary(cands: list[dict], stall_excess: int) -> dict | None:
    """The root cause: among candidates explaining at least half of the largest excess, the most
    specific; None when nothing recorded explains a fifth of the stall."""
    if not cands or cands[0]["excess_dur_ns"] < EXPLAINED_SHARE * max(stall_excess, 1):
        return None
    top = cands[0]["excess_dur_ns"]
    close = [c for c in cands if c["excess_dur_ns"] >= SPECIFIC_SHARE * top]
    return max(close, key=lambda c: (SPECIFICITY[c["kind"]], c["excess_dur_ns"]))


# -- context of the evidence ------------------------------------------------------------------------
def evidence_stack(cand: dict) -> int | None:
    """The Python stack the evidence rows carry, if any."""
    for key in ("request", "wait", "call"):
        row = cand.get(key)
        if row and row.get("python_stack_id"):
            return row["python_stack_id"]
    for row in cand.get("requests") or []:
        if row.get("python_stack_id"):
            return row["python_stack_id"]
    return None


def evidence_ts(cand: dict, step: dict) -> int:
    for key in ("request", "wait", "call"):
        row = cand.get(key)
        if row and row.get("ts"):
            return row["ts"]
    contender = cand.get("contender")
    if contender and contender.get("first_ts"):
        return contender["first_ts"]
    return step["ts"]


def nearest_stack(store: Store, thread_id: int, ts: int, since: int) -> int | None:
    """The Python stack of the thread's latest event with one at or before ts (within the step)."""
    best = None
    for table in ("cuda_call", "offcpu_interval", "block_request", "nccl_call"):
        row = store.one(f"SELECT ts, python_stack_id FROM {table} WHERE thread_id = ? AND ts <= ? AND ts >= ?"
                        " AND python_stack_id IS NOT NULL ORDER BY ts DESC LIMIT 1", (thread_id, ts, since))
        if row and (best is None or row["ts"] > best["ts"]):
            best = row
    return best["python_stack_id"] if best else None


def python_site(store: Store, stack_id: int | None) -> tuple[str | None, list[str]]:
    if stack_id is None:
        return None, []
    site = store.one("SELECT text FROM python_call_site WHERE stack_id = ?", (stack_id,))
    frames = [r["text"] for r in store.query("SELECT text FROM python_frame WHERE stack_id = ? ORDER BY depth",
                                             (stack_id,))]
    return (site["text"] if site else None), frames


def lineage_at(store: Store, session_id: int, thread_id: int, ts: int, io_tag: int | None) -> dict | None:
    """The lineage tag current on the thread at ts (or the request's own tag) with its label."""
    tag = io_tag
    if not tag:
        row = store.one("SELECT tag FROM lineage_mark WHERE thread_id = ? AND ts <= ? ORDER BY ts DESC LIMIT 1",
                        (thread_id, ts))
        tag = row["tag"] if row else None
    if not tag:
        return None
    label = store.one("SELECT label FROM lineage_label WHERE session_id = ? AND tag = ?", (session_id, tag))
    ckpt = store.one("SELECT path, phase FROM checkpoint_mark WHERE thread_id = ? AND ts <= ? ORDER BY ts DESC LIMIT 1",
                     (thread_id, ts))
    return {"tag": tag, "tag_hex": f"0x{tag & (2**64 - 1):016x}", "label": label["label"] if label else None,
            "checkpoint": ckpt["path"] if ckpt and ckpt["phase"] == 1 else None}


# -- steps against their rolling baseline -------------------------------------------------------------
# The same rule as the step_baseline view (store/views/0008_causes.sql), computed here so that a
# report does not evaluate the view's per-row subqueries once per column: the view is what the
# sqlite3 shell uses, and tests/test_explain_golden.py checks that both give the same rows.
STALL_RATIO = 1.5
STALL_MIN_EXCESS = 1_000_000


def _with_baseline(step: dict, neighbours: list[int]) -> dict:
    ordered = sorted(neighbours)
    base = ordered[(len(ordered) + 1) // 2 - 1] if ordered else None
    out = dict(step)
    out.update(baseline_dur=base, baseline_steps=len(ordered))
    if base is None:
        out.update(excess_dur=None, ratio=None, slow=0)
        return out
    out.update(excess_dur=step["dur"] - base, ratio=round(step["dur"] / max(base, 1), 2),
               slow=int(len(ordered) >= 3 and step["dur"] >= STALL_RATIO * base
                        and step["dur"] - base >= STALL_MIN_EXCESS and bool(step["complete"] or step["running"])))
    return out


def lookup_steps(store: Store, session_id: int, number: int) -> list[dict]:
    """Every thread's step `number` with its baseline, through the indexes (a few ms)."""
    out = [_lookup(store, st)
           for st in store.query("SELECT * FROM step WHERE session_id = ? AND step = ?", (session_id, number))]
    return sorted(out, key=lambda r: -(r["excess_dur"] or 0))


def _lookup(store: Store, st: dict) -> dict:
    """One step row of the step view with its baseline, from the marks around it."""
    before = [r[0] for r in store.conn.execute(
        "SELECT ts FROM step_mark WHERE thread_id = ? AND ts <= ? ORDER BY ts DESC LIMIT ?",
        (st["thread_id"], st["ts"], NEIGHBOURS + 1))]
    after = [r[0] for r in store.conn.execute(
        "SELECT ts FROM step_mark WHERE thread_id = ? AND ts > ? ORDER BY ts LIMIT ?",
        (st["thread_id"], st["ts"], NEIGHBOURS + 1))]
    durs = [before[i] - before[i + 1] for i in range(len(before) - 1)]  # the steps before, newest first
    durs += [after[i + 1] - after[i] for i in range(len(after) - 1)]  # the complete steps after
    return _with_baseline(st, durs)


def all_steps(store: Store, session_id: int) -> list[dict]:
    """Every step of the session with its baseline, in one pass."""
    rows = store.query("SELECT * FROM step_all WHERE session_id = ? ORDER BY thread_id, ts", (session_id,))
    out: list[dict] = []
    start = 0
    while start < len(rows):
        end = start
        while end < len(rows) and rows[end]["thread_id"] == rows[start]["thread_id"]:
            end += 1
        thread = rows[start:end]
        for i, st in enumerate(thread):
            before = [r["dur"] for r in thread[max(0, i - NEIGHBOURS):i]]
            after = [r["dur"] for r in thread[i + 1:i + 1 + NEIGHBOURS] if r["complete"]]
            out.append(_with_baseline(st, before + after))
        start = end
    return out


def find_stalls(store: Store, session_id: int, start: int, end: int) -> list[dict]:
    """The stalled steps whose start lies in [start, end), worst first. A step can only be slow if
    it is 1.5x the shortest of its neighbours (the median is never below the minimum), so only those
    steps, and each thread's last step, get their median computed."""
    threads = [r[0] for r in store.conn.execute(
        "SELECT t.id FROM thread t WHERE t.session_id = ?"
        " AND EXISTS (SELECT 1 FROM step_mark m WHERE m.thread_id = t.id)", (session_id,))]
    candidates = []  # (thread_id, ts) of steps that may be stalls
    for thread_id in threads:
        tss = [r[0] for r in store.conn.execute(  # the covering (thread_id, ts) index, nothing else
            "SELECT ts FROM step_mark WHERE thread_id = ? ORDER BY ts", (thread_id,))]
        durs = [b - a for a, b in zip(tss, tss[1:], strict=False)]  # complete steps; the last has no end yet
        for i, ts in enumerate(tss):
            if not start <= ts < end:
                continue
            if i == len(durs):  # the thread's last step
                candidates.append((thread_id, ts))
                continue
            near = durs[max(0, i - NEIGHBOURS):i] + durs[i + 1:i + 1 + NEIGHBOURS]
            if near:
                lo = min(near)
                if durs[i] >= STALL_RATIO * lo and durs[i] - lo >= STALL_MIN_EXCESS:
                    candidates.append((thread_id, ts))
    out = []
    for key in candidates:
        for st in store.query("SELECT * FROM step WHERE thread_id = ? AND ts = ?", key):
            row = _lookup(store, st)
            if row["slow"]:
                out.append(row)
    return sorted(out, key=lambda r: -r["excess_dur"])
