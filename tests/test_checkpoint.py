"""Checkpoint integrity without BPF: hashing, the stat at the stop, and the checkpoint layer fed with
the records bpf/checkpoint.bpf.c sends (real files in a temporary folder, a real store, BPF maps
faked), judged by the checkpoint_integrity view. tests/test_checkpoint_bpf.py does it for real."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from recorder.core.identity import Identity
from recorder.core.layer import Context
from recorder.layers.checkpoint import (
    CKPT_IO,
    CKPT_OPEN,
    CKPT_RENAME,
    CKPT_SCOPE,
    RECORDS,
    XATTR,
    CheckpointLayer,
    Hasher,
    HashJob,
    hash_file,
    now_ns,
    render_verification,
    stat_again,
    verify_checkpoints,
)
from store.db import Writer, open_store
from store.errors import StoreError

C = RECORDS.constants
O_WRONLY_CREAT_TRUNC = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def test_hash_file_states(tmp_path):
    data = os.urandom(3 * (1 << 20) + 5)
    path = tmp_path / "a.pt"
    path.write_bytes(data)
    v = hash_file(str(path))
    st = path.stat()
    assert (v.state, v.sha256, v.size_bytes, v.ino, v.mtime_ns) == (
        "hashed", hashlib.sha256(data).hexdigest(), len(data), st.st_ino, st.st_mtime_ns)
    assert abs(v.mtime_ts - (st.st_mtime_ns - time.time_ns() + time.monotonic_ns())) < 1_000_000_000
    assert hash_file(str(tmp_path / "gone.pt")).state == "missing"
    assert hash_file(str(tmp_path / "no" / "folder.pt")).state == "missing"
    assert hash_file(str(tmp_path)).state == "not_regular"
    assert hash_file(None).state == "replaced"
    replaced = hash_file(str(path), expected_ino=st.st_ino + 1)
    assert (replaced.state, replaced.sha256) == ("replaced", None)
    cancel = threading.Event()
    cancel.set()
    assert hash_file(str(path), cancel=cancel).state == "not_hashed"


def test_stat_again_states(tmp_path):
    path = tmp_path / "a.pt"
    path.write_bytes(b"x" * 10)
    st = path.stat()
    assert stat_again(str(path), st.st_ino, 10, st.st_mtime_ns).state == "unchanged"
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    changed = stat_again(str(path), st.st_ino, 10, st.st_mtime_ns)
    assert (changed.state, changed.detail) == ("changed", "mtime differ")
    other = tmp_path / "b.pt"
    other.write_bytes(b"y")
    other.replace(path)
    assert stat_again(str(path), st.st_ino, 10, st.st_mtime_ns).state == "replaced"
    path.unlink()
    assert stat_again(str(path), st.st_ino, 10, st.st_mtime_ns).state == "missing"


def test_hasher_thread_hashes_in_order_and_stops(tmp_path):
    files = []
    for i in range(5):
        p = tmp_path / f"{i}.pt"
        p.write_bytes(bytes([i]) * 1000)
        files.append(p)
    h = Hasher(max_queued=2)
    handed = [HashJob(i, str(p), None, "completed") for i, p in enumerate(files)]
    waiting = list(handed)
    results = []
    deadline = time.monotonic() + 10
    while len(results) < len(files) and time.monotonic() < deadline:
        while waiting and h.offer(waiting[0]):
            waiting.pop(0)
        try:
            results.append(h.results.get(timeout=0.05))
        except Exception:
            pass
    assert [job.file_id for job, _ in results] == [0, 1, 2, 3, 4]
    assert all(v.sha256 == hashlib.sha256(bytes([i]) * 1000).hexdigest() for i, (_, v) in enumerate(results))
    while not h.idle() and time.monotonic() < deadline:  # its last task_done follows its last result
        time.sleep(0.01)
    assert h.idle()
    h.stop(timeout_s=2)
    assert not h.thread.is_alive()


# -- the layer, fed by hand ------------------------------------------------------------------------
class _Key:
    pass


class _Table(dict):
    """A BCC table as the layer uses it: Key(), and ctypes integers as keys."""

    def Key(self):  # noqa: N802 - BCC's name
        return _Key()

    def __delitem__(self, key) -> None:
        super().__delitem__(getattr(key, "value", key))


class FakeProbes:
    """What the layer uses of recorder.core.loader.Probes: its maps, uprobe attachment, capabilities."""

    def __init__(self) -> None:
        self.layers = ["checkpoint"]
        self.tables = {name: _Table() for name in ("ckpt_verdict", "ckpt_fds", "ckpt_scope")}
        self.uprobes: list[tuple[str, str, str]] = []
        self.caps: list[tuple] = []
        self.bpf = self

    def __getitem__(self, name: str) -> _Table:
        return self.tables[name]

    def attach_uprobe(self, name: str, sym: str, fn_name: str) -> None:
        self.uprobes.append((name, sym, fn_name))

    def cap(self, *cap) -> None:
        self.caps.append(cap)

    def verdicts(self) -> dict[tuple[int, int], int]:
        return {(k.tgid, k.fd): v.value for k, v in self.tables["ckpt_verdict"].items()}


class Feed:
    """A session around a CheckpointLayer, and the records the BPF side would send it."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = open_store(tmp_path / "c.db", create=True)
        self.sid = self.store.db["session"].insert({
            "started_ts": now_ns(), "wall_offset_ns": time.time_ns() - now_ns(), "status": "recording",
            "recorder_pid": os.getpid(), "hostname": "h", "kernel_release": "k", "boot_id": "b", "cpu_count": 2,
            "target": "test", "command": "test", "tool_version": "t"}).last_pk
        self.writer = Writer(self.store)
        self.identity = Identity(self.store, self.writer, self.sid)
        self.probes = FakeProbes()
        context = Context(self.store, self.writer, self.sid, 0, self.identity, {}, self.probes)
        self.layer = CheckpointLayer(context)
        self.layer.prepare()
        self.layer.attach()
        self.sink = self.layer.sinks()["checkpoint_events"]
        self.next_id = 1000
        self.last_end = 0

    def clock(self, dur: int) -> int:
        """ts of a syscall of `dur` ns entered now, after the previous one returned (as on one thread)."""
        ts = max(now_ns(), self.last_end + 1)
        self.last_end = ts + dur
        return ts

    def scope(self, pid: int, tid: int, phase: int, path: Path, tag: int = 0) -> None:
        raw = os.fsencode(path)
        self.sink(CKPT_SCOPE.pack(self.clock(0), phase, tag, 0, len(raw), pid, tid, raw))

    def open(self, pid: int, tid: int, fd: int, path: str | Path, in_scope: bool,
             flags: int = O_WRONLY_CREAT_TRUNC, dirfd: int = -100) -> int:
        self.next_id += 1
        self.sink(CKPT_OPEN.pack(self.clock(1000), 1000, self.next_id, flags, pid, tid, fd, dirfd,
                                        int(in_scope), 0, os.fsencode(path)))
        return self.next_id

    def io(self, pid: int, tid: int, fd: int, open_id: int, op: str, offset: int = 0, count: int = 0,
           ret: int = 0) -> None:
        self.sink(CKPT_IO.pack(self.clock(2000), 2000, open_id, offset, count, ret, pid, tid, fd,
                                      C[f"CKPT_OP_{op.upper()}"]))

    def rename(self, pid: int, tid: int, old: Path, new: Path, ret: int = 0) -> None:
        self.sink(CKPT_RENAME.pack(self.clock(3000), 3000, ret, pid, tid, -100, -100, 0, 0, os.fsencode(old),
                                          os.fsencode(new)))

    def flush(self) -> None:
        self.layer.flush()
        self.writer.flush()

    def finish(self) -> None:
        self.layer.close(0)
        self.identity.flush_exits()
        self.writer.close()

    def integrity(self) -> dict[str, dict]:
        return {r["final_path"]: r for r in self.store.query("SELECT * FROM checkpoint_integrity")}


