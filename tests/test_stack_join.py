"""How events meet their Python stack records (recorder/core/stacks.py StackRecorder.join), without BPF:
records are made with the layout bpf/pystack.h sends, events are plain tuples keyed by them."""

from __future__ import annotations

import struct
from types import SimpleNamespace

from recorder.core import stacks
from recorder.core.pyframes import STATUS_NO_THREAD_STATE
from recorder.core.stacks import StackRecorder


class FakeWriter:
    def __init__(self) -> None:
        self.rows: dict[str, list[tuple]] = {}

    def table(self, name: str, columns: tuple) -> None:
        self.rows.setdefault(name, [])

    def add(self, name: str, row: tuple) -> None:
        self.rows[name].append(row)

    def extend(self, name: str, rows: list) -> None:
        self.rows[name].extend(rows)


def recorder() -> StackRecorder:
    store = SimpleNamespace(one=lambda sql: {"n": 0})
    probes = SimpleNamespace(pystack=SimpleNamespace(targets={}), capabilities=[])
    return StackRecorder(store, FakeWriter(), 1, probes)


def record(ts: int, pid: int = 10, tid: int = 11, status: int = STATUS_NO_THREAD_STATE) -> bytes:
    """A pystacks record without frames: (ts, pid, tid, nframes, status, digest)."""
    return struct.pack("=QIIIIQ", ts, pid, tid, 0, status, 0)


def key(event: tuple):
    return (event[0], 10, 11) if event[0] else None


def test_events_of_one_syscall_share_its_capture() -> None:
    r = recorder()
    r.add([record(100)])
    got = list(r.join("offcpu", [(100, "wait 1"), (100, "wait 2"), (0, "preempted")], key, shared=True))
    stack_id = got[0][1]
    assert stack_id is not None
    assert got == [((100, "wait 1"), stack_id), ((100, "wait 2"), stack_id), ((0, "preempted"), None)]
    # a kworker-queued request of the same syscall, read in a later flush, still finds it
    assert list(r.join("block", [(100, "bio")], key, shared=True)) == [((100, "bio"), stack_id)]


def test_an_event_read_before_its_stack_waits_one_flush() -> None:
    r = recorder()
    assert list(r.join("marker", [(200, "step")], key)) == []  # held back
    assert r.held("marker")
    r.add([record(200)])
    (event, stack_id), = r.join("marker", [], key)
    assert event == (200, "step") and stack_id is not None
    assert not r.held("marker")
    # held once only: a record that never comes (lost in the kernel, counted there) gives None
    assert list(r.join("marker", [(300, "step")], key)) == []
    assert list(r.join("marker", [], key)) == [((300, "step"), None)]


def test_a_call_takes_its_own_stack_once() -> None:
    r = recorder()
    r.add([record(400)])
    assert list(r.join("cuda", [(400, "call")], key))[0][1] is not None
    assert r.take((400, 10, 11)) is None  # not shared: popped


def test_taken_shared_keys_are_kept_for_a_while_per_thread() -> None:
    r = recorder()
    r.add([record(1_000), record(1_000 + stacks.RECENT_NS + 1)])
    first = r.take((1_000, 10, 11), shared=True)
    assert r.take((1_000, 10, 11), shared=True) == first
    r.take((1_000 + stacks.RECENT_NS + 1, 10, 11), shared=True)
    assert r.take((1_000, 10, 11), shared=True) is None  # older than RECENT_NS before the newest


def test_stacks_are_deduplicated() -> None:
    r = recorder()
    r.add([record(500), record(501), record(502, tid=12)])
    ids = {r.take((ts, 10, tid)) for ts, tid in ((500, 11), (501, 11), (502, 12))}
    assert len(ids) == 1
    assert [row[4] for row in r.writer.rows["python_stack"]] == ["no python thread state"]


def test_known_records_are_joined_in_c_as_in_python(monkeypatch) -> None:
    """StackRecorder.add with recorder/_ingest.c's join of records seen before, and without it:
    the same joins, the same stack ids, the same capability rows."""
    if stacks._join_known_stacks is None:
        import pytest

        pytest.skip("recorder._ingest is not built")
    batches = [[record(ts, tid=11 + ts % 3) for ts in range(1_000, 1_300)],
               [record(ts, pid=20, tid=21) for ts in range(2_000, 2_100)],
               [record(ts, tid=11 + ts % 3) for ts in range(3_000, 3_050)]
               + [record(ts, pid=20, tid=21) for ts in range(3_050, 3_070)]]
    results = []
    in_c = []
    join_known = stacks._join_known_stacks

    def counted(records, *args):
        left = join_known(records, *args)
        in_c.append(len(records) - len(left))
        return left

    monkeypatch.setattr(stacks, "_join_known_stacks", counted)
    for c in (True, False):
        if not c:
            monkeypatch.setattr(stacks, "_join_known_stacks", None)
        r = recorder()
        # pid 10 a target whose capability row is not written yet, pid 20 no target
        r.walker.targets[10] = stacks.Unsupported(10, "not a CPython process")
        joins = []
        for batch in batches:
            r.add(batch)
            joins.append(dict(r._join))
            r._join.clear()
        results.append((joins, sorted(r._reported), r.writer.rows.get("python_stack"),
                        [(c.probe, c.status, c.detail, c.target) for c in r.probes.capabilities]))
    assert results[0] == results[1]
    joins = results[0][0]
    assert [len(j) for j in joins] == [300, 100, 70]
    assert len(set(joins[0].values())) == 1 and joins[2][(3_000, 10, 11)] == joins[0][(1_002, 10, 11)]
    # a batch's records seen in an earlier batch are joined in C, of a target (its capability row
    # written by then) and of a process that is none alike
    assert in_c == [0, 0, 70]
    assert results[0][3] == [("cpython frames", "absent", "not a CPython process", "pid 10")]


def test_a_hung_calls_stack_outlives_the_join_horizon() -> None:
    r = recorder()
    r.add([record(5), record(7, tid=12)])
    (stack_id,) = {r.join_keys()[(5, 10, 11)]}
    assert r.open_stack((5, 10, 11), take=False) == stack_id  # a dump peeks
    # the call never returns: past the horizon its record leaves the join, parked for its thread
    r.housekeeping(7 + stacks.PENDING_JOIN_NS + 1)
    assert r.join_keys() == {}
    assert r.open_stack((5, 10, 11), take=True) == stack_id  # the stop still finds its stack
    assert r.open_stack((6, 10, 11), take=True) is None  # another call of that thread has none
