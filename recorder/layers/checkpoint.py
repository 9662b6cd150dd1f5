"""Checkpoint integrity: which files are checkpoints, what was written to them, and whether what is on
disk afterwards is what was written.

A file is a checkpoint when a target opens it for writing
- inside `with recorder.checkpoint(path):` on the opening thread (decided in BPF at the open),
- at the path of a scope open in the same process on another thread (`marker_path`),
- when it carries the xattr `user.ai.checkpoint` (any value) at the open (`xattr`),
- or when it is a completed checkpoint of the session opened for writing again outside any scope
  (`rewrite`: recorded as a modification of that checkpoint).
bpf/checkpoint.bpf.c sends every open for writing of the targets; user space decides the last three
within one flush (stat and getxattr of the path) and writes the verdict back, holding the file's
events meanwhile, so nothing written before the decision is lost.

A checkpoint file is complete when every descriptor on it is closed and, if it was opened in a
scope, the scope was left (or its process ended: `writer_exited`); files without a scope also wait
SETTLE_NS after the close for the rename that usually follows. Then its sha256 is computed by a
thread of the recorder, never the training process: one worker, lowest CPU priority and
best-effort/7 I/O priority, a bounded queue (files wait in a backlog while it is full, in order).
At the session stop the recorder waits up to STOP_HASH_DEADLINE_S for the hashes, then stats every
hashed file again. `verify_checkpoints()` re-hashes a finished recording's checkpoints later.
The judgement (complete, missing, changed ...) is SQL: the checkpoint_integrity view.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recorder.core.capability import failure
from recorder.core.clock import now_ns
from recorder.core.events import Layout, Loss, Records
from recorder.core.int64 import signed64
from recorder.core.layer import BaseLayer, BpfSource, Context, Phase, Sink
from recorder.core.libraries import workload_library_kind
from store.errors import StoreError

if TYPE_CHECKING:
    from recorder.core.loader import Probes
    from store.db import Store

XATTR = "user.ai.checkpoint"
MARKER_SYMBOL = "stall_recorder_checkpoint"
SETTLE_NS = 250_000_000  # a file closed outside any scope is hashed this long after its close
STOP_HASH_DEADLINE_S = 30.0  # at the session stop, hashes still running after this are not_hashed
QUEUE_MAX = 16  # files handed to the hashing thread at once; the rest wait in the backlog
CHUNK_BYTES = 1 << 20
AT_FDCWD = -100
O_TRUNC = 0o1000

CKPT_OPEN = Layout(
    "ckpt_open_event",
    (
        ("ts", "u64"),  # openat entered
        ("dur", "u64"),  # entry -> return, ns
        ("open_id", "u64"),  # with pid and fd, names this open until its close
        ("flags", "u64"),  # O_* flags as passed
        ("pid", "u32"),
        ("tid", "u32"),
        ("fd", "s32"),  # the new descriptor (opens that failed are not sent)
        ("dirfd", "s32"),  # directory a relative path is relative to, -100 = AT_FDCWD
        ("in_scope", "u32"),  # 1: the opening thread was inside recorder.checkpoint()
        ("pad", "u32"),
        ("path", "char256"),  # as passed, cut at 255 bytes
    ),
    "a target opened a file for writing (classified by user space unless in a checkpoint scope)",
)

CKPT_IO = Layout(
    "ckpt_io_event",
    (
        ("ts", "u64"),  # syscall entered
        ("dur", "u64"),  # entry -> return, ns
        ("open_id", "u64"),
        ("offset", "s64"),  # file offset written at (writes), new length (ftruncate); -1 unknown (O_APPEND)
        ("count", "u64"),  # bytes asked for (writes)
        ("ret", "s64"),  # the syscall's return: bytes written, 0, or -errno
        ("pid", "u32"),
        ("tid", "u32"),
        ("fd", "s32"),
        ("op", "u32"),  # CKPT_OP_*
    ),
    "a write, fsync, fdatasync, ftruncate or close on a file opened for writing",
)

CKPT_RENAME = Layout(
    "ckpt_rename_event",
    (
        ("ts", "u64"),
        ("dur", "u64"),
        ("ret", "s64"),  # 0 or -errno
        ("pid", "u32"),
        ("tid", "u32"),
        ("olddirfd", "s32"),  # -100 = AT_FDCWD
        ("newdirfd", "s32"),
        ("flags", "u32"),  # renameat2 RENAME_* flags
        ("pad", "u32"),
        ("oldpath", "char256"),
        ("newpath", "char256"),
    ),
    "rename/renameat/renameat2 by a target",
)

CKPT_SCOPE = Layout(
    "ckpt_scope_event",
    (
        ("ts", "u64"),
        ("phase", "u64"),  # 1 begin, 2 end
        ("tag", "u64"),  # lineage tag current on the thread
        ("path_addr", "u64"),  # the path stays alive in the process during the scope
        ("path_len", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("path", "char256"),  # the first 255 bytes of the path
    ),
    "recorder.checkpoint(path) entered or left (uprobe on stall_recorder_checkpoint)",
)

RECORDS = Records((CKPT_OPEN, CKPT_IO, CKPT_RENAME, CKPT_SCOPE), {
    "CKPT_OP_WRITE": 1, "CKPT_OP_PWRITE64": 2, "CKPT_OP_WRITEV": 3, "CKPT_OP_PWRITEV": 4,
    "CKPT_OP_PWRITEV2": 5, "CKPT_OP_SENDFILE": 6, "CKPT_OP_COPY_FILE_RANGE": 7, "CKPT_OP_FSYNC": 8,
    "CKPT_OP_FDATASYNC": 9, "CKPT_OP_FTRUNCATE": 10, "CKPT_OP_CLOSE": 11,
    "CKPT_OP_OPEN": 12, "CKPT_OP_LSEEK": 13, "CKPT_OP_RENAME": 14,  # stashed between entry and exit only
    "CKPT_PENDING": 0,  # not classified by user space yet: its events are sent and held there
    "CKPT_OPTED": 1,  # a checkpoint file: events sent
    "CKPT_IGNORED": 2,  # not a checkpoint: nothing sent
}, (
    ("PROBE_CKPT", Loss("checkpoint ring buffer", "checkpoint", "checkpoint events", "ring buffer full")),
    # its descriptors or calls in flight
    ("PROBE_CKPT_MAP", Loss("checkpoint map full", "checkpoint", "checkpoint file operations",
                            "descriptor or call map full")),
))

_SYSCALL_OPS = ("write", "pwrite64", "writev", "pwritev", "pwritev2", "sendfile", "copy_file_range")
_OTHER_OPS = ("fsync", "fdatasync", "ftruncate", "close")
_C = RECORDS.constants
_OP_NAMES = {_C[f"CKPT_OP_{name.upper()}"]: name for name in _SYSCALL_OPS + _OTHER_OPS}
_WRITES = {_C[f"CKPT_OP_{name.upper()}"] for name in _SYSCALL_OPS}
_VECTORED = {_C["CKPT_OP_WRITEV"], _C["CKPT_OP_PWRITEV"], _C["CKPT_OP_PWRITEV2"]}
_CLOSE, _TRUNCATE = _C["CKPT_OP_CLOSE"], _C["CKPT_OP_FTRUNCATE"]
_OPTED, _IGNORED = _C["CKPT_OPTED"], _C["CKPT_IGNORED"]
_SIZES = {layout.size: layout for layout in RECORDS.layouts}
assert len(_SIZES) == 4, "checkpoint records are told apart by their size"

SOURCES = (BpfSource(
    "checkpoint", "checkpoint.bpf.c",
    ("syscalls:sys_enter_openat", "syscalls:sys_exit_openat", "syscalls:sys_enter_write",
     "syscalls:sys_exit_write", "syscalls:sys_enter_close", "syscalls:sys_exit_close"),
    optional=tuple(f"syscalls:sys_enter_{name}" for name in (
        "open", "creat", "openat2", "pwrite64", "writev", "pwritev", "pwritev2", "sendfile64",
        "copy_file_range", "lseek", "fsync", "fdatasync", "ftruncate", "rename", "renameat", "renameat2"))),)

FILE_COLUMNS = ("id", "session_id", "ts", "dur", "thread_id", "path", "opted_by", "scope_path", "scope_ts",
                "scope_thread_id", "scope_end_ts", "tag", "dev_major", "dev_minor", "ino", "modifies_file_id")
EXTENT_COLUMNS = ("session_id", "file_id", "ts", "dur", "thread_id", "syscall", "file_offset", "size_bytes",
                  "requested_bytes", "error")
OP_COLUMNS = ("session_id", "file_id", "ts", "dur", "thread_id", "op", "fd", "open_flags", "size_bytes", "path",
              "error")
VERIFY_COLUMNS = ("session_id", "file_id", "ts", "dur", "trigger", "method", "path", "state", "ino", "size_bytes",
                  "mtime_ns", "mtime_ts", "sha256", "detail")


def db_text(path: str | None) -> str | None:
    """A path as stored: bytes that are not UTF-8 appear as \\xNN (SQLite text is UTF-8)."""
    if path is None:
        return None
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def has_checkpoint_xattr(path: str) -> bool:
    """True when the file at path carries user.ai.checkpoint (any value); False when it does not,
    is gone, or its file system has no user xattrs."""
    try:
        os.getxattr(path, XATTR)
        return True
    except OSError:
        return False


# -- hashing ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verification:
    """What one look at a file found (a checkpoint_verify row without its session and file)."""

    ts: int
    dur: int
    method: str  # sha256 or stat
    path: str | None
    state: str
    ino: int | None = None
    size_bytes: int | None = None
    mtime_ns: int | None = None
    mtime_ts: int | None = None
    sha256: str | None = None
    detail: str | None = None


def _monotonic_of(wall_ns: int) -> int:
    """A CLOCK_REALTIME instant (st_mtime_ns) on CLOCK_MONOTONIC, with the offset of right now."""
    real = time.clock_gettime_ns(time.CLOCK_REALTIME)
    mono = now_ns()
    return wall_ns - (real - mono)


def hash_file(path: str | None, expected_ino: int | None = None,
              cancel: threading.Event | None = None) -> Verification:
    """sha256, size and mtime of the file at path, never raising: a path that is gone is 'missing',
    another inode than expected is 'replaced' (not read), an unreadable one 'unreadable'."""
    t0 = now_ns()

    def done(state: str, detail: str | None = None, **kw) -> Verification:
        return Verification(t0, now_ns() - t0, "sha256", path, state, detail=detail, **kw)

    if path is None:
        return done("replaced", "the file lost its path (another file was renamed over it)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return done("missing", "no file at the path when hashed")
    except OSError as e:
        return done("unreadable", f"open: {e.strerror}")
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            return done("not_regular", "not a regular file", ino=before.st_ino)
        if expected_ino is not None and before.st_ino != expected_ino:
            return done("replaced", f"inode {before.st_ino} at the path, the checkpoint was {expected_ino}",
                        ino=before.st_ino, size_bytes=before.st_size, mtime_ns=before.st_mtime_ns,
                        mtime_ts=_monotonic_of(before.st_mtime_ns))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass
        digest = hashlib.sha256()
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        total = 0
        while True:
            if cancel is not None and cancel.is_set():
                return done("not_hashed", "the session stopped while it was hashed", ino=before.st_ino)
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            digest.update(view[:n])
            total += n
        after = os.fstat(fd)
    except OSError as e:
        return done("unreadable", f"read: {e.strerror}")
    finally:
        os.close(fd)
    detail = None
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or after.st_size != total:
        detail = "changed while it was hashed"
    return done("hashed", detail, ino=after.st_ino, size_bytes=total, mtime_ns=after.st_mtime_ns,
                mtime_ts=_monotonic_of(after.st_mtime_ns), sha256=digest.hexdigest())


def stat_again(path: str | None, ino: int | None, size: int | None, mtime_ns: int | None) -> Verification:
    """Compare what is at path now with an earlier hash: unchanged, changed, missing or replaced."""
    t0 = now_ns()
    if path is None:
        return Verification(t0, 0, "stat", None, "replaced", detail="the file lost its path")
    try:
        st = os.stat(path)
    except OSError:
        return Verification(t0, now_ns() - t0, "stat", path, "missing", detail="no file at the path")
    common: dict[str, Any] = dict(ino=st.st_ino, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns,
                  mtime_ts=_monotonic_of(st.st_mtime_ns))
    if ino is not None and st.st_ino != ino:
        return Verification(t0, now_ns() - t0, "stat", path, "replaced",
                            detail=f"inode {st.st_ino} at the path, was {ino}", **common)
    what = [name for name, old, new in (("size", size, st.st_size), ("mtime", mtime_ns, st.st_mtime_ns))
            if old != new]
    return Verification(t0, now_ns() - t0, "stat", path, "changed" if what else "unchanged",
                        detail=(" and ".join(what) + " differ") if what else None, **common)


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def _lower_priority() -> None:
    """The calling thread: nice 19 and best-effort I/O priority 7 (not idle: a training job reading
    data all the time would starve an idle-class reader)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError:
        pass
    nr = _IOPRIO_SET.get(os.uname().machine)
    if nr is not None:
        try:
            ctypes.CDLL(None, use_errno=True).syscall(nr, 1, tid, (2 << 13) | 7)  # IOPRIO_WHO_PROCESS, BE/7
        except (OSError, AttributeError):
            pass


