"""The CUDA layer: uprobes on every traced API a mapped libcudart/libcuda exports (apis.py), and the
rows of `cuda_call` and `cuda_api`."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from recorder.core.capability import failure
from recorder.core.clock import now_ns
from recorder.core.events import Loss
from recorder.core.inflight import CallInFlight, in_flight
from recorder.core.int64 import signed64
from recorder.core.layer import BaseLayer, BpfSource, Context, Observation, Phase, Sink
from recorder.core.libraries import (
    cuda_library_kind,
    exported_functions,
    gpu_libraries,
    resolve,
    workload_library_kind,
)
from recorder.core.x86insn import attach_pair, detach_entry, detach_return, entry_sites, site_detail
from recorder.layers.cuda.apis import (
    API_INDEX,
    APIS,
    FIRST_DRIVER_API,
    LAUNCH_LAYOUTS,
    Api,
    body_programs,
    bpf_programs,
    is_launch,
    return_program,
)
from recorder.layers.cuda.records import COUNT, COUNT_KERNELS, CUDA, RECORDS

SOURCES = (BpfSource("cuda", "cuda.bpf.c"),)


# -- rows ---------------------------------------------------------------------------------------------
CUDA_COLUMNS = (
    "session_id", "ts", "dur", "thread_id", "api_id", "ret", "size_bytes",
    "size_class", "stream", "function", "pointer", "event_handle", "memcpy_kind", "grid", "block",
    "shared_mem_bytes", "cgroup_id", "python_stack_id", "native_stack_id", "driver_api_id",
)
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
    "graph_launch": {"handle", "stream"},
    "graph_instantiate": {"pointer", "handle"},
    "capture_end": {"stream", "pointer"},
}
_API_FIELDS = [_LAYOUT_FIELDS[api.layout] for api in APIS]
# per API: (size, stream, launch, pointer, handle, memcpy_kind) are meaningful
_API_FLAGS = [tuple(name in fields for name in ("size", "stream", "launch", "pointer", "handle", "memcpy_kind"))
              for fields in _API_FIELDS]
# The same as one byte per API, bit i for flag i (recorder/_ingest.c)
_API_FLAG_BITS = bytes(sum(1 << i for i, flag in enumerate(flags) if flag) for flags in _API_FLAGS)
# cuda_call's columns as recorder/_ingest.c packs them: 'd' is a launch's "x,y,z" grid or block
CUDA_PROGRAM = "iiiiiiiiiiiiiddiiiii"
# cuda_event fields recorder/_ingest.c reads, in its order
CUDA_PACK_FIELDS = ("ts", "dur", "cgroup_id", "ret", "size", "stream", "function", "pointer", "handle",
                    "py_digest",
                    "pid", "tid", "api", "memcpy_kind", "grid_x", "grid_y", "grid_z", "block_x",
                    "block_y", "block_z", "shared_mem", "flags", "native_digest", "driver_api")
# cuda_event unpacked with its 64-bit fields signed: SQLite's INTEGER is a signed 64-bit value, so a
# value above 2**63 - 1 (a size_t of -1 passed to cudaMalloc) is stored as its two's complement
_CUDA_SIGNED = struct.Struct("=8x" + CUDA.fmt[1:].replace("Q", "q"))
_CUDA_PID, _CUDA_TID, _CUDA_DIGEST, _CUDA_FLAGS = (CUDA.names.index(n)
                                                   for n in ("pid", "tid", "py_digest", "flags"))
_NO_STACK = RECORDS.constants["CUDA_FLAG_NO_STACK"]
_SAMPLE = RECORDS.constants["CUDA_FLAG_SAMPLE"]
_FLAGS_AT = 8 + CUDA.offsets()["flags"]  # a framed record's flags
LAUNCH_COUNT_COLUMNS = ("session_id", "ts", "dur", "thread_id", "api_id", "function", "launches", "cgroup_id")
LAUNCH_SAMPLE_COLUMNS = ("session_id", "ts", "thread_id", "api_id", "function", "stream", "grid", "block",
                         "python_stack_id", "native_stack_id")
_COUNT_SIGNED = struct.Struct("=8x" + COUNT.fmt[1:].replace("Q", "q"))
_COUNT_AT = {name: i for i, name in enumerate(COUNT.names)}
_NO_API = RECORDS.constants["CUDA_NO_API"]


# `loss.probe` of a call in flight at stop that could not be stored (its thread had ended)
OPEN_LOST = "cuda call in flight, thread gone"
_OPEN_LOST = Loss(OPEN_LOST, "cuda", "CUDA calls in flight at the stop", "their thread had ended")
# where kernel launches are probed (LaunchRoute)
LAUNCHES_AT_DRIVER = "launches are probed at the driver: every runtime launch went through it"
ROUTE_EVIDENCE = 1000  # runtime launches seen through the driver before the runtime's probes go
ROUTE_CHECK_NS = 1_000_000_000
# `loss.probe` of a runtime launch in flight when the runtime's launch probes were detached
ROUTE_LOST = "cuda launch in flight when the runtime's launch probes were detached"
_ROUTE_LOST = Loss(ROUTE_LOST, "cuda", "CUDA kernel launches",
                   "in flight when the runtime's launch probes were detached")
_OPEN_INSERT = f"INSERT INTO cuda_call ({','.join(CUDA_COLUMNS)}, open) VALUES ({','.join('?' * len(CUDA_COLUMNS))}, 1)"
_RET = CUDA_COLUMNS.index("ret")


def _ingest_module():
    try:
        from recorder import _ingest
    except ImportError:  # not built (no compiler at install time): rows are built in Python
        return None
    return _ingest


def cuda_stack_key(rec: tuple) -> tuple[int, int, int] | int | None:
    """A CUDA call's stack record is keyed by its entry (ts, pid, tid); a stack sent before comes
    as its digest instead (bpf/pystack.h PYSTACK_CAPTURE_BY_DIGEST); a fast launch kept without
    stacks (CUDA_FLAG_NO_STACK) has none."""
    if rec[_CUDA_FLAGS] & _NO_STACK:
        return None
    return rec[_CUDA_DIGEST] or (rec[0], rec[_CUDA_PID], rec[_CUDA_TID])


class CudaLayer(BaseLayer):
    """CUDA calls of the targets: uprobes on every traced API a mapped libcudart/libcuda exports."""

    name = "cuda"
    sources = SOURCES
    tables = ("cuda_api", "cuda_call", "cuda_launch_count", "cuda_launch_sample", "library")
    records = RECORDS
    losses = (*RECORDS.losses(), _OPEN_LOST, _ROUTE_LOST)
    observes = (Observation("cuda", "CUDA runtime/driver calls"),)
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.raw: list[bytes] = []
        self.counts_raw: list[bytes] = []
        # kernel launches counted at their entry (bpf/cuda.bpf.c cuda_count_launch), not a row each
        self.counting = not context.settings.launch_rows
        self._pack_cuda: Callable | None = None
        self.route = LaunchRoute(context)

    def prepare(self) -> None:
        ctx = self.context
        ctx.store.conn.executemany(
            "INSERT OR IGNORE INTO cuda_api (id, name, family, library, arguments) VALUES (?,?,?,?,?)",
            [(i, a.name, a.family, a.library, a.layout) for i, a in enumerate(APIS)])
        ctx.store.conn.commit()
        ctx.writer.table("cuda_call", CUDA_COLUMNS)
        ctx.writer.table("cuda_launch_count", LAUNCH_COUNT_COLUMNS)
        ctx.writer.table("cuda_launch_sample", LAUNCH_SAMPLE_COLUMNS)
        self._pack_cuda = self._packing()

    def bpf_text(self) -> str:
        return bpf_programs(counts=self.counting)

    def attach(self) -> None:
        probes = self.context.probes
        try:  # the CUDA entries' native stack walk (bpf/cuda.bpf.c), one program for every API
            walk = probes.bpf.load_func("cuda_native", probes.BPF.KPROBE)
            probes.bpf.get_table("cuda_progs")[ctypes.c_int(0)] = ctypes.c_int(walk.fd)
        except Exception as e:  # the calls are recorded without their native stack
            probes.cap("cuda", "native stacks", "failed", failure(e))
        if self.counting:
            try:  # the sampled launches' stacks (bpf/cuda.bpf.c cuda_launch_sample)
                sample = probes.bpf.load_func("cuda_launch_sample", probes.BPF.KPROBE)
                probes.bpf.get_table("cuda_progs")[ctypes.c_int(1)] = ctypes.c_int(sample.fd)
            except Exception as e:  # launches are counted, none is kept as a sample
                probes.cap("cuda", "launch samples", "failed", failure(e))
        try:  # the bodies the per-API programs tail-call (bpf/cuda.bpf.c cuda_dispatch)
            bodies = probes.bpf.get_table("cuda_bodies")
            for slot, name in enumerate(body_programs()):
                bodies[ctypes.c_int(slot)] = ctypes.c_int(probes.bpf.load_func(name, probes.BPF.KPROBE).fd)
        except Exception as e:  # no CUDA call can be recorded
            probes.cap("cuda", "call bodies", "failed", failure(e))

    def attach_library(self, path: str, kind: str) -> int:
        """Attach entry and return probes to every traced API the library exports."""
        probes = self.context.probes
        real = os.path.realpath(path)
        if real in probes.attached_libraries:
            return 0
        names = exported_functions(real)
        wanted = [api for api in APIS if api.library == kind and api.name in names]
        if not wanted:
            probes.cap("cuda", f"{kind} library", "absent", "exports no traced CUDA API", path)
            probes.attached_libraries[real] = 0
            return 0
        count = 0
        sites = entry_sites(real, {api.name for api in wanted})  # where each probe costs one trap
        for api in wanted:
            i = API_INDEX[api.name]
            if not self.route.wants(real, api):
                probes.cap("cuda", api.name, "absent", LAUNCHES_AT_DRIVER, path)
                continue
            site = sites.get(api.name)
            try:
                # a counted launch: its entry only
                returns = None if self.counting and is_launch(api) else return_program(api)
                attach_pair(probes.bpf, real, api.name, site, f"cuda_entry_{i}", returns)
                probes.cap("cuda", api.name, "attached", site_detail(site), path)
                self.route.attached(real, api)
                count += 1
            except Exception as e:
                probes.cap("cuda", api.name, "failed", failure(e), path)
        probes.attached_libraries[real] = count
        return count

    def found(self, path: str, kind: str, found_by: str) -> None:
        """A CUDA library mapped by a target (or named by --cuda-lib): attach it, and list it in
        `library` the first time."""
        probes = self.context.probes
        before = len(probes.attached_libraries)
        self.attach_library(path, kind)
        if len(probes.attached_libraries) > before:
            self.context.writer.add("library", (self.context.session_id, path, kind, now_ns(), found_by))

    def named_library(self, path: str) -> bool:
        """--cuda-lib: every library but NCCL and the marker extension (the workload layer's) is
        taken as a CUDA one, the runtime unless its name says driver."""
        if workload_library_kind(path):
            return False
        self.found(path, cuda_library_kind(path) or "runtime", "option")
        return True

    def scan(self, pid: int, found_by: str) -> None:
        for path, kind in gpu_libraries(pid):
            found = resolve(pid, path)
            self.found(found, kind, found_by)
            if kind == "runtime":
                self.route.mapped(pid, os.path.realpath(found))

    def sinks(self) -> dict[str, Sink]:
        return {"cuda_events": self.raw.append, "cuda_counts": self.counts_raw.append}

    def blocks(self) -> dict[str, int]:
        return {"cuda_events": CUDA.size, "cuda_counts": COUNT.size}

    def flush(self) -> None:
        ctx = self.context
        self.route.check()
        joined_cuda = b"".join(self.raw)  # blocks of framed records (Probes.open_rings)
        ctx.events["cuda"] += len(joined_cuda) // CUDA.framed_size
        if self.counting:
            joined_cuda = self._launch_samples(joined_cuda)
            if self.counts_raw:
                joined = b"".join(self.counts_raw)
                self.counts_raw.clear()
                self._write_counts(_COUNT_SIGNED.iter_unpack(joined))
        if self.raw or ctx.stacks.held("cuda"):
            if self._pack_cuda and joined_cuda:
                joined_cuda = self._pack_cuda_rows(joined_cuda)
            ctx.writer.extend("cuda_call", self._cuda_rows(joined_cuda))
            self.raw.clear()

    def _launch_samples(self, joined: bytes) -> bytes:
        """Write the sampled launches among framed cuda_event records into cuda_launch_sample; returns
        the other records (the calls with a return probe)."""
        framed = CUDA.framed_size
        view = memoryview(joined)
        keep, samples = [], []
        flags_at = _FLAGS_AT
        for at in range(0, len(joined), framed):
            if int.from_bytes(view[at + flags_at:at + flags_at + 4], "little") & _SAMPLE:
                samples.append(view[at:at + framed])
            else:
                keep.append(view[at:at + framed])
        if not samples and not self.context.stacks.held("cuda_sample"):
            return joined
        ctx = self.context
        stacks = ctx.stacks
        threads, ident = ctx.identity.threads, ctx.identity
        natives = stacks.native_cache()
        rows = []
        records = _CUDA_SIGNED.iter_unpack(b"".join(samples))
        for rec, py_stack in stacks.join("cuda_sample", records, cuda_stack_key):
            (ts, _dur, _cg, _ret, _size, stream, function, _pointer, _handle, _digest, pid, tid, api, _kind,
             gx, gy, gz, bx, by, bz, _shmem, _flags, _driver_api, _reserved, native_stack) = rec
            th = threads.get(tid) or ident.thread(tid, pid, None, ts)
            native = natives.get((pid, native_stack))
            if native is None:
                native = stacks.native_id(pid, native_stack)
            rows.append((ctx.session_id, ts, th, api, function, stream, f"{gx},{gy},{gz}", f"{bx},{by},{bz}",
                         py_stack, native))
        ctx.writer.extend("cuda_launch_sample", rows)
        return b"".join(keep) if len(keep) * framed != len(joined) else joined

    def _write_counts(self, records: Iterable[tuple]) -> int:
        """cuda_launch_count rows of cuda_count_event records (unpacked, 64-bit fields signed): one per
        kernel named, one for the others. Returns the launches."""
        ctx = self.context
        sid = ctx.session_id
        threads, ident = ctx.identity.threads, ctx.identity
        at = _COUNT_AT
        f0, c0, a0 = at["function_0"], at["count_0"], at["api_0"]
        rows: list[tuple] = []
        launches = 0
        for r in records:
            n = r[at["launches"]]
            if n <= 0:
                continue
            ts, last, pid, tid = r[at["ts"]], r[at["last_ts"]], r[at["pid"]], r[at["tid"]]
            th = threads.get(tid) or ident.thread(tid, pid, None, ts)
            cg = r[at["cgroup_id"]]
            for i in range(min(r[at["kernels"]], COUNT_KERNELS)):
                rows.append((sid, ts, last - ts, th, r[a0 + i], r[f0 + i], r[c0 + i], cg))
            if r[at["other"]]:
                rows.append((sid, ts, last - ts, th, None, None, r[at["other"]], cg))
            launches += n
        ctx.events["cuda"] += launches
        ctx.writer.extend("cuda_launch_count", rows)
        return launches

    def _drain_counts(self, final: bool) -> None:
        """The launches counted and not sent yet (bpf/cuda_inflight.h cuda_tallies): at the stop, every
        thread's (taken from the map); at a dump none (they come with their thread's next send)."""
        if self.counting and final:
            self._take_tallies(lambda pid, tid: True)

    def tick(self, ts: int) -> None:
        """Once a second: the launches counted by threads that have exited (no program of theirs
        sends them any more) are written now, and their entries leave the map."""
        if self.counting:
            self._take_tallies(lambda pid, tid: not os.path.exists(f"/proc/{pid}/task/{tid}"))

    def _take_tallies(self, gone: Callable[[int, int], bool]) -> None:
        """Write and remove the tallies of the threads `gone(pid, tid)` names. A thread still running
        may count a launch between the read and the removal: only the stop takes those."""
        try:
            table = self.context.probes.bpf.get_table("cuda_tallies")
        except Exception:  # no CUDA layer loaded
            return
        records = []
        for key, t in list(table.items()):
            ev = t.ev
            if not gone(ev.pid, key.value):
                continue
            if ev.launches:
                records.append(tuple(signed64(getattr(ev, name)) if COUNT.fields[i][1] == "u64"
                                     else getattr(ev, name) for i, name in enumerate(COUNT.names)))
            try:
                del table[key]
            except KeyError:
                pass
        if records:
            self._write_counts(records)

    def _packing(self) -> Callable | None:
        """recorder/_ingest.c's pack_cuda with cuda_call declared packed to the writer, or None
        when the extensions are not built or not safe here (rows are then built in Python)."""
        writer = self.context.writer
        ingest = _ingest_module() if writer.packs else None
        if ingest is None:
            return None
        writer.packed_table("cuda_call", CUDA_PROGRAM)
        self._cuda_offsets = tuple(CUDA.offsets()[name] for name in CUDA_PACK_FIELDS)
        return ingest.pack_cuda

    def _pack_cuda_rows(self, joined: bytes) -> bytes:
        """Write the cuda_call rows of the records whose thread and stacks are known, packed
        (recorder/_ingest.c, the same values _cuda_rows() gives); returns the other records."""
        ctx = self.context
        framed = CUDA.framed_size
        assert self._pack_cuda is not None  # the packed path is taken only where it exists
        packed, misses = self._pack_cuda(
            joined, framed, self._cuda_offsets, ctx.session_id, ctx.identity.threads,
            ctx.stacks.join_keys(), ctx.stacks.digests(), ctx.stacks.native_cache(),
            _API_FLAG_BITS, self._learn_cuda)
        ctx.writer.extend_packed("cuda_call", packed)
        if not misses:
            return b""
        view = memoryview(joined)
        return b"".join([view[at:at + framed] for at in misses])

    def _learn_cuda(self, ts: int, pid: int, tid: int, native: int) -> None:
        """A thread or native stack seen for the first time by pack_cuda, at that record (the
        order the Python path would make them in)."""
        ctx = self.context
        if tid not in ctx.identity.threads:
            ctx.identity.thread(tid, pid, None, ts)
        if native and (pid, native) not in ctx.stacks.native_cache():  # a miss is counted at the call's row
            ctx.stacks.native_id(pid, native, count=False)

    def drain_in_flight(self, ts: int, final: bool) -> int:
        """Write the calls still in flight at `ts` as open cuda_call rows (dur: entry -> ts, ret
        NULL) with their thread, arguments and stacks; `final` (the stop) removes them from the
        map, else (a dump) they stay for their return. A call whose thread has ended is counted in
        `loss`. Returns the rows written."""
        ctx = self.context
        stacks = ctx.stacks
        self._drain_counts(final)
        records, lost = [], 0
        for call in in_flight(ctx.probes.bpf, "cuda_inflight", delete=final):
            r = call.record
            if r.ts == 0:  # a thread's launch record between launches (bpf/cuda.bpf.c)
                continue
            if call.pid is None or r.ts > ts:
                lost += call.pid is None
                continue
            # a launch's stacks are taken at its return, which this one has not reached
            launch = APIS[r.api].layout in LAUNCH_LAYOUTS if r.api < len(APIS) else False
            records.append((
                r.ts, ts - r.ts, r.cgroup_id, 0, signed64(r.size), signed64(r.stream), signed64(r.function),
                signed64(r.pointer), signed64(r.handle), r.py_digest, call.pid, call.tid, r.api,
                r.memcpy_kind, r.grid_x, r.grid_y, r.grid_z, r.block_x, r.block_y, r.block_z, r.shared_mem,
                RECORDS.constants["CUDA_FLAG_POINTER_UNREAD"] | (_NO_STACK if launch else 0),  # not written yet
                r.driver_api, 0, r.native_digest))
        digests = stacks.digests()

        def stack_of(rec: tuple) -> int | None:
            k = cuda_stack_key(rec)
            if k is None:
                return None
            return digests.get(k) if isinstance(k, int) else stacks.open_stack(k, take=final)

        rows = self._rows((rec, stack_of(rec)) for rec in records)
        # the calls in flight at an earlier drain (a dump) are replaced: open rows are those of the last
        self.drop_open_rows()
        for row in rows:
            ctx.writer.execute(_OPEN_INSERT, row[:_RET] + (None,) + row[_RET + 1:])
        if lost:
            ctx.writer.add("loss", (ctx.session_id, ts, OPEN_LOST, lost))
        return len(rows)

    def in_flight(self) -> tuple[CallInFlight, ...]:
        """The CUDA calls in flight now, oldest first, left in the map for their return (a thread's
        launch record between launches and a call of a thread gone are none)."""
        if self.context.probes is None:
            return ()
        return tuple(CallInFlight("cuda_call", APIS[r.api].name, call.pid, call.tid, r.ts)
                     for call in in_flight(self.context.probes.bpf, "cuda_inflight", delete=False)
                     if call.pid is not None and (r := call.record).ts != 0 and r.api < len(APIS))

    def drop_open_rows(self) -> None:
        ctx = self.context
        ctx.writer.execute("DELETE FROM cuda_call WHERE session_id = ? AND open = 1", (ctx.session_id,))

    def _cuda_rows(self, joined: bytes) -> list[tuple]:
        """cuda_call rows from framed cuda_event records (ring header, then the record)."""
        stacks = self.context.stacks
        return self._rows(stacks.join("cuda", _CUDA_SIGNED.iter_unpack(joined), cuda_stack_key))

    def _rows(self, joined: Iterable[tuple[tuple, int | None]]) -> list[tuple]:
        """cuda_call rows from unpacked cuda_event records, each with its Python stack id."""
        ctx = self.context
        sid = ctx.session_id
        ident = ctx.identity
        threads = ident.threads
        stacks = ctx.stacks
        natives = stacks.native_cache()
        dims: dict[tuple[int, int, int], str] = {}  # a launch's few distinct grid/block shapes
        rows: list[tuple] = []
        append = rows.append
        for rec, py_stack in joined:
            (ts, dur, cg, ret, size, stream, function, pointer, handle, _digest, pid, tid, api, kind,
             gx, gy, gz, bx, by, bz, shmem, flags, driver_api, _reserved, native_stack) = rec
            has_size, has_stream, launch, has_pointer, has_handle, has_kind = _API_FLAGS[api]
            th = threads.get(tid) or ident.thread(tid, pid, None, ts)
            if flags & _NO_STACK:  # a fast launch: kept without stacks by design, no miss
                native = None
            else:
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
                driver_api if driver_api != _NO_API else None,
            ))
        return rows



# -- where kernel launches are probed ------------------------------------------------------------------


@dataclass
class RuntimeRoute:
    """Where one runtime library's launches are probed (LaunchRoute)."""

    path: str
    apis: list[Api] = field(default_factory=list)  # its launch APIs attached
    state: str = "both"  # 'both' -> 'detaching' -> 'driver', or 'kept'
    base: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> its counts when it began to count


