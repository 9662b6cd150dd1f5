"""Checkpoint integrity with real BPF: one recording of tests/workloads/checkpoint_writes.py, whose
scenarios each write their own file with a known outcome (the script reports the truth, sha256
computed by itself), judged by the checkpoint_integrity view. Skipped with the reason without
root/BPF, or when no file system here keeps user xattrs (tmp, or ext4 on a loop device)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

from recorder.layers.checkpoint import XATTR, verify_checkpoints
from store.db import open_store

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "checkpoint_writes.py")


def _keeps_user_xattrs(folder: Path) -> bool:
    probe = folder / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return False
        raise
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """(db, truth): the workload recorded once; its files in a folder that keeps user xattrs."""
    base = tmp_path_factory.mktemp("checkpoints")
    folder, loop = base / "files", None
    folder.mkdir()
    if not _keeps_user_xattrs(folder):
        if not Path("/dev/loop-control").exists() or not shutil.which("mkfs.ext4"):
            pytest.skip("needs a file system with user xattrs (tmp has none, and no loop device for ext4)")
        img = base / "disk.img"
        subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
        loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True,
                              check=True).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
        subprocess.run(["mount", loop, str(folder)], check=True)
    try:
        marked = folder / "marked.bin"
        marked.write_bytes(b"old content, about to be replaced")
        os.setxattr(marked, XATTR, b"1")
        db = base / "c.db"
        res = run_recorder("record", "--db", str(db), "--", sys.executable, WORKLOAD, "--dir", str(folder),
                           "--xattr-file", str(marked), timeout=300)
        assert res.returncode == 0, res.stderr
        yield db, workload_output(res.stdout)
    finally:
        if loop:
            subprocess.run(["umount", "-l", str(folder)], check=False)
            subprocess.run(["losetup", "-d", loop], check=False)


def integrity(db: Path, final_path: str) -> dict:
    rows = q(db, "SELECT * FROM checkpoint_integrity WHERE final_path = ?", (final_path,))
    assert len(rows) == 1, (final_path, q(db, "SELECT file_id, final_path, status FROM checkpoint_integrity"))
    conn_cols = q(db, "SELECT name FROM pragma_table_info('checkpoint_integrity')")
    return dict(zip([c[0] for c in conn_cols], rows[0], strict=True))


def test_a_completed_checkpoint_verifies(recording):
    db, truth = recording
    t = truth["complete"]
    row = integrity(db, t["path"])
    assert (row["status"], row["reasons"]) == ("verified", None)
    assert row["sha256"] == t["sha256"] and row["size_bytes"] == t["size"]
    assert (row["path"], row["opted_by"], row["scope_path"]) == (t["tmp"], "marker_scope", t["path"])
    assert (row["writes"], row["bytes_written"], row["expected_size"], row["gaps"]) == (16, t["size"], t["size"], 0)
    # completion order: the last write, then the fsync, then the rename, within the scope
    assert row["last_write_end_ts"] <= row["last_sync_ts"] < row["rename_ts"] <= row["complete_ts"]
    extents = q(db, "SELECT file_offset, size_bytes, syscall FROM checkpoint_extent WHERE file_id = ? ORDER BY ts",
                (row["file_id"],))
    assert [(o, s) for o, s, _ in extents] == [(i * 65536, 65536) for i in range(16)]
    ops = [op for (op,) in q(db, "SELECT op FROM checkpoint_op WHERE file_id = ? ORDER BY ts", (row["file_id"],))]
    assert ops == ["open", "fsync", "close", "rename"]
    # hashed by the recorder, not by the writer: the hash began after the file was complete
    assert row["verified_ts"] >= row["complete_ts"]
    assert q(db, "SELECT state FROM checkpoint_verify WHERE file_id = ? AND trigger = 'session_stop'",
             (row["file_id"],)) == [("unchanged",)]


def test_a_writer_killed_mid_write_is_incomplete(recording):
    db, truth = recording
    t = truth["killed"]
    row = integrity(db, t["path"])
    assert row["status"] == "incomplete"
    assert "writer_died" in row["reasons"].split(",") and "no_fsync" in row["reasons"].split(",")
    assert row["pid"] == t["pid"] and row["scope_path"] == t["scope_path"]
    assert row["bytes_written"] >= t["at_least"] and row["complete_ts"] is None
    # what was on disk was hashed anyway, after the writer died
    assert q(db, "SELECT trigger, size_bytes FROM checkpoint_verify WHERE file_id = ? AND method = 'sha256'",
             (row["file_id"],)) == [("writer_exited", row["bytes_written"])]


def test_unsynced_and_gapped_checkpoints_are_incomplete(recording):
    db, truth = recording
    row = integrity(db, truth["no_fsync"]["path"])
    assert (row["status"], row["reasons"], row["sha256"]) == ("incomplete", "no_fsync", truth["no_fsync"]["sha256"])
    t = truth["gap"]
    row = integrity(db, t["path"])
    assert (row["status"], row["reasons"], row["gaps"]) == ("incomplete", "gap", 1)
    assert q(db, "SELECT file_offset, size_bytes FROM checkpoint_extent_gap WHERE file_id = ?",
             (row["file_id"],)) == [(t["hole_offset"], t["hole_size"])]
    syscalls = q(db, "SELECT DISTINCT syscall FROM checkpoint_extent WHERE file_id = ?", (row["file_id"],))
    assert syscalls == [("pwrite64",)]


def test_a_checkpoint_modified_after_completion_is_changed(recording):
    db, truth = recording
    t = truth["modified"]
    row = integrity(db, t["path"])
    assert row["status"] == "changed" and "written_after_completion" in row["reasons"]
    # what was hashed is what was written, before the change (or, had the recorder been slower than
    # the script's pause, the change is seen in the file's mtime at hashing)
    assert row["sha256"] == t["sha256"] or "modified_before_hash" in row["reasons"]
    assert row["changed_ts"] > row["complete_ts"]
    rewrite = q(db, "SELECT opted_by, path FROM checkpoint_file WHERE modifies_file_id = ?", (row["file_id"],))
    assert rewrite == [("rewrite", t["path"])]
    extents = q(db, "SELECT e.file_offset, e.size_bytes FROM checkpoint_extent e JOIN checkpoint_file f"
                    " ON f.id = e.file_id WHERE f.modifies_file_id = ?", (row["file_id"],))
    assert extents == [(100, 16)]


def test_a_path_that_disappears_before_hashing_is_missing(recording):
    db, truth = recording
    row = integrity(db, truth["vanished"]["path"])
    assert (row["status"], row["reasons"], row["sha256"]) == ("missing", "missing", None)
    assert q(db, "SELECT state FROM checkpoint_verify WHERE file_id = ?", (row["file_id"],)) == [("missing",)]
    # the recorder went on and stopped normally
    assert q(db, "SELECT status FROM session") == [("complete",)]


def test_a_file_with_the_xattr_is_traced_without_markers(recording):
    db, truth = recording
    t = truth["xattr"]
    row = integrity(db, t["path"])
    assert (row["status"], row["opted_by"], row["scope_path"]) == ("verified", "xattr", None)
    assert (row["sha256"], row["size_bytes"], row["writes"]) == (t["sha256"], t["size"], 5)


def test_nothing_else_is_taken_for_a_checkpoint(recording):
    db, truth = recording
    paths = {p for (p,) in q(db, "SELECT final_path FROM checkpoint_integrity")}
    expected = {truth[k]["path"] for k in ("complete", "no_fsync", "gap", "killed", "modified", "vanished", "xattr")}
    assert paths == expected
    assert q(db, "SELECT count(*) FROM capability WHERE layer = 'checkpoint' AND status = 'attached'")[0][0] >= 7
    assert q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe LIKE 'checkpoint%'") == [(0,)]


def test_recheck_finds_a_later_change(recording, tmp_path):
    db, truth = recording
    copy = tmp_path / "copy.db"
    shutil.copy(db, copy)
    t = truth["complete"]
    with open_store(copy) as store:
        first = {r["path"]: r for r in verify_checkpoints(store)}
    assert first[t["path"]]["matches"] and first[t["path"]]["sha256"] == t["sha256"]
    assert first[truth["xattr"]["path"]]["matches"]
    original = Path(t["path"]).read_bytes()
    try:
        Path(t["path"]).write_bytes(original[:-1] + b"!")
        with open_store(copy) as store:
            again = {r["path"]: r for r in verify_checkpoints(store)}
        assert not again[t["path"]]["matches"]
        # the same through the command line: exit status 1 and the changed file named
        cli = run_recorder("verify-checkpoints", "--db", str(copy), "--json")
        assert cli.returncode == 1
        assert {r["path"]: r["matches"] for r in json.loads(cli.stdout)}[t["path"]] is False
        assert hashlib.sha256(Path(t["path"]).read_bytes()).hexdigest() == again[t["path"]]["sha256"]
    finally:
        Path(t["path"]).write_bytes(original)
    row = integrity(copy, t["path"])
    assert (row["status"], row["reasons"]) == ("changed", "sha256_differs")
