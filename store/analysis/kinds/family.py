"""What a cause family declares (store/analysis/kinds/): its kinds, the rule that finds its candidate
causes in a step's breakdown, the facts a report states of each kind, and the next actions.

A candidate is a dict with at least `kind`, `dur_ns` (the step's time the cause accounts for) and
`excess_dur_ns` (that time above its median in the neighbouring steps), plus the evidence rows its
facts read (`request`, `wait`, `call`, ...). Which candidate is the root cause is the rule's
(store/analysis/causes.py `primary`, with the specificity of each kind from the cause_kind table).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from store.analysis.actions import Action
from store.db import Store

IO_REASONS = ("io", "uninterruptible")  # the off-CPU reasons (step_cause 'blocked' details) of an I/O wait


@dataclass(frozen=True)
class RuleContext:
    """What a candidate rule reads: the step (a step_baseline_lookup row) and its breakdown (step_cause
    rows with their usual time and excess, store/analysis/causes.py `breakdown`)."""

    store: Store
    step: dict
    rows: list[dict]

    @property
    def io_reasons(self) -> tuple[str, ...]:
        """The waits that are I/O's: D state inside a direct reclaim is the reclaim's, not I/O's."""
        return ("io",) if any(r["cause"] == "reclaim" for r in self.rows) else IO_REASONS

    def longest_wait(self, reason: str) -> dict | None:
        """The step's longest off-CPU interval of `reason` (step_offcpu)."""
        return self.store.one("SELECT * FROM step_offcpu WHERE step_mark_id = ? AND reason = ?"
                              " ORDER BY blocked_dur DESC LIMIT 1", (self.step["step_mark_id"], reason))


def row_base(row: dict) -> dict:
    """A candidate's time, from the breakdown row it stands for."""
    return {"dur_ns": row["dur_ns"], "excess_dur_ns": row["excess_dur_ns"], "detail": row["detail"]}


@dataclass
class Facts:
    """What a kind's facts function fills in for one candidate: `facts` (the report's primary cause:
    at least `summary`; its fields are those of store/models.py PrimaryCause), `path` (the kernel
    path), `context` (what the next actions name besides the facts) and `actions_of` (the actions
    entry, when not the kind's own)."""

    store: Store
    step: dict
    cand: dict
    facts: dict
    context: dict = field(default_factory=dict)
    path: list[str] = field(default_factory=list)
    actions_of: str | None = None

    @property
    def kind(self) -> str:
        return self.cand["kind"]

    @property
    def dur(self) -> int:
        return self.cand["dur_ns"]

    @property
    def request(self) -> dict:
        return self.cand.get("request") or {}

    @property
    def wait(self) -> dict:
        return self.cand.get("wait") or {}

    @property
    def syscall(self) -> str | None:
        return self.wait.get("syscall_name")


@dataclass(frozen=True)
class Kind:
    """One root cause a report can name (a row of the cause_kind table gives its specificity)."""

    name: str
    facts: Callable[[Facts], None]
    # the step_lost_line rows (cause, details or None for all) where its time went; None: the rows of
    # the candidate's own wait reason, if it has one (a call or a collective has no time of its own)
    lost_time: tuple[str, tuple[str, ...] | None] | None = None
    own_stack: bool = False  # its evidence rows carry no stack: it is at the line where its time went
    explains: tuple[str, ...] = ()  # candidate kinds it explains: not repeated as secondary signals
    events_stated: tuple[str, ...] = ()  # machine event kinds its facts state: not repeated either
    quiet: bool = False  # never a secondary signal beside a primary cause (the sleep a cause is made of)
    stack: Callable[[dict], int | None] | None = None  # the Python stack it is at, before its evidence's
    evidence: Callable[[dict], Mapping[str, int | None]] | None = None  # evidence ids besides the usual


@dataclass(frozen=True)
class Family:
    """A family of causes: its kinds, the rules that find its candidates and its next actions (per
    kind, or per variant a facts function names in `actions_of`). The rules run in three rounds over
    the families in registry order: `whole` (the whole breakdown), `row` (each breakdown row, the
    first family that claims it), `followed` (the waits followed to other threads)."""

    name: str
    kinds: tuple[Kind, ...]
    actions: Mapping[str, list[Action]]
    whole: Callable[[RuleContext], list[dict]] | None = None
    row: Callable[[RuleContext, dict], dict | None] | None = None
    followed: Callable[[RuleContext], list[dict]] | None = None
