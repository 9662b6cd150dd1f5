"""How a record the BPF programs send to user space is declared once, for C and Python.

A layer declares its own records (`Records`: its layouts, its #define constants, its drop counters)
in its own package; `Definitions.gather()` puts every layer's together with the few constants all
share (the target modes). `Definitions.c_text()` renders the C structs and #defines prepended to the
BPF sources at load time, and `Layout.unpack` reads the same bytes in Python, so the two cannot
drift; tests/test_events.py compiles the rendered C with gcc and compares sizes and offsets.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# C type -> (struct format char, size). Fields are ordered largest first in each layout so that
# the C compiler adds no padding and the Python format can be packed ("=").
_CTYPES: dict[str, tuple[str, int]] = {
    "u64": ("Q", 8),
    "s64": ("q", 8),
    "u32": ("I", 4),
    "s32": ("i", 4),
    "u16": ("H", 2),
    "char16": ("16s", 16),
    "char128": ("128s", 128),
    "char32": ("32s", 32),
    "char256": ("256s", 256),
}


_FRAMED: dict[str, struct.Struct] = {}  # layout name -> its struct after a ring header


@dataclass(frozen=True)
class Layout:
    """A fixed-size record: a C struct and its Python struct format from the same field list."""

    name: str
    fields: tuple[tuple[str, str], ...]
    doc: str
    _struct: struct.Struct = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = sum(_CTYPES[ctype][1] for _, ctype in self.fields)
        if size % 8:
            raise ValueError(f"{self.name}: {size} bytes; pad to a multiple of 8 so C adds none")
        fmt = "=" + "".join(_CTYPES[ctype][0] for _, ctype in self.fields)
        object.__setattr__(self, "_struct", struct.Struct(fmt))

    @property
    def size(self) -> int:
        return self._struct.size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)

    @property
    def fmt(self) -> str:
        """The struct format: '=' and one code per field."""
        return self._struct.format

    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for name, ctype in self.fields:
            out[name] = at
            at += _CTYPES[ctype][1]
        return out

    def unpack(self, data: bytes) -> tuple:
        return self._struct.unpack_from(data)

    def pack(self, *values) -> bytes:
        """The record's bytes from its field values, in order (tests feed layers with these)."""
        return self._struct.pack(*values)

    def iter_unpack(self, joined: bytes):
        return self._struct.iter_unpack(joined)

    @property
    def framed_size(self) -> int:
        """Bytes per record as a ring buffer holds it: its 8-byte header, then the record."""
        return self._struct.size + 8

    def iter_framed(self, joined: bytes):
        """Records read in blocks from a ring buffer (recorder/core/ringbuf.py), headers skipped."""
        framed = _FRAMED.get(self.name)
        if framed is None:
            framed = _FRAMED[self.name] = struct.Struct("=8x" + self._struct.format[1:])
        return framed.iter_unpack(joined)

    def c_struct(self) -> str:
        lines = [f"/* {self.doc} */", f"struct {self.name} {{"]
        for name, ctype in self.fields:
            if ctype.startswith("char"):
                lines.append(f"    char {name}[{_CTYPES[ctype][1]}];")
            else:
                lines.append(f"    {ctype} {name};")
        lines.append("};")
        return "\n".join(lines)


# Constants every BPF source shares (bpf/common.h): how targets are selected.
CONSTANTS: dict[str, int] = {
    "MODE_PIDS": 0,
    "MODE_CGROUP": 1,
    "MODE_ALL": 2,
}


@dataclass(frozen=True)
class Loss:
    """A `loss.probe` name a layer writes, and what it means to a reader: the session stores it in
    `layer_vocabulary`, where the report reads it (store/analysis/losses.py)."""

    probe: str
    layer: str  # the layer as reports name it ('block', 'nccl')
    what: str  # what was lost ('requests')
    why: str  # why ('ring buffer full')


@dataclass(frozen=True)
class Records:
    """What one layer shares with its BPF programs: its record layouts, its #define constants, and its
    drop counters in order, each a PROBE_<NAME> constant (an index into the `drops` per-CPU array of
    bpf/common.h, numbered by `Definitions.gather`) with the loss its drops are stored under."""

    layouts: tuple[Layout, ...] = ()
    constants: Mapping[str, int] = field(default_factory=dict)
    drops: tuple[tuple[str, Loss], ...] = ()

    def losses(self) -> tuple[Loss, ...]:
        """The losses of its drop counters."""
        return tuple(loss for _, loss in self.drops)


@dataclass(frozen=True)
class Definitions:
    """Every layer's records in one set: the C text prepended to the session's BPF programs and the
    `loss.probe` name of each drop counter by its index."""

    layouts: tuple[Layout, ...]
    constants: Mapping[str, int]
    probe_names: tuple[str, ...]

    @classmethod
    def gather(cls, records: Iterable[Records]) -> Definitions:
        """The shared constants and each layer's records, drop counters numbered in the order given."""
        layouts: list[Layout] = []
        constants = dict(CONSTANTS)
        names: list[str] = []
        for r in records:
            layouts.extend(r.layouts)
            for name, value in (*r.constants.items(), *((c, len(names) + i) for i, (c, _) in enumerate(r.drops))):
                if name in constants:
                    raise ValueError(f"{name} is defined twice: each layer names its constants with its own prefix")
                constants[name] = value
            names.extend(loss.probe for loss in r.losses())
        constants["PROBE_COUNT"] = len(names)
        structs = [layout.name for layout in layouts]
        if len(set(structs)) != len(structs):
            raise ValueError(f"a struct is defined twice in {structs}")
        return cls(tuple(layouts), constants, tuple(names))

    def c_text(self) -> str:
        """C text with every layout and constant, prepended to each BPF program."""
        parts = [f"#define {name} {value}" for name, value in self.constants.items()]
        parts += [layout.c_struct() for layout in self.layouts]
        return "\n".join(parts) + "\n"
