"""`recorder cluster explain` over imported profiler traces (one per rank, `recorder import`): with no
NCCL calls recorded, the ranks are lined up on the device's own collective kernels. In a step, the
n-th collective kernel of every rank is the same operation (NCCL runs a communicator's collectives
in order); it cannot finish before every rank's has started, so the rank whose collective kernels
started last is the one the others waited for, and their kernels ran long waiting for it.

Clocks: a trace's times are Unix time (Kineto's baseTimeNanoseconds + ts), each from its host's
realtime clock; lateness below LATE_MIN_NS is not attributed to anyone.
"""

from __future__ import annotations

from pathlib import Path

from store.db import open_store
from store.errors import UserError
from store.report.build import explain as explain_one
from store.units import ms, utc

LATE_MIN_NS = 1_000_000  # a rank is late from 1 ms after the first rank's collective kernel started
COLLECTIVE_KERNEL = ("nccl", "rccl")  # kernel names of NCCL (CUDA) and RCCL (ROCm)


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in COLLECTIVE_KERNEL)


def applies(dbs: list[Path]) -> bool:
    """Whether these recordings are imported profiler traces with device activity and no NCCL calls."""
    if not dbs:
        return False
    for db in dbs:
        try:
            with open_store(db, readonly=True) as store:
                traced = store.one("SELECT 1 AS x FROM trace_import WHERE format = 'chrome_trace' LIMIT 1")
                calls = store.one("SELECT 1 AS x FROM nccl_call LIMIT 1")
        except UserError:
            return False
        if traced is None or calls is not None:
            return False
    return True


def flight_dumps_only(dbs: list[Path]) -> bool:
    """Whether these databases hold imported Flight Recorder dumps and nothing else."""
    if not dbs:
        return False
    for db in dbs:
        try:
            with open_store(db, readonly=True) as store:
                kinds = {r["format"] for r in store.query("SELECT DISTINCT format FROM trace_import")}
                others = store.row("SELECT count(*) AS n FROM session WHERE id NOT IN"
                                   " (SELECT session_id FROM trace_import)")["n"]
        except UserError:
            return False
        if kinds != {"flight_recorder"} or others:
            return False
    return True


def explain_dumps(dbs: list[Path]) -> dict:
    """The Flight Recorder hang across the ranks' dumps (store/analysis/flight_dumps.py), which are
    read together from one database."""
    if len(dbs) > 1:
        raise UserError("the Flight Recorder dumps are in several databases: import every rank's dump into one "
                        "(recorder import nccl_trace_rank_* --db hang.db) and explain that")
    with open_store(dbs[0], readonly=True) as store:
        report = explain_one(store, None)
    hang = report.get("hang")
    return {"mode": "flight_recorder", "db": str(dbs[0]), "verdict": "hang" if hang else "no_hang",
            "summary": hang["summary"] if hang else "every collective in the dumps completed",
            "collectives": hang["collectives"] if hang else []}


def render_dumps(r: dict) -> str:
    lines = [f"Cluster report (Flight Recorder dumps in {r['db']})", r["summary"]]
    lines += [f"  {c['text']}" for c in r["collectives"]]
    return "\n".join(lines)


def _ranks(dbs: list[Path]) -> list[dict]:
    out = []
    for db in dbs:
        with open_store(db, readonly=True) as store:
            for r in store.query(
                    "SELECT i.session_id, i.rank, i.path, s.wall_offset_ns FROM trace_import i"
                    " JOIN session s ON s.id = i.session_id WHERE i.format = 'chrome_trace' ORDER BY i.session_id"):
                out.append({"db": str(db), "session_id": r["session_id"], "rank": r["rank"], "trace": r["path"],
                            "wall_offset_ns": r["wall_offset_ns"]})
    for i, r in enumerate(out):
        if r["rank"] is None:
            r["rank"] = i  # a trace without distributedInfo: numbered in the order given
    return out


