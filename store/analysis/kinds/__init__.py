"""The cause families, one module each, registered in FAMILIES: every root cause a step report can
name is a Kind of exactly one family (store/analysis/kinds/family.py says what a family declares;
docs/architecture.md, "Adding a cause kind", how to add one). store/analysis/causes.py finds a
step's candidates by looping over the families' rules, store/analysis/explain.py states the chosen
ones through their kinds' facts and actions.
"""

from __future__ import annotations

from store.analysis.actions import Action, fill
from store.analysis.kinds import cpu, cuda, io, memory, nccl, network, waits
from store.analysis.kinds.family import Facts, Family, Kind, RuleContext
from store.db import Store

FAMILIES: tuple[Family, ...] = (io.FAMILY, cpu.FAMILY, network.FAMILY, memory.FAMILY, cuda.FAMILY, nccl.FAMILY,
                                waits.FAMILY)

KINDS: dict[str, Kind] = {k.name: k for f in FAMILIES for k in f.kinds}

# a stalled step that no recorded wait explains: not a kind, the report's last resort
UNEXPLAINED: list[Action] = [
    "Nothing recorded explains the step: profile the thread's own code at that time (py-spy dump, or "
    "recorder explain --stack on its CUDA calls)",
]
# a step's root cause (and the variants its facts name in `actions_of`) -> its next actions
STEP_ACTIONS: dict[str, list[Action]] = {**{k: v for f in FAMILIES for k, v in f.actions.items()},
                                         "unexplained": UNEXPLAINED}


def candidates(store: Store, step: dict, rows: list[dict]) -> list[dict]:
    """Every family's candidates for the step, in the rules' order: the whole breakdown, each row
    (claimed by the first family whose rule takes it), then the waits followed."""
    ctx = RuleContext(store, step, rows)
    out: list[dict] = []
    for family in FAMILIES:
        if family.whole is not None:
            out += family.whole(ctx)
    row_rules = [f.row for f in FAMILIES if f.row is not None]
    for row in rows:
        for rule in row_rules:
            cand = rule(ctx, row)
            if cand is not None:
                out.append(cand)
                break
    for family in FAMILIES:
        if family.followed is not None:
            out += family.followed(ctx)
    return out


def cause_facts(store: Store, cand: dict, step: dict) -> dict:
    """What the report says about a candidate cause: its kind's facts (summary and the fields of its
    kind), kernel path and next actions."""
    kind = cand["kind"]
    f = Facts(store, step, cand, {"kind": kind, "dur_ns": cand["dur_ns"], "excess_dur_ns": cand["excess_dur_ns"]})
    KINDS[kind].facts(f)
    request = f.request
    context = {**f.facts, "request_ts": request.get("ts"),
               "request_end": request.get("ts", 0) + request.get("dur", 0), **f.context}
    f.facts["next_actions"] = fill(STEP_ACTIONS, f.actions_of if f.actions_of in STEP_ACTIONS else kind, context)
    f.facts["kernel_path"] = f.path
    return f.facts