class LaunchRoute:
    """Where kernel launches are probed, decided per runtime library. Every runtime launch calls a
    driver launch, and each probe pair costs the launching thread two traps (docs/benchmarks.md), so
    once ROUTE_EVIDENCE launches of the processes that map a runtime library were seen going through
    the driver's launch probes, that library's launch probes are detached: first their entries, then
    (at the next check, once the launches in flight have returned) their returns. From then on its
    launches are the driver's rows (their native stacks still show the runtime's frame), at half the
    cost. A runtime launch of such a process not seen at the driver keeps the library's probes for
    the session; STALL_RECORDER_KEEP_RUNTIME_LAUNCHES=1 keeps them always. A runtime library found
    later (another process, another environment) is probed and decided on its own evidence, whatever
    was decided for the others. Each decision is a capability row (layer 'cuda', probe 'launch
    probes', target: the library). The counts are per process (bpf/cuda.bpf.c cuda_launch_route)."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.libraries: dict[str, RuntimeRoute] = {}  # runtime libraries with launch APIs attached, by path
        self.users: dict[int, set[str]] = {}  # pid -> the runtime libraries it maps
        self.driver_launches = False  # a driver library's launch APIs are attached
        self.checked = 0

    def wants(self, path: str, api: Api) -> bool:
        lib = self.libraries.get(path)
        return not (api.library == "runtime" and is_launch(api) and lib is not None
                    and lib.state in ("detaching", "driver"))

    def attached(self, path: str, api: Api) -> None:
        if not is_launch(api):
            return
        if api.library == "runtime":
            self.libraries.setdefault(path, RuntimeRoute(path)).apis.append(api)
        elif not self.driver_launches:
            self.driver_launches = True
            counts = self.counts()
            for lib in self.libraries.values():  # count from here: earlier launches could not reach it
                lib.base = {pid: counts.get(pid, (0, 0)) for pid in lib.base}

    def mapped(self, pid: int, path: str) -> None:
        """Process `pid` maps runtime library `path`: its launches are that library's evidence, counted
        from now (and from the driver's attach)."""
        lib = self.libraries.get(path)
        if lib is None or pid in lib.base:
            return
        lib.base[pid] = self.counts().get(pid, (0, 0))
        self.users.setdefault(pid, set()).add(path)

    def counts(self) -> dict[int, tuple[int, int]]:
        """pid -> (runtime launches returned, of which through a driver launch probe)."""
        try:
            table = self.context.probes.bpf.get_table("cuda_launch_route")
            return {k.value: (v.launches, v.through) for k, v in table.items()}
        except Exception:  # the map is not there (no CUDA layer loaded)
            return {}

    def check(self) -> None:
        now = now_ns()
        pending = [lib for lib in self.libraries.values() if lib.state in ("both", "detaching")]
        if not pending or now - self.checked < ROUTE_CHECK_NS:
            return
        self.checked = now
        probes = self.context.probes
        detaching = [lib for lib in pending if lib.state == "detaching"]
        if detaching:
            self._detached(detaching, now)
        if not self.driver_launches or probes.settings.keep_runtime_launches:
            return
        counts = self.counts()
        for lib in pending:
            if lib.state != "both" or not lib.base:
                continue
            total = sum(counts.get(pid, (0, 0))[0] - b[0] for pid, b in lib.base.items())
            through = sum(counts.get(pid, (0, 0))[1] - b[1] for pid, b in lib.base.items())
            if total < ROUTE_EVIDENCE:
                continue
            if through < total:
                lib.state = "kept"
                probes.cap("cuda", "launch probes", "attached",
                           f"runtime and driver: {total - through:,} of the first {total:,} runtime launches "
                           "were not seen going through the driver's launch probes", lib.path)
                continue
            sites = entry_sites(lib.path, {api.name for api in lib.apis})
            for api in lib.apis:
                try:
                    detach_entry(probes.bpf, lib.path, api.name, sites.get(api.name))
                except Exception:
                    pass
            lib.state = "detaching"
            probes.cap("cuda", "launch probes", "attached",
                       f"driver only: the first {total:,} runtime launches all went through the driver's launch "
                       "probes, so the runtime's launch probes were detached ("
                       + ("one trap a launch instead of two); launches are counted at the driver from then on"
                          if not self.context.settings.launch_rows else
                          "one probe pair a launch instead of two); launches are the driver's rows from then on"),
                       lib.path)

    def _detached(self, libraries: list[RuntimeRoute], now: int) -> None:
        """The second step of a switch: the returns go, and a launch of those libraries still in
        flight (a second after its entry probe went) is counted lost: it will not be seen return, and
        its record would make its thread's driver launches look nested in it."""
        probes = self.context.probes
        for lib in libraries:
            sites = entry_sites(lib.path, {api.name for api in lib.apis})
            for api in lib.apis:
                try:
                    detach_return(probes.bpf, lib.path, api.name, sites.get(api.name))
                except Exception:  # already gone with its library
                    pass
            lib.state = "driver"
        paths = {lib.path for lib in libraries}
        stale = 0
        for call in in_flight(probes.bpf, "cuda_inflight", delete=False):
            r = call.record
            if not (r.ts and r.api < FIRST_DRIVER_API and APIS[r.api].layout in LAUNCH_LAYOUTS):
                continue
            if call.pid is not None and self.users.get(call.pid) and not self.users[call.pid] & paths:
                continue  # a launch of another library, whose probes stay
            r.ts = 0
            try:
                probes.bpf["cuda_inflight"][ctypes.c_uint64(call.tid << 32 | call.api)] = r
            except Exception:  # the thread ended meanwhile
                continue
            stale += 1
        if stale:
            self.context.writer.add("loss", (self.context.session_id, now - now % 1_000_000_000, ROUTE_LOST, stale))
