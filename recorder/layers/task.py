"""The task layer: forks, execs, exits, renames and dlopen calls of the targets (bpf/task.bpf.c).

It writes no table of its own: each event changes what the session knows (a new process to scan for
libraries, a new process image, a thread that ended). The session hands it the reactions
(`context.processes`, recorder/core/layer.py ProcessHooks); this layer decides their order within a
batch: forks and execs before the batch's other rows (`flush_phase` PROCESSES), so a new process
image's events get its identity; exits one flush late (`retire()`), after every other layer, so rows
held back for their stack record still find the process's caches.
"""

from __future__ import annotations

import os
import signal

from recorder.core.capability import failure
from recorder.core.clock import now_ns
from recorder.core.events import Layout, Loss, Records
from recorder.core.identity import read_tgid
from recorder.core.layer import BaseLayer, BpfSource, Context, Phase, ProcessHooks, Sink
from recorder.core.loader import tracepoint_field_offset

SOURCES = (BpfSource("task", "task.bpf.c",
                     ("sched:sched_process_fork", "sched:sched_process_exec", "sched:sched_process_exit"),
                     # a forked Python inherits its parent's stack-walking recipe in the kernel;
                     # renames follow a thread's name after it is first seen
                     optional=("task:task_newtask", "task:task_rename")),)
# a process that opens a CUDA/NCCL library is held at its dlopen's return until the library's
# probes are attached (bpf/task.bpf.c task_openat)
OPENAT = "syscalls:sys_enter_openat"
ALIVE_EVERY_NS = 200_000_000  # the reader says it reads at most this often (the program trusts 3 s)
TASK = Layout(
    "task_event",
    (
        ("ts", "u64"),
        ("kind", "u32"),  # TASK_FORK / TASK_EXEC / TASK_EXIT / TASK_DLOPEN / TASK_RENAME
        ("pid", "u32"),  # tgid of the task doing it
        ("tid", "u32"),
        ("child_tid", "u32"),  # fork: the new task
        ("comm", "char16"),  # the task's name; for TASK_RENAME its new name
    ),
    "process lifecycle of traced tasks, their renames, and library loads that need a rescan",
)
RECORDS = Records((TASK,), {
    "TASK_FORK": 1,
    "TASK_EXEC": 2,
    "TASK_EXIT": 3,
    "TASK_DLOPEN": 4,
    "TASK_RENAME": 5,  # tid is the renamed task, which may be another thread of the process
}, (("PROBE_TASK", Loss("task ring buffer", "task", "process and thread events", "ring buffer full")),))
_C = RECORDS.constants


