"""The packed cuda_call path (recorder/_ingest.c + store/db/_insert.c) against the Python one, without
BPF: the same cuda_event records through the CUDA layer's row building both ways give the same rows, and
the packed writer stores exactly what executemany stores. The BPF tests (test_record_bpf.py and
the rest) exercise the packed path end to end, as it is the default where it is built."""

from __future__ import annotations

import sqlite3
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from recorder.core.identity import Identity
from recorder.core.layer import Context
from recorder.core.pyframes import STATUS_NO_THREAD_STATE
from recorder.core.stacks import StackRecorder
from recorder.layers import cuda
from recorder.layers.cuda import CUDA_COLUMNS, CudaLayer
from recorder.layers.cuda.records import CUDA, RECORDS
from store.db import Writer, open_store, packed_inserter

try:
    from recorder import _ingest  # noqa: F401
    from store.db import _insert  # noqa: F401
    BUILT = True
except ImportError:
    BUILT = False

needs_build = pytest.mark.skipif(not BUILT, reason="the C extensions are not built (no compiler at install)")

PID = 4242
API = {api.name: i for i, api in enumerate(cuda.APIS)}
NO_API = RECORDS.constants["CUDA_NO_API"]
NO_STACK = RECORDS.constants["CUDA_FLAG_NO_STACK"]


def cuda_record(ts: int, tid: int, api: str, *, size: int = 0, stream: int = 0, function: int = 0,
                pointer: int = 0, handle: int = 0, kind: int = 0, grid=(0, 0, 0), block=(0, 0, 0),
                shmem: int = 0, flags: int = 0, native: int = 7, ret: int = 0, dur: int = 1500,
                digest: int = 0, driver_api: int = NO_API) -> bytes:
    """One framed cuda_event (8-byte ring header, then the record), as the block reader gives it."""
    return bytes(8) + CUDA.pack(ts, dur, 99, ret, size, stream, function, pointer, handle,
                                       digest, PID, tid, API[api], kind, *grid, *block, shmem, flags,
                                       driver_api, 0, native)


def stack_record(ts: int, tid: int, digest: int = 0) -> bytes:
    return struct.pack("=QIIIIQ", ts, PID, tid, 0, STATUS_NO_THREAD_STATE, digest)


def session_over(db: Path, packed: bool) -> SimpleNamespace:
    """The CUDA layer over a real store, with the parts of a session it uses."""
    store = open_store(db, create=True)
    writer = Writer(store)
    identity = Identity(store, writer, 1)
    confirmed: list[int] = []  # digests the walker is told it may send instead of records
    probes = SimpleNamespace(pystack=SimpleNamespace(targets={}, confirm=confirmed.extend),
                             capabilities=[])
    stacks = StackRecorder(store, writer, 1, probes)
    stacks._native_raw[(PID, 7)] = 1  # a native stack already resolved (no map to read)
    context = Context(store, writer, 1, 0, identity, {"cuda": 0}, probes, stacks)
    layer = CudaLayer(context)
    layer.prepare()
    if not packed:
        layer._pack_cuda = None
    assert layer._pack_cuda or not packed
    return SimpleNamespace(store=store, writer=writer, stacks=stacks, confirmed=confirmed, layer=layer)


def flush(s: SimpleNamespace, cuda_records: list[bytes], stack_records: list[bytes]) -> None:
    s.stacks.add(stack_records)
    s.layer.raw.extend(cuda_records)
    s.layer.flush()
    s.writer.flush()


def calls(db: Path) -> list[tuple]:
    conn = sqlite3.connect(db)
    cols = ",".join(CUDA_COLUMNS)
    rows = conn.execute(f"SELECT {cols} FROM cuda_call ORDER BY ts").fetchall()
    conn.close()
    return rows