def write_chunks(feed: Feed, pid: int, tid: int, fd: int, open_id: int, path: Path, parts: list[bytes],
                 syscall: str = "write") -> None:
    """Write the parts to path for real, and tell the layer, one record per write."""
    offset = 0
    with open(path, "r+b") as f:
        for part in parts:
            f.seek(offset)
            f.write(part)
            f.flush()
            feed.io(pid, tid, fd, open_id, syscall, offset, len(part), len(part))
            offset += len(part)


@pytest.fixture
def feed(tmp_path):
    f = Feed(tmp_path)
    yield f
    f.store.close()


def test_marker_scope_checkpoint_verifies_and_follows_its_rename(feed, tmp_path):
    pid, tid = os.getpid(), os.getpid()
    final, tmp = tmp_path / "step10.pt", tmp_path / "step10.pt.tmp"
    parts = [os.urandom(4096) for _ in range(4)]
    feed.scope(pid, tid, 1, final, tag=42)
    tmp.write_bytes(b"")
    oid = feed.open(pid, tid, 5, tmp, in_scope=True)
    write_chunks(feed, pid, tid, 5, oid, tmp, parts)
    feed.flush()  # a flush in the middle of the write changes nothing
    feed.io(pid, tid, 5, oid, "fsync")
    feed.io(pid, tid, 5, oid, "close")
    tmp.replace(final)
    feed.rename(pid, tid, tmp, final)
    feed.scope(pid, tid, 2, final, tag=42)
    feed.flush()
    feed.finish()
    row = feed.integrity()[str(final)]
    assert (row["status"], row["reasons"], row["opted_by"], row["scope_path"], row["tag"]) == (
        "verified", None, "marker_scope", str(final), 42)
    assert (row["sha256"], row["size_bytes"], row["writes"]) == (hashlib.sha256(b"".join(parts)).hexdigest(),
                                                               16384, 4)
    assert row["path"] == str(tmp) and row["complete_ts"] is not None
    assert feed.probes.verdicts() == {}  # decided in BPF: nothing to tell it