@dataclass(frozen=True)
class HashJob:
    file_id: int
    path: str | None
    ino: int | None
    trigger: str  # completed or writer_exited


class Hasher:
    """One low-priority worker thread of the recorder that hashes complete checkpoint files."""

    def __init__(self, max_queued: int = QUEUE_MAX) -> None:
        self.jobs: queue.Queue[HashJob | None] = queue.Queue(maxsize=max_queued)
        self.results: queue.SimpleQueue[tuple[HashJob, Verification]] = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stall-checkpoint-hash", daemon=True)
        self.thread.start()

    def offer(self, job: HashJob) -> bool:
        """Hand a job over without waiting; False when the queue is full."""
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.cancel.is_set():
                    t = now_ns()
                    result = Verification(t, 0, "sha256", job.path, "not_hashed",
                                          detail="the session stopped before it was hashed")
                else:
                    try:
                        result = hash_file(job.path, job.ino, self.cancel)
                    except Exception as e:  # never lose a job: the file is recorded as unreadable
                        t = now_ns()
                        result = Verification(t, 0, "sha256", job.path, "unreadable",
                                              detail=f"{type(e).__name__}: {e}")
                self.results.put((job, result))
            finally:
                self.jobs.task_done()

    def idle(self) -> bool:
        return self.jobs.unfinished_tasks == 0

    def stop(self, timeout_s: float) -> None:
        """Cancel what is left and end the thread (jobs still queued come back as not_hashed)."""
        self.cancel.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.jobs.put(None, timeout=0.05)
                break
            except queue.Full:
                continue
        self.thread.join(max(0.0, deadline - time.monotonic()))


