"""One recording session: open the store, attach the probes, move events into SQLite, stop cleanly.

The loop polls the BPF ring buffers, keeps the raw records of each kind in a list (a callback does
no more than copy bytes), and every 100 ms turns them into rows and writes them in one transaction.
Once a second it stores what was dropped, rescans the targets for newly mapped libraries and
refreshes the status file `recorder status` reads. A SIGKILL at any moment leaves a valid database
(WAL) whose session reads as incomplete.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from recorder.core.capability import CAPABILITY_COLUMNS
from recorder.core.clock import now_ns
from recorder.core.identity import Identity
from recorder.core.layer import Context, Layer, Phase, ProcessHooks
from recorder.core.loader import Probes, TargetSpec
from recorder.core.participant import SessionHandle
from recorder.core.processes import (
    all_processes,
    cgroup_members,
    check_target_pid,
    is_kernel_thread,
    tree,
    worth_configuring,
)
from recorder.core.settings import Settings
from recorder.core.stacks import OBSERVES as PYTHON_OBSERVES
from recorder.core.stacks import StackRecorder
from recorder.errors import TargetError, UserError
from recorder.flight import FlightOptions, FlightRecorder, Window
from recorder.layers import LAYERS, definitions
from recorder.metrics import MetricsFile, Snapshot, collect, loss_layer, render
from recorder.metrics_http import ListenOptions, MetricsListener
from recorder.recording_files import (
    already_recording,
    give_back_reserve,
    make_reserve,
    session_summary,
    status_path,
)
from recorder.steps_infer import infer_steps
from recorder.workload_metrics import WorkloadWatch
from store.db import Store, Writer, WriterLimits, cannot_write, lock_path, open_store
from store.db.rules import slow_call_rule, stall_rule
from store.flight import file_bytes

VERSION = "0.1.0"
# the session's own `loss.probe` word: (layer, kind, word, what, why) of layer_vocabulary
UNEXPECTED_SIZE = ("recorder", "loss", "ring record of unexpected size", "ring records", "unexpected size")
FLUSH_INTERVAL_S = 0.1
HOUSEKEEPING_INTERVAL_S = 1.0


def vocabulary(layers: Sequence[Layer]) -> list[tuple[str, str, str, str, str]]:
    """The rows of `layer_vocabulary` a session of `layers` (or of their classes: the words are class
    attributes) writes at its start, less its id: (layer, kind, word, what, why) of the loss words
    (kind 'loss': a `loss.probe`, what was lost and why) and of the capability words reports list
    (kind 'capability': a `capability.layer` word and what it observes; layer and word are the same,
    why is empty), the layers' and the session's own."""
    rows = [(loss.layer, "loss", loss.probe, loss.what, loss.why) for layer in layers for loss in layer.losses]
    rows.append(UNEXPECTED_SIZE)
    words = [word for layer in layers for word in layer.observes] + [PYTHON_OBSERVES]  # the stack recorder's
    rows += [(word.layer, "capability", word.layer, word.what, "") for word in words]
    return rows


@dataclass
class Counters:
    started: float = field(default_factory=time.monotonic)
    events: dict[str, int] = field(default_factory=lambda: {"offcpu": 0, "cuda": 0, "task": 0})
    last_events: dict[str, int] = field(default_factory=dict)
    rate: dict[str, float] = field(default_factory=dict)
    dropped: int = 0
    last_tick: float = field(default_factory=time.monotonic)


class Session:
    """A recording in progress. Use `Session.begin(...)`, then `run()` and `finish()`.

    The session owns what no layer owns (the lock, the session row, the writer, the thread identity,
    the stack recorder, finding target processes) and drives every layer of the registry
    (recorder/layers/__init__.py `LAYERS`) through the hooks of recorder/core/layer.py, naming none:
    the layers' order is the registry's, each batch's is their `flush_phase` (`flush()`).
    """

    def __init__(self, db: Path, target: TargetSpec, cuda_libs: tuple[str, ...], command: str,
                 described_target: str | None = None,
                 settings: Settings | None = None, flight: FlightOptions | None = None,
                 metrics_file: Path | None = None, metrics_listen: ListenOptions | None = None) -> None:
        self.db_path = db
        self.target = target
        self.cuda_libs = cuda_libs
        self.command = command
        self.described_target = described_target or target.describe()
        self.store: Store  # from begin() on, as are the BPF object, the writer, the context and the stacks
        self.probes: Probes
        self._lock_file: IO[str] | None = None
        self.counters = Counters()
        self.pystacks: list[bytes] = []  # raw Python stack records, for the stack recorder
        self.known_pids: set[int] = set()
        # processes of a tree, cgroup or --all target looked at (configured or not worth it), so
        # that the rescan reads the maps of the new ones only
        self.checked: set[int] = set()
        self.stopping = False
        self.settings = settings
        self.layers: list[Layer] = []
        self.flight_options = flight
        self.flight: FlightRecorder | None = None  # with --keep: the window kept, incidents saved
        self.metrics = MetricsFile(metrics_file) if metrics_file else None  # --metrics-file
        # --metrics-listen: /metrics over HTTP(S); its checks run here, before anything is attached
        self.listener = MetricsListener(metrics_listen) if metrics_listen else None
        self.rank_metrics: WorkloadWatch | None = None  # the workload's metrics, with either of the two
        self._rank_metrics_db: sqlite3.Connection | None = None
        self.dropped_by_layer: dict[str, int] = {}

    # -- start ------------------------------------------------------------------------------------
    def begin(self) -> dict:
        """Lock, create the session, attach everything; returns the attach summary."""
        settings = self.settings or Settings.from_environment()
        self._take_lock()
        for pid in (*self.target.pids, *self.target.trees):
            check_target_pid(pid)
        if self.listener:
            self.listener.start()  # a port taken is refused before anything is recorded
        self.store = open_store(self.db_path, create=True)
        started = now_ns()
        wall = time.time_ns() - started
        uname = os.uname()
        self.session_id: int = self.store.db.table("session").insert({
            "started_ts": started, "wall_offset_ns": wall, "status": "recording",
            "recorder_pid": os.getpid(), "hostname": socket.gethostname(),
            "kernel_release": uname.release, "boot_id": _boot_id(), "cpu_count": os.cpu_count() or 0,
            "target": self.described_target, "command": self.command, "tool_version": VERSION,
        }).last_pk  # type: ignore[assignment]  # the row's id: an insert of one row always has it
        self.store.conn.commit()
        self.started_ts = started
        # a flight recording's window bounds the writer (its limits are set where it is made)
        window = Window(self.flight_options) if self.flight_options else None
        self.writer = Writer(self.store, background=True, limits=window.writer_limits() if window else WriterLimits())
        self.writer.table("capability", CAPABILITY_COLUMNS)
        self.writer.table("loss", ("session_id", "ts", "probe", "dropped"))
        self.writer.table("library", ("session_id", "path", "kind", "first_ts", "found_by"))
        self.writer.table("incident", ("session_id", "ts", "trigger", "detail", "start_ts", "end_ts", "file"))
        self.writer.table("layer_vocabulary", ("session_id", "layer", "kind", "word", "what", "why"))
        self.identity = Identity(self.store, self.writer, self.session_id)
        self.context = Context(self.store, self.writer, self.session_id, started, self.identity,
                               self.counters.events, settings=settings,
                               processes=ProcessHooks(scan=self._scan_process, known=self.known_pids.__contains__,
                                                      exited=self._process_exited, dlopen=self._dlopen))
        self.layers = [layer(self.context) for layer in LAYERS]
        self._write_vocabulary()
        for layer in self.layers:
            layer.prepare()
        try:
            self.probes = Probes(self.target, [s for layer in self.layers for s in layer.sources],
                                 [text for layer in self.layers if (text := layer.bpf_text())], settings,
                                 definitions=definitions())
        except UserError:
            self._abandon()
            raise
        self.stacks = StackRecorder(self.store, self.writer, self.session_id, self.probes)
        self.context.probes, self.context.stacks = self.probes, self.stacks
        for pid in self._members():
            if self.target.pids or self.target.trees:
                self.probes.add_pid(pid)
        for layer in self.layers:
            layer.attach()
        for path in self.cuda_libs:
            if not Path(path).exists():
                raise TargetError(f"--cuda-lib {path} does not exist: pass the path of libcudart.so, libcuda.so "
                                  "or libnccl.so")
            any(layer.named_library(path) for layer in self.layers)  # the first that takes it
        sinks = {"pystacks": self.pystacks.append}
        blocks: dict[str, int] = {}
        for layer in self.layers:
            sinks.update(layer.sinks())
            blocks.update(layer.blocks())
        self.probes.open_rings(sinks, blocks=blocks)
        for pid in self.target.pids:
            self._attach_process(pid, "maps", started, worth_configuring(pid))
        self._rescan_members("maps")
        try:
            for layer in self.layers:
                layer.start()
        except UserError:
            self._abandon()
            raise
        self._store_capabilities()
        self.writer.flush()
        # what the participants that are not layers get of the session (recorder/core/participant.py)
        self.handle = SessionHandle(self.db_path, self.session_id, started, self.writer, self.layers)
        if self.flight_options and window:
            self.flight = FlightRecorder(self.handle, self.flight_options, window)
            self.flight.start()
        self.started_unix = time.time()
        if self.metrics or self.listener:
            self._start_rank_metrics()
        self.write_metrics(force=True)
        return self.summary_at_start()

    def _start_rank_metrics(self) -> None:
        """The workload's metrics (recorder/workload_metrics.py), read from a connection of their own."""
        self.writer.sync()
        conn = self._rank_metrics_db = self.handle.connect()
        wall = conn.execute("SELECT wall_offset_ns FROM session WHERE id = ?", (self.session_id,)).fetchone()[0]
        handle = self.handle
        reading = Store(self.db_path, conn, True)
        self.rank_metrics = WorkloadWatch(conn, self.session_id, stall_rule(reading), socket.gethostname(), wall,
                                          lambda: handle.in_flight("nccl_call"), slow_call_rule(reading))

    def _close_rank_metrics(self) -> None:
        if self._rank_metrics_db is not None:
            self._rank_metrics_db.close()
            self._rank_metrics_db = None

    def in_phase_order(self) -> list[Layer]:
        """The layers in the order of their `flush_phase`, registry order within one."""
        return sorted(self.layers, key=lambda layer: layer.flush_phase)

    def _write_vocabulary(self) -> None:
        """Every word the layers (and the session) write into `loss` and `capability`, with what it
        means, for the report."""
        self.writer.extend("layer_vocabulary", [(self.session_id, *row) for row in vocabulary(self.layers)])
        self.loss_layers = {loss.probe: loss.layer for layer in self.layers for loss in layer.losses}

    def _take_lock(self) -> None:
        path = lock_path(self.db_path)
        try:
            f = path.open("a+")
        except OSError as e:
            raise UserError(f"cannot create {path} ({e.strerror}): pass a writable --db path") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise already_recording(self.db_path, holder) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f
        make_reserve(self.db_path)

    def _abandon(self) -> None:
        """Startup failed after the session row was written: keep it, marked with no data."""
        give_back_reserve(self.db_path)
        for layer in self.layers:
            layer.stop()
        if getattr(self, "store", None):
            if getattr(self, "writer", None):
                self.writer.close()
            self.store.conn.execute(
                "UPDATE session SET status = 'failed', stopped_ts = ? WHERE id = ?",
                (now_ns(), self.session_id),
            )
            self.store.conn.commit()

    def summary_at_start(self) -> dict:
        caps = [(c.layer, c.probe, c.status, c.detail) for c in self.probes.capabilities]
        for layer in self.layers:
            caps.extend(layer.summary())
        return {
            "session_id": self.session_id,
            "db": str(self.db_path),
            "target": self.described_target,
            "recorder_pid": os.getpid(),
            "attached": sorted({f"{layer}:{probe}" for layer, probe, status, _ in caps if status == "attached"}),
            "libraries": sorted(p for p, n in self.probes.attached_libraries.items() if n),
            "not_attached": sorted({f"{layer}:{probe} ({status}: {detail})"
                                    for layer, probe, status, detail in caps if status != "attached"}),
            "metrics_url": self.listener.url if self.listener else None,  # --metrics-listen
        }

    # -- processes and libraries ------------------------------------------------------------------
    def _members(self) -> set[int]:
        """The processes the target names now (for -p, the PIDs given)."""
        t = self.target
        if t.everything:
            return all_processes()
        if t.cgroup:
            return cgroup_members(t.cgroup)
        return {*t.pids, *(pid for root in t.trees for pid in tree(root))}

    def _rescan_members(self, found_by: str) -> None:
        """Configure the processes of a tree, cgroup or --all target not looked at yet: those
        running at the start, and those that entered the cgroup or were missed since (a fork or
        exec of a target is configured when its event is read)."""
        if not (self.target.trees or self.target.cgroup or self.target.everything):
            return
        members = self._members()
        self.checked &= members  # a pid that ended may come back as another process
        ts = now_ns()
        for pid in sorted(members - self.checked - self.known_pids - {os.getpid()}):
            self.checked.add(pid)
            if self.target.trees:
                self.probes.add_pid(pid)
            if is_kernel_thread(pid):
                continue
            what = worth_configuring(pid)
            # a tree's processes are targets however they look; of a cgroup or the host, those
            # with something to attach to
            if what or self.target.trees:
                self._attach_process(pid, found_by, ts, what)

    def _attach_process(self, pid: int, found_by: str, ts: int, what: list[str]) -> None:
        """Configure a target process as it is now, with one capability row saying what it has."""
        self._scan_process(pid, found_by, ts)
        self.probes.cap("target", "process", "attached",
                        ", ".join(what) if what else "no CUDA/NCCL library, marker extension or CPython mapped yet",
                        f"pid {pid}")

    def _scan_process(self, pid: int, found_by: str, ts: int) -> None:
        self.identity.process(pid, ts)
        self.known_pids.add(pid)
        self.stacks.seen(pid, found_by)
        for layer in self.layers:
            layer.scan(pid, found_by)

    def _process_exited(self, pid: int, ts: int) -> None:
        self.known_pids.discard(pid)
        self.stacks.exited(pid)
        for layer in self.layers:
            layer.process_exited(pid, ts)

    def _dlopen(self, pid: int) -> None:
        if pid not in self.known_pids:  # of a cgroup or --all target, not worth configuring until now
            if what := worth_configuring(pid):
                self._attach_process(pid, "dlopen", now_ns(), what)
            return
        self.stacks.retry_pending()  # a shared-build Python maps libpython after its exec
        self.stacks.natives.forget(pid)  # its native stacks may now pass through the new library
        for layer in self.layers:
            layer.scan(pid, "dlopen")

    def _store_capabilities(self) -> None:
        caps = self.probes.capabilities
        start = getattr(self, "_caps_stored", 0)
        for c in caps[start:]:
            self.writer.add("capability", (self.session_id, c.layer, c.probe, c.target, c.status,
                                           c.detail, c.ts))
        self._caps_stored = len(caps)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool]) -> None:
        last_flush = last_house = time.monotonic()
        while not should_stop() and not self.stopping:
            self.probes.poll(50)
            now = time.monotonic()
            # exec and dlopen may have mapped a CUDA library: attach before the next call
            if any(layer.wants_flush() for layer in self.layers) or now - last_flush >= FLUSH_INTERVAL_S:
                self.flush()
                last_flush = now
            if now - last_house >= HOUSEKEEPING_INTERVAL_S:
                # a dlopen or exec the rings hold already is the layers' to see before the rescan
                # finds its mapping: read them and flush what they brought first
                self.probes.poll(0)
                if any(layer.wants_flush() for layer in self.layers):
                    self.flush()
                    last_flush = now
                self.housekeeping()
                last_house = now
            if self.writer.stopped is not None:  # the disk took no more: stop recording, not the target
                return

    def flush(self) -> None:
        """Turn the raw records collected so far into rows and write them in one transaction: the
        layers in `flush_phase` order, with the session's own steps where the phases say."""
        layers = self.in_phase_order()
        for phase in Phase:
            if phase is Phase.THREADS:
                self._add_stacks()  # stack records before the events: each event's stack came before it
            elif phase is Phase.DEVICES:
                for layer in layers:  # exits one flush late: rows held back for their stack record first
                    layer.retire()
            for layer in layers:
                if layer.flush_phase is phase:
                    layer.flush()
        self._store_capabilities()
        self._flush_exits()
        if self.flight:  # a flight recording's deletions go in the batch's transaction
            self.flight.keep(now_ns())
        self.writer.flush()

    def _add_stacks(self) -> None:
        self.stacks.add(self.pystacks)
        self.pystacks.clear()

    def _flush_exits(self) -> None:
        if self.identity.exited:
            self.identity.flush_exits()

    def housekeeping(self) -> None:
        ts = now_ns()
        second = ts - ts % 1_000_000_000
        for probe, dropped in self.probes.read_drops():
            if dropped:
                self.counters.dropped += dropped
                self._lost(second, probe, dropped)
        for probe, missed in self.probes.read_recursion_misses():
            self.counters.dropped += missed
            self._lost(second, probe, missed)
        skipped = self.probes.skipped_records()
        if skipped:
            self._lost(second, UNEXPECTED_SIZE[2], skipped)
        for reason, n in self.stacks.housekeeping(ts).items():
            self._lost(second, reason, n)
        for layer in self.layers:
            layer.tick(ts)
        for pid in list(self.known_pids):
            if not Path(f"/proc/{pid}").exists():
                self.known_pids.discard(pid)
                continue
            for layer in self.layers:
                layer.scan(pid, "rescan")
        self._rescan_members("rescan")
        if self.flight:
            self.flight.tick()
        if self.rank_metrics and self._rank_metrics_db:
            try:
                self.rank_metrics.tick(ts)
            except sqlite3.Error as e:  # a busy moment of the writer: the next second reads what this one missed
                _say(f"recorder: workload metrics: {e}")
        # where a recording whose recorder dies ends: the last second committed
        self.writer.execute("UPDATE session SET written_ts = ? WHERE id = ?", (ts, self.session_id))
        self._write_status()
        self.write_metrics()

    def _lost(self, second: int, probe: str, n: int) -> None:
        """One `loss` row, counted by layer for the metrics file."""
        self.writer.add("loss", (self.session_id, second, probe, n))
        layer = self.loss_layers.get(probe) or loss_layer(probe)
        self.dropped_by_layer[layer] = self.dropped_by_layer.get(layer, 0) + n

    def write_metrics(self, force: bool = False, up: bool = True) -> None:
        """--metrics-file: rewritten every few seconds; --metrics-listen: what /metrics serves, every
        second (recorder/metrics.py, recorder/workload_metrics.py)."""
        if self.metrics is None and self.listener is None:
            return
        events_seen = dict(self.counters.events)
        for layer in self.layers:
            events_seen.update(layer.counted())
        snapshot = Snapshot(
            session_id=self.session_id, db=str(self.db_path), target=self.described_target,
            started_unix=self.started_unix, events=events_seen, dropped_by_layer=dict(self.dropped_by_layer),
            db_bytes=file_bytes(self.db_path), up=up, flight=self.flight.metrics() if self.flight else None)
        workload = self.rank_metrics.metrics() if self.rank_metrics else []
        if self.listener:
            self.listener.publish(render(collect(snapshot) + workload))
        if self.metrics:
            self.metrics.write(snapshot, force=force, extra=workload)

    def _write_status(self) -> None:
        c = self.counters
        now = time.monotonic()
        span = max(now - c.last_tick, 1e-3)
        c.rate = {k: (v - c.last_events.get(k, 0)) / span for k, v in c.events.items()}
        c.last_events = dict(c.events)
        c.last_tick = now
        status = {
            "session_id": self.session_id, "recorder_pid": os.getpid(), "db": str(self.db_path),
            "target": self.described_target, "running_s": round(now - c.started, 1),
            "events": c.events, "events_per_s": {k: round(v, 1) for k, v in c.rate.items()},
            "dropped": c.dropped, "db_bytes": file_bytes(self.db_path),
            "libraries": sorted(p for p, n in self.probes.attached_libraries.items() if n),
            "updated_unix": time.time(),
        }
        if self.flight:
            status["flight"] = self.flight.status()
        tmp = status_path(self.db_path).with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(status, indent=1))
            tmp.replace(status_path(self.db_path))
        except OSError:  # a full disk: `recorder status` reads an older one, the recording goes on
            tmp.unlink(missing_ok=True)

    def drain_in_flight(self, ts: int, final: bool = False) -> dict[str, int]:
        """Write every CUDA and NCCL call still in flight at `ts` as an open row (open = 1, ret
        NULL, dur up to `ts`) with its thread, arguments and Python stack; returns the rows per
        layer. At the stop (`final`) the calls leave the in-flight maps; for a dump while recording
        they stay, and are written again, closed, when they return. Each drain replaces the open
        rows of the one before, so after the stop they are exactly the calls in flight at the stop.
        Call it after a flush, so the stack records of the calls' entries have been read."""
        return {layer.name: n for layer in self.layers if (n := layer.drain_in_flight(ts, final))}

    # -- stop -------------------------------------------------------------------------------------
    def finish(self) -> dict:
        """Drain the buffers, close open intervals, mark the session complete, build indexes."""
        if self.writer.stopped is not None:
            return self.finish_stopped()
        for layer in self.layers:
            layer.stop()  # a sampler's last samples go out with the flush below
        for layer in self.layers:
            layer.settle(now_ns())  # e.g. requests in flight at the end complete: rows, not losses
        self.probes.consume()
        self.flush()
        for layer in self.layers:
            layer.unfinished(now_ns())  # e.g. block requests whose completion was never seen, into `loss`
        self.housekeeping()
        stop = now_ns()
        self.stacks.finish()
        self.drain_in_flight(stop, final=True)  # a hung call's stack record was read at its entry
        self.flush()  # the calls held back for their stack record, and the capability rows
        for reason, n in self.stacks.housekeeping(stop).items():  # the stacks those never got
            self.writer.add("loss", (self.session_id, stop - stop % 1_000_000_000, reason, n))
        for layer in self.in_phase_order():
            layer.finish(stop)  # the last exits, now that nothing is held back; intervals still open end
        self.stacks.report_misses()
        self._store_capabilities()
        for layer in self.in_phase_order():
            layer.close(stop)  # e.g. waits for the last hashes (bounded)
        if self.flight:  # incidents still waiting end at the stop (the maps tell what is in flight)
            self.writer.sync()
            self.flight.finish(stop)
        self._close_rank_metrics()
        self.writer.close()
        if self.writer.stopped is not None:
            return self.finish_stopped()
        self.stacks.amend_capabilities()  # 'attached' only where a process's stacks were read
        # The recording is complete, indexed and readable before the probes go: closing each uprobe
        # waits for the kernel (tens of ms each, seconds for a CUDA library's), and nothing written
        # needs them gone. Until then the targets still trap, into programs whose records no one reads.
        try:
            self.store.conn.execute(
                "UPDATE session SET status = 'complete', stopped_ts = ? WHERE id = ?",
                (stop, self.session_id),
            )
            self.store.conn.commit()
            if self.flight:
                self.flight.store_saved(self.store)
            self.store.build_indexes()
            infer_steps(self.store, self.session_id)  # steps of processes that called no recorder.step
            self.store.store_baselines(self.session_id)
            self.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.OperationalError as e:
            if not cannot_write(e):
                raise
            self.store.conn.rollback()  # complete up to the stop; what a report would speed up is left out
            _say(f"recorder: the disk took no more at the stop ({e}): the recording is complete, without "
                 "its indexes and baselines (reports are slower)")
        self.probes.cleanup()
        self.write_metrics(force=True, up=False)
        return self._release()

    def finish_stopped(self) -> dict:
        """The disk took no more: detach everything (the target runs on untouched), mark the session
        with why and when it stopped writing, leave what was committed readable."""
        w = self.writer
        for layer in self.layers:
            layer.stop()
        w.close()  # what is still queued is counted, not written
        self._close_rank_metrics()
        if self.flight:
            self.flight.abandon()
        self.probes.cleanup()
        reason = f"{w.stopped}: {w.rows_not_written:,} rows not written"
        give_back_reserve(self.db_path)  # the room held for this: the mark and the log's lines
        try:
            self.store.conn.execute(
                "UPDATE session SET status = 'incomplete', stopped_ts = ?, stop_reason = ? WHERE id = ?",
                (w.last_commit_ns, reason, self.session_id))
            self.store.conn.commit()
        except sqlite3.Error as e:
            self.store.conn.rollback()
            reason += f" (not marked in the recording: {e})"
        try:  # the log's pages into the file where there is room: the file is whole without its log
            self.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        self.write_metrics(force=True, up=False)
        summary = self._release()  # closing the last connection gives the log's space back: say it after
        _say(f"recorder: stopped recording into {self.db_path}: {reason}; the target keeps running; what "
             f"was written is readable: recorder explain --db {self.db_path}")
        return summary

    def _release(self) -> dict:
        if self.listener:
            self.listener.close()
        summary = session_summary(self.store, self.session_id)
        self.store.close()
        status_path(self.db_path).unlink(missing_ok=True)
        give_back_reserve(self.db_path)
        if self._lock_file:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
        return summary


def _say(text: str) -> None:
    """A line for the log (stdout of a background recorder): a full disk may refuse it too."""
    try:
        print(text, flush=True)
    except OSError:
        pass


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def install_stop_signals(session: Session) -> None:
    def handler(signum, frame):
        session.stopping = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    install_dump_signal(session)


def install_dump_signal(session: Session) -> None:
    """SIGUSR1 saves a flight recording's kept window now (the next tick does the work)."""
    def dump(signum, frame):
        if session.flight:
            session.flight.dump_requested = True

    if session.flight_options:
        signal.signal(signal.SIGUSR1, dump)
