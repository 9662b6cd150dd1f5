"""The on-CPU profile: where the traced threads' CPU time went. A software CPU-clock perf event on
every CPU runs profile.bpf.c at `profile_hz` samples a second (--profile-hz,
STALL_RECORDER_PROFILE_HZ; 0 turns it off); a sample of a target thread is one `cpu_sample` row with
its native user stack (symbolised by the stack recorder, stored once per distinct stack) and its
Python stack (the walker's perf event copy, joined like every other event's). Each row stands for
1 s / profile_hz of the thread's CPU time: a step's excess that no wait explains is attributed to a
library and function and a Python line from these rows (the `step_cpu_profile` view).

Its programs are no part of the session's compile: they are compiled once the session records, in
a BPF object of their own (recorder/core/secondary.py), and attached when it is ready, seconds after
the start; the capability row says from when the samples were taken. The walker's copy in that
object builds its records in a scratch of its own and sends them through a ring of its own: a sample
interrupts a traced call's walk on the same CPU without costing the call its stack, and a full ring
of the profile's loses samples' stacks only."""

from __future__ import annotations

import ctypes
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from recorder.core.capability import failure
from recorder.core.events import Layout, Loss, Records
from recorder.core.layer import BaseLayer, BpfSource, Context, Observation, Phase

if TYPE_CHECKING:
    from recorder.core.loader import Probes
    from recorder.core.secondary import Secondary
    from recorder.core.stacks import StackRecorder

SOURCE = Path(__file__).with_name("profile.bpf.c")
SAMPLE = Layout(
    "profile_event",
    (
        ("ts", "u64"),  # the sample, ns CLOCK_MONOTONIC
        ("pid", "u32"),
        ("tid", "u32"),
        ("cpu", "u32"),
        ("user_stack", "s32"),  # id in profile_stacks, negative: the kernel's walk stored none (-errno)
        ("flags", "u32"),  # PROFILE_FLAG_*
        ("pad", "u32"),
        ("comm", "char16"),
    ),
    "one on-CPU sample of a traced thread",
)
RING_PAGES = 64  # profile.bpf.c PROFILE_RING_PAGES
# the samples' Python stack records (a ring of the profile's own, read at every poll of the session)
PYSTACK_RING_PAGES = 512
RECORDS = Records((SAMPLE,), {
    "PROFILE_FLAG_KERNEL": 1,  # the sample interrupted kernel code (a syscall, a page fault) of the thread
    "PROFILE_STACK_ENTRIES": 4096,  # distinct user stacks held between two flushes
}, (("PROBE_PROFILE", Loss("profile ring buffer", "profile", "on-CPU samples", "ring buffer full")),
    ("PROBE_PROFILE_PYSTACK", Loss("profile python stack ring buffer", "profile", "on-CPU samples' Python stacks",
                                   "ring buffer full"))))
COLUMNS = ("session_id", "ts", "thread_id", "cpu", "dur", "in_kernel", "native_stack_id", "python_stack_id")
PROGRAM = "profile_sample"
WALKER = ("pystack_pe_find", "pystack_pe_walk", "pystack_pe_scan")  # PROG_FIND, PROG_WALK, PROG_SCAN
WHAT = "cpu-clock samples"
_KERNEL = RECORDS.constants["PROFILE_FLAG_KERNEL"]
# the kernel walk's errors: -EFAULT, -EEXIST (its slot holds another stack), -ENOMEM
_ERRORS = {-14: "user stack not readable", -17: "stack map slot taken", -12: "stack map full"}
NATIVE_IDS = 1 << 16  # distinct native stacks remembered (all of them forgotten past that)
_STACK_DEPTH = 127  # a BPF_STACK_TRACE value: the kernel's perf_event_max_stack default


# Objects whose frames keep no symbol: the interpreter and the C library, where a sample's time is put
# on its Python line (store/views/0014_profile.sql, native_frame_outside); their symbol tables (the
# interpreter's is the largest a Python job maps) are not read for a sample, which would hold the
# session's flush for a second or more at a job's first samples.
_UNSYMBOLISED = re.compile(r"(?:^|/)(python|libpython|libc\.so|libc-|libm\.so|libpthread|ld-linux)[^/]*$")


def symbolised(path: str) -> bool:
    return _UNSYMBOLISED.search(path) is None


def sample_key(rec: tuple) -> tuple[int, int, int]:
    """(ts, pid, tid) of a sample's Python stack record: every sample has one."""
    return rec[0], rec[1], rec[2]