def test_files_outside_scopes_are_classified_and_their_early_writes_kept(feed, tmp_path):
    pid, tid = os.getpid(), os.getpid()
    marked, plain = tmp_path / "marked.bin", tmp_path / "log.txt"
    marked.write_bytes(b"")
    os.setxattr(marked, XATTR, b"1")
    plain.write_bytes(b"")
    m = feed.open(pid, tid, 7, marked, in_scope=False)
    p = feed.open(pid, tid, 8, os.path.relpath(plain), in_scope=False)  # relative to the cwd
    write_chunks(feed, pid, tid, 7, m, marked, [b"a" * 100, b"b" * 100])  # before any verdict
    write_chunks(feed, pid, tid, 8, p, plain, [b"log line\n"])
    feed.flush()
    assert feed.probes.verdicts() == {(pid, 7): C["CKPT_OPTED"], (pid, 8): C["CKPT_IGNORED"]}
    feed.io(pid, tid, 7, m, "fdatasync")
    feed.io(pid, tid, 7, m, "close")
    feed.io(pid, tid, 8, p, "close")
    feed.flush()
    feed.finish()
    rows = feed.integrity()
    assert list(rows) == [str(marked)]
    row = rows[str(marked)]
    assert (row["status"], row["opted_by"], row["writes"], row["size_bytes"]) == ("verified", "xattr", 2, 200)
    assert feed.store.query("SELECT op FROM checkpoint_op ORDER BY ts") == [
        {"op": "open"}, {"op": "fdatasync"}, {"op": "close"}]


def test_scope_path_opened_by_another_thread_and_a_folder_rename(feed, tmp_path):
    """A helper thread writes the scope's file into step.tmp/, then the folder is renamed to step/."""
    pid, main, helper = os.getpid(), os.getpid(), os.getpid() + 1
    staging, done = tmp_path / "step.tmp", tmp_path / "step"
    staging.mkdir()
    shard = staging / "shard0.pt"
    shard.write_bytes(b"")
    feed.scope(pid, main, 1, shard)
    oid = feed.open(pid, helper, 9, shard, in_scope=False)
    write_chunks(feed, pid, helper, 9, oid, shard, [b"z" * 5000])
    feed.io(pid, helper, 9, oid, "fsync")
    feed.io(pid, helper, 9, oid, "close")
    feed.flush()
    staging.rename(done)
    feed.rename(pid, main, staging, done)
    feed.scope(pid, main, 2, shard)
    feed.flush()
    feed.finish()
    row = feed.integrity()[str(done / "shard0.pt")]
    assert (row["status"], row["opted_by"], row["scope_path"], row["size_bytes"]) == (
        "verified", "marker_path", str(shard), 5000)


