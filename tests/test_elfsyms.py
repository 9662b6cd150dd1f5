"""recorder/core/elfsyms.py (bulk symbol tables for native stacks and library API lists) against
pyelftools' own per-symbol reading, on libraries built here (static functions, aliases, an IFUNC,
stripped, 32-bit) and on the system's C library and this interpreter."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from recorder.core.elfsyms import FunctionSymbols, SymbolTableError, function_names
from recorder.core.libraries import exported_functions

SOURCE = r"""
__attribute__((noinline, used)) static int hidden_helper(int x) { return x * 3; }
int exported_one(int x) { return hidden_helper(x) + 1; }
int exported_two(int x) { return x - 2; }
int alias_of_two(int x) __attribute__((alias("exported_two")));
int table_value = 7;
static int impl(void) { return 42; }
static int (*resolve_picked(void))(void) { return impl; }
int picked(void) __attribute__((ifunc("resolve_picked")));
"""


def reference(path: Path | str, sections=(".symtab", ".dynsym")) -> dict[int, tuple[str, int]]:
    """What pyelftools reads symbol by symbol: start -> (name, size), first in table order."""
    found: dict[int, tuple[str, int]] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for name in sections:
            sec = elf.get_section_by_name(name)
            if sec is None:
                continue
            for sym in sec.iter_symbols():
                # pyelftools names type 10 (STT_GNU_IFUNC) STT_LOOS
                if (sym["st_info"]["type"] in ("STT_FUNC", "STT_LOOS") and sym["st_value"]
                        and sym["st_shndx"] != "SHN_UNDEF" and sym.name):
                    found.setdefault(sym["st_value"], (sym.name, sym["st_size"]))
    return found


def as_dict(syms: FunctionSymbols) -> dict[int, tuple[str, int]]:
    return {start: (name, size) for start, size, name in syms.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the test libraries (make test installs it)")
    out = tmp_path_factory.mktemp("elf")
    (out / "lib.c").write_text(SOURCE)
    libs = {"full": out / "libfull.so", "stripped": out / "libstripped.so"}
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", libs["full"], out / "lib.c"], check=True)
    shutil.copy(libs["full"], libs["stripped"])
    subprocess.run(["strip", "--strip-all", libs["stripped"]], check=True)
    # 32-bit: compile only (no 32-bit C library needed) and link with ld
    obj = out / "lib32.o"
    if subprocess.run(["gcc", "-m32", "-c", "-fPIC", "-O1", "-o", obj, out / "lib.c"],
                      capture_output=True).returncode == 0:
        libs["elf32"] = out / "lib32.so"
        subprocess.run(["ld", "-m", "elf_i386", "-shared", "-o", libs["elf32"], obj], check=True)
    return libs


def test_matches_pyelftools_on_a_built_library(built) -> None:
    syms = FunctionSymbols(str(built["full"]))
    assert as_dict(syms) == reference(built["full"])
    names = {name for _, _, name in syms.items()}
    # static functions come from .symtab; the data symbol does not count
    assert {"hidden_helper", "exported_one"} <= names and "table_value" not in names
    # the IFUNC's address is its resolver's: named by whichever comes first in .symtab
    assert {"picked", "resolve_picked"} & names
    # two names at one address: the first in table order names it, as pyelftools reads it
    assert len({"exported_two", "alias_of_two"} & names) == 1
    start = next(s for s, _, n in syms.items() if n == "exported_one")
    size = next(z for s, z, _ in syms.items() if s == start)
    assert syms.lookup(start) == ("exported_one", 0)
    assert syms.lookup(start + size - 1) == ("exported_one", size - 1)
    assert syms.lookup(0) is None


def test_stripped_library_keeps_its_dynamic_symbols(built) -> None:
    syms = FunctionSymbols(str(built["stripped"]))
    assert as_dict(syms) == reference(built["stripped"])
    names = {name for _, _, name in syms.items()}
    assert {"exported_one", "picked"} <= names and "hidden_helper" not in names
    # the IFUNC counts (type 10); the API list keeps both names of an aliased address
    assert function_names(str(built["stripped"])) == names | {"alias_of_two", "exported_two"}
    assert {"exported_one", "exported_two", "alias_of_two", "picked"} <= exported_functions(str(built["stripped"]))


def test_32_bit_layout(built) -> None:
    if "elf32" not in built:
        pytest.skip("gcc cannot compile for -m32 here (the 32-bit symbol layout is not checked)")
    syms = FunctionSymbols(str(built["elf32"]))
    assert as_dict(syms) == reference(built["elf32"])
    assert "exported_one" in {name for _, _, name in syms.items()}


@pytest.mark.parametrize("which", ["libc", "python"])
def test_matches_pyelftools_on_system_objects(which: str) -> None:
    if which == "libc":
        path = next((p for p in ("/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6") if Path(p).exists()), None)
        if path is None:
            pytest.skip("no glibc at a known path")
    else:
        ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
        shared = Path(sysconfig.get_config_var("LIBDIR") or "") / ldlib
        path = str(shared if ".so" in ldlib and shared.exists() else Path(sys.executable).resolve())
    syms = FunctionSymbols(path)
    assert len(syms) > 500
    assert as_dict(syms) == reference(path)


def test_a_file_that_lies_about_its_string_table_is_refused(built, tmp_path) -> None:
    """A string table whose offset points past the end of the file: a clear error, not garbage."""
    bad = tmp_path / "bad.so"
    data = bytearray(built["full"].read_bytes())
    with open(built["full"], "rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".symtab")
        link = sec["sh_link"]
        header = elf["e_shoff"] + link * elf["e_shentsize"]
    # Elf64_Shdr: name(4) type(4) flags(8) addr(8) offset(8) size(8): the offset is at +24
    data[header + 24:header + 32] = (len(data) + 4096).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(SymbolTableError, match="past the end of the file"):
        FunctionSymbols(str(bad))
    # the API list reads .dynsym, whose own string table is intact
    assert "exported_one" in exported_functions(str(bad))
