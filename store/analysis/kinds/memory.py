"""Memory: the step's thread reclaimed memory for its own allocations (step_cause 'reclaim', detail:
global or cgroup), memory_reclaim with the OOM kills of the step; or was paused writing dirty pages
(step_cause 'dirty_throttle', detail: the backing device), dirty_throttle."""

from __future__ import annotations

from store.analysis.kinds.family import Facts, Family, Kind, RuleContext, row_base
from store.units import ms


def candidate(ctx: RuleContext, row: dict) -> dict | None:
    sid = ctx.step["step_mark_id"]
    if row["cause"] == "reclaim":
        kills = ctx.store.query("SELECT * FROM step_machine_event WHERE step_mark_id = ? AND kind = 'oom_kill'"
                                " ORDER BY ts", (sid,))
        # a wait of the thread inside a reclaim (it blocked while reclaiming for its allocation);
        # the line is where the reclaim time went (lost_lines)
        wait = ctx.store.one("SELECT o.* FROM step_offcpu o JOIN step_reclaim r ON r.step_mark_id = o.step_mark_id"
                             " JOIN reclaim_interval x ON x.id = r.reclaim_id"
                             " WHERE o.step_mark_id = ? AND o.python_stack_id IS NOT NULL"
                             " AND o.ts >= x.ts AND o.ts < x.ts + x.dur ORDER BY o.ts LIMIT 1", (sid,))
        return {**row_base(row), "kind": "memory_reclaim", "scope": row["detail"], "oom_kills": kills, "wait": wait}
    if row["cause"] == "dirty_throttle":
        return {**row_base(row), "kind": "dirty_throttle", "bdi": row["detail"]}
    return None


def memory_reclaim(f: Facts) -> None:
    kills = f.cand.get("oom_kills") or []
    scope = f.cand.get("scope")
    f.facts.update(scope=scope, oom_kills=[k["detail"] for k in kills])
    f.facts["summary"] = (f"memory reclaim: the thread spent {ms(f.dur)} in {scope} direct reclaim"
                          + (f"; {kills[0]['detail']}" if kills else ""))
    f.path = ["page allocation", f"{scope} direct reclaim ({ms(f.dur)})"] + (["OOM kill"] if kills else [])
    f.context["oom_kill"] = kills[0]["detail"] if kills else None


def dirty_throttle(f: Facts) -> None:
    f.facts["summary"] = f"dirty-page throttling: the thread was paused {ms(f.dur)} writing to {f.cand.get('bdi')}"
    f.path = ["write()", "balance_dirty_pages pause"]


FAMILY = Family(
    name="memory",
    kinds=(Kind("memory_reclaim", memory_reclaim, lost_time=("reclaim", None), own_stack=True,
                events_stated=("oom_kill",)),
           Kind("dirty_throttle", dirty_throttle)),
    row=candidate,
    actions={
        "memory_reclaim": [
            "Compare the job's memory use with its cgroup limit (memory.max, memory.current, memory.events)",
            "Lower the data loader's memory (fewer workers, smaller prefetch) or raise the limit",
            ("Restart the killed worker's work: {oom_kill}", "oom_kill"),
        ],
        "dirty_throttle": ["Write checkpoints with O_DIRECT or from another thread, or raise dirty_bytes"],
    },
)