def _collectives(db: str, sid: int, step: int) -> tuple[dict | None, list[dict]]:
    with open_store(db, readonly=True) as store:
        st = store.one("SELECT ts, end_ts, thread_id FROM step WHERE session_id = ? AND step = ? ORDER BY ts LIMIT 1",
                       (sid, step))
        if st is None:
            return None, []
        rows = store.query(
            "SELECT d.ts, d.dur, s.value AS name FROM device_activity d JOIN string s ON s.id = d.name_id"
            " WHERE d.session_id = ? AND d.kind = 'kernel' AND d.ts >= ? AND d.ts < ? ORDER BY d.ts",
            (sid, st["ts"], st["end_ts"]))
    return st, [r for r in rows if _is_collective(r["name"])]


def _steps(ranks: list[dict]) -> list[int]:
    common: set[int] | None = None
    for r in ranks:
        with open_store(r["db"], readonly=True) as store:
            have = {x["step"] for x in store.query("SELECT DISTINCT step FROM step_mark WHERE session_id = ?",
                                                   (r["session_id"],))}
        common = have if common is None else common & have
    return sorted(common or ())


def _step_view(ranks: list[dict], step: int) -> dict:
    per_rank = []
    for r in ranks:
        st, colls = _collectives(r["db"], r["session_id"], step)
        if st is None:
            continue
        off = r["wall_offset_ns"]
        per_rank.append({**r, "step_ts": st["ts"] + off, "step_dur_ns": st["end_ts"] - st["ts"],
                         "kernels": [(c["ts"] + off, c["dur"], c["name"]) for c in colls]})
    with_kernels = [p for p in per_rank if p["kernels"]]
    if len(with_kernels) < 2:
        return {"step": step, "ranks": per_rank, "paired": 0, "lateness": {}}
    paired = min(len(p["kernels"]) for p in with_kernels)
    lateness: dict[int, int] = {p["rank"]: 0 for p in with_kernels}
    for k in range(paired):
        first = min(p["kernels"][k][0] for p in with_kernels)
        for p in with_kernels:
            lateness[p["rank"]] += p["kernels"][k][0] - first
    return {"step": step, "ranks": per_rank, "paired": paired, "lateness": lateness}


def explain(dbs: list[Path], step: int | None = None) -> dict:
    """The rank whose collective kernels started last in `step` (default: the step where the latest
    rank was latest), with what its own trace says of the step."""
    ranks = _ranks(dbs)
    if len(ranks) < 2:
        raise UserError("cluster explain needs the traces of at least two ranks: import one per rank "
                        "(recorder import rank*.json.gz --db job.db)")
    steps = _steps(ranks)
    if not steps:
        raise UserError("the traces share no ProfilerStep#N: profile the same steps on every rank")
    if step is not None and step not in steps:
        raise UserError(f"step {step} is not in every rank's trace: the steps they share run {steps[0]}..{steps[-1]}")
    views = [_step_view(ranks, s) for s in ([step] if step is not None else steps)]
    view = max(views, key=lambda v: max(v["lateness"].values(), default=0))
    first_starts = {p["rank"]: p["kernels"][0][0] for p in view["ranks"] if p["kernels"]}
    earliest = min(first_starts.values(), default=None)
    rows = []
    for p in sorted(view["ranks"], key=lambda p: p["rank"]):
        coll = p["kernels"]
        rows.append({"rank": p["rank"], "db": p["db"], "session_id": p["session_id"], "trace": p["trace"],
                     "step_dur_ns": p["step_dur_ns"], "collective_kernels": len(coll),
                     "first_collective_utc": utc(coll[0][0]) if coll else None,
                     "first_collective_late_ns": coll[0][0] - earliest if coll and earliest is not None else None,
                     "lateness_ns": view["lateness"].get(p["rank"]),
                     "collective_dur_ns": sum(c[1] for c in coll)})
    late = max(view["lateness"].items(), key=lambda kv: kv[1], default=None)
    verdict = "late_rank" if late is not None and late[1] >= LATE_MIN_NS * max(view["paired"], 1) else "no_late_rank"
    if not view["paired"]:
        verdict = "no_collectives"
    out: dict = {"mode": "device", "step": view["step"], "verdict": verdict, "ranks": rows,
                 "collectives_paired": view["paired"], "late_rank": None, "explanation": None,
                 "notes": ["ranks lined up on their collective kernels (imported profiler traces, no NCCL calls "
                           "recorded); times are each host's realtime clock"]}
    if verdict == "late_rank" and late is not None:
        r = next(x for x in rows if x["rank"] == late[0])
        others = [x for x in rows if x["rank"] != late[0] and x["collective_kernels"]]
        out["late_rank"] = {"rank": late[0], "db": r["db"], "session_id": r["session_id"],
                            "mean_lateness_ns": late[1] // max(view["paired"], 1),
                            "first_collective_late_ns": r["first_collective_late_ns"],
                            "others_collective_dur_ns": round(sum(x["collective_dur_ns"] for x in others)
                                                              / max(len(others), 1))}
        with open_store(r["db"], readonly=True) as store:
            report = explain_one(store, r["session_id"], step=view["step"])
        out["explanation"] = {"symptom": report["symptom"], "gpu": report.get("gpu")}
    return out


