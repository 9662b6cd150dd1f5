"""The rules the views apply, read from the database (migration 0010_rules.sql).

Each threshold and mapping is a row of a table the views join: stall_rule, slow_call_rule,
device_event_cause, cause_kind, cause_rule. Python reads them from there to apply them where it
works on rows the views gave it (choosing a step's root cause) and to quote them in a report; it
never carries its own copy of a number.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from functools import lru_cache

from store.db import MIGRATIONS, Store


@dataclass(frozen=True)
class StallRule:
    ratio: float             # a stall takes at least ratio x its rolling baseline
    min_excess_dur: int      # ns, and at least this much more
    min_baseline_steps: int  # a baseline over fewer steps decides nothing
    neighbours: int          # steps on each side of the rolling baseline

    def stalled(self, dur: int, baseline: float) -> bool:
        """dur (ns) is a stall against a baseline (ns) taken over enough steps."""
        return dur >= self.ratio * baseline and dur - baseline >= self.min_excess_dur

    def text(self) -> str:
        """'1.5x the rolling median and 1 ms more', as a report quotes it."""
        return f"{self.ratio:g}x the rolling median and {self.min_excess_dur / 1e6:g} ms more"

    def threshold(self) -> str:
        """The rule as the MCP step listing states it."""
        return f"stalled: dur >= {self.ratio:g} x the rolling median and {self.min_excess_dur / 1e6:g} ms more"


@dataclass(frozen=True)
class SlowCallRule:
    ratio: float
    min_excess_dur: int
    min_baseline_calls: int

    def times(self) -> str:
        """'twice' for a ratio of 2, else '3x'."""
        return "twice" if self.ratio == 2 else f"{self.ratio:g}x"

    def threshold(self) -> str:
        """The rule as the MCP slow-call listing states it."""
        return (f"dur >= {self.ratio:g} x expected_dur and excess_dur >= {self.min_excess_dur / 1000:g} us, "
                f"baseline of >= {self.min_baseline_calls} calls (slow_cuda_call)")


@dataclass(frozen=True)
class CauseRule:
    specific_share: float    # a more specific cause wins when it explains this share of the top excess
    explained_share: float   # below this share of the stall, no recorded cause explains it
    secondary_share: float   # other causes above this share of the stall are secondary signals
    specificity: dict[str, int]   # cause kind -> how specific it is (cause_kind)
    event_cause: dict[str, str]   # device or machine event kind -> cause kind (device_event_cause)


def stall_rule(store: Store) -> StallRule:
    r = store.row("SELECT ratio, min_excess_dur, min_baseline_steps, neighbours FROM stall_rule")
    return StallRule(r["ratio"], r["min_excess_dur"], r["min_baseline_steps"], r["neighbours"])


@lru_cache(maxsize=1)
def default_stall_rule() -> StallRule:
    """The stall rule every new recording starts with (its row as the migrations write it), for what
    has no one recording's rule to read: a job's steps across several recordings or Parquet exports."""
    conn = sqlite3.connect(":memory:")
    try:
        for _, path in MIGRATIONS:
            conn.executescript(path.read_text())
        r = conn.execute("SELECT ratio, min_excess_dur, min_baseline_steps, neighbours FROM stall_rule").fetchone()
    finally:
        conn.close()
    return StallRule(*r)


def slow_call_rule(store: Store) -> SlowCallRule:
    r = store.row("SELECT ratio, min_excess_dur, min_baseline_calls FROM slow_call_rule")
    return SlowCallRule(r["ratio"], r["min_excess_dur"], r["min_baseline_calls"])


def cause_rule(store: Store) -> CauseRule:
    r = store.row("SELECT specific_share, explained_share, secondary_share FROM cause_rule")
    return CauseRule(
        r["specific_share"], r["explained_share"], r["secondary_share"],
        {k: s for k, s in store.conn.execute("SELECT kind, specificity FROM cause_kind")},
        {k: c for k, c in store.conn.execute("SELECT kind, cause FROM device_event_cause")},
    )