# -- the session layer --------------------------------------------------------------------------------
@dataclass
class Scope:
    """One recorder.checkpoint(path) scope of a thread."""

    pid: int
    tid: int
    ts: int
    path: str
    tag: int
    end_ts: int | None = None
    files: list[CheckpointFile] = field(default_factory=list)


@dataclass
class CheckpointFile:
    id: int
    pid: int
    path: str  # as first opened
    current: str | None  # where it is now (renames followed), None once another file was renamed over it
    opted_by: str
    scope: Scope | None
    ino: int | None
    modifies: CheckpointFile | None = None  # opted_by 'rewrite': the completed checkpoint it modifies
    open_fds: int = 0
    last_close_ts: int = 0
    complete: bool = False
    hashed: Verification | None = None


@dataclass
class OpenFile:
    """A target's descriptor opened for writing, from its open until its close."""

    pid: int
    tid: int
    fd: int
    open_id: int
    ts: int
    dur: int
    flags: int
    opened: str  # the absolute path it was opened at
    scope: Scope | None
    in_scope: bool
    path: str = ""  # where it is now (renames followed); set from `opened`
    state: str = "pending"  # pending, opted, ignored
    closed: bool = False
    file: CheckpointFile | None = None
    held: list[tuple[str, tuple]] = field(default_factory=list)  # rows waiting for the verdict
    renames: list[tuple] = field(default_factory=list)  # (ts, dur, tid) of renames that moved it meanwhile

    def __post_init__(self) -> None:
        self.path = self.path or self.opened


