"""Why a step was slow: the step's breakdown by cause against its neighbours, and the evidence.

The numbers come from the views in store/views/0008_causes.sql (step_cause and the step_* link
views) and the rules from the tables of store/migrations/0010_rules.sql (store/db/rules.py); this
module decides which cause made the step slow and gathers what a report says about it. A cause's
share of a stall is its time in the step minus its median time in the neighbouring steps (the
same 20 steps the step's baseline is taken over): 300 ms asleep in a synchronisation
that every step has is not a cause, 3 s blocked on I/O that no other step has is.
"""

from __future__ import annotations

from statistics import median

from store.analysis import kinds
from store.db import Store
from store.db.rules import CauseRule, StallRule, stall_rule


def neighbour_ids(store: Store, step: dict) -> list[int]:
    """The steps the step's baseline is taken over (stall_rule.neighbours on each side)."""
    n = stall_rule(store).neighbours
    before = store.query("SELECT step_mark_id FROM step WHERE thread_id = ? AND ts < ? ORDER BY ts DESC LIMIT ?",
                         (step["thread_id"], step["ts"], n))
    after = store.query("SELECT step_mark_id FROM step WHERE thread_id = ? AND ts > ? AND complete"
                        " ORDER BY ts LIMIT ?", (step["thread_id"], step["ts"], n))
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
def candidates(store: Store, step: dict, rows: list[dict]) -> list[dict]:
    """One candidate cause per kind, with the excess it explains and its evidence rows: the cause
    families' rules (store/analysis/kinds/), the largest of each kind, the largest excess first."""
    merged: dict[str, dict] = {}
    for c in kinds.candidates(store, step, rows):  # one candidate per kind: the largest
        have = merged.get(c["kind"])
        if have is None or c["excess_dur_ns"] > have["excess_dur_ns"]:
            merged[c["kind"]] = c
    return sorted(merged.values(), key=lambda c: -c["excess_dur_ns"])


def primary(cands: list[dict], stall_excess: int, rule: CauseRule) -> dict | None:
    """The root cause: among candidates explaining at least rule.specific_share (half) of the
    largest excess, the most specific; None when nothing recorded explains rule.explained_share (a
    fifth) of the stall."""
    if not cands or cands[0]["excess_dur_ns"] < rule.explained_share * max(stall_excess, 1):
        return None
    top = cands[0]["excess_dur_ns"]
    close = [c for c in cands if c["excess_dur_ns"] >= rule.specific_share * top]
    return max(close, key=lambda c: (rule.specificity[c["kind"]], c["excess_dur_ns"]))


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


LINES_LISTED = 5
LINE_SHARE_LISTED = 0.01  # lines with less of the cause's time are left out of the list


def lost_lines(store: Store, step: dict, cand: dict) -> list[dict]:
    """The Python lines where the cause's time in the step went, most time first (step_lost_line):
    [{'python', 'dur_ns', 'intervals', 'how', 'python_stack_id'}]."""
    own = kinds.KINDS[cand["kind"]].lost_time  # the step_lost_line rows of the kind's own time
    if own is None:  # else those of the candidate's wait, if it has one (a call or a collective has none)
        if cand.get("reason") is None:
            return []
        own = ("blocked", (cand["reason"],))
    cause, details = own
    sql = "SELECT * FROM step_lost_line WHERE step_mark_id = ? AND cause = ?"
    args: list = [step["step_mark_id"], cause]
    if details:
        sql += f" AND detail IN ({','.join('?' * len(details))})"
        args += details
    rows = store.query(sql + " ORDER BY dur DESC", args)
    merged: dict[str | None, dict] = {}
    for r in rows:  # one row per line across the details (io and uninterruptible)
        have = merged.setdefault(r["python_line"], {"python": r["python_line"], "dur_ns": 0, "intervals": 0,
                                                    "how": r["how"], "python_stack_id": r["python_stack_id"]})
        have["dur_ns"] += r["dur"]
        have["intervals"] += r["intervals"]
    return sorted(merged.values(), key=lambda r: (r["python"] is None, -r["dur_ns"]))


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
# Which steps are stalls is the views' decision (step_baseline_lookup, with stall_rule's thresholds):
# the two functions a report uses read it from there. all_steps, for listings of a whole session,
# computes the same rows in one pass over the marks (the step_baseline view sorts a window per row,
# ~7x slower); tests/test_rules.py checks that it gives the view's rows, also under a changed rule.


