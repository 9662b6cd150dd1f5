"""The session's handle (recorder/core/participant.py): what its participants learn of the calls in
flight comes from the layers' own hooks (Layer.in_flight(), drain_in_flight(), drop_open_rows()), in
registry order, and the flight recorder's hung-call trigger fires from that answer alone. The layers
here are stand-ins implementing the contract; the real CUDA layer's answer, from its BPF map, is
tests/test_flight_bpf.py's hung-call incident."""

from __future__ import annotations

from pathlib import Path

from recorder.core.clock import now_ns
from recorder.core.inflight import CallInFlight
from recorder.core.layer import BaseLayer, Layer
from recorder.core.participant import SessionHandle
from recorder.flight import FlightOptions
from recorder.flight.triggers import Triggers
from store.db import Writer, open_store

S = 1_000_000_000


class Holding(BaseLayer):
    """A layer holding calls in flight, noting what it was asked."""

    def __init__(self, name: str, table: str, calls: tuple[CallInFlight, ...]) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # uses nothing of a context
        self.name, self.tables, self.calls = name, (table,), calls
        self.asked: list[str] = []

    def in_flight(self) -> tuple[CallInFlight, ...]:
        self.asked.append("in_flight")
        return self.calls

    def drain_in_flight(self, ts: int, final: bool) -> int:
        self.asked.append(f"drain {ts} final={final}")
        return len(self.calls)

    def drop_open_rows(self) -> None:
        self.asked.append("drop")


def _recording(path: Path) -> tuple:
    store = open_store(path, create=True)
    sid = store.db["session"].insert({
        "started_ts": 0, "wall_offset_ns": 0, "status": "recording", "recorder_pid": 1, "hostname": "h",
        "kernel_release": "k", "boot_id": "b", "cpu_count": 1, "target": "t", "command": "c",
        "tool_version": "0"}).last_pk
    store.conn.commit()
    return store, sid


def test_the_handle_asks_the_layers_what_is_in_flight(tmp_path):
    store, sid = _recording(tmp_path / "h.db")
    cuda = Holding("cuda", "cuda_call", (CallInFlight("cuda_call", "cudaStreamSynchronize", 10, 11, 5 * S),))
    nccl = Holding("workload", "nccl_call", (CallInFlight("nccl_call", "ncclAllReduce", 10, 12, 3 * S),
                                             CallInFlight("nccl_call", "ncclBroadcast", 20, 21, 4 * S)))
    quiet = BaseLayer(None)  # type: ignore[arg-type]  # a layer with nothing in flight: the contract's defaults
    layers: list[Layer] = [cuda, quiet, nccl]  # type: ignore[list-item]  # BaseLayer's name is a plain str
    handle = SessionHandle(store.path, sid, 0, Writer(store), layers)
    assert [(c.api, c.pid, c.tid, c.ts) for c in handle.in_flight()] == [
        ("cudaStreamSynchronize", 10, 11, 5 * S), ("ncclAllReduce", 10, 12, 3 * S), ("ncclBroadcast", 20, 21, 4 * S)]
    cuda.asked.clear()
    assert [c.api for c in handle.in_flight("nccl_call")] == ["ncclAllReduce", "ncclBroadcast"]
    assert cuda.asked == []  # a layer that writes no such table is not asked (its map is not read)
    nccl.asked.clear()
    handle.write_open_rows(7 * S)  # a copy's open rows: the calls stay in their maps for their return
    handle.drop_open_rows()
    assert cuda.asked == nccl.asked == [f"drain {7 * S} final=False", "drop"]
    store.close()


def test_the_hung_call_trigger_fires_from_the_layers_answer(tmp_path):
    """A call in flight past --hang fires once, named as its layer names it; a younger one does not."""
    store, sid = _recording(tmp_path / "t.db")
    now = now_ns()
    calls = (CallInFlight("cuda_call", "cudaStreamSynchronize", 10, 11, now - 3 * S),
             CallInFlight("cuda_call", "cudaMalloc", 10, 12, now - S))
    handle = SessionHandle(store.path, sid, 0, Writer(store), [Holding("cuda", "cuda_call", calls)])  # type: ignore[list-item]
    fired: list[tuple[str, int, str]] = []
    triggers = Triggers(FlightOptions(keep_ns=60 * S, hang_ns=2 * S, triggers=frozenset({"hung-call"})),
                        lambda trigger, ts, detail: fired.append((trigger, ts, detail)))
    monitor = handle.connect()
    triggers.start(handle, monitor, 0)
    triggers.watch(now)
    triggers.watch(now + S // 2)  # the same call, seen already
    assert fired == [("hung-call", now, "cudaStreamSynchronize in flight for 3.0 s on thread 11 (--hang 2s)")]
    monitor.close()
    store.close()
