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
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from recorder import cuda, events
from recorder.checkpoints import CheckpointLayer
from recorder.errors import TargetError, UserError
from recorder.gpu import GpuSampler, GpuSettings
from recorder.identity import Identity
from recorder.iolayer import IoLayer, KernelLog
from recorder.libraries import gpu_libraries, resolve
from recorder.probes import Probes, TargetSpec, now_ns
from recorder.stacks import StackRecorder
from recorder.steps_infer import infer_steps
from recorder.workload_layer import WorkloadLayer
from recorder.workload_layer import library_kind as workload_library_kind
from store.db import Store, Writer, lock_path, open_store

VERSION = "0.1.0"
FLUSH_INTERVAL_S = 0.1
HOUSEKEEPING_INTERVAL_S = 1.0

OFFCPU_COLUMNS = (
    "session_id", "ts", "dur", "thread_id", "cpu", "state", "syscall", "next_thread_id",
    "waker_thread_id", "waker_cpu", "wakeup_ts", "in_cpu", "contender_thread_id", "contender_run_dur", "cgroup_id",
    "open", "python_stack_id",
)
CUDA_COLUMNS = (
    "session_id", "ts", "dur", "thread_id", "api_id", "ret", "size_bytes",
    "size_class", "stream", "function", "pointer", "event_handle", "memcpy_kind", "grid", "block",
    "shared_mem_bytes", "cgroup_id", "python_stack_id", "native_stack_id",
)
CAPABILITY_COLUMNS = ("session_id", "layer", "probe", "target", "status", "detail", "ts")

# Which cuda_event fields mean something for each argument layout; others are stored as NULL.
_LAYOUT_FIELDS = {
    "none": set(),
    "malloc": {"size", "pointer"},
    "malloc_async": {"size", "pointer", "stream"},
    "free": {"pointer"},
    "free_async": {"pointer", "stream"},
    "memcpy": {"size", "memcpy_kind"},
    "memcpy_async": {"size", "memcpy_kind", "stream"},
    "memcpy_drv": {"size"},
    "memcpy_drv_async": {"size", "stream"},
    "stream": {"stream"},
    "event": {"handle"},
    "launch_rt": {"function", "launch", "stream"},
    "launch_drv": {"function", "launch", "stream"},
    "launch_drv_ex": {"function", "launch", "stream"},
    "launch_rt_ex": {"function", "launch", "stream"},
}
_API_FIELDS = [_LAYOUT_FIELDS[api.layout] for api in cuda.APIS]
# per API: (size, stream, launch, pointer, handle, memcpy_kind) are meaningful
_API_FLAGS = [tuple(name in fields for name in ("size", "stream", "launch", "pointer", "handle", "memcpy_kind"))
              for fields in _API_FIELDS]
# The same as one byte per API, bit i for flag i (recorder/_ingest.c)
_API_FLAG_BITS = bytes(sum(1 << i for i, flag in enumerate(flags) if flag) for flags in _API_FLAGS)
# cuda_call's columns as recorder/_ingest.c packs them: 'd' is a launch's "x,y,z" grid or block
CUDA_PROGRAM = "iiiiiiiiiiiiiddiiii"
# cuda_event fields recorder/_ingest.c reads, in its order
CUDA_PACK_FIELDS = ("ts", "dur", "cgroup_id", "ret", "size", "stream", "function", "pointer", "handle",
                    "py_digest",
                    "pid", "tid", "api", "memcpy_kind", "grid_x", "grid_y", "grid_z", "block_x",
                    "block_y", "block_z", "shared_mem", "flags", "native_digest")
# cuda_event unpacked with its 64-bit fields signed: SQLite's INTEGER is a signed 64-bit value, so a
# value above 2**63 - 1 (a size_t of -1 passed to cudaMalloc) is stored as its two's complement
_CUDA_SIGNED = struct.Struct("=8x" + events.CUDA.fmt[1:].replace("Q", "q"))


def _ingest_module():
    try:
        from recorder import _ingest
    except ImportError:  # not built (no compiler at install time): rows are built in Python
        return None
    return _ingest


def status_path(db: Path) -> Path:
    return db.with_name(db.name + ".status.json")


def log_path(db: Path) -> Path:
    return db.with_name(db.name + ".log")


