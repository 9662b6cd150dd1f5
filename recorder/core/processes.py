"""The processes a target names, read from /proc and the cgroup v2 tree.

`-p` names processes, `--tree` a process and its descendants, `-c` a cgroup v2 subtree and `--all`
the host. The kernel side filters events by the target (bpf/common.h `is_target`), but what it
cannot do (find the CUDA/NCCL libraries a process maps, configure the CPython frame walker) needs
the processes themselves: they are listed here at the start and again once a second, so that a job
already running, or one that enters the cgroup later, is configured as `-p` configures its PID.
"""

from __future__ import annotations

import os
from pathlib import Path

from recorder.core.libraries import cuda_library_kind, mapped_files, workload_library_kind
from recorder.errors import TargetError

PF_KTHREAD = 0x00200000  # task flag of a kernel thread (include/linux/sched.h)


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat after the command name (field 3 onwards), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()


def is_kernel_thread(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and bool(int(fields[6]) & PF_KTHREAD)


def check_target_pid(pid: int) -> None:
    """Refuse, in one line, a PID that names no process or a kernel thread (nothing to attach to)."""
    fields = _stat_fields(pid)
    if fields is None:
        raise TargetError(f"no process with pid {pid}: it is gone or never ran; check it with 'ps -p {pid}'")
    if int(fields[6]) & PF_KTHREAD:
        raise TargetError(f"pid {pid} is a kernel thread: it runs no CUDA or Python code; pass the pid of a "
                          "user process")
    try:
        tgid = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("Tgid:")))
    except (OSError, StopIteration, ValueError):
        return
    if tgid != pid:
        raise TargetError(f"pid {pid} is a thread of process {tgid}: pass -p {tgid}")


def all_processes() -> set[int]:
    """Every process of the host (its kernel threads included: callers filter)."""
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def parents() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    out = {}
    for pid in all_processes():
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = int(fields[1])
    return out


def tree(root: int) -> list[int]:
    """`root` and every process descending from it now, root first."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(sorted(children.get(pid, ()), reverse=True))
    return out


def cgroup_members(path: str | Path) -> set[int]:
    """Processes in a cgroup v2 folder and every folder below it."""
    out: set[int] = set()
    for folder, _dirs, files in os.walk(path):
        if "cgroup.procs" not in files:
            continue
        try:
            text = Path(folder, "cgroup.procs").read_text()
        except OSError:  # removed meanwhile
            continue
        out.update(int(p) for p in text.split())
    return out


def worth_configuring(pid: int) -> list[str]:
    """What a process has that the recorder attaches to: its CUDA/NCCL libraries, the marker
    extension, a CPython interpreter; [] for none (or a process gone or unreadable)."""
    found: list[str] = []
    for path in mapped_files(pid):
        base = path.rsplit("/", 1)[-1]
        what = cuda_library_kind(path) or workload_library_kind(path)
        if what:
            what = {"runtime": "CUDA runtime", "driver": "CUDA driver", "nccl": "NCCL"}.get(what, what)
        elif base.startswith("libpython"):
            what = "CPython"
        if what and what not in found:
            found.append(what)
    if "CPython" not in found:
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            exe = ""
        if exe.startswith("python"):  # a static build maps no libpython
            found.append("CPython")
    return found
