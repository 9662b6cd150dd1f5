"""A running recorder's metrics for Prometheus, in node_exporter's textfile format.

`recorder start --metrics-file PATH` (or `record`) rewrites PATH every few seconds: node_exporter's
textfile collector (`--collector.textfile.directory`) serves it with the node's other metrics, so
the recorder needs no port of its own. The file is written next to its final name (under a random
name, created new) and renamed over it, so a scrape never reads half of it. At a clean stop
`stall_recorder_up` becomes 0; a recorder that died leaves
`stall_recorder_last_update_timestamp_seconds` behind, which an alert can watch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from store.analysis.losses import describe
from store.errors import UserError

INTERVAL_S = 5.0  # how often the file is rewritten while recording
PREFIX = "stall_recorder_"


@dataclass
class Metric:
    """One metric family: its samples are (labels, value)."""

    name: str
    kind: str  # 'gauge', 'counter' or 'histogram'
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)
    suffixes: list[str] = field(default_factory=list)  # a histogram's '_bucket', '_sum', '_count' per sample

    def add(self, value: float, **labels: str) -> Metric:
        self.samples.append((labels, value))
        return self

    def add_sample(self, suffix: str, value: float, **labels: str) -> Metric:
        """A sample of a histogram's series NAME_bucket, NAME_sum or NAME_count."""
        self.suffixes += [""] * (len(self.samples) - len(self.suffixes)) + [suffix]
        return self.add(value, **labels)


