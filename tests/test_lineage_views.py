"""The step and lineage views (store/views/0006_inferred_lineage.sql) on a real SQLite file with
known markers: which step and tag each block request, CUDA call and NCCL call gets, at the edges
(before the first step, nested and restored scopes, other threads, other processes, kernel
threads, the patch series' io_tag), and that they stay index lookups. The same views on a real BPF
recording are in tests/test_lineage_bpf.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import recorder
from recorder.core.identity import Identity
from recorder.core.int64 import signed64
from recorder.core.layer import Context
from recorder.layers.io.layer import IoLayer
from recorder.layers.io.records import BLOCK, RECORDS
from store.db import Writer, open_store

LABELS = {11: "checkpoint_write/run42/step7/shard3", 22: "eval/run42", -5: "\\xff not utf-8"}


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(tmp_path / "v.db", create=True)
    for n in (1, 2):  # a second session: its marks must not leak into the first
        s.db["session"].insert({
            "started_ts": 0, "stopped_ts": 10_000, "wall_offset_ns": 0, "status": "complete",
            "recorder_pid": 1, "hostname": "h", "kernel_release": "k", "boot_id": "b", "cpu_count": 2,
            "target": "synthetic", "command": f"test {n}", "tool_version": "test"})
    s.conn.execute("INSERT INTO cuda_api (id, name, family, library, arguments)"
                   " VALUES (0, 'cudaMalloc', 'cudaMalloc', 'runtime', 'malloc')")
    s.conn.execute("INSERT INTO nccl_api (id, name, kind) VALUES (0, 'ncclAllReduce', 'collective')")
    s.conn.executemany("INSERT INTO process (id, session_id, pid, first_ts) VALUES (?, ?, ?, 0)",
                       [(1, 1, 100), (2, 1, 200), (3, 1, 2), (4, 2, 100)])
    # process 1: the training thread 1 (steps), a checkpoint thread 2 (lineage), a loader thread 3;
    # process 2 has no steps; thread 4 is a kworker; thread 5 is process 4 in session 2
    s.conn.executemany("INSERT INTO thread (id, session_id, tid, process_id, first_ts) VALUES (?, ?, ?, ?, 0)",
                       [(1, 1, 100, 1), (2, 1, 101, 1), (3, 1, 102, 1), (6, 1, 200, 2), (4, 1, 30, 3),
                        (5, 2, 100, 4)])
    s.conn.executemany("INSERT INTO step_mark (session_id, ts, thread_id, step, inferred) VALUES (?, ?, ?, ?, ?)",
                       [(1, 1000, 1, 7, 0), (1, 2000, 1, 8, 0), (1, 3000, 1, 9, 0), (2, 500, 5, 99, 1)])
    s.conn.executemany("INSERT INTO lineage_mark (session_id, ts, thread_id, tag) VALUES (1, ?, ?, ?)",
                       [(1100, 2, 11), (1200, 2, 22), (1300, 2, 11), (1400, 2, 0),  # nested, then left
                        (2500, 2, -5)])
    s.conn.executemany("INSERT INTO lineage_label (session_id, tag, label) VALUES (1, ?, ?)", LABELS.items())
    s.conn.commit()
    s.build_indexes()
    yield s
    s.close()


def block(s, ts: int, thread_id: int | None, kind: str = "target", io_tag: int | None = None) -> int:
    return s.db["block_request"].insert({
        "session_id": 1, "ts": ts, "dur": 50, "thread_id": thread_id, "submitter_kind": kind, "device": "loop0",
        "dev_major": 7, "dev_minor": 0, "sector": 0, "size_bytes": 4096, "op": "write", "rwbs": "WS", "sync": 1,
        "metadata": 0, "fua": 0, "readahead": 0, "preflush": 0, "bio_queue_ts": ts, "complete_ts": ts + 50,
        "error": 0, "requeues": 0, "merges": 0, "io_tag": io_tag}).last_pk


def test_block_requests_get_their_process_step_and_thread_tag(store):
    cases = {
        block(store, 900, 2): (None, None, None, None),            # before the process's first step
        block(store, 1150, 2): (7, 11, LABELS[11], "thread"),      # in the outer scope, step 7
        block(store, 1250, 2): (7, 22, LABELS[22], "thread"),      # nested scope
        block(store, 1300, 2): (7, 11, LABELS[11], "thread"),      # back in the outer one (same ts as the mark)
        block(store, 1500, 2): (7, None, None, None),              # scope left: tag 0 is no tag
        block(store, 2100, 3): (8, None, None, None),              # another thread of the process: its step
        block(store, 2600, 2, "target_deferred"): (8, -5, LABELS[-5], "thread"),  # throttled: the target's tag
        block(store, 3500, 6): (None, None, None, None),           # a process without steps
        block(store, 3600, 4, "kernel_thread"): (None, None, None, None),  # writeback, no patch
        block(store, 3700, 4, "kernel_thread", io_tag=22): (None, 22, LABELS[22], "io_tag"),  # with it
        block(store, 3800, None, "kernel_thread", io_tag=33): (None, 33, None, "io_tag"),  # unknown label
        block(store, 1150, 2, io_tag=22): (7, 22, LABELS[22], "io_tag"),  # the kernel's tag wins
    }
    got = {r[0]: r[1:] for r in store.conn.execute(
        "SELECT block_request_id, step, tag, label, tag_source FROM block_request_lineage")}
    assert got == cases
    row = store.one("SELECT step_inferred, step_mark_id, process_id FROM block_request_lineage"
                    " WHERE block_request_id = ?", (list(cases)[1],))
    assert row == {"step_inferred": 0, "step_mark_id": 1, "process_id": 1}


def test_cuda_and_nccl_calls_get_step_and_tag(store):
    rows = [(1, 1150, 2), (1, 2050, 1), (1, 3500, 6), (2, 600, 5)]
    store.conn.executemany("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, cgroup_id)"
                           " VALUES (?, ?, 10, ?, 0, 0, 0)", rows)
    store.conn.executemany("INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, cgroup_id)"
                           " VALUES (?, ?, 10, ?, 0, 0, 0)", rows)
    expected = [(1150, 7, 0, 11, LABELS[11]), (2050, 8, 0, None, None), (3500, None, None, None, None),
                (600, 99, 1, None, None)]
    for view in ("cuda_call_lineage", "nccl_call_lineage"):
        got = store.conn.execute(f"SELECT ts, step, step_inferred, tag, label FROM {view} ORDER BY session_id, ts")
        assert got.fetchall() == expected, view
    assert store.one("SELECT api FROM cuda_call_lineage LIMIT 1") == {"api": "cudaMalloc"}
    assert store.one("SELECT api FROM nccl_call_lineage LIMIT 1") == {"api": "ncclAllReduce"}


@pytest.mark.parametrize("view,event_id", [("block_request_lineage", "block_request_id"),
                                           ("cuda_call_lineage", "cuda_call_id"),
                                           ("nccl_call_lineage", "nccl_call_id")])
def test_markers_are_found_through_indexes(store, view, event_id):
    """One event costs index seeks, not a scan of the markers or a sort of them."""
    plan = [r[3] for r in store.conn.execute(f"EXPLAIN QUERY PLAN SELECT * FROM {view} WHERE {event_id} = 1")]
    text = "\n".join(plan)
    assert "USING INDEX step_mark_session_ts (session_id=? AND ts<?)" in text, text
    assert "USING COVERING INDEX lineage_mark_thread_ts (thread_id=? AND ts<?)" in text, text
    assert "TEMP B-TREE" not in text, text
    # the scans allowed: the list of processes with steps (built once per query) and, in this
    # database of one API each, the API names
    scans = [p for p in plan if p.startswith("SCAN")]
    assert all(p.startswith(("SCAN m USING COVERING INDEX step_mark", "SCAN a ")) for p in scans), plan


def test_io_tag_from_the_kernel_is_stored_signed_and_finds_its_label(tmp_path):
    """A request completed with the patch series' io_tag in block_rq_complete carries the 64-bit tag the
    task set: stored like the markers' tags (two's complement), so half of all tags neither
    overflow SQLite's integer nor miss their label."""
    label = next(f"shard{i}" for i in range(100) if recorder.tag_of(f"shard{i}") >= 1 << 63)
    tag = recorder.tag_of(label)
    s = open_store(tmp_path / "io.db", create=True)
    sid = s.db["session"].insert({
        "started_ts": 0, "stopped_ts": 10_000, "wall_offset_ns": 0, "status": "complete", "recorder_pid": 1,
        "hostname": "h", "kernel_release": "k", "boot_id": "b", "cpu_count": 2, "target": "synthetic",
        "command": "test", "tool_version": "test"}).last_pk
    s.conn.execute("INSERT INTO lineage_label (session_id, tag, label) VALUES (?, ?, ?)", (sid, signed64(tag), label))
    writer = Writer(s)
    io = IoLayer(Context(s, writer, sid, 0, Identity(s, writer, sid), {}))
    io.prepare()
    record = {name: b"" if ctype.startswith("char") else 0 for name, ctype in BLOCK.fields}
    record.update(ts=1000, bio_queue_ts=1000, issue_ts=1100, complete_ts=1500, io_tag=tag, dev=(7 << 20) | 99,
                  nr_bytes=4096, pid=os.getpid(), tid=os.getpid(), flags=RECORDS.constants["BLOCK_FLAG_AI"],
                  rwbs=b"W", comm=b"python")
    io.sinks()["block_events"](BLOCK.pack(*record.values()))
    io.flush()
    writer.close()
    row = s.one("SELECT tag, tag_source, label FROM block_request_lineage")
    assert row == {"tag": signed64(tag), "tag_source": "io_tag", "label": label}
    s.close()
