"""The incidents of a flight recording: a trigger's window waits for its after part, is copied into
<db>.incidents/<UTC time>-<trigger>.db by a thread of its own (the ring buffers keep being drained),
listed in the recording's `incident` table, explained (its step and primary cause kind, for the
metrics) and handed to the --on-incident command and to --ship.

Trigger storms: a trigger that fires while an incident is waiting for its after part joins it (named
in its detail); each trigger kind fires at most once per `cooldown`, and at most `max_per_hour`
incidents are saved per hour; the rest are counted (`FlightState.suppressed`).
"""

from __future__ import annotations

import datetime as dt
import socket
import sqlite3
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from recorder.core.clock import now_ns
from recorder.core.participant import SessionHandle
from recorder.flight.options import NS, FlightOptions
from recorder.flight.shipping import Shipper
from recorder.incident_hook import IncidentHook
from recorder.steps_infer import infer_steps
from store.db import Store, open_store
from store.errors import UserError
from store.flight import incidents_dir, save_window
from store.text import without_controls


def incident_name(ts_unix_ns: int, trigger: str) -> str:
    when = dt.datetime.fromtimestamp(ts_unix_ns / NS, dt.timezone.utc)
    return f"{when:%Y%m%dT%H%M%S}.{when.microsecond // 1000:03d}Z-{trigger}.db"


def incident_facts(path: Path) -> dict:
    """What a saved incident's report says: {'stall', 'step', 'cause_kind', 'cause'} (None where it
    says nothing; an incident without a report, e.g. an empty window, is no stall)."""
    from store.report.build import analyse

    try:
        with open_store(path, readonly=True) as store:
            report = analyse(store).to_json()
    except Exception:  # noqa: BLE001 - whatever the report cannot say, the incident is still announced
        return {"stall": False, "step": None, "cause_kind": None, "cause": None}
    cause = report.get("primary_cause") or {}
    step = report.get("step") or {}
    return {"stall": bool(report.get("stall")), "step": step.get("step"), "cause_kind": cause.get("kind"),
            "cause": cause.get("summary")}


def incident_summary(trigger: str, when_unix_ns: int, host: str, facts: dict, detail: str) -> str:
    """The one line the --on-incident command gets."""
    when = dt.datetime.fromtimestamp(when_unix_ns / NS, dt.timezone.utc)
    what = (f"step {facts['step']} stalled" if facts["stall"] and facts["step"] is not None
            else "stall" if facts["stall"] else "no stall found in the window")
    cause = f", primary cause {facts['cause_kind']}: {facts['cause']}" if facts["cause_kind"] else ""
    line = f"stall-recorder on {host}: {trigger} incident at {when:%Y-%m-%dT%H:%M:%SZ}: {what}{cause}; {detail}"
    # one line, whatever the detail or a process name in the cause held, and no control characters
    line = without_controls(" ".join(line.split()))
    return line if len(line) <= 500 else line[:497] + "..."


def save_incident(src: Path, out: Path, session_id: int, start: int, end: int, *, trigger: str, detail: str,
                  ts: int) -> dict:
    """save_window(), then the steps a recording's stop would infer: a normal, complete recording."""
    row = save_window(src, out, session_id, start, end, trigger=trigger, detail=detail, ts=ts)
    with open_store(out) as store:
        infer_steps(store, session_id)
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return row


@dataclass
class Pending:
    trigger: str
    ts: int
    details: list[str]
    due: int                 # monotonic ns the window ends (the after part recorded)
    start: int


@dataclass
class FlightState:
    saved: list[dict] = field(default_factory=list)
    suppressed: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    last: dict | None = None  # the last incident saved: trigger, file, when, its report's facts
    last_stall: dict | None = None  # the last one whose report finds a stall

    def note_error(self, text: str) -> None:
        self.errors.append(text)
        print(f"recorder: flight recorder: {text}", flush=True)