def already_recording(db: Path, holder: int | str) -> UserError:
    return UserError(f"a recorder (pid {holder}) is already recording into {db}: "
                     f"stop it with 'recorder stop --db {db}' or pass another --db")


@dataclass
class Counters:
    started: float = field(default_factory=time.monotonic)
    events: dict[str, int] = field(default_factory=lambda: {"offcpu": 0, "cuda": 0, "task": 0})
    last_events: dict[str, int] = field(default_factory=dict)
    rate: dict[str, float] = field(default_factory=dict)
    dropped: int = 0
    last_tick: float = field(default_factory=time.monotonic)


class Session:
    """A recording in progress. Use `Session.begin(...)`, then `run()` and `finish()`."""

    def __init__(self, db: Path, target: TargetSpec, cuda_libs: tuple[str, ...], command: str,
                 described_target: str | None = None, gpu: GpuSettings | None = None) -> None:
        self.db_path = db
        self.target = target
        self.cuda_libs = cuda_libs
        self.command = command
        self.described_target = described_target or target.describe()
        self.store: Store | None = None
        self.probes: Probes | None = None
        self._lock_file = None
        self.counters = Counters()
        self.raw: dict[str, list[bytes]] = {"offcpu": [], "cuda": [], "task": [], "pystack": []}
        self.known_pids: set[int] = set()
        self.stopping = False
        self._deferred_exits: list[tuple] = []  # task exit records retired at the next flush
        self.gpu_settings = gpu
        self.gpu: GpuSampler | None = None

    # -- start ------------------------------------------------------------------------------------
    def begin(self) -> dict:
        """Lock, create the session, attach everything; returns the attach summary."""
        gpu_settings = self.gpu_settings or GpuSettings.from_environment()
        self._take_lock()
        for pid in self.target.pids:
            if not Path(f"/proc/{pid}").exists():
                raise TargetError(f"no process with pid {pid}: check the pid with 'ps -p {pid}'")
        self.store = open_store(self.db_path, create=True)
        started = now_ns()
        wall = time.time_ns() - started
        uname = os.uname()
        self.session_id = self.store.db["session"].insert({
            "started_ts": started, "wall_offset_ns": wall, "status": "recording",
            "recorder_pid": os.getpid(), "hostname": socket.gethostname(),
            "kernel_release": uname.release, "boot_id": _boot_id(), "cpu_count": os.cpu_count() or 0,
            "target": self.described_target, "command": self.command, "tool_version": VERSION,
        }).last_pk
        self.store.conn.commit()
        self.started_ts = started
        self.store.conn.executemany(
            "INSERT OR IGNORE INTO cuda_api (id, name, family, library, arguments) VALUES (?,?,?,?,?)",
            [(i, a.name, a.family, a.library, a.layout) for i, a in enumerate(cuda.APIS)])
        self.store.conn.commit()
        self.writer = Writer(self.store, background=True)
        self.writer.table("offcpu_interval", OFFCPU_COLUMNS)
        self.writer.table("cuda_call", CUDA_COLUMNS)
        self._pack_cuda = self._packing()
        self.writer.table("capability", CAPABILITY_COLUMNS)
        self.writer.table("loss", ("session_id", "ts", "probe", "dropped"))
        self.writer.table("library", ("session_id", "path", "kind", "first_ts", "found_by"))
        self.identity = Identity(self.store, self.writer, self.session_id)
        self.workload = WorkloadLayer(self)
        self.workload.prepare()
        try:
            self.probes = Probes(self.target, extra_source=self.workload.source())
        except UserError:
            self._abandon()
            raise
        self.stacks = StackRecorder(self.store, self.writer, self.session_id, self.probes)
        for pid in self.target.pids:
            self.probes.add_pid(pid)
        self.io = IoLayer(self.writer, self.identity, self.session_id, self.probes, self.stacks)
        self.io.devices.record_present()
        self.checkpoints = CheckpointLayer(self)
        self.kernel_log = KernelLog(self.store, self.writer, self.session_id, started)
        for probe, status, detail in self.kernel_log.capability:
            self.writer.add("capability", (self.session_id, "kmsg", probe, "", status, detail, now_ns()))
        self.probes.attach_dlopen()
        for path in self.cuda_libs:
            if not Path(path).exists():
                raise TargetError(f"--cuda-lib {path} does not exist: pass the path of libcudart.so, libcuda.so "
                                  "or libnccl.so")
            if workload_library_kind(path):
                self.workload.attach(path, workload_library_kind(path), "option")
                continue
            kind = cuda.library_kind(path) or "runtime"
            self._attach(path, kind, "option")
        self.probes.open_rings({
            "pystacks": self.raw["pystack"].append,
            "offcpu_events": self.raw["offcpu"].append,
            "cuda_events": self.raw["cuda"].append,
            "task_events": self.raw["task"].append,
            **self.io.sinks(),
            **self.workload.sinks(),
            **self.checkpoints.sinks(),
        }, blocks={"offcpu_events": events.OFFCPU.size, "cuda_events": events.CUDA.size})
        for pid in self.target.pids:
            self._scan_process(pid, "maps", started)
        self.gpu = GpuSampler(self.writer, self.session_id, gpu_settings)
        try:
            self.gpu.start()
        except UserError:
            self._abandon()
            raise
        self._store_capabilities()
        self.gpu.flush()
        self.writer.flush()
        return self.summary_at_start()

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

    def _abandon(self) -> None:
        """Startup failed after the session row was written: keep it, marked with no data."""
        if self.gpu:
            self.gpu.stop()
        if self.store:
            if getattr(self, "writer", None):
                self.writer.close()
            self.store.conn.execute(
                "UPDATE session SET status = 'failed', stopped_ts = ? WHERE id = ?",
                (now_ns(), self.session_id),
            )
            self.store.conn.commit()

    def summary_at_start(self) -> dict:
        caps = [(c.layer, c.probe, c.status, c.detail) for c in (self.probes.capabilities if self.probes else [])]
        if self.gpu:
            caps.append(("gpu", "nvml", *self.gpu.status))
        return {
            "session_id": self.session_id,
            "db": str(self.db_path),
            "target": self.described_target,
            "recorder_pid": os.getpid(),
            "attached": sorted({f"{layer}:{probe}" for layer, probe, status, _ in caps if status == "attached"}),
            "libraries": sorted(p for p, n in self.probes.attached_libraries.items() if n),
            "not_attached": sorted({f"{layer}:{probe} ({status}: {detail})"
                                    for layer, probe, status, detail in caps if status != "attached"}),
        }

    # -- libraries --------------------------------------------------------------------------------
    def _attach(self, path: str, kind: str, found_by: str) -> None:
        before = len(self.probes.attached_libraries)
        self.probes.attach_library(path, kind)
        if len(self.probes.attached_libraries) > before:
            self.writer.add("library", (self.session_id, path, kind, now_ns(), found_by))

    def _scan_process(self, pid: int, found_by: str, ts: int) -> None:
        self.identity.process(pid, ts)
        self.known_pids.add(pid)
        self.stacks.seen(pid, found_by)
        for path, kind in gpu_libraries(pid):
            self._attach(resolve(pid, path), kind, found_by)
        self.workload.scan(pid, found_by)

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
            if self.raw["task"] or now - last_flush >= FLUSH_INTERVAL_S:
                self.flush()
                last_flush = now
            if now - last_house >= HOUSEKEEPING_INTERVAL_S:
                self.housekeeping()
                last_house = now

    def flush(self) -> None:
        """Turn the raw records collected so far into rows and write them in one transaction."""
        sid = self.session_id
        ident = self.identity
        raw_off, raw_cuda, raw_task = self.raw["offcpu"], self.raw["cuda"], self.raw["task"]
        # offcpu and cuda come in blocks of framed records (Probes.open_rings)
        joined_off = b"".join(raw_off)
        joined_cuda = b"".join(raw_cuda)
        self.counters.events["offcpu"] += len(joined_off) // events.OFFCPU.framed_size
        self.counters.events["cuda"] += len(joined_cuda) // events.CUDA.framed_size
        self.counters.events["task"] += len(raw_task)
        # Forks and execs first, so this batch's events of a new process image get its identity;
        # exits last, so the exiting thread's final events still find theirs.
        tasks = list(events.TASK.iter_unpack(b"".join(raw_task))) if raw_task else []
        raw_task.clear()
        for rec in tasks:
            if rec[1] != events.CONSTANTS["TASK_EXIT"]:
                self._task_event(*rec)
        self.stacks.add(self.raw["pystack"])  # before the events: each event's stack came before it
        self.raw["pystack"].clear()
        if raw_off or self.stacks.held("offcpu"):
            rows = []
            threads = ident.threads
            for rec, py_stack in self.stacks.join("offcpu", events.OFFCPU.iter_framed(joined_off),
                                                  _offcpu_stack_key, shared=True):
                (ts, dur, cg, state, wakeup_ts, contender_run, stack_ts, pid, tid, cpu, next_tid, waker_tid,
                 waker_cpu, syscall, flags, in_cpu, contender, comm, next_comm, waker_comm,
                 contender_comm) = rec
                th = threads.get(tid) or ident.thread(tid, pid, comm, ts)
                nxt = ident.thread(next_tid, None, next_comm, ts, False) if next_tid else None
                wk = ident.thread(waker_tid, None, waker_comm, ts, False) if waker_tid else None
                rival = ident.thread(contender, None, contender_comm, ts, False) if contender else None
                rows.append((sid, ts, dur, th, cpu, state, syscall if syscall >= 0 else None, nxt,
                             wk, waker_cpu if waker_tid else None, wakeup_ts or None, in_cpu,
                             rival, contender_run if contender else None, cg, flags & 1, py_stack))
            raw_off.clear()
            self.writer.extend("offcpu_interval", rows)
        if raw_cuda or self.stacks.held("cuda"):
            if self._pack_cuda and joined_cuda:
                joined_cuda = self._pack_cuda_rows(joined_cuda)
            self.writer.extend("cuda_call", self._cuda_rows(joined_cuda))
            raw_cuda.clear()
        self.workload.flush()  # before task events: an exit retires the thread's identity
        self.checkpoints.flush()
        self.io.flush()  # also before: a thread's block requests complete before it exits
        # Exits are applied one flush late: rows held back for their stack record are written in
        # the next flush, and a process's exit drops its stack caches (StackRecorder.exited).
        # Thread identities outlive exits anyway (Identity.departed).
        for rec in self._deferred_exits:
            self._task_event(*rec)
        self._deferred_exits = [rec for rec in tasks if rec[1] == events.CONSTANTS["TASK_EXIT"]]
        self.kernel_log.poll()
        if self.gpu:
            self.gpu.flush()
        self._store_capabilities()
        if ident.exited:
            ident.flush_exits()
        self.writer.flush()

    def _packing(self) -> Callable | None:
        """recorder/_ingest.c's pack_cuda with cuda_call declared packed to the writer, or None
        when the extensions are not built or not safe here (rows are then built in Python)."""
        ingest = _ingest_module() if self.writer.packs else None
        if ingest is None:
            return None
        self.writer.packed_table("cuda_call", CUDA_PROGRAM)
        self._cuda_offsets = tuple(events.CUDA.offsets()[name] for name in CUDA_PACK_FIELDS)
        return ingest.pack_cuda

    def _pack_cuda_rows(self, joined: bytes) -> bytes:
        """Write the cuda_call rows of the records whose thread and stacks are known, packed
        (recorder/_ingest.c, the same values _cuda_rows() gives); returns the other records."""
        framed = events.CUDA.framed_size
        packed, misses = self._pack_cuda(
            joined, framed, self._cuda_offsets, self.session_id, self.identity.threads,
            self.stacks.join_keys(), self.stacks.digests(), self.stacks.native_cache(),
            _API_FLAG_BITS, self._learn_cuda)
        self.writer.extend_packed("cuda_call", packed)
        if not misses:
            return b""
        view = memoryview(joined)
        return b"".join([view[at:at + framed] for at in misses])

    def _learn_cuda(self, ts: int, pid: int, tid: int, native: int) -> None:
        """A thread or native stack seen for the first time by pack_cuda, at that record (the
        order the Python path would make them in)."""
        if tid not in self.identity.threads:
            self.identity.thread(tid, pid, None, ts)
        if (pid, native) not in self.stacks.native_cache():  # a miss is counted at the call's row
            self.stacks.native_id(pid, native, count=False)

    def _cuda_rows(self, joined: bytes) -> list[tuple]:
        """cuda_call rows from framed cuda_event records (ring header, then the record)."""
        sid = self.session_id
        ident = self.identity
        threads = ident.threads
        stacks = self.stacks
        natives = stacks.native_cache()
        dims: dict[tuple[int, int, int], str] = {}  # a launch's few distinct grid/block shapes
        rows = []
        append = rows.append
        for rec, py_stack in stacks.join("cuda", _CUDA_SIGNED.iter_unpack(joined), _cuda_stack_key):
            (ts, dur, cg, ret, size, stream, function, pointer, handle, _digest, pid, tid, api, kind,
             gx, gy, gz, bx, by, bz, shmem, flags, native_stack) = rec
            has_size, has_stream, launch, has_pointer, has_handle, has_kind = _API_FLAGS[api]
            th = threads.get(tid) or ident.thread(tid, pid, None, ts)
            native = natives.get((pid, native_stack))
            if native is None:
                native = stacks.native_id(pid, native_stack)
            grid = block = None
            if launch:
                grid = dims.get((gx, gy, gz))
                if grid is None:
                    grid = dims[(gx, gy, gz)] = f"{gx},{gy},{gz}"
                block = dims.get((bx, by, bz))
                if block is None:
                    block = dims[(bx, by, bz)] = f"{bx},{by},{bz}"
            append((
                sid, ts, dur, th, api, ret,
                size if has_size else None,
                (size.bit_length() if size >= 0 else 64) if has_size else None,
                stream if has_stream else None,
                function if launch else None,
                pointer if has_pointer and not flags & 1 else None,
                handle if has_handle else None,
                kind if has_kind else None,
                grid,
                block,
                shmem if launch else None,
                cg,
                py_stack,
                native,
            ))
        return rows

    def _task_event(self, ts: int, kind: int, pid: int, tid: int, child: int, comm: bytes) -> None:
        c = events.CONSTANTS
        if kind == c["TASK_FORK"]:
            child_pid = _tgid_or(child, pid)
            if child_pid != pid and child_pid not in self.known_pids:
                self._scan_process(child_pid, "fork", ts)
            self.identity.thread_forked(child, child_pid, ts)
        elif kind == c["TASK_EXEC"]:
            self.identity.process_exec(pid, ts)
            self.identity.thread(tid, pid, comm, ts)
            self._scan_process(pid, "exec", ts)
        elif kind == c["TASK_EXIT"]:
            self.identity.thread_exited(tid, pid, ts)
            if tid == pid:
                self.known_pids.discard(pid)
                self.stacks.exited(pid)
                self.checkpoints.process_exited(pid, ts)
        elif kind == c["TASK_DLOPEN"]:
            self.stacks.retry_pending()  # a shared-build Python maps libpython after its exec
            for path, lib_kind in gpu_libraries(pid):
                self._attach(resolve(pid, path), lib_kind, "dlopen")
            self.workload.scan(pid, "dlopen")

    def housekeeping(self) -> None:
        ts = now_ns()
        second = ts - ts % 1_000_000_000
        for probe, dropped in enumerate(self.probes.read_drops()):
            if dropped:
                self.counters.dropped += dropped
                self.writer.add("loss", (self.session_id, second, events.PROBE_NAMES[probe], dropped))
        skipped = self.probes.skipped_records()
        if skipped:
            self.writer.add("loss", (self.session_id, second, "ring record of unexpected size", skipped))
        for reason, n in self.stacks.housekeeping(ts).items():
            self.writer.add("loss", (self.session_id, second, reason, n))
        for pid in list(self.known_pids):
            if not Path(f"/proc/{pid}").exists():
                self.known_pids.discard(pid)
                continue
            for path, kind in gpu_libraries(pid):
                self._attach(resolve(pid, path), kind, "rescan")
            self.workload.scan(pid, "rescan")
        self._write_status()

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
            "dropped": c.dropped, "db_bytes": _db_bytes(self.db_path),
            "libraries": sorted(p for p, n in self.probes.attached_libraries.items() if n),
            "updated_unix": time.time(),
        }
        tmp = status_path(self.db_path).with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(status_path(self.db_path))

    # -- stop -------------------------------------------------------------------------------------
    def finish(self) -> dict:
        """Drain the buffers, close open intervals, mark the session complete, build indexes."""
        if self.gpu:
            self.gpu.stop()  # its last samples go out with the flush below
        self.probes.consume()
        self.flush()
        self.io.finish(now_ns())  # block requests whose completion was never seen, into `loss`
        self.housekeeping()
        stop = now_ns()
        self.stacks.finish()
        self.flush()  # the calls held back for their stack record, and the capability rows
        for rec in self._deferred_exits:  # the last exits, now that nothing is held back
            self._task_event(*rec)
        self._deferred_exits = []
        for tid, rec in self.probes.open_offcpu():
            ident = self.identity
            th = ident.thread(tid, rec.pid, bytes(rec.comm), rec.ts)
            self.writer.add("offcpu_interval", (
                self.session_id, rec.ts, stop - rec.ts, th, rec.cpu, rec.state,
                rec.syscall if rec.syscall >= 0 else None, None, None, None, None, None, None,
                None, rec.cgroup_id, 1,
                self.stacks.take((rec.stack_ts, rec.pid, tid), shared=True) if rec.stack_ts else None))
        self.stacks.report_misses()
        self._store_capabilities()
        self.kernel_log.close()
        self.io.flush()
        self.checkpoints.finish()  # waits for the last hashes (bounded)
        self.writer.close()
        self.probes.cleanup()
        self.store.conn.execute(
            "UPDATE session SET status = 'complete', stopped_ts = ? WHERE id = ?",
            (stop, self.session_id),
        )
        self.store.conn.commit()
        self.store.build_indexes()
        infer_steps(self.store, self.session_id)  # steps of processes that called no recorder.step
        self.store.store_baselines(self.session_id)
        self.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        summary = session_summary(self.store, self.session_id)
        self.store.close()
        status_path(self.db_path).unlink(missing_ok=True)
        if self._lock_file:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
        return summary


