"""Checkpoint writes with known outcomes, for tests/test_checkpoint_bpf.py. Each scenario writes its
own file under --dir and reports what it did; one JSON line at the end with every scenario's truth.

    python checkpoint_writes.py --dir DIR [--xattr-file PATH]

- complete:  under recorder.checkpoint(final): chunks to final.tmp, fsync, close, os.replace
- no_fsync:  the same without the fsync
- gap:       pwrite of chunks 0 and 2 (chunk 1 never written), fsync
- killed:    a child process writes chunks under a scope and is SIGKILLed after three
- modified:  a complete checkpoint, then (after it was hashed) 16 bytes overwritten in place
- vanished:  a complete checkpoint unlinked before its scope ends (so before it can be hashed)
- xattr:     --xattr-file (carrying user.ai.checkpoint) rewritten without any marker
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import recorder  # noqa: E402  (the marker API)

CHUNK = 64 * 1024


def chunks(n: int, seed: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() * (CHUNK // 32) for i in range(n)]


def truth(path: str, data: bytes, **more) -> dict:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **more}


def atomic_save(final: str, parts: list[bytes], fsync: bool = True, then=None) -> None:
    tmp = final + ".tmp"
    with recorder.checkpoint(final):
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if then:
            then()


def killed_writer(final: str) -> None:
    """The child: writes chunks forever under a scope, says when three are on disk."""
    with recorder.checkpoint(final):
        fd = os.open(final + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i, part in enumerate(chunks(1000, 7)):
            os.write(fd, part)
            if i == 2:
                sys.stdout.write("three\n")
                sys.stdout.flush()
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--xattr-file")
    ap.add_argument("--killed-child", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.killed_child:
        killed_writer(args.killed_child)
        return
    time.sleep(0.3)  # the recorder attaches the marker probes of this process
    d = args.dir
    out: dict = {"pid": os.getpid()}

    parts = chunks(16, 1)
    atomic_save(os.path.join(d, "complete.pt"), parts)
    out["complete"] = truth(os.path.join(d, "complete.pt"), b"".join(parts), tmp=os.path.join(d, "complete.pt.tmp"))

    parts = chunks(4, 2)
    atomic_save(os.path.join(d, "no_fsync.pt"), parts, fsync=False)
    out["no_fsync"] = truth(os.path.join(d, "no_fsync.pt"), b"".join(parts))

    gap = os.path.join(d, "gap.pt")
    parts = chunks(3, 3)
    with recorder.checkpoint(gap):
        fd = os.open(gap, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, parts[0], 0)
        os.pwrite(fd, parts[2], 2 * CHUNK)
        os.fsync(fd)
        os.close(fd)
    out["gap"] = {"path": gap, "hole_offset": CHUNK, "hole_size": CHUNK}

    killed = os.path.join(d, "killed.pt")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--dir", d, "--killed-child", killed],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "three\n"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    out["killed"] = {"path": killed + ".tmp", "scope_path": killed, "pid": child.pid,
                     "at_least": 3 * CHUNK}

    modified = os.path.join(d, "modified.pt")
    parts = chunks(4, 4)
    atomic_save(modified, parts)
    time.sleep(0.6)  # hashed by now
    with open(modified, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    out["modified"] = truth(modified, b"".join(parts))

    vanished = os.path.join(d, "vanished.pt")
    atomic_save(vanished, chunks(2, 5), then=lambda: os.unlink(vanished))
    out["vanished"] = {"path": vanished}

    if args.xattr_file:
        parts = chunks(5, 6)
        with open(args.xattr_file, "wb") as f:  # no marker: the xattr alone opts it in
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        out["xattr"] = truth(args.xattr_file, b"".join(parts))
    time.sleep(0.3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
