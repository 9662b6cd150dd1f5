"""Calls still in flight: the entries of a per-call BPF map whose return has not been seen.

CUDA and NCCL calls are written when they return (bpf/cuda.bpf.c, bpf/nccl.bpf.c): the entry
program keeps the call's arguments in an in-flight map keyed by (thread id << 32 | API index) and
the return program turns them into one event. A call that never returns (a hung collective) stays
in the map. `in_flight()` reads those entries, for the session's stop and for a dump of a recording
in progress; the layers turn them into rows with open = 1 (store/migrations/0013_open_calls_user_code.sql),
and answer what is in flight now as `CallInFlight` records (their `Layer.in_flight()`), for the
flight recorder's hung-call trigger and the live workload metrics, which read no layer's map.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OpenCall:
    """One in-flight map entry: the calling thread, its process (None when the thread is gone),
    the API index and the map's record (a ctypes struct with the C field names)."""

    tid: int
    pid: int | None
    api: int
    record: Any


@dataclass(frozen=True)
class CallInFlight:
    """A call entered and not yet returned, as a layer answers it (`Layer.in_flight()`): plain
    values, no map record."""

    table: str  # the table its row goes to at its return ('cuda_call', 'nccl_call')
    api: str  # the API's name ('cudaStreamSynchronize', 'ncclAllReduce')
    pid: int  # its process (a call of a thread gone is none)
    tid: int
    ts: int  # its entry, ns CLOCK_MONOTONIC


def in_flight(bpf: Any, map_name: str, delete: bool) -> list[OpenCall]:
    """Every entry of the in-flight map `map_name`, oldest entry first; with `delete` they are
    removed (at stop: nothing returns any more), else left for their return (a dump while
    recording). A map missing from the object (its layer left out) has none."""
    try:
        table = bpf.get_table(map_name)
    except KeyError:
        return []
    calls = []
    for key, value in list(table.items()):
        k = key.value
        record = type(value).from_buffer_copy(value)  # a copy: the entry may go at its return
        tid = k >> 32
        calls.append(OpenCall(tid, live_tgid(tid), k & 0xFFFFFFFF, record))
        if delete:
            try:
                del table[ctypes.c_uint64(k)]
            except KeyError:  # returned meanwhile
                pass
    calls.sort(key=lambda c: c.record.ts)
    return calls


def live_tgid(tid: int) -> int | None:
    """The process of a thread that is still alive; None when it has ended (a zombie's thread has
    exited too: it is inside no call)."""
    try:
        with open(f"/proc/{tid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
        return None
    try:
        return int(fields["Tgid"])
    except (KeyError, ValueError):
        return None
