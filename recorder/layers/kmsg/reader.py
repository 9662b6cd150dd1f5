"""`KmsgReader` reads `/dev/kmsg` without blocking from a CLOCK_MONOTONIC start time and counts what
it read, parsed, could not parse and lost."""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from recorder.errors import NotPrivileged
from recorder.layers.kmsg.parsers import ParsedEvent, UnknownSubsystemLine, classify
from recorder.layers.kmsg.parsers.common import KernelEvent
from recorder.layers.kmsg.record import KMSG_PATH, READ_SIZE, KmsgRecord, parse_record

# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class KernelLogEntry:
    """What the reader yields: the record, what it parsed into, and when the reader read it."""

    record: KmsgRecord
    event: ParsedEvent | UnknownSubsystemLine | None
    read_ts_ns: int  # CLOCK_MONOTONIC ns at read time; stands in for ts when the header had none
    clock_offset_ns: int = 0  # printk clock minus CLOCK_MONOTONIC, from KmsgReader.calibrate()

    @property
    def ts_ns(self) -> int:
        """CLOCK_MONOTONIC ns (the clock of bpf_ktime_get_ns) of the record."""
        ts = self.record.ts_ns
        return self.read_ts_ns if ts is None else ts - self.clock_offset_ns


@dataclass(slots=True, frozen=True)
class ClockOffset:
    """printk clock (local_clock) minus CLOCK_MONOTONIC, measured by writing a record."""

    offset_ns: int
    uncertainty_ns: int  # half the width of the interval the offset is known to lie in
    samples: int


@dataclass(slots=True)
class KmsgStats:
    """Counters of one reader, for the session's loss statistics."""

    records_read: int = 0  # every record read, including skipped ones
    skipped_before_start: int = 0  # records older than the start time
    parsed: dict[str, int] = field(default_factory=dict)  # per event table.kind
    unknown: int = 0  # lines of watched subsystems no parser knows (kept raw)
    malformed: int = 0  # records whose header or continuation lines could not be read
    lost: int = 0  # records overwritten before we read them (sequence-number gaps)
    overruns: int = 0  # times read() failed with EPIPE


def _event_key(event: KernelEvent) -> str:
    return f"{event.table}.{event.kind}"


