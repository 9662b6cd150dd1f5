"""Native stack symbolisation against a real process (this one): addresses in executable anonymous
memory (a driver's generated code, JIT code) and addresses in no mapping at all (a stale frame
record's garbage) cost a lookup in the maps kept for the process, not a re-read of /proc/PID/maps
per stack; the maps are read again after forget() (a library load) and, for an address in no
mapping, at most once per MAPS_REREAD_NS. No root needed."""

from __future__ import annotations

import ctypes
import mmap
import os

from recorder.core import stacks
from recorder.core.stacks import NativeSymbolizer

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _executable_anonymous_page() -> int:
    """A private anonymous page mapped readable and executable, as generated code is."""
    address = _libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert address and address != ctypes.c_void_p(-1).value, os.strerror(ctypes.get_errno())
    return address


def _libc_function() -> int:
    return ctypes.cast(_libc.getpid, ctypes.c_void_p).value


def test_anonymous_code_and_garbage_do_not_reread_the_maps() -> None:
    page = _executable_anonymous_page()
    try:
        anon = page + 16
        libc = _libc_function()
        garbage = 0x10  # below every mapping
        sym = NativeSymbolizer()
        pid = os.getpid()
        for _ in range(1000):  # a thousand new stacks through the same memory
            frames = sym.frames(pid, [libc, anon, garbage])
        assert sym.maps_reads == 1
        assert frames[0].object and "libc" in frames[0].object and frames[0].symbol in ("getpid", "__getpid")
        assert frames[1].object is None and frames[1].symbol is None and frames[1].address == anon
        assert frames[2].object is None and frames[2].address == garbage
    finally:
        _libc.munmap(page, mmap.PAGESIZE)


def test_maps_are_read_again_after_a_library_load_and_once_a_while_for_a_miss(monkeypatch) -> None:
    sym = NativeSymbolizer()
    pid = os.getpid()
    libc = _libc_function()
    sym.frames(pid, [libc])
    assert sym.maps_reads == 1
    # memory mapped after the read: found once the process is said to have loaded a library
    page = _executable_anonymous_page()
    try:
        fresh = page
        monkeypatch.setattr(stacks, "MAPS_REREAD_NS", 10**15)  # no time-based re-read in this part
        sym.frames(pid, [fresh])  # in no mapping of the maps read: remembered as a miss
        sym.frames(pid, [fresh])
        assert sym.maps_reads == 1
        sym.forget(pid)
        assert sym.frames(pid, [fresh])[0].address == fresh
        assert sym.maps_reads == 2
        # an address in no mapping re-reads the maps once MAPS_REREAD_NS has passed, and only once
        monkeypatch.setattr(stacks, "MAPS_REREAD_NS", 0)
        sym.frames(pid, [0x20])
        assert sym.maps_reads == 3
        sym.frames(pid, [0x20])  # a known miss since that read
        assert sym.maps_reads == 3
    finally:
        _libc.munmap(page, mmap.PAGESIZE)


def test_a_process_that_is_gone_keeps_its_last_maps() -> None:
    sym = NativeSymbolizer()
    assert sym.frames(2**22 + 12345, [0x1000])[0].object is None  # no such process: no mapping, no error
