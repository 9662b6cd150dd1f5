"""The OOM killer's messages."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from recorder.layers.kmsg.parsers.common import _D, _H, _SD, KernelEvent, _hex, _opt_int

# ---- OOM -----------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class OomInvoked(KernelEvent):
    """`python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0`."""

    kind: ClassVar[str] = "invoked"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    comm: str  # the allocating task, not the victim
    gfp_mask: int
    alloc_order: int  # log2 of the pages the failed allocation asked for
    oom_score_adj: int
    gfp_flags: str | None = None
    nodemask: str | None = None


@dataclass(slots=True, frozen=True)
class OomConstraint(KernelEvent):
    """`oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,
    oom_memcg=/job42,task_memcg=/job42,task=python,pid=19289,uid=0`."""

    kind: ClassVar[str] = "constraint"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    constraint_kind: str | None = None  # CONSTRAINT_NONE, CONSTRAINT_MEMCG, ...
    nodemask: str | None = None
    cpuset: str | None = None
    mems_allowed: str | None = None
    oom_memcg: str | None = None
    task_memcg: str | None = None
    comm: str | None = None  # `task=`
    pid: int | None = None
    uid: int | None = None
    global_oom: bool = False


@dataclass(slots=True, frozen=True)
class OomKilled(KernelEvent):
    """`Memory cgroup out of memory: Killed process 19289 (python) total-vm:2676kB, anon-rss:84kB,
    file-rss:1468kB, shmem-rss:4kB, UID:0 pgtables:40kB oom_score_adj:0`; `Out of memory:` for a
    system OOM; older kernels omit the fields after file-rss/shmem-rss."""

    kind: ClassVar[str] = "killed"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    pid: int
    comm: str
    total_vm_bytes: int
    anon_rss_bytes: int
    file_rss_bytes: int
    scope: str | None = None  # memcg or system; None when the line has no prefix (old kernels)
    shmem_rss_bytes: int | None = None
    uid: int | None = None
    pgtables_bytes: int | None = None
    oom_score_adj: int | None = None


@dataclass(slots=True, frozen=True)
class OomVictimSelected(KernelEvent):
    """Older kernels: `Out of memory: Kill process 19289 (python) score 923 or sacrifice child`."""

    kind: ClassVar[str] = "selected"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    pid: int
    comm: str
    score: int
    scope: str


@dataclass(slots=True, frozen=True)
class OomReaped(KernelEvent):
    """`oom_reaper: reaped process 19289 (python), now anon-rss:0kB, file-rss:0kB,
    shmem-rss:4kB`."""

    kind: ClassVar[str] = "reaped"
    table: ClassVar[str] = "oom_kill"
    subsystem: ClassVar[str] = "oom"
    pid: int
    comm: str
    anon_rss_bytes: int
    file_rss_bytes: int
    shmem_rss_bytes: int




_OOM_INVOKED = re.compile(
    rf"(.+) invoked oom-killer: gfp_mask=0x{_H}(?:\(([^)]*)\))?, (?:nodemask=(\S+), )?"
    rf"order={_SD}, (?:oom_adj={_SD}, )?oom_score_adj={_SD}"
)
_OOM_KILLED = re.compile(
    r"(?:(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): )?"
    rf"Killed process {_D} \((.*)\) total-vm:{_D}kB, anon-rss:{_D}kB, file-rss:{_D}kB"
    rf"(?:, shmem-rss:{_D}kB)?(?:,? UID:{_D})?(?:,? pgtables:{_D}kB)?(?:,? oom_score_adj:{_SD})?"
)
_OOM_SELECTED = re.compile(
    rf"(Memory cgroup out of memory|Out of memory): Kill process {_D} \((.*)\) score {_D} "
    r"or sacrifice child"
)
_OOM_REAPED = re.compile(
    rf"oom_reaper: reaped process {_D} \((.*)\), now anon-rss:{_D}kB, file-rss:{_D}kB, "
    rf"shmem-rss:{_D}kB"
)
_OOM_CONSTRAINT_KEYS = {"constraint", "nodemask", "cpuset", "mems_allowed", "oom_memcg",
                        "task_memcg", "task", "pid", "uid"}
_NODE_LIST = re.compile(r"[0-9-]+")


def _scope(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    return "memcg" if prefix.startswith("Memory cgroup") else "system"


def _parse_oom_constraint(body: str) -> OomConstraint | None:
    values: dict[str, str] = {}
    global_oom = False
    last: str | None = None
    for token in body.split(","):
        key, eq, value = token.partition("=")
        if eq and key in _OOM_CONSTRAINT_KEYS:
            values[key] = value
            last = key
        elif token == "global_oom":
            global_oom = True
        elif last in ("mems_allowed", "cpuset", "nodemask") and _NODE_LIST.fullmatch(token):
            # A node list like 0,2-3 is printed with commas of its own.
            values[last] += "," + token
        else:
            return None
    pid, uid = values.get("pid"), values.get("uid")
    if (pid is not None and not (pid.isdigit() and len(pid) <= 20)) or (
        uid is not None and not (uid.isdigit() and len(uid) <= 20)
    ):
        return None
    return OomConstraint(
        constraint_kind=values.get("constraint"), nodemask=values.get("nodemask"),
        cpuset=values.get("cpuset"), mems_allowed=values.get("mems_allowed"),
        oom_memcg=values.get("oom_memcg"), task_memcg=values.get("task_memcg"),
        comm=values.get("task"), pid=_opt_int(pid), uid=_opt_int(uid), global_oom=global_oom,
    )


def _kib(value: str | None) -> int | None:
    return None if value is None else int(value) * 1024


def _parse_oom(text: str) -> KernelEvent | None:
    if text.startswith("oom-kill:"):
        return _parse_oom_constraint(text[9:])
    if m := _OOM_KILLED.fullmatch(text):
        return OomKilled(
            scope=_scope(m[1]), pid=int(m[2]), comm=m[3], total_vm_bytes=int(m[4]) * 1024,
            anon_rss_bytes=int(m[5]) * 1024, file_rss_bytes=int(m[6]) * 1024,
            shmem_rss_bytes=_kib(m[7]), uid=_opt_int(m[8]), pgtables_bytes=_kib(m[9]),
            oom_score_adj=_opt_int(m[10]),
        )
    if m := _OOM_INVOKED.fullmatch(text):
        return OomInvoked(comm=m[1], gfp_mask=_hex(m[2]), gfp_flags=m[3], nodemask=m[4],
                          alloc_order=int(m[5]), oom_score_adj=int(m[7]))
    if m := _OOM_REAPED.fullmatch(text):
        return OomReaped(pid=int(m[1]), comm=m[2], anon_rss_bytes=int(m[3]) * 1024,
                         file_rss_bytes=int(m[4]) * 1024, shmem_rss_bytes=int(m[5]) * 1024)
    if m := _OOM_SELECTED.fullmatch(text):
        return OomVictimSelected(scope=_scope(m[1]) or "system", pid=int(m[2]), comm=m[3],
                                 score=int(m[4]))
    return None
