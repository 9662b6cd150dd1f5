"""Function symbols of an ELF object, read in bulk.

pyelftools parses each symbol through its construct layer, about 60 µs a symbol: a second for
libpython's 17,000 symbols, minutes for a framework library's hundreds of thousands. The session
symbolises native stacks between two reads of the rings, so a second there is a second in which no
Python stack is resolved, and a process that exits meanwhile takes its code objects with it. Here
pyelftools reads the headers only; each symbol table is unpacked a column at a time, and names are
read from the mapped file when a lookup needs them (benchmarks/bench_symbols.py).
"""

from __future__ import annotations

import bisect
import mmap
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator
from operator import itemgetter
from typing import Any

STT_FUNC, STT_GNU_IFUNC = 2, 10
SHN_UNDEF = 0
_FUNCTION_TYPES = (STT_FUNC, STT_GNU_IFUNC)


class SymbolTableError(ValueError):
    """A symbol table whose entries or string table do not fit the file."""


def _tables(elf, sections: Iterable[str]) -> Iterator[tuple[Any, int, int, bool]]:
    """(symbol table section, string table offset, string table size, 64-bit) of each named
    symbol table present."""
    for name in sections:
        sec = elf.get_section_by_name(name)
        if sec is None or sec["sh_type"] not in ("SHT_SYMTAB", "SHT_DYNSYM"):
            continue
        is64 = elf.elfclass == 64
        if sec["sh_entsize"] not in (0, 24 if is64 else 16):
            raise SymbolTableError(f"{name}: entry size {sec['sh_entsize']} in an ELF{elf.elfclass} file")
        strtab = elf.get_section(sec["sh_link"])
        if strtab["sh_type"] != "SHT_STRTAB":
            raise SymbolTableError(f"{name}: linked section {sec['sh_link']} is not a string table")
        yield sec, strtab["sh_offset"], strtab["sh_size"], is64


def _columns(sec: Any, is64: bool, little: bool) -> tuple[array, array, array, array, array]:
    """The table's name offsets, types, section indexes, values and sizes, one array each."""
    data = sec.data()
    if is64 and little == (sys.byteorder == "little"):
        # Elf64_Sym is three 8-byte words: name | info << 32 | other << 40 | shndx << 48, value, size
        words = array("Q")
        words.frombytes(data[:len(data) - len(data) % 24])
        head = words[0::3]
        return (array("Q", (w & 0xFFFFFFFF for w in head)), array("B", ((w >> 32) & 0xF for w in head)),
                array("Q", (w >> 48 for w in head)), words[1::3], words[2::3])
    fmt = ("<" if little else ">") + ("IBBHQQ" if is64 else "IIIBBH")
    rows = list(struct.iter_unpack(fmt, data[:len(data) - len(data) % struct.calcsize(fmt)]))
    order = (0, 1, 3, 4, 5) if is64 else (0, 3, 5, 1, 2)  # name, info, shndx, value, size
    cols = [[r[i] for r in rows] for i in order]
    return (array("Q", cols[0]), array("B", (i & 0xF for i in cols[1])), array("Q", cols[2]),
            array("Q", cols[3]), array("Q", cols[4]))


def _functions(elf, file_size: int, sections: Iterable[str]) -> list[tuple[int, int, int]]:
    """(start, size, name's position in the file) of each defined function symbol in `sections`,
    in table order."""
    picked: list[tuple[int, int, int]] = []
    for sec, str_off, str_size, is64 in _tables(elf, sections):
        if str_off + str_size > file_size:
            raise SymbolTableError(f"{sec.name}: string table past the end of the file")
        names, types, shndx, values, sizes = _columns(sec, is64, elf.little_endian)
        keep = [i for i, t in enumerate(types)
                if t in _FUNCTION_TYPES and values[i] and shndx[i] != SHN_UNDEF and names[i]]
        if keep and max(names[i] for i in keep) >= str_size:
            raise SymbolTableError(f"{sec.name}: a symbol name past its string table")
        picked += [(values[i], sizes[i], str_off + names[i]) for i in keep]
    return picked


def _name(mapped: mmap.mmap, position: int) -> str:
    end = mapped.find(b"\0", position)
    return mapped[position:end if end >= 0 else len(mapped)].decode("utf-8", "replace")


class FunctionSymbols:
    """The defined function symbols of one ELF file, .symtab first, then .dynsym (the first symbol
    seen at an address names it), looked up by virtual address.

    The file is memory-mapped: starts, sizes and name offsets are kept in arrays and names are read
    from the mapping on lookup, so a library of 10^5-10^6 symbols costs a few MB of the recorder's
    memory, not the hundreds its string table and Python objects would."""

    def __init__(self, path: str, sections: Iterable[str] = (".symtab", ".dynsym")) -> None:
        from elftools.elf.elffile import ELFFile  # deferred: only symbolisation needs it

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            elf = ELFFile(f)
            self.loads = [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in elf.iter_segments()
                          if s["p_type"] == "PT_LOAD"]
            picked = _functions(elf, len(self._map), sections)
        picked.sort(key=itemgetter(0))  # stable: the first symbol in table order names an address
        self.starts, self._sizes, self._names = array("Q"), array("Q"), array("Q")
        last = None
        for start, size, name in picked:
            if start != last:
                self.starts.append(start)
                self._sizes.append(size)
                self._names.append(name)
                last = start

    def __len__(self) -> int:
        return len(self.starts)

    def vaddr(self, file_offset: int) -> int:
        """The virtual address a file offset is loaded at (the offset itself outside PT_LOADs)."""
        for off, vaddr, size in self.loads:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return file_offset

    def items(self) -> Iterator[tuple[int, int, str]]:
        """(start, size, name) of every symbol, by address."""
        for i, start in enumerate(self.starts):
            yield start, self._sizes[i], _name(self._map, self._names[i])

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(symbol, offset from its start) of the function containing vaddr, None outside any."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return None
        start, size = self.starts[i], self._sizes[i]
        if size and vaddr >= start + size:
            return None
        return _name(self._map, self._names[i]), vaddr - start


def function_names(path: str, sections: Iterable[str] = (".dynsym",)) -> set[str]:
    """Names of the functions an ELF file defines in `sections`, aliases included (the API a
    library exports is every name, not one per address)."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        return {_name(mapped, position) for _, _, position in _functions(ELFFile(f), len(mapped), sections)}
