"""The flight recorder: a session that keeps only its last minutes and saves the incidents by itself.

`recorder start --keep 10m` runs a normal session whose Writer also deletes what fell out of the
window (store/flight/__init__.py); once a second `FlightRecorder.tick()` looks for a trigger in what was
just written (a stalled step by the report's stall rule, marked or, for a process that marks none,
inferred live as the report infers them (recorder/steps_live.py); on a thread with no steps either
way a CUDA call slow against its own baseline (recorder/slow_calls.py); a kernel-log device error or
OOM kill) and in the BPF maps of calls in flight (a CUDA or NCCL call in flight longer than --hang). A trigger
saves [its time - before, its time + after] into <db>.incidents/<UTC time>-<trigger>.db once the
after part has been recorded; the copy runs in a thread of its own so the ring buffers keep being
drained. SIGUSR1 saves the kept window at once (trigger 'signal').

Trigger storms: a trigger that fires while an incident is waiting for its after part joins it
(named in its detail); each trigger kind fires at most once per `cooldown`, and at most
`max_per_hour` incidents are saved per hour; the rest are counted in the status file.

Telling someone: each incident saved is explained (its step and primary cause kind, kept for the
metrics file of recorder/metrics.py) and handed to the `--on-incident` command
(recorder/incident_hook.py) with a one-line summary.
"""

from __future__ import annotations

import datetime as dt
import queue
import socket
import sqlite3
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from recorder.core.clock import now_ns
from recorder.incident_hook import HookOptions, IncidentHook
from recorder.slow_calls import SlowCallWatch
from recorder.steps_infer import infer_steps
from recorder.steps_live import InferredStepWatch
from store.db import Store, open_store, sqlite_uri
from store.db.rules import StallRule, slow_call_rule, stall_rule
from store.errors import UserError
from store.flight import (
    SECURE_DELETE_FAST,
    Retention,
    SizeBound,
    event_tables,
    file_bytes,
    incidents_dir,
    save_window,
    used_bytes,
    wal_bytes,
)
from store.text import without_controls

NS = 1_000_000_000
SHIP_WAIT_S = 60.0  # at stop, how long the incidents still to upload are waited for, in all
VACUUM_PAGES_PER_TICK = 1024  # 4 MB a second at 4 KiB pages
ROW_BYTES = 160  # what a row takes in the database, at most, for the backstop's estimate of a piece
SIZED_INTERVAL_NS = NS // 10  # under --max-size the window is kept at every batch, not every second
TRIGGERS = ("stall", "hung-call", "nvme", "io-error", "xid", "aer", "oom")
# kernel-log and memory tables a trigger watches: (table, trigger, condition on its rows)
WATCHED = (
    ("nvme_event", "nvme", "kind <> 'power_saving_hint'"),
    ("block_error", "io-error", "1"),
    ("gpu_xid", "xid", "1"),
    ("aer_event", "aer", "1"),
    ("oom_kill", "oom", "1"),
    ("oom_victim", "oom", "1"),
)


@dataclass(frozen=True)
class FlightOptions:
    keep_ns: int                         # the window kept
    max_bytes: int | None = None         # and at most this much on disk (the window shrinks to fit)
    before_ns: int = 60 * NS             # an incident covers its trigger's time - before ...
    after_ns: int = 30 * NS              # ... to + after
    hang_ns: int = 30 * NS               # a CUDA/NCCL call in flight this long is a hang
    triggers: frozenset[str] = frozenset(TRIGGERS)
    cooldown_ns: int = 300 * NS          # one incident per trigger kind per cooldown
    max_per_hour: int = 12               # and at most this many incidents an hour
    hook: HookOptions | None = None      # --on-incident: run for every incident saved
    ship: str | None = None              # --ship: the object store (s3://...) every incident is uploaded to

    def check(self) -> None:
        if self.keep_ns < 10 * NS:
            raise UserError("--keep must be at least 10s: pass e.g. --keep 10m")
        if self.before_ns + self.after_ns + 5 * NS > self.keep_ns:
            raise UserError(f"--keep {self.keep_ns // NS}s is shorter than an incident (--before "
                            f"{self.before_ns // NS}s + --after {self.after_ns // NS}s + 5s): keep more or "
                            "save less")
        if self.max_bytes is not None and self.max_bytes < 16_000_000:
            raise UserError("--max-size must be at least 16MB: pass e.g. --max-size 2GB")
        unknown = self.triggers - set(TRIGGERS)
        if unknown:
            raise UserError(f"no trigger {', '.join(sorted(unknown))}: choose from {', '.join(TRIGGERS)}")
        if self.hook:
            self.hook.check()
        if self.ship:
            from store import objectstore

            objectstore.check_url(self.ship)

    def describe(self) -> dict:
        return {"keep_s": self.keep_ns / NS, "max_bytes": self.max_bytes, "before_s": self.before_ns / NS,
                "after_s": self.after_ns / NS, "hang_s": self.hang_ns / NS, "triggers": sorted(self.triggers),
                "cooldown_s": self.cooldown_ns / NS, "max_per_hour": self.max_per_hour,
                "on_incident": self.hook.command if self.hook else None, "ship": self.ship}


