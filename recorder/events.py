"""The one definition of every record the BPF programs send to user space.

Each layout is declared here once. `c_definitions()` renders the C structs that are prepended to the
BPF sources at load time, and `Layout.unpack` reads the same bytes in Python, so the two cannot
drift; tests/test_events.py compiles the rendered C with gcc and compares sizes and offsets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# C type -> (struct format char, size). Fields are ordered largest first in each layout so that
# the C compiler adds no padding and the Python format can be packed ("=").
_CTYPES: dict[str, tuple[str, int]] = {
    "u64": ("Q", 8),
    "s64": ("q", 8),
    "u32": ("I", 4),
    "s32": ("i", 4),
    "u16": ("H", 2),
    "char16": ("16s", 16),
}


@dataclass(frozen=True)
class Layout:
    """A fixed-size record: a C struct and its Python struct format from the same field list."""

    name: str
    fields: tuple[tuple[str, str], ...]
    doc: str
    _struct: struct.Struct = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = sum(_CTYPES[ctype][1] for _, ctype in self.fields)
        if size % 8:
            raise ValueError(f"{self.name}: {size} bytes; pad to a multiple of 8 so C adds none")
        fmt = "=" + "".join(_CTYPES[ctype][0] for _, ctype in self.fields)
        object.__setattr__(self, "_struct", struct.Struct(fmt))

    @property
    def size(self) -> int:
        return self._struct.size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)

    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for name, ctype in self.fields:
            out[name] = at
            at += _CTYPES[ctype][1]
        return out

    def unpack(self, data: bytes) -> tuple:
        return self._struct.unpack_from(data)

    def iter_unpack(self, joined: bytes):
        return self._struct.iter_unpack(joined)

    def c_struct(self) -> str:
        lines = [f"/* {self.doc} */", f"struct {self.name} {{"]
        for name, ctype in self.fields:
            if ctype == "char16":
                lines.append(f"    char {name}[16];")
            else:
                lines.append(f"    {ctype} {name};")
        lines.append("};")
        return "\n".join(lines)


OFFCPU = Layout(
    "offcpu_event",
    (
        ("ts", "u64"),  # switch-out, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # until switch-in, ns
        ("cgroup_id", "u64"),
        ("state", "s64"),  # sched_switch prev_state as the tracepoint reports it
        ("wakeup_ts", "u64"),  # when it was woken (became runnable again), 0 if never asleep
        ("contender_run", "u64"),  # ns the contender ran on in_cpu while this thread was runnable
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

CUDA = Layout(
    "cuda_event",
    (
        ("ts", "u64"),  # entry, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # entry -> return, ns
        ("cgroup_id", "u64"),
        ("ret", "s64"),  # return value (cudaError_t / CUresult)
        ("size", "u64"),  # bytes for alloc/memcpy, 0 when not meaningful
        ("stream", "u64"),
        ("function", "u64"),  # kernel function pointer / CUfunction
        ("pointer", "u64"),  # device/host pointer allocated or freed
        ("handle", "u64"),  # event handle for event synchronisation
        ("pid", "u32"),
        ("tid", "u32"),
        ("api", "u32"),  # index into recorder.cuda.APIS
        ("memcpy_kind", "s32"),
        ("grid_x", "u32"),
        ("grid_y", "u32"),
        ("grid_z", "u32"),
        ("block_x", "u32"),
        ("block_y", "u32"),
        ("block_z", "u32"),
        ("shared_mem", "u32"),
        ("flags", "u32"),  # CUDA_FLAG_*
    ),
    "one CUDA runtime or driver call, sent at return",
)

TASK = Layout(
    "task_event",
    (
        ("ts", "u64"),
        ("kind", "u32"),  # TASK_FORK / TASK_EXEC / TASK_EXIT / TASK_DLOPEN
        ("pid", "u32"),  # tgid of the task doing it
        ("tid", "u32"),
        ("child_tid", "u32"),  # fork: the new task
        ("comm", "char16"),
    ),
    "process lifecycle of traced tasks, and library loads that need a rescan",
)

LAYOUTS = (OFFCPU, CUDA, TASK)

# Constants shared by C and Python.
CONSTANTS: dict[str, int] = {
    "TASK_FORK": 1,
    "TASK_EXEC": 2,
    "TASK_EXIT": 3,
    "TASK_DLOPEN": 4,
    "OFFCPU_FLAG_OPEN": 1,
    # the allocated pointer could not be read at return
    "CUDA_FLAG_POINTER_UNREAD": 1,  # still off-CPU when the session stopped: dur runs to the stop
    "MODE_PIDS": 0,
    "MODE_CGROUP": 1,
    "MODE_ALL": 2,
    # probe ids for the drop counters (index into the `drops` per-cpu array)
    "PROBE_SCHED": 0,
    "PROBE_CUDA": 1,
    "PROBE_TASK": 2,
    "PROBE_CUDA_MAP": 3,
    "PROBE_SCHED_MAP": 4,
    "PROBE_COUNT": 5,
}

PROBE_NAMES = {
    CONSTANTS["PROBE_SCHED"]: "sched:offcpu ring buffer",
    CONSTANTS["PROBE_CUDA"]: "cuda ring buffer",
    CONSTANTS["PROBE_TASK"]: "task ring buffer",
    CONSTANTS["PROBE_CUDA_MAP"]: "cuda in-flight map full",
    CONSTANTS["PROBE_SCHED_MAP"]: "sched off-CPU map full",
}


def c_definitions() -> str:
    """C text with every layout and constant, prepended to each BPF program."""
    parts = [f"#define {name} {value}" for name, value in CONSTANTS.items()]
    parts += [layout.c_struct() for layout in LAYOUTS]
    return "\n".join(parts) + "\n"


def comm(raw: bytes) -> str:
    """A task name from a 16-byte, NUL-padded kernel buffer."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