def _label_value(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def render(metrics: list[Metric]) -> str:
    """The Prometheus text exposition format (version 0.0.4) of `metrics`."""
    lines = []
    for m in metrics:
        name = PREFIX + m.name
        lines.append(f"# HELP {name} {m.help}")
        lines.append(f"# TYPE {name} {m.kind}")
        for i, (labels, value) in enumerate(m.samples):
            series = name + (m.suffixes[i] if i < len(m.suffixes) else "")
            text = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{series}{{{text}}} {_number(value)}" if text else f"{series} {_number(value)}")
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a new temporary file in `path`'s folder, then rename it over `path`.

    The folder is often one other users can write (a textfile collector's): the temporary file gets
    a random name and is created, never opened (O_CREAT|O_EXCL|O_NOFOLLOW, what mkstemp does), so a
    file or a symlink planted under a name the recorder would use is never written through. The
    rename replaces a symlink at `path` itself, never its target. Readable by all (0644), as
    node_exporter, which runs as a user of its own, reads it."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def check_metrics_path(path: Path) -> None:
    """Fail at the start, in one line, when PATH cannot be written."""
    if path.is_dir():
        raise UserError(f"--metrics-file {path} is a directory: pass a file path, e.g. "
                        "/var/lib/node_exporter/textfile_collector/stall_recorder.prom")
    if not path.parent.is_dir():
        raise UserError(f"--metrics-file: folder {path.parent} does not exist: create it or pass another path")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"--metrics-file: cannot write into {path.parent}: pass a writable path")


def loss_layer(probe: str) -> str:
    """The layer a `loss.probe` name is of, as the loss report names it (store/analysis/losses.py)."""
    return describe(probe)[0]


# the layer each kind of event counted in the status file comes from
EVENT_LAYERS = {"offcpu": "sched", "cuda": "cuda", "task": "task", "nccl": "workload", "marker": "workload",
                "block": "io", "checkpoint": "checkpoint"}


@dataclass
class Snapshot:
    """What the session knows at one moment (filled by recorder/session.py)."""

    session_id: int
    db: str
    target: str
    started_unix: float
    events: dict[str, int]
    dropped_by_layer: dict[str, int]
    db_bytes: int
    up: bool = True
    flight: dict | None = None  # FlightRecorder.metrics(): absent without --keep


def collect(s: Snapshot) -> list[Metric]:
    """Every metric of a snapshot, in a fixed order."""
    times = os.times()
    info = Metric("info", "gauge", "the recording: its session, database and target (value 1)")
    info.add(1, session=str(s.session_id), db=s.db, target=s.target)
    events = Metric("events_total", "counter", "events recorded, by layer and kind")
    for kind, n in sorted(s.events.items()):
        events.add(n, layer=EVENT_LAYERS.get(kind, kind), kind=kind)
    dropped = Metric("dropped_events_total", "counter",
                     "events lost (ring buffer or map full, BPF program skipped, stack unread), by layer")
    for layer, n in sorted(s.dropped_by_layer.items()):
        dropped.add(n, layer=layer)
    out = [
        Metric("up", "gauge", "1 while the recorder records; 0 once it stopped cleanly").add(int(s.up)),
        Metric("last_update_timestamp_seconds", "gauge",
               "when this file was written (Unix time): a stale value means the recorder died").add(time.time()),
        Metric("start_timestamp_seconds", "gauge", "when the recording started (Unix time)").add(s.started_unix),
        info, events, dropped,
        Metric("cpu_seconds_total", "counter", "CPU time the recorder used (user and system, all its threads)")
        .add(round(times.user + times.system, 3)),
        Metric("database_bytes", "gauge", "the recording database and its write-ahead log on disk").add(s.db_bytes),
    ]
    f = s.flight
    if f is None:
        return out
    saved = Metric("incidents_saved_total", "counter", "incident recordings saved, by trigger")
    for trigger, n in sorted(f["saved"].items()):
        saved.add(n, trigger=trigger)
    held = Metric("incidents_suppressed_total", "counter",
                  "triggers held back by the rate limit (--cooldown, 12 an hour), by trigger")
    for trigger, n in sorted(f["suppressed"].items()):
        held.add(n, trigger=trigger)
    out += [
        saved, held,
        Metric("incident_errors_total", "counter", "incidents that could not be saved").add(f["errors"]),
        Metric("window_kept_seconds", "gauge",
               "the window the flight recorder keeps now (shorter than --keep when --max-size holds no more)")
        .add(f["kept_s"]),
        Metric("window_configured_seconds", "gauge", "--keep").add(f["keep_s"]),
        Metric("hook_runs_total", "counter", "--on-incident commands run").add(f["hook_runs"]),
        Metric("hook_failures_total", "counter",
               "--on-incident commands that failed (exit status not 0, timeout, could not start)")
        .add(f["hook_failures"]),
    ]
    last = f.get("last")
    if last:
        out += [
            Metric("last_incident_timestamp_seconds", "gauge", "when the last incident's trigger fired (Unix time)")
            .add(last["unix"]),
            Metric("last_incident_info", "gauge",
                   "the last incident saved: its trigger, file and primary cause kind (value 1)")
            .add(1, trigger=last["trigger"], file=last["file"], cause_kind=last["cause_kind"] or "none"),
        ]
    stall = f.get("last_stall")
    if stall:
        out.append(Metric("last_stall_timestamp_seconds", "gauge",
                          "when the last incident whose report finds a stall was triggered (Unix time)")
                   .add(stall["unix"]))
        if stall["step"] is not None:
            out.append(Metric("last_stall_step", "gauge", "the stalled step of the last stall (its marker's number)")
                       .add(stall["step"]))
        out.append(Metric("last_stall_cause_info", "gauge",
                          "the primary cause kind of the last stall (store/analysis/causes.py kinds; value 1)")
                   .add(1, cause_kind=stall["cause_kind"] or "none", trigger=stall["trigger"]))
    return out


class MetricsFile:
    """The file node_exporter reads: write() at most every INTERVAL_S, or now with force."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last = 0.0
        self._failed = False

    def write(self, snapshot: Snapshot, force: bool = False, extra: list[Metric] | None = None) -> None:
        now = time.monotonic()
        if not force and now - self._last < INTERVAL_S:
            return
        self._last = now
        try:
            write_atomically(self.path, render(collect(snapshot) + (extra or [])))
            self._failed = False
        except OSError as e:  # a full disk: the next write tries again; said once per failing stretch
            if not self._failed:
                print(f"recorder: cannot write the metrics file {self.path} ({e.strerror}): retrying every "
                      f"{INTERVAL_S:g} s", flush=True)
            self._failed = True