_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'500MB', '2GiB', '1g' -> bytes."""
    t = text.strip().lower()
    digits = t.rstrip("abgikmt")
    unit = t[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1
    if value <= 0 or unit not in _SIZE_UNITS:
        raise UserError(f"cannot read size {text!r}: write e.g. 500MB, 2GB or 1GiB")
    return int(value * _SIZE_UNITS[unit])


def vacuum_statements(pages: int) -> list[str]:
    """Statements that give `pages` free pages back to the file system. sqlite3 steps a statement
    that returns no rows once, and PRAGMA incremental_vacuum frees one page per step: one statement
    per page (a few microseconds each)."""
    return ["PRAGMA incremental_vacuum(1)"] * pages


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


class FlightRecorder:
    """Keeps a session's window and saves its incidents. Driven by the Session: start() once the
    session is written, tick() every second, finish() at stop."""

    def __init__(self, session, options: FlightOptions) -> None:
        self.session = session
        self.options = options
        self.keep_now = options.keep_ns  # shrinks while the database is above --max-size
        self.bound = SizeBound(options.max_bytes, options.keep_ns) if options.max_bytes else None
        self._last_keep = 0
        self._cut: int | None = None  # the cutoff the writer's backstop last applied (ns), until keep() reads it
        self._pages: tuple[int, int] | None = None  # (bytes in use, bytes free) as the writer last saw them
        self._page_size = 4096
        self._last_handed = 0
        self._row_rate = 0.0  # rows a second handed to the writer, smoothed
        self.short_since: int | None = None  # the window is shorter than --keep because of the size
        self.shortest: int | None = None
        self.state = FlightState()
        self.pending: list[Pending] = []
        self.last_fired: dict[str, int] = {}
        self.fired_hour: deque[int] = deque()
        self.seen_calls: set[tuple[str, int, int]] = set()
        self.dump_requested = False
        self._saver: threading.Thread | None = None
        self._results: list[dict] = []
        self._lock = threading.Lock()
        self._monitor: sqlite3.Connection | None = None
        self._last_id: dict[str, int] = {}
        self._steps: dict[int, tuple[int, int, deque[int]]] = {}
        self._rule: StallRule  # the report's stall rule, read at start()
        self._calls: SlowCallWatch | None = None  # the stall trigger of threads with no steps
        self._inferred: InferredStepWatch | None = None  # and of processes whose steps are inferred
        self.folder = incidents_dir(session.db_path)
        self.hook = IncidentHook(options.hook) if options.hook else None
        # --ship: one thread uploads the incidents in turn (an export is CPU work: never several at once)
        self._to_ship: queue.Queue[Path | None] = queue.Queue()
        self._shipper: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self.session.writer.sync()
        self._monitor = sqlite3.connect(sqlite_uri(self.session.db_path, mode="ro"), uri=True,
                                        check_same_thread=False)
        self._monitor.execute("PRAGMA busy_timeout = 2000")
        tables = event_tables(self._monitor)
        # what earlier sessions left in the file is theirs: the window only applies to this one
        floors = {t: self._monitor.execute(f'SELECT coalesce(max(id), 0) FROM "{t}"').fetchone()[0]
                  for t in tables}
        self.retention = Retention(tables, floors=floors)
        for sql in self.retention.setup:
            self.session.writer.execute(sql)
        if self.bound:
            page = self._page_size = self._monitor.execute("PRAGMA page_size").fetchone()[0]
            for sql in self.bound.pragmas(page):
                self.session.writer.execute(sql)
            # a burst (the rings' backlog) in transactions the log's share holds (~100 bytes a row)
            self.session.writer.txn_rows = max(self.bound.wal_bytes // 4 // ROW_BYTES, 500)
            self.session.writer.wal_limit = self.bound.wal_bytes
            self.retention.chunk_rows = self.session.writer.txn_rows  # a deletion's pages go to the log too
        else:
            self.session.writer.execute("PRAGMA journal_size_limit = 67108864")  # the log shrinks after a burst
            self.session.writer.execute(SECURE_DELETE_FAST)  # pruning writes no freed page to the log
        self.session.writer.execute("INSERT OR REPLACE INTO flight_window (session_id, keep_ns, max_bytes) "
                                    "VALUES (?, ?, ?)", (self.session.session_id, self.options.keep_ns,
                                                         self.options.max_bytes))
        self.session.writer.flush()  # the mark table exists before the first deletion runs
        self.session.writer.sync()
        if self.bound:
            self.session.writer.make_room = self._make_room
        for table, _, _ in WATCHED + (("step_mark", "", ""),):
            self._last_id[table] = self._monitor.execute(
                f"SELECT coalesce(max(id), 0) FROM {table}").fetchone()[0]
        self._rule = stall_rule(Store(self.session.db_path, self._monitor, True))
        self._calls = SlowCallWatch(self._monitor, self.session.session_id,
                                    slow_call_rule(Store(self.session.db_path, self._monitor, True)), self._rule)
        self.sid = sid = self.session.session_id
        self.wall_offset = self._monitor.execute("SELECT wall_offset_ns FROM session WHERE id = ?",
                                                 (sid,)).fetchone()[0]
        self._inferred = InferredStepWatch(self._monitor, sid, self._rule, self.wall_offset)

    def tick(self) -> None:
        """Once a second: keep the window, watch the triggers, save what is due."""
        now = now_ns()
        self._collect_saved()
        if self.bound is None:
            self.keep(now)
        elif self.short_since is not None:
            self.session.writer.execute(
                "UPDATE flight_window SET shortest_ns = ?1, first_short_ts = coalesce(first_short_ts, ?2), "
                "last_short_ts = ?3 WHERE session_id = ?4", (self.shortest, self.short_since, now, self.sid))
        try:
            self._watch(now)
        except sqlite3.Error as e:  # a busy moment of the writer: look again next second
            self._note_error(f"trigger check: {e}")
        if self.dump_requested:
            self.dump_requested = False
            self._fire("signal", now, "SIGUSR1: the kept window saved on request", force=True)
        for p in [p for p in self.pending if now >= p.due]:
            self.pending.remove(p)
            self._save(p, now)

    def finish(self, stop: int) -> None:
        """At stop: save the incidents still waiting (their window ends at the stop)."""
        for p in self.pending:
            self._save(p, stop, background=False)
        self.pending.clear()
        if self._saver:
            self._saver.join()
        if self.hook:
            self.hook.wait()
        if self._shipper:  # uploads still under way get their retries; what the store does not take stays spooled
            self._to_ship.put(None)
            self._shipper.join(timeout=SHIP_WAIT_S)
            left = []
            while not self._to_ship.empty():
                out = self._to_ship.get_nowait()
                if out is not None:
                    left.append(out)
            if self._shipper.is_alive() or left:
                names = ", ".join(o.name for o in left) or "the one under way"
                self._note_error(f"--ship: not all incidents were uploaded within {SHIP_WAIT_S:g} s of the stop "
                                 f"({names}): upload each with 'recorder export --parquet {self.options.ship} "
                                 f"--db INCIDENT'")
        held = ", ".join(f"{n} {t}" for t, n in sorted(self.state.suppressed.items()))
        if held:
            print(f"recorder: flight recorder: triggers held back by the rate limit (one incident per trigger per "
                  f"{self.options.cooldown_ns / NS:g} s, {self.options.max_per_hour} an hour): {held}", flush=True)
        if self._monitor:
            self._monitor.close()

    def abandon(self) -> None:
        """The disk took no more: incidents waiting are not saved (they would need room too)."""
        if self._saver:
            self._saver.join()
        self.pending.clear()
        if self._monitor:
            self._monitor.close()
            self._monitor = None

    def store_saved(self, store: Store) -> None:
        """List the incidents saved in the recording (after the writer is closed)."""
        self._collect_saved(direct=store)

    # -- the window -------------------------------------------------------------------------------
    def keep(self, now: int) -> None:
        """Delete what fell out of the window: once a second from tick(), and under --max-size at
        every batch (the session's flush), so a high event rate cannot outrun the bound."""
        if self._monitor is None:
            return
        opts = self.options
        if self.bound is not None:
            elapsed = now - self._last_keep
            if elapsed < SIZED_INTERVAL_NS * 9 // 10:
                return
            # the pages as the writer saw them before its last insert (no read of the file here: a
            # reader ten times a second holds the log back from its checkpoints)
            used, free = self._pages or used_bytes(self._monitor)
            wal = wal_bytes(self.session.db_path)
            span = now - self.session.started_ts
            writer = self.session.writer
            handed = writer.rows_handed + writer.pending()
            if self._last_keep:
                rate = (handed - self._last_handed) * NS / max(elapsed, 1)
                self._row_rate = rate if not self._row_rate else 0.7 * self._row_rate + 0.3 * rate
            self._last_handed = handed
            lag = int((handed - writer.rows_written) * NS / self._row_rate) if self._row_rate else 0
            cut, self._cut = self._cut, None
            if cut is not None:  # the backstop deleted rows the window still held: it is that short now
                self.keep_now = min(self.keep_now, max(self.bound.min_keep_ns, now - cut))
            self.keep_now = self.bound.next_keep(self.keep_now, span, used, wal, min(elapsed, NS), min(lag, 10 * NS))
            for sql in vacuum_statements(self.bound.pages_to_give_back(used, free, wal, self._page_size)):
                self.session.writer.execute(sql)
            if self.keep_now < opts.keep_ns:
                self.short_since = self.short_since or now
                self.shortest = min(self.shortest or self.keep_now, self.keep_now)
            elif self.short_since is not None:
                self.short_since = None
        else:
            used, free = used_bytes(self._monitor)
            if free > max(used // 4, 8 << 20):  # a burst left many pages free: give them back
                for sql in vacuum_statements(VACUUM_PAGES_PER_TICK):
                    self.session.writer.execute(sql)
        self._last_keep = now
        # deleted before the batch's rows are inserted: they reuse the pages freed
        for sql, params, until_done in self.retention.statements(now, now - self.keep_now):
            self.session.writer.execute_first(sql, params, until_done=until_done)

    def _make_room(self, conn: sqlite3.Connection, rows: int) -> None:
        """The writer's backstop under --max-size (Retention.make_room), before each piece it inserts."""
        bound = self.bound
        assert bound is not None  # the writer calls this only under --max-size (start())
        room = int(bound.room(wal_bytes(self.session.db_path)) * 0.9)
        cut = self.retention.make_room(conn, room, rows * ROW_BYTES, commit=self.session.writer.commit_piece)
        if cut is not None:
            self._cut = cut if self._cut is None else max(self._cut, cut)
        self._pages = used_bytes(conn)

    def status(self) -> dict:
        window = None
        if self._monitor is not None:
            try:  # the oldest row kept, found by its id (no index on ts while recording)
                window = self._monitor.execute(
                    "SELECT ts FROM offcpu_interval WHERE id = (SELECT min(id) FROM offcpu_interval WHERE id > ?)",
                    (self.retention.floors.get("offcpu_interval", 0),)).fetchone()
                window = window[0] if window else None
            except sqlite3.Error:
                pass
        now = now_ns()
        return {
            **self.options.describe(),
            "kept_s": round(self.keep_now / NS, 1),
            # the window is shorter than --keep: --max-size holds no more at this event rate
            "short_by_size": self.short_since is not None,
            "shortest_kept_s": round(self.shortest / NS, 1) if self.shortest else None,
            "oldest_event_s": round((now - window) / NS, 1) if window else None,  # None: no event kept yet
            "db_file_bytes": file_bytes(self.session.db_path),
            "incidents_dir": str(self.folder),
            "incidents": [{k: r[k] for k in ("trigger", "file", "detail", "rows", "bytes")}
                          for r in self.state.saved],
            "pending": [{"trigger": p.trigger, "due_in_s": round((p.due - now) / NS, 1)} for p in self.pending],
            "suppressed": dict(self.state.suppressed),
            "errors": self.state.errors[-5:],
            "hook": {"runs": self.hook.runs, "failures": self.hook.failures} if self.hook else None,
        }

    # -- triggers ---------------------------------------------------------------------------------
    def _watch(self, now: int) -> None:
        mon = self._monitor
        if mon is None:  # not started, or closed
            return
        trig = self.options.triggers
        for table, trigger, cond in WATCHED:
            rows = mon.execute(
                f"SELECT e.id, e.ts, coalesce(k.text, '') FROM {table} e "
                f"LEFT JOIN kernel_log k ON k.id = {'e.kernel_log_id' if table != 'oom_victim' else 'NULL'} "
                f"WHERE e.id > ? AND e.session_id = ? AND {cond} ORDER BY e.id",
                (self._last_id[table], self.sid)).fetchall()
            if rows:
                self._last_id[table] = rows[-1][0]
            if trigger in trig:
                for _, ts, text in rows:
                    self._fire(trigger, ts, f"{table}: {text}" if text else table)
        marks = mon.execute("SELECT id, thread_id, ts, step FROM step_mark WHERE id > ? AND session_id = ? "
                            "ORDER BY id", (self._last_id["step_mark"], self.sid)).fetchall()
        if marks:
            self._last_id["step_mark"] = marks[-1][0]
        for _, thread_id, ts, step in marks:
            self._step(thread_id, ts, step)
        if "stall" in trig and self._calls and self._inferred:
            # a process that marks no steps: its steps inferred as the report infers them; a
            # thread with neither marked nor inferred steps: its calls slow against their baseline
            for ts, detail in self._inferred.check(now, self._steps):
                self._fire("stall", ts, detail)
            for ts, detail in self._calls.check(self._steps.keys() | self._inferred.stepping()):
                self._fire("stall", ts, detail)
        if "hung-call" in trig:
            for table, api, tid, ts in self.in_flight():
                age = now - ts
                key = (table, tid, ts)
                if age >= self.options.hang_ns and key not in self.seen_calls:
                    self.seen_calls.add(key)
                    self._fire("hung-call", now, f"{api} in flight for {age / NS:.1f} s on thread {tid} "
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
                    self._fire("stall", ts, f"step {prev_step} took {dur / 1e6:.0f} ms, {dur / median:.1f}x the "
                                            f"median of the {len(durs)} steps before ({median / 1e6:.0f} ms; a stall "
                                            f"is {rule.text()})")
            durs.append(dur)
        else:
            durs = deque(maxlen=max(rule.neighbours, rule.min_baseline_steps))
        self._steps[thread_id] = (ts, step, durs)

    def in_flight(self) -> list[tuple[str, str, int, int]]:
        """(table, API name, tid, entry ts) of the CUDA and NCCL calls in flight now, from the BPF maps
        of calls entered and not yet returned (a thread gone is no call in flight)."""
        from recorder.core.inflight import in_flight
        from recorder.layers.cuda.apis import APIS as CUDA_APIS
        from recorder.layers.workload.nccl import APIS as NCCL_APIS

        out = []
        bpf = self.session.probes.bpf
        for map_name, table, names in (("cuda_inflight", "cuda_call", CUDA_APIS),
                                       ("nccl_inflight", "nccl_call", NCCL_APIS)):
            for call in in_flight(bpf, map_name, delete=False):
                # a CUDA record names its API (launches share one key per thread)
                api = call.record.api if map_name == "cuda_inflight" else call.api
                if call.pid is None or call.record.ts == 0 or api >= len(names):
                    continue
                out.append((table, names[api].name, call.tid, call.record.ts))
        return out

    def _fire(self, trigger: str, ts: int, detail: str, force: bool = False) -> None:
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
            self.pending.append(Pending(trigger, ts, [detail], now, now - self.keep_now))
            return
        start = max(ts - opts.before_ns, now - self.keep_now)
        self.pending.append(Pending(trigger, ts, [f"{trigger}: {detail}"], max(ts, now) + opts.after_ns, start))

    # -- saving -----------------------------------------------------------------------------------
    def _save(self, p: Pending, end: int, background: bool = True) -> None:
        self.folder.mkdir(exist_ok=True)
        out = self.folder / incident_name(p.ts + self.wall_offset, p.trigger)
        detail = "; ".join(p.details)
        if self._saver:
            self._saver.join()  # one copy at a time
        if background:
            # the calls in flight now become open rows (open = 1) that the copy takes along; at the
            # stop the session's last drain has written them already
            self.session.drain_in_flight(end, final=False)
            self.session.writer.flush()  # the open rows are queued statements: hand them over
            self.session.writer.sync()  # the window's rows are committed before the copy reads them

        def work() -> None:
            try:
                row = save_incident(self.session.db_path, out, self.sid, p.start, end, trigger=p.trigger,
                                    detail=detail, ts=p.ts)
            except (UserError, sqlite3.Error, OSError) as e:
                self._note_error(f"saving {out.name}: {e}")
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
        if self.options.ship:
            self._ship(out)

    def _ship(self, out: Path) -> None:
        """--ship: queue the incident for the shipper thread (started with the first one)."""
        self._to_ship.put(out)
        if self._shipper is None:
            self._shipper = threading.Thread(target=self._ship_all, name="stall-ship", daemon=True)
            self._shipper.start()

    def _ship_all(self) -> None:
        """Upload each queued incident (its file and its Parquet export), oldest first."""
        from store.exports.parquet import ship_incident
        from store.objectstore import spool_folder

        spool = spool_folder(self.session.db_path)
        ship = self.options.ship
        assert ship is not None  # this thread runs only with --ship (_save)
        while (out := self._to_ship.get()) is not None:
            began = time.monotonic()
            try:
                result = ship_incident(out, ship, socket.gethostname(), spool)
            except (UserError, sqlite3.Error, OSError, ValueError) as e:  # this incident; the thread goes on
                self._note_error(f"shipping {out.name}: {e}")
                continue
            for line in result.get("quarantined", []):  # an entry that failed a check, set aside
                self._note_error(f"shipping: {line}")
            if result["pending"]:
                self._note_error(f"shipping {out.name}: the store did not take it ({result['error']}); "
                                 f"{result['pending']} upload(s) kept in {result['spool']} for the next incident")
            else:
                print(f"recorder: incident shipped: {out.name} to {result['url']} in "
                      f"{time.monotonic() - began:.1f} s"
                      + (f" (and {len(result['uploaded']) - 2} spooled upload(s))" if len(result["uploaded"]) > 2
                         else ""), flush=True)

    def metrics(self) -> dict:
        """What recorder/metrics.py writes of the flight recorder."""
        saved: dict[str, int] = dict.fromkeys((*sorted(self.options.triggers), "signal"), 0)
        for row in self.state.saved:
            saved[row["trigger"]] = saved.get(row["trigger"], 0) + 1
        with self._lock:
            last, last_stall = self.state.last, self.state.last_stall
        return {"saved": saved, "suppressed": dict(self.state.suppressed), "errors": len(self.state.errors),
                "kept_s": self.keep_now / NS, "keep_s": self.options.keep_ns / NS,
                "hook_runs": self.hook.runs if self.hook else 0,
                "hook_failures": self.hook.failures if self.hook else 0,
                "last": last, "last_stall": last_stall}

    def _collect_saved(self, direct: Store | None = None) -> None:
        with self._lock:
            results, self._results = self._results, []
        if results and direct is None and not (self._saver and self._saver.is_alive()):
            # the open rows a save drained were for its copy: while recording, calls in flight
            # are in the BPF maps, not in the tables (the stop's drain writes them for good)
            for table in ("cuda_call", "nccl_call"):
                self.session.writer.execute(f"DELETE FROM {table} WHERE session_id = ? AND open = 1", (self.sid,))
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

    def _note_error(self, text: str) -> None:
        self.state.errors.append(text)
        print(f"recorder: flight recorder: {text}", flush=True)

