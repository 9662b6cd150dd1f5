"""The flight recorder's `stall` trigger for processes that mark no steps: their steps inferred while
recording, by the report's heuristic (recorder/steps_infer.py), and judged by the report's stall rule.

A recording's stop (and each incident saved) infers the steps of a process that called no
`recorder.step` from the period of its synchronising calls; `recorder explain` then finds its
stalls with the stall rule. Live, the same happens on the recent calls, cheaply (a training job
writes tens of thousands of rows a second, of which a few are synchronising calls):

- once a second the synchronising CUDA and NCCL calls written since the last look are read, by row
  id (SQLite filters them; only those reach Python), and kept per thread (the last RECENT_CALLS);
- a thread's step pattern (find_pattern: which call begins each step) is searched on its recent
  calls, at most every SEARCH_EVERY_NS while it has none and every RECHECK_EVERY_NS once it has one
  (a job may change its rhythm); between searches each new call of the pattern's key extends it by
  one step, so a second's work is a loop over that second's new calls;
- each step is judged as it ends (at the next step's start) against the median of the steps before
  it, as for a marked step (Triggers._step): stall_rule's ratio and excess over at least
  `neighbours` steps. Of the threads of a process, the one with the most steps is judged, as the
  report keeps that one's steps.

A thread whose steps are inferred is judged by its steps, not by its slow calls (as the report
explains such a process by its steps): the slow-call trigger (recorder/slow_calls.py) leaves it out.
"""

from __future__ import annotations

import sqlite3
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from recorder.steps_infer import Pattern, SyncCall, find_pattern, sync_call_rows
from store.db.rules import StallRule
from store.units import utc

NS = 1_000_000_000
RECENT_CALLS = 512                 # synchronising calls kept per thread for the search
SEARCH_EVERY_NS = 2 * NS           # a thread without steps is searched again at most this often
RECHECK_EVERY_NS = 30 * NS         # and one with steps this often
FORGET_NS = 120 * NS               # a thread with no synchronising call for this long is forgotten


@dataclass
class _Thread:
    tid: int
    process_id: int | None
    calls: deque[SyncCall] = field(default_factory=lambda: deque(maxlen=RECENT_CALLS))
    pattern: Pattern | None = None
    searched: int = 0              # monotonic ns of the last search, 0: never
    since_anchor: int = 0          # calls of the pattern's key since the last step began
    start: int | None = None       # ts the current step began
    durs: deque[int] = field(default_factory=deque)  # the last steps' durations: the baseline
    steps: int = 0                 # steps seen since the pattern was found
    judged: int = 0                # ts the last step judged ended
    fresh: bool = False            # new calls since the last look


