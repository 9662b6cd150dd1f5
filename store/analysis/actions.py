"""The recommended next actions of a report: per cause, the steps to take, each a template filled
from the facts the analysis found. A step's root causes declare theirs in their family's module
(store/analysis/kinds/, gathered in kinds.STEP_ACTIONS); a slow CUDA call's are below.

A template is a plain str.format string. An entry given as (template, key) is included only when
the context's `key` is set (the OOM kill to restart after memory reclaim, the call's syscall).
"""

from __future__ import annotations

from collections.abc import Mapping

Action = str | tuple[str, str]

# A slow CUDA call's cause (the report of a session without steps) -> its next actions.
CALL_ACTIONS: dict[str, list[Action]] = {
    "cpu_contention": [
        ("See what {contender_name} (pid {contender_pid}) is and why it runs on cpu {cpus}: "
         "ps -o pid,psr,pcpu,cmd -p {contender_pid}", "contender_pid"),
        ("Keep it off the training threads' CPUs: give the job an exclusive cpuset, or move it "
         "with taskset -cp <other cpus> {contender_pid}", "contender_pid"),
        "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
    ],
    "blocked": [
        "The call blocked ({what}): look for lock or I/O contention in the same process at that time "
        "(recorder explain --window around {ts})",
    ],
    "in_call": [
        "{api} spent its time on-CPU in the library: compare with the driver's own timing "
        "(Nsight Systems) and check GPU health (nvidia-smi -q) for that period",
    ],
}


def fill(table: Mapping[str, list[Action]], kind: str, context: Mapping[str, object]) -> list[str]:
    """The actions of `kind` with the context's values in their places."""
    out = []
    for action in table.get(kind, []):
        if isinstance(action, tuple):
            action, needs = action
            if not context.get(needs):
                continue
        out.append(action.format_map(context))
    return out
