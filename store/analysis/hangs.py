"""Hangs: the CUDA and NCCL calls that had not returned when the session stopped (or the recording
was dumped), stored with open = 1 (store/migrations/0013_open_calls_user_code.sql). For a stuck job the report
says which rank and thread is inside which call since when and at which Python line, and for each
collective still in flight which ranks of its communicator are inside it and which never entered it
(and what those are doing instead, when they are recorded here).
"""

from __future__ import annotations

from store.db import Store
from store.units import ms, utc

_OPEN = """
SELECT 'nccl' AS layer, a.name AS api, a.kind, c.id, c.ts, c.dur, c.python_stack_id,
       t.tid, t.name AS thread_name, p.pid, p.name AS process_name, p.id AS process_id,
       k.rank, k.nranks, k.comm_hash
FROM nccl_call c JOIN nccl_api a ON a.id = c.api_id JOIN thread t ON t.id = c.thread_id
LEFT JOIN process p ON p.id = t.process_id
LEFT JOIN nccl_comm k ON k.process_id = t.process_id
     AND (k.handle = c.handle OR (c.handle IS NULL AND k.handle = 0 AND k.init_ts = c.ts)) -- an init in flight
WHERE c.session_id = ? AND c.open = 1
UNION ALL
SELECT 'cuda', a.name, a.family, c.id, c.ts, c.dur, c.python_stack_id,
       t.tid, t.name, p.pid, p.name, p.id,
       (SELECT min(rank) FROM nccl_comm k WHERE k.process_id = t.process_id), NULL, NULL
FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id JOIN thread t ON t.id = c.thread_id
LEFT JOIN process p ON p.id = t.process_id
WHERE c.session_id = ? AND c.open = 1
ORDER BY ts
"""


def _python(store: Store, stack_id: int | None) -> tuple[str | None, list[str]]:
    if stack_id is None:
        return None, []
    site = store.one("SELECT text FROM python_call_site WHERE stack_id = ?", (stack_id,))
    frames = [r["text"] for r in store.query(
        "SELECT text FROM python_frame WHERE stack_id = ? ORDER BY depth", (stack_id,))]
    return (site["text"] if site else None), frames


def _who(call: dict) -> str:
    rank = f"rank {call['rank']} " if call["rank"] is not None else ""
    return (f"{rank}(pid {call['pid']}, thread {call['thread_name']} tid {call['tid']})" if rank
            else f"{call['process_name']} (pid {call['pid']}, thread {call['thread_name']} tid {call['tid']})")


def _not_inside(store: Store, process_id: int | None, off: int) -> str:
    """What a rank not inside the collective (or init) was doing, when it has no call in flight."""
    if process_id is None:
        return ("no process recorded here entered it as this rank (not started, stuck before it, or on another "
                "host: that host's recording has its side)")
    gone = store.one("SELECT exit_ts FROM process WHERE id = ?", (process_id,))
    if gone and gone["exit_ts"] is not None:
        return f"its process exited at {utc(gone['exit_ts'] + off)} without entering it"
    return "no call in flight: it never called the collective"


def hang_facts(store: Store, session: dict) -> dict | None:
    """The hang part of a report (store/models.py Hang), None when every call returned."""
    sid, off = session["id"], session["wall_offset_ns"]
    rows = store.query(_OPEN, (sid, sid))
    if not rows:
        return None
    stopped = session["stopped_ts"]
    calls = []
    for r in rows:
        python, stack = _python(store, r["python_stack_id"])
        calls.append({
            "layer": r["layer"], "api": r["api"], "call_id": r["id"], "pid": r["pid"], "tid": r["tid"],
            "thread_name": r["thread_name"], "process_name": r["process_name"], "rank": r["rank"],
            "comm_hash": r["comm_hash"], "since_ts": r["ts"], "since_utc": utc(r["ts"] + off),
            "open_dur_ns": (stopped or r["ts"] + r["dur"]) - r["ts"], "python": python, "python_stack": stack,
            "_kind": r["kind"], "_nranks": r["nranks"], "_process_id": r["process_id"],
        })
    for c in calls:
        c["text"] = (f"{_who(c)} inside {c['api']} since {c['since_utc']} ({ms(c['open_dur_ns'])} before the stop)"
                     + (f", at {c['python']}" if c["python"] else ""))
    collectives = []
    # collectives and communicator inits: every rank must enter them before any returns
    joint = ("collective", "init")
    for comm in sorted({c["comm_hash"] for c in calls if c["_kind"] in joint and c["comm_hash"] is not None}):
        inside = [c for c in calls if c["comm_hash"] == comm and c["_kind"] in joint]
        nranks = inside[0]["_nranks"]
        recorded = {r["rank"]: r["process_id"] for r in store.query(
            "SELECT rank, process_id FROM nccl_comm WHERE session_id = ? AND comm_hash = ?", (sid, comm))}
        inside_ranks = sorted({c["rank"] for c in inside})
        missing = []
        for rank in range(nranks or 0):
            if rank in inside_ranks:
                continue
            elsewhere = [c for c in calls if c["_process_id"] == recorded.get(rank)] if rank in recorded else []
            missing.append({
                "rank": rank, "recorded": rank in recorded,
                "doing": (f"inside {elsewhere[0]['api']} since {elsewhere[0]['since_utc']}"
                          + (f", at {elsewhere[0]['python']}" if elsewhere[0]["python"] else "")) if elsewhere
                else _not_inside(store, recorded.get(rank), off),
            })
        apis = sorted({c["api"] for c in inside})
        collectives.append({
            "api": "/".join(apis), "comm_hash": comm, "nranks": nranks, "inside_ranks": inside_ranks,
            "missing_ranks": [m["rank"] for m in missing], "missing": missing,
            "since_utc": min(c["since_utc"] for c in inside),
            "text": (f"{'/'.join(apis)} (communicator {comm & 0xFFFFFFFFFFFFFFFF:016x}, {nranks} ranks): "
                     f"ranks inside it: {', '.join(map(str, inside_ranks))}; ranks not inside it: "
                     + ("; ".join(f"{m['rank']} ({m['doing']})" for m in missing) if missing else "none")),
        })
    for c in calls:
        for k in [k for k in c if k.startswith("_")]:
            del c[k]
    n = len(calls)
    summary = f"{n} call{'s' if n != 1 else ''} had not returned when the session stopped"
    if stopped is None:
        summary = f"{n} call{'s' if n != 1 else ''} had not returned when the recording was read"
    return {"summary": summary, "open_calls": calls, "collectives": collectives}
