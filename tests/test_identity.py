"""Thread identities across exits (recorder/core/identity.py): a thread that exited keeps its row for
events read after the exit, and a tid used again by a new thread gets a new row. No BPF: the
identities are written through the real Writer into a real store."""

from __future__ import annotations

import os

from recorder.core.identity import DEPARTED_NS, Identity
from store.db import Writer, open_store


def _identity(tmp_path):
    s = open_store(tmp_path / "ident.db", create=True)
    sid = s.db["session"].insert({
        "started_ts": 0, "stopped_ts": 10_000, "wall_offset_ns": 0, "status": "complete", "recorder_pid": 1,
        "hostname": "h", "kernel_release": "k", "boot_id": "b", "cpu_count": 2, "target": "synthetic",
        "command": "test", "tool_version": "test"}).last_pk
    writer = Writer(s)
    return s, writer, Identity(s, writer, sid)


def test_an_exited_thread_keeps_its_row_until_its_tid_is_used_again(tmp_path):
    s, writer, ident = _identity(tmp_path)
    pid = os.getpid()
    tid = 4_000_001  # above any live tid here: the row's name comes from the event
    first = ident.thread_forked(tid, pid, 1_000)
    ident.thread_exited(tid, pid, 2_000)
    # read after the exit: as the waker of another thread's interval, and as its own late row
    assert ident.thread(tid, None, b"worker", 2_100, traced=False) == first
    assert ident.thread(tid, pid, b"worker", 1_900) == first
    # the same tid, long after the exit without a fork seen: another thread
    later = ident.thread(tid, None, b"other", 2_000 + DEPARTED_NS + 1, traced=False)
    assert later != first
    # a fork that reuses the tid is a new thread at once
    ident.thread_exited(tid, pid, 3_000 + DEPARTED_NS)
    reused = ident.thread_forked(tid, pid, 3_001 + DEPARTED_NS)
    assert reused not in (first, later)
    ident.flush_exits()
    writer.flush()
    rows = s.conn.execute("SELECT id, tid, exit_ts FROM thread ORDER BY id").fetchall()
    assert [tuple(r) for r in rows] == [(first, tid, 2_000), (later, tid, 3_000 + DEPARTED_NS), (reused, tid, None)]
