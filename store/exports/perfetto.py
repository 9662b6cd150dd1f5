"""`recorder export --perfetto FILE`: a recording as a native Perfetto trace.

The trace is built with the Perfetto project's own protos (the `perfetto` package's
perfetto_trace_pb2), so ui.perfetto.dev and trace_processor read it as they read their own traces:

- a process track per recorded process and a thread track per thread, with its steps, CUDA and NCCL
  calls, off-CPU intervals (state, reason, who held the CPU), direct reclaim and dirty throttling;
  lineage and checkpoint scopes on tracks of their own inside the process;
- the task a thread waited behind gets a slice on its own thread track for the time it ran;
- a track per disk with each block request and its stages (queued, on device);
- counters: each disk's queue depth (requests in flight) and each GPU's utilisation and memory;
- instants for every kernel log record and for each typed device or machine event;
- a flow (arrow) for every causal_link row whose two ends are in the exported window;
- for an imported profiler trace (`recorder import`), its host ops on their threads and a track per
  device and stream with each kernel, copy and memset, with a flow from the runtime call that
  launched it.

Timestamps are the recording's CLOCK_MONOTONIC nanoseconds (an imported trace's: its own clock's).
Overlapping slices of one track are spread over extra lanes (tracks named '... (2)'), since a
Perfetto track only holds nested slices.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from store.db import Store
from store.errors import UserError
from store.report.build import resolve_window, session_end, session_row

SEQ_ID = 1  # every packet is written on one sequence

# Tables whose rows are device or machine events a causal_link may point at, with the column that
# names what they happened to (their track) and the one that says what happened.
EVENT_TABLES: dict[str, tuple[str, str | None]] = {
    "nvme_event": ("controller", "kind"),
    "nvme_timeout_action": ("controller", "action"),
    "block_error": ("dev", "kind"),
    "dma_event": ("device", "kind"),
    "swiotlb_event": ("device", "kind"),
    "iommu_fault": ("device", "kind"),
    "aer_event": ("device", "severity"),
    "gpu_xid": ("device", "meaning"),
    "oom_kill": ("comm", "kind"),
    "oom_victim": ("comm", None),
    "tcp_retransmit": ("daddr", None),
}


@dataclass
class Slice:
    ts: int
    dur: int
    name: str
    category: str
    args: dict = field(default_factory=dict)
    key: tuple[str, int] | None = None      # (table, id): where causal links attach
    children: list[Slice] = field(default_factory=list)  # stages drawn inside it
    stack: int | None = None                # python_stack.id: its call site and stack become arguments


@dataclass
class _Group:
    """Slices meant for one track; spread over lanes when they overlap."""

    name: str
    parent: int | None                      # uuid of the process/root track extra lanes hang off
    base: int | None                        # uuid of the first lane (a thread track), or None
    nest: bool                              # may a slice sit inside another (calls inside a step)?
    slices: list[Slice] = field(default_factory=list)


def _ann(name: str, value: object) -> pb.DebugAnnotation:
    a = pb.DebugAnnotation(name=name)
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    else:
        a.string_value = str(value)
    return a


def _hex(tag: int | None) -> str | None:
    """A 64-bit tag as the reports print it (SQLite stores it signed)."""
    return None if tag is None else f"{tag & 0xFFFFFFFFFFFFFFFF:#x}"


def _size(n: int | None) -> str:
    if n is None:
        return ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.0f} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{n} B"


class TraceBuilder:
    def __init__(self) -> None:
        # serialized TracePackets: a Trace is its packets, each framed as field 1 (kept as bytes
        # rather than as one Trace message, which costs kilobytes per packet in memory)
        self.descriptors: list[bytes] = []
        self._uuid = 0
        self.groups: dict[tuple, _Group] = {}
        self.instants: list[tuple[int, int, Slice]] = []      # (ts, track uuid, slice)
        self.counters: list[tuple[int, int, int | float]] = []  # (ts, track uuid, value)
        self.links: list[tuple[tuple[str, int], tuple[str, int], str]] = []
        self.stats = {"tracks": 0, "slices": 0, "instants": 0, "counter_values": 0, "flows": 0,
                      "links_outside": 0}
        self.emitted: set[tuple[str, int]] = set()
        self.flows: list[tuple[tuple[str, int], tuple[str, int], int]] = []  # (from, to, flow id)

    def uuid(self) -> int:
        self._uuid += 1
        return self._uuid

    def track(self, name: str | None = None, parent: int | None = None, *, process: tuple | None = None,
              thread: tuple | None = None, counter: int | None = None) -> int:
        u = self.uuid()
        d = pb.TrackDescriptor(uuid=u)
        if name:
            d.name = name
        if parent is not None:
            d.parent_uuid = parent
        if process is not None:
            pid, pname, cmdline = process
            d.process.pid = pid
            if pname:
                d.process.process_name = pname
            if cmdline:
                d.process.cmdline.append(cmdline)
        if thread is not None:
            pid, tid, tname = thread
            d.thread.pid, d.thread.tid = pid, tid
            if tname:
                d.thread.thread_name = tname
        if counter is not None:
            d.counter.unit = counter
        p = pb.TracePacket(track_descriptor=d, trusted_packet_sequence_id=SEQ_ID)
        if not self.descriptors:  # the sequence starts clean: readers need no earlier state
            p.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        self.descriptors.append(p.SerializeToString())
        self.stats["tracks"] += 1
        return u

    def group(self, key: tuple, name: str, parent: int | None, base: int | None = None,
              nest: bool = True) -> _Group:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group(name, parent, base, nest)
        return g

    # -- writing ---------------------------------------------------------------------------------
    def _lanes(self, g: _Group) -> list[list[Slice]]:
        """First-fit: a slice goes to the first lane where it nests in (or follows) what is open."""
        lanes: list[list[Slice]] = []
        stacks: list[list[int]] = []        # per lane: end times of the open slices
        for s in sorted(g.slices, key=lambda s: (s.ts, -s.dur)):
            end = s.ts + s.dur
            for stack in stacks:
                while stack and stack[-1] <= s.ts:
                    stack.pop()
            fit = next((i for i, st in enumerate(stacks) if not st or (g.nest and end <= st[-1])), None)
            if fit is None:
                fit = len(lanes)
                lanes.append([])
                stacks.append([])
            lanes[fit].append(s)
            stacks[fit].append(end)
        return lanes

    def _event(self, ts: int, track: int, kind: int, s: Slice | None = None,
               value: int | float | None = None) -> pb.TracePacket:
        p = pb.TracePacket(timestamp=ts, trusted_packet_sequence_id=SEQ_ID)
        e = p.track_event
        e.type = kind
        e.track_uuid = track
        if s is not None:
            e.name = s.name
            e.categories.append(s.category)
            for k, v in s.args.items():
                if v is not None:
                    e.debug_annotations.append(_ann(k, v))
            if s.key is not None:  # the row it shows, to look it up with SQL
                table, rid = s.key
                e.debug_annotations.append(_ann("row", f"{table} {rid}") if table != "contender"
                                           else _ann("offcpu_interval", rid))
                if s.key in self._why:  # flows carry no name: say here what the arrows into it mean
                    e.debug_annotations.append(_ann("explains", "; ".join(self._why[s.key])))
                e.flow_ids.extend(self._out.get(s.key, ()))
                e.terminating_flow_ids.extend(self._in.get(s.key, ()))
        if value is not None:
            if isinstance(value, float):
                e.double_counter_value = value
            else:
                e.counter_value = value
        return p

    def _assign_flows(self) -> None:
        self._out: dict[tuple, list[int]] = defaultdict(list)
        self._in: dict[tuple, list[int]] = defaultdict(list)
        self._why: dict[tuple, list[str]] = defaultdict(list)
        for src, dst, relation in self.links:
            if src in self.emitted and dst in self.emitted:
                fid = len(self.flows) + 1
                self.flows.append((src, dst, fid))
                self._out[src].append(fid)
                self._in[dst].append(fid)
                self._why[dst].append(f"{relation} of {src[0]} {src[1]}")
            else:
                self.stats["links_outside"] += 1
        self.stats["flows"] = len(self.flows)

    def finish(self) -> bytes:
        for g in self.groups.values():
            for s in g.slices:
                if s.key is not None:
                    self.emitted.add(s.key)
        for _, _, s in self.instants:
            if s.key is not None:
                self.emitted.add(s.key)
        self._assign_flows()
        events: list[tuple[int, int, bytes]] = []   # (ts, order, packet): sorted stably
        order = 0

        def add(ts: int, packet: pb.TracePacket) -> None:
            nonlocal order
            packet.timestamp = ts
            events.append((ts, order, packet.SerializeToString()))
            order += 1

        for g in self.groups.values():
            for n, lane in enumerate(self._lanes(g)):
                if n == 0 and g.base is not None:
                    track = g.base
                else:
                    track = self.track(g.name if n == 0 else f"{g.name} ({n + 1})", g.parent)
                flat = [(s.ts, -s.dur, depth, s) for s, depth in _flatten(lane)]
                flat.sort(key=lambda x: x[:3])
                stack: list[int] = []
                for ts, _, _, s in flat:
                    while stack and stack[-1] <= ts:
                        add(stack.pop(), self._event(0, track, pb.TrackEvent.TYPE_SLICE_END))
                    if s.dur <= 0:
                        add(ts, self._event(ts, track, pb.TrackEvent.TYPE_INSTANT, s))
                        self.stats["instants"] += 1
                        continue
                    add(ts, self._event(ts, track, pb.TrackEvent.TYPE_SLICE_BEGIN, s))
                    self.stats["slices"] += 1
                    stack.append(ts + s.dur)
                while stack:
                    add(stack.pop(), self._event(0, track, pb.TrackEvent.TYPE_SLICE_END))
        for ts, track, s in self.instants:
            add(ts, self._event(ts, track, pb.TrackEvent.TYPE_INSTANT, s))
            self.stats["instants"] += 1
        for ts, track, value in self.counters:
            add(ts, self._event(ts, track, pb.TrackEvent.TYPE_COUNTER, value=value))
            self.stats["counter_values"] += 1
        events.sort(key=lambda x: (x[0], x[1]))
        if not self.descriptors:  # nothing at all in the window: still a valid, empty trace
            return b""
        out = bytearray()
        for data in self.descriptors + [e[2] for e in events]:
            out += _PACKET_TAG + _varint(len(data)) + data
        return bytes(out)


_PACKET_TAG = bytes([(1 << 3) | 2])  # Trace.packet: field 1, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _flatten(slices: list[Slice], depth: int = 0):
    for s in slices:
        yield s, depth
        yield from _flatten(s.children, depth + 1)


# -- reading the recording ------------------------------------------------------------------------
def export_window(store: Store, session_id: int | None, window: str | None, step: int | None) -> tuple[dict, int, int]:
    session = session_row(store, session_id)
    if step is not None:
        row = store.row("SELECT min(ts) AS a, max(end_ts) AS b, count(*) AS n FROM step_all"
                        " WHERE session_id = ? AND step = ?", (session["id"], step))
        if not row["n"]:
            span = store.row("SELECT min(step) AS lo, max(step) AS hi FROM step_mark WHERE session_id = ?",
                             (session["id"],))
            where = (f"its steps run {span['lo']}..{span['hi']}" if span["lo"] is not None
                     else "it has no steps: export a --window instead")
            raise UserError(f"no step {step} in session {session['id']}: {where}")
        return session, row["a"], max(row["b"], row["a"] + 1)
    a, b = resolve_window(store, session, window)
    return session, a, b


def build_trace(store: Store, session_id: int | None = None, window: str | None = None,
                step: int | None = None) -> tuple[bytes, dict]:
    session, a, b = export_window(store, session_id, window, step)
    sid = session["id"]
    tb = TraceBuilder()
    w = {"s": sid, "a": a, "b": b}

    # processes and threads: every thread with an event in the window gets its track lazily
    threads = {r["thread_id"]: r for r in store.query("SELECT * FROM thread_info WHERE session_id = ?", (sid,))}
    procs: dict[int, int] = {}
    thread_tracks: dict[int, int] = {}

    def proc_track(t: dict) -> int:
        pid = t["pid"] if t["pid"] is not None else t["tid"]
        if pid not in procs:
            procs[pid] = tb.track(process=(pid, t["process_name"], t["cmdline"]))
        return procs[pid]

    def thread_group(thread_id: int, kind: str = "main") -> _Group:
        t = threads[thread_id]
        parent = proc_track(t)
        if kind == "main":
            if thread_id not in thread_tracks:
                pid = t["pid"] if t["pid"] is not None else t["tid"]
                thread_tracks[thread_id] = tb.track(thread=(pid, t["tid"], t["thread_name"]))
            return tb.group(("thread", thread_id), f"{t['thread_name']} {t['tid']}", parent,
                            thread_tracks[thread_id])
        return tb.group((kind, thread_id), f"{t['thread_name']} {t['tid']}: {kind}", parent, nest=False)

    for r in store.query(
            "SELECT st.*, b.baseline_dur, b.ratio, b.slow FROM step_all st"
            " LEFT JOIN step_baseline b ON b.step_mark_id = st.step_mark_id"
            " WHERE st.session_id = :s AND st.ts < :b AND st.end_ts > :a", w):
        name = f"step {r['step']}" + (" (stall)" if r["slow"] else "")
        thread_group(r["thread_id"]).slices.append(Slice(
            r["ts"], r["dur"], name, "stall" if r["slow"] else "step",
            {"step": r["step"], "baseline_dur_ns": r["baseline_dur"], "ratio": r["ratio"],
             "complete": bool(r["complete"]), "inferred": bool(r["inferred"])}, ("step_mark", r["step_mark_id"])))

    for r in store.query("SELECT c.*, b.median_dur AS expected_dur FROM cuda_call_named c"
                         " LEFT JOIN cuda_baseline b ON b.session_id = c.session_id AND b.family = c.family"
                         " AND b.size_class = coalesce(c.size_class, -1)"
                         " WHERE c.session_id = :s AND c.ts < :b AND c.ts + c.dur > :a", w):
        thread_group(r["thread_id"]).slices.append(Slice(
            r["ts"], r["dur"], r["api"], "cuda",
            {"ret": r["ret"], "size_bytes": r["size_bytes"], "stream": r["stream"],
             "expected_dur_ns": r["expected_dur"], "library": r["library"]}, ("cuda_call", r["id"]),
            stack=r["python_stack_id"]))

    for r in store.query("SELECT d.*, c.python_stack_id FROM nccl_call_detail d JOIN nccl_call c ON c.id = d.id"
                         " WHERE d.session_id = :s AND d.ts < :b AND d.ts + d.dur > :a", w):
        thread_group(r["thread_id"]).slices.append(Slice(
            r["ts"], r["dur"], r["api"], "nccl",
            {"rank": r["rank"], "nranks": r["nranks"], "count": r["count"], "comm_hash": r["comm_hash"],
             "ret": r["ret"]}, ("nccl_call", r["id"]), stack=r["python_stack_id"]))

    for r in store.query("SELECT o.*, i.contender_thread_id, i.python_stack_id FROM offcpu o"
                         " JOIN offcpu_interval i ON i.id = o.id"
                         " WHERE o.session_id = :s AND o.ts < :b AND o.ts + o.dur > :a", w):
        who = r["contender_name"] and f"{r['contender_name']} (pid {r['contender_pid']})"
        thread_group(r["thread_id"]).slices.append(Slice(
            r["ts"], r["dur"], f"off-CPU: {r['reason']}", "sched",
            {"state": r["state_letter"], "reason": r["reason"], "syscall": r["syscall_name"],
             "runq_dur_ns": r["runq_dur"], "cpu": r["cpu"], "in_cpu": r["in_cpu"], "held_cpu": who,
             "woken_by": r["waker_name"] and (f"{r['waker_name']} (pid {r['waker_pid']})" if r["waker_pid"] is not None
                                              else r["waker_name"]),
             "open": bool(r["open"])}, ("offcpu_interval", r["id"]), stack=r["python_stack_id"]))
        if r["contender_thread_id"] in threads:
            start = max(r["wakeup_ts"] or r["ts"], r["ts"])
            victim = threads[r["thread_id"]]
            thread_group(r["contender_thread_id"], "ran while others waited").slices.append(Slice(
                start, r["ts"] + r["dur"] - start, f"held CPU {r['in_cpu']} from {victim['thread_name']}",
                "sched", {"waiting_tid": victim["tid"], "ran_ns": r["contender_run_dur"]},
                ("contender", r["id"])))

    for table, name in (("reclaim_interval", "kind"), ("dirty_throttle", "bdi")):
        for r in store.query(f"SELECT * FROM {table} WHERE session_id = :s AND ts < :b AND ts + dur > :a", w):
            if r["thread_id"] in threads:
                label = "direct reclaim" if table == "reclaim_interval" else "dirty throttle"
                args = {k: v for k, v in r.items()
                        if k not in ("id", "session_id", "ts", "dur", "thread_id", "python_stack_id")}
                thread_group(r["thread_id"]).slices.append(Slice(
                    r["ts"], r["dur"], f"{label}: {r[name]}", "memory", args, (table, r["id"]),
                    stack=r.get("python_stack_id")))

    for r in store.query("SELECT * FROM lineage_interval WHERE session_id = :s AND tag != 0"
                         " AND ts < :b AND ts + dur > :a", w):
        thread_group(r["thread_id"], "lineage").slices.append(Slice(
            r["ts"], r["dur"], r["label"] or f"tag {_hex(r['tag'])}", "lineage", {"tag": _hex(r["tag"])}))

    opened: dict[tuple, dict] = {}
    for r in store.query("SELECT * FROM checkpoint_mark WHERE session_id = :s AND ts < :b ORDER BY ts", w):
        k = (r["thread_id"], r["path"])
        if r["phase"] == 1:
            opened[k] = r
        elif k in opened:
            s = opened.pop(k)
            if r["ts"] >= a:
                thread_group(r["thread_id"], "checkpoint").slices.append(Slice(
                    s["ts"], r["ts"] - s["ts"], f"checkpoint {os.path.basename(r['path'])}", "checkpoint",
                    {"path": r["path"]}))

    # what the checkpoint files went through: open, fsync, ftruncate, close, rename (a slow fsync
    # is where a checkpoint's I/O stall shows on the thread)
    for r in store.query("SELECT o.*, f.path AS file FROM checkpoint_op o JOIN checkpoint_file f ON f.id = o.file_id"
                         " WHERE o.session_id = :s AND o.ts < :b AND o.ts + o.dur > :a", w):
        thread_group(r["thread_id"]).slices.append(Slice(
            r["ts"], r["dur"], f"{r['op']} {os.path.basename(r['file'])}", "checkpoint",
            {"file": r["file"], "fd": r["fd"], "error": r["error"], "size_bytes": r["size_bytes"],
             "renamed_to": r["path"] if r["op"] == "rename" else None}, ("checkpoint_op", r["id"])))

    # block requests: a track per disk, each request with its stages, and the queue depth counter
    disks_root = None
    depth: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in store.query("SELECT * FROM block_request WHERE session_id = :s AND ts < :b AND ts + dur > :a", w):
        if disks_root is None:
            disks_root = tb.track("block I/O")
        disk = r["device"] or f"{r['dev_major']}:{r['dev_minor']}"
        end = r["ts"] + r["dur"]
        issue = r["issue_ts"]
        stages = []
        if issue is not None and r["ts"] <= issue <= end:
            stages = [Slice(r["ts"], issue - r["ts"], "queued", "block"),
                      Slice(issue, end - issue, "on device", "block")]
        tb.group(("disk", disk), disk, disks_root, nest=False).slices.append(Slice(
            r["ts"], r["dur"], f"{r['op']} {_size(r['size_bytes'])}", "block",
            {"sector": r["sector"], "size_bytes": r["size_bytes"], "rwbs": r["rwbs"], "error": r["error"],
             "submitter": r["submitter_kind"], "queued_dur_ns": r["queued_dur"], "device_dur_ns": r["device_dur"],
             "io_tag": _hex(r["io_tag"])}, ("block_request", r["id"]), stages, r["python_stack_id"]))
        depth[disk] += [(r["ts"], 1), (end, -1)]
    for disk, changes in depth.items():
        track = tb.track(f"{disk} queue depth", disks_root, counter=pb.CounterDescriptor.UNIT_COUNT)
        n = 0
        changes.sort()
        for i, (ts, d) in enumerate(changes):
            n += d
            if i + 1 == len(changes) or changes[i + 1][0] != ts:
                tb.counters.append((ts, track, n))

    gpu_tracks: dict[tuple, int] = {}
    gpu_root = None
    for r in store.query("SELECT * FROM gpu_sample WHERE session_id = :s AND ts BETWEEN :a AND :b ORDER BY ts", w):
        for col, label, unit in (("util_gpu", "utilisation %", pb.CounterDescriptor.UNIT_COUNT),
                                 ("mem_used_bytes", "memory used", pb.CounterDescriptor.UNIT_SIZE_BYTES)):
            if r[col] is None:
                continue
            if gpu_root is None:
                gpu_root = tb.track("GPU")
            k = (r["gpu_index"], col)
            if k not in gpu_tracks:
                gpu_tracks[k] = tb.track(f"GPU {r['gpu_index']} {label}", gpu_root, counter=unit)
            tb.counters.append((r["ts"], gpu_tracks[k], r[col]))

    # an imported profiler trace: the host's ops on their threads, and the device's own timeline, a
    # track per device and stream, each kernel, copy and memset flowing from the call that launched it
    for r in store.query("SELECT o.id, o.ts, o.dur, o.thread_id, o.kind, o.correlation, s.value AS name"
                         " FROM host_op o JOIN string s ON s.id = o.name_id"
                         " WHERE o.session_id = :s AND o.ts < :b AND o.ts + o.dur > :a", w):
        if r["thread_id"] in threads:
            thread_group(r["thread_id"]).slices.append(Slice(
                r["ts"], r["dur"], r["name"], f"host {r['kind']}", {"kind": r["kind"], "correlation": r["correlation"]},
                ("host_op", r["id"])))
    device_root = None
    for r in store.query("SELECT d.id, d.ts, d.dur, d.kind, d.device, d.stream, d.correlation, d.launch_op_id,"
                         " d.size_bytes, d.grid, d.block, s.value AS name FROM device_activity d"
                         " JOIN string s ON s.id = d.name_id"
                         " WHERE d.session_id = :s AND d.ts < :b AND d.ts + d.dur > :a", w):
        if device_root is None:
            device_root = tb.track("devices (profiler trace)")
        tb.group(("device", r["device"], r["stream"]), f"device {r['device']} stream {r['stream']}", device_root,
                 nest=False).slices.append(Slice(
                     r["ts"], r["dur"], r["name"], f"device {r['kind']}",
                     {"kind": r["kind"], "device": r["device"], "stream": r["stream"], "correlation": r["correlation"],
                      "size_bytes": r["size_bytes"], "grid": r["grid"], "block": r["block"]},
                     ("device_activity", r["id"])))
        if r["launch_op_id"] is not None:
            tb.links.append((("host_op", r["launch_op_id"]), ("device_activity", r["id"]), "launched"))

    # kernel log lines, then typed device and machine events (what causal links point at)
    klog = None
    for r in store.query("SELECT * FROM kernel_log WHERE session_id = :s AND ts BETWEEN :a AND :b", w):
        klog = klog or tb.track("kernel log")
        tb.instants.append((r["ts"], klog, Slice(
            r["ts"], 0, r["text"][:120], "kmsg",
            {"text": r["text"], "level": r["level"], "subsystem": r["subsystem"], "device": r["device"],
             "event": r["event_kind"]}, ("kernel_log", r["id"]))))
    ev_root = None
    ev_tracks: dict[str, int] = {}
    for table, (where, what) in EVENT_TABLES.items():
        for r in store.query(f"SELECT * FROM {table} WHERE session_id = :s AND ts BETWEEN :a AND :b", w):
            ev_root = ev_root or tb.track("device and machine events")
            name = str(r.get(where) or table)
            if name not in ev_tracks:
                ev_tracks[name] = tb.track(name, ev_root)
            args = {k: v for k, v in r.items() if k not in ("id", "session_id", "ts") and v is not None}
            label = f"{table}: {r[what]}" if what and r.get(what) else table
            tb.instants.append((r["ts"], ev_tracks[name], Slice(r["ts"], 0, label, "device", args, (table, r["id"]))))

    _python(store, [s for g in tb.groups.values() for s in g.slices if s.stack is not None])

    for r in store.query("SELECT * FROM causal_link WHERE session_id = ?", (sid,)):
        src = (r["from_table"], r["from_id"])
        dst = ("contender", r["from_id"]) if r["to_table"] == "thread" else (r["to_table"], r["to_id"])
        tb.links.append((src, dst, r["relation"]))

    data = tb.finish()
    if not tb.stats["slices"] + tb.stats["instants"] + tb.stats["counter_values"]:
        span = (session_end(store, session) - session["started_ts"]) / 1e9
        raise UserError(f"nothing recorded in that window of session {sid}: it runs 0..{span:.1f} s after its "
                        "start; pick a --window inside it")
    return data, {"session_id": sid, "start_ts": a, "end_ts": b, **tb.stats}


def _python(store: Store, slices: list[Slice]) -> None:
    """The Python call site and stack of each slice captured with one, as its arguments."""
    ids = sorted({s.stack for s in slices if s.stack is not None})
    texts: dict[int | None, dict] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        for r in store.query(f"SELECT stack_id, call_site, stack_text FROM python_stack_text WHERE stack_id IN "
                             f"({','.join('?' * len(chunk))})", chunk):
            texts[r["stack_id"]] = r
    for s in slices:
        t = texts.get(s.stack)
        if t and t["call_site"]:
            s.args["python"] = t["call_site"]
            s.args["python_stack"] = t["stack_text"]


def export_perfetto(store: Store, out: Path, session_id: int | None = None, window: str | None = None,
                    step: int | None = None) -> dict:
    """Write the trace to `out` (whole, or not at all) and say what it holds."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"folder {parent} does not exist: create it or write the trace elsewhere")
    data, stats = build_trace(store, session_id, window, step)
    tmp = out.with_name(out.name + ".part")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {out}: {e.strerror}; pass a writable path") from None
    return {"file": str(out), "bytes": len(data), **stats}
