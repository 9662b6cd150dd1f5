"""Start-up: the session's BPF object calls bpf_probe_read_user(_str) under names BCC's front end
does not look up in the kernel's symbol table (bpf/common.h). That must change nothing but the
compile's cost: every program of the object a session compiles is checked here to be, instruction
for instruction, what it is under the helpers' own names (declared `long` instead of BCC's `int`,
12 programs differed and the verifier rejected one of them), and to cost less CPU to compile.
Skipped with the reason without root.
"""

from __future__ import annotations

import ctypes as ct
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import needs_bpf

pytestmark = [needs_bpf, pytest.mark.bpf]

RENAMES = ("#define bpf_probe_read_user recorder_read_user\n",
           "#define bpf_probe_read_user_str recorder_read_user_str\n")
BPF_LD_IMM64, BPF_CALL = 0x18, 0x85
BPF_PSEUDO_MAP_FD = 1
HELPERS = {112: "probe_read_user", 114: "probe_read_user_str"}  # BPF_FUNC_* numbers


class _Captured(Exception):
    pass


def session_source(tmp_path: Path, monkeypatch) -> tuple[str, list[str]]:
    """The C text and flags a session hands BCC, taken before anything is compiled."""
    import bcc

    from recorder.core.loader import TargetSpec
    from recorder.errors import ProbeError
    from recorder.session import Session

    seen: dict = {}

    class Capture:
        def __init__(self, text=b"", cflags=(), **_kw) -> None:
            seen["text"], seen["cflags"] = text, list(cflags)
            raise _Captured

    monkeypatch.setattr(bcc, "BPF", Capture)
    work = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    try:
        with pytest.raises(ProbeError):
            Session(tmp_path / "s.db", TargetSpec(pids=(work.pid,)), (), "test").begin()
    finally:
        work.kill()
        work.wait()
    text = seen["text"]
    return (text.decode() if isinstance(text, bytes) else text), seen["cflags"]


def compile_programs(text: str, cflags: list[str]) -> tuple[dict[str, list[tuple]], float]:
    """Every function of the compiled module as its instructions (a map's file descriptor replaced
    by the map's name), and the compile's CPU seconds. Compiled only: nothing is loaded or attached."""
    from bcc.libbcc import lib

    lib.bpf_num_tables.restype = ct.c_ulonglong
    lib.bpf_num_tables.argtypes = [ct.c_void_p]
    lib.bpf_table_name.restype = ct.c_char_p
    lib.bpf_table_name.argtypes = [ct.c_void_p, ct.c_ulonglong]
    flags = (ct.c_char_p * len(cflags))(*[f.encode() for f in cflags])
    t0 = time.process_time()
    module = lib.bpf_module_create_c_from_string(text.encode(), 0, flags, len(cflags), True, None)
    cpu = time.process_time() - t0
    assert module, "the session's BPF text did not compile"
    try:
        maps = {}
        for i in range(lib.bpf_num_tables(module)):
            name = lib.bpf_table_name(module, i)
            maps[lib.bpf_table_fd(module, name)] = name.decode()
        programs = {}
        for i in range(lib.bpf_num_functions(module)):
            name = lib.bpf_function_name(module, i)
            code = ct.string_at(lib.bpf_function_start(module, name), lib.bpf_function_size(module, name))
            insns = []
            for op, regs, off, imm in struct.iter_unpack("<BBhi", code):
                if op == BPF_LD_IMM64 and regs >> 4 == BPF_PSEUDO_MAP_FD:
                    imm = maps[imm]
                insns.append((op, regs, off, imm))
            programs[name.decode()] = insns
        return programs, cpu
    finally:
        lib.bpf_module_destroy(module)


def test_renamed_helpers_compile_to_the_same_programs_for_less(tmp_path: Path, monkeypatch) -> None:
    text, cflags = session_source(tmp_path, monkeypatch)
    assert all(line in text for line in RENAMES)
    ours, ours_cpu = compile_programs(text, cflags)
    bcc_names = text
    for line in RENAMES:
        bcc_names = bcc_names.replace(line, "")
    theirs, theirs_cpu = compile_programs(bcc_names, cflags)
    assert len(ours) > 400 and ours.keys() == theirs.keys()
    differ = sorted(name for name in ours if ours[name] != theirs[name])
    assert differ == [], f"{len(differ)} programs compile differently with the helpers renamed: {differ[:10]}"
    # the helpers are really called (by their numbers), from the CUDA, NCCL, walker and task programs
    calling = {name for name, insns in ours.items()
               if any(op == BPF_CALL and regs == 0 and imm in HELPERS for op, regs, _, imm in insns)}
    assert {"cuda_native", "nccl_entry_body", "nccl_return_body", "pystack_walk", "task_openat"} <= calling
    # BCC's front end searched the kernel's symbol table at each of their ~30 call sites: seconds
    assert ours_cpu < 0.85 * theirs_cpu, (ours_cpu, theirs_cpu)
