"""Raw ftrace records, as a kernel's trace_pipe_raw gives them, decoded with the event `format` files.

What a tracepoint's BPF program receives is the event's record in this binary layout (BCC builds the
program's `args` struct from the same `format` file), so decoding a kernel's raw records with its
formats reads exactly the bytes and offsets the recorder's programs read. Used on the records the
kernel series' boot test dumps (kernel-patches/boot/init.c, dump_raw_trace).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"stall-recorder trace dump 1\n"
_FIELD = re.compile(r"field:(.+?) (\w+)(\[\d*\])?;\s*offset:(\d+);\s*size:(\d+);\s*signed:(\d);")
# ring-buffer event header: type_len (5 bits) | time_delta (27 bits); kernel/trace/ring_buffer.c
_PADDING, _TIME_EXTEND, _TIME_STAMP = 29, 30, 31
_COMMIT_MASK = (1 << 27) - 1  # the page's commit field also carries missed-events flags above these
_ABS_TS_MASK = (1 << 59) - 1


class DumpError(ValueError):
    """The dump or a page in it is not what the boot test writes."""


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str
    offset: int
    size: int
    signed: bool
    array: bool


@dataclass
class Format:
    """One event's tracefs `format` file."""

    name: str
    fields: dict[str, Field] = field(default_factory=dict)

    def decode(self, record: bytes) -> dict[str, int | str | bytes]:
        """Every field of one record: integers as the kernel stores them (little endian), `char[N]`
        and `__data_loc char[]` as text."""
        out: dict[str, int | str | bytes] = {}
        for f in self.fields.values():
            if f.offset + f.size > len(record):
                raise DumpError(f"{self.name}: record of {len(record)} bytes has no {f.name} at {f.offset}")
            # a `char buf[]` of size 0 is the rest of the record (ftrace:print)
            raw = record[f.offset:f.offset + f.size] if f.size or not f.array else record[f.offset:]
            if f.ctype.startswith("__data_loc"):
                loc = int.from_bytes(raw, "little")
                start, length = loc & 0xFFFF, loc >> 16
                out[f.name] = record[start:start + length].split(b"\0", 1)[0].decode("utf-8", "replace")
            elif f.array and f.ctype.endswith("char"):
                out[f.name] = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
            elif f.array:
                out[f.name] = raw
            else:
                out[f.name] = int.from_bytes(raw, "little", signed=f.signed)
        return out


def parse_formats(text: str) -> dict[str, Format]:
    """system/name -> Format, from the boot test's `=== format system/name ===` blocks."""
    out: dict[str, Format] = {}
    for name, body in re.findall(r"^=== format (\S+) ===\n(.*?)^=== end format ===\n", text, re.M | re.S):
        out[name] = parse_format(name, body)
    return out


def parse_format(name: str, body: str, needs: str = "common_type") -> Format:
    """One `format` file's fields; `needs` is a field it must have."""
    fmt = Format(name)
    for ctype, fname, array, offset, size, signed in _FIELD.findall(body):
        fmt.fields[fname] = Field(fname, ctype.strip(), int(offset), int(size), signed == "1", bool(array))
    if needs not in fmt.fields:
        raise DumpError(f"{name}: no {needs} in its format")
    return fmt


@dataclass
class Dump:
    """What the boot test wrote: the page layout, each event's id, each CPU's pages."""

    header_page: Format
    ids: dict[int, str]  # event id -> system/name
    cpus: dict[int, bytes]
    size: int  # bytes up to and with the `end` line


def read_dump(data: bytes) -> Dump:
    """Parses the dump (see dump_raw_trace in kernel-patches/boot/init.c); trailing bytes are ignored."""
    if not data.startswith(MAGIC):
        raise DumpError("not a stall-recorder trace dump (no header line)")
    at = len(MAGIC)
    header: Format | None = None
    ids: dict[int, str] = {}
    cpus: dict[int, bytes] = {}

    def line() -> list[str]:
        nonlocal at
        end = data.find(b"\n", at)
        if end < 0:
            raise DumpError("the dump ends before its `end` line")
        words = data[at:end].decode("ascii", "replace").split()
        at = end + 1
        return words

    while True:
        words = line()
        if words == ["end"]:
            break
        if len(words) == 2 and words[0] == "header_page":
            size = int(words[1])
            header = parse_format("header_page", data[at:at + size].decode("ascii", "replace"), "commit")
            at += size
        elif len(words) == 3 and words[0] == "event":
            ids[int(words[2])] = words[1]
        elif len(words) == 3 and words[0] == "cpu":
            size = int(words[2])
            cpus[int(words[1])] = data[at:at + size]
            at += size
        else:
            raise DumpError(f"unexpected line in the dump: {' '.join(words)!r}")
    if header is None:
        raise DumpError("the dump has no header_page")
    return Dump(header, ids, cpus, at)


