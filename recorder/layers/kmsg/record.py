"""`/dev/kmsg` records: `prio,seq,usec,flag[,...];text` plus ` KEY=value` continuation lines.

`parse_record(raw)` never raises: a record it cannot read is returned with `malformed=True` and
its raw bytes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KMSG_PATH = "/dev/kmsg"
# A record is at most CONSOLE_EXT_LOG_MAX (8 KiB); a smaller buffer makes read() fail with EINVAL.
READ_SIZE = 16384

_INT64_MAX = 2**63 - 1

LEVEL_NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")




@dataclass(slots=True, frozen=True)
class KmsgRecord:
    """One `/dev/kmsg` record. Fields the header did not give are None."""

    raw: bytes  # the record as read, kept so a malformed one can be stored verbatim
    text: str  # message text, `\\xNN` escapes undone, decoded as UTF-8 (bad bytes backslashed)
    facility: int | None = None  # syslog facility (prio >> 3); 0 kernel, 1 user (writes to kmsg)
    level: int | None = None  # syslog level (prio & 7): 0 emerg .. 7 debug
    seq: int | None = None  # kernel sequence number; gaps mean records were overwritten
    usec: int | None = None  # printk timestamp in microseconds (see ts_ns)
    flag: str = ""  # '-' normal, 'c' continuation fragment (older kernels), '+' continued
    caller: str | None = None  # `caller=T123` / `C2` header field (CONFIG_PRINTK_CALLER)
    properties: dict[str, str] = field(default_factory=dict)  # continuation ` KEY=value` lines
    malformed: bool = False
    error: str | None = None  # why the record is malformed

    @property
    def ts_ns(self) -> int | None:
        """The record's own stamp in ns. printk stamps with local_clock() (sched_clock), which
        runs at CLOCK_MONOTONIC's rate but is not the same clock: on the development VM it was
        ~0.4 ms ahead of clock_gettime(CLOCK_MONOTONIC), and NTP slewing lets the two drift.
        `KmsgReader.calibrate()` measures the offset; `KernelLogEntry.ts_ns` applies it."""
        return None if self.usec is None else self.usec * 1000


_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
_DIGITS = re.compile(rb"[0-9]{1,20}")


def _unescape(data: bytes) -> bytes:
    # The kernel writes every byte < 0x20, >= 0x7f and the backslash itself as \xNN.
    if b"\\x" not in data:
        return data
    return _ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), data)


def _decode(data: bytes) -> str:
    return _unescape(data).decode("utf-8", "backslashreplace")


def _header_int(value: bytes) -> int | None:
    return int(value) if _DIGITS.fullmatch(value) else None


def parse_record(raw: bytes) -> KmsgRecord:
    """Parse one `/dev/kmsg` record. Never raises; unreadable records come back malformed."""
    head, sep, body = raw.partition(b";")
    if not sep:
        return KmsgRecord(raw=raw, text=_decode(raw.rstrip(b"\n")), malformed=True,
                          error="no ';' between header and text")
    lines = body.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    text = _decode(lines[0]) if lines else ""
    problems: list[str] = []
    properties: dict[str, str] = {}
    for line in lines[1:]:
        key, eq, value = line[1:].partition(b"=")
        if line[:1] != b" " or not eq or not key:
            problems.append("continuation line is not ' KEY=value'")
            continue
        properties[_decode(key)] = _decode(value)

    parts = head.split(b",")
    if len(parts) < 4:
        return KmsgRecord(raw=raw, text=text, properties=properties, malformed=True,
                          error="header has fewer than 4 fields (prio,seq,usec,flag)")
    prio, seq, usec = (_header_int(p) for p in parts[:3])
    if prio is None or seq is None or usec is None:
        problems.append("prio, seq or usec is not a decimal number")
    # Out of range for the kernel's own types (u64 seq, ns in s64): not a real header.
    if seq is not None and seq >= 2**64:
        problems.append("seq beyond 64 bits")
        seq = None
    if usec is not None and usec * 1000 > _INT64_MAX:
        problems.append("usec beyond 64-bit nanoseconds")
        usec = None
    if prio is not None and prio >= 2**11:  # facility is a u8, level 3 bits
        problems.append("prio beyond facility 255")
        prio = None
    flag = parts[3].decode("ascii", "backslashreplace")
    if len(flag) != 1:
        problems.append("flag is not one character")
    caller = None
    for extra in parts[4:]:
        if extra.startswith(b"caller="):
            caller = extra[7:].decode("ascii", "backslashreplace")
    return KmsgRecord(
        raw=raw,
        text=text,
        facility=None if prio is None else prio >> 3,
        level=None if prio is None else prio & 7,
        seq=seq,
        usec=usec,
        flag=flag,
        caller=caller,
        properties=properties,
        malformed=bool(problems),
        error="; ".join(problems) or None,
    )


def split_dump(data: bytes) -> list[bytes]:
    """Split a saved `/dev/kmsg` dump (records back to back, as `cat /dev/kmsg` writes them) into
    records: a record starts at each line that does not begin with a space."""
    records: list[bytes] = []
    for line in data.splitlines(keepends=True):
        if line.startswith(b" ") and records:
            records[-1] += line
        elif line.strip():
            records.append(line)
    return records
