"""CUDA: the step's thread spent more time inside CUDA calls, on the CPU or blocked in the library,
than they usually take (step_cause 'cuda_call', detail: the API): slow_cuda_call, or gpu_xid when
the GPU reported an Xid error during the step. A call is judged against its own baseline, or, with
none of its own (the first cudaMalloc of the session, a cudaDeviceSynchronize at a checkpoint), by
its step: its whole time against the API's time in the neighbouring steps (view step_cuda_call)."""

from __future__ import annotations

from store.analysis.kinds.family import Facts, Family, Kind, RuleContext, row_base
from store.db import Store
from store.units import ms


def candidate(ctx: RuleContext, row: dict) -> dict | None:
    if row["cause"] != "cuda_call":
        return None
    sid = ctx.step["step_mark_id"]
    call = ctx.store.one("SELECT * FROM step_cuda_call WHERE step_mark_id = ? AND api = ?"
                         " ORDER BY own_excess_dur DESC LIMIT 1", (sid, row["detail"]))
    xids = ctx.store.query("SELECT * FROM step_machine_event WHERE step_mark_id = ?"
                           " AND kind IN ('gpu_xid') ORDER BY ts", (sid,))
    return {**row_base(row), "kind": "gpu_xid" if xids else "slow_cuda_call", "call": call, "xids": xids}


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def call_ordinal(store: Store, call_id: int) -> tuple[int, bool]:
    """(its number among the session's calls of its family and size class, 1 for the first; whether
    no call of its family came before it in the session) of a call the step judges (fewer than
    slow_call_rule.min_baseline_calls calls in its class, so the first count is cheap)."""
    c = store.row("SELECT c.session_id, c.ts, c.size_class, a.family FROM cuda_call c"
                  " JOIN cuda_api a ON a.id = c.api_id WHERE c.id = ?", (call_id,))
    family = [r["id"] for r in store.query("SELECT id FROM cuda_api WHERE family = ?", (c["family"],))]
    marks = ",".join("?" * len(family))
    n = store.row(f"SELECT count(*) AS n FROM cuda_call WHERE session_id = ? AND api_id IN ({marks})"
                  " AND coalesce(size_class, -1) = ? AND (ts < ? OR (ts = ? AND id < ?))",
                  (c["session_id"], *family, c["size_class"] if c["size_class"] is not None else -1,
                   c["ts"], c["ts"], call_id))["n"]
    earlier = store.one(f"SELECT 1 AS x FROM cuda_call WHERE session_id = ? AND api_id IN ({marks}) AND ts < ?"
                        " LIMIT 1", (c["session_id"], *family, c["ts"]))
    return n + 1, earlier is None


def which_call(store: Store, call: dict) -> str:
    """'the first of the session', 'the first of that size in the session', 'the second of the
    session'; in a flight recording or an incident, whose older rows are gone, 'in the window kept'."""
    call_id = call["cuda_call_id"] if "cuda_call_id" in call else call["id"]
    n, first = call_ordinal(store, call_id)
    sid = store.row("SELECT session_id FROM cuda_call WHERE id = ?", (call_id,))["session_id"]
    windowed = (store.one("SELECT 1 AS x FROM flight_window WHERE session_id = ?", (sid,))
                or store.one("SELECT 1 AS x FROM incident WHERE session_id = ? AND own = 1", (sid,)))
    where = "in the window kept" if windowed else "of the session"
    if first:
        return f"the first {where}"
    nth = ORDINALS[n - 1] if n <= len(ORDINALS) else f"{n}th"
    if where == "of the session":
        where = "in the session"
    return f"the {nth} of that size {where}" if call.get("size_bytes") is not None else f"the {nth} {where}"


def graph_detail(store: Store, call: dict) -> str:
    """For a slow graph replay, or a synchronisation that waited for replays (cuda_sync_graph): which
    graph, and where it was instantiated."""
    call_id = call.get("cuda_call_id")
    if call_id is None:
        return ""
    if call.get("family") in ("cudaGraphLaunch", "cuGraphLaunch"):
        g = store.one("SELECT graph_exec, instantiated_at FROM cuda_graph_launch WHERE cuda_call_id = ?", (call_id,))
        replayed = []
        if g and g["graph_exec"] is not None:
            replayed = [g]
        what = "replaying"
    else:
        replayed = store.query("SELECT graph_exec, instantiated_at FROM cuda_sync_graph WHERE sync_call_id = ?"
                               " ORDER BY launched_ts", (call_id,))
        what = "waiting for"
    if not replayed:
        return ""
    graphs = {r["graph_exec"]: r["instantiated_at"] for r in replayed}
    named = "; ".join(f"graph {handle:#x}" + (f" instantiated at {at}" if at else "")
                      for handle, at in list(graphs.items())[:3])
    count = f"{len(replayed)} replays of " if len(replayed) > 1 else ""
    return f" ({what} {count}{named})"


