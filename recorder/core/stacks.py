"""Stacks at traced events: the Python stack (bpf/pystack.h) and the native user stack of each call,
resolved while the process lives and stored once per distinct stack.

The CUDA, NCCL and marker entry probes end with PYSTACK_CAPTURE(ctx, ts), which sends exactly one
`pystacks` record per call, keyed by (entry ts, pid, tid), the call's own event carrying the same
ts. The CUDA entries use PYSTACK_CAPTURE_BY_DIGEST: once a stack is resolved for good here, its
digest is confirmed to the walker (`pystack_known`), and a call repeating it sends no record; its
event carries the digest instead (`py_digest`), which `digests()` maps to the stack id.
sched_switch (a traced thread blocking), the block layer (a target's bio or I/O intent) and the
start of a target's direct reclaim end with PYSTACK_CAPTURE_TP: their events carry the key of their
stack record (`stack_ts`), which the events of one syscall share. `StackRecorder.add()` resolves
the records as they arrive and keeps each stack id under its key until the event's row takes it
(`join()`). A call's native stack is a digest under which the `native_stacks` map holds its frames
(bpf/cuda.bpf.c walks them); `native_id()` reads a digest's frames once per process and symbolises
them (the mapped ELF objects' symbols, read in bulk by recorder/core/elfsyms.py), cached per object
and address. Both are interned: a million calls from one line cost one stack row.

Per process (start, fork, exec) `seen()` configures the walker and one `capability` row says whether
its Python frames are read and, if not, why. A Python whose libpython is not mapped yet at exec
(shared builds: the dynamic loader runs after the exec event) is detected again on its next dlopen
and once a second until it is.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import re
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from recorder.core.capability import Observation
from recorder.core.elfsyms import FunctionSymbols
from recorder.core.pyframes import (
    COUNT_NAMES,
    STATUS_NAMES,
    STATUS_NOT_CONFIGURED,
    STATUS_UNSUPPORTED,
    PyStackProbe,
    PythonTarget,
    StackResolver,
    Unsupported,
    parse_pystack_event,
)

CAPABILITY_PROBE = "cpython frames"
OBSERVES = Observation("python", "Python source lines")  # what its CAPABILITY_PROBE rows say was observed
PENDING_JOIN_NS = 600 * 1_000_000_000  # a stack waits this long for its call's row (long syncs)
PARKED_MAX = 65536  # threads whose latest unjoined stack is kept beyond that, for a hang's call
# Shared keys already taken stay per thread for the syscall's other events, e.g. a throttled bio a
# kworker queues (and the device completes) seconds after the thread's wait took the key: for
# RECENT_NS after the thread's newest taken key, at most RECENT_PER_THREAD of them.
RECENT_NS = 30 * 1_000_000_000
RECENT_PER_THREAD = 4096
# An off-CPU interval whose stack is read at its syscall's exit (bpf/sched.bpf.c) waits this long
# for it: a syscall that blocked for a while may go on blocking (a large read) after the interval.
PROMISE_WAIT_NS = 60 * 1_000_000_000
PROMISE_MISSED = "python stack of a syscall that did not return"
Key = tuple[int, int, int]  # a stack record's (ts, pid, tid)
try:
    from recorder._ingest import join_known_stacks as _join_known_stacks
except ImportError:  # not built: every record goes through add()'s loop
    _join_known_stacks = None
_RECORD_KEY = struct.Struct("=QII")  # the (ts, pid, tid) that opens a pystacks record
_PYTHON_NAME = re.compile(r"python\d|libpython")
PENDING_RETRY_S = 1.0  # a pending process is detected again at least this often
PENDING_S = 10.0       # and for this long, after which its answer is final


# the event tables whose rows carry the Python stack captured for them
STACK_EVENT_TABLES = ("cuda_call", "offcpu_interval", "block_request", "nccl_call", "reclaim_interval")
# python_stack.status of a stack whose frames were read (all of them, or the innermost ones)
READ_STATUSES = ("ok", "truncated")


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------------------------
# Native symbols


@dataclass(frozen=True)
class NativeFrame:
    address: int  # run-time instruction address (return address for callers)
    object: str | None  # mapped file, None for anonymous memory (JIT, vdso)
    symbol: str | None  # function symbol, None where the object has no symbol there
    offset: int | None  # bytes from the symbol's start (or from the object's start without symbol)


@dataclass
class _Mapping:
    start: int
    end: int
    offset: int
    path: str | None  # the mapped file; None for anonymous memory ([anon], JIT code, [vdso], ...)
    # the mapped ELF object's key and symbols, looked up at the first address in it
    object: tuple[tuple[int, int], FunctionSymbols | None] | None = None
    looked_up: bool = False


@dataclass
class _Maps:
    """One read of /proc/PID/maps: every mapping, file-backed or not, sorted by address."""

    starts: list[int]
    mappings: list[_Mapping]
    read_ns: int
    missed: set[int]  # addresses in no mapping as of this read

    def find(self, addr: int) -> _Mapping | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.mappings[i].end:
            return self.mappings[i]
        return None


# times a process whose interpreter state the walker cannot read is detected again (once a second)
RERESOLVE_MAX = 3

# An address in no mapping (a stale frame record's garbage, or memory mapped after the last read)
# makes the maps be read again at most this often per process: a PyTorch process maps thousands of
# regions, and re-reading them for every new stack would cost milliseconds each.
MAPS_REREAD_NS = 1_000_000_000


class NativeSymbolizer:
    """Addresses of a process -> NativeFrames, via /proc/PID/maps and the mapped files' symbols.

    The maps are read once per process and kept: every mapping, anonymous executable memory
    included (a driver's generated code, JIT code), so an address there costs a lookup, not a
    re-read. They are read again when the process loads a library or execs (`forget()`), and, for
    an address in no mapping at all, at most once per MAPS_REREAD_NS. Objects are keyed by (device,
    inode) of the file actually mapped, so a library replaced on disk is never read for a process
    that maps the old one; symbols are cached per (object, address)."""

    def __init__(self) -> None:
        self._maps: dict[int, _Maps] = {}
        self._objects: dict[tuple[int, int], FunctionSymbols | None] = {}
        self._cache: dict[tuple[tuple[int, int], int], tuple[str, int] | None] = {}
        self.maps_reads = 0  # reads of /proc/PID/maps so far (docs/benchmarks.md)

    def forget(self, pid: int) -> None:
        """The process mapped or unmapped code (a library load, an exec, an exit): its maps are
        read again at its next stack."""
        self._maps.pop(pid, None)

    def _read_maps(self, pid: int) -> _Maps | None:
        mappings = []
        self.maps_reads += 1
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) < 5:
                        continue
                    lo, hi = parts[0].split("-")
                    path = parts[5].rstrip("\n") if len(parts) == 6 else ""
                    mappings.append(_Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16),
                                             path if path.startswith("/") else None))
        except (OSError, ValueError):
            return self._maps.get(pid)
        maps = _Maps([m.start for m in mappings], mappings, _now_ns(), set())
        self._maps[pid] = maps
        return maps

    def _object(self, pid: int, m: _Mapping) -> tuple[tuple[int, int], FunctionSymbols | None] | None:
        if m.looked_up:
            return m.object
        m.looked_up = True
        assert m.path is not None
        mapped = f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"
        try:
            st = os.stat(mapped)
        except OSError:
            try:
                st = os.stat(m.path)
                mapped = m.path
            except OSError:
                return None
        key = (st.st_dev, st.st_ino)
        if key not in self._objects:
            try:
                self._objects[key] = FunctionSymbols(mapped)
            except Exception:  # not an ELF file, or one pyelftools cannot read: addresses only
                self._objects[key] = None
        m.object = (key, self._objects[key])
        return m.object

    def frames(self, pid: int, addresses: list[int],
               symbolise: Callable[[str], bool] | None = None) -> list[NativeFrame]:
        """`symbolise(path)` false: the frames in that object keep its path and offset, no symbol
        (its symbol table is not read)."""
        maps = self._maps.get(pid) or self._read_maps(pid)
        out = []
        for depth, addr in enumerate(addresses):
            m = maps.find(addr) if maps else None
            if m is None and (maps is None or addr not in maps.missed):
                if maps is None or _now_ns() - maps.read_ns >= MAPS_REREAD_NS:
                    maps = self._read_maps(pid)
                    m = maps.find(addr) if maps else None
                if m is None and maps is not None:
                    maps.missed.add(addr)
            if m is None or m.path is None:
                out.append(NativeFrame(addr, None, None, None))
                continue
            file_offset = addr - m.start + m.offset
            if symbolise is not None and not symbolise(m.path):
                out.append(NativeFrame(addr, m.path, None, file_offset))
                continue
            obj = self._object(pid, m)
            if obj is None or obj[1] is None:
                out.append(NativeFrame(addr, m.path, None, file_offset))
                continue
            key, syms = obj
            assert syms is not None  # obj[1] checked above
            # a caller's address is where the call returns to: look up the call instruction
            vaddr = syms.vaddr(file_offset - (1 if depth else 0))
            ck = (key, vaddr)
            if ck not in self._cache:
                self._cache[ck] = syms.lookup(vaddr)
            hit = self._cache[ck]
            if hit is None:
                out.append(NativeFrame(addr, m.path, None, file_offset))
            else:
                out.append(NativeFrame(addr, m.path, hit[0], hit[1] + (1 if depth else 0)))
        return out


# ---------------------------------------------------------------------------------------------
# The session side

_NOT_USER = 1 << 63  # kernel half of the address space, and above SQLite's INTEGER

PY_CODE_COLUMNS = ("id", "session_id", "filename", "qualname", "first_line")
PY_STACK_COLUMNS = ("id", "session_id", "hash", "depth", "status", "failure", "reread")
PY_FRAME_COLUMNS = ("stack_id", "depth", "code_id", "line")
NATIVE_STACK_COLUMNS = ("id", "session_id", "hash", "depth")
NATIVE_FRAME_COLUMNS = ("stack_id", "depth", "address", "object", "symbol", "symbol_offset")
PY_GIL_COLUMNS = ("session_id", "pid", "lo", "hi", "version")


def _hash(value: object) -> str:
    return hashlib.sha1(repr(value).encode()).hexdigest()[:16]


class StackRecorder:
    """Resolves and interns the stacks of a session's calls; rows go through the session's Writer.

    `probes` is the session's Probes (its `bpf` holds the walker and the `native_stacks` map, its
    `capabilities` list is what the session stores)."""

    def __init__(self, store: Any, writer: Any, session_id: int, probes: Any) -> None:
        self.store = store
        self.writer = writer
        self.session_id = session_id
        self.probes = probes
        self.walker: PyStackProbe = probes.pystack  # installed by Probes
        self.resolver = StackResolver(self.walker.targets)
        self.natives = NativeSymbolizer()
        # imported now, not at the first target's detection: the import takes ~50 ms, during which
        # a freshly exec'd Python's first calls would be recorded with the walker not configured
        import elftools.elf.elffile  # noqa: F401
        for name, cols in (("python_code", PY_CODE_COLUMNS), ("python_stack", PY_STACK_COLUMNS),
                           ("python_stack_frame", PY_FRAME_COLUMNS), ("native_stack", NATIVE_STACK_COLUMNS),
                           ("native_stack_frame", NATIVE_FRAME_COLUMNS), ("python_gil", PY_GIL_COLUMNS)):
            writer.table(name, cols)
        self._next = {t: store.one(f"SELECT coalesce(max(id), 0) AS n FROM {t}")["n"]
                      for t in ("python_code", "python_stack", "native_stack")}
        self._codes: dict[tuple[str, str, int], int] = {}
        self._py_stacks: dict[str, int] = {}  # hash -> id
        self._raw: dict[tuple, int] = {}  # (pid, status, raw frames) -> stack id
        # (pid, record bytes after ts/pid/tid) -> (stack id, status waits for configuration)
        self._seen: dict[tuple[int, bytes], tuple[int, bool]] = {}
        self._native_stacks: dict[str, int] = {}
        self._native_raw: dict[tuple[int, int], int] = {}  # (pid, native digest) -> stack id
        self._join: dict[Key, int] = {}  # (ts, pid, tid) -> python stack id, until an event takes it
        # (pid, tid) -> (ts, stack id): each thread's latest stack pruned from _join unjoined, which
        # is a call still in flight (a hang's) when its thread made no call since (open_stack())
        self._parked: dict[tuple[int, int], tuple[int, int]] = {}
        # digest -> python stack id, for the events whose stack was sent as its digest only (the
        # walker's pystack_known holds the digests confirmed here), and the digests per pid
        self._digests: dict[int, int] = {}
        self._digests_of: dict[int, list[int]] = {}
        self.digest_errors = 0  # digests the walker could not be told (it then keeps sending records)
        # keys several events may name (one capture per syscall): (pid, tid) -> {ts: stack id}
        self._recent: dict[tuple[int, int], dict[int, int]] = {}
        # events whose stack record was not read yet, per kind: the rings are read one after the
        # other, so an event can be read in the poll before its (earlier) stack record; held one flush
        self._held: dict[str, list[tuple]] = {}
        self._final = False
        self._gils: set[tuple[int, int]] = set()  # (pid, _PyRuntime) written to python_gil
        self.pending: set[int] = set()  # pids that may still turn out to be Python (libpython not mapped)
        # pids whose interpreter state the walker could not read, to detect again; times each was
        self._reresolve: set[int] = set()
        self._rereads: dict[int, int] = {}
        self._reported: set[int] = set()  # pids whose capability row is written
        self._maps_seen: dict[int, tuple[int, float]] = {}  # pending pid -> (mapped files, when) at its last detection
        self._pending_since: dict[int, float] = {}  # pending pid -> when it became pending (monotonic s)
        self.losses: dict[str, int] = {}  # stack records lost, written to `loss` once a second
        # calls without a native stack, by reason (not event losses: the call itself is recorded);
        # unresolved Python frames are counted on the stack itself (python_stack.status)
        self.native_errors: Counter[str] = Counter()
        self._counts_seen: dict[str, int] = {}

    # -- processes --------------------------------------------------------------------------------
    def seen(self, pid: int, how: str) -> None:
        """A target process appeared (start, fork) or replaced its image (exec)."""
        if how == "exec" or pid in self.walker.targets:
            self.walker.forget(pid)  # the old image's recipe must not walk the new one meanwhile
            self._drop(pid)
            self._settled(pid)  # a new image is pending from its own start
        self._configure(pid)

    def _configure(self, pid: int) -> None:
        try:
            target = self.walker.configure(pid)
        except Exception as e:  # map update failed: report, never stop recording
            self.walker.targets[pid] = target = Unsupported(pid, f"walker not configured: {e}")
        if isinstance(target, Unsupported) and self._may_become_python(pid):
            self.pending.add(pid)
            self._pending_since.setdefault(pid, time.monotonic())
        else:
            self._settled(pid)
        if isinstance(target, PythonTarget) and target.runtime_size and (pid, target.runtime) not in self._gils:
            # where its GIL is: a futex wait in this range is a wait for the interpreter lock
            if any(p == pid for p, _ in self._gils):  # an exec: the old image's lock is gone
                self._gils = {k for k in self._gils if k[0] != pid}
                self.writer.execute("DELETE FROM python_gil WHERE session_id = ? AND pid = ? AND lo != ?",
                                    (self.session_id, pid, target.runtime))
            self._gils.add((pid, target.runtime))
            self.writer.add("python_gil", (self.session_id, pid, target.runtime,
                                           target.runtime + target.runtime_size, target.version_text))

    @staticmethod
    def _may_become_python(pid: int) -> bool:
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            return False
        return bool(_PYTHON_NAME.search(exe))

    def retry_pending(self) -> None:
        """Detect again the processes whose interpreter was not mapped yet, once it is (checked at
        every flush, after a dlopen and once a second: a cheap read of /proc/PID/maps). A process
        is detected again when its mappings changed, and at least once a second while it stays
        pending, for up to PENDING_S: an answer read in a moment of its start-up (its exec's
        loader still mapping libpython, an event of its image before read after) is never final
        while it could still change."""
        now = time.monotonic()
        for pid in list(self.pending):
            try:
                with open(f"/proc/{pid}/maps", "rb") as f:
                    maps = f.read()
            except OSError:  # exited
                self._settled(pid)
                continue
            count = maps.count(b"/")
            last = self._maps_seen.get(pid)
            if last is not None and last[0] == count and now - last[1] < PENDING_RETRY_S:
                continue
            self._maps_seen[pid] = (count, now)
            self._configure(pid)
            if pid in self.pending and now - self._pending_since.get(pid, now) >= PENDING_S:
                self._settled(pid)  # not Python after all (a stripped build, an unsupported one): final

    def _settled(self, pid: int) -> None:
        self.pending.discard(pid)
        self._maps_seen.pop(pid, None)
        self._pending_since.pop(pid, None)

    def _drop(self, pid: int) -> None:
        self._rereads.pop(pid, None)  # a new image (or none) starts over
        self._reresolve.discard(pid)
        self.resolver.forget(pid)
        self.natives.forget(pid)
        self.walker.targets.pop(pid, None)
        self._raw = {k: v for k, v in self._raw.items() if k[0] != pid}
        self._seen = {k: v for k, v in self._seen.items() if k[0] != pid}
        self._recent = {k: v for k, v in self._recent.items() if k[0] != pid}
        self._native_raw = {k: v for k, v in self._native_raw.items() if k[0] != pid}
        for d in self._digests_of.pop(pid, ()):
            self._digests.pop(d, None)
        self._reported.discard(pid)

    def exited(self, pid: int) -> None:
        self._report(pid)
        self._settled(pid)
        self._drop(pid)
        self.walker.forget(pid)

    def _report(self, pid: int) -> None:
        """One capability row per process image: whether its Python frames are read."""
        if pid in self._reported or pid not in self.walker.targets:
            return
        from recorder.core.capability import Capability

        target = self.walker.targets[pid]
        self._reported.add(pid)
        if isinstance(target, Unsupported):
            cap = Capability("python", CAPABILITY_PROBE, "absent", target.reason, f"pid {pid}", _now_ns())
        else:
            cache = self.walker.code_cache.get(pid)
            detail = f"CPython {target.version_text} ({target.elf_path})"
            detail += "; code objects cached across walks" if cache is None else f"; {cache}"
            cap = Capability("python", CAPABILITY_PROBE, "attached", detail, f"pid {pid}", _now_ns())
        self.probes.capabilities.append(cap)

    # -- python stacks ----------------------------------------------------------------------------
    def add(self, records: list[bytes]) -> None:
        """Resolve `pystacks` records now, while their processes live (called at every flush).

        A record whose bytes after (ts, pid, tid) were seen before in the same process names the
        same stack: `_seen` maps them to its id without parsing (most calls repeat a few stacks)."""
        retry = bool(self.pending)
        seen, join, pending, reported = self._seen, self._join, self.pending, self._reported
        if _join_known_stacks is not None:  # the plain hits below, in C
            records = _join_known_stacks(records, _RECORD_KEY.size, seen, join, reported, pending,
                                         self.walker.targets)
        key_of = _RECORD_KEY.unpack_from
        confirm = []
        for data in records:
            ts, pid, tid = key_of(data)
            hit = seen.get((pid, data[_RECORD_KEY.size:]))
            if hit is not None:
                stack_id, waits = hit
                if waits and pid in pending:
                    retry = True
                elif pid not in reported and pid not in pending:
                    self._report(pid)
                join[(ts, pid, tid)] = stack_id
                continue
            ev = parse_pystack_event(data)
            waits = ev.status in (STATUS_NOT_CONFIGURED, STATUS_UNSUPPORTED)
            if waits and pid in pending:
                retry = True
            elif pid not in reported and pid not in pending:
                self._report(pid)
            key = (pid, ev.status, ev.frames)
            known = self._raw.get(key)
            stack_id = known if known is not None else self._python_stack(ev)
            if key in self._raw:  # resolved for good: the same bytes mean the same stack
                seen[(pid, data[_RECORD_KEY.size:])] = (stack_id, waits)
                if ev.digest and ev.digest not in self._digests:
                    self._digests[ev.digest] = stack_id
                    self._digests_of.setdefault(pid, []).append(ev.digest)
                    confirm.append(ev.digest)
            join[(ts, pid, tid)] = stack_id
        if confirm:
            try:
                self.walker.confirm(confirm)
            except Exception:  # the map refused: captures keep sending records, nothing is lost
                self.digest_errors += len(confirm)
        if retry:
            self.retry_pending()

    def _python_stack(self, ev: Any) -> int:
        status = STATUS_NAMES.get(ev.status, f"status {ev.status}")
        frames: list[tuple[int | None, int | None]] = []
        resolved = True
        failure = None
        reread = 0
        raw = ev.frames
        if ev.unread:
            # code objects the walker could not read (a page not resident): say why (the page's
            # state, before the read below faults it in), then read them here without a checksum
            failure = "code object " + self.resolver.page_state(ev.pid, raw[ev.unread[0]][0])
            raw = tuple((code, instr, None) if i in ev.unread else (code, instr, csum)
                        for i, (code, instr, csum) in enumerate(raw))
        if ev.failed:  # the read that ended the walk: not retried, the thread has run on since
            what, addr = ev.failed
            if what == "interpreter state" and self._rereads.get(ev.pid, 0) < RERESOLVE_MAX:
                self._reresolve.add(ev.pid)  # detected again at the next second (housekeeping)
            if what == "code pointer":  # a frame read while the interpreter was writing it
                failure = "frame without its code object"
            elif what == "task" or not addr:
                failure = f"{what} memory unreadable"
            else:
                failure = f"{what} {self.resolver.page_state(ev.pid, addr)}"
        if raw:
            for i, f in enumerate(self.resolver.resolve(ev.pid, raw)):
                if f.available and i in ev.unread:
                    reread += 1
                if not f.available:
                    resolved = False
                    # the walk itself went well: say why user space could not resolve the frame
                    # (a module's code object is freed once its import ran, before it was read)
                    failure = failure or f.error
                    frames.append((None, None))
                    continue
                ck = (f.filename, f.qualname, f.first_line or 0)
                code_id = self._codes.get(ck)
                if code_id is None:
                    code_id = self._codes[ck] = self._new_id("python_code")
                    self.writer.add("python_code", (code_id, self.session_id, *ck))
                frames.append((code_id, f.line))
        if not resolved and status in ("ok", "truncated"):
            status = "unresolved"
        h = _hash((status, frames, failure, reread) if failure else (status, frames))
        stack_id = self._py_stacks.get(h)
        if stack_id is None:
            stack_id = self._py_stacks[h] = self._new_id("python_stack")
            self.writer.add("python_stack", (stack_id, self.session_id, h, len(frames), status, failure, reread))
            self.writer.extend("python_stack_frame",
                               [(stack_id, d, code, line) for d, (code, line) in enumerate(frames)])
        # a failed frame may resolve once re-read, a good one stays good; a code object read back
        # here has no checksum to tell a reused address: its record is resolved again each time
        if resolved and not ev.unread:
            self._raw[(ev.pid, ev.status, ev.frames)] = stack_id
        return stack_id

    def _new_id(self, table: str) -> int:
        self._next[table] += 1
        return self._next[table]

    def held(self, kind: str) -> bool:
        """Whether events of `kind` are held back for their stack record (see join())."""
        return bool(self._held.get(kind))

    def join(self, kind: str, records: Iterable[tuple], key: Callable[[tuple], Key | int | None],
             shared: bool = False, patient: Callable[[tuple], bool] | None = None
             ) -> Iterator[tuple[tuple, int | None]]:
        """The events of `kind` held back at the last call, then `records`, each with its Python
        stack id. `key(rec)` is the (ts, pid, tid) of the event's stack record, None when it has
        none (e.g. a preemption). An event whose record has not been read yet is held back for the
        next call, once; after that (or at the end of the session) its stack is None, which the
        walker has counted as lost (ring buffer full, scratch clobbered). `shared`: several events
        may name one key (the tracepoint captures, one per syscall). `key(rec)` may also be a
        stack digest (an int): the stack was sent before and the event carries its digest.
        `patient(rec)`: the record may come long after the event (captured at the end of the
        event's syscall): such an event is held until it comes, for up to PROMISE_WAIT_NS after
        the key's time or until the end of the session; one it never came for is counted in
        `losses` (PROMISE_MISSED)."""
        held = self._held.pop(kind, [])
        retrying = {key(r) for r in held}
        again = []
        pop = self._join.pop
        now = _now_ns()
        for rec in itertools.chain(held, records):
            k = key(rec)
            if k is None:
                yield rec, None
                continue
            if isinstance(k, int):  # a stack sent as its digest
                stack_id = self._digests.get(k)
            else:
                stack_id = self.take(k, shared) if shared else pop(k, None)
            if stack_id is None and patient is not None and type(k) is tuple and patient(rec):
                if not self._final and now - k[0] < PROMISE_WAIT_NS:
                    again.append(rec)
                    continue
                self.losses[PROMISE_MISSED] = self.losses.get(PROMISE_MISSED, 0) + 1
            elif stack_id is None and not self._final and k not in retrying:
                again.append(rec)
                continue
            yield rec, stack_id
        if again:
            self._held[kind] = again

    def digests(self) -> dict[int, int]:
        """Stack digest -> Python stack id, for events whose stack came as a digest."""
        return self._digests

    def join_keys(self) -> dict[Key, int]:
        """(ts, pid, tid) -> Python stack id of the stack records read and not yet joined: a
        caller that joins an event itself pops its key (recorder/_ingest.c)."""
        return self._join

    def open_stack(self, k: Key, take: bool) -> int | None:
        """The stack recorded under key k for a call still in flight (its event never came):
        from the records not joined yet, or the thread's parked one once it has waited longer than
        PENDING_JOIN_NS. `take` removes it (the stop), else it stays for the call's return."""
        stack_id = self._join.pop(k, None) if take else self._join.get(k)
        if stack_id is not None:
            return stack_id
        parked = self._parked.get((k[1], k[2]))
        return parked[1] if parked and parked[0] == k[0] else None

    def take(self, k: Key, shared: bool = False) -> int | None:
        """The stack id recorded under key k (None when not read, or lost)."""
        stack_id = self._join.pop(k, None)
        if not shared:
            return stack_id
        recent = self._recent.setdefault((k[1], k[2]), {})
        if stack_id is None:
            return recent.get(k[0])
        recent[k[0]] = stack_id
        horizon = k[0] - RECENT_NS
        while len(recent) > RECENT_PER_THREAD or next(iter(recent)) < horizon:
            del recent[next(iter(recent))]
        return stack_id

    # -- native stacks ----------------------------------------------------------------------------
    def native_cache(self) -> dict[tuple[int, int], int]:
        """(pid, native digest) -> native stack id already stored: the hot path's lookup before
        calling native_id()."""
        return self._native_raw

    def native_id(self, pid: int, digest: int, count: bool = True) -> int | None:
        """The stored native stack of a call whose entry walked `digest` (bpf/cuda.bpf.c), None
        when it has none (counted in native_errors by reason, unless `count` is false: a lookup
        ahead of the call's own)."""
        if not digest:  # the return address was unreadable, or the walk is not installed
            self.native_errors["native stack not walked"] += count
            return None
        cached = self._native_raw.get((pid, digest))
        if cached is not None:
            return cached
        table = self.probes.bpf["native_stacks"]
        try:
            value = table[table.Key(digest)]
        except KeyError:  # the insert failed, or 16,384 newer stacks evicted it before this read
            self.native_errors["native stack not in the map"] += count
            return None
        stack_id = self.native_stack(pid, value.ip[:min(value.frames, len(value.ip))])
        self._native_raw[(pid, digest)] = stack_id
        return stack_id

    def native_stack(self, pid: int, addresses: Iterable[int],
                     symbolise: Callable[[str], bool] | None = None) -> int:
        """The stored native stack of `pid`'s user instruction `addresses`, innermost first (a
        walk's frames: the digests above, or the kernel's walk of a profile sample), symbolised
        (in the objects `symbolise(path)` accepts, all without it) and stored once per distinct stack."""
        # the walk stops at a frame pointer that cannot be one; a return address read from a
        # stale frame record can still be no user-space address (nor storable): cut there
        frames = self.natives.frames(pid, list(itertools.takewhile(lambda a: 0 < a < _NOT_USER, addresses)),
                                     symbolise)
        h = _hash([(f.address, f.object, f.symbol, f.offset) for f in frames])
        stack_id = self._native_stacks.get(h)
        if stack_id is None:
            stack_id = self._native_stacks[h] = self._new_id("native_stack")
            self.writer.add("native_stack", (stack_id, self.session_id, h, len(frames)))
            self.writer.extend("native_stack_frame", [
                (stack_id, d, f.address, f.object, f.symbol, f.offset) for d, f in enumerate(frames)])
        return stack_id

    # -- accounting -------------------------------------------------------------------------------
    def housekeeping(self, second: int) -> dict[str, int]:
        """Stack records lost since the last call (written to `loss` by the session); prunes stacks
        whose call never came (the call's own record was lost)."""
        try:
            counts = self.walker.counts()
        except Exception:
            counts = {}
        for name in (COUNT_NAMES[len(STATUS_NAMES)], COUNT_NAMES[len(STATUS_NAMES) + 1]):
            delta = counts.get(name, 0) - self._counts_seen.get(name, 0)
            self._counts_seen[name] = counts.get(name, 0)
            if delta > 0:
                self.losses[f"python stack {name}"] = self.losses.get(f"python stack {name}", 0) + delta
        out, self.losses = self.losses, {}
        horizon = second - PENDING_JOIN_NS
        if self._join and next(iter(self._join))[0] < horizon:
            for k, v in self._join.items():
                if k[0] < horizon and self._parked.get((k[1], k[2]), (0, 0))[0] < k[0]:
                    self._parked[(k[1], k[2])] = (k[0], v)
            self._join = {k: v for k, v in self._join.items() if k[0] >= horizon}
            while len(self._parked) > PARKED_MAX:
                del self._parked[next(iter(self._parked))]
        self.retry_pending()
        self._resolve_again()
        return out

    def _resolve_again(self) -> None:
        """A process whose interpreter state the walker could not read is detected again (its
        recipe written anew), at most RERESOLVE_MAX times per process image: its state may have
        been read before the interpreter was in place. Each walk reads it again in any case; this
        is for a recipe that cannot read it. A process that reads (or has no Python) costs nothing."""
        for pid in self._reresolve:
            if pid in self.walker.targets and isinstance(self.walker.targets[pid], PythonTarget):
                self._rereads[pid] = self._rereads.get(pid, 0) + 1
                self._seen = {k: v for k, v in self._seen.items() if k[0] != pid}
                self._raw = {k: v for k, v in self._raw.items() if k[0] != pid}
                self._configure(pid)
        self._reresolve.clear()

    def report_misses(self) -> None:
        """At the stop: a `capability` row per kind of stack some calls were stored without (the
        calls themselves were recorded, so this is no loss): layer 'cuda', probe 'native stacks',
        with the count per reason; layer 'python', probe 'stack digests', when the walker could not
        be told a digest (those stacks sent their record at every call instead: slower, not lost)."""
        from recorder.core.capability import Capability

        if self.native_errors:
            total = sum(self.native_errors.values())
            reasons = ", ".join(f"{reason}: {n:,}" for reason, n in self.native_errors.most_common())
            self.probes.capabilities.append(Capability(
                "cuda", "native stacks", "attached", f"{total:,} calls stored without one ({reasons})",
                "", _now_ns()))
        if self.digest_errors:
            self.probes.capabilities.append(Capability(
                "python", "stack digests", "attached",
                f"{self.digest_errors:,} stacks the walker could not be told (they kept sending "
                "their record at every call)", "", _now_ns()))

    def amend_capabilities(self) -> int:
        """After the last rows are written: see amend_stack_capabilities()."""
        return amend_stack_capabilities(self.store.conn, self.session_id)

    def finish(self) -> None:
        self._final = True
        for pid in list(self.walker.targets):
            if pid not in self.pending:
                self._report(pid)
        for pid in list(self.pending):
            self._report(pid)
        self.resolver.close()


def amend_stack_capabilities(conn: Any, sid: int) -> int:
    """After the last rows of session `sid` are written: each process's 'cpython frames' row says
    how many of the stacks of its recorded events were read, why the others were not (with the
    reason a read failed, python_stack.failure) and how many were read only after user space read
    back a code object the walker could not; a process none of whose stacks could be read is
    'failed', not 'attached'. Returns the rows changed."""
    events = " UNION ALL ".join(
        f"SELECT thread_id, python_stack_id FROM {table} WHERE session_id = :s AND python_stack_id IS NOT NULL"
        for table in STACK_EVENT_TABLES)
    counts: dict[int, Counter] = {}
    failures: dict[int, dict[str, Counter]] = {}  # pid -> status -> failure -> events
    rereads: dict[int, Counter] = {}  # pid -> why a code object was read back -> events then read
    for pid, status, failure, reread, n in conn.execute(
            f"SELECT p.pid, st.status, st.failure, st.reread > 0, count(*) FROM ({events}) e"
            " JOIN python_stack st ON st.id = e.python_stack_id JOIN thread t ON t.id = e.thread_id"
            " JOIN process p ON p.id = t.process_id GROUP BY 1, 2, 3, 4", {"s": sid}):
        counts.setdefault(pid, Counter())[status] += n
        if status in READ_STATUSES:
            if reread:
                rereads.setdefault(pid, Counter())[failure or "code object page not resident"] += n
        elif failure:
            failures.setdefault(pid, {}).setdefault(status, Counter())[failure] += n
    changed = 0
    for cap_id, target, detail in conn.execute(
            "SELECT id, target, detail FROM capability WHERE session_id = ? AND layer = 'python' AND probe = ?"
            " AND status = 'attached' AND target LIKE 'pid %'", (sid, CAPABILITY_PROBE)).fetchall():
        by_status = counts.get(int(target[4:]) if target[4:].isdigit() else -1)
        if not by_status:
            continue
        total = sum(by_status.values())
        read = sum(n for status, n in by_status.items() if status in READ_STATUSES)
        pid = int(target[4:])
        why = failures.get(pid, {})
        failed = [f"{status}: {n:,}" + (f" ({', '.join(f'{r}: {k:,}' for r, k in why[status].most_common())})"
                                        if status in why else "")
                  for status, n in by_status.most_common() if status not in READ_STATUSES]
        summary = f"{read:,} of {total:,} stacks read" + (f" ({', '.join(failed)})" if failed else "")
        if pid in rereads:
            back = rereads[pid]
            summary += (f"; {sum(back.values()):,} of them after reading back code objects the walker"
                        f" could not ({', '.join(f'{r}: {k:,}' for r, k in back.most_common())})")
        if read:
            conn.execute("UPDATE capability SET detail = ? WHERE id = ?", (f"{detail}; {summary}", cap_id))
        else:
            conn.execute("UPDATE capability SET status = 'failed', detail = ? WHERE id = ?",
                         (f"walker attached, {summary}; {detail}", cap_id))
        changed += 1
    return changed
