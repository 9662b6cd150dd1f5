"""The layer contract: what every layer of a recording declares and does, and what it is given.

A layer is one source of observations (the scheduler, CUDA calls, block I/O, the kernel log ...).
It owns its BPF source names, its tracepoints, its record layouts' decoding and its rows; the
session (recorder/session.py) drives every layer through the same steps, in the order of its
`layer_order()` and `flush_steps()`:

1. `Layer(context)`: nothing is attached yet; the store, writer, session id and identity exist.
2. `prepare()`: declare its tables to the writer and write its static rows (API lists).
3. `sources` and `bpf_text()`: the BPF files (each with the tracepoints it needs and those it
   uses when present) and the generated programs compiled into the session's one BPF object.
4. `attach()`: once the BPF object is loaded (`context.probes`) and the stack recorder exists:
   attach uprobes, fill maps, open files; record every decision as a Capability.
5. `sinks()`: ring buffer name -> callable taking one record's bytes (or a block of framed records
   for the rings in `blocks()`); the callable only copies bytes.
6. `flush()`: every batch (100 ms), turn the records collected since the last flush into rows.
7. `finish(ts)`: at stop, after the last flush: what it could not complete goes to `loss`.

`drain_in_flight(ts, final)`: calls a layer holds in a BPF map until they return (CUDA, NCCL) are
written as open rows: at the stop (`final`, taken out of the map) and for a dump while recording.

What a layer loses is written to `loss` under the names in its `losses` (per-probe drops are
counted by the loader; a layer adds its own reasons in flush or finish). Layers never import the
session or each other: what they share goes through the `Context` (the identity, the stack
recorder, the libraries attached).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from recorder.core.sources import BpfSource  # where the layers import it from

if TYPE_CHECKING:
    from recorder.core.identity import Identity
    from recorder.core.loader import Probes
    from recorder.core.stacks import StackRecorder
    from store.db import Store, Writer


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
    def tables(self) -> tuple[str, ...]: ...  # what it writes

    @property
    def losses(self) -> tuple[str, ...]: ...  # the `loss.probe` names its lost records are counted under

    def prepare(self) -> None: ...

    def bpf_text(self) -> str: ...

    def attach(self) -> None: ...

    def sinks(self) -> dict[str, Sink]: ...

    def blocks(self) -> dict[str, int]: ...

    def flush(self) -> None: ...

    def finish(self, ts: int) -> None: ...

    def drain_in_flight(self, ts: int, final: bool) -> int: ...


class BaseLayer:
    """Defaults for the contract's optional steps: a layer overrides what it needs."""

    name = ""
    sources: tuple[BpfSource, ...] = ()
    tables: tuple[str, ...] = ()
    losses: tuple[str, ...] = ()

    def __init__(self, context: Context) -> None:
        self.context = context

    def prepare(self) -> None:
        pass

    def bpf_text(self) -> str:
        return ""

    def attach(self) -> None:
        pass

    def sinks(self) -> dict[str, Sink]:
        return {}

    def blocks(self) -> dict[str, int]:
        return {}

    def flush(self) -> None:
        pass

    def finish(self, ts: int) -> None:
        pass

    def drain_in_flight(self, ts: int, final: bool) -> int:
        return 0
