"""The layer that records what the workload says about itself: its NCCL calls (communicator, rank,
collective) and the markers its script calls (recorder.step / lineage / checkpoint).

Libraries are found like the CUDA ones: `libnccl*` and the marker extension `recorder/_markers*.so`
in each target's /proc/PID/maps (at start, after exec and dlopen, and once a second); the session
calls `scan(pid, ...)` when it looks at a process. Its BPF (nccl.bpf.c, lineage.bpf.c and the NCCL
programs of recorder/layers/workload/nccl.py) is compiled after every other layer's.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

import bpf
from recorder.core.capability import failure
from recorder.core.clock import now_ns
from recorder.core.events import Loss
from recorder.core.inflight import CallInFlight, in_flight
from recorder.core.int64 import signed64
from recorder.core.layer import BaseLayer, Context, Observation, Phase, Sink
from recorder.core.libraries import exported_functions, mapped_files, resolve, workload_library_kind
from recorder.core.x86insn import attach_pair, entry_sites, site_detail
from recorder.layers.workload import nccl
from recorder.layers.workload.records import MARKER, NCCL, RECORDS

NCCL_CALL_COLUMNS = ("session_id", "ts", "dur", "thread_id", "api_id", "ret", "count", "datatype", "op",
                     "peer", "handle", "stream", "cgroup_id", "python_stack_id")
NCCL_COMM_COLUMNS = ("session_id", "process_id", "handle", "comm_hash", "rank", "nranks", "init_ts")
MARKER_SYMBOLS = {"stall_recorder_step": "marker_step", "stall_recorder_lineage": "marker_lineage",
                  "stall_recorder_checkpoint": "marker_checkpoint"}
# `loss.probe` of a call in flight at stop that could not be stored (its thread had ended)
OPEN_LOST = "nccl call in flight, thread gone"
_OPEN_LOST = Loss(OPEN_LOST, "nccl", "NCCL calls in flight at the stop", "their thread had ended")
_OPEN_INSERT = (f"INSERT INTO nccl_call ({','.join(NCCL_CALL_COLUMNS)}, open)"
                f" VALUES ({','.join('?' * len(NCCL_CALL_COLUMNS))}, 1)")
_KIND = {i: api.kind for i, api in enumerate(nccl.APIS)}
_STEP, _LINEAGE, _CHECKPOINT = (RECORDS.constants[k] for k in ("MARKER_STEP", "MARKER_LINEAGE", "MARKER_CHECKPOINT"))


library_kind = workload_library_kind  # 'nccl', 'markers' or None for a mapped file name


class WorkloadLayer(BaseLayer):
    name = "workload"
    tables = ("nccl_api", "nccl_call", "nccl_comm", "step_mark", "lineage_mark", "lineage_label", "checkpoint_mark",
              "library")
    records = RECORDS
    losses = (*RECORDS.losses(), _OPEN_LOST)
    observes = (Observation("nccl", "NCCL collectives"),)  # its "markers" rows are listed by no report
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.raw: dict[str, list[bytes]] = {"nccl": [], "marker": []}
        self.labels_seen: set[int] = set()
        self.attached: set[str] = set()

    def bpf_text(self) -> str:
        return "\n".join([bpf.source("nccl.bpf.c"), bpf.source("lineage.bpf.c"), nccl.bpf_programs()])

    def sinks(self) -> dict[str, Sink]:
        return {"nccl_events": self.raw["nccl"].append, "marker_events": self.raw["marker"].append}

    def attach(self) -> None:
        """The bodies the per-API NCCL programs tail-call (bpf/nccl.bpf.c nccl_dispatch)."""
        probes = self.context.probes
        try:
            bodies = probes.bpf.get_table("nccl_bodies")
            for slot, name in enumerate(nccl.body_programs()):
                bodies[ctypes.c_int(slot)] = ctypes.c_int(probes.bpf.load_func(name, probes.BPF.KPROBE).fd)
        except Exception as e:  # BCC raises bare Exception; no NCCL call can be recorded
            probes.cap("nccl", "call bodies", "failed", failure(e))

    def prepare(self) -> None:
        """Tables and the API list, once the store and writer exist."""
        s = self.context
        s.store.conn.executemany("INSERT OR IGNORE INTO nccl_api (id, name, kind) VALUES (?, ?, ?)",
                                 [(i, a.name, a.kind) for i, a in enumerate(nccl.APIS)])
        s.store.conn.commit()
        w = s.writer
        w.table("nccl_call", NCCL_CALL_COLUMNS)
        w.table("nccl_comm", NCCL_COMM_COLUMNS)
        w.table("step_mark", ("session_id", "ts", "thread_id", "step", "python_stack_id"))
        w.table("lineage_mark", ("session_id", "ts", "thread_id", "tag", "python_stack_id"))
        w.table("lineage_label", ("session_id", "tag", "label"))
        w.table("checkpoint_mark", ("session_id", "ts", "thread_id", "phase", "tag", "path", "python_stack_id"))

    # -- attaching --------------------------------------------------------------------------------
    def named_library(self, path: str) -> bool:
        """--cuda-lib naming NCCL or the marker extension."""
        kind = library_kind(path)
        if kind:
            self.attach_library(path, kind, "option")
        return kind is not None

    def scan(self, pid: int, found_by: str) -> None:
        for path in mapped_files(pid):
            kind = library_kind(path)
            if kind:
                self.attach_library(resolve(pid, path), kind, found_by)

    def attach_library(self, path: str, kind: str, found_by: str) -> None:
        real = os.path.realpath(path)
        if real in self.attached:
            return
        self.attached.add(real)
        self.context.libraries[real] = kind
        probes = self.context.probes
        names = exported_functions(real)
        if kind == "nccl":
            wanted: list[tuple[str, str | None, str]]
            wanted = [(f"nccl_entry_{i}", f"nccl_return_{i}", a.name) for i, a in enumerate(nccl.APIS)
                      if a.name in names]
            layer = "nccl"
        else:
            wanted = [(fn, None, sym) for sym, fn in MARKER_SYMBOLS.items() if sym in names]
            layer = "markers"
        if not wanted:
            probes.cap(layer, f"{kind} library", "absent", "exports none of the traced functions", path)
            return
        # where each NCCL probe costs one trap; a marker symbol's probe stays on it, where the
        # checkpoint layer's probe is too (one breakpoint serves both)
        sites = entry_sites(real, {sym for _, _, sym in wanted}) if kind == "nccl" else {}
        for entry, ret, sym in wanted:
            site = sites.get(sym)
            try:
                attach_pair(probes.bpf, real, sym, site, entry, ret)
                probes.cap(layer, sym, "attached", site_detail(site), path)
            except Exception as e:  # BCC raises bare Exception
                probes.cap(layer, sym, "failed", failure(e), path)
        self.context.writer.add("library", (self.context.session_id, path, kind, now_ns(), found_by))

    # -- rows -------------------------------------------------------------------------------------
    def flush(self) -> None:
        s = self.context
        sid, ident, w = s.session_id, s.identity, s.writer
        for kind, records in self.raw.items():
            s.count(kind, len(records))
        stacks = s.stacks  # each marker and NCCL entry captured its Python stack under (ts, pid, tid)
        if self.raw["marker"] or stacks.held("marker"):
            records = MARKER.iter_unpack(b"".join(self.raw["marker"]))
            for (ts, value, tag, text_addr, text_len, pid, tid, kind, _pad, text), py_stack in stacks.join(
                    "marker", records, _marker_stack_key):
                th = ident.thread(tid, pid, None, ts)
                if kind == _STEP:
                    w.add("step_mark", (sid, ts, th, signed64(value), py_stack))
                elif kind == _LINEAGE:
                    w.add("lineage_mark", (sid, ts, th, signed64(tag), py_stack))
                    if tag and tag not in self.labels_seen:
                        self.labels_seen.add(tag)
                        label = _read_text(pid, text_addr, text_len, text)
                        w.add("lineage_label", (sid, signed64(tag), label))
                elif kind == _CHECKPOINT:
                    path = _read_text(pid, text_addr, text_len, text)
                    w.add("checkpoint_mark", (sid, ts, th, value, signed64(tag), path, py_stack))
            self.raw["marker"].clear()
        if self.raw["nccl"] or stacks.held("nccl"):
            records = NCCL.iter_unpack(b"".join(self.raw["nccl"]))
            w.extend("nccl_call", self._nccl_rows(stacks.join("nccl", records, _nccl_stack_key)))
            self.raw["nccl"].clear()

    def _nccl_rows(self, joined: Iterable[tuple[tuple, int | None]], open_calls: bool = False) -> list[tuple]:
        """nccl_call rows from unpacked nccl_event records with their Python stack ids (and the
        communicators a returned init made, into nccl_comm)."""
        s = self.context
        sid, ident, w = s.session_id, s.identity, s.writer
        rows = []
        for (ts, dur, cg, ret, count, comm, stream, comm_hash, pid, tid, api, datatype, op, peer, nranks,
             rank), py_stack in joined:
            th = ident.thread(tid, pid, None, ts)
            kind = _KIND[api]
            if kind == "init" and ret == 0 and not open_calls:
                w.add("nccl_comm", (sid, ident.process(pid, ts), comm, signed64(comm_hash), rank, nranks, ts))
            data = kind in ("collective", "p2p")
            rows.append((sid, ts, dur, th, api, None if open_calls else ret, count if data else None,
                         datatype if data else None, op if data and op >= 0 else None,
                         peer if peer >= 0 else None, comm or None, stream if data else None, cg, py_stack))
        return rows

    def drain_in_flight(self, ts: int, final: bool) -> int:
        """Write the NCCL calls still in flight at `ts` as open nccl_call rows (dur: entry -> ts,
        ret NULL) with their thread, communicator and Python stack: the hung collective of a stuck
        job. `final` (the stop) removes them from the map, else (a dump) they stay for their
        return. A call whose thread has ended is counted in `loss`. Returns the rows written."""
        s = self.context
        joined, lost = [], 0
        for call in in_flight(s.probes.bpf, "nccl_inflight", delete=final):
            r = call.record
            if call.pid is None or r.ts > ts:
                lost += call.pid is None
                continue
            # an init's communicator is written at its return: an open one has none yet
            rec = (r.ts, ts - r.ts, r.cgroup_id, 0, r.count, 0 if r.out_comm else r.comm, r.stream,
                   r.comm_hash, call.pid, call.tid, call.api, r.datatype, r.op, r.peer, r.nranks, r.rank)
            k = _nccl_stack_key(rec)
            joined.append((rec, s.stacks.open_stack(k, take=final)))
            if final and _KIND[call.api] == "init":
                # a rank stuck in its init: its communicator, with no handle yet (0), so the hang
                # report knows its rank and which ranks never joined
                s.writer.add("nccl_comm", (s.session_id, s.identity.process(call.pid, r.ts), 0,
                                           signed64(r.comm_hash), r.rank, r.nranks, r.ts))
        rows = self._nccl_rows(joined, open_calls=True)
        # the calls in flight at an earlier drain (a dump) are replaced: open rows are those of the last
        self.drop_open_rows()
        for row in rows:
            s.writer.execute(_OPEN_INSERT, row)
        if lost:
            s.writer.add("loss", (s.session_id, ts, OPEN_LOST, lost))
        return len(rows)

    def in_flight(self) -> tuple[CallInFlight, ...]:
        """The NCCL calls in flight now, oldest first, left in the map for their return (a call of a
        thread gone is none)."""
        if self.context.probes is None:
            return ()
        return tuple(CallInFlight("nccl_call", nccl.APIS[call.api].name, call.pid, call.tid, call.record.ts)
                     for call in in_flight(self.context.probes.bpf, "nccl_inflight", delete=False)
                     if call.pid is not None and call.record.ts != 0 and call.api < len(nccl.APIS))

    def drop_open_rows(self) -> None:
        s = self.context
        s.writer.execute("DELETE FROM nccl_call WHERE session_id = ? AND open = 1", (s.session_id,))


def _marker_stack_key(rec: tuple) -> tuple[int, int, int]:
    return rec[0], rec[5], rec[6]  # ts, pid, tid


def _nccl_stack_key(rec: tuple) -> tuple[int, int, int]:
    return rec[0], rec[8], rec[9]  # entry ts, pid, tid


def _read_text(pid: int, addr: int, length: int, inline: bytes) -> str:
    """The whole label or path from the process (kept alive there), else the inline copy."""
    raw = inline.split(b"\0", 1)[0]
    if length > len(raw) and addr:
        try:
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(addr)
                raw = mem.read(min(length, 65536))
        except OSError:
            pass  # the process is gone: keep the first 127 bytes
    return raw.decode("utf-8", "backslashreplace")
