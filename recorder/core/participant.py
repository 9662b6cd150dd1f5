"""What the session's participants that are not layers may use of it.

A layer gets the `Context` (recorder/core/layer.py). The session's other participants (the flight
recorder, recorder/flight/, and the live workload metrics, recorder/workload_metrics.py) get a
`SessionHandle`: never the Session. It holds what they read (the recording's file, its session id and
start, the rows the writer took) and what they may ask of the session: write through its writer,
and learn what its layers hold in flight, have it written as open rows for a copy, or deleted again.
The layers answer through their own hooks (`Layer.in_flight()`, `drain_in_flight()`,
`drop_open_rows()`), so a participant names no layer and reads no BPF map. The metrics file and
/metrics (recorder/metrics.py, recorder/metrics_http.py) get less still: a `Snapshot` of values, or
the text to serve; the --on-incident command (recorder/incident_hook.py) its options and each incident.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from recorder.core.inflight import CallInFlight
from store.db import sqlite_uri

if TYPE_CHECKING:
    from recorder.core.layer import Layer


class RowWriter(Protocol):
    """What a participant may do with the session's writer (store/db/__init__.py `Writer`): queue
    rows and statements, hand them over and wait for them, and read its counts. Its limits are set
    where it is made (`WriterLimits`), not here."""

    @property
    def rows_handed(self) -> int: ...  # rows handed to the writer thread so far

    @property
    def rows_written(self) -> int: ...  # of those, committed

    def add(self, name: str, row: Sequence) -> None: ...

    def execute(self, sql: str, params: Sequence = ()) -> None: ...

    def execute_first(self, sql: str, params: Sequence = (), *, until_done: bool = False) -> None: ...

    def pending(self) -> int: ...

    def flush(self) -> int: ...

    def sync(self) -> None: ...

    def commit_piece(self, rows: int = 0) -> None: ...


class SessionHandle:
    """A recording in progress as its participants see it (made by the session once its layers
    started)."""

    def __init__(self, db_path: Path, session_id: int, started_ts: int, writer: RowWriter,
                 layers: Sequence[Layer] = ()) -> None:
        self.db_path = db_path
        self.session_id = session_id
        self.started_ts = started_ts  # ns CLOCK_MONOTONIC
        self.writer = writer
        self._layers = tuple(layers)

    def connect(self) -> sqlite3.Connection:
        """A read-only connection of the participant's own to the recording (any thread may use it)."""
        conn = sqlite3.connect(sqlite_uri(self.db_path, mode="ro"), uri=True, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 2000")
        return conn

    def in_flight(self, table: str | None = None) -> list[CallInFlight]:
        """The calls in flight now, layer by layer (registry order), each layer's oldest first; with
        `table`, only those of the layers that write it ('nccl_call'): the others' maps are not read."""
        return [call for layer in self._layers if table is None or table in layer.tables
                for call in layer.in_flight()]

    def write_open_rows(self, ts: int) -> None:
        """The calls in flight at `ts` written as open rows (open = 1), left in their maps for their
        return: what a copy of the recording made now takes along (a dump, an incident)."""
        for layer in self._layers:
            layer.drain_in_flight(ts, False)

    def drop_open_rows(self) -> None:
        """The open rows write_open_rows() wrote deleted again, once the copy is made."""
        for layer in self._layers:
            layer.drop_open_rows()
