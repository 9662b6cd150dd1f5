"""The flight recorder's `stall` trigger for threads with no steps (none marked, none inferred by
recorder/steps_live.py): a CUDA call slow against its own baseline, by the report's rule for slow
calls (slow_call_rule: at least `ratio` x the baseline, over a baseline of at least
`min_baseline_calls` calls) and at least the stall rule's `min_excess_dur` (1 ms) more: a call
200 us over twice its baseline is evidence in a report, a GPU's ordinary jitter, not an incident
worth saving.

The report's baseline of a call is the median over the session of the calls of the same API family
and size class (view cuda_baseline). Live, the baseline can only be the calls before: here the
median of the per-second medians of that family and size class over the last BASELINE_SECONDS
seconds. Each second the calls written since the last look are read once, aggregated in SQLite
(a training job makes tens of thousands a second): per family and size class their median, their
count and the slowest one, which is the only one compared with the baseline.
"""

from __future__ import annotations

import sqlite3
import statistics
from collections import deque
from collections.abc import Iterable

from store.db.rules import SlowCallRule, StallRule

BASELINE_SECONDS = 30

_BATCH = """
WITH c AS (
    SELECT a.family, a.name AS api, coalesce(c.size_class, -1) AS size_class, c.dur, c.ts, t.tid
    FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id JOIN thread t ON t.id = c.thread_id
    WHERE c.id > ? AND c.id <= ? AND c.session_id = ? AND c.open = 0 {skip}
),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY family, size_class ORDER BY dur) AS rn,
           count(*) OVER (PARTITION BY family, size_class) AS n
    FROM c
)
SELECT family, size_class, n,
       max(CASE WHEN rn = (n + 1) / 2 THEN dur END) AS median_dur,
       max(CASE WHEN rn = n THEN dur END) AS max_dur,
       max(CASE WHEN rn = n THEN ts END) AS max_ts,
       max(CASE WHEN rn = n THEN api END) AS max_api,
       max(CASE WHEN rn = n THEN tid END) AS max_tid
FROM ranked GROUP BY family, size_class
"""


class SlowCallWatch:
    """Reads the CUDA calls written since its last look; says which was slow against the calls before."""

    def __init__(self, monitor: sqlite3.Connection, session_id: int, rule: SlowCallRule, stall: StallRule) -> None:
        self.monitor = monitor
        self.session_id = session_id
        self.rule = rule
        self.min_excess_dur = max(rule.min_excess_dur, stall.min_excess_dur)
        self.last_id = monitor.execute("SELECT coalesce(max(id), 0) FROM cuda_call").fetchone()[0]
        # (family, size class) -> the last seconds' (median, calls)
        self.history: dict[tuple[str, int], deque[tuple[int, int]]] = {}

    def check(self, stepping_threads: Iterable[int]) -> list[tuple[int, str]]:
        """(ts, detail) of each slow call since the last look, of threads not in `stepping_threads`
        (a thread with steps, marked or inferred, is watched by its steps)."""
        top = self.monitor.execute("SELECT coalesce(max(id), 0) FROM cuda_call").fetchone()[0]
        if top <= self.last_id:
            return []
        marked = ",".join(str(int(t)) for t in stepping_threads)
        skip = f"AND c.thread_id NOT IN ({marked})" if marked else ""
        rows = self.monitor.execute(_BATCH.format(skip=skip), (self.last_id, top, self.session_id)).fetchall()
        self.last_id = top
        rule, out = self.rule, []
        for family, size_class, n, median, slowest, ts, api, tid in rows:
            past = self.history.setdefault((family, size_class), deque(maxlen=BASELINE_SECONDS))
            calls = sum(k for _, k in past)
            if calls >= rule.min_baseline_calls:
                base = int(statistics.median(m for m, _ in past))
                if slowest >= rule.ratio * base and slowest - base >= self.min_excess_dur:
                    size = "" if size_class < 0 else f" ({_size_text(size_class)})"
                    out.append((ts, f"{api}{size} took {slowest / 1e6:.1f} ms on thread {tid}, "
                                    f"{slowest / max(base, 1):.0f}x the median of the {calls} calls of its family and "
                                    f"size before ({base / 1e6:.2f} ms; a slow call is {rule.times()} its baseline "
                                    f"and {self.min_excess_dur / 1e6:g} ms more; the thread marks no steps)"))
            past.append((median, n))
        return out


def _size_text(size_class: int) -> str:
    """The power-of-two bucket of a size: bit length 27 -> '64-128 MiB'."""
    lo, hi = 1 << max(size_class - 1, 0), 1 << size_class
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if lo >= 1 << shift:
            return f"{lo >> shift}-{hi >> shift} {unit}"
    return f"{lo}-{hi} bytes"
