"""CPython stacks at uprobes: target detection, the BPF walker's configuration, frame resolution.

The BPF side (bpf/pystack.h) records, for each traced call, (code object address, instruction,
checksum) per frame. This module:

- `detect(pid)` finds the interpreter in a process and how to walk it (offsets per version),
- `PyStackProbe(bpf)` wires the walker programs and fills the per-process map,
- `StackResolver` turns recorded frames into file, qualified name and the *executing* line,
- `parse_pystack_event(data)` reads one `pystack_event` from the `pystacks` ring buffer.

Layouts here mirror structs in bpf/pystack.h; tests/test_pyframes_layout.py compiles the header
with gcc and fails if the two drift.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bpf import BPF_DIR

HEADER = BPF_DIR / "pystack.h"

MAX_FRAMES = 64

# pystack_event.status, as #defined in bpf/pystack.h
STATUS_OK = 0
STATUS_TRUNCATED = 1
STATUS_NOT_CONFIGURED = 2
STATUS_UNSUPPORTED = 3
STATUS_NO_THREAD_STATE = 4
STATUS_READ_ERROR = 5
STATUS_NOT_INSTALLED = 6
STATUS_NAMES: dict[int, str] = {
    STATUS_OK: "ok",
    STATUS_TRUNCATED: "truncated",
    STATUS_NOT_CONFIGURED: "not configured",
    STATUS_UNSUPPORTED: "unsupported interpreter",
    STATUS_NO_THREAD_STATE: "no python thread state",
    STATUS_READ_ERROR: "read error",
    STATUS_NOT_INSTALLED: "walker not installed",
}
# pystack_counts slots after the statuses
COUNT_NAMES: dict[int, str] = {
    **STATUS_NAMES,
    len(STATUS_NAMES): "ringbuf full",
    len(STATUS_NAMES) + 1: "scratch clobbered",
    len(STATUS_NAMES) + 2: "sent as digest",  # a known stack's capture: no record, its digest
}

# pystack_proc.flags
F_CFRAME = 1
F_LASTI_INT = 2
F_NAME_HASH = 4
F_DATASTACK = 8  # frames allocated in a per-thread data stack (3.11+): read a window at a time
F_CODE_CACHE = 16  # the code deallocator is probed: code checksums are kept across walks
TP_DEALLOC = 48  # offsetof(PyTypeObject, tp_dealloc) on 64-bit builds, every supported version

PROG_FIND = 0
PROG_WALK = 1
PROG_SCAN = 2

# pystack_frame.pad (bpf/pystack.h): a frame whose code object head the walker could not read, and
# the entry after the frames that says which read ended the walk (what << 8), its `code` the address
FRAME_CODE_UNREAD = 1
FRAME_FAILED = 2
FAILED_WHAT: dict[int, str] = {1: "task", 2: "interpreter state", 3: "frame", 4: "code pointer"}

# The Python mirrors of the C structs: (field, struct format) in declaration order.
EVENT_HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("ts", "Q"), ("pid", "I"), ("tid", "I"), ("nframes", "I"), ("status", "I"), ("digest", "Q"),
)
FRAME_FIELDS: tuple[tuple[str, str], ...] = (
    ("code", "Q"), ("instr", "Q"), ("checksum", "I"), ("pad", "I"),
)
PROC_FIELDS: tuple[tuple[str, str], ...] = (
    ("runtime", "Q"), ("code_type", "Q"),
    ("status", "I"), ("flags", "I"), ("fsbase", "I"), ("version", "I"),
    ("runtime_interpreters_head", "H"), ("interp_next", "H"), ("interp_threads_head", "H"),
    ("tstate_next", "H"), ("tstate_thread_id", "H"), ("tstate_frame", "H"),
    ("cframe_current_frame", "H"), ("frame_code", "H"), ("frame_back", "H"),
    ("frame_instr", "H"), ("frame_owner", "H"), ("code_firstlineno", "H"),
    ("code_version", "H"), ("code_name", "H"), ("str_hash", "H"), ("code_filename", "H"),
    ("generation", "I"), ("pad2", "I"),
)
_EVENT_HEADER = struct.Struct("=" + "".join(f for _, f in EVENT_HEADER_FIELDS))
_FRAME = struct.Struct("=" + "".join(f for _, f in FRAME_FIELDS))
_PROC = struct.Struct("=" + "".join(f for _, f in PROC_FIELDS))
EVENT_SIZE = _EVENT_HEADER.size + MAX_FRAMES * _FRAME.size


# ---------------------------------------------------------------------------------------------
# Events


@dataclass(frozen=True)
class PyStackEvent:
    ts: int  # ns CLOCK_MONOTONIC, the probe's own timestamp (join key with pid, tid)
    pid: int
    tid: int
    status: int
    frames: tuple[tuple[int, int, int], ...]  # (code address, instr, checksum), innermost first
    digest: int = 0  # the stack's identity in its process image (bpf/pystack.h), 0 when none
    unread: tuple[int, ...] = ()  # indices of frames whose code object the walker could not read
    failed: tuple[str, int] | None = None  # read error: what could not be read, and its address

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, f"status {self.status}")


def parse_pystack_event(data: bytes) -> PyStackEvent:
    """One record from the `pystacks` ring buffer (only the filled frames are sent)."""
    ts, pid, tid, nframes, status, digest = _EVENT_HEADER.unpack_from(data, 0)
    nframes = min(nframes, MAX_FRAMES, (len(data) - _EVENT_HEADER.size) // _FRAME.size)
    raw = [_FRAME.unpack_from(data, _EVENT_HEADER.size + i * _FRAME.size) for i in range(nframes)]
    failed = None
    if raw and raw[-1][3] & FRAME_FAILED:
        code, _instr, _sum, pad = raw.pop()
        failed = (FAILED_WHAT.get(pad >> 8, f"read {pad >> 8}"), code)
    frames = tuple((code, instr, checksum) for code, instr, checksum, _pad in raw)
    unread = tuple(i for i, f in enumerate(raw) if f[3] & FRAME_CODE_UNREAD)
    return PyStackEvent(ts, pid, tid, status, frames, digest, unread, failed)


# ---------------------------------------------------------------------------------------------
# Offsets


@dataclass(frozen=True)
class PyOffsets:
    """Byte offsets of what the walker and the resolver read, for one CPython minor version."""

    runtime_interpreters_head: int
    interp_next: int
    interp_threads_head: int
    tstate_next: int
    tstate_thread_id: int
    tstate_frame: int
    cframe_current_frame: int | None  # None: tstate_frame is the top frame itself
    frame_code: int
    frame_back: int
    frame_instr: int
    frame_owner: int | None
    code_filename: int
    code_name: int
    code_qualname: int | None  # None before 3.11: co_name is the best name there is
    code_firstlineno: int
    code_linetable: int
    code_adaptive: int | None  # None in 3.10: the instruction is f_lasti, not a pointer
    code_version: int | None  # co_version (3.12+): unique per code object
    str_hash: int = 24
    str_length: int = 16
    str_state: int = 32
    str_ascii_size: int = 40
    str_compact_size: int = 56
    bytes_size: int = 16
    bytes_data: int = 32


# x86-64 release builds, offsetof() against the installed headers (tests/pyframes/offsets.c
# re-measures them for every interpreter on the machine). 3.13+ come from _Py_DebugOffsets.
OFFSETS: dict[tuple[int, int], PyOffsets] = {
    (3, 10): PyOffsets(
        runtime_interpreters_head=32, interp_next=0, interp_threads_head=8, tstate_next=8,
        tstate_thread_id=176, tstate_frame=24, cframe_current_frame=None, frame_code=32,
        frame_back=24, frame_instr=96, frame_owner=None, code_filename=104, code_name=112,
        code_qualname=None, code_firstlineno=40, code_linetable=120, code_adaptive=None,
        code_version=None, str_ascii_size=48, str_compact_size=72,
    ),
    (3, 11): PyOffsets(
        runtime_interpreters_head=40, interp_next=0, interp_threads_head=16, tstate_next=8,
        tstate_thread_id=152, tstate_frame=56, cframe_current_frame=8, frame_code=32,
        frame_back=48, frame_instr=56, frame_owner=69, code_filename=112, code_name=120,
        code_qualname=128, code_firstlineno=72, code_linetable=136, code_adaptive=184,
        code_version=None, str_ascii_size=48, str_compact_size=72,
    ),
    (3, 12): PyOffsets(
        runtime_interpreters_head=40, interp_next=0, interp_threads_head=72, tstate_next=8,
        tstate_thread_id=136, tstate_frame=56, cframe_current_frame=0, frame_code=0,
        frame_back=8, frame_instr=56, frame_owner=70, code_filename=112, code_name=120,
        code_qualname=128, code_firstlineno=68, code_linetable=136, code_adaptive=192,
        code_version=92,
    ),
}
# co_version is not in _Py_DebugOffsets; offsetof(PyCodeObject, co_version) per minor.
CODE_VERSION_OFFSET: dict[tuple[int, int], int] = {(3, 13): 92}
SUPPORTED = "CPython 3.10-3.13 (x86-64, GIL builds)"


def _debug_offsets_313(raw: bytes) -> tuple[PyOffsets, bool]:
    """(offsets, free_threaded) from 3.13's `_Py_DebugOffsets` (internal/pycore_runtime.h)."""
    v = struct.unpack_from("<" + "Q" * (len(raw) // 8), raw[: len(raw) // 8 * 8])
    # cookie(1) version(2) free_threaded(3), then struct by struct; each starts with its size
    free_threaded = bool(v[2])
    rt = 3  # runtime_state: size, finalizing, interpreters_head
    it = rt + 3  # interpreter_state: size, id, next, threads_head, gc, ... (13 fields)
    th = it + 13  # thread_state: size, prev, next, interp, current_frame, thread_id, ... (9)
    fr = th + 9  # interpreter_frame: size, previous, executable, instr_ptr, localsplus, owner
    co = fr + 6  # code_object: size, filename, name, qualname, linetable, firstlineno, ...(10)
    ob = co + 10  # pyobject (2), type_object (4), tuple (3), list (3), dict (3), float (2),
    uni = ob + 2 + 4 + 3 + 3 + 3 + 2 + 3 + 3  # long (3), bytes (3), then unicode_object
    by = uni - 3  # bytes_object: size, ob_size, ob_sval
    offsets = PyOffsets(
        runtime_interpreters_head=v[rt + 2], interp_next=v[it + 2], interp_threads_head=v[it + 3],
        tstate_next=v[th + 2], tstate_thread_id=v[th + 5], tstate_frame=v[th + 4],
        cframe_current_frame=None, frame_code=v[fr + 2], frame_back=v[fr + 1],
        frame_instr=v[fr + 3], frame_owner=v[fr + 5], code_filename=v[co + 1],
        code_name=v[co + 2], code_qualname=v[co + 3], code_firstlineno=v[co + 5],
        code_linetable=v[co + 4], code_adaptive=v[co + 9],
        code_version=CODE_VERSION_OFFSET[(3, 13)], str_state=v[uni + 1], str_length=v[uni + 2],
        str_ascii_size=v[uni + 3], str_compact_size=v[uni + 3] + 16, bytes_size=v[by + 1],
        bytes_data=v[by + 2],
    )
    return offsets, free_threaded


# ---------------------------------------------------------------------------------------------
# Detection


@dataclass(frozen=True)
class Unsupported:
    """A process whose Python stacks cannot be read, and why (stored in the capability table)."""

    pid: int
    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class PythonTarget:
    pid: int
    elf_path: str  # the object defining _PyRuntime (executable or libpython), as mapped
    version: tuple[int, int, int]
    runtime: int  # run-time address of _PyRuntime
    code_type: int  # run-time address of PyCode_Type
    load_bias: int
    offsets: PyOffsets = field(repr=False)
    runtime_size: int = 0  # bytes of _PyRuntime (its ELF symbol's size): the GIL lies inside it

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


@dataclass(frozen=True)
class _Mapping:
    start: int
    offset: int
    path: str


def _maps(pid: int) -> list[_Mapping]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                out.append(_Mapping(int(parts[0].split("-")[0], 16), int(parts[2], 16),
                                    parts[5].rstrip("\n")))
    return out


def _read_mem(pid: int, addr: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        return os.pread(f.fileno(), size, addr)


@dataclass(frozen=True)
class _ElfFacts:
    elf_type: str
    first_load_vaddr: int
    symbols: dict[str, int]  # defined symbols we care about -> st_value
    pyruntime_section: int | None
    runtime_size: int = 0  # st_size of _PyRuntime (or the .PyRuntime section's size)


_WANTED = ("_PyRuntime", "Py_Version", "PyCode_Type")


_FACTS: dict[tuple[int, int, int, int], _ElfFacts] = {}  # (dev, inode, size, mtime) -> facts


def _elf_facts(path: str) -> _ElfFacts:
    """What detection needs from an interpreter's ELF file, read once per file: every rank or
    worker exec'ing the same Python is configured without parsing it again (~7 ms each), which is
    time its first calls would otherwise spend unconfigured."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    facts = _FACTS.get(key)
    if facts is None:
        if len(_FACTS) >= 64:
            _FACTS.clear()
        facts = _FACTS[key] = _read_elf_facts(path)
    return facts


def _read_elf_facts(path: str) -> _ElfFacts:
    from elftools.elf.elffile import ELFFile  # deferred: only detection needs it

    with open(path, "rb") as f:
        elf = ELFFile(f)
        if elf["e_machine"] != "EM_X86_64":
            raise ValueError(f"{elf['e_machine']} binaries are not supported (x86-64 only)")
        loads = [s["p_vaddr"] for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        symbols: dict[str, int] = {}
        runtime_size = 0
        # the GNU hash table finds exported symbols without reading every symbol (ms, not 100s of
        # ms: detection runs between a Python's exec and its first traced call)
        table = elf.get_section_by_name(".gnu.hash")
        for wanted in _WANTED if table is not None and hasattr(table, "get_symbol") else ():
            sym = table.get_symbol(wanted)  # type: ignore[union-attr]  # a GNU hash section (hasattr above)
            if sym is not None and sym["st_shndx"] != "SHN_UNDEF" and sym["st_value"]:
                symbols[wanted] = sym["st_value"]
                if wanted == "_PyRuntime":
                    runtime_size = sym["st_size"]
        complete = "_PyRuntime" in symbols and "PyCode_Type" in symbols  # Py_Version: 3.11+ only
        for name in (".dynsym", ".symtab") if not complete else ():
            sec = elf.get_section_by_name(name)
            if sec is None:
                continue
            for wanted in _WANTED:
                if wanted in symbols:
                    continue
                for sym in sec.get_symbol_by_name(wanted) or []:  # type: ignore[attr-defined]  # a symbol table
                    # extension modules reference _PyRuntime too: only a definition counts
                    if sym["st_shndx"] != "SHN_UNDEF" and sym["st_value"]:
                        symbols[wanted] = sym["st_value"]
                        if wanted == "_PyRuntime":
                            runtime_size = sym["st_size"]
                        break
        sec = elf.get_section_by_name(".PyRuntime")
        if not runtime_size and sec is not None:
            runtime_size = sec["sh_size"]
        return _ElfFacts(elf["e_type"], min(loads) if loads else 0, symbols,
                         sec["sh_addr"] if sec is not None else None, runtime_size)


_VERSION_IN_NAME = re.compile(r"python(\d)\.(\d+)(t?)")


def detect(pid: int) -> PythonTarget | Unsupported:
    """How to walk the Python stacks of `pid`, or why they cannot be walked. Never raises."""
    try:
        return _detect(pid)
    except (OSError, ValueError, KeyError, struct.error) as e:
        return Unsupported(pid, f"cannot inspect process: {e}")
    except Exception as e:  # pyelftools raises its own types on corrupt files
        return Unsupported(pid, f"cannot inspect process: {type(e).__name__}: {e}")


def _detect(pid: int) -> PythonTarget | Unsupported:
    maps = _maps(pid)
    exe = os.readlink(f"/proc/{pid}/exe")
    # the executable first (static builds), then any libpython (shared builds, embedders)
    paths = [exe] + sorted({m.path for m in maps if "libpython" in os.path.basename(m.path)})
    for path in paths:
        mapped = [m for m in maps if m.path == path]
        if not mapped:
            continue
        facts = _elf_facts(f"/proc/{pid}/root{path}")
        runtime = facts.symbols.get("_PyRuntime", facts.pyruntime_section)
        if runtime is None:
            continue
        if facts.elf_type == "ET_EXEC":
            bias = 0
        else:
            base = [m for m in mapped if m.offset == 0]
            if not base:
                return Unsupported(pid, f"{path}: no mapping at file offset 0")
            bias = base[0].start - (facts.first_load_vaddr & ~0xFFF)
        return _target(pid, path, facts, runtime + bias, bias)
    if any(_VERSION_IN_NAME.search(os.path.basename(p)) for p in paths):
        return Unsupported(pid, f"{exe}: no _PyRuntime symbol (stripped, or older than 3.7)")
    return Unsupported(pid, f"not a CPython process ({exe}: no _PyRuntime)")


def _target(
    pid: int, path: str, facts: _ElfFacts, runtime: int, bias: int
) -> PythonTarget | Unsupported:
    name = _VERSION_IN_NAME.search(os.path.basename(path))
    if "Py_Version" in facts.symbols:
        (hexversion,) = struct.unpack("<I", _read_mem(pid, facts.symbols["Py_Version"] + bias, 4))
        version = (hexversion >> 24, (hexversion >> 16) & 0xFF, (hexversion >> 8) & 0xFF)
    elif name:
        version = (int(name.group(1)), int(name.group(2)), 0)
    else:
        return Unsupported(pid, f"{path}: CPython version unknown (no Py_Version, name gives none)")
    minor = version[:2]
    text = ".".join(map(str, version[:2]))
    if "PyCode_Type" not in facts.symbols:
        return Unsupported(pid, f"{path}: no PyCode_Type symbol")
    code_type = facts.symbols["PyCode_Type"] + bias
    if name and name.group(3) == "t":
        return Unsupported(pid, f"CPython {text} free-threaded build: not supported")
    if minor in OFFSETS:
        offsets = OFFSETS[minor]
    elif minor == (3, 13):
        raw = _read_mem(pid, runtime, 1024)
        if raw[:8] != b"xdebugpy":
            return Unsupported(pid, f"CPython {text}: _Py_DebugOffsets cookie missing")
        offsets, free_threaded = _debug_offsets_313(raw)
        if free_threaded:
            return Unsupported(pid, f"CPython {text} free-threaded build: not supported")
    else:
        return Unsupported(pid, f"CPython {text} is not supported ({SUPPORTED})")
    return PythonTarget(pid, path, version, runtime, code_type, bias, offsets, facts.runtime_size)


# ---------------------------------------------------------------------------------------------
# The BPF side


def bpf_source() -> str:
    """bpf/pystack.h's text, to paste before the probes that use PYSTACK_CAPTURE (BCC rewrites
    map syntax only in the main text, so the header cannot simply be #included)."""
    return HEADER.read_text()


def proc_config(target: PythonTarget | Unsupported, fsbase_offset: int, generation: int = 0,
                code_cache: bool = False) -> dict[str, int]:
    """The pystack_proc map value for a target (an Unsupported one gets status records only).
    `code_cache`: the code deallocator is probed (PyStackProbe), so checksums outlive a walk."""
    values = {name: 0 for name, _ in PROC_FIELDS}
    values["fsbase"] = fsbase_offset
    values["generation"] = generation & 0xFFFFFFFF
    if isinstance(target, Unsupported):
        values["status"] = STATUS_UNSUPPORTED
        return values
    o = target.offsets
    flags = 0
    if o.cframe_current_frame is not None:
        flags |= F_CFRAME
    if o.code_adaptive is None:
        flags |= F_LASTI_INT
    else:
        flags |= F_DATASTACK
    if o.code_version is None:
        flags |= F_NAME_HASH
    if code_cache:
        flags |= F_CODE_CACHE
    values.update(
        runtime=target.runtime, code_type=target.code_type, status=STATUS_OK, flags=flags,
        version=(target.version[0] << 8) | target.version[1],
        runtime_interpreters_head=o.runtime_interpreters_head, interp_next=o.interp_next,
        interp_threads_head=o.interp_threads_head, tstate_next=o.tstate_next,
        tstate_thread_id=o.tstate_thread_id, tstate_frame=o.tstate_frame,
        cframe_current_frame=o.cframe_current_frame or 0, frame_code=o.frame_code,
        frame_back=o.frame_back, frame_instr=o.frame_instr, frame_owner=o.frame_owner or 0,
        code_firstlineno=o.code_firstlineno, code_version=o.code_version or 0,
        code_name=o.code_name, str_hash=o.str_hash, code_filename=o.code_filename,
    )
    return values


def checksum(firstlineno: int, co_version: int | None, name_hash: int | None, filename: int) -> int:
    """The walker's per-frame checksum (pystack_walk in bpf/pystack.h), recomputed from memory.
    `filename` is the address of co_filename: module bodies share first line and name (and before
    3.12 have no co_version), so a module's code freed and another's put at its address (a .pth
    line site exec'd at start-up, then the script's) differ only by their file."""
    s = ((firstlineno & 0xFFFFFFFF) * 0x9E3779B1) & 0xFFFFFFFF
    if co_version is not None:
        s ^= co_version & 0xFFFFFFFF
    if name_hash is not None:
        h = name_hash & 0xFFFFFFFFFFFFFFFF
        s ^= (h & 0xFFFFFFFF) ^ (h >> 32)
    s ^= ((filename >> 3) & 0xFFFFFFFF) ^ ((filename >> 35) & 0xFFFFFFFF)
    return s


class PyStackProbe:
    """Wires bpf/pystack.h's walker into a loaded BCC program and configures target processes.

        bpf = BPF(text=bpf_source() + probes)   # probes end with PYSTACK_CAPTURE(ctx, ts)
        probe = PyStackProbe(bpf); probe.install(); probe.configure(pid)

    Tracepoint probes end with PYSTACK_CAPTURE_TP(args, ts) and need install_tracepoints().
    """

    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf
        self._fsbase: int | None = None
        self.targets: dict[int, PythonTarget | Unsupported] = {}
        self._generation = 0
        # (device, inode, deallocator address) of an interpreter file -> why its code objects'
        # deallocation is not probed (None: probed, checksums are kept across walks)
        self._freed_probes: dict[tuple[int, int, int], str | None] = {}
        self.code_cache: dict[int, str | None] = {}  # pid -> as above, per configured target

    def install(self) -> None:
        """Wire the walker for uprobes (PYSTACK_CAPTURE)."""
        from bcc import BPF  # deferred: importing bcc needs the distribution's package

        self._install("pystack_progs", "pystack_", BPF.KPROBE)

    def install_tracepoints(self) -> None:
        """Wire the walker's tracepoint copy (PYSTACK_CAPTURE_TP: sched_switch, block_bio_queue)."""
        from bcc import BPF

        self._install("pystack_tp_progs", "pystack_tp_", BPF.TRACEPOINT)

    def install_perf_events(self) -> None:
        """Wire the walker's perf event copy (PYSTACK_CAPTURE_PE: the on-CPU profile's samples)."""
        from bcc import BPF

        self._install("pystack_pe_progs", "pystack_pe_", BPF.PERF_EVENT)

    def _install(self, table: str, prefix: str, prog_type: int) -> None:
        progs = self.bpf.get_table(table)
        for slot, name in ((PROG_FIND, "find"), (PROG_WALK, "walk"), (PROG_SCAN, "scan")):
            fn = self.bpf.load_func(prefix + name, prog_type)
            progs[ctypes.c_int(slot)] = ctypes.c_int(fn.fd)

    def _fsbase_offset(self) -> int:
        if self._fsbase is None:
            from recorder.core.btf import member_offset

            self._fsbase = member_offset("task_struct.thread.fsbase")
        return self._fsbase

    def configure(self, pid: int, code_cache: bool = True) -> PythonTarget | Unsupported:
        """Detect `pid` and tell the walker how to read it; an Unsupported target still gets
        records (status "unsupported interpreter") so its calls are counted, not lost.
        `code_cache=False` makes the walker read every code object at every walk (benchmarks)."""
        target = detect(pid)
        table = self.bpf.get_table("pystack_procs")
        leaf = table.Leaf()
        if not code_cache:
            cache_off: str | None = "turned off"
        elif isinstance(target, PythonTarget):
            cache_off = self._probe_code_freed(target)
        else:
            cache_off = "not a supported interpreter"
        self._generation += 1
        config = proc_config(target, self._fsbase_offset(), self._generation, cache_off is None)
        for name, value in config.items():
            setattr(leaf, name, value)
        table[table.Key(pid)] = leaf
        self.targets[pid] = target
        self.code_cache[pid] = cache_off
        return target

    def _probe_code_freed(self, target: PythonTarget) -> str | None:
        """Attach pystack_code_freed to the interpreter's code deallocator (PyCode_Type's
        tp_dealloc, read from the target: stripped builds have it too), once per file; None when
        it is probed, else why not (then the walker reads every code object at every walk)."""
        path = f"/proc/{target.pid}/root{target.elf_path}"
        try:
            dealloc = struct.unpack("<Q", _read_mem(target.pid, target.code_type + TP_DEALLOC, 8))[0]
            st = os.stat(path)
        except (OSError, struct.error) as e:
            return f"code deallocator unreadable: {e}"
        key = (st.st_dev, st.st_ino, dealloc - target.load_bias)
        if key not in self._freed_probes:
            try:
                # BCC takes the address as the file's virtual address (symbol values' space)
                self.bpf.attach_uprobe(name=path, addr=dealloc - target.load_bias,
                                       fn_name="pystack_code_freed")
                self._freed_probes[key] = None
            except Exception as e:  # any attach failure: no cache, and walks stay correct
                self._freed_probes[key] = f"code deallocator not probed: {e}"
        return self._freed_probes[key]

    def forget(self, pid: int) -> None:
        table = self.bpf.get_table("pystack_procs")
        try:
            del table[table.Key(pid)]
        except KeyError:
            pass
        self.targets.pop(pid, None)
        self.code_cache.pop(pid, None)

    def confirm(self, digests: Iterable[int]) -> None:
        """Tell the walker these stack digests are held by user space: a capture made with
        PYSTACK_CAPTURE_BY_DIGEST that has one of them sends the digest instead of its record."""
        table = self.bpf.get_table("pystack_known")
        for d in digests:
            table[table.Key(d)] = table.Leaf(1)

    def counts(self) -> dict[str, int]:
        """Records per status plus losses (ring buffer full, scratch clobbered), all CPUs."""
        table = self.bpf.get_table("pystack_counts")
        return {
            COUNT_NAMES[k.value]: int(sum(v)) for k, v in table.items() if k.value in COUNT_NAMES
        }


# ---------------------------------------------------------------------------------------------
# Resolution


@dataclass(frozen=True)
class PyFrame:
    filename: str
    qualname: str
    line: int | None  # the executing line (the call site), None if the code has none there
    code_addr: int
    error: str | None = None  # set when the frame could not be resolved; names are then empty
    first_line: int | None = None  # co_firstlineno (the def line), None when unresolved

    @property
    def available(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        if self.error:
            return f"<unavailable: {self.error}>"
        return f"{self.qualname}() at {self.filename}:{self.line}"


@dataclass(frozen=True)
class _Code:
    filename: str
    qualname: str
    firstlineno: int
    linetable: bytes


def _varint(t: bytes, i: int) -> tuple[int, int]:
    b = t[i]
    val, shift = b & 63, 0
    while b & 64:
        i += 1
        b = t[i]
        shift += 6
        val |= (b & 63) << shift
    return val, i + 1


def line_310(table: bytes, firstlineno: int, addr: int) -> int | None:
    """3.10 co_linetable: (byte delta, signed line delta) pairs; mirrors _PyCode_CheckLineNumber."""
    if addr < 0:
        return firstlineno
    line, ar_line, end, i = firstlineno, None, 0, 0
    while end <= addr:
        if i + 1 >= len(table):
            return None
        while True:
            start = end
            end += table[i]
            delta = table[i + 1] - 256 if table[i + 1] > 127 else table[i + 1]
            i += 2
            if delta == -128:
                ar_line = None
            else:
                line += delta
                ar_line = line
            if start != end or i + 1 >= len(table):
                break
    return ar_line


def line_311(table: bytes, firstlineno: int, addr: int) -> int | None:
    """3.11+ location table (Objects/locations.md); `addr` in bytes from the first instruction."""
    if addr < 0:
        return firstlineno
    line, start, i = firstlineno, 0, 0
    while i < len(table):
        head = table[i]
        code = (head >> 3) & 15
        end = start + ((head & 7) + 1) * 2
        i += 1
        if code in (13, 14):
            raw, i = _varint(table, i)
            line += -(raw >> 1) if raw & 1 else raw >> 1
        elif code in (10, 11, 12):
            line += code - 10
        if start <= addr < end:
            return None if code == 15 else line
        while i < len(table) and not table[i] & 128:  # skip the rest of the entry
            i += 1
        start = end
    return None


# Above any live object's reference count (3.12's immortal objects have 2**32 - 1) and below any
# address the allocator's free-list link can hold in the same word.
_LIVE_REFCNT = 1 << 40


class StackResolver:
    """(pid, frames) -> PyFrames, reading /proc/PID/mem. Cached by (pid, code address, checksum):
    the checksum is recomputed from memory before anything is cached, so a code address freed and
    reused by another code object is reported unavailable rather than misattributed."""

    def __init__(self, targets: dict[int, PythonTarget | Unsupported] | None = None) -> None:
        self.targets: dict[int, PythonTarget | Unsupported] = targets if targets is not None else {}
        self._codes: dict[tuple[int, int, int | None], _Code] = {}
        self._mem: dict[int, int] = {}
        self.failures: dict[str, int] = {}  # reason -> frames, for the loss table
        self._page_states: dict[tuple[int, int], str] = {}  # (pid, page) -> state when a read failed

    def close(self) -> None:
        for fd in self._mem.values():
            os.close(fd)
        self._mem.clear()

    def forget(self, pid: int) -> None:
        """Drop a process (after it exited): its memory can no longer be read."""
        fd = self._mem.pop(pid, None)
        if fd is not None:
            os.close(fd)
        self._codes = {k: v for k, v in self._codes.items() if k[0] != pid}
        self._page_states = {k: v for k, v in self._page_states.items() if k[0] != pid}

    def _read(self, pid: int, addr: int, size: int) -> bytes:
        if not 0 <= addr < 1 << 63:  # a pointer read from memory freed and reused since the capture
            raise OSError(f"not a user address: {addr:#x}")
        fd = self._mem.get(pid)
        if fd is not None:
            try:
                data = os.pread(fd, size, addr)
                if len(data) == size:
                    return data
            except OSError:
                pass
            # An open /proc/PID/mem reads the memory of the image it was opened on: after an exec
            # (whose event may come a batch after the new image's first stacks) it is opened again
            os.close(self._mem.pop(pid))
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        self._mem[pid] = fd
        data = os.pread(fd, size, addr)
        if len(data) != size:
            raise OSError(f"short read at {addr:#x}")
        return data

    def page_state(self, pid: int, addr: int) -> str:
        """Why a read of `addr` in process `pid` may have failed without faulting: its page's state
        now, from /proc/PID/pagemap (read before anything faults the page in). A page this
        resolver faulted in itself, reading back a code object of an earlier record, keeps the
        state it had then: the captures of one round of reads failed for the same reason."""
        key = (pid, addr >> 12)
        try:
            with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
                entry = int.from_bytes(os.pread(f.fileno(), 8, (addr >> 12) * 8), "little")
            if entry >> 63 & 1:
                return self._page_states.get(key, "page not resident (faulted in since)")
            if entry >> 62 & 1:
                state = "page swapped out"
            else:
                state = "address not mapped"
                with open(f"/proc/{pid}/maps") as f:
                    for line in f:
                        lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
                        if lo <= addr < hi:
                            state = "page not resident"
                            break
        except (OSError, ValueError):
            return "page state unknown (process gone)"
        if len(self._page_states) >= 4096:
            self._page_states.clear()
        self._page_states[key] = state
        return state

    def resolve(self, pid: int, frames: Iterable[tuple[int, int, int | None]]) -> list[PyFrame]:
        """Frames (code, instr, checksum) -> PyFrames; a checksum None is a code object the walker
        could not read (its page was not resident): it is read here, with the checks below but
        no checksum to compare."""
        target = self.targets.get(pid)
        if target is None:
            target = self.targets[pid] = detect(pid)
        out = []
        for code, instr, csum in frames:
            if isinstance(target, Unsupported):
                out.append(self._failed(code, f"unsupported: {target.reason}"))
                continue
            try:
                out.append(self._resolve_one(target, code, instr, csum))
            except (OSError, ValueError, IndexError, UnicodeDecodeError, struct.error) as e:
                out.append(self._failed(code, f"unreadable: {e}"))
        return out

    def _failed(self, code: int, reason: str) -> PyFrame:
        key = reason.split(":")[0]
        self.failures[key] = self.failures.get(key, 0) + 1
        return PyFrame("", "", None, code, reason)

    def _resolve_one(self, t: PythonTarget, code: int, instr: int, csum: int | None) -> PyFrame:
        key = (t.pid, code, csum)
        info = self._codes.get(key)
        if info is None:
            info = self._load_code(t, code, csum)
            if info is None:
                return self._failed(code, "code object freed or replaced before it was resolved")
            self._codes[key] = info
        o = t.offsets
        if o.code_adaptive is None:
            lasti = instr - (1 << 32) if instr >= 1 << 31 else instr
            line = line_310(info.linetable, info.firstlineno, lasti * 2)
        else:
            line = line_311(info.linetable, info.firstlineno, instr - (code + o.code_adaptive))
        return PyFrame(info.filename, info.qualname, line, code, first_line=info.firstlineno)

    def _load_code(self, t: PythonTarget, code: int, csum: int | None) -> _Code | None:
        o = t.offsets
        head = self._read(t.pid, code, 144)
        if struct.unpack_from("<Q", head, 8)[0] != t.code_type:
            return None
        firstlineno = struct.unpack_from("<i", head, o.code_firstlineno)[0]
        version = name_hash = None
        name = struct.unpack_from("<Q", head, o.code_name)[0]
        if o.code_version is not None:
            version = struct.unpack_from("<I", head, o.code_version)[0]
        else:
            name_hash = struct.unpack_from("<q", self._read(t.pid, name + o.str_hash, 8))[0]
        if csum is not None and checksum(firstlineno, version, name_hash,
                                         struct.unpack_from("<Q", head, o.code_filename)[0]) != csum:
            return None
        qual = struct.unpack_from("<Q", head, o.code_qualname)[0] if o.code_qualname else name
        filename = struct.unpack_from("<Q", head, o.code_filename)[0]
        table = struct.unpack_from("<Q", head, o.code_linetable)[0]
        info = _Code(self._str(t, filename), self._str(t, qual), firstlineno, self._bytes(t, table))
        # The code object may have been freed while its strings were read, and they reused by
        # another object's: the fields used (and on 3.10/3.11 the name's hash) read again must be
        # unchanged (not the whole head: the reference count changes all the time). A freed block
        # keeps those fields (the allocator writes only its first word, the free list's link), so
        # the reference count must also still be one: a live object's is small and positive.
        again = self._read(t.pid, code, 144)
        used = [(8, 8), (o.code_firstlineno, 4), (o.code_name, 8), (o.code_filename, 8), (o.code_linetable, 8)]
        used += [(off, size) for off, size in ((o.code_qualname, 8), (o.code_version, 4)) if off]
        if any(again[off:off + size] != head[off:off + size] for off, size in used):
            return None
        if not 0 < struct.unpack_from("<q", again, 0)[0] < _LIVE_REFCNT:
            return None
        if version is None and struct.unpack_from("<q", self._read(t.pid, name + o.str_hash, 8))[0] != name_hash:
            return None
        return info

    def _str(self, t: PythonTarget, addr: int) -> str:
        o = t.offsets
        head = self._read(t.pid, addr, o.str_compact_size)
        length = struct.unpack_from("<q", head, o.str_length)[0]
        state = struct.unpack_from("<I", head, o.str_state)[0]
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or not 0 <= length <= 65536:
            raise ValueError(f"str at {addr:#x} is not a compact string")
        start = addr + (o.str_ascii_size if ascii_ else o.str_compact_size)
        data = self._read(t.pid, start, length * kind) if length else b""
        if ascii_:
            return data.decode("ascii")
        return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind])

    def _bytes(self, t: PythonTarget, addr: int) -> bytes:
        o = t.offsets
        size = struct.unpack_from("<q", self._read(t.pid, addr + o.bytes_size, 8))[0]
        if not 0 <= size <= 1 << 24:
            raise ValueError(f"bytes at {addr:#x} has size {size}")
        return self._read(t.pid, addr + o.bytes_data, size) if size else b""


def format_stack(frames: Sequence[PyFrame]) -> str:
    return "\n".join(str(f) for f in frames)
