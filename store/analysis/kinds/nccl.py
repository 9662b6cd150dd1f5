"""NCCL: the step's thread waited in a collective (step_cause 'nccl_wait', detail: the API, and the
rank that entered it last when known): nccl_straggler when another rank was late, else nccl_wait."""

from __future__ import annotations

from collections.abc import Mapping

from store.analysis.kinds.family import Facts, Family, Kind, RuleContext, row_base
from store.units import ms


def candidate(ctx: RuleContext, row: dict) -> dict | None:
    if row["cause"] != "nccl_wait":
        return None
    straggling = " waiting for rank " in (row["detail"] or "")
    wait = ctx.store.one("SELECT * FROM step_nccl_wait WHERE step_mark_id = ? ORDER BY wait_dur DESC LIMIT 1",
                         (ctx.step["step_mark_id"],))
    return {**row_base(row), "kind": "nccl_straggler" if straggling else "nccl_wait", "wait": wait}


def nccl(f: Facts) -> None:
    """nccl_straggler, nccl_wait."""
    w = f.wait
    f.facts.update(api=w.get("api"), rank=w.get("rank"), straggler_rank=w.get("straggler_rank"),
                   straggler_pid=w.get("straggler_pid"), lateness_dur_ns=w.get("lateness_dur"),
                   comm_hash=w.get("comm_hash"), seq=w.get("seq"))
    if f.kind == "nccl_straggler":
        f.facts["summary"] = (f"NCCL straggler: rank {w.get('straggler_rank')} (pid {w.get('straggler_pid')})"
                              f" entered {w.get('api')} {ms(w.get('lateness_dur'))} after the first rank; rank "
                              f"{w.get('rank')} waited {ms(w.get('wait_dur'))}")
        f.path = [f"{w.get('api')} (collective {w.get('seq')})", f"waiting for rank {w.get('straggler_rank')}"]
    else:
        f.facts["summary"] = f"waiting in {w.get('api')} for {ms(f.dur)}"
        f.path = [f"{w.get('api')}"]


def collective(cand: dict) -> Mapping[str, int | None]:
    """The collective call waited in, besides the usual evidence."""
    return {"nccl_call_id": cand["wait"].get("nccl_call_id")} if cand.get("wait") else {}


FAMILY = Family(
    name="nccl",
    kinds=(Kind("nccl_straggler", nccl, evidence=collective), Kind("nccl_wait", nccl, evidence=collective)),
    row=candidate,
    actions={
        "nccl_straggler": [
            "Explain rank {straggler_rank}'s step: it is the one that was slow "
            "(below, when its recording is in this database)",
            "If one rank is always last, look at its host (CPU, disk, thermals)",
        ],
        "nccl_wait": ["Record the other ranks into the same database to see which one was late"],
    },
)
