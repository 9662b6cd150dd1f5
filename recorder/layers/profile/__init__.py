"""The on-CPU profile: where the traced threads' CPU time went. A software CPU-clock perf event on
every CPU runs profile.bpf.c at `profile_hz` samples a second (--profile-hz,
STALL_RECORDER_PROFILE_HZ; 0 turns it off); a sample of a target thread is one `cpu_sample` row with
its native user stack (symbolised by the stack recorder, stored once per distinct stack) and its
Python stack (the walker's perf event copy, joined like every other event's). Each row stands for
1 s / profile_hz of the thread's CPU time: a step's excess that no wait explains is attributed to a
library and function and a Python line from these rows (the `step_cpu_profile` view)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from recorder.core.events import Layout, Loss, Records
from recorder.core.layer import BaseLayer, BpfSource, Context, Observation, Phase, Sink

if TYPE_CHECKING:
    from recorder.core.loader import Probes
    from recorder.core.stacks import StackRecorder

SOURCES = (BpfSource("profile", str(Path(__file__).with_name("profile.bpf.c"))),)
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
RECORDS = Records((SAMPLE,), {
    "PROFILE_FLAG_KERNEL": 1,  # the sample interrupted kernel code (a syscall, a page fault) of the thread
    "PROFILE_STACK_ENTRIES": 4096,  # distinct user stacks held between two flushes
}, (("PROBE_PROFILE", Loss("profile ring buffer", "profile", "on-CPU samples", "ring buffer full")),))
COLUMNS = ("session_id", "ts", "thread_id", "cpu", "dur", "in_kernel", "native_stack_id", "python_stack_id")
PROGRAM = "profile_sample"
_KERNEL = RECORDS.constants["PROFILE_FLAG_KERNEL"]
# the kernel walk's errors: -EFAULT, -EEXIST (its slot holds another stack), -ENOMEM
_ERRORS = {-14: "user stack not readable", -17: "stack map slot taken", -12: "stack map full"}


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


class ProfileLayer(BaseLayer):
    name = "profile"
    sources: tuple[BpfSource, ...] = SOURCES
    records = RECORDS
    tables = ("cpu_sample",)
    losses = RECORDS.losses()
    observes = (Observation("profile", "on-CPU samples (where the CPU time went)"),)
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.hz = context.settings.profile_hz
        if not self.hz:  # turned off: its programs and the walker's perf event copy are not compiled
            self.sources = ()
        # a fixed period of CPU-clock time rather than a rate the kernel steers: every sample stands
        # for exactly this much of the thread's CPU time
        self.period = 1_000_000_000 // max(self.hz, 1)
        self.raw: list[bytes] = []
        self.on = False
        self.missing: Counter[str] = Counter()  # samples stored without their native stack, by reason

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
        probes = self.probes
        what = "cpu-clock samples"
        if not self.hz:
            probes.cap("profile", what, "absent", "turned off (--profile-hz 0)")
            return
        if "profile" not in probes.layers:
            return
        try:
            probes.pystack.install_perf_events()
        except Exception as e:  # the samples keep their native stacks; their Python ones say "not installed"
            probes.cap("python", "cpython frames walker (perf events)", "failed", f"{type(e).__name__}: {e}")
        try:
            from bcc import PerfSWConfig, PerfType

            probes.bpf.attach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK,
                                         fn_name=PROGRAM, sample_period=self.period)
        except Exception as e:  # no perf events here (a container without CAP_PERFMON, perf_event_paranoid)
            probes.cap("profile", what, "failed", f"{type(e).__name__}: {e}")
            return
        self.on = True
        probes.cap("profile", what, "attached", f"every {self.period / 1e6:.1f} ms of CPU time ({self.hz} a second)"
                   " on each CPU, the targets' threads only")

    def sinks(self) -> dict[str, Sink]:
        return {"profile_events": self.raw.append}

    def _native(self, pid: int, stack: int, cache: dict[tuple[int, int], int | None]) -> int | None:
        """The stored native stack of a sample's stack id, read from the map (once per flush)."""
        if stack < 0:
            self.missing[_ERRORS.get(stack, f"kernel walk error {stack}")] += 1
            return None
        key = (pid, stack)
        if key not in cache:
            try:
                addresses = list(self.probes.bpf["profile_stacks"].walk(stack))
            except KeyError:  # deleted by the last flush as this sample took its id (rare)
                addresses = []
            cache[key] = self.stacks.native_stack(pid, addresses, symbolised) if addresses else None
        if cache[key] is None:
            self.missing["stack gone from the map"] += 1
        return cache[key]

    def flush(self) -> None:
        ctx = self.context
        raw = self.raw  # the list the ring's sink appends to (sinks())
        ctx.count("profile", len(raw))
        if not (raw or self.stacks.held("profile")):
            return
        cache: dict[tuple[int, int], int | None] = {}
        samples = []
        for data in raw:
            ts, pid, tid, cpu, stack, flags, _pad, comm = SAMPLE.unpack(data)
            samples.append((ts, pid, tid, cpu, self._native(pid, stack, cache), flags, comm))
        raw.clear()
        if cache:  # the next flush's samples of these stacks store them again: the map never fills
            table = self.probes.bpf["profile_stacks"]
            for _pid, stack in cache:
                try:
                    del table[table.Key(stack)]
                except KeyError:
                    pass
        sid, ident = ctx.session_id, ctx.identity
        dur = self.period
        rows = []
        for (ts, pid, tid, cpu, native, flags, comm), py_stack in self.stacks.join("profile", samples, sample_key):
            thread = ident.threads.get(tid) or ident.thread(tid, pid, comm, ts)
            rows.append((sid, ts, thread, cpu, dur, flags & _KERNEL, native, py_stack))
        ctx.writer.extend("cpu_sample", rows)

    def finish(self, ts: int) -> None:
        if self.missing:
            total = sum(self.missing.values())
            reasons = ", ".join(f"{reason}: {n:,}" for reason, n in self.missing.most_common())
            self.probes.cap("profile", "native stacks", "attached",
                                    f"{total:,} samples stored without one ({reasons})")