def lookup_steps(store: Store, session_id: int, number: int) -> list[dict]:
    """Every thread's step `number` with its baseline (step_baseline_lookup, through the indexes)."""
    out = store.query("SELECT * FROM step_baseline_lookup WHERE session_id = ? AND step = ?", (session_id, number))
    return sorted(out, key=lambda r: -(r["excess_dur"] or 0))


def all_steps(store: Store, session_id: int) -> list[dict]:
    """Every step of the session with its baseline, in one pass: the rows of step_baseline."""
    rule = stall_rule(store)
    n = rule.neighbours
    rows = store.query("SELECT * FROM step_all WHERE session_id = ? ORDER BY thread_id, ts", (session_id,))
    out: list[dict] = []
    start = 0
    while start < len(rows):
        end = start
        while end < len(rows) and rows[end]["thread_id"] == rows[start]["thread_id"]:
            end += 1
        thread = rows[start:end]
        for i, st in enumerate(thread):
            before = [r["dur"] for r in thread[max(0, i - n):i]]
            after = [r["dur"] for r in thread[i + 1:i + 1 + n] if r["complete"]]
            out.append(_with_baseline(st, before + after, rule))
        start = end
    return out


def _with_baseline(step: dict, neighbours: list[int], rule: StallRule) -> dict:
    ordered = sorted(neighbours)
    base = ordered[(len(ordered) + 1) // 2 - 1] if ordered else None  # the lower middle, as the view
    out = dict(step)
    out.update(baseline_dur=base, baseline_steps=len(ordered))
    if base is None:
        out.update(excess_dur=None, ratio=None, slow=0)
        return out
    out.update(excess_dur=step["dur"] - base, ratio=round(step["dur"] / max(base, 1), 2),
               slow=int(len(ordered) >= rule.min_baseline_steps and step["dur"] >= rule.ratio * base
                        and step["dur"] - base >= rule.min_excess_dur and bool(step["complete"] or step["running"])))
    return out


def find_stalls(store: Store, session_id: int, start: int, end: int) -> list[dict]:
    """The stalled steps whose start lies in [start, end), worst first: the rows of the stall view.
    Only steps at least stall_rule.ratio x the shortest of their neighbours (the median is never
    below the minimum), and each thread's last step, are looked up in step_baseline_lookup, which
    decides; the marks are read once through the covering (thread_id, ts) index (at 20,000 steps
    ~60 ms, the stall view's window over every step ~1 s)."""
    rule = stall_rule(store)
    n = rule.neighbours
    threads = [r[0] for r in store.conn.execute(
        "SELECT t.id FROM thread t WHERE t.session_id = ?"
        " AND EXISTS (SELECT 1 FROM step_mark m WHERE m.thread_id = t.id)", (session_id,))]
    candidates = []  # step_mark ids of steps that may be stalls
    for thread_id in threads:
        marks = store.conn.execute("SELECT ts, id FROM step_mark WHERE thread_id = ? ORDER BY ts",
                                   (thread_id,)).fetchall()
        tss = [ts for ts, _ in marks]
        durs = [b - a for a, b in zip(tss, tss[1:], strict=False)]  # complete steps; the last has no end yet
        for i, (ts, mark_id) in enumerate(marks):
            if not start <= ts < end:
                continue
            if i == len(durs):  # the thread's last step
                candidates.append(mark_id)
                continue
            near = durs[max(0, i - n):i] + durs[i + 1:i + 1 + n]
            if near:
                lo = min(near)
                if durs[i] >= rule.ratio * lo and durs[i] - lo >= rule.min_excess_dur:
                    candidates.append(mark_id)
    out = []
    for i in range(0, len(candidates), 500):  # a list of ids reaches the view's indexed lookups
        ids = candidates[i:i + 500]
        out += store.query(f"SELECT * FROM step_baseline_lookup WHERE step_mark_id IN ({','.join('?' * len(ids))})"
                           " AND slow", ids)
    return sorted(out, key=lambda r: -r["excess_dur"])