class KmsgReader:
    """Non-blocking reader of `/dev/kmsg` from a CLOCK_MONOTONIC start time.

    Use `fileno()` with the main loop's own select/poll and call `read_available()`, or call
    `poll(timeout)`; iterating blocks and yields entries forever. Records with a timestamp before
    `start_ns` are skipped (only the leading run of them: printk stamps are per-CPU and may step
    back a little, and a record after the start is never dropped for that). `start_ns=None` reads
    only records that arrive after open().
    """

    def __init__(self, start_ns: int | None = None, path: str = KMSG_PATH) -> None:
        self.start_ns = start_ns
        self.path = path
        self.stats = KmsgStats()
        self._fd: int | None = None
        self._next_seq: int | None = None
        self._started = start_ns is None
        self.clock_offset: ClockOffset | None = None  # set by calibrate()

    def open(self) -> KmsgReader:
        # O_RDONLY: writing is not needed, and each open of /dev/kmsg has its own read position,
        # so this reader never disturbs journald or dmesg.
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:
            raise NotPrivileged(
                f"cannot read {self.path}: run as root or with CAP_SYSLOG "
                "(or set kernel.dmesg_restrict=0)") from None
        if self.start_ns is None:
            os.lseek(self._fd, 0, os.SEEK_END)  # SEEK_END: only records written from now on
        else:
            # SEEK_SET 0 is the oldest record still in the buffer. SEEK_DATA would be the first
            # record after the last `dmesg -c`, which can skip records after our start.
            os.lseek(self._fd, 0, os.SEEK_SET)
        return self

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> KmsgReader:
        return self.open() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        if self._fd is None:
            raise RuntimeError("KmsgReader is not open: call open() or use it as a context manager")
        return self._fd

    def read_available(self) -> list[KernelLogEntry]:
        """Every record readable now, parsed; returns at once when there is none."""
        fd = self.fileno()
        entries: list[KernelLogEntry] = []
        while True:
            try:
                raw = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:
                    # Records were overwritten under us; the next read returns the oldest one
                    # left, and the sequence gap tells how many were lost.
                    self.stats.overruns += 1
                    continue
                raise
            if not raw:
                break
            entry = self.ingest(raw)
            if entry is not None:
                entries.append(entry)
        return entries

    def poll(self, timeout: float | None = 0.0) -> list[KernelLogEntry]:
        """Wait up to `timeout` seconds (None: forever) for records, then read all available."""
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        return self.read_available()

    def __iter__(self) -> Iterator[KernelLogEntry]:
        while True:
            yield from self.poll(None)

    def calibrate(self, samples: int = 5, timeout: float = 1.0) -> ClockOffset:
        """Measure the printk clock against CLOCK_MONOTONIC and apply it to what this reader
        yields from now on. Writes `samples` debug-level records (`stall-recorder: clock sync`)
        to /dev/kmsg, so it needs root; each is stamped by the kernel between two
        clock_gettime() calls, and the narrowest bracket wins. Call it again now and then over
        a long session: the two clocks can drift apart under NTP slewing."""
        nonce = os.urandom(6).hex()
        probe = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        best: tuple[int, int] | None = None
        try:
            os.lseek(probe, 0, os.SEEK_END)
            for i in range(samples):
                text = f"stall-recorder: clock sync {nonce} {i}"
                # A fresh open per write dodges the per-open ratelimit of printk_devkmsg.
                try:
                    out = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
                except PermissionError:
                    raise NotPrivileged(
                        f"cannot write {self.path} to measure the printk clock: run as root, "
                        "with kernel.printk_devkmsg not 'off'") from None
                try:
                    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                    os.write(out, f"<7>{text}\n".encode())
                    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                finally:
                    os.close(out)
                ts = _find_stamp(probe, text, timeout)
                if ts is None:
                    continue
                # The stamp is truncated to whole microseconds: the true one is in [ts, ts+999].
                lo, hi = ts - t1, ts + 999 - t0
                if best is None or hi - lo < best[1] - best[0]:
                    best = (lo, hi)
        finally:
            os.close(probe)
        if best is None:
            raise RuntimeError(f"clock sync records written to {self.path} never came back")
        self.clock_offset = ClockOffset(offset_ns=(best[0] + best[1]) // 2,
                                        uncertainty_ns=(best[1] - best[0] + 1) // 2,
                                        samples=samples)
        return self.clock_offset

    def ingest(self, raw: bytes) -> KernelLogEntry | None:
        """Parse and count one raw record as if it had just been read (also for replaying a
        saved dump); None when it precedes the start time."""
        stats = self.stats
        stats.records_read += 1
        record = parse_record(raw)
        if record.seq is not None:
            if self._next_seq is not None and record.seq > self._next_seq:
                stats.lost += record.seq - self._next_seq
            self._next_seq = record.seq + 1
        ts = record.ts_ns
        if ts is not None and self.clock_offset is not None:
            ts -= self.clock_offset.offset_ns
        if not self._started:
            if ts is not None and ts < self.start_ns:  # type: ignore[operator]
                stats.skipped_before_start += 1
                return None
            self._started = True
        if record.malformed:
            stats.malformed += 1
        event = classify(record.text)
        if isinstance(event, UnknownSubsystemLine):
            stats.unknown += 1
        elif event is not None:
            key = _event_key(event)
            stats.parsed[key] = stats.parsed.get(key, 0) + 1
        offset = self.clock_offset.offset_ns if self.clock_offset is not None else 0
        return KernelLogEntry(record=record, event=event, clock_offset_ns=offset,
                              read_ts_ns=time.clock_gettime_ns(time.CLOCK_MONOTONIC))


def _find_stamp(fd: int, text: str, timeout: float) -> int | None:
    """Read records from fd until the one with this text; its printk stamp in ns."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        try:
            raw = os.read(fd, READ_SIZE)
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            poller.poll(int(left * 1000) + 1)
            continue
        except OSError as e:
            if e.errno == errno.EPIPE:
                continue
            raise
        record = parse_record(raw)
        if record.text == text:
            return record.ts_ns