def session_summary(store: Store, session_id: int) -> dict:
    s = store.one("SELECT * FROM session WHERE id = ?", (session_id,))
    counts = {
        table: store.one(f"SELECT count(*) AS n FROM {table} WHERE session_id = ?", (session_id,))["n"]
        for table in ("offcpu_interval", "cuda_call", "thread", "process", "library")
    }
    lost = store.one("SELECT coalesce(sum(dropped), 0) AS n FROM loss WHERE session_id = ?",
                     (session_id,))["n"]
    dur = ((s["stopped_ts"] or s["started_ts"]) - s["started_ts"]) / 1e9
    return {"session_id": session_id, "status": s["status"], "duration_s": round(dur, 3),
            "rows": counts, "dropped": lost, "db": str(store.path),
            "db_bytes": _db_bytes(store.path)}


_OFF_STACK, _OFF_PID, _OFF_TID = (events.OFFCPU.names.index(n) for n in ("stack_ts", "pid", "tid"))
_CUDA_PID, _CUDA_TID, _CUDA_DIGEST = (events.CUDA.names.index(n) for n in ("pid", "tid", "py_digest"))


def _offcpu_stack_key(rec: tuple) -> tuple[int, int, int] | None:
    """(stack_ts, pid, tid) of an offcpu_event's Python stack record; None for a preemption."""
    return (rec[_OFF_STACK], rec[_OFF_PID], rec[_OFF_TID]) if rec[_OFF_STACK] else None


def _cuda_stack_key(rec: tuple) -> tuple[int, int, int] | int:
    """A CUDA call's stack record is keyed by its entry (ts, pid, tid); a stack sent before comes
    as its digest instead (bpf/pystack.h PYSTACK_CAPTURE_BY_DIGEST)."""
    return rec[_CUDA_DIGEST] or (rec[0], rec[_CUDA_PID], rec[_CUDA_TID])


def _tgid_or(tid: int, default: int) -> int:
    from recorder.identity import read_tgid

    return read_tgid(tid) or default


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _db_bytes(db: Path) -> int:
    total = 0
    for p in (db, db.with_name(db.name + "-wal")):
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def install_stop_signals(session: Session) -> None:
    def handler(signum, frame):
        session.stopping = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