class TaskLayer(BaseLayer):
    name = "task"
    sources = SOURCES
    records = RECORDS
    losses = RECORDS.losses()
    flush_phase = Phase.PROCESSES

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        assert context.processes is not None, "the session's reactions to processes come first"
        self.hooks: ProcessHooks = context.processes
        self.raw: list[bytes] = []
        self._deferred_exits: list[tuple] = []  # exit records retired at the next flush
        self._batch_exits: list[tuple] = []
        self.held: set[int] = set()  # processes stopped at a dlopen return, until resumed
        self._alive_said = 0  # when the task events' reader last said it reads (task_reader_alive)

    def bpf_text(self) -> str:
        offset = tracepoint_field_offset(OPENAT, "filename")
        if offset is None:
            return ""
        return ("#if DLOPEN_HOLD\n"
                "int task_openat(void *ctx) {\n"
                "    u64 id = bpf_get_current_pid_tgid();\n"
                "    if (!is_target(id >> 32)) return 0;\n"
                "    const char *filename = 0;\n"
                f"    bpf_probe_read_kernel(&filename, sizeof(filename), (char *)ctx + {offset});\n"
                "    return task_open(id, filename);\n"
                "}\n"
                "#endif\n")

    def _reader_alive(self, ts: int) -> None:
        """Tell the dlopen program the events are read (ts) or no longer (0): it holds a process
        only while they are (bpf/task.bpf.c, task_reader_alive)."""
        if self.context.probes is None:  # a session that failed before its probes were made
            return
        try:
            table = self.context.probes.bpf["task_reader_alive"]
            table[table.Key(0)] = table.Leaf(ts)
        except (KeyError, OSError):  # the map refused: holds stop within seconds, nothing is stopped for good
            return
        self._alive_said = ts

    def attach(self) -> None:
        probes = self.context.probes
        self._reader_alive(now_ns())
        probes.attach_dlopen()
        if not probes.settings.dlopen_hold:
            probes.cap("task", "dlopen hold", "absent", "STALL_RECORDER_DLOPEN_HOLD is off: the first calls after "
                       "a CUDA/NCCL library's dlopen may be missed")
            return
        if tracepoint_field_offset(OPENAT, "filename") is None:
            probes.cap("task", "dlopen hold", "absent", f"no {OPENAT} tracepoint with a filename field")
            return
        try:
            probes.bpf.attach_tracepoint(tp=OPENAT, fn_name="task_openat")
            probes.cap("task", "dlopen hold", "attached", f"{OPENAT}: held at the dlopen return until attached")
        except Exception as e:  # BCC raises bare Exception
            probes.cap("task", "dlopen hold", "failed", failure(e))

    def sinks(self) -> dict[str, Sink]:
        return {"task_events": self.raw.append}

    def wants_flush(self) -> bool:
        """Records waiting: an exec or dlopen may have mapped a library to attach before its calls."""
        return bool(self.raw)

    def flush(self) -> None:
        """Forks, execs and dlopens of this batch now; its exits are kept for the next `retire()`."""
        now = now_ns()
        if self._alive_said and now - self._alive_said >= ALIVE_EVERY_NS:
            self._reader_alive(now)
        self.context.events["task"] += len(self.raw)
        tasks = list(TASK.iter_unpack(b"".join(self.raw))) if self.raw else []
        self.raw.clear()
        # an exec renames the task to the new program just before its exec record: that name
        # comes with the exec, and is no rename of the old program's thread
        execs = {(rec[3], i) for i, rec in enumerate(tasks) if rec[1] == _C["TASK_EXEC"]}
        for i, rec in enumerate(tasks):
            if rec[1] == _C["TASK_RENAME"] and any((rec[3], j) in execs for j in range(i + 1, min(i + 3, len(tasks)))):
                continue
            if rec[1] != _C["TASK_EXIT"]:
                self._event(*rec)
        self._batch_exits = [rec for rec in tasks if rec[1] == _C["TASK_EXIT"]]

    def retire(self) -> None:
        """Apply the previous batch's exits (after every other layer's rows of this batch)."""
        for rec in self._deferred_exits:
            self._event(*rec)
        self._deferred_exits = self._batch_exits

    def _resume(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # it ended meanwhile
            pass
        self.held.discard(pid)

    def stop(self) -> None:
        """The stop began: no dlopen is held from now on (the events are read once more, and the
        probes may stay attached for seconds while they are detached, with nobody reading)."""
        self._reader_alive(0)

    def finish(self, ts: int) -> None:
        """The last exits, once nothing is held back; no process is left stopped."""
        for pid in list(self.held):
            self._resume(pid)
        for rec in self._deferred_exits:
            self._event(*rec)
        self._deferred_exits = []

    def _event(self, ts: int, kind: int, pid: int, tid: int, child: int, comm: bytes) -> None:
        ident = self.context.identity
        if kind == _C["TASK_FORK"]:
            child_pid = read_tgid(child) or pid
            if child_pid != pid and not self.hooks.known(child_pid):
                self.hooks.scan(child_pid, "fork", ts)
            ident.thread_forked(child, child_pid, ts, comm)  # a new task starts with its parent's name
        elif kind == _C["TASK_EXEC"]:
            ident.process_exec(pid, ts)
            ident.thread(tid, pid, comm, ts)
            self.hooks.scan(pid, "exec", ts)
        elif kind == _C["TASK_EXIT"]:
            ident.thread_exited(tid, pid, ts)
            if tid == pid:
                self.hooks.exited(pid, ts)
        elif kind == _C["TASK_DLOPEN"]:
            if not child:
                self.hooks.dlopen(pid)
                return
            # held (bpf/task.bpf.c): stopped at the return of a dlopen that opened a library the
            # recorder attaches to; it goes on once that library's probes are attached
            self.held.add(pid)
            try:
                self.hooks.dlopen(pid)
            finally:
                self._resume(pid)
        elif kind == _C["TASK_RENAME"]:
            ident.thread_renamed(tid, pid, comm, ts)