class CheckpointLayer(BaseLayer):
    """Rows for checkpoint_file, checkpoint_extent, checkpoint_op and checkpoint_verify; one per session."""

    name = "checkpoint"
    sources = SOURCES
    tables = ("checkpoint_file", "checkpoint_extent", "checkpoint_op", "checkpoint_verify")
    records = RECORDS
    losses = RECORDS.losses()
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.writer = context.writer
        self.identity = context.identity
        self.sid = context.session_id
        self.probes: Probes | None = None
        self.enabled = False  # until attach() finds checkpoint.bpf.c compiled
        self.raw: list[bytes] = []
        self.opens: dict[tuple[int, int, int], OpenFile] = {}  # (pid, fd, open_id)
        self.pending: list[OpenFile] = []
        self.files: dict[int, CheckpointFile] = {}
        self.by_current: dict[str, CheckpointFile] = {}  # latest checkpoint file at each path
        self.scopes: dict[int, list[Scope]] = {}  # tid -> open scopes, innermost last
        self.settling: set[int] = set()  # file ids closed outside a scope, waiting SETTLE_NS
        self.backlog: deque[tuple[int, str]] = deque()  # (file id, trigger) waiting for the hasher
        self.unlooked: list[tuple[CheckpointFile, tuple]] = []  # new files: stat at the end of the batch
        self.exits_seen: list[int] = []  # pids, handled one flush later (their last events may lag)
        self.exits_due: list[int] = []
        self.cwd: dict[int, str] = {}
        self.attached: set[str] = set()
        self.hasher: Hasher | None = None
        self.events = 0
        self._next_id = 0

    def prepare(self) -> None:
        for table, cols in (("checkpoint_file", FILE_COLUMNS), ("checkpoint_extent", EXTENT_COLUMNS),
                            ("checkpoint_op", OP_COLUMNS), ("checkpoint_verify", VERIFY_COLUMNS)):
            self.writer.table(table, cols)
        row = self.context.store.one("SELECT max(id) AS m FROM checkpoint_file")
        self._next_id = ((row or {}).get("m") or 0) + 1

    def attach(self) -> None:
        self.probes = self.context.probes
        self.enabled = self.probes is not None and "checkpoint" in self.probes.layers
        if self.enabled:
            self.hasher = Hasher()
            # the recorder's own marker extension: attached before any target maps it, so a scope
            # entered right after `import recorder` is seen
            for lib in sorted(Path(__file__).resolve().parent.parent.glob("_markers*.so")):
                self.attach_markers(str(lib))

    def sinks(self) -> dict[str, Sink]:
        return {"checkpoint_events": self.raw.append} if self.enabled else {}

    # -- attaching -------------------------------------------------------------------------------
    def attach_markers(self, path: str) -> None:
        """The scope uprobe on one copy of the marker extension (recorder/_markers*.so)."""
        real = os.path.realpath(path)
        if real in self.attached or not self.enabled:
            return
        self.attached.add(real)
        try:
            self.probes.bpf.attach_uprobe(name=real, sym=MARKER_SYMBOL, fn_name="checkpoint_scope")
            self.probes.cap("checkpoint", MARKER_SYMBOL, "attached", "", real)
        except Exception as e:  # BCC raises bare Exception
            self.probes.cap("checkpoint", MARKER_SYMBOL, "failed", failure(e), real)

    def _follow_workload_libraries(self) -> None:
        """Copies of the marker extension the workload layer found mapped by a target."""
        for path in list(self.context.libraries):
            if path not in self.attached and workload_library_kind(path) == "markers":
                self.attach_markers(path)

    # -- events ----------------------------------------------------------------------------------
    def flush(self) -> None:
        if not self.enabled:
            return
        self._follow_workload_libraries()
        chunks = self.raw[:]  # the ring's callback appends to this very list
        self.raw.clear()
        self.events += len(chunks)
        for chunk in chunks:
            layout = _SIZES.get(len(chunk))
            if layout is CKPT_IO:
                self._io(*layout.unpack(chunk))
            elif layout is CKPT_OPEN:
                self._open(*layout.unpack(chunk))
            elif layout is CKPT_RENAME:
                self._rename(*layout.unpack(chunk))
            elif layout is CKPT_SCOPE:
                self._scope(*layout.unpack(chunk))
        self._classify()
        self._look()
        due, self.exits_due, self.exits_seen = self.exits_due, self.exits_seen, []
        for pid in due:
            self._writer_gone(pid)
        self._settle(now_ns())
        self._hand_over()
        self._collect()

    def process_exited(self, pid: int, ts: int) -> None:
        """A target process ended: its files without a close are judged one flush later."""
        if self.enabled:
            self.exits_seen.append(pid)

    def _thread(self, tid: int, pid: int, ts: int) -> int:
        return self.identity.thread(tid, pid, None, ts)

    def _scope(self, ts: int, phase: int, tag: int, addr: int, length: int, pid: int, tid: int,
               inline: bytes) -> None:
        path = self._marker_path(pid, addr, length, inline)
        if phase == 1:
            self.scopes.setdefault(tid, []).append(Scope(pid, tid, ts, path, tag))
            return
        stack = self.scopes.get(tid)
        if phase != 2 or not stack:
            return  # a scope entered before the session started
        at = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].path == path), len(stack) - 1)
        scope = stack.pop(at)
        scope.end_ts = ts
        for f in scope.files:
            self.writer.execute("UPDATE checkpoint_file SET scope_end_ts = ? WHERE id = ? AND scope_ts = ?",
                                (ts, f.id, scope.ts))
            self._maybe_complete(f)
        if not stack:
            del self.scopes[tid]

    def _marker_path(self, pid: int, addr: int, length: int, inline: bytes) -> str:
        raw = inline.split(b"\0", 1)[0]
        if length > len(raw) and addr:
            try:  # the path is alive in the process while its scope is
                with open(f"/proc/{pid}/mem", "rb") as mem:
                    mem.seek(addr)
                    raw = mem.read(min(length, 65536))
            except OSError:
                pass
        return os.path.normpath(os.fsdecode(raw))

    def _resolve(self, pid: int, dirfd: int, raw: bytes) -> str:
        """An absolute path from a path as a syscall got it (relative to the cwd or to dirfd)."""
        text = os.fsdecode(raw.split(b"\0", 1)[0])
        if text.startswith("/"):
            return os.path.normpath(text)
        base = None
        try:
            if dirfd == AT_FDCWD:
                base = self.cwd[pid] = os.readlink(f"/proc/{pid}/cwd")
            else:
                base = os.readlink(f"/proc/{pid}/fd/{dirfd}")
        except OSError:
            base = self.cwd.get(pid) if dirfd == AT_FDCWD else None
        return os.path.normpath(os.path.join(base, text)) if base else text

    def _open(self, ts: int, dur: int, open_id: int, flags: int, pid: int, tid: int, fd: int, dirfd: int,
              in_scope: int, _pad: int, raw: bytes) -> None:
        path = self._resolve(pid, dirfd, raw)
        if len(raw.split(b"\0", 1)[0]) >= 255:  # cut in BPF: the whole path from the descriptor
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
        stack = self.scopes.get(tid)
        o = OpenFile(pid, tid, fd, open_id, ts, dur, flags, path, stack[-1] if stack and in_scope else None,
                     bool(in_scope))
        self.opens[(pid, fd, open_id)] = o
        if not in_scope:
            self.pending.append(o)
        elif _not_a_checkpoint(path):  # BPF follows it; its records are dropped here
            o.state = "ignored"
        else:
            self._opt(o, "marker_scope", o.scope)

    def _io(self, ts: int, dur: int, open_id: int, offset: int, count: int, ret: int, pid: int, tid: int,
            fd: int, op: int) -> None:
        o = self.opens.get((pid, fd, open_id))
        if o is None or o.state == "ignored":
            return
        name = _OP_NAMES.get(op)
        if name is None:
            return
        th = self._thread(tid, pid, ts)
        error = ret if ret < 0 else 0
        row: tuple[str, tuple]
        if op in _WRITES:
            row = ("extent", (ts, dur, th, name, offset if offset >= 0 else None, max(ret, 0),
                              None if op in _VECTORED else count, error))
        else:
            row = ("op", (ts, dur, th, name, fd, None, offset if op == _TRUNCATE else None, None,
                          error))
        if op == _CLOSE:
            o.closed = True
            if o.state != "pending":
                del self.opens[(pid, fd, open_id)]
        if o.state == "pending":
            o.held.append(row)
            return
        assert o.file is not None  # an open that is not pending has its file
        self._write_row(o.file, row)
        if op == _CLOSE:
            self._closed(o.file, ts)

    def _write_row(self, f: CheckpointFile, row: tuple[str, tuple]) -> None:
        kind, values = row
        self.writer.add("checkpoint_extent" if kind == "extent" else "checkpoint_op", (self.sid, f.id, *values))

    def _rename(self, ts: int, dur: int, ret: int, pid: int, tid: int, olddirfd: int, newdirfd: int,
                flags: int, _pad: int, old_raw: bytes, new_raw: bytes) -> None:
        old = self._resolve(pid, olddirfd, old_raw)
        new = self._resolve(pid, newdirfd, new_raw)
        if ret != 0:
            f = self.by_current.get(old)
            if f is not None:  # a failed attempt to give a checkpoint its name
                self.writer.add("checkpoint_op", (self.sid, f.id, ts, dur, self._thread(tid, pid, ts), "rename",
                                                  None, None, None, db_text(new), ret))
            return
        prefix = old + "/"
        moved = [f for f in self.files.values()
                 if f.current is not None and (f.current == old or f.current.startswith(prefix))]
        replaced = self.by_current.get(new)
        if replaced is not None and replaced not in moved:
            replaced.current = None  # another file now has its name
            self.by_current.pop(new, None)
        th = self._thread(tid, pid, ts) if moved else None
        for f in moved:
            assert f.current is not None  # moved holds files with a name
            if self.by_current.get(f.current) is f:
                del self.by_current[f.current]
            f.current = new + f.current[len(old):]
            if f.opted_by != "rewrite":
                self.by_current[f.current] = f
            self.writer.add("checkpoint_op", (self.sid, f.id, ts, dur, th, "rename", None, None, None,
                                              db_text(f.current), 0))
        for o in self.pending:
            if o.path == old or o.path.startswith(prefix):
                o.path = new + o.path[len(old):]
                o.renames.append((ts, dur, tid, o.path))

    # -- which files are checkpoints ---------------------------------------------------------------
    def _classify(self) -> None:
        for o in self.pending:
            opted = self._verdict(o)
            if opted is None:
                o.state = "ignored"
                o.held.clear()
                if o.closed:
                    self.opens.pop((o.pid, o.fd, o.open_id), None)
            else:
                self._opt(o, *opted)
                if o.closed:
                    self.opens.pop((o.pid, o.fd, o.open_id), None)
            if not o.closed:
                self._send_verdict(o)
        self.pending = []

    def _verdict(self, o: OpenFile) -> tuple[str, Scope | None, CheckpointFile | None] | None:
        """(opted_by, scope, modified file) for a checkpoint, None for any other file."""
        try:
            st = os.stat(o.path)
            if not stat.S_ISREG(st.st_mode):
                return None
        except OSError:
            st = None
        live = self.by_current.get(o.path)
        if live is not None and not live.complete and live.pid == o.pid:
            return live.opted_by, live.scope, None  # another descriptor on a file being written
        scope = next((s for stack in self.scopes.values() for s in stack if s.pid == o.pid and s.path == o.path),
                     None)
        if scope is not None:
            return "marker_path", scope, None
        done = live if live is not None and live.complete else None
        if st is not None and has_checkpoint_xattr(o.path):
            if done is not None and not o.flags & O_TRUNC:
                return "rewrite", None, done
            return "xattr", None, None
        if done is not None:
            return "rewrite", None, done
        return None

    def _send_verdict(self, o: OpenFile) -> None:
        table = self.probes.bpf["ckpt_verdict"]
        key = table.Key()
        key.open_id, key.tgid, key.fd = o.open_id, o.pid, o.fd
        table[key] = ctypes.c_uint32(_OPTED if o.state == "opted" else _IGNORED)

    def _opt(self, o: OpenFile, opted_by: str, scope: Scope | None, modifies: CheckpointFile | None = None) -> None:
        o.state = "opted"
        live = self.by_current.get(o.path)
        merged = live is not None and not live.complete and live.pid == o.pid and opted_by != "rewrite"
        f = live if merged and live is not None else self._new_file(o, opted_by, scope, modifies)
        o.file = f
        f.open_fds += 1
        self.writer.add("checkpoint_op", (self.sid, f.id, o.ts, o.dur, self._thread(o.tid, o.pid, o.ts), "open",
                                          o.fd, o.flags, None, db_text(o.opened), 0))
        for row in o.held:
            self._write_row(f, row)
            if row[0] == "op" and row[1][3] == "close":
                self._closed(f, row[1][0])
        if not merged:  # renamed before it was known to be a checkpoint (a known file follows its own)
            for ts, dur, tid, path in o.renames:
                self.writer.add("checkpoint_op", (self.sid, f.id, ts, dur, self._thread(tid, o.pid, ts), "rename",
                                                  None, None, None, db_text(path), 0))
        o.held.clear()
        o.renames.clear()

    def _new_file(self, o: OpenFile, opted_by: str, scope: Scope | None,
                  modifies: CheckpointFile | None) -> CheckpointFile:
        f = CheckpointFile(self._next_id, o.pid, o.opened, o.path, opted_by, scope, None, modifies)
        self._next_id += 1
        self.files[f.id] = f
        if opted_by != "rewrite":
            self.by_current[o.path] = f
        if scope is not None:
            scope.files.append(f)
        self.unlooked.append((f, (
            f.id, self.sid, o.ts, o.dur, self._thread(o.tid, o.pid, o.ts), db_text(o.opened), opted_by,
            db_text(scope.path) if scope else None, scope.ts if scope else None,
            self._thread(scope.tid, scope.pid, scope.ts) if scope else None)))
        return f

    def _look(self) -> None:
        """The rows of this batch's new files, with the inode at their path now: after the batch's
        renames, and never through /proc/PID/fd (the descriptor may be closed and reused by now)."""
        for f, head in self.unlooked:
            st = None
            if f.current is not None:
                try:
                    st = os.stat(f.current)
                except OSError:
                    pass
            f.ino = st.st_ino if st else None
            scope = f.scope
            modifies = f.modifies
            self.writer.add("checkpoint_file", (
                *head, scope.end_ts if scope else None, signed64(scope.tag) if scope and scope.tag else None,
                os.major(st.st_dev) if st else None, os.minor(st.st_dev) if st else None, f.ino,
                modifies.id if modifies else None))
        self.unlooked.clear()

    # -- completion and hashing ----------------------------------------------------------------------
    def _closed(self, f: CheckpointFile, ts: int) -> None:
        f.open_fds = max(0, f.open_fds - 1)
        f.last_close_ts = max(f.last_close_ts, ts)
        self._maybe_complete(f)

    def _maybe_complete(self, f: CheckpointFile, trigger: str | None = None) -> None:
        if f.complete:
            return
        if trigger is None:
            if f.open_fds > 0 or (f.scope is not None and f.scope.end_ts is None):
                return
            if f.scope is None:  # a rename usually follows the close: give it a moment
                self.settling.add(f.id)
                return
            trigger = "completed"
        f.complete = True
        self.settling.discard(f.id)
        if f.opted_by == "rewrite":
            return  # a modification of a checkpoint: its writes are the evidence, not its content
        self.backlog.append((f.id, trigger))

    def _settle(self, now: int, force: bool = False) -> None:
        for file_id in list(self.settling):
            f = self.files[file_id]
            if force or now - f.last_close_ts >= SETTLE_NS:
                self.settling.discard(file_id)
                self._maybe_complete(f, "completed")

    def _writer_gone(self, pid: int) -> None:
        """Its process ended: files it left open or inside a scope are done as they are."""
        for key in [k for k in self.opens if k[0] == pid]:
            o = self.opens.pop(key)
            self._forget_fd(o)
        for tid in [t for t, stack in self.scopes.items() if stack and stack[0].pid == pid]:
            del self.scopes[tid]
            try:
                del self.probes.bpf["ckpt_scope"][ctypes.c_uint32(tid)]
            except KeyError:
                pass
        for f in self.files.values():
            if f.pid == pid and not f.complete and (f.open_fds > 0 or (f.scope and f.scope.end_ts is None)):
                f.open_fds = 0
                self._maybe_complete(f, "writer_exited")

    def _forget_fd(self, o: OpenFile) -> None:
        table = self.probes.bpf["ckpt_fds"]
        key = table.Key()
        key.tgid, key.fd = o.pid, o.fd
        try:
            if table[key].open_id == o.open_id:
                del table[key]
        except KeyError:
            pass

    def _hand_over(self) -> None:
        while self.backlog and self.hasher is not None:
            file_id, trigger = self.backlog[0]
            f = self.files[file_id]  # its path and inode as known now, after the renames seen
            if not self.hasher.offer(HashJob(f.id, f.current, f.ino, trigger)):
                break
            self.backlog.popleft()

    def _collect(self) -> None:
        if self.hasher is None:
            return
        while True:
            try:
                job, v = self.hasher.results.get_nowait()
            except queue.Empty:
                break
            f = self.files[job.file_id]
            if v.state == "missing" and f.current is not None and f.current != job.path:
                self.backlog.appendleft((f.id, job.trigger))  # renamed meanwhile: hash it at its new path
                continue
            if v.state == "hashed":
                f.hashed = v
            self._verify_row(job.file_id, job.trigger, v)

    def _verify_row(self, file_id: int, trigger: str, v: Verification) -> None:
        self.writer.add("checkpoint_verify", (
            self.sid, file_id, v.ts, v.dur, trigger, v.method, db_text(v.path), v.state, v.ino, v.size_bytes,
            v.mtime_ns, v.mtime_ts, v.sha256, v.detail))

    def counted(self) -> dict[str, int]:
        return {"checkpoint": self.events}

    def close(self, ts: int = 0) -> None:
        """At the stop: the exits not judged yet, the hashes still due (up to STOP_HASH_DEADLINE_S),
        then a stat of every hashed file."""
        if not self.enabled:
            return
        self.flush()
        for pid in self.exits_due + self.exits_seen:
            self._writer_gone(pid)
        self.exits_due, self.exits_seen = [], []
        self._settle(now_ns(), force=True)
        deadline = time.monotonic() + STOP_HASH_DEADLINE_S
        while time.monotonic() < deadline:
            self._hand_over()
            self._collect()
            if not self.backlog and self.hasher.idle():
                break
            time.sleep(0.02)
        self.hasher.stop(timeout_s=5.0)
        self._collect()
        for file_id, trigger in self.backlog:
            self._verify_row(file_id, trigger, Verification(
                now_ns(), 0, "sha256", self.files[file_id].current, "not_hashed",
                detail=f"the session stopped before it was hashed ({STOP_HASH_DEADLINE_S:.0f} s allowed)"))
        self.backlog.clear()
        for f in self.files.values():
            if f.hashed is not None:
                h = f.hashed
                self._verify_row(f.id, "session_stop", stat_again(h.path, h.ino, h.size_bytes, h.mtime_ns))


