"""Python stack reads that fail for a transient cause, with real BPF and real swap: the walker reads
the target's memory without faulting pages in, so a code object swapped out cannot be read there.
tests/workloads/swapped_code.py swaps out the code object of a caller on the stack before each
sleep; user space reads it back through /proc/PID/mem, so every sleep still has its whole stack,
and the process's capability row counts the stacks read only that way and says why, exactly as
the recording has them. Skipped with the reason where root, BPF or swap is missing; the swap file
made here is switched off even when a test fails."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

from recorder.core.pyframes import StackResolver

WORKLOAD = ROOT / "tests" / "workloads" / "swapped_code.py"
SYS_CLOCK_NANOSLEEP = 230  # x86-64
ROUNDS = 6


@pytest.fixture
def swap(tmp_path: Path):
    """A 64 MiB swap file, on for the test (MADV_PAGEOUT of anonymous memory needs swap)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch swap on")
    path = tmp_path / "swap"
    with open(path, "wb") as f:  # no holes: swapon refuses a sparse file
        for _ in range(64):
            f.write(bytes(1 << 20))
    path.chmod(0o600)
    made = subprocess.run(["mkswap", str(path)], capture_output=True, text=True)
    on = made.returncode == 0 and subprocess.run(["swapon", str(path)], capture_output=True, text=True)
    if not on or on.returncode != 0:
        pytest.skip(f"cannot switch swap on here: {(on or made).stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["swapoff", str(path)], check=True)


def tagged_line(tag: str) -> int:
    for n, text in enumerate(WORKLOAD.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# @{tag}"):
            return n
    raise AssertionError(tag)


@needs_bpf
@pytest.mark.bpf
def test_swapped_out_code_objects_are_read_back_and_counted(tmp_path: Path, swap: Path) -> None:
    db = tmp_path / "s.db"
    res = run_recorder("record", "--db", str(db), "--", sys.executable, str(WORKLOAD), "--rounds", str(ROUNDS),
                       timeout=300)
    assert res.returncode == 0, res.stderr
    job = workload_output(res.stdout)
    assert job["swapped"] == [True] * ROUNDS, job  # the page was out before each sleep

    # every sleep has its whole stack: inner at the sleep, the round's outer_N (its code object read
    # back where the walker could not read it), main, the module
    sleeps = q(db, "SELECT o.python_stack_id, st.status, st.failure, st.reread FROM offcpu_interval o"
                   " JOIN thread t ON t.id = o.thread_id JOIN python_stack st ON st.id = o.python_stack_id"
                   " WHERE t.tid = ? AND o.syscall = ? AND o.dur BETWEEN ? AND ? ORDER BY o.ts",
               (job["tid"], SYS_CLOCK_NANOSLEEP, job["sleep_ms"] * 0.9e6, job["sleep_ms"] * 10e6))
    assert len(sleeps) == ROUNDS, sleeps
    for n, (stack_id, status, failure, reread) in enumerate(sleeps):
        frames = q(db, "SELECT c.qualname, f.line FROM python_stack_frame f JOIN python_code c ON c.id = f.code_id"
                       " WHERE f.stack_id = ? ORDER BY f.depth", (stack_id,))
        assert [name for name, _ in frames] == ["inner", f"outer_{n}", "main", "<module>"], frames
        assert frames[0][1] == tagged_line("sleep")
        assert status == "ok"
        assert (failure, reread) in ((None, 0), ("code object page swapped out", 1)), (failure, reread)
    # in every round the walker's read failed and user space read the code object back: at the
    # sleep's end, or first at the round's swap write (issued from this thread right after its page
    # was unmapped), whose read back faults the page in again, often before the sleep ends
    for n in range(ROUNDS):
        reads = q(db, "SELECT st.reread, st.failure FROM python_stack st WHERE st.session_id = 1 AND EXISTS"
                      " (SELECT 1 FROM python_stack_frame f JOIN python_code c ON c.id = f.code_id"
                      "  WHERE f.stack_id = st.id AND c.qualname = ?)", (f"outer_{n}",))
        assert (1, "code object page swapped out") in reads, (n, reads)

    # no read of the process failed for good (a capture in the interpreter's first moments, before
    # the recorder configured it, is 'not configured'; one during an import, at start-up, may find a
    # module's code object freed when user space reads it, and says so; one while the interpreter
    # shuts down, after its thread state is cleared, has no Python thread state), and none went missing
    # (the events' stacks: the on-CPU profile samples at any instant, and this workload pages its own
    # memory out, so a sample may find even the interpreter state's page out; it is counted as such)
    events = " UNION ALL ".join(f"SELECT thread_id, python_stack_id FROM {t} WHERE python_stack_id IS NOT NULL"
                                for t in ("cuda_call", "offcpu_interval", "block_request", "nccl_call"))
    statuses = set(q(db, "SELECT DISTINCT status, failure FROM python_stack WHERE session_id = 1"
                         f" AND id IN (SELECT python_stack_id FROM ({events}))"))
    assert statuses <= {("ok", None), ("ok", "code object page swapped out"), ("not configured", None),
                        ("no python thread state", None),
                        ("unresolved", "code object freed or replaced before it was resolved")}, statuses
    unresolved = q(db, "SELECT st.id, (SELECT group_concat(c.qualname) FROM python_stack_frame f JOIN python_code c"
                       " ON c.id = f.code_id WHERE f.stack_id = st.id) FROM python_stack st"
                       " WHERE st.status = 'unresolved'")
    assert all("_find_and_load" in names for _, names in unresolved), unresolved
    assert q(db, "SELECT probe FROM loss WHERE probe LIKE 'python stack%'") == []

    # the capability row's counts are the recording's, per event
    counts = q(db, f"SELECT st.status, count(*), sum(st.reread > 0) FROM ({events}) e"
                   " JOIN python_stack st ON st.id = e.python_stack_id JOIN thread t ON t.id = e.thread_id"
                   " JOIN process p ON p.id = t.process_id WHERE p.pid = ? GROUP BY 1", (job["pid"],))
    by_status = {status: (n, back) for status, n, back in counts}
    read, back = by_status.pop("ok")
    total = read + sum(n for n, _ in by_status.values())
    failed = {f"{status}: {n:,}" + (f" (code object freed or replaced before it was resolved: {n:,})"
                                    if status == "unresolved" else "") for status, (n, _) in by_status.items()}
    (status, detail), = q(db, "SELECT status, detail FROM capability WHERE probe = 'cpython frames' AND target = ?",
                          (f"pid {job['pid']}",))
    assert status == "attached"
    summary = re.search(r"; (\d[\d,]*) of (\d[\d,]*) stacks read(?: \((.*)\))?; ", detail)
    assert summary and summary.group(1, 2) == (f"{read:,}", f"{total:,}"), detail
    assert set(re.split(r", (?![^(]*\))", summary.group(3))) == failed if failed else summary.group(3) is None, detail
    assert detail.endswith(f"; {back:,} of them after reading back code objects the walker could not"
                           f" (code object page swapped out: {back:,})"), detail
    assert back >= 1


def test_page_state_says_why_a_read_without_faulting_fails() -> None:
    """The reasons, from this process's own pages: one never touched, one unmapped, one resident."""
    resolver = StackResolver()
    pid = os.getpid()
    area = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    assert resolver.page_state(pid, base + mmap.PAGESIZE) == "page not resident"  # never touched
    area[0] = 1
    assert resolver.page_state(pid, base) == "page not resident (faulted in since)"
    assert resolver.page_state(pid, 0x1000) == "address not mapped"
    # a page found not resident keeps that state once faulted in (by the recorder's read back)
    area[mmap.PAGESIZE] = 1
    assert resolver.page_state(pid, base + mmap.PAGESIZE) == "page not resident"
    assert re.fullmatch(r"page state unknown \(process gone\)", resolver.page_state(2**22 + 7, base))


def test_a_record_says_which_code_objects_were_not_read_and_where_the_walk_failed() -> None:
    """The walker's entries after the frames (bpf/pystack.h): a frame whose code object was not read
    keeps its place, the entry of the read that ended the walk is no frame."""
    import struct

    from recorder.core.pyframes import (
        EVENT_HEADER_FIELDS,
        FRAME_CODE_UNREAD,
        FRAME_FAILED,
        FRAME_FIELDS,
        STATUS_READ_ERROR,
        parse_pystack_event,
    )

    header = struct.Struct("=" + "".join(f for _, f in EVENT_HEADER_FIELDS))
    frame = struct.Struct("=" + "".join(f for _, f in FRAME_FIELDS))
    data = header.pack(5, 10, 11, 3, STATUS_READ_ERROR, 0) + b"".join([
        frame.pack(0x1000, 7, 99, 0),
        frame.pack(0x2000, 8, 0, FRAME_CODE_UNREAD),
        frame.pack(0xDEAD000, 0, 0, FRAME_FAILED | 3 << 8),  # a frame's head
    ])
    ev = parse_pystack_event(data)
    assert ev.frames == ((0x1000, 7, 99), (0x2000, 8, 0))
    assert ev.unread == (1,)
    assert ev.failed == ("frame", 0xDEAD000)
    whole = parse_pystack_event(header.pack(5, 10, 11, 1, 0, 0) + frame.pack(0x1000, 7, 99, 0))
    assert (whole.frames, whole.unread, whole.failed) == (((0x1000, 7, 99),), (), None)
