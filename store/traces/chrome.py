"""PyTorch profiler traces (Chrome trace JSON as torch.profiler's export_chrome_trace and
tensorboard_trace_handler write them, through Kineto over CUPTI or roctracer) read into plain rows.

What a trace holds, and where it goes:
- complete events ('ph': 'X') on host threads (pid and tid are the process's and thread's ids):
  operators (cat 'cpu_op'), Python functions ('python_function', with_stack=True), runtime and
  driver calls ('cuda_runtime', 'cuda_driver'; HIP calls carry the same categories), user
  annotations ('user_annotation', ProfilerStep#N among them) -> HostOp;
- complete events on device rows (pid is the device, tid the stream): kernels ('kernel'), copies
  ('gpu_memcpy'), memsets ('gpu_memset'), the device-side copy of an annotation ('gpu_user_annotation'),
  synchronisations seen from the device ('cuda_sync') -> DeviceActivity, with the correlation id
  that names the runtime call that launched them;
- metadata events ('ph': 'M') name processes and threads; `distributedInfo` gives rank and world
  size; `baseTimeNanoseconds` (Kineto from PyTorch 2.1 on) is the Unix time ts counts from.

Timestamps are microseconds with up to three decimals (nanoseconds): they are read from their
text, never through a float, so a Unix-time trace keeps its nanoseconds.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from store.errors import UserError

STEP_NAME = re.compile(r"ProfilerStep#(\d+)$")
HOST_KINDS = {"cpu_op": "cpu_op", "python_function": "python_function", "cuda_runtime": "runtime",
              "cuda_driver": "runtime", "user_annotation": "annotation", "cpu_instant_event": "other",
              "overhead": "other"}
DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset",
                "gpu_user_annotation": "annotation", "cuda_sync": "sync"}


class TraceError(UserError):
    """A file that is not a usable profiler trace: one line saying which file and why."""


@dataclass(slots=True)
class HostOp:
    ts: int
    dur: int
    pid: int
    tid: int
    kind: str
    name: str
    correlation: int | None
    external_id: int | None


@dataclass(slots=True)
class DeviceActivity:
    ts: int
    dur: int
    kind: str
    name: str
    device: int
    stream: int | None
    correlation: int | None
    size_bytes: int | None
    grid: str | None
    block: str | None


@dataclass
class Trace:
    """One profiler trace, read."""

    path: Path
    base_ns: int                        # Unix ns that ts 0 is (0: ts are Unix time already)
    start_ts: int                       # ns of the earliest event
    end_ts: int                         # ns the latest event ended
    events: int                         # events in the file
    skipped: int                        # events not stored (flows, counters, instants, spans)
    processes: dict[int, str] = field(default_factory=dict)   # pid -> name (host processes)
    threads: dict[tuple[int, int], str | None] = field(default_factory=dict)  # (pid, tid) -> name
    host: list[HostOp] = field(default_factory=list)
    device: list[DeviceActivity] = field(default_factory=list)
    distributed: dict | None = None
    runtime: str | None = None          # 'cuda' or 'rocm'; None without device activity
    host_name: str | None = None        # the host the trace was taken on, where it says (host_name)


def ns(value: object) -> int:
    """Microseconds as the trace writes them (an int, or a number's text: parse_float keeps it) -> ns."""
    if isinstance(value, int):
        return value * 1000
    if isinstance(value, str):
        if "e" in value or "E" in value:
            return round(float(value) * 1000)
        whole, _, frac = value.partition(".")
        sign = -1 if whole.startswith("-") else 1
        return int(whole or "0") * 1000 + sign * int((frac + "000")[:3] or "0")
    if isinstance(value, float):
        return round(value * 1000)
    raise ValueError(f"not a time: {value!r}")


def _int(value: object) -> int | None:
    """An id as the profiler writes it: an int, a number's text, or a hex pointer ('0x0')."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value, 0) if value.startswith(("0x", "0X")) else int(float(value))
        except ValueError:
            return None
    return None


def _dims(value: object) -> str | None:
    """'x,y,z' of a kernel's grid or block ([x, y, z] in the trace)."""
    if type(value) is list and len(value) == 3:
        x, y, z = value
        if type(x) is int and type(y) is int and type(z) is int:
            return f"{x},{y},{z}"
    return None


def _args(event: dict) -> dict:
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def load_json(path: Path) -> object:
    """The file's JSON (gzip when it starts with gzip's magic, whatever its name), with every
    non-integer number kept as its text; one-line TraceError for anything unreadable."""
    try:
        with path.open("rb") as f:
            head = f.read(2)
            f.seek(0)
            raw = gzip.GzipFile(fileobj=f).read() if head == b"\x1f\x8b" else f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise TraceError(f"{path}: truncated or damaged gzip ({e}): copy the trace again") from None
    except OSError as e:
        raise TraceError(f"cannot read {path} ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path} is neither JSON nor a Flight Recorder dump (not UTF-8 text)") from None
    del raw  # the bytes are not needed beside their text while the JSON is parsed
    try:
        return json.loads(text, parse_float=str)
    except json.JSONDecodeError as e:
        what = "truncated" if e.pos >= len(text.rstrip()) - 1 else "not valid JSON"
        raise TraceError(f"{path} is {what} (line {e.lineno}, column {e.colno}: {e.msg}): "
                         "pass a complete trace") from None
    except RecursionError:
        raise TraceError(f"{path} nests JSON too deeply to be a profiler trace") from None


def is_chrome_trace(doc: object) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)