def test_killed_writer_gap_and_missing_file(feed, tmp_path):
    pid, tid = os.getpid(), os.getpid()
    gone_pid = 4_000_000  # a writer that no longer exists
    killed, gap, vanished = tmp_path / "killed.pt", tmp_path / "gap.pt", tmp_path / "vanished.pt"
    for p in (killed, gap, vanished):
        p.write_bytes(b"")
    feed.scope(gone_pid, gone_pid, 1, killed)
    k = feed.open(gone_pid, gone_pid, 3, killed, in_scope=True)
    write_chunks(feed, gone_pid, gone_pid, 3, k, killed, [b"k" * 300] * 3)
    feed.scope(pid, tid, 1, gap)
    g = feed.open(pid, tid, 4, gap, in_scope=True)
    with open(gap, "r+b") as f:
        f.write(b"0" * 100)
        f.seek(200)
        f.write(b"2" * 100)
    feed.io(pid, tid, 4, g, "pwrite64", 0, 100, 100)
    feed.io(pid, tid, 4, g, "pwrite64", 200, 100, 100)
    feed.io(pid, tid, 4, g, "fsync")
    feed.io(pid, tid, 4, g, "close")
    feed.scope(pid, tid, 2, gap)
    feed.scope(pid, tid, 1, vanished)
    v = feed.open(pid, tid, 6, vanished, in_scope=True)
    write_chunks(feed, pid, tid, 6, v, vanished, [b"v" * 10])
    feed.io(pid, tid, 6, v, "fsync")
    feed.io(pid, tid, 6, v, "close")
    vanished.unlink()
    feed.scope(pid, tid, 2, vanished)
    feed.flush()
    # the writer's process ends: the identity layer records the exit, the layer is told
    process_id = feed.identity.process(gone_pid, now_ns())
    feed.writer.execute("UPDATE process SET exit_ts = ? WHERE id = ?", (now_ns(), process_id))
    feed.layer.process_exited(gone_pid, now_ns())
    feed.flush()
    feed.flush()
    feed.finish()
    rows = feed.integrity()
    assert (rows[str(killed)]["status"], rows[str(killed)]["reasons"]) == ("incomplete", "no_fsync,writer_died")
    assert rows[str(killed)]["size_bytes"] == 900
    assert (rows[str(gap)]["status"], rows[str(gap)]["reasons"], rows[str(gap)]["first_gap_offset"]) == (
        "incomplete", "gap", 100)
    assert (rows[str(vanished)]["status"], rows[str(vanished)]["reasons"]) == ("missing", "missing")
    verify = feed.store.query("SELECT trigger, state FROM checkpoint_verify v JOIN checkpoint_file f"
                              " ON f.id = v.file_id WHERE f.path = ? ORDER BY v.id", (str(killed),))
    assert verify == [{"trigger": "writer_exited", "state": "hashed"},
                      {"trigger": "session_stop", "state": "unchanged"}]


def test_rewrites_supersession_and_late_modification(feed, tmp_path):
    """latest.pt saved twice by tmp + rename (the first is superseded, not changed); then written in
    place outside any scope (a rewrite: changed); other.pt modified on disk before it was hashed."""
    pid, tid = os.getpid(), os.getpid()
    latest = tmp_path / "latest.pt"
    for i in range(2):
        tmp = tmp_path / f"latest.pt.tmp{i}"
        tmp.write_bytes(b"")
        feed.scope(pid, tid, 1, latest)
        oid = feed.open(pid, tid, 3, tmp, in_scope=True)
        write_chunks(feed, pid, tid, 3, oid, tmp, [bytes([i]) * 1000])
        feed.io(pid, tid, 3, oid, "fsync")
        feed.io(pid, tid, 3, oid, "close")
        tmp.replace(latest)
        feed.rename(pid, tid, tmp, latest)
        feed.scope(pid, tid, 2, latest)
        feed.flush()
        time.sleep(0.2)
        feed.flush()
    other = tmp_path / "other.pt"
    other.write_bytes(b"")
    feed.scope(pid, tid, 1, other)
    oid = feed.open(pid, tid, 4, other, in_scope=True)
    write_chunks(feed, pid, tid, 4, oid, other, [b"o" * 1000])
    feed.io(pid, tid, 4, oid, "fsync")
    feed.io(pid, tid, 4, oid, "close")
    feed.scope(pid, tid, 2, other)
    time.sleep(0.05)  # more than a clock tick: file times are coarse
    with open(other, "r+b") as f:  # by someone the recorder does not trace, before the hash
        f.write(b"X")
    rw = feed.open(pid, tid, 5, latest, in_scope=False, flags=os.O_RDWR)
    with open(latest, "r+b") as f:
        f.seek(10)
        f.write(b"Y" * 5)
    feed.io(pid, tid, 5, rw, "pwrite64", 10, 5, 5)
    feed.io(pid, tid, 5, rw, "close")
    feed.flush()
    feed.finish()
    rows = feed.store.query("SELECT file_id, path, status, reasons, superseded_by_file_id FROM checkpoint_integrity"
                            " ORDER BY file_id")
    first, second, late = rows
    assert (first["status"], first["reasons"], first["superseded_by_file_id"]) == ("verified", None,
                                                                                 second["file_id"])
    assert (second["status"], second["reasons"]) == ("changed", "written_after_completion,changed_at_stop")
    assert (late["status"], late["reasons"]) == ("changed", "modified_before_hash")
    assert feed.store.query("SELECT opted_by, modifies_file_id FROM checkpoint_file WHERE opted_by = 'rewrite'") == [
        {"opted_by": "rewrite", "modifies_file_id": second["file_id"]}]