def perf_events_check() -> tuple[bool, str]:
    """Whether a CPU-clock perf event of every process on a CPU can be opened here (what the
    profile's samples need: CAP_PERFMON or root, and a perf_event_paranoid that allows it)."""
    attr = (ctypes.c_uint64 * 16)()  # struct perf_event_attr, PERF_ATTR_SIZE_VER1 (72 bytes) and more
    attr[0] = 1 | 72 << 32  # type PERF_TYPE_SOFTWARE, size
    attr[1] = 0  # config PERF_COUNT_SW_CPU_CLOCK
    attr[5] = 1  # flags: disabled
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(298, ctypes.byref(attr), -1, 0, -1, 0)  # __NR_perf_event_open: every process, CPU 0
    if fd < 0:
        return False, f"perf_event_open refused: {os.strerror(ctypes.get_errno())}"
    os.close(fd)
    return True, "CPU-clock perf events can be opened"


class ProfileLayer(BaseLayer):
    name = "profile"
    # none in the session's compile: its programs are compiled after the start (start())
    sources: tuple[BpfSource, ...] = ()
    records = RECORDS
    tables = ("cpu_sample",)
    losses = RECORDS.losses()
    observes = (Observation("profile", "on-CPU samples (where the CPU time went)"),)
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.hz = context.settings.profile_hz
        # a fixed period of CPU-clock time rather than a rate the kernel steers: every sample stands
        # for exactly this much of the thread's CPU time
        self.period = 1_000_000_000 // max(self.hz, 1)
        self.raw: list[bytes] = []
        self.py_raw: list[bytes] = []  # the samples' Python stack records
        self.on = False
        self.compile: Secondary | None = None
        self.fds: dict[str, int] = {}
        self.perf_fds: list[int] = []
        self.missing: Counter[str] = Counter()  # samples stored without their native stack, by reason
        # (pid, addresses) -> stored native stack, across flushes: a job's samples repeat a few
        # hundred stacks, each symbolised once, not at every flush it appears in (the kernel's
        # stack ids are not kept: each flush deletes them, so the map never fills)
        self.natives: dict[tuple[int, tuple[int, ...]], int] = {}

    @property
    def probes(self) -> Probes:
        probes = self.context.probes
        assert probes is not None  # from attach() on (recorder/core/layer.py)
        return probes

    @property
    def stacks(self) -> StackRecorder:
        stacks = self.context.stacks
        assert stacks is not None  # from attach() on
        return stacks

    def prepare(self) -> None:
        self.context.writer.table("cpu_sample", COLUMNS)

    def attach(self) -> None:
        if not self.hz:
            self.probes.cap("profile", WHAT, "absent", "turned off (--profile-hz 0)")

    def start(self) -> None:
        """Compile the profile's programs in the background, now that the session records."""
        if not self.hz:
            return
        from bcc import BPF

        from recorder.core.secondary import Secondary, Wanted

        probes = self.probes
        text = probes.secondary_source(SOURCE.read_text(), PYSTACK_RING_PAGES,
                                       "#define PYSTACK_RING_FULL() count_drop(PROBE_PROFILE_PYSTACK)")
        wanted = Wanted(programs={PROGRAM: BPF.PERF_EVENT}, maps=("profile_events", "profile_stacks", "pystacks"),
                        arrays={"pystack_pe_progs": WALKER}, array_type=BPF.PERF_EVENT)
        self.compile = Secondary(probes.bpf, text, wanted)
        try:
            self.compile.start()
        except OSError as e:  # no fork (a process limit): the recording goes on without samples
            self.compile = None
            probes.cap("profile", WHAT, "failed", f"its programs could not be compiled: {failure(e)}")

    def _ready(self) -> None:
        """Attach the samples once their programs are compiled (checked at every flush)."""
        c = self.compile
        if c is None:
            return
        fds = c.poll()
        if fds is None:
            if c.error is not None:
                self.compile = None
                self.probes.cap("profile", WHAT, "failed", f"its programs did not compile: {c.error}")
            return
        self.fds, self.compile = fds, None
        probes = self.probes
        probes.adopt(list(fds.values()))  # closed with the session's maps, after its rings
        try:
            self._open_perf_events(fds[PROGRAM])
        except OSError as e:  # no perf events here (a container without CAP_PERFMON, perf_event_paranoid)
            probes.cap("profile", WHAT, "failed", failure(e))
            return
        probes.add_ring(fds["profile_events"], RING_PAGES * 4096, self.raw.append)
        probes.add_ring(fds["pystacks"], PYSTACK_RING_PAGES * 4096, self.py_raw.append)
        self.on = True
        probes.cap("profile", WHAT, "attached", f"every {self.period / 1e6:.1f} ms of CPU time ({self.hz} a second)"
                   f" on each CPU, the targets' threads only; {time.monotonic() - c.started:.1f} s after the"
                   f" recording began (its programs are compiled once it records, {c.cpu_s or 0:.1f} CPU-s):"
                   " no samples before")

    def _open_perf_events(self, prog_fd: int) -> None:
        from bcc import PerfSWConfig, PerfType, lib
        from bcc.utils import get_online_cpus

        for cpu in get_online_cpus():
            fd = lib.bpf_attach_perf_event(prog_fd, PerfType.SOFTWARE, PerfSWConfig.CPU_CLOCK,
                                           ctypes.c_ulonglong(self.period), ctypes.c_ulonglong(0), -1, cpu, -1)
            if fd < 0:
                self._close_perf_events()
                raise OSError(f"perf event on CPU {cpu} not opened (perf_event_open refused)")
            self.perf_fds.append(fd)

    def _close_perf_events(self) -> None:
        from bcc import lib

        for fd in self.perf_fds:
            lib.bpf_close_perf_event_fd(fd)
        self.perf_fds = []

    def _native(self, pid: int, stack: int, cache: dict[tuple[int, int], int | None]) -> int | None:
        """The stored native stack of a sample's stack id, read from the map (once per flush)."""
        if stack < 0:
            self.missing[_ERRORS.get(stack, f"kernel walk error {stack}")] += 1
            return None
        key = (pid, stack)
        if key not in cache:
            from bcc import lib

            value = (ctypes.c_uint64 * _STACK_DEPTH)()
            sid = ctypes.c_uint32(stack)
            found = lib.bpf_lookup_elem(self.fds["profile_stacks"], ctypes.byref(sid), ctypes.byref(value)) == 0
            # deleted by the last flush as this sample took its id (rare): no addresses
            addresses = _addresses(value) if found else ()
            known = (pid, addresses)
            if addresses and known not in self.natives:
                if len(self.natives) >= NATIVE_IDS:
                    self.natives.clear()
                self.natives[known] = self.stacks.native_stack(pid, addresses, symbolised)
            cache[key] = self.natives.get(known) if addresses else None
        if cache[key] is None:
            self.missing["stack gone from the map"] += 1
        return cache[key]

    def flush(self) -> None:
        self._ready()
        ctx = self.context
        raw = self.raw  # the list the ring's sink appends to (_ready())
        ctx.count("profile", len(raw))
        if self.py_raw:  # the samples' Python stacks, before the samples that take them
            self.stacks.add(self.py_raw)
            self.py_raw.clear()
        if not (raw or self.stacks.held("profile")):
            return
        cache: dict[tuple[int, int], int | None] = {}
        samples = []
        for data in raw:
            ts, pid, tid, cpu, stack, flags, _pad, comm = SAMPLE.unpack(data)
            samples.append((ts, pid, tid, cpu, self._native(pid, stack, cache), flags, comm))
        raw.clear()
        if cache:  # the next flush's samples of these stacks store them again: the map never fills
            from bcc import lib

            for _pid, stack in cache:
                lib.bpf_delete_elem(self.fds["profile_stacks"], ctypes.byref(ctypes.c_uint32(stack)))
        sid, ident = ctx.session_id, ctx.identity
        dur = self.period
        rows = []
        for (ts, pid, tid, cpu, native, flags, comm), py_stack in self.stacks.join("profile", samples, sample_key):
            thread = ident.threads.get(tid) or ident.thread(tid, pid, comm, ts)
            rows.append((sid, ts, thread, cpu, dur, flags & _KERNEL, native, py_stack))
        ctx.writer.extend("cpu_sample", rows)

    def scan(self, pid: int, found_by: str) -> None:
        if found_by in ("exec", "dlopen"):  # another image, or code mapped where other code was
            self._forget(pid)

    def process_exited(self, pid: int, ts: int) -> None:
        self._forget(pid)

    def _forget(self, pid: int) -> None:
        if any(k[0] == pid for k in self.natives):
            self.natives = {k: v for k, v in self.natives.items() if k[0] != pid}

    def stop(self) -> None:
        """No sample after this; a compile still running ends, and the row says the samples never began."""
        if self.on:
            self._close_perf_events()
            return
        c, self.compile = self.compile, None
        if c is None or c.error is not None:
            return
        fds = c.poll()  # compiled since the last flush: never attached
        if fds is None:
            c.cancel()
        else:
            self.probes.adopt(list(fds.values()))
        if c.error is None or c.error == "cancelled":
            self.probes.cap("profile", WHAT, "absent", f"the recording ended {time.monotonic() - c.started:.1f} s"
                            " after it began, before the profile's programs were ready (they are compiled once"
                            " it records): no samples")
        else:
            self.probes.cap("profile", WHAT, "failed", f"its programs did not compile: {c.error}")

    def finish(self, ts: int) -> None:
        if self.missing:
            total = sum(self.missing.values())
            reasons = ", ".join(f"{reason}: {n:,}" for reason, n in self.missing.most_common())
            self.probes.cap("profile", "native stacks", "attached",
                                    f"{total:,} samples stored without one ({reasons})")



def _addresses(values: ctypes.Array) -> tuple[int, ...]:
    """A stack map value's addresses: innermost first, up to the first empty slot."""
    out = []
    for v in values:
        if not v:
            break
        out.append(v)
    return tuple(out)