def _not_a_checkpoint(path: str) -> bool:
    """Files a scope's thread may write that are not what it saves: Python's bytecode cache (an
    import inside the scope), devices and pipes."""
    if "/__pycache__/" in path:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # gone already (renamed or removed): judged by what happened to it



# -- later: re-hash a recording's checkpoints ----------------------------------------------------------
def verify_checkpoints(store: Store, session_id: int | None = None) -> list[dict]:
    """Hash again every checkpoint of a session that was hashed when it completed (the latest session
    by default), store each result in checkpoint_verify (trigger 'recheck'; not when the store is
    read-only) and return them with
    `matches`: True when the content is what was hashed then. Safe to run any time, in any order."""
    if session_id is None:
        session_id = store.row("SELECT max(id) AS id FROM session")["id"]
        if session_id is None:
            raise StoreError(f"{store.path} holds no session: record one with 'recorder record' first")
    elif store.one("SELECT id FROM session WHERE id = ?", (session_id,)) is None:
        raise StoreError(f"no session {session_id} in {store.path}: 'recorder status' or the session table "
                         "lists them")
    files = store.query(
        "SELECT f.id AS file_id, v.path, v.ino, v.sha256, v.size_bytes FROM checkpoint_file f"
        " JOIN checkpoint_verify v ON v.id = (SELECT min(x.id) FROM checkpoint_verify x WHERE x.file_id = f.id"
        "   AND x.method = 'sha256' AND x.trigger IN ('completed', 'writer_exited'))"
        " WHERE f.session_id = ? AND v.state = 'hashed' ORDER BY f.id", (session_id,))
    out = []
    for f in files:
        v = hash_file(f["path"])
        if v.state == "hashed" and f["ino"] is not None and v.ino != f["ino"]:
            v = Verification(v.ts, v.dur, v.method, v.path, "replaced" if v.sha256 != f["sha256"] else "hashed",
                             v.ino, v.size_bytes, v.mtime_ns, v.mtime_ts, v.sha256,
                             f"inode {v.ino} at the path, was {f['ino']}")
        if not store.readonly:  # a recording opened read-only is hashed against, not written
            store.conn.execute(
                f"INSERT INTO checkpoint_verify ({', '.join(VERIFY_COLUMNS)})"
                f" VALUES ({', '.join('?' * len(VERIFY_COLUMNS))})",
                (session_id, f["file_id"], v.ts, v.dur, "recheck", v.method, v.path, v.state, v.ino, v.size_bytes,
                 v.mtime_ns, v.mtime_ts, v.sha256, v.detail))
        out.append({"file_id": f["file_id"], "path": f["path"], "state": v.state, "sha256": v.sha256,
                    "size_bytes": v.size_bytes, "matches": v.state == "hashed" and v.sha256 == f["sha256"],
                    "detail": v.detail})
    if not store.readonly:
        store.conn.commit()
    return out


def render_verification(results: list[dict]) -> str:
    """One line per re-hashed checkpoint, then a summary line."""
    lines = []
    for r in results:
        word = "ok" if r["matches"] else ("CHANGED" if r["state"] == "hashed" else r["state"].upper())
        extra = f" ({r['detail']})" if r["detail"] and not r["matches"] else ""
        lines.append(f"{word:10s} {r['path']}{extra}")
    bad = sum(not r["matches"] for r in results)
    lines.append(f"{len(results)} checkpoint files re-hashed, {bad} differ from what was recorded"
                 if results else "no hashed checkpoint files in this session")
    return "\n".join(lines)