def steps(dbs: list[Path], limit: int = 0) -> dict:
    """Every step the ranks' traces share: its median duration across ranks and the rank whose
    collective kernels started latest, by how much on average."""
    ranks = _ranks(dbs)
    shared = _steps(ranks)
    shared = shared[:limit] if limit else shared
    out = []
    for s in shared:
        view = _step_view(ranks, s)
        durs = sorted(p["step_dur_ns"] for p in view["ranks"])
        late = max(view["lateness"].items(), key=lambda kv: kv[1], default=None)
        mean = late[1] // max(view["paired"], 1) if late else None
        named = late is not None and mean is not None and mean >= LATE_MIN_NS
        out.append({"step": s, "ranks": len(view["ranks"]), "dur_ns": durs[(len(durs) - 1) // 2] if durs else None,
                    "collectives_paired": view["paired"], "late_rank": late[0] if named and late else None,
                    "mean_lateness_ns": mean if named else None})
    return {"mode": "device", "steps": out, "count": len(out)}


def render_steps(r: dict) -> str:
    lines = [f"{'STEP':>8} {'RANKS':>6} {'DUR':>9} {'COLL.':>6} {'LATE RANK':>10} {'MEAN LATE':>10}"]
    for s in r["steps"]:
        lines.append(f"{s['step']:>8} {s['ranks']:>6} {ms(s['dur_ns']):>9} {s['collectives_paired']:>6} "
                     f"{'' if s['late_rank'] is None else s['late_rank']:>10} {ms(s['mean_lateness_ns']):>10}")
    lines.append(f"{r['count']} steps (imported profiler traces: ranks lined up on their collective kernels; a late "
                 f"rank is named from {ms(LATE_MIN_NS)} of mean lateness)")
    return "\n".join(lines)


def render(r: dict) -> str:
    lines = [f"Cluster report (profiler traces): step {r['step']}, {len(r['ranks'])} ranks, "
             f"{r['collectives_paired']} collective kernels lined up per rank"]
    late = r["late_rank"]
    if r["verdict"] == "no_collectives":
        lines.append("No collective kernels (NCCL/RCCL) in the step on two ranks or more: nothing to line up")
    elif late is None:
        lines.append(f"No late rank: every rank's collective kernels started within {ms(LATE_MIN_NS)} of the first")
    else:
        lines.append(f"Late rank: {late['rank']} (session {late['session_id']} of {late['db']}): its collective "
                     f"kernels started {ms(late['mean_lateness_ns'])} after the first rank's on average (the first "
                     f"one {ms(late['first_collective_late_ns'])} late); the other ranks' collective kernels ran "
                     f"{ms(late['others_collective_dur_ns'])} in the step, which holds their wait for it")
        if r["explanation"]:
            lines.append(f"Why rank {late['rank']} was late: {r['explanation']['symptom']}")
    lines.append(f"{'RANK':>6} {'FIRST COLLECTIVE (UTC)':26} {'LATE':>9} {'MEAN LATE':>10} {'IN COLL.':>9} {'STEP':>9}")
    for x in r["ranks"]:
        mean = x["lateness_ns"] // max(r["collectives_paired"], 1) if x["lateness_ns"] is not None else None
        lines.append(f"{x['rank']:>6} {x['first_collective_utc'] or '-':26} {ms(x['first_collective_late_ns']):>9} "
                     f"{ms(mean):>10} {ms(x['collective_dur_ns']):>9} {ms(x['step_dur_ns']):>9}")
    lines += [f"Note: {n}" for n in r["notes"]]
    return "\n".join(lines)
