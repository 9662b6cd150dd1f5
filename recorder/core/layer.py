"""The layer contract: what every layer of a recording declares and does, and what it is given.

A layer is one source of observations (the scheduler, CUDA calls, block I/O, the kernel log ...).
It owns its BPF source names, its tracepoints, its record layouts (`records`), its rows, and the
words it writes into `loss`; the session (recorder/session.py) knows no layer by name: it creates
every class of the registry (recorder/layers/__init__.py, `LAYERS`) in that order and drives them
all through the hooks below. A hook a layer does not need is BaseLayer's no-op.

Starting, in this order:
1. `Layer(context)`: nothing is attached yet; the store, writer, session id, identity and settings exist.
2. `prepare()`: declare its tables to the writer and write its static rows (API lists).
3. `sources`, `records` and `bpf_text()`: the BPF files (each with the tracepoints it needs and those
   it uses when present), the structs and constants they share with Python, and the generated programs
   compiled into the session's one BPF object, in registry order.
4. `attach()`: once the BPF object is loaded (`context.probes`) and the stack recorder exists:
   attach uprobes, fill maps, open files; record every decision as a Capability.
5. `named_library(path)`: a library named on the command line (--cuda-lib); the first layer that
   takes it (returns True) attaches it.
6. `sinks()` and `blocks()`: ring buffer name -> callable taking one record's bytes (or a block of
   framed records for the rings in `blocks()`); the callable only copies bytes.
7. `scan(pid, found_by)`: a target process looked at (at the start, at its fork, exec or dlopen,
   and every second): attach what it maps.
8. `start()`: once the rings are open; a UserError here abandons the session.

Recording:
- `flush()`: every batch (100 ms), turn the records collected since the last batch into rows, in
  the order of `flush_phase` (then registry order); `retire()` runs for every layer between the
  THREADS and DEVICES phases. `wants_flush()`: records waiting that must be handled before the next
  batch is due (an exec may have mapped a library to attach before its first call).
- `process_exited(pid, ts)`: a whole target process ended (the task layer's `context.processes`).
- `tick(ts)`: once a second, after the drop counters were read.
- `drain_in_flight(ts, final)`: calls a layer holds in a BPF map until they return (CUDA, NCCL) are
  written as open rows: at the stop (`final`, taken out of the map) and for a dump while recording.
- `in_flight()`: those calls now, as plain records (`CallInFlight`), read without changing the map;
  `drop_open_rows()`: the open rows a dump's drain wrote are deleted again (while recording, a call
  in flight is in the map, not in the table). The flight recorder and the workload metrics ask the
  layers through the session's handle (recorder/core/participant.py), naming none.
- `counted()`: records read that the status file does not count, for the metrics file.
- `summary()`: capability rows that are not the loader's, for the attach summary.

Stopping, in this order:
1. `stop()`: what runs on its own (a sampling thread) stops; also when the start failed or the disk
   took no more.
2. `settle(ts)`: with the probes still attached, wait (briefly) for what is in flight to arrive;
   then the session reads the rings a last time and flushes.
3. `unfinished(ts)`: what was started and never ended in the kernel goes to `loss`; then the last
   `tick` and `drain_in_flight(final=True)`.
4. `finish(ts)`: open intervals end at the stop, the last exits are applied (in `flush_phase`
   order); then the session reports the stacks' misses and stores the capabilities.
5. `close(ts)`: the last reads of what no BPF program sends (the kernel log) and the waits for the
   recorder's own threads (hashes), in `flush_phase` order, before the writer closes.

What a layer loses is written to `loss` under the names in its `losses` (per-probe drops are counted
by the loader from its `records.drops`; a layer adds its own reasons), each with what it means; the
session stores them in `layer_vocabulary` so the report can word them without knowing the layer.
Likewise its `observes`: the `capability.layer` words a report lists under "Observed:" or "Not
observed:", each with what it observes ('block': 'block I/O requests'); a layer whose capability rows
no report lists (the task layer's) declares none.
Layers never import the session or each other: what they share goes through the `Context` (the
identity, the stack recorder, the libraries attached, the session's reactions to processes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from recorder.core.capability import Observation  # where the layers import it from
from recorder.core.events import Loss, Records
from recorder.core.inflight import CallInFlight
from recorder.core.settings import Settings
from recorder.core.sources import BpfSource  # where the layers import it from

if TYPE_CHECKING:
    from recorder.core.identity import Identity
    from recorder.core.loader import Probes
    from recorder.core.stacks import StackRecorder
    from store.db import Store, Writer


class Phase(IntEnum):
    """Where a layer's `flush()` runs in each batch; its `finish()` and `close()` at the stop follow
    the same order."""

    PROCESSES = 1  # forks and execs first, so this batch's events of a new process image get its identity
    # (the session reads the batch's Python stack records here: each event's stack came before it)
    THREADS = 2  # events of target threads, before the exits `retire()` applies end their threads
    # (every layer's `retire()` here: exits one flush late, after every row held for its stack record)
    DEVICES = 3  # rows that name no target thread (the kernel log, GPU samples)


@dataclass(frozen=True)
class ProcessHooks:
    """What the session does when a process appears, ends or maps a library (called by the layer
    that sees it happen)."""

    scan: Callable[[int, str, int], None]  # (pid, found_by, ts): a process to look at
    known: Callable[[int], bool]  # pid already looked at
    exited: Callable[[int, int], None]  # (pid, ts): a whole process ended
    dlopen: Callable[[int], None]  # pid mapped a library


@dataclass
class Context:
    """What a layer may use of the session. Filled as the session starts: `probes` and `stacks`
    exist from `attach()` on."""

    store: Store
    writer: Writer
    session_id: int
    started_ts: int
    identity: Identity
    events: dict[str, int]  # records read per kind, for the status file
    probes: Probes | None = None
    stacks: StackRecorder | None = None
    # real path -> kind of every library a layer attached uprobes to ('nccl', 'markers', ...)
    libraries: dict[str, str] = field(default_factory=dict)
    settings: Settings = field(default_factory=Settings)
    processes: ProcessHooks | None = None

    def count(self, kind: str, n: int) -> None:
        self.events[kind] = self.events.get(kind, 0) + n


Sink = Callable[[bytes], None]


@runtime_checkable
class Layer(Protocol):
    """The contract every layer implements (see the module docstring for when each is called)."""

    # read-only (properties) so that a layer's class attributes, e.g. tables = ("offcpu_interval",),
    # satisfy them for the type checker
    @property
    def name(self) -> str: ...

    @property
    def sources(self) -> tuple[BpfSource, ...]: ...  # what it attaches through tracepoints

    @property
    def records(self) -> Records: ...  # the structs, constants and drop counters it shares with its BPF programs

    @property
    def tables(self) -> tuple[str, ...]: ...  # what it writes

    @property
    def losses(self) -> tuple[Loss, ...]: ...  # every `loss.probe` name it writes, with what it means

    @property
    def observes(self) -> tuple[Observation, ...]: ...  # the `capability.layer` words reports list, and their meaning

    @property
    def flush_phase(self) -> Phase: ...

    def prepare(self) -> None: ...

    def bpf_text(self) -> str: ...

    def attach(self) -> None: ...

    def named_library(self, path: str) -> bool: ...

    def sinks(self) -> dict[str, Sink]: ...

    def blocks(self) -> dict[str, int]: ...

    def scan(self, pid: int, found_by: str) -> None: ...

    def start(self) -> None: ...

    def wants_flush(self) -> bool: ...

    def flush(self) -> None: ...

    def retire(self) -> None: ...

    def process_exited(self, pid: int, ts: int) -> None: ...

    def tick(self, ts: int) -> None: ...

    def drain_in_flight(self, ts: int, final: bool) -> int: ...

    def in_flight(self) -> tuple[CallInFlight, ...]: ...

    def drop_open_rows(self) -> None: ...

    def counted(self) -> dict[str, int]: ...

    def summary(self) -> tuple[tuple[str, str, str, str], ...]: ...

    def stop(self) -> None: ...

    def settle(self, ts: int) -> None: ...

    def unfinished(self, ts: int) -> None: ...

    def finish(self, ts: int) -> None: ...

    def close(self, ts: int) -> None: ...


class BaseLayer:
    """Defaults for every hook of the contract: a layer overrides what it needs."""

    name = ""
    sources: tuple[BpfSource, ...] = ()
    records: ClassVar[Records] = Records()
    tables: tuple[str, ...] = ()
    losses: tuple[Loss, ...] = ()
    observes: tuple[Observation, ...] = ()
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        self.context = context

    def prepare(self) -> None:
        pass

    def bpf_text(self) -> str:
        return ""

    def attach(self) -> None:
        pass

    def named_library(self, path: str) -> bool:
        return False

    def sinks(self) -> dict[str, Sink]:
        return {}

    def blocks(self) -> dict[str, int]:
        return {}

    def scan(self, pid: int, found_by: str) -> None:
        pass

    def start(self) -> None:
        pass

    def wants_flush(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def retire(self) -> None:
        pass

    def process_exited(self, pid: int, ts: int) -> None:
        pass

    def tick(self, ts: int) -> None:
        pass

    def drain_in_flight(self, ts: int, final: bool) -> int:
        return 0

    def in_flight(self) -> tuple[CallInFlight, ...]:
        return ()

    def drop_open_rows(self) -> None:
        pass

    def counted(self) -> dict[str, int]:
        return {}

    def summary(self) -> tuple[tuple[str, str, str, str], ...]:
        return ()

    def stop(self) -> None:
        pass

    def settle(self, ts: int) -> None:
        pass

    def unfinished(self, ts: int) -> None:
        pass

    def finish(self, ts: int) -> None:
        pass

    def close(self, ts: int) -> None:
        pass