CPU_WAIT_STATED = 0.05  # a call's share waiting for a CPU from which its summary says so


def inside(store: Store, call: dict) -> tuple[str, list[str]]:
    """Where a call's time went, in words and as a kernel path: on the CPU inside the library, or
    blocked in it (waiting for the device or the driver; the reason and system call of its longest
    such wait) when more of it was blocked than on the CPU; and the time it waited for a CPU, when
    that is a noticeable part of it (the scheduler's, a cause of its own: step_cause 'cpu_wait')."""
    dur, offcpu = call.get("dur") or 0, call.get("offcpu_dur") or 0
    blocked, runq = call.get("blocked_dur") or 0, call.get("cpu_wait_dur") or 0
    if blocked > dur - offcpu:
        wait = blocked_in(store, call["cuda_call_id"])
        how = ""
        if wait and wait["syscall_name"]:
            how = (f" (in {wait['syscall_name']}())" if wait["syscall_name"] == wait["reason"]
                   else f" ({wait['reason']} in {wait['syscall_name']}())")
        elif wait:
            how = f" ({wait['reason']})"
        where = f"blocked inside the library for {ms(blocked)}{how}"
        path = [f"{call.get('api')}", "blocked in the CUDA library" + how]
    else:
        where = "on the CPU inside the library (driver or device wait)"
        if runq >= CPU_WAIT_STATED * max(dur, 1) or blocked >= CPU_WAIT_STATED * max(dur, 1):
            where = f"{ms(dur - offcpu)} on the CPU inside the library (driver or device wait)"
        path = [f"{call.get('api')}", "on-CPU in the CUDA library"]
    if runq >= CPU_WAIT_STATED * max(dur, 1):
        where += f", {ms(runq)} waiting for a CPU"
    return where, path


def cuda(f: Facts) -> None:
    """slow_cuda_call, gpu_xid."""
    c = f.cand.get("call") or {}
    f.facts.update(api=c.get("api"), expected_dur_ns=c.get("expected_dur"), call_dur_ns=c.get("dur"),
                   judged=c.get("judged"))
    if f.kind == "gpu_xid":
        x = f.cand["xids"][0]
        f.facts.update(device=x["device"], detail=x["detail"])
        f.facts["summary"] = f"GPU error on {x['device']} ({x['detail']}) during {c.get('api')}"
        f.path = [f"{c.get('api')}", "on-CPU in the CUDA library"]
        return
    where, f.path = inside(f.store, c)
    if c.get("judged") == "step":  # no baseline of its own: the step judged it
        f.facts["call_ordinal"] = call_ordinal(f.store, c["cuda_call_id"])[0]
        which = which_call(f.store, c)
        f.facts["summary"] = (f"{ms(c['dur'])} in {c.get('api')}, {which} (no baseline of its own): {where}"
                              + graph_detail(f.store, c))
        f.context["which"] = which
        f.actions_of = "slow_cuda_call_once"
    else:
        f.facts["summary"] = (f"slow {c.get('api')}: {ms(c.get('dur'))} against ~{ms(c.get('expected_dur'))}, "
                              f"{where}" + graph_detail(f.store, c))


def blocked_in(store: Store, call_id: int) -> dict | None:
    """The longest wait of a call that was not a wait for a CPU: its reason and system call."""
    return store.one("SELECT o.reason, o.syscall_name FROM cuda_call_offcpu l JOIN offcpu o ON o.id = l.offcpu_id"
                     " WHERE l.cuda_call_id = ? AND o.reason NOT IN ('preempted', 'yield')"
                     " ORDER BY l.overlap_dur - l.runq_overlap_dur DESC LIMIT 1", (call_id,))


FAMILY = Family(
    name="cuda",
    kinds=(Kind("slow_cuda_call", cuda), Kind("gpu_xid", cuda)),
    row=candidate,
    actions={
        "gpu_xid": [
            "nvidia-smi -q -i {device} and the driver's documentation of the Xid",
            "Drain the node if the Xid is a hardware or bus error",
        ],
        "slow_cuda_call": [
            "Compare with the driver's own timing of {api} (Nsight Systems) and "
            "check GPU health (nvidia-smi -q) for that period",
        ],
        # a call with no baseline of its own, judged by its step
        "slow_cuda_call_once": [
            "{api} was made once here ({which}): if the step need not wait for it, move it out of the steps "
            "that matter (allocate before training or keep the caching allocator's memory instead of emptying "
            "it; overlap a checkpoint's or an evaluation's synchronisation and copies with the next steps)",
            "Compare with the driver's own timing of {api} (Nsight Systems) and "
            "check GPU health (nvidia-smi -q) for that period",
        ],
    },
)
