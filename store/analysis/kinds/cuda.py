"""CUDA: the step's thread spent more time on the CPU inside CUDA calls than they usually take
(step_cause 'cuda_call', detail: the API): slow_cuda_call, or gpu_xid when the GPU reported an Xid
error during the step."""

from __future__ import annotations

from store.analysis.kinds.family import Facts, Family, Kind, RuleContext, row_base
from store.db import Store
from store.units import ms


def candidate(ctx: RuleContext, row: dict) -> dict | None:
    if row["cause"] != "cuda_call":
        return None
    sid = ctx.step["step_mark_id"]
    call = ctx.store.one("SELECT * FROM step_cuda_call WHERE step_mark_id = ? AND api = ?"
                         " ORDER BY oncpu_excess_dur DESC LIMIT 1", (sid, row["detail"]))
    xids = ctx.store.query("SELECT * FROM step_machine_event WHERE step_mark_id = ?"
                           " AND kind IN ('gpu_xid') ORDER BY ts", (sid,))
    return {**row_base(row), "kind": "gpu_xid" if xids else "slow_cuda_call", "call": call, "xids": xids}


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


def cuda(f: Facts) -> None:
    """slow_cuda_call, gpu_xid."""
    c = f.cand.get("call") or {}
    f.facts.update(api=c.get("api"), expected_dur_ns=c.get("expected_dur"), call_dur_ns=c.get("dur"))
    if f.kind == "gpu_xid":
        x = f.cand["xids"][0]
        f.facts.update(device=x["device"], detail=x["detail"])
        f.facts["summary"] = f"GPU error on {x['device']} ({x['detail']}) during {c.get('api')}"
    else:
        f.facts["summary"] = (f"slow {c.get('api')}: {ms(c.get('dur'))} against ~{ms(c.get('expected_dur'))}, "
                              "on the CPU inside the library (driver or device wait)" + graph_detail(f.store, c))
    f.path = [f"{c.get('api')}", "on-CPU in the CUDA library"]


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
    },
)
