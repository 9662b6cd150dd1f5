"""Reading BPF ring buffers straight from their memory mapping, many records per Python call.

BCC's `ring_buffer_poll` calls back into Python once per record through a ctypes trampoline
(~1.4 us a record on a small VM, two records per traced CUDA call with its stack record). Here each
ring's pages are mapped into the recorder as libbpf maps them (the consumer position read-write,
the producer position and the data area read-only, the data area mapped twice so a record that
wraps around is contiguous), the records are walked in one loop and the consumer position is
stored as space is freed. Waiting is one `epoll` over the rings' map fds: the kernel reports a ring
readable while it holds unread records.

Ordering: the record header is read after the producer position and the data after the header; on
x86-64 (TSO) plain loads keep that order, so the fast reader is used there only and every other
architecture keeps BCC's reader (`supported()`).
"""

from __future__ import annotations

import mmap
import platform
import select
from collections import deque
from collections.abc import Callable

try:  # the loop below in C (recorder/_ingest.c), where it is built
    from recorder._ingest import drain_records as _drain_records
except ImportError:
    _drain_records = None

BUSY = 1 << 31  # bpf_ringbuf_hdr.len: reserved, not yet committed
DISCARD = 1 << 30  # discarded by the program: skip it
HEADER = 8  # u32 len, u32 page offset
FREE_EVERY = 4096  # store the consumer position at least this often (frees space for the producer)


def supported() -> bool:
    return platform.machine() in ("x86_64", "amd64")


class Ring:
    """One BPF_MAP_TYPE_RINGBUF map, mapped into this process; `drain()` hands every committed
    record's bytes to `sink` in order.

    A ring whose records all have one size (`record_size`, a multiple of 8) is read in blocks: the
    sink gets many *framed* records at once, each its 8-byte ring header then the record (see
    `frame()`), checked with one strided read of the headers instead of a loop per record."""

    def __init__(self, fd: int, data_size: int, sink: Callable[[bytes], object],
                 record_size: int | None = None) -> None:
        page = mmap.PAGESIZE
        self.fd = fd
        self.sink = sink
        self.mask = data_size - 1
        self.record_size = record_size
        self.malformed = 0  # records of another size in a fixed-size ring (skipped)
        self.page = page
        self._consumer = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._producer = mmap.mmap(fd, page + 2 * data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        # aligned 8-byte loads and stores through typed views (one machine access each)
        self._cons = memoryview(self._consumer).cast("Q")
        self._prod = memoryview(self._producer).cast("Q")
        self._words = memoryview(self._producer).cast("I")

    def drain(self) -> int:
        """Hand over every record committed when called, in order; returns how many."""
        if self.record_size is not None:
            return self._drain_blocks()
        cons_view, words, data, sink = self._cons, self._words, self._producer, self.sink
        mask, base = self.mask, self.page
        count = freed = 0
        if _drain_records is not None:
            records = _drain_records(data, self._consumer, base, mask, FREE_EVERY)
            deque(map(sink, records), 0)
            count = len(records)
        # (after the C reader: what it left, e.g. a record it could not size, or one just committed)
        cons = cons_view[0]
        prod = self._prod[0]
        while cons < prod:
            at = base + (cons & mask)
            length = words[at >> 2]
            if length & BUSY:  # reserved but not committed yet: later records wait behind it
                break
            size = length & ~(BUSY | DISCARD)
            if not length & DISCARD:
                sink(data[at + HEADER:at + HEADER + size])
                count += 1
            cons += (size + HEADER + 7) & ~7
            freed += 1
            if freed == FREE_EVERY:
                cons_view[0] = cons
                freed = 0
        cons_view[0] = cons
        return count

    def _drain_blocks(self) -> int:
        cons_view, words, data, sink = self._cons, self._words, self._producer, self.sink
        mask, base, size = self.mask, self.page, self.record_size
        assert size is not None  # read in blocks only with a record size
        stride = size + HEADER
        cons = cons_view[0]
        prod = self._prod[0]
        count = 0
        while cons < prod:
            n = (prod - cons) // stride
            at = base + (cons & mask)
            lengths = words[at >> 2:(at + n * stride) >> 2:stride >> 2].tolist() if n else []
            good = n if lengths.count(size) == n else _first_other(lengths, size)
            if good:
                sink(data[at:at + good * stride])
                count += good
                cons += good * stride
                cons_view[0] = cons
                continue
            length = words[at >> 2]  # a record that is not a committed one of `size` bytes
            if length & BUSY:
                break
            if length == size:  # committed since the headers were read: the next stretch has it
                continue
            if not length & DISCARD:
                self.malformed += 1
            cons += ((length & ~(BUSY | DISCARD)) + HEADER + 7) & ~7
            cons_view[0] = cons
        return count

    def close(self) -> None:
        for view in (self._cons, self._prod, self._words):
            view.release()
        self._consumer.close()
        self._producer.close()


def _first_other(values: list[int], value: int) -> int:
    for i, v in enumerate(values):
        if v != value:
            return i
    return len(values)


def frame(record: bytes) -> bytes:
    """A record as a block reader hands it over (for readers that get records one at a time)."""
    return _NO_HEADER + record


_NO_HEADER = bytes(HEADER)


class RingSet:
    """Every ring the session reads, with one epoll over them."""

    def __init__(self) -> None:
        self.rings: list[Ring] = []
        self._epoll = select.epoll()

    def add(self, fd: int, data_size: int, sink: Callable[[bytes], object],
            record_size: int | None = None) -> None:
        self.rings.append(Ring(fd, data_size, sink, record_size))
        self._epoll.register(fd, select.EPOLLIN)

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for a record, then drain every ring; returns records read."""
        try:
            self._epoll.poll(timeout_ms / 1000)
        except InterruptedError:
            pass
        return self.consume()

    def consume(self) -> int:
        return sum(ring.drain() for ring in self.rings)

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
        self.rings = []
        self._epoll.close()
