"""The x86-64 decoder and uprobe classifier of recorder/core/x86insn.py: lengths checked against the
assembler on snippets assembled here and against objdump on the libraries of this machine; how the
kernel carries out each instruction, by kernel version; where an entry probe goes. The real kernel's
behaviour is checked in test_x86insn_bpf.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from recorder.core import x86insn
from recorder.core.x86insn import EMULATED, REFUSED, SINGLE_STEPPED, decide, decode, place_entry

V618, V616, V615, V619 = (6, 18), (6, 16), (6, 15), (6, 19)

# (assembly, what the kernel does on 6.18, its text)
SNIPPETS = [
    ("push %rbp", EMULATED, "push %rbp"),
    ("push %r15", EMULATED, "push %r15"),
    ("mov 0x1234(%rip),%rax", SINGLE_STEPPED, "mov 0x1234(%rip),%rax"),
    ("lea 0x10(%rip),%rdi", SINGLE_STEPPED, "lea 0x10(%rip),%rdi"),
    ("endbr64", SINGLE_STEPPED, "endbr64"),
    ("sub $0x28,%rsp", SINGLE_STEPPED, "sub $0x28,%rsp"),
    ("mov %rsp,%rbp", SINGLE_STEPPED, "mov %rsp,%rbp"),
    ("nop", EMULATED, "nop"),
    ("xchg %ax,%ax", EMULATED, None),
    ("pause", EMULATED, "pause"),
    (".byte 0x0f,0x1f,0x44,0,0", EMULATED, "nopl 0x0(%rax,%rax,1)"),
    (".byte 0x0f,0x1f,0x04,0", SINGLE_STEPPED, "nopl (%rax,%rax,1)"),  # a nopl not in x86_nops
    ("jmp .+0x100", EMULATED, None),
    ("call .+0x100", EMULATED, None),
    ("jne .+0x100", EMULATED, None),
    ("je .+4", EMULATED, None),
    ("jmp *0x10(%rip)", SINGLE_STEPPED, "jmp *0x10(%rip)"),
    ("int3", REFUSED, "int3"),
    ("hlt", REFUSED, "hlt"),
    ("lock incl (%rax)", REFUSED, None),
    (".byte 0x2e,0x0f,0x1f,0x84,0,0,0,0,0", REFUSED, None),
    ("syscall", SINGLE_STEPPED, "syscall"),
    ("movabs $0x5aa3cafebeef,%rax", SINGLE_STEPPED, "movabs $0x5aa3cafebeef,%rax"),
    ("mov %fs:0x28,%rax", SINGLE_STEPPED, None),
    ("vmovdqu (%rsi),%ymm0", REFUSED, None),  # the table is read at the opcode after VEX: 6f is bad
    ("vzeroupper", EMULATED, None),  # c5 f8 77: the kernel takes opcode 77 for a ja (and skips it)
    ("vpaddd %zmm1,%zmm2,%zmm3", SINGLE_STEPPED, None),
    ("test $0x1,%dil", SINGLE_STEPPED, None),
]


def _assemble(lines: list[str], tmp: Path) -> list[bytes]:
    """Each line assembled alone, by the C compiler's assembler (the bytes between two labels)."""
    missing = [tool for tool in ("cc", "objcopy", "nm") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: the snippets are assembled with the C compiler and binutils")
    src = tmp / "s.S"
    src.write_text(".text\n" + "".join(f"a{i}: {line}\n" for i, line in enumerate(lines)) + f"a{len(lines)}:\n")
    obj = tmp / "s.o"
    subprocess.run(["cc", "-c", "-o", str(obj), str(src)], check=True)
    text = subprocess.run(["objcopy", "-O", "binary", "-j", ".text", str(obj), "/dev/stdout"],
                          capture_output=True, check=True).stdout
    nm = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    at = {int(n[1:]): int(a, 16) for a, _, n in (line.split() for line in nm.splitlines())}
    return [text[at[i]:at[i + 1]] for i in range(len(lines))]


def test_snippets_decode_to_the_assembler_s_length_and_kernel_handling(tmp_path):
    codes = _assemble([s for s, _, _ in SNIPPETS], tmp_path)
    for (asm, kind, text), code in zip(SNIPPETS, codes, strict=True):
        insn = decode(code + b"\xcc" * 16)
        assert insn.length == len(code), (asm, code.hex(" "))
        assert decide(insn, V618).kind == kind, (asm, decide(insn, V618))
        if text:
            assert insn.text() == text, asm


def test_nop_emulation_follows_the_kernel_version():
    nop5, nopl4_other = decode(x86insn.NOP5), decode(b"\x0f\x1f\x04\x00")
    assert decide(nop5, V615).kind == SINGLE_STEPPED  # only 0x90 forms before 6.16
    assert decide(nop5, V616).kind == EMULATED  # the kernel's own nops (x86_nops) from 6.16
    assert decide(nopl4_other, V618).kind == SINGLE_STEPPED
    assert decide(nopl4_other, V619).kind == EMULATED  # any nopl from 6.19
    assert decide(decode(b"\xf3\x90"), V618).kind == EMULATED  # pause, as a nop, until 6.18
    assert decide(decode(b"\xf3\x90"), V619).kind == SINGLE_STEPPED
    assert decide(decode(b"\x48\x89\xc0"), V619).kind == EMULATED  # mov %rax,%rax: a 6.19 nop
    assert decide(decode(b"\x66\x90"), (6, 1)).kind == REFUSED
    assert x86insn.optimized(nop5, V618) and not x86insn.optimized(nop5, V616)
    # endbr64 is no nop to any of them
    assert {decide(decode(x86insn.ENDBR64), v).kind for v in (V615, V616, V618, V619)} == {SINGLE_STEPPED}


def test_push_with_another_rex_than_41_is_single_stepped():
    assert decide(decode(b"\x41\x57"), V618).kind == EMULATED  # push %r15
    assert decide(decode(b"\x48\x55"), V618).kind == SINGLE_STEPPED  # rex.W push %rbp


def test_cut_short_and_invalid_bytes_are_decode_errors():
    for code in (b"", b"\x48", b"\x48\x8b\x05\x00", b"\xe8\x00\x00", b"\x0f", b"\xea\x00\x00\x00\x00\x00\x00"):
        with pytest.raises(x86insn.DecodeError):
            decode(code)


def _function(body: bytes, size: int | None = None) -> tuple[bytes, int]:
    return body + b"\xcc" * 64, len(body) if size is None else size


RIP_LOAD = bytes.fromhex("488b05f42e0000")  # mov 0x2ef4(%rip),%rax


def test_a_rip_relative_load_then_push_is_moved_to_the_push():
    code, size = _function(RIP_LOAD + b"\x55\x48\x89\xe5\x5d\xc3")
    p = place_entry(code, size, V618)
    assert (p.status, p.offset, p.probed.text()) == ("moved", 7, "push %rbp")
    assert p.describe() == ("entry mov 0x2ef4(%rip),%rax is single-stepped; probe moved to +7 (push %rbp, "
                            "emulated): one trap a call")


def test_endbr64_then_push_is_moved_past_endbr64():
    code, size = _function(x86insn.ENDBR64 + b"\x55\xc3")
    assert place_entry(code, size, V618).offset == 4


def test_no_move_past_a_write_of_an_argument_register_or_the_stack():
    for first, word in ((bytes.fromhex("488b3df42e0000"), "%rdi"),  # mov 0x2ef4(%rip),%rdi
                        (bytes.fromhex("4c8b05f42e0000"), "%r8"),   # mov 0x2ef4(%rip),%r8
                        (bytes.fromhex("4883ec28"), "%rsp"),        # sub $0x28,%rsp
                        (bytes.fromhex("8a3d00000000"), "%rdi"),    # mov 0x0(%rip),%bh: a byte of rbx... no: %bh
                        (bytes.fromhex("b602"), "%rdx")):           # mov $2,%dh: a byte of rdx
        code, size = _function(first + b"\x55\xc3")
        p = place_entry(code, size, V618)
        if first == bytes.fromhex("8a3d00000000"):  # %bh is rbx's: moved
            assert p.moved, p
            continue
        assert not p.moved and f"writes {word}" in p.reason, (first.hex(), p.reason)


def test_no_move_past_a_store_a_call_or_when_the_code_jumps_back_in():
    store = bytes.fromhex("48890500000000")  # mov %rax,0x0(%rip)
    code, size = _function(store + b"\x55\xc3")
    assert not place_entry(code, size, V618).moved
    call_first = bytes.fromhex("ff1500000000")  # call *0x0(%rip)
    code, size = _function(call_first + b"\x55\xc3")
    assert "is not one a probe is moved past" in place_entry(code, size, V618).reason
    loop = RIP_LOAD + b"\x55\x5d\x48\xff\xc0\x48\x83\xf8\x02\x72\xf5\xc3"  # jb back to +7
    code, size = _function(loop)
    assert place_entry(code, size, V618).reason == ("the code at +16 may jump to +1..+7, the bytes skipped or "
                                                    "the new place")
    # a rel32 jump from further into the function, and one to the entry itself (which fires either way)
    far = RIP_LOAD + b"\x55" + b"\x90" * 300 + b"\xe9" + (7 - 313).to_bytes(4, "little", signed=True) + b"\xc3"
    code, size = _function(far)
    assert place_entry(code, size, V618).reason.startswith("the code at +308 may jump to +1..+7")
    to_entry = RIP_LOAD + b"\x55\xeb" + (-10).to_bytes(1, "little", signed=True) + b"\xc3"
    code, size = _function(to_entry)
    assert place_entry(code, size, V618).moved


def test_no_move_without_a_symbol_size_or_past_another_symbol():
    code, _ = _function(RIP_LOAD + b"\x55\xc3")
    assert "no size" in place_entry(code, 0, V618).reason
    assert place_entry(code, 9, V618, other_symbols=(7,)).reason == "another symbol starts at +7"


def test_emulated_and_refused_entries_stay():
    code, size = _function(b"\x55\xc3")
    p = place_entry(code, size, V618)
    assert (p.status, p.offset) == ("emulated", 0)
    code, size = _function(b"\xcc\x55\xc3")
    assert place_entry(code, size, V618).status == "refused"


def _objdump_bounds(path: str, start: int, stop: int) -> list[int]:
    out = subprocess.run(["objdump", "-d", "-j", ".text", "--no-show-raw-insn", f"--start-address={start}",
                          f"--stop-address={stop}", path], capture_output=True, text=True, check=True).stdout
    return [int(m.group(1), 16) for m in re.finditer(r"^\s+([0-9a-f]+):\t", out, re.M)]


def _libraries() -> list[str]:
    from recorder.core.libraries import find_libc

    vendor = sorted(str(p) for p in Path("/var/cache/stall-recorder/vendor").glob("*/nvidia/*/lib/*.so*"))
    return [p for p in [find_libc(), *vendor] if p]


@pytest.mark.parametrize("path", _libraries(), ids=lambda p: Path(p).name)
def test_lengths_match_objdump_on_this_machine_s_libraries(path):
    """60 KB of each library's .text, decoded one instruction after another, ends where objdump's do."""
    if not shutil.which("objdump"):
        pytest.skip("no objdump")
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        text = ELFFile(f).get_section_by_name(".text")
        data, base = text.data(), text["sh_addr"]
    from recorder.core.elfsyms import FunctionSymbols

    # from one function's start to another's, so that objdump starts and stops in step
    starts = [a for a in FunctionSymbols(path).starts if base + len(data) // 3 <= a < base + len(data)]
    start = starts[0]
    stop = next(a for a in starts if a >= start + 60_000)
    bounds = _objdump_bounds(path, start, stop) + [stop]
    assert len(bounds) > 5_000
    checked = 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        insn = decode(data, a - base)
        assert insn.length == b - a, (hex(a), data[a - base:b - base].hex(" "))
        checked += 1
    assert checked == len(bounds) - 1


def test_entry_sites_of_the_vendor_runtime_and_nccl():
    """NVIDIA's libcudart begins its APIs with push %rbp; libnccl has single-stepped entries, some moved."""
    from recorder.layers.cuda.apis import APIS
    from recorder.layers.workload import nccl

    libs = {Path(p).name: p for p in _libraries()}
    if "libcudart.so.12" not in libs or "libnccl.so.2" not in libs:
        pytest.skip("the vendor libraries are not in the cache (scripts/setup.sh --test)")
    rt = x86insn.entry_sites(libs["libcudart.so.12"], {a.name for a in APIS if a.library == "runtime"}, V618)
    found = [s for s in rt.values() if s]
    assert len(found) >= 30 and {s.placement.status for s in found} == {"emulated"}
    assert rt["cudaLaunchKernel"].placement.entry.text() == "push %rbp"
    nc = x86insn.entry_sites(libs["libnccl.so.2"], {a.name for a in nccl.APIS} | {"ncclCommInitAll", "ncclBcast"},
                             V618)
    assert nc["ncclAllReduce"].placement.status == "emulated"
    assert (nc["ncclCommInitAll"].placement.status, nc["ncclCommInitAll"].placement.offset) == ("moved", 10)
    assert nc["ncclBcast"].placement.reason == "sub $0x10,%rsp at its entry writes %rsp (the stack pointer)"


def test_doctor_says_where_each_probe_of_a_library_goes():
    import json

    import native_libs  # tests/native, put on the path by conftest
    from recorder import doctor

    lib = str(native_libs.build_trap_library())
    (check,) = doctor.probe_trap_checks([lib, lib])
    assert check.name == "probe traps libcuda.so.1" and not check.ok and not check.required
    assert check.detail.endswith(": 1 emulated, 1 moved, 1 single-stepped (cuLaunchKernel_ptsz)"), check.detail
    probes = json.loads(json.dumps(doctor.as_json([check])))["checks"][0]["probes"]
    assert set(probes) == {"cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernel_ptds"}
    moved = probes["cuLaunchKernel"]
    assert (moved["status"], moved["offset"], moved["entry_handling"], moved["handling"]) == (
        "moved", 7, "single-stepped", "emulated")
    assert moved["entry"].startswith("mov ") and moved["probed"].startswith("jmp ")
    assert probes["cuLaunchKernel_ptsz"]["reason"] == ("the code at +16 may jump to +1..+7, the bytes skipped or "
                                                       "the new place")
    assert probes["cuLaunchKernel_ptds"]["status"] == "emulated"
    assert doctor.probe_trap_checks(["/bin/true"]) == []  # no CUDA/NCCL library: no check


def test_trampolines():
    """endbr64 then a direct jmp: moved onto the jmp; endbr64 then an indirect jmp through a GOT slot:
    nothing emulated before the function leaves, kept at the entry."""
    code, size = _function(x86insn.ENDBR64 + b"\xe9\x00\x10\x00\x00")
    p = place_entry(code, size, V618)
    assert (p.status, p.offset, p.probed.text()) == ("moved", 4, "jmp .+0x1005")
    code, size = _function(x86insn.ENDBR64 + bytes.fromhex("ff2500100000"))  # jmp *0x1000(%rip)
    p = place_entry(code, size, V618)
    assert p.status == "single-stepped"
    assert p.reason == "jmp *0x1000(%rip) at +4 is not one a probe is moved past (a branch, a stack or " \
                       "implicit-register operation)"