class InferredStepWatch:
    """Infers the steps of threads that mark none from the calls written since its last look, and
    says which step just ended as a stall."""

    def __init__(self, monitor: sqlite3.Connection, session_id: int, rule: StallRule, wall_offset_ns: int,
                 on_step: Callable[[int, int, int, bool], None] | None = None) -> None:
        self.monitor = monitor
        # (thread id, start ts, duration, stalled) of each step that ended, once, on the judged thread
        self.on_step = on_step
        self.session_id = session_id
        self.rule = rule
        self.wall_offset_ns = wall_offset_ns
        self.baseline_steps = max(rule.neighbours, rule.min_baseline_steps)
        self.last_ids = {t: self._top(t) for t in ("cuda_call", "nccl_call")}
        self.threads: dict[int, _Thread] = {}
        self.marking: set[int] = set()  # processes that mark steps
        self.skipped: set[int] = set()  # and their threads
        self._forgot = 0

    def stepping(self) -> set[int]:
        """The threads whose steps are inferred now."""
        return {t for t, s in self.threads.items() if s.pattern is not None}

    def check(self, now: int, marked_threads: Iterable[int]) -> list[tuple[int, str]]:
        """(ts the step ended, detail) of each inferred step that ended as a stall since the last look."""
        self._skip_marked(set(marked_threads))
        tops = {t: self._top(t) for t in self.last_ids}
        out: list[tuple[int, str]] = []
        if any(tops[t] > self.last_ids[t] for t in tops):
            rows = sync_call_rows(self.monitor, self.session_id, (self.last_ids["cuda_call"], tops["cuda_call"]),
                                  (self.last_ids["nccl_call"], tops["nccl_call"]), self.skipped)
            self.last_ids = tops
            self._learn({r[0] for r in rows} - self.threads.keys() - self.skipped)
            for thread_id, ts, dur, key in rows:
                t = self.threads.get(thread_id)
                if t is None:
                    continue
                t.calls.append(SyncCall(ts, dur, key))
                t.fresh = True
                p = t.pattern
                if p is not None and key == p.key:
                    t.since_anchor += 1
                    if t.since_anchor == p.stride:
                        t.since_anchor = 0
                        self._step_began(thread_id, t, ts, out)
        for thread_id, t in list(self.threads.items()):
            if t.fresh and now - t.searched >= (RECHECK_EVERY_NS if t.pattern else SEARCH_EVERY_NS):
                t.searched = now
                calls = list(t.calls)
                self._adopt(thread_id, t, calls, find_pattern(calls), out)
            t.fresh = False
        if now - self._forgot >= RECHECK_EVERY_NS:
            self._forgot = now
            for thread_id in [i for i, t in self.threads.items() if t.calls and now - t.calls[-1].ts > FORGET_NS]:
                del self.threads[thread_id]
        return out

    # -- steps ------------------------------------------------------------------------------------
    def _adopt(self, thread_id: int, t: _Thread, calls: list[SyncCall], pattern: Pattern | None, out: list) -> None:
        """A (new) search's pattern: the thread's steps rebuilt from its recent calls, the ones not
        judged yet judged now."""
        t.pattern, t.start, t.durs, t.steps, t.since_anchor = pattern, None, deque(maxlen=self.baseline_steps), 0, 0
        if pattern is None:
            return
        for i in pattern.anchors:
            self._step_began(thread_id, t, calls[i].ts, out)
        t.since_anchor = sum(1 for c in calls[pattern.anchors[-1] + 1:] if c.key == pattern.key)

    def _step_began(self, thread_id: int, t: _Thread, ts: int, out: list) -> None:
        """A step began at ts: the one before it ended there; judge it (once) by the stall rule."""
        if t.start is not None:
            dur = ts - t.start
            if ts > t.judged:
                t.judged = ts
                judged = self._judged_thread(thread_id, t)
                stalled = False
                if len(t.durs) >= self.baseline_steps and judged:
                    median = statistics.median(t.durs)
                    if self.rule.stalled(dur, median) and t.pattern is not None:  # a step begins under a pattern
                        stalled = True
                        out.append((ts, self._detail(t, t.pattern, t.start, dur, median)))
                if judged and self.on_step is not None:
                    self.on_step(thread_id, t.start, dur, stalled)
            t.durs.append(dur)
        t.start = ts
        t.steps += 1

    def _judged_thread(self, thread_id: int, t: _Thread) -> bool:
        """Of a process's threads with steps, the one with the most (the report keeps its steps)."""
        if t.process_id is None:
            return True
        return all(o.steps <= t.steps or o.pattern is None for i, o in self.threads.items()
                   if i != thread_id and o.process_id == t.process_id)

    def _detail(self, t: _Thread, p: Pattern, start: int, dur: int, median: float) -> str:
        every = "every" if p.stride == 1 else f"every {_ordinal(p.stride)}"
        return (f"inferred step at {utc(start + self.wall_offset_ns)} on thread {t.tid} took {dur / 1e6:.0f} ms, "
                f"{dur / median:.1f}x the median of the {len(t.durs)} steps before ({median / 1e6:.0f} ms; a stall "
                f"is {self.rule.text()}; the process marks no steps: one begins at {every} {p.key.split('@')[0]} "
                f"of the thread)")

    # -- the database -----------------------------------------------------------------------------
    def _top(self, table: str) -> int:
        return self.monitor.execute(f"SELECT coalesce(max(id), 0) FROM {table}").fetchone()[0]

    def _learn(self, thread_ids: set[int]) -> None:
        if not thread_ids:
            return
        marks = ",".join("?" * len(thread_ids))
        for thread_id, process_id, tid in self.monitor.execute(
                f"SELECT id, process_id, tid FROM thread WHERE id IN ({marks})", tuple(thread_ids)):
            if process_id in self.marking:
                self.skipped.add(thread_id)
            else:
                self.threads[thread_id] = _Thread(tid, process_id)

    def _skip_marked(self, marked: set[int]) -> None:
        """Processes that mark steps are watched by their marks: their threads are left out."""
        new = marked - self.skipped
        if not new:
            return
        marks = ",".join("?" * len(new))
        self.marking |= {p for (p,) in self.monitor.execute(
            f"SELECT DISTINCT process_id FROM thread WHERE id IN ({marks}) AND process_id IS NOT NULL", tuple(new))}
        self.skipped |= new | {i for i, t in self.threads.items() if t.process_id in self.marking}
        for thread_id in self.skipped & self.threads.keys():
            del self.threads[thread_id]


def _ordinal(n: int) -> str:
    return f"{n}{'nd' if n == 2 else 'rd' if n == 3 else 'th'}"
