"""The scheduler layer: off-CPU intervals of the target threads (bpf/sched.bpf.c) into
`offcpu_interval`, each with who woke the thread, who held its CPU, and the Python stack it
blocked in (unless STALL_RECORDER_OFFCPU_STACKS=0). Inside a syscall the stack is read at the
syscall's exit and only for a wait of STALL_RECORDER_OFFCPU_STACK_MIN_US or more: the interval's
row waits for that record (StackRecorder.join)."""

from __future__ import annotations

import ctypes

from recorder.core.events import Layout, Loss, Records
from recorder.core.layer import BaseLayer, BpfSource, Context, Observation, Phase, Sink
from recorder.core.settings import DEFAULT_OFFCPU_STACK_MIN_US

# where the kernel has them, a wake-up from a timer, interrupt or softirq is told from one by a task
WAKER_CONTEXT_TRACEPOINTS = ("irq:irq_handler_entry", "irq:softirq_entry", "timer:hrtimer_expire_entry",
                             "timer:hrtimer_expire_exit", "timer:timer_expire_entry", "timer:timer_expire_exit",
                             # hardirqs that are no device interrupt (x86): IPIs, irq_work
                             "irq_vectors:irq_work_entry",
                             "irq_vectors:call_function_entry", "irq_vectors:call_function_single_entry")
SOURCES = (BpfSource("sched", "sched.bpf.c", ("sched:sched_switch", "sched:sched_waking",
                                               "raw_syscalls:sys_enter", "raw_syscalls:sys_exit"),
                     WAKER_CONTEXT_TRACEPOINTS),)
OFFCPU = Layout(
    "offcpu_event",
    (
        ("ts", "u64"),  # switch-out, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # until switch-in, ns
        ("cgroup_id", "u64"),
        ("state", "s64"),  # sched_switch prev_state as the tracepoint reports it
        ("wakeup_ts", "u64"),  # when it was woken (became runnable again), 0 if never asleep
        ("contender_run", "u64"),  # ns the contender ran on in_cpu while this thread was runnable
        # key (ts) of its Python stack record: the switch-out, an earlier capture in the same
        # syscall, or the one promised at the syscall's exit (OFFCPU_FLAG_PROMISED); 0: none
        # (preempted, a short wait in a syscall, or captures turned off)
        ("stack_ts", "u64"),
        ("futex_addr", "u64"),  # futex word of the futex() it blocked in (args[0]), 0 outside one
        ("pid", "u32"),
        ("tid", "u32"),
        ("cpu", "u32"),  # cpu it left
        ("next_tid", "u32"),  # task that took the cpu at switch-out
        ("waker_tid", "u32"),  # task that woke it (0: none seen, e.g. preempted)
        ("waker_cpu", "u32"),
        ("syscall", "s32"),  # syscall in progress at switch-out, -1 none
        ("flags", "u32"),  # OFFCPU_FLAG_*
        ("in_cpu", "u32"),  # cpu it came back on
        ("contender_tid", "u32"),  # task that ran longest on in_cpu while this one was runnable
        ("comm", "char16"),
        ("next_comm", "char16"),
        ("waker_comm", "char16"),
        ("contender_comm", "char16"),
    ),
    "one off-CPU interval of a traced thread, sent at switch-in",
)
RECORDS = Records((OFFCPU,), {
    "OFFCPU_FLAG_OPEN": 1,  # still off-CPU when the session stopped: dur runs to the stop
    "OFFCPU_FLAG_PROMISED": 2,  # stack_ts is captured at the syscall's exit (bpf/sched.bpf.c)
    # the kernel reported no switch-in (bpf/sched.bpf.c): the end is the return from the syscall it
    # blocked in, or else its wake-up (0 when it was never woken: its end is not known)
    "OFFCPU_FLAG_END_SYSCALL": 4,
    "OFFCPU_FLAG_END_WAKEUP": 8,
}, (("PROBE_SCHED", Loss("sched:offcpu ring buffer", "sched", "off-CPU intervals", "ring buffer full")),
      ("PROBE_SCHED_MAP", Loss("sched off-CPU map full", "sched", "off-CPU intervals", "off-CPU map full"))))
# waker names bpf/sched.bpf.c gives a wake-up from interrupt context (with waker tid 0)
WAKER_CONTEXTS = {b"timer": "timer", b"interrupt": "interrupt", b"softirq": "softirq"}
OFFCPU_COLUMNS = (
    "session_id", "ts", "dur", "thread_id", "cpu", "state", "syscall", "next_thread_id",
    "waker_thread_id", "waker_cpu", "wakeup_ts", "in_cpu", "contender_thread_id", "contender_run_dur", "cgroup_id",
    "open", "python_stack_id", "waker_context", "futex_addr", "end_seen",
)
_OFF_STACK, _OFF_PID, _OFF_TID, _OFF_FLAGS = (OFFCPU.names.index(n) for n in ("stack_ts", "pid", "tid", "flags"))
_PROMISED = RECORDS.constants["OFFCPU_FLAG_PROMISED"]
_END_SYSCALL = RECORDS.constants["OFFCPU_FLAG_END_SYSCALL"]
_END_WAKEUP = RECORDS.constants["OFFCPU_FLAG_END_WAKEUP"]