def read(path: Path, doc: object) -> Trace:
    """The rows of a profiler trace already loaded by load_json."""
    if not is_chrome_trace(doc):
        raise TraceError(f"{path} is not a PyTorch profiler trace (no 'traceEvents' list): pass a file written by "
                         "torch.profiler (export_chrome_trace or tensorboard_trace_handler)")
    assert isinstance(doc, dict)
    events = doc["traceEvents"]
    base = _int(doc.get("baseTimeNanoseconds")) or 0
    dist = doc.get("distributedInfo")
    trace = Trace(path=path, base_ns=base, start_ts=0, end_ts=0, events=len(events), skipped=0,
                  distributed=dist if isinstance(dist, dict) else None,
                  host_name=doc["host_name"] if isinstance(doc.get("host_name"), str) else None)
    device_pids: set[int] = set()
    lo, hi = None, None
    names: dict[tuple[int, int], str] = {}
    rocm = False
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceError(f"{path}: event {i} is not an object: not a profiler trace")
        ph = e.get("ph")
        pid, tid = e.get("pid"), e.get("tid")
        if ph == "M":
            name = e.get("name")
            args = _args(e)
            if isinstance(pid, int) and isinstance(args.get("name"), str):
                if name == "process_name":
                    trace.processes[pid] = args["name"]
                elif name == "thread_name" and isinstance(tid, int):
                    names[(pid, tid)] = args["name"].strip()
            if name == "process_labels" and isinstance(pid, int) and "GPU" in str(args.get("labels", "")):
                device_pids.add(pid)
            trace.skipped += 1
            continue
        if ph != "X" or not isinstance(pid, int) or not isinstance(tid, int):
            trace.skipped += 1  # flows, counters, instants, and the profiler's own spans ('Spans', 'Traces')
            continue
        try:
            ts = ns(e["ts"])
            dur = max(ns(e.get("dur", 0)), 0)
        except (KeyError, ValueError) as err:
            raise TraceError(f"{path}: event {i} has no usable ts/dur ({err}): not a profiler trace") from None
        lo = ts if lo is None or ts < lo else lo
        hi = ts + dur if hi is None or ts + dur > hi else hi
        cat = e.get("cat")
        name = str(e.get("name", ""))
        args = _args(e)
        dkind = DEVICE_KINDS.get(cat) if isinstance(cat, str) else None
        if dkind is not None:
            device = _int(args.get("device"))
            trace.device.append(DeviceActivity(
                ts, dur, dkind, name, pid if device is None else device, _int(args.get("stream", tid)),
                _int(args.get("correlation")), _int(args.get("bytes")), _dims(args.get("grid")),
                _dims(args.get("block"))))
            device_pids.add(pid)
            continue
        kind = HOST_KINDS.get(cat, "other") if isinstance(cat, str) else "other"
        if kind == "runtime" and name.startswith("hip"):
            rocm = True
        trace.host.append(HostOp(ts, dur, pid, tid, kind, name, _int(args.get("correlation")),
                                 _int(args.get("External id"))))
    if lo is None or hi is None:
        raise TraceError(f"{path} holds no timed event: not a profiler trace, or an empty one")
    trace.start_ts, trace.end_ts = lo, hi
    # a device row's pid is the device, never a host process: its name is not a process's
    host_pids = {op.pid for op in trace.host}
    for pid in device_pids - host_pids:
        trace.processes.pop(pid, None)
    for op in trace.host:
        if (op.pid, op.tid) not in trace.threads:
            trace.threads[(op.pid, op.tid)] = names.get((op.pid, op.tid))
    if trace.device:
        trace.runtime = "rocm" if rocm else "cuda"
    return trace


def steps(trace: Trace) -> list[tuple[int, int, int, int, int]]:
    """(pid, tid, step, ts, end_ts) of the host's ProfilerStep#N annotations."""
    out = []
    for op in trace.host:
        if op.kind == "annotation":
            m = STEP_NAME.match(op.name)
            if m:
                out.append((op.pid, op.tid, int(m.group(1)), op.ts, op.ts + op.dur))
    return out