def workload() -> tuple[list[list[bytes]], list[list[bytes]]]:
    """Two flushes of calls: three threads (the third first seen in the second flush), every
    argument layout, a size of 2**64 - 1, a failed allocation, a call without a native stack, a
    call whose stack record comes one flush late, a fourth thread whose calls after its first
    carry their stack's digest instead of a record (one of them a digest never sent), runtime
    launches that went through the driver, and fast launches kept without stacks (a fifth thread's
    first call among them: its thread is learnt at such a record)."""
    first, second, stacks1, stacks2 = [], [], [], []
    ts = 1_000_000
    for i in range(300):
        tid = PID + i % 2
        ts += 1000
        fast = i % 4 != 0  # three in four launches are fast ones, kept without stacks
        first.append(cuda_record(ts, tid, "cudaLaunchKernel", function=0x5555_0000 + i % 3,
                                 stream=0x7F00_0000_1000, grid=(i + 1, 2, 1), block=(256, 1, 1),
                                 shmem=i % 5 * 1024, driver_api=API["cuLaunchKernel"],
                                 flags=NO_STACK if fast else 0, native=0 if fast else 7))
        if not fast:
            stacks1.append(stack_record(ts, tid))
    for _ in range(20):
        ts += 1000
        first.append(cuda_record(ts, PID + 4, "cuLaunchKernelEx", flags=NO_STACK, native=0))
    specials = [
        dict(api="cudaMalloc", size=1 << 20, pointer=0x7F12_3456_0000),
        dict(api="cudaMalloc", size=(1 << 64) - 1, pointer=0, flags=1, ret=2),  # failed, size_t -1
        dict(api="cudaFree", pointer=0x7F12_3456_0000),
        dict(api="cudaMemcpyAsync", size=4096, kind=1, stream=0x10),
        dict(api="cudaEventSynchronize", handle=0xABCDEF),
        dict(api="cudaStreamSynchronize", stream=0x20, ret=-1 & 0xFFFF_FFFF),
        dict(api="cudaDeviceSynchronize", native=0),  # no native stack (unreadable)
    ]
    for spec in specials:
        ts += 1000
        first.append(cuda_record(ts, PID, **spec))
        stacks1.append(stack_record(ts, PID))
    ts += 1000
    late = ts
    first.append(cuda_record(late, PID + 1, "cudaDeviceSynchronize"))  # its stack record: next flush
    stacks2.append(stack_record(late, PID + 1))
    for _ in range(100):
        ts += 1000
        second.append(cuda_record(ts, PID + 2, "cuLaunchKernel", function=0x99, grid=(7, 7, 7),
                                  block=(32, 32, 1)))
        stacks2.append(stack_record(ts, PID + 2))
    ts += 1000
    first.append(cuda_record(ts, PID + 3, "cudaMalloc", size=64))  # sends its stack (digest D)
    stacks1.append(stack_record(ts, PID + 3, DIGEST))
    for batch in (first, second):
        for _ in range(50):
            ts += 1000
            batch.append(cuda_record(ts, PID + 3, "cudaMalloc", size=64, digest=DIGEST))
    ts += 1000
    second.append(cuda_record(ts, PID + 3, "cudaFree", digest=UNSENT))
    return [first, second], [stacks1, stacks2]


DIGEST, UNSENT = 0x1234_5678_9ABC_DEF1, 0x0BAD_0000_0000_0001