class Incidents:
    """The incidents of one session: fired (fire()), waiting, saved, announced, listed."""

    def __init__(self, session: SessionHandle, options: FlightOptions, kept: Callable[[], int]) -> None:
        self.session = session
        self.options = options
        self.kept = kept  # the window kept now (ns): an incident starts no earlier
        self.state = FlightState()
        self.pending: list[Pending] = []
        self.last_fired: dict[str, int] = {}
        self.fired_hour: deque[int] = deque()
        self.wall_offset = 0  # the session's, read at start
        self._saver: threading.Thread | None = None
        self._results: list[dict] = []
        self._lock = threading.Lock()
        self.folder = incidents_dir(session.db_path)
        self.hook = IncidentHook(options.hook) if options.hook else None
        self.shipper = Shipper(options.ship, session.db_path, self.state.note_error) if options.ship else None

    def fire(self, trigger: str, ts: int, detail: str, force: bool = False) -> None:
        opts = self.options
        now = now_ns()
        for p in self.pending:  # a storm joins the incident already waiting
            if p.due > now and not force:
                if len(p.details) < 20:
                    p.details.append(f"{trigger}: {detail}")
                return
        last = self.last_fired.get(trigger)
        while self.fired_hour and now - self.fired_hour[0] > 3600 * NS:
            self.fired_hour.popleft()
        if not force and ((last is not None and now - last < opts.cooldown_ns)
                          or len(self.fired_hour) >= opts.max_per_hour):
            self.state.suppressed[trigger] = self.state.suppressed.get(trigger, 0) + 1
            return
        self.last_fired[trigger] = now
        self.fired_hour.append(now)
        if force:  # the kept window, now
            self.pending.append(Pending(trigger, ts, [detail], now, now - self.kept()))
            return
        start = max(ts - opts.before_ns, now - self.kept())
        self.pending.append(Pending(trigger, ts, [f"{trigger}: {detail}"], max(ts, now) + opts.after_ns, start))

    def save_due(self, now: int) -> None:
        for p in [p for p in self.pending if now >= p.due]:
            self.pending.remove(p)
            self.save(p, now)

    def save(self, p: Pending, end: int, background: bool = True) -> None:
        self.folder.mkdir(exist_ok=True)
        out = self.folder / incident_name(p.ts + self.wall_offset, p.trigger)
        detail = "; ".join(p.details)
        session = self.session
        if self._saver:
            self._saver.join()  # one copy at a time
        if background:
            # the calls in flight now become open rows (open = 1) that the copy takes along; at the
            # stop the session's last drain has written them already
            session.write_open_rows(end)
            session.writer.flush()  # the open rows are queued statements: hand them over
            session.writer.sync()  # the window's rows are committed before the copy reads them

        def work() -> None:
            try:
                row = save_incident(session.db_path, out, session.session_id, p.start, end, trigger=p.trigger,
                                    detail=detail, ts=p.ts)
            except (UserError, sqlite3.Error, OSError) as e:
                self.state.note_error(f"saving {out.name}: {e}")
                return
            with self._lock:
                self._results.append(row)
            print(f"recorder: incident saved: {out} ({row['rows']} rows; {detail})", flush=True)
            self._announce(p, out, detail)

        if background:
            self._saver = threading.Thread(target=work, name="stall-incident", daemon=True)
            self._saver.start()
        else:
            work()

    def _announce(self, p: Pending, out: Path, detail: str) -> None:
        """Explain the incident just saved (for the metrics) and run --on-incident on it."""
        facts = incident_facts(out)
        unix_ns = p.ts + self.wall_offset
        last = {"trigger": p.trigger, "file": str(out), "unix": unix_ns / NS, **facts}
        with self._lock:
            self.state.last = last
            if facts["stall"]:
                self.state.last_stall = last
        if self.hook:
            summary = incident_summary(p.trigger, unix_ns, socket.gethostname(), facts, detail)
            self.hook.run(str(out), summary, {
                "STALL_RECORDER_INCIDENT_TRIGGER": p.trigger, "STALL_RECORDER_DB": str(self.session.db_path),
                "STALL_RECORDER_INCIDENT_CAUSE": facts["cause_kind"] or "",
                "STALL_RECORDER_INCIDENT_STEP": "" if facts["step"] is None else str(facts["step"])})
        if self.shipper:
            self.shipper.ship(out)

    def wait(self) -> None:
        """The copy under way, the commands and the uploads still running, given their time."""
        if self._saver:
            self._saver.join()
        if self.hook:
            self.hook.wait()
        if self.shipper:
            self.shipper.finish()

    def abandon(self) -> None:
        """The copy under way ends; the incidents waiting are not saved."""
        if self._saver:
            self._saver.join()
        self.pending.clear()

    def collect_saved(self, direct: Store | None = None) -> None:
        """List the incidents saved since the last call in the recording: through the writer while
        recording, into `direct` once it is closed."""
        with self._lock:
            results, self._results = self._results, []
        if results and direct is None and not (self._saver and self._saver.is_alive()):
            # the open rows a save drained were for its copy: while recording, calls in flight
            # are in the BPF maps, not in the tables (the stop's drain writes them for good)
            self.session.drop_open_rows()
        for row in results:
            self.state.saved.append(row)
            values = (row["session_id"], row["ts"], row["trigger"], row["detail"], row["start_ts"], row["end_ts"],
                      row["file"])
            if direct is not None:
                direct.conn.execute("INSERT INTO incident (session_id, ts, trigger, detail, start_ts, end_ts, file) "
                                    "VALUES (?, ?, ?, ?, ?, ?, ?)", values)
                direct.conn.commit()
            else:
                self.session.writer.add("incident", values)

    def last(self) -> tuple[dict | None, dict | None]:
        """The last incident saved and the last that found a stall (the announcing thread sets them)."""
        with self._lock:
            return self.state.last, self.state.last_stall
