"""Member offsets of kernel structs, read from the running kernel's BTF.

BCC compiles against whatever kernel headers it finds, and on many hosts those are another
kernel's (here: 6.1 headers under a 6.18 kernel, where `task_struct.thread.fsbase` moves by
kilobytes). Any offset BPF code uses to read a kernel struct through a pointer must come from
`/sys/kernel/btf/vmlinux` instead. The BTF format is small (a header, a type section and a string
section; see Documentation/bpf/btf.rst), so this is a pure-Python reader with no dependencies.

    >>> member_offset("task_struct.thread.fsbase")  # bytes from the start of task_struct
    3128
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"

BTF_MAGIC = 0xEB9F

# Kinds (include/uapi/linux/btf.h).
KIND_INT = 1
KIND_PTR = 2
KIND_ARRAY = 3
KIND_STRUCT = 4
KIND_UNION = 5
KIND_ENUM = 6
KIND_FWD = 7
KIND_TYPEDEF = 8
KIND_VOLATILE = 9
KIND_CONST = 10
KIND_RESTRICT = 11
KIND_FUNC = 12
KIND_FUNC_PROTO = 13
KIND_VAR = 14
KIND_DATASEC = 15
KIND_FLOAT = 16
KIND_DECL_TAG = 17
KIND_TYPE_TAG = 18
KIND_ENUM64 = 19

# Kinds that only qualify another type: looked through when descending into a member.
_MODIFIERS = {KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG}


class BTFError(Exception):
    """The BTF blob is unreadable or does not describe the requested member."""


@dataclass(frozen=True)
class Member:
    name: str
    type_id: int
    bit_offset: int
    bitfield_size: int


@dataclass(frozen=True)
class BTFType:
    kind: int
    name: str
    size_or_type: int
    members: tuple[Member, ...] = ()


class BTF:
    """Parsed BTF types: `types[i]` is type id i (id 0 is void)."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 24:
            raise BTFError("BTF blob shorter than its header")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != BTF_MAGIC:
            raise BTFError(f"bad BTF magic {magic:#x} (big-endian BTF is not supported)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
        self._strings = blob[hdr_len + str_off : hdr_len + str_off + str_len]
        self.types: list[BTFType | None] = [None]
        self._by_name: dict[tuple[int, str], int] = {}
        self._parse_types(blob, hdr_len + type_off, hdr_len + type_off + type_len)

    def _name(self, off: int) -> str:
        end = self._strings.index(b"\0", off)
        return self._strings[off:end].decode()

    def _parse_types(self, blob: bytes, pos: int, end: int) -> None:
        while pos < end:
            name_off, info, size_or_type = struct.unpack_from("<III", blob, pos)
            pos += 12
            vlen = info & 0xFFFF
            kind = (info >> 24) & 0x1F
            kind_flag = info >> 31
            members: tuple[Member, ...] = ()
            if kind in (KIND_STRUCT, KIND_UNION):
                out = []
                for _ in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", blob, pos)
                    pos += 12
                    # With kind_flag set the offset word packs the bitfield size in its top byte.
                    bits, size = (m_off & 0xFFFFFF, m_off >> 24) if kind_flag else (m_off, 0)
                    out.append(Member(self._name(m_name), m_type, bits, size))
                members = tuple(out)
            elif kind == KIND_INT or kind == KIND_VAR or kind == KIND_DECL_TAG:
                pos += 4
            elif kind == KIND_ARRAY:
                pos += 12
            elif kind == KIND_ENUM or kind == KIND_FUNC_PROTO:
                pos += 8 * vlen
            elif kind == KIND_DATASEC or kind == KIND_ENUM64:
                pos += 12 * vlen
            elif kind not in (KIND_PTR, KIND_FWD, KIND_FUNC, KIND_FLOAT) and kind not in _MODIFIERS:
                raise BTFError(f"unknown BTF kind {kind} at type {len(self.types)}")
            name = self._name(name_off)
            self.types.append(BTFType(kind, name, size_or_type, members))
            if name and kind in (KIND_STRUCT, KIND_UNION):
                # First definition wins: duplicates are identical in vmlinux.
                self._by_name.setdefault((kind, name), len(self.types) - 1)

    def find_struct(self, name: str) -> int:
        for kind in (KIND_STRUCT, KIND_UNION):
            if (kind, name) in self._by_name:
                return self._by_name[(kind, name)]
        raise BTFError(f"no struct or union named {name!r} in BTF")

    def _resolve(self, type_id: int) -> int:
        """Follow typedefs and qualifiers down to the underlying type."""
        while True:
            t = self.types[type_id]
            if t is None or t.kind not in _MODIFIERS:
                return type_id
            type_id = t.size_or_type

    def _find_member(self, type_id: int, name: str) -> tuple[int, int] | None:
        """(bit offset, member type id) of `name`, looking inside anonymous structs/unions."""
        t = self.types[self._resolve(type_id)]
        if t is None or t.kind not in (KIND_STRUCT, KIND_UNION):
            return None
        for m in t.members:
            if m.name == name:
                return m.bit_offset, m.type_id
        for m in t.members:
            if not m.name:
                found = self._find_member(m.type_id, name)
                if found is not None:
                    return m.bit_offset + found[0], found[1]
        return None

    def member_offset(self, path: str) -> int:
        """Byte offset of `struct.member.member...` from the start of the struct."""
        struct_name, *members = path.split(".")
        if not members:
            raise BTFError(f"{path!r} names no member (expected e.g. task_struct.thread.fsbase)")
        type_id = self.find_struct(struct_name)
        bits = 0
        for i, name in enumerate(members):
            found = self._find_member(type_id, name)
            if found is None:
                where = ".".join([struct_name, *members[:i]])
                raise BTFError(f"{where} has no member {name!r} in this kernel's BTF")
            bits += found[0]
            type_id = found[1]
        if bits % 8:
            raise BTFError(f"{path} is a bitfield (bit offset {bits}), not byte addressable")
        return bits // 8


@cache
def _vmlinux_blob() -> bytes:
    try:
        with open(VMLINUX_BTF, "rb") as f:
            return f.read()
    except OSError as e:
        raise BTFError(
            f"cannot read {VMLINUX_BTF} ({e}); the kernel needs CONFIG_DEBUG_INFO_BTF=y"
        ) from e


@cache
def vmlinux() -> BTF:
    """The running kernel's BTF, parsed once per process."""
    return BTF(_vmlinux_blob())


def _offsets_file() -> Path:
    from recorder.core.kheaders import cache_dir

    return cache_dir() / "btf-offsets.json"


def member_offset(path: str) -> int:
    """Byte offset of a member path in the running kernel, e.g. `task_struct.thread.fsbase`.

    Parsing the kernel's BTF in Python takes about a second, so the answers are kept in the cache
    folder under the BTF's own SHA-256: a kernel whose BTF differs in any byte parses it again."""
    key = hashlib.sha256(_vmlinux_blob()).hexdigest()
    file = _offsets_file()
    try:
        known = json.loads(file.read_text())
        if known.get("btf_sha256") == key and isinstance(known["offsets"].get(path), int):
            return known["offsets"][path]
    except (OSError, ValueError, KeyError, AttributeError):
        known = {}
    offset = vmlinux().member_offset(path)
    offsets = known.get("offsets", {}) if known.get("btf_sha256") == key else {}
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:  # a cache that cannot be written costs the parse next time, nothing else
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"btf_sha256": key, "offsets": {**offsets, path: offset}}))
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)
    return offset
