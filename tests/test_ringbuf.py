"""The memory-mapped ring buffer reader (recorder/core/ringbuf.py) on real BPF ring buffers: every record
in order, across many wrap-arounds of a one-page ring, read in blocks (fixed size) and one by one
(mixed sizes)."""

import ctypes
import os
import struct
import subprocess
import sys

import pytest

from recorder.core import ringbuf

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF")

PROGRAM = r"""
BPF_RINGBUF_OUTPUT(fixed, PAGES);
BPF_RINGBUF_OUTPUT(mixed, 1);
BPF_ARRAY(seq, u64, 1);
BPF_ARRAY(lost, u64, 1);
struct rec { u64 n; u64 pid; u64 a; u64 b; };
struct small { u64 n; };

TRACEPOINT_PROBE(syscalls, sys_enter_getppid)
{
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (pid != TARGET)
        return 0;
    int k = 0;
    u64 *next = seq.lookup(&k);
    u64 *drops = lost.lookup(&k);
    if (!next || !drops)
        return 0;
    u64 n = __sync_fetch_and_add(next, 1);
    struct rec r = {.n = n, .pid = pid, .a = n * 3, .b = ~n};
    if (fixed.ringbuf_output(&r, sizeof(r), 0) != 0)
        __sync_fetch_and_add(drops, 1);
    if (n & 1) {
        struct small s = {.n = n};
        mixed.ringbuf_output(&s, sizeof(s), 0);
    } else {
        mixed.ringbuf_output(&r, sizeof(r), 0);
    }
    return 0;
}
"""
REC = struct.Struct("=QQQQ")
FRAMED = struct.Struct("=8xQQQQ")


def _program(target: int, pages: int):
    """PROGRAM loaded for the process `target`, its `fixed` ring `pages` pages long."""
    if not ringbuf.supported():
        pytest.skip("the mapped reader is used on x86-64 only")
    from bcc import BPF

    from recorder.core import kheaders

    kheaders.locate()  # exports BCC_KERNEL_SOURCE where only generic headers exist
    return BPF(text=PROGRAM.replace("TARGET", str(target)).replace("PAGES", str(pages)))


@pytest.fixture(scope="module")
def bpf():
    b = _program(os.getpid(), 1)
    yield b
    b.cleanup()


def _calls(n: int) -> None:
    for _ in range(n):
        os.getppid()


@pytest.mark.parametrize("reader", ["C", "Python"])
def test_blocks_and_single_records_across_wraparounds(bpf, reader, monkeypatch):
    if reader == "Python":  # the loop recorder/_ingest.c replaces, as where it is not built
        monkeypatch.setattr(ringbuf, "_drain_records", None)
    elif ringbuf._drain_records is None:
        pytest.skip("recorder._ingest is not built")
    blocks: list[bytes] = []
    singles: list[bytes] = []
    rings = ringbuf.RingSet()
    fixed, mixed = bpf["fixed"], bpf["mixed"]
    rings.add(fixed.map_fd, fixed.max_entries, blocks.append, REC.size)
    rings.add(mixed.map_fd, mixed.max_entries, singles.append)
    start = bpf["seq"][ctypes.c_int(0)].value
    total = 0
    for round_ in range(40):  # a 4 KiB ring holds 102 framed records: ~20 wrap-arounds
        n = 37 + round_ % 50
        _calls(n)
        total += n
        assert rings.poll(100) == 2 * n
    assert rings.poll(0) == 0
    rings.close()
    assert bpf["lost"][ctypes.c_int(0)].value == 0
    records = list(FRAMED.iter_unpack(b"".join(blocks)))
    assert [r[0] for r in records] == list(range(start, start + total))
    assert all(r[1] == os.getpid() and r[2] == r[0] * 3 and r[3] == ~r[0] & (2**64 - 1) for r in records)
    assert [len(s) for s in singles] == [8 if n & 1 else 32 for n in range(start, start + total)]
    assert [struct.unpack_from("=Q", s)[0] for s in singles] == list(range(start, start + total))


def test_frame_matches_the_block_layout():
    record = REC.pack(1, 2, 3, 4)
    assert FRAMED.unpack(ringbuf.frame(record)) == (1, 2, 3, 4)


def test_blocks_read_while_another_cpu_writes():
    """A producer process on another CPU writes while the reader drains: records reserved but not
    yet committed when the headers are read are read later, never skipped as malformed."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs for a concurrent producer")
    calls = 200_000
    child = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.stdin.readline()\n"
                              f"for _ in range({calls}): os.getppid()"], stdin=subprocess.PIPE)
    try:
        b = _program(child.pid, 4)
        blocks: list[bytes] = []
        rings = ringbuf.RingSet()
        fixed = b["fixed"]
        rings.add(fixed.map_fd, fixed.max_entries, blocks.append, REC.size)
        child.stdin.write(b"go\n")
        child.stdin.flush()
        while child.poll() is None:
            rings.consume()  # reading all the time: headers are often read mid-reservation
        rings.poll(0)
        malformed = rings.rings[0].malformed
        rings.close()
        lost = b["lost"][ctypes.c_int(0)].value
        b.cleanup()
    finally:
        child.kill()
        child.wait()
    got = [r[0] for r in FRAMED.iter_unpack(b"".join(blocks))]
    assert malformed == 0
    assert len(got) + lost == calls, (len(got), lost)
    assert got == sorted(got) and len(set(got)) == len(got)  # in order, none twice
