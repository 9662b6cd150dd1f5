"""What fires an incident, looked for once a second in what was just written and in what is in
flight: a stalled step by the report's stall rule (marked, or for a process that marks none inferred
live as the report infers them, recorder/steps_live.py; on a thread with no steps either way a CUDA
call slow against its own baseline, recorder/slow_calls.py), a kernel-log device error or OOM kill,
and a CUDA or NCCL call in flight longer than --hang (asked of the session's layers through its
handle, `SessionHandle.in_flight()`)."""

from __future__ import annotations

import sqlite3
import statistics
from collections import deque
from collections.abc import Callable

from recorder.core.participant import SessionHandle
from recorder.flight.options import NS, FlightOptions
from recorder.slow_calls import SlowCallWatch
from recorder.steps_live import InferredStepWatch
from store.db import Store
from store.db.rules import StallRule, slow_call_rule, stall_rule

# kernel-log and memory tables a trigger watches: (table, trigger, condition on its rows)
WATCHED = (
    ("nvme_event", "nvme", "kind <> 'power_saving_hint'"),
    ("block_error", "io-error", "1"),
    ("gpu_xid", "xid", "1"),
    ("aer_event", "aer", "1"),
    ("oom_kill", "oom", "1"),
    ("oom_victim", "oom", "1"),
)

Fire = Callable[[str, int, str], None]  # (trigger, its time in ns CLOCK_MONOTONIC, what it saw)


class Triggers:
    """Watches one session's rows and calls in flight, and calls `fire` for each trigger seen."""

    def __init__(self, options: FlightOptions, fire: Fire) -> None:
        self.options = options
        self.fire = fire
        self.seen_calls: set[tuple[str, int, int]] = set()
        self._last_id: dict[str, int] = {}
        self._steps: dict[int, tuple[int, int, deque[int]]] = {}
        self._rule: StallRule  # the report's stall rule, read at start()
        self._calls: SlowCallWatch | None = None  # the stall trigger of threads with no steps
        self._inferred: InferredStepWatch | None = None  # and of processes whose steps are inferred
        self._session: SessionHandle | None = None
        self._monitor: sqlite3.Connection | None = None

    def start(self, session: SessionHandle, monitor: sqlite3.Connection, wall_offset: int) -> None:
        """What is in the tables already is not looked at again; the rules are the recording's."""
        self._session, self._monitor = session, monitor
        for table, _, _ in WATCHED + (("step_mark", "", ""),):
            self._last_id[table] = monitor.execute(f"SELECT coalesce(max(id), 0) FROM {table}").fetchone()[0]
        self._rule = stall_rule(Store(session.db_path, monitor, True))
        self._calls = SlowCallWatch(monitor, session.session_id,
                                    slow_call_rule(Store(session.db_path, monitor, True)), self._rule)
        self._inferred = InferredStepWatch(monitor, session.session_id, self._rule, wall_offset)

    def stop(self) -> None:
        self._monitor = None

    def watch(self, now: int) -> None:
        mon, session = self._monitor, self._session
        if mon is None or session is None:  # not started, or closed
            return
        sid = session.session_id
        trig = self.options.triggers
        for table, trigger, cond in WATCHED:
            rows = mon.execute(
                f"SELECT e.id, e.ts, coalesce(k.text, '') FROM {table} e "
                f"LEFT JOIN kernel_log k ON k.id = {'e.kernel_log_id' if table != 'oom_victim' else 'NULL'} "
                f"WHERE e.id > ? AND e.session_id = ? AND {cond} ORDER BY e.id",
                (self._last_id[table], sid)).fetchall()
            if rows:
                self._last_id[table] = rows[-1][0]
            if trigger in trig:
                for _, ts, text in rows:
                    self.fire(trigger, ts, f"{table}: {text}" if text else table)
        marks = mon.execute("SELECT id, thread_id, ts, step FROM step_mark WHERE id > ? AND session_id = ? "
                            "ORDER BY id", (self._last_id["step_mark"], sid)).fetchall()
        if marks:
            self._last_id["step_mark"] = marks[-1][0]
        for _, thread_id, ts, step in marks:
            self._step(thread_id, ts, step)
        if "stall" in trig and self._calls and self._inferred:
            # a process that marks no steps: its steps inferred as the report infers them; a
            # thread with neither marked nor inferred steps: its calls slow against their baseline
            for ts, detail in self._inferred.check(now, self._steps):
                self.fire("stall", ts, detail)
            for ts, detail in self._calls.check(self._steps.keys() | self._inferred.stepping()):
                self.fire("stall", ts, detail)
        if "hung-call" in trig:
            for call in session.in_flight():
                age = now - call.ts
                key = (call.table, call.tid, call.ts)
                if age >= self.options.hang_ns and key not in self.seen_calls:
                    self.seen_calls.add(key)
                    self.fire("hung-call", now, f"{call.api} in flight for {age / NS:.1f} s on thread {call.tid} "
                                                f"(--hang {self.options.hang_ns / NS:g}s)")
            if len(self.seen_calls) > 10_000:
                self.seen_calls.clear()

    def _step(self, thread_id: int, ts: int, step: int) -> None:
        """The report's stall rule (stall_rule) on a thread's step as it ends. Live, the rolling
        baseline can only be the steps before: the median of the thread's last `neighbours` steps,
        and none until there are that many (the report's window has as many on each side)."""
        rule = self._rule
        last = self._steps.get(thread_id)
        if last is not None:
            prev_ts, prev_step, durs = last
            dur = ts - prev_ts
            if len(durs) >= max(rule.neighbours, rule.min_baseline_steps) and "stall" in self.options.triggers:
                median = statistics.median(durs)
                if rule.stalled(dur, median):
                    self.fire("stall", ts, f"step {prev_step} took {dur / 1e6:.0f} ms, {dur / median:.1f}x the "
                                           f"median of the {len(durs)} steps before ({median / 1e6:.0f} ms; a stall "
                                           f"is {rule.text()})")
            durs.append(dur)
        else:
            durs = deque(maxlen=max(rule.neighbours, rule.min_baseline_steps))
        self._steps[thread_id] = (ts, step, durs)