@needs_build
def test_packed_rows_equal_the_python_rows(tmp_path: Path) -> None:
    batches, stack_batches = workload()
    got = {}
    packed_rows = []
    for packed in (False, True):
        db = tmp_path / f"packed_{packed}.db"
        s = session_over(db, packed)
        extend = s.writer.extend_packed
        s.writer.extend_packed = lambda name, data, extend=extend: (
            packed_rows.append(len(data) // ((len(CUDA_COLUMNS) + 5) * 8)), extend(name, data))
        for records, stacks in zip(batches, stack_batches, strict=True):
            flush(s, records, stacks)
        s.stacks._final = True
        flush(s, [], [])
        s.store.close()
        got[packed] = calls(db)
        assert s.confirmed == [DIGEST]  # the stack resolved for good is confirmed to the walker
    assert len(got[False]) == sum(map(len, batches))
    assert got[True] == got[False]
    # all but the call without a native stack, the one whose stack record came late and the one
    # with a digest never sent were packed
    assert sum(packed_rows) == len(got[True]) - 3
    by_digest = [row for row in got[True] if row[3] == got[True][-1][3]]  # the fourth thread
    assert len(by_digest) == 102 and len({row[17] for row in by_digest[:-1]}) == 1
    assert by_digest[-1][4] == API["cudaFree"] and by_digest[-1][17] is None  # UNSENT: no stack
    by_api = {(row[4], row[6]): row for row in got[True]}
    failed = by_api[(API["cudaMalloc"], -1)]
    assert failed[7] == 64 and failed[10] is None  # size class of 2**64 - 1; no pointer: it failed
    launch = next(row for row in got[True] if row[4] == API["cudaLaunchKernel"])
    assert launch[13:16] == ("1,2,1", "256,1,1", 0) and launch[6] is None
    assert launch[19] == API["cuLaunchKernel"]  # the driver API it went through
    assert {row[19] for row in got[True] if row[4] != API["cudaLaunchKernel"]} == {None}
    # every call has its stack, the late one too, but the one whose digest was never sent and the
    # fast launches kept without (225 of the first 300, and the fifth thread's 20)
    fast = [row for row in got[True] if row[4] in (API["cudaLaunchKernel"], API["cuLaunchKernelEx"])
            and row[17] is None]
    assert len(fast) == 245 and all(row[18] is None for row in fast)
    assert sum(row[17] is None for row in got[True]) == 1 + 245
    assert sum(row[18] is None for row in got[True]) == 1 + 245  # and the call without a native stack
    assert not s.stacks.native_errors.get("native stack not walked", 0) > 1  # fast launches are no miss


@needs_build
def test_packed_writer_stores_what_executemany_stores(tmp_path: Path) -> None:
    rows = []
    for i in range(1234):  # more than one statement's worth, not a multiple of it
        nulls = (i % 3 == 0, i % 5 == 0)
        rows.append((1, i, -i, None if nulls[0] else (1 << 63) - 1 - i,
                     None if nulls[1] else f"{i},{i + 1},{(1 << 32) - 1}", i * 7))
    slots = []
    for r in rows:
        x = tuple(map(int, r[4].split(","))) if r[4] else (0, 0, 0)
        mask = (1 << 3 if r[3] is None else 0) | (1 << 4 if r[4] is None else 0)
        slots.append(struct.pack("=9q", r[0], r[1], r[2], r[3] or 0, *(v - (1 << 32) if v >= 1 << 31
                                                                         else v for v in x), r[5], mask))
    stored = {}
    for packed in (False, True):
        store = open_store(tmp_path / f"w_{packed}.db", create=True)
        store.conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, a, b, c, d, e, f)")
        w = Writer(store, background=True)
        w.table("t", ("a", "b", "c", "d", "e", "f"))
        if packed:
            w.packed_table("t", "iiiidi")
            w.extend_packed("t", b"".join(slots[:1000]))
            w.extend_packed("t", b"".join(slots[1000:]))
            assert w.pending() == len(rows)
        else:
            w.extend("t", rows)
        assert w.flush() == len(rows)
        w.close()
        stored[packed] = store.conn.execute("SELECT a, b, c, d, e, f FROM t ORDER BY id").fetchall()
        store.close()
    assert stored[True] == stored[False] == rows


@needs_build
def test_a_packed_batch_that_does_not_fit_the_program_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path / "bad.db", create=True)
    store.conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, a, b)")
    w = Writer(store)
    w.table("t", ("a", "b"))
    with pytest.raises(ValueError, match="columns"):
        w.packed_table("t", "iii")
    w.packed_table("t", "ii")
    w.extend_packed("t", struct.pack("=3q", 1, 2, 0) + b"\0" * 8)  # a row and a stray word
    with pytest.raises(ValueError, match="do not match"):
        w.flush()
    store.close()


def test_without_the_extensions_there_is_no_packed_writer(tmp_path: Path, monkeypatch) -> None:
    import store.db as store_package

    monkeypatch.setitem(sys.modules, "store.db._insert", None)  # import fails, as when not built
    monkeypatch.delattr(store_package, "_insert", raising=False)
    store = open_store(tmp_path / "plain.db", create=True)
    assert packed_inserter(store) is None
    assert not Writer(store).packs
    store.close()


@needs_build
def test_a_read_only_store_gets_no_packed_writer(tmp_path: Path) -> None:
    open_store(tmp_path / "ro.db", create=True).close()
    store = open_store(tmp_path / "ro.db", readonly=True)
    assert packed_inserter(store) is None
    store.close()