def set_offcpu_stacks(probes, on: bool, min_us: int = DEFAULT_OFFCPU_STACK_MIN_US) -> None:
    """Capture (or not) the Python stack of a traced thread when it blocks: at the switch outside a
    syscall, at the syscall's exit when it blocked in one for `min_us` or longer."""
    if "sched" in probes.layers:
        settings = probes.bpf["sched_settings"]
        settings[ctypes.c_int(0)] = ctypes.c_uint32(int(on))
        settings[ctypes.c_int(1)] = ctypes.c_uint32(min_us)


def _end_seen(flags: int, wakeup_ts: int) -> str | None:
    """How the interval's end was seen when the kernel reported no switch-in (bpf/sched.bpf.c)."""
    if flags & _END_SYSCALL:
        return "syscall return"
    if flags & _END_WAKEUP:
        return "wake-up" if wakeup_ts else "not seen"
    return None


def offcpu_stack_key(rec: tuple) -> tuple[int, int, int] | None:
    """(stack_ts, pid, tid) of an offcpu_event's Python stack record; None when it has none (most preemptions)."""
    return (rec[_OFF_STACK], rec[_OFF_PID], rec[_OFF_TID]) if rec[_OFF_STACK] else None


def offcpu_stack_promised(rec: tuple) -> bool:
    """Whether the event's stack record comes at its syscall's exit, maybe long after the event."""
    return bool(rec[_OFF_FLAGS] & _PROMISED)


class SchedLayer(BaseLayer):
    name = "sched"
    sources = SOURCES
    tables = ("offcpu_interval",)
    records = RECORDS
    losses = RECORDS.losses()
    observes = (Observation("sched", "scheduler (off-CPU intervals)"),)
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.offcpu_stacks = context.settings.offcpu_stacks
        self.stack_min_us = context.settings.offcpu_stack_min_us
        self.raw: list[bytes] = []

    def prepare(self) -> None:
        self.context.writer.table("offcpu_interval", OFFCPU_COLUMNS)

    def attach(self) -> None:
        probes = self.context.probes
        set_offcpu_stacks(probes, self.offcpu_stacks, self.stack_min_us)
        if "sched" in probes.layers:
            # in the sched layer: the python layer is observed only where a process's frames are read
            on = self.offcpu_stacks
            probes.cap("sched", "python stacks at blocking switches", "attached" if on else "absent",
                       f"waits of {self.stack_min_us} us or more in a syscall (read at its exit), every wait"
                       " outside one, and the first wait of a thread not captured for 100 ms" if on
                       else "turned off (STALL_RECORDER_OFFCPU_STACKS=0)")

    def sinks(self) -> dict[str, Sink]:
        return {"offcpu_events": self.raw.append}

    def blocks(self) -> dict[str, int]:
        return {"offcpu_events": OFFCPU.size}

    def flush(self) -> None:
        ctx = self.context
        raw_off = self.raw
        stacks = ctx.stacks
        joined_off = b"".join(raw_off)  # blocks of framed records (Probes.open_rings)
        ctx.events["offcpu"] += len(joined_off) // OFFCPU.framed_size
        if not (raw_off or stacks.held("offcpu")):
            return
        sid, ident = ctx.session_id, ctx.identity
        rows = []
        threads = ident.threads
        for rec, py_stack in stacks.join("offcpu", OFFCPU.iter_framed(joined_off),
                                         offcpu_stack_key, shared=True, patient=offcpu_stack_promised):
            (ts, dur, cg, state, wakeup_ts, contender_run, stack_ts, futex_addr, pid, tid, cpu, next_tid, waker_tid,
             waker_cpu, syscall, flags, in_cpu, contender, comm, next_comm, waker_comm,
             contender_comm) = rec
            th = threads.get(tid) or ident.thread(tid, pid, comm, ts)
            nxt = ident.thread(next_tid, None, next_comm, ts, False) if next_tid else None
            wk = ident.thread(waker_tid, None, waker_comm, ts, False) if waker_tid else None
            context = None if waker_tid or not wakeup_ts else WAKER_CONTEXTS.get(waker_comm.split(b"\0", 1)[0])
            rival = ident.thread(contender, None, contender_comm, ts, False) if contender else None
            rows.append((sid, ts, dur, th, cpu, state, syscall if syscall >= 0 else None, nxt,
                         wk, waker_cpu if waker_tid or context else None, wakeup_ts or None, in_cpu,
                         rival, contender_run if contender else None, cg, flags & 1, py_stack, context,
                         futex_addr or None, _end_seen(flags, wakeup_ts)))
        raw_off.clear()
        ctx.writer.extend("offcpu_interval", rows)

    def finish(self, ts: int) -> None:
        """Intervals still open at stop (the thread is off CPU now) end at `ts`, marked open."""
        probes = self.context.probes
        if "sched" not in probes.layers:
            return
        ctx = self.context
        for k, rec in probes.bpf["offcpu_open"].items():
            if not rec.ts:  # closed: the thread is on a CPU
                continue
            tid = k.value
            th = ctx.identity.thread(tid, rec.pid, bytes(rec.comm), rec.ts)
            ctx.writer.add("offcpu_interval", (
                ctx.session_id, rec.ts, ts - rec.ts, th, rec.cpu, rec.state,
                rec.syscall if rec.syscall >= 0 else None, None, None, None, None, None, None,
                None, rec.cgroup_id, 1,
                ctx.stacks.take((rec.stack_ts, rec.pid, tid), shared=True) if rec.stack_ts else None, None,
                rec.futex_addr or None, None))