def page_records(pages: bytes, header: Format) -> Iterator[tuple[int, bytes]]:
    """(timestamp ns, record) of every event in a CPU's trace_pipe_raw pages, in order."""
    ts_f, commit_f, data_f = header.fields["timestamp"], header.fields["commit"], header.fields["data"]
    page_size = data_f.offset + data_f.size  # the ring buffer's sub-buffer, a page by default
    for start in range(0, len(pages) - page_size + 1, page_size):
        page = pages[start:start + page_size]
        ts = int.from_bytes(page[ts_f.offset:ts_f.offset + ts_f.size], "little")
        commit = int.from_bytes(page[commit_f.offset:commit_f.offset + commit_f.size], "little") & _COMMIT_MASK
        at, end = data_f.offset, data_f.offset + commit
        if end > page_size:
            raise DumpError(f"page at {start}: commit {commit} past the page")
        while at + 4 <= end:
            (word,) = struct.unpack_from("<I", page, at)
            type_len, delta = word & 0x1F, word >> 5
            if type_len == _PADDING:
                if delta == 0:  # the rest of the page is padding
                    break
                at += 4 + struct.unpack_from("<I", page, at + 4)[0]
                ts += delta
            elif type_len == _TIME_EXTEND:
                ts += (struct.unpack_from("<I", page, at + 4)[0] << 27) | delta
                at += 8
            elif type_len == _TIME_STAMP:
                ts = (ts & ~_ABS_TS_MASK) | ((struct.unpack_from("<I", page, at + 4)[0] << 27) | delta)
                at += 8
            elif type_len == 0:  # length in the next word (which it counts), then the record
                length = struct.unpack_from("<I", page, at + 4)[0]
                ts += delta
                yield ts, page[at + 8:at + 4 + length]
                at += 4 + ((length + 3) & ~3)
            else:
                ts += delta
                yield ts, page[at + 4:at + 4 + 4 * type_len]
                at += 4 + 4 * type_len


def records(dump: Dump, formats: dict[str, Format]) -> Iterator[tuple[str, int, dict]]:
    """(system/name, timestamp, decoded fields) of every record in the dump, each CPU in order.

    Raises DumpError for a record whose id the dump does not name or whose format is not given."""
    for cpu in sorted(dump.cpus):
        for ts, record in page_records(dump.cpus[cpu], dump.header_page):
            (event_id,) = struct.unpack_from("<H", record, 0)
            name = dump.ids.get(event_id)
            if name is None:
                raise DumpError(f"cpu{cpu}: a record of event id {event_id}, which the dump does not name")
            if name in formats:
                yield name, ts, formats[name].decode(record)


def save_fixture(boot: Path, dest: Path, dump_at: int = 8 << 20) -> None:
    """Copies a boot's dump (from its disk2.img) and the console lines the tests read into `dest`."""
    with open(boot / "disk2.img", "rb") as disk:
        disk.seek(dump_at)
        data = disk.read(64 << 20)
    dump = read_dump(data)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "trace-dump.bin").write_bytes(data[:dump.size])
    console = (boot / "console.txt").read_text(errors="replace").splitlines()
    keep = ("ok: ", "FAILED: ", "completion: ", "trace dump: ", "stall-recorder boot test: ")
    (dest / "console.txt").write_text("".join(f"{line}\n" for line in console if line.startswith(keep)))


if __name__ == "__main__":  # python -m tests.ftrace_raw BOOT_DIR DEST_DIR
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.ftrace_raw BOOT_DIR DEST_DIR (a kernel-patches/check --boot directory)")
    save_fixture(Path(sys.argv[1]), Path(sys.argv[2]))