def test_verify_checkpoints_rehashes_later(feed, tmp_path):
    pid, tid = os.getpid(), os.getpid()
    path = tmp_path / "a.pt"
    path.write_bytes(b"")
    feed.scope(pid, tid, 1, path)
    oid = feed.open(pid, tid, 3, path, in_scope=True)
    write_chunks(feed, pid, tid, 3, oid, path, [b"a" * 50])
    feed.io(pid, tid, 3, oid, "fsync")
    feed.io(pid, tid, 3, oid, "close")
    feed.scope(pid, tid, 2, path)
    feed.flush()
    feed.finish()
    assert [r["matches"] for r in verify_checkpoints(feed.store)] == [True]
    assert feed.integrity()[str(path)]["status"] == "verified"
    path.unlink()
    result = verify_checkpoints(feed.store, feed.sid)
    assert [(r["matches"], r["state"]) for r in result] == [(False, "missing")]
    row = feed.integrity()[str(path)]
    assert (row["status"], row["reasons"]) == ("changed", "missing_at_recheck")


def test_what_a_scope_writes_besides_its_checkpoint_is_left_out(feed, tmp_path):
    """An import inside the scope writes a .pyc (temporary name, then rename); /dev/null is no file."""
    pid, tid = os.getpid(), os.getpid()
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    pyc, final = cache / "mod.cpython-311.pyc.1234", tmp_path / "ckpt.pt"
    pyc.write_bytes(b"")
    final.write_bytes(b"")
    feed.scope(pid, tid, 1, final)
    c = feed.open(pid, tid, 3, pyc, in_scope=True)
    write_chunks(feed, pid, tid, 3, c, pyc, [b"\x00" * 64])
    feed.io(pid, tid, 3, c, "close")
    n = feed.open(pid, tid, 4, "/dev/null", in_scope=True)
    feed.io(pid, tid, 4, n, "write", 0, 5, 5)
    feed.io(pid, tid, 4, n, "close")
    k = feed.open(pid, tid, 5, final, in_scope=True)
    write_chunks(feed, pid, tid, 5, k, final, [b"k" * 64])
    feed.io(pid, tid, 5, k, "fsync")
    feed.io(pid, tid, 5, k, "close")
    feed.scope(pid, tid, 2, final)
    feed.flush()
    feed.finish()
    assert [(r["final_path"], r["status"]) for r in feed.integrity().values()] == [(str(final), "verified")]
    assert feed.store.query("SELECT count(*) AS n FROM checkpoint_extent") == [{"n": 1}]


def test_verify_checkpoints_names_a_missing_session(tmp_path):
    with open_store(tmp_path / "empty.db", create=True) as store:
        with pytest.raises(StoreError, match="holds no session"):
            verify_checkpoints(store)
    feed = Feed(tmp_path)
    try:
        with pytest.raises(StoreError, match="no session 7 in"):
            verify_checkpoints(feed.store, 7)
        assert verify_checkpoints(feed.store) == []
        assert render_verification([]) == "no hashed checkpoint files in this session"
    finally:
        feed.store.close()


def test_a_file_renamed_before_it_was_classified_keeps_its_rename(feed, tmp_path):
    """Opened, written, closed and renamed within one batch, before the xattr was looked at."""
    pid, tid = os.getpid(), os.getpid()
    tmp, final = tmp_path / "w.tmp", tmp_path / "w.bin"
    tmp.write_bytes(b"")
    os.setxattr(tmp, XATTR, b"1")
    oid = feed.open(pid, tid, 3, tmp, in_scope=False)
    write_chunks(feed, pid, tid, 3, oid, tmp, [b"w" * 700])
    feed.io(pid, tid, 3, oid, "fsync")
    feed.io(pid, tid, 3, oid, "close")
    tmp.replace(final)
    feed.rename(pid, tid, tmp, final)
    feed.flush()
    feed.finish()
    row = feed.integrity()[str(final)]
    assert (row["status"], row["path"], row["opted_by"], row["size_bytes"]) == ("verified", str(tmp), "xattr", 700)
    ops = feed.store.query("SELECT op, path FROM checkpoint_op ORDER BY ts")
    assert ops == [{"op": "open", "path": str(tmp)}, {"op": "fsync", "path": None}, {"op": "close", "path": None},
                   {"op": "rename", "path": str(final)}]
