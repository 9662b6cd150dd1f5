"""The flight recorder of one session: its window (window.py), its triggers (triggers.py) and its
incidents (incidents.py, shipping.py), driven by the Session: start() once the session is written,
keep() at every batch, tick() every second, finish() at stop. It is given the session's handle
(recorder/core/participant.py `SessionHandle`), never the session, and names no layer."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from recorder.core.clock import now_ns
from recorder.core.participant import SessionHandle
from recorder.flight.incidents import FlightState, Incidents
from recorder.flight.options import NS, FlightOptions
from recorder.flight.triggers import Triggers
from recorder.flight.window import Window
from store.db import Store


class FlightRecorder:
    """Keeps a session's window and saves its incidents. `window` is the one the session's writer
    was made with (its limits, `Window.writer_limits()`)."""

    def __init__(self, session: SessionHandle, options: FlightOptions, window: Window) -> None:
        self.session = session
        self.options = options
        self.window = window
        self.incidents = Incidents(session, options, lambda: window.keep_now)
        self.triggers = Triggers(options, self.incidents.fire)
        self.dump_requested = False  # SIGUSR1: the next tick saves the kept window
        self._monitor: sqlite3.Connection | None = None
        # the window kept (Window.keep): at every batch under --max-size, else once a second; the
        # window's own method, so that a batch reaches it in no more calls than before the split
        self.keep: Callable[[int], None] = window.keep

    @property
    def state(self) -> FlightState:
        return self.incidents.state

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self.session.writer.sync()
        monitor = self._monitor = self.session.connect()
        self.window.start(self.session, monitor)
        wall_offset = monitor.execute("SELECT wall_offset_ns FROM session WHERE id = ?",
                                      (self.session.session_id,)).fetchone()[0]
        self.incidents.wall_offset = wall_offset
        self.triggers.start(self.session, monitor, wall_offset)

    def tick(self) -> None:
        """Once a second: keep the window, watch the triggers, save what is due."""
        now = now_ns()
        self.incidents.collect_saved()
        self.window.tick(now)
        try:
            self.triggers.watch(now)
        except sqlite3.Error as e:  # a busy moment of the writer: look again next second
            self.state.note_error(f"trigger check: {e}")
        if self.dump_requested:
            self.dump_requested = False
            self.incidents.fire("signal", now, "SIGUSR1: the kept window saved on request", force=True)
        self.incidents.save_due(now)

    def finish(self, stop: int) -> None:
        """At stop: save the incidents still waiting (their window ends at the stop)."""
        incidents = self.incidents
        for p in incidents.pending:
            incidents.save(p, stop, background=False)
        incidents.pending.clear()
        incidents.wait()
        held = ", ".join(f"{n} {t}" for t, n in sorted(self.state.suppressed.items()))
        if held:
            print(f"recorder: flight recorder: triggers held back by the rate limit (one incident per trigger per "
                  f"{self.options.cooldown_ns / NS:g} s, {self.options.max_per_hour} an hour): {held}", flush=True)
        if self._monitor:
            self._monitor.close()

    def abandon(self) -> None:
        """The disk took no more: incidents waiting are not saved (they would need room too)."""
        self.incidents.abandon()
        if self._monitor:
            self._monitor.close()
            self._monitor = None
            self.window.stop()
            self.triggers.stop()

    def store_saved(self, store: Store) -> None:
        """List the incidents saved in the recording (after the writer is closed)."""
        self.incidents.collect_saved(direct=store)

    # -- what it says -----------------------------------------------------------------------------
    def status(self) -> dict:
        now = now_ns()
        hook = self.incidents.hook
        return {
            **self.options.describe(),
            **self.window.status(now),
            "incidents_dir": str(self.incidents.folder),
            "incidents": [{k: r[k] for k in ("trigger", "file", "detail", "rows", "bytes")}
                          for r in self.state.saved],
            "pending": [{"trigger": p.trigger, "due_in_s": round((p.due - now) / NS, 1)}
                        for p in self.incidents.pending],
            "suppressed": dict(self.state.suppressed),
            "errors": self.state.errors[-5:],
            "hook": {"runs": hook.runs, "failures": hook.failures} if hook else None,
        }

    def metrics(self) -> dict:
        """What recorder/metrics.py writes of the flight recorder."""
        saved: dict[str, int] = dict.fromkeys((*sorted(self.options.triggers), "signal"), 0)
        for row in self.state.saved:
            saved[row["trigger"]] = saved.get(row["trigger"], 0) + 1
        last, last_stall = self.incidents.last()
        hook = self.incidents.hook
        return {"saved": saved, "suppressed": dict(self.state.suppressed), "errors": len(self.state.errors),
                "kept_s": self.window.keep_now / NS, "keep_s": self.options.keep_ns / NS,
                "hook_runs": hook.runs if hook else 0,
                "hook_failures": hook.failures if hook else 0,
                "last": last, "last_stall": last_stall}
