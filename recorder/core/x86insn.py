"""What a uprobe costs at a function's first instructions on x86-64, and where it costs least.

A uprobe is a breakpoint (int3). When it is hit the kernel runs the BPF program, then has to carry
out the instruction the breakpoint replaced. It does that in one of two ways
(arch/x86/kernel/uprobes.c):

- **emulated**: the kernel applies the instruction's effect to the saved registers itself and
  returns to the next one: `push reg` (incl. `push r8`-`push r15`), `jmp`/`call` rel, `jcc`, the
  `nop` forms (which ones depends on the kernel: `decide()`). One trap.
- **single-stepped**: the kernel copies the instruction into a page of the process ("[uprobes]" in
  its maps), rewrites a RIP-relative operand through a scratch register, returns to the copy with
  the trap flag set, and fixes the registers up in a second trap. Everything else, `endbr64`
  included. Two traps and the copying: about 3x the cost of an emulated one on a VM.
- **refused**: the attach fails (ENOTSUPP): `int3`, `int n`, `in`/`out`, `hlt`, the CS/DS/ES/SS
  segment prefixes and `lock`, the instructions that mask exceptions (`mov ss`, `pop ss`).

`place_entry()` moves an entry probe from a single-stepped first instruction to the first emulated
instruction of the straight-line path behind it, when every call still passes it and it still sees
the arguments: only instructions that write no argument register, no stack or frame pointer and no
memory are skipped, and nothing in the function branches into the skipped bytes. A return probe
moves with it (it hijacks the return address at `%rsp`, which the skipped instructions keep).

The decoder is a length decoder with the operand fields the classification needs (ModRM, SIB,
displacement, immediate, prefixes, REX/VEX); it names the common instructions and shows the others
by their bytes.
"""

from __future__ import annotations

import bisect
import os
import re
import struct
from dataclasses import dataclass

EMULATED, SINGLE_STEPPED, REFUSED = "emulated", "single-stepped", "refused"
MAX_INSN = 15
MAX_SKIP = 32  # bytes of instructions a probe may be moved past
SCAN_MAX = 1 << 20  # bytes of a function scanned for branches into the skipped ones

REGS64 = ("rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
          "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
REGS32 = ("eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi",
          "r8d", "r9d", "r10d", "r11d", "r12d", "r13d", "r14d", "r15d")
REGS16 = ("ax", "cx", "dx", "bx", "sp", "bp", "si", "di",
          "r8w", "r9w", "r10w", "r11w", "r12w", "r13w", "r14w", "r15w")
REGS8 = ("al", "cl", "dl", "bl", "spl", "bpl", "sil", "dil",
         "r8b", "r9b", "r10b", "r11b", "r12b", "r13b", "r14b", "r15b")
REGS8_LEGACY = ("al", "cl", "dl", "bl", "ah", "ch", "dh", "bh")
# what the entry's BPF programs read: the six argument registers, the stack (stack arguments and
# the return address) and the frame pointer (the native stack walk)
ARGUMENT_REGISTERS = frozenset({7, 6, 2, 1, 8, 9})  # rdi rsi rdx rcx r8 r9
PROTECTED = ARGUMENT_REGISTERS | {4, 5}  # and rsp, rbp

_PREFIXES = frozenset({0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3})
_BAD_PREFIXES = frozenset({0x26, 0x2E, 0x36, 0x3E, 0xF0})  # ES CS SS DS LOCK (is_prefix_bad)


def _bits(rows: tuple[str, ...]) -> frozenset[int]:
    """Opcodes whose digit is 1 in a 16x16 table written as 16 strings of 16 digits."""
    return frozenset(row * 16 + col for row, line in enumerate(rows) for col, ch in enumerate(line) if ch == "1")


# The kernel's good_insns_64 table (arch/x86/kernel/uprobes.c): opcodes a uprobe accepts. 0x0f is
# good, so every two- and three-byte opcode passes (its good_2byte_insns table is never reached
# for them on x86-64: `syscall` and `ud2` attach).
GOOD_64 = _bits((
    "1111110011111101", "1111110011111100", "1111111011111110", "1111111011111110",
    "1111111111111111", "1111111111111111", "0001111111110000", "1111111111111111",
    "1101111111111111", "1111111111011111", "1111111111111111", "1111111111111111",
    "1111111111110000", "1111000111111111", "1111000011010000", "1011011111001111",
))

# 1-byte opcodes with a ModRM byte (64-bit mode)
_MODRM_1 = _bits((
    "1111000011110000", "1111000011110000", "1111000011110000", "1111000011110000",
    "0000000000000000", "0000000000000000", "0001000001010000", "0000000000000000",
    "1111111111111111", "0000000000000000", "0000000000000000", "0000000000000000",
    "1100001100000000", "1111000011111111", "0000000000000000", "0000001100000011",
))
# 2-byte (0f xx) opcodes without a ModRM byte
_NO_MODRM_2 = frozenset({0x05, 0x06, 0x07, 0x08, 0x09, 0x0B, 0x0E, 0x30, 0x31, 0x32, 0x33, 0x34, 0x35,
                         0x37, 0x77, 0xA0, 0xA1, 0xA2, 0xA8, 0xA9, 0xAA}
                        | set(range(0x80, 0x90)) | set(range(0xC8, 0xD0)))
_IMM8_2 = frozenset({0x70, 0x71, 0x72, 0x73, 0xA4, 0xAC, 0xBA, 0xC2, 0xC4, 0xC5, 0xC6, 0x0F})

_JCC = ("jo", "jno", "jb", "jae", "je", "jne", "jbe", "ja", "js", "jns", "jp", "jnp", "jl", "jge", "jle", "jg")
_ALU = ("add", "or", "adc", "sbb", "and", "sub", "xor", "cmp")
_SHIFT = ("rol", "ror", "rcl", "rcr", "shl", "shr", "sal", "sar")
_F7 = ("test", "test", "not", "neg", "mul", "imul", "div", "idiv")
_FF = ("inc", "dec", "call", "lcall", "jmp", "ljmp", "push", "(bad)")

# The kernel's 64-bit nops (arch/x86/include/asm/nops.h, x86_nops[]), which 6.16-6.18 emulate
X86_NOPS = (
    b"\x90", b"\x66\x90", b"\x0f\x1f\x00", b"\x0f\x1f\x40\x00", b"\x0f\x1f\x44\x00\x00",
    b"\x66\x0f\x1f\x44\x00\x00", b"\x0f\x1f\x80\x00\x00\x00\x00", b"\x0f\x1f\x84\x00\x00\x00\x00\x00",
    b"\x2e\x0f\x1f\x84\x00\x00\x00\x00\x00", b"\x66\x2e\x0f\x1f\x84\x00\x00\x00\x00\x00",
    b"\x66\x66\x2e\x0f\x1f\x84\x00\x00\x00\x00\x00",
)
NOP5 = X86_NOPS[4]
ENDBR64, ENDBR32 = b"\xf3\x0f\x1e\xfa", b"\xf3\x0f\x1e\xfb"


class DecodeError(ValueError):
    """Bytes that are no complete x86-64 instruction this decoder knows."""


@dataclass(frozen=True)
class Insn:
    """One decoded instruction."""

    raw: bytes
    prefixes: bytes  # legacy prefixes, in order
    rex: int  # the REX byte, 0 when none
    vex: int  # bytes of a VEX/EVEX prefix (0, 2, 3 or 4)
    opcode: bytes  # the opcode bytes, 0f escapes included (for VEX: the implied map's escapes)
    modrm: int | None
    sib: int | None
    disp: int
    disp_size: int
    imm: int  # signed
    imm_size: int

    @property
    def length(self) -> int:
        return len(self.raw)

    @property
    def rip_relative(self) -> bool:
        return self.modrm is not None and self.modrm >> 6 == 0 and self.modrm & 7 == 5

    @property
    def mod(self) -> int:
        return -1 if self.modrm is None else self.modrm >> 6

    @property
    def reg(self) -> int:
        """ModRM.reg with REX.R."""
        return -1 if self.modrm is None else (self.modrm >> 3 & 7) | (self.rex >> 2 & 1) << 3

    @property
    def rm(self) -> int:
        """ModRM.rm with REX.B (a register when mod is 3)."""
        return -1 if self.modrm is None else (self.modrm & 7) | (self.rex & 1) << 3

    @property
    def op_size(self) -> int:
        if self.rex & 8:
            return 8
        return 2 if 0x66 in self.prefixes else 4

    def hex(self) -> str:
        return self.raw.hex(" ")

    def text(self) -> str:
        """A short AT&T-style text of the instruction (its bytes where it has no name here)."""
        try:
            name = _format(self)
        except (IndexError, KeyError):
            name = None
        return name or f"({self.hex()})"


def decode(code: bytes, at: int = 0) -> Insn:
    """The instruction at `code[at:]`; DecodeError when it is cut short or not understood."""
    start = i = at
    end = min(len(code), at + MAX_INSN)

    def byte() -> int:
        nonlocal i
        if i >= end:
            raise DecodeError(f"instruction cut short at +{i - start}")
        b = code[i]
        i += 1
        return b

    prefixes = bytearray()
    b = byte()
    while b in _PREFIXES:
        prefixes.append(b)
        b = byte()
    rex = vex = 0
    if 0x40 <= b <= 0x4F:
        rex = b
        b = byte()
    if rex == 0 and b in (0xC4, 0xC5, 0x62):  # VEX3, VEX2, EVEX (always so in 64-bit mode)
        if b == 0xC5:
            vex, p1 = 2, byte()
            rex = 0x40 | (0 if p1 & 0x80 else 4)
            opcode = bytes([0x0F, byte()])
        else:
            vex = 3 if b == 0xC4 else 4
            p1, p2 = byte(), byte()
            if vex == 4:
                byte()
            rex = 0x40 | (0 if p1 & 0x80 else 4) | (0 if p1 & 0x40 else 2) | (0 if p1 & 0x20 else 1) | (p2 & 0x80) >> 4
            mmap_ = p1 & (0x7 if vex == 4 else 0x1F)
            escapes = {1: b"\x0f", 2: b"\x0f\x38", 3: b"\x0f\x3a", 5: b"\x0f\x05", 6: b"\x0f\x06"}.get(mmap_)
            if escapes is None:
                raise DecodeError(f"VEX/EVEX map {mmap_}")
            opcode = escapes + bytes([byte()])
        has_modrm = not (opcode == b"\x0f\x77")
        imm = 1 if opcode[:2] == b"\x0f\x3a" or (len(opcode) == 2 and opcode[1] in _IMM8_2 - {0x0F}) else 0
        return _finish(code, start, i, end, bytes(prefixes), rex, vex, opcode, has_modrm, imm)
    if b == 0x0F:
        b2 = byte()
        if b2 in (0x38, 0x3A):
            opcode = bytes([0x0F, b2, byte()])
            return _finish(code, start, i, end, bytes(prefixes), rex, 0, opcode, True, 1 if b2 == 0x3A else 0)
        opcode = bytes([0x0F, b2])
        if 0x80 <= b2 <= 0x8F:
            imm = 4  # jcc rel32: operand size is 64 bits in 64-bit mode, whatever the prefixes
        elif b2 in _IMM8_2:
            imm = 1
        elif b2 == 0x78 and (0x66 in prefixes or 0xF2 in prefixes):
            imm = 2  # extrq / insertq ib, ib
        else:
            imm = 0
        return _finish(code, start, i, end, bytes(prefixes), rex, 0, opcode, b2 not in _NO_MODRM_2, imm)
    opcode = bytes([b])
    z = 2 if 0x66 in prefixes else 4
    imm = 0
    if b in (0x04, 0x0C, 0x14, 0x1C, 0x24, 0x2C, 0x34, 0x3C, 0x6A, 0x6B, 0x80, 0x82, 0x83, 0xA8, 0xC0, 0xC1,
             0xC6, 0xCD, 0xD4, 0xD5, 0xE4, 0xE5, 0xE6, 0xE7, 0xEB, 0xE0, 0xE1, 0xE2, 0xE3) or 0x70 <= b <= 0x7F \
            or 0xB0 <= b <= 0xB7:
        imm = 1
    elif b in (0x05, 0x0D, 0x15, 0x1D, 0x25, 0x2D, 0x35, 0x3D, 0x68, 0x69, 0x81, 0xA9, 0xC7):
        imm = z
    elif b in (0xE8, 0xE9):
        imm = 4  # rel32 in 64-bit mode, 66 or not
    elif 0xB8 <= b <= 0xBF:
        imm = 8 if rex & 8 else z
    elif b in (0xC2, 0xCA):
        imm = 2
    elif b == 0xC8:
        imm = 3
    elif 0xA0 <= b <= 0xA3:
        imm = 4 if 0x67 in prefixes else 8  # moffs
    elif b in (0x9A, 0xEA):
        raise DecodeError(f"opcode {b:02x} is invalid in 64-bit mode")
    has_modrm = b in _MODRM_1
    insn = _finish(code, start, i, end, bytes(prefixes), rex, 0, opcode, has_modrm, imm)
    if b in (0xF6, 0xF7) and insn.modrm is not None and (insn.modrm >> 3 & 7) in (0, 1):
        # test r/m, imm: the immediate follows the ModRM operand
        return _finish(code, start, i, end, bytes(prefixes), rex, 0, opcode, True, 1 if b == 0xF6 else z)
    return insn


def _finish(code: bytes, start: int, i: int, end: int, prefixes: bytes, rex: int, vex: int, opcode: bytes,
            has_modrm: bool, imm_size: int) -> Insn:
    modrm = sib = None
    disp = disp_size = 0
    if has_modrm:
        if i >= end:
            raise DecodeError("instruction cut short at its ModRM byte")
        modrm = code[i]
        i += 1
        mod, rm = modrm >> 6, modrm & 7
        if mod != 3 and rm == 4:
            if i >= end:
                raise DecodeError("instruction cut short at its SIB byte")
            sib = code[i]
            i += 1
            if mod == 0 and sib & 7 == 5:
                disp_size = 4
        if mod == 0 and rm == 5:
            disp_size = 4
        elif mod == 1:
            disp_size = 1
        elif mod == 2:
            disp_size = 4
    if i + disp_size + imm_size > end:
        raise DecodeError("instruction cut short in its displacement or immediate")
    if disp_size:
        disp = int.from_bytes(code[i:i + disp_size], "little", signed=True)
        i += disp_size
    imm = int.from_bytes(code[i:i + imm_size], "little", signed=True) if imm_size else 0
    i += imm_size
    return Insn(bytes(code[start:i]), prefixes, rex, vex, opcode, modrm, sib, disp, disp_size, imm, imm_size)


# -- how the kernel carries an instruction out ------------------------------------------------------


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of a kernel release string ('6.18.44-fc' -> (6, 18)); (0, 0) when unreadable."""
    m = re.match(r"(\d+)\.(\d+)", release if release is not None else os.uname().release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@dataclass(frozen=True)
class Handling:
    """How the kernel carries out a probed instruction: EMULATED, SINGLE_STEPPED or REFUSED, and why."""

    kind: str
    why: str


def _is_nop_6_19(insn: Insn) -> bool:
    """The unified insn_is_nop() of 6.19 (arch/x86/lib/insn-eval.c), for the encodings met in code."""
    if insn.vex:
        return False
    op = insn.opcode
    if op == b"\x90":
        return not insn.rex & 1 and 0xF3 not in insn.prefixes
    if op == b"\x0f\x1f":
        return insn.modrm is not None and insn.modrm >> 3 & 7 == 0
    if op == b"\x89" and insn.mod == 3:
        return insn.op_size == 8 and insn.reg == insn.rm
    if op == b"\x8d" and insn.mod in (1, 2) and insn.disp == 0 and insn.op_size == 8:
        if any(p != 0x3E for p in insn.prefixes):
            return False
        if insn.sib is not None and (insn.sib >> 6 != 0 or (insn.sib >> 3 & 7 | (insn.rex >> 1 & 1) << 3) != 4):
            return False
        base = ((insn.sib & 7) | (insn.rex & 1) << 3) if insn.sib is not None else insn.rm
        return insn.reg == base
    if op in (b"\xe9", b"\xeb"):
        return insn.imm == 0
    return False


def decide(insn: Insn, version: tuple[int, int] | None = None) -> Handling:
    """How a uprobe on this instruction is carried out by a 64-bit process's kernel of `version`
    (the running kernel's by default), following arch_uprobe_analyze_insn()."""
    v = version or kernel_version()
    op = insn.opcode
    # uprobe_init_insn(): prefixes, exception masking, the good-instruction table
    bad = sorted(p for p in insn.prefixes if p in _BAD_PREFIXES)
    if bad:
        names = {0x26: "es", 0x2E: "cs", 0x36: "ss", 0x3E: "ds", 0xF0: "lock"}
        return Handling(REFUSED, f"the kernel refuses the {names[bad[0]]} prefix")
    if op == b"\x8e" and insn.modrm is not None and insn.modrm >> 3 & 7 == 2 or op == b"\x17":
        return Handling(REFUSED, "the kernel refuses instructions that mask exceptions (mov/pop %ss)")
    # the table is read at the first opcode byte the kernel's decoder sees: 0f for the legacy
    # two- and three-byte opcodes (always good), the opcode itself after a VEX/EVEX prefix
    first_byte = op[-1] if insn.vex else op[0]
    if first_byte not in GOOD_64:
        return Handling(REFUSED, f"the kernel refuses opcode {first_byte:02x}")
    # branch_setup_xol_ops(): nops, jmp, call, jcc
    if v >= (6, 19):
        if _is_nop_6_19(insn):
            return Handling(EMULATED, "a nop")
    elif v >= (6, 16) and insn.raw in X86_NOPS:
        return Handling(EMULATED, "a nop")
    # the kernel's OPCODE1() is the opcode byte after a VEX/EVEX prefix, which these checks do not
    # look at: vzeroupper (c5 f8 77) is taken for a ja and skipped
    kop = op[-1] if insn.vex else op[0]
    vex_note = f" (the kernel takes VEX opcode {kop:02x} for one)" if insn.vex else ""
    if kop == 0x90 and v < (6, 19):  # prefix* + nop (pause too), as jmp +0
        if 0x66 in insn.prefixes and v < (6, 2):
            return Handling(REFUSED, "a 66-prefixed nop (refused before 6.2)")
        return Handling(EMULATED, "a nop" + vex_note)
    branch = None
    if kop in (0xE9, 0xEB):
        branch = "a jmp"
    elif kop == 0xE8:
        branch = "a call"
    elif 0x70 <= kop <= 0x7F or (not insn.vex and len(op) == 2 and op[0] == 0x0F and 0x80 <= op[1] <= 0x8F):
        branch = "a conditional jump"
    if branch:
        if 0x66 in insn.prefixes:
            return Handling(REFUSED, f"{branch} with a 66 prefix (the kernel refuses them)")
        return Handling(EMULATED, branch + vex_note)
    # push_setup_xol_ops(): push reg, push r8-r15 with REX 41 only
    if not insn.vex and 0x50 <= kop <= 0x57 and len(op) == 1:
        if insn.length == 1 or (insn.length == 2 and insn.rex == 0x41):
            return Handling(EMULATED, "a push")
    why = "RIP-relative, run out of line through a scratch register" if insn.rip_relative else "run out of line"
    return Handling(SINGLE_STEPPED, why)


def optimized(insn: Insn, version: tuple[int, int] | None = None) -> bool:
    """Whether the kernel turns this probe into a call after its first hit (a 5-byte nop, 6.18+):
    then no trap at all, a syscall instead."""
    return (version or kernel_version()) >= (6, 18) and insn.raw == NOP5


# -- what skipping an instruction would change -----------------------------------------------------


def _reg_name(n: int) -> str:
    return "%" + REGS64[n]


def _written(insn: Insn) -> tuple[set[int], bool] | None:
    """(general registers it writes, whether it writes memory) for the instructions a probe may be
    moved past; None for any other (a branch, an implicit register, a stack operation, ...)."""
    if insn.raw in (ENDBR64, ENDBR32):
        return set(), False
    if insn.vex or any(p in (0xF0, 0xF2, 0xF3) for p in insn.prefixes):
        return None
    op = insn.opcode
    legacy8 = insn.rex == 0

    def r8(n: int, byte_op: bool) -> int:
        return n - 4 if byte_op and legacy8 and 4 <= n <= 7 else n  # %ah-%bh are bytes of rax-rbx

    if len(op) == 1:
        b = op[0]
        if b == 0x90 and not insn.rex & 1:
            return set(), False
        if b < 0x40 and b & 7 < 6:  # add/or/adc/sbb/and/sub/xor/cmp
            cmp = b >> 3 == 7
            low = b & 7
            if low in (4, 5):
                return (set() if cmp else {0}), False
            byte_op = low in (0, 2)
            if low in (0, 1):  # r/m <- r/m op reg
                if cmp:
                    return set(), False
                return ({r8(insn.rm, byte_op)}, False) if insn.mod == 3 else None
            return (set() if cmp else {r8(insn.reg, byte_op)}), False
        if b in (0x84, 0x85, 0xA8, 0xA9):
            return set(), False
        if b in (0x88, 0x89):
            return ({r8(insn.rm, b == 0x88)}, False) if insn.mod == 3 else None
        if b in (0x8A, 0x8B, 0x8D, 0x63):
            return {r8(insn.reg, b == 0x8A)}, False
        if b in (0x80, 0x81, 0x83):
            if insn.modrm is not None and insn.modrm >> 3 & 7 == 7:
                return set(), False
            return ({r8(insn.rm, b == 0x80)}, False) if insn.mod == 3 else None
        if 0xB0 <= b <= 0xBF:
            n = (b & 7) | (insn.rex & 1) << 3
            return {r8(n, b < 0xB8)}, False
        if b in (0xC6, 0xC7) and insn.modrm is not None and insn.modrm >> 3 & 7 == 0:
            return ({r8(insn.rm, b == 0xC6)}, False) if insn.mod == 3 else None
        if b in (0xF6, 0xF7) and insn.modrm is not None:
            sub = insn.modrm >> 3 & 7
            if sub in (0, 1):
                return set(), False
            if sub in (2, 3):
                return ({r8(insn.rm, b == 0xF6)}, False) if insn.mod == 3 else None
        return None
    if len(op) == 2:
        b = op[1]
        if b == 0x1F and insn.modrm is not None and insn.modrm >> 3 & 7 == 0:
            return set(), False
        if b in (0x18, 0x0D):  # prefetch
            return set(), False
        if b in (0xB6, 0xB7, 0xBE, 0xBF, 0xAF) or 0x40 <= b <= 0x4F:
            return {insn.reg}, False
        if 0x90 <= b <= 0x9F:
            return ({r8(insn.rm, True)}, False) if insn.mod == 3 else None
    return None


def skip_blocker(insn: Insn) -> str | None:
    """Why a probe cannot be moved past this instruction, None when it can."""
    w = _written(insn)
    if w is None:
        return "is not one a probe is moved past (a branch, a stack or implicit-register operation)"
    regs, _memory = w
    hit = sorted(regs & PROTECTED)
    if hit:
        what = "an argument register" if hit[0] in ARGUMENT_REGISTERS else (
            "the stack pointer" if hit[0] == 4 else "the frame pointer")
        return f"writes {_reg_name(hit[0])} ({what})"
    return None


# -- where an entry probe goes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where an entry probe (and its return probe) is placed in one function, and what it costs."""

    offset: int  # bytes from the function's start
    entry: Insn | None  # the function's first instruction (None: not decodable)
    entry_handling: Handling
    probed: Insn | None  # the instruction under the probe
    handling: Handling  # of the probed instruction
    reason: str = ""  # why the probe stays on a single-stepped entry
    optimized: bool = False  # the kernel turns it into a call after its first hit

    @property
    def moved(self) -> bool:
        return self.offset > 0

    @property
    def status(self) -> str:
        """'emulated', 'moved', 'single-stepped' or 'refused'."""
        return "moved" if self.moved else self.handling.kind

    def describe(self) -> str:
        """One line for a capability row or `recorder doctor`."""
        first = self.entry.text() if self.entry else "undecodable"
        if self.moved:
            assert self.probed is not None
            return (f"entry {first} is single-stepped; probe moved to +{self.offset} "
                    f"({self.probed.text()}, emulated): one trap a call")
        if self.handling.kind == EMULATED:
            extra = ", turned into a call after its first hit" if self.optimized else ""
            return f"entry {first} is emulated ({self.handling.why}{extra}): one trap a call"
        if self.handling.kind == REFUSED:
            return f"entry {first}: {self.handling.why}"
        return f"entry {first} is single-stepped (two traps a call); not moved: {self.reason}"

    def as_dict(self) -> dict:
        return {"status": self.status, "offset": self.offset,
                "entry": self.entry.text() if self.entry else None,
                "entry_bytes": self.entry.hex() if self.entry else None,
                "entry_handling": self.entry_handling.kind,
                "probed": self.probed.text() if self.probed else None,
                "handling": self.handling.kind, "optimized": self.optimized,
                "reason": self.reason, "detail": self.describe()}


_REL_OPCODES = re.compile(rb"[\xe8\xe9]|\x0f[\x80-\x8f]", re.S)
_REL8_OPCODES = frozenset({0xEB, *range(0x70, 0x80), 0xE0, 0xE1, 0xE2, 0xE3})


def branches_into(code: bytes, low: int, high: int) -> int | None:
    """The position of a direct jmp/jcc/call/loop in `code` (a function from offset 0) whose target
    is in [low, high], None when there is none. Every byte position is read as a possible opcode,
    so what a linear decode would miss (data, a desynchronised stream) counts too: a false match
    only keeps a probe where it is."""
    n = len(code)
    for p in range(min(n - 1, high + 130)):  # a rel8 reaches 128 bytes back
        if code[p] in _REL8_OPCODES:
            target = p + 2 + struct.unpack_from("b", code, p + 1)[0]
            if low <= target <= high:
                return p
    for m in _REL_OPCODES.finditer(code):
        p = m.start()
        at = m.end()
        if at + 4 > n:
            continue
        target = at + 4 + struct.unpack_from("<i", code, at)[0]
        if low <= target <= high:
            return p
    return None


def place_entry(code: bytes, size: int, version: tuple[int, int] | None = None,
                other_symbols: tuple[int, ...] = ()) -> Placement:
    """Where to put the entry probe of the function whose bytes start `code` (`size` of them are
    the function, its ELF symbol's size; 0 when unknown); `other_symbols`: offsets from its start of
    other symbols (an entry another name jumps to)."""
    v = version or kernel_version()
    try:
        entry = decode(code, 0)
    except DecodeError as e:
        unknown = Handling(SINGLE_STEPPED, f"not decoded here ({e})")
        return Placement(0, None, unknown, None, unknown, "its first instruction was not decoded")
    first = decide(entry, v)
    if first.kind == EMULATED:
        return Placement(0, entry, first, entry, first, optimized=optimized(entry, v))
    if first.kind == REFUSED:
        return Placement(0, entry, first, entry, first, first.why)
    offset, insn = 0, entry
    while True:
        blocker = skip_blocker(insn)
        if blocker:
            where = "its entry" if offset == 0 else f"+{offset}"
            return Placement(0, entry, first, entry, first, f"{insn.text()} at {where} {blocker}")
        offset += insn.length
        if offset > MAX_SKIP or (size and offset >= size):
            return Placement(0, entry, first, entry, first, "no emulated instruction in its first bytes")
        try:
            insn = decode(code, offset)
        except DecodeError:
            return Placement(0, entry, first, entry, first, f"the instruction at +{offset} was not decoded")
        handling = decide(insn, v)
        if handling.kind == EMULATED:
            break
    if not size:
        return Placement(0, entry, first, entry, first,
                         "its symbol has no size, so branches into its first bytes cannot be ruled out")
    if size > SCAN_MAX or size > len(code):
        return Placement(0, entry, first, entry, first, f"its {size:,} bytes were not scanned for branches")
    inside = [o for o in other_symbols if 0 < o <= offset]
    if inside:
        return Placement(0, entry, first, entry, first, f"another symbol starts at +{inside[0]}")
    source = branches_into(code[:size], 1, offset)
    if source is not None:
        return Placement(0, entry, first, entry, first,
                         f"the code at +{source} may jump to +1..+{offset}, the bytes skipped or the new place")
    return Placement(offset, entry, first, insn, handling, optimized=optimized(insn, v))


# -- names -----------------------------------------------------------------------------------------


def _sized(n: int, size: int, legacy8: bool = False) -> str:
    if size == 1:
        return "%" + (REGS8_LEGACY[n] if legacy8 and n < 8 else REGS8[n])
    return "%" + {8: REGS64, 4: REGS32, 2: REGS16}[size][n]


def _mem(insn: Insn) -> str:
    seg = "".join({0x64: "%fs:", 0x65: "%gs:"}.get(p, "") for p in insn.prefixes)
    if insn.rip_relative:
        return f"{seg}{insn.disp:#x}(%rip)"
    disp = f"{insn.disp:#x}" if insn.disp_size else ""
    if insn.sib is not None:
        base = (insn.sib & 7) | (insn.rex & 1) << 3
        index = (insn.sib >> 3 & 7) | (insn.rex >> 1 & 1) << 3
        scale = 1 << (insn.sib >> 6)
        base_s = "" if insn.mod == 0 and insn.sib & 7 == 5 else "%" + REGS64[base]
        index_s = "" if index == 4 else f",%{REGS64[index]},{scale}"
        if not base_s and not index_s:
            return f"{seg}{insn.disp:#x}"
        return f"{seg}{disp}({base_s}{index_s})"
    return f"{seg}{disp}(%{REGS64[insn.rm]})"


def _rm(insn: Insn, size: int) -> str:
    return _sized(insn.rm, size, insn.rex == 0) if insn.mod == 3 else _mem(insn)


def _format(insn: Insn) -> str | None:
    if insn.raw == ENDBR64:
        return "endbr64"
    if insn.raw == ENDBR32:
        return "endbr32"
    if insn.vex:
        return None
    op, size = insn.opcode, insn.op_size
    if len(op) == 1:
        b = op[0]
        if b == 0x90:
            return "pause" if 0xF3 in insn.prefixes else ("xchg %r8,%rax" if insn.rex & 1 else "nop")
        if 0x50 <= b <= 0x57:
            return f"push %{REGS64[(b & 7) | (insn.rex & 1) << 3]}"
        if 0x58 <= b <= 0x5F:
            return f"pop %{REGS64[(b & 7) | (insn.rex & 1) << 3]}"
        if b < 0x40 and b & 7 < 6:
            name, low = _ALU[b >> 3], b & 7
            s = 1 if low in (0, 2, 4) else size
            if low in (4, 5):
                return f"{name} ${insn.imm:#x},{_sized(0, s)}"
            reg = _sized(insn.reg, s, insn.rex == 0)
            return f"{name} {reg},{_rm(insn, s)}" if low < 2 else f"{name} {_rm(insn, s)},{reg}"
        if b in (0x88, 0x89, 0x8A, 0x8B, 0x84, 0x85):
            s = 1 if b in (0x88, 0x8A, 0x84) else size
            name = "test" if b in (0x84, 0x85) else "mov"
            reg = _sized(insn.reg, s, insn.rex == 0)
            return f"{name} {reg},{_rm(insn, s)}" if b in (0x88, 0x89, 0x84, 0x85) else f"mov {_rm(insn, s)},{reg}"
        if b == 0x8D:
            return f"lea {_mem(insn)},{_sized(insn.reg, size)}"
        if b == 0x63:
            return f"movslq {_rm(insn, 4)},{_sized(insn.reg, 8)}"
        if b in (0x80, 0x81, 0x83):
            s = 1 if b == 0x80 else size
            return f"{_ALU[insn.modrm >> 3 & 7]} ${insn.imm:#x},{_rm(insn, s)}"  # type: ignore[operator]
        if b in (0xC0, 0xC1, 0xD0, 0xD1, 0xD3):
            s = 1 if b in (0xC0, 0xD0) else size
            count = f"${insn.imm:#x}," if b in (0xC0, 0xC1) else ("%cl," if b == 0xD3 else "")
            return f"{_SHIFT[insn.modrm >> 3 & 7]} {count}{_rm(insn, s)}"  # type: ignore[operator]
        if 0xB0 <= b <= 0xBF:
            s = 1 if b < 0xB8 else size
            name = "movabs" if insn.imm_size == 8 else "mov"
            value = insn.imm & ((1 << 8 * insn.imm_size) - 1)
            return f"{name} ${value:#x},{_sized((b & 7) | (insn.rex & 1) << 3, s, insn.rex == 0)}"
        if b in (0xC6, 0xC7) and insn.modrm is not None and insn.modrm >> 3 & 7 == 0:
            return f"mov ${insn.imm:#x},{_rm(insn, 1 if b == 0xC6 else size)}"
        if b in (0xF6, 0xF7) and insn.modrm is not None:
            sub = insn.modrm >> 3 & 7
            s = 1 if b == 0xF6 else size
            return f"test ${insn.imm:#x},{_rm(insn, s)}" if sub < 2 else f"{_F7[sub]} {_rm(insn, s)}"
        if b == 0xFF and insn.modrm is not None:
            sub = insn.modrm >> 3 & 7
            target = _rm(insn, 8)
            return f"{_FF[sub]} *{target}" if sub in (2, 4) else f"{_FF[sub]} {target}"
        if b in (0xE8, 0xE9, 0xEB):
            return f"{'call' if b == 0xE8 else 'jmp'} .{insn.imm + insn.length:+#x}"
        if 0x70 <= b <= 0x7F:
            return f"{_JCC[b & 15]} .{insn.imm + insn.length:+#x}"
        simple = {0xC3: "ret", 0xC9: "leave", 0xCC: "int3", 0x99: "cltd" if size == 4 else "cqto",
                  0x98: "cltq" if size == 8 else "cwtl", 0xF4: "hlt", 0x9C: "pushf", 0x9D: "popf"}
        return simple.get(b)
    if len(op) == 2:
        b = op[1]
        if b == 0x1F:
            return f"nop{'w' if size == 2 else 'l'} {_rm(insn, size)}"
        if 0x80 <= b <= 0x8F:
            return f"{_JCC[b & 15]} .{insn.imm + insn.length:+#x}"
        if b in (0xB6, 0xB7, 0xBE, 0xBF):
            name = ("movzb", "movzw", "movsb", "movsw")[(b - 0xB6) if b < 0xBE else (b - 0xBE + 2)]
            return f"{name} {_rm(insn, 1 if b in (0xB6, 0xBE) else 2)},{_sized(insn.reg, size)}"
        simple = {0x05: "syscall", 0x0B: "ud2", 0xA2: "cpuid", 0x31: "rdtsc"}
        return simple.get(b)
    return None


# -- in an ELF file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """An entry probe's place in a library: the function's address (its symbol's value), the
    placement, and the address the probe goes to."""

    name: str
    address: int  # the symbol's virtual address in the file
    size: int
    placement: Placement

    @property
    def probe_address(self) -> int:
        return self.address + self.placement.offset


_SITES: dict[tuple[str, int, int], dict[str, Site | None]] = {}


def entry_sites(path: str, names: frozenset[str] | set[str] | tuple[str, ...],
                version: tuple[int, int] | None = None) -> dict[str, Site | None]:
    """The Site of each function `names` lists that the ELF file at `path` defines (None for a name
    it does not define, or whose bytes are not in the file), kept per file and kernel version. An
    unreadable file gives {}."""
    import mmap

    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    from recorder.core.elfsyms import SymbolTableError, _functions, _name

    v = version or kernel_version()
    try:
        st = os.stat(path)
    except OSError:
        return {}
    key = (os.path.realpath(path), st.st_ino, int(st.st_mtime))
    cached = _SITES.setdefault(key, {}) if version is None else {}
    if all(n in cached for n in names):
        return {n: cached[n] for n in names}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            elf = ELFFile(f)
            if elf["e_machine"] != "EM_X86_64":
                return {n: None for n in names}
            loads = [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in elf.iter_segments()
                     if s["p_type"] == "PT_LOAD"]
            symbols = _functions(elf, len(mapped), (".dynsym", ".symtab"))
            starts = sorted({start for start, _, _ in symbols})
            by_name: dict[str, tuple[int, int]] = {}
            for start, size, position in symbols:
                name = _name(mapped, position).split("@", 1)[0]
                by_name.setdefault(name, (start, size))
            out: dict[str, Site | None] = {}
            for name in names:
                if name in cached:
                    out[name] = cached[name]
                    continue
                found = by_name.get(name)
                if found is None:
                    out[name] = None
                    continue
                start, size = found
                code = _read(mapped, loads, start, max(size, MAX_SKIP + MAX_INSN))
                if not code:
                    out[name] = None
                    continue
                i = bisect.bisect_right(starts, start)
                others = tuple(s - start for s in starts[i:i + 8] if s - start <= MAX_SKIP)
                out[name] = Site(name, start, size, place_entry(code, size, v, others))
    except (OSError, ELFError, SymbolTableError, ValueError):
        return {}
    cached.update(out)
    return out


# -- attaching ---------------------------------------------------------------------------------------


def attach_pair(bpf, path: str, sym: str, site: Site | None, entry_fn: str, return_fn: str | None) -> None:
    """Attach an entry program (and a return program) of a BCC object to function `sym` of the
    library at `path`: at its symbol, or at `site`'s moved address when the placement moved it
    (both probes there, so one breakpoint still serves both). BCC's exception when it fails."""
    if site is None or not site.placement.moved:
        bpf.attach_uprobe(name=path, sym=sym, fn_name=entry_fn)
        if return_fn:
            bpf.attach_uretprobe(name=path, sym=sym, fn_name=return_fn)
        return
    bpf.attach_uprobe(name=path, addr=site.probe_address, fn_name=entry_fn)
    if return_fn:
        bpf.attach_uretprobe(name=path, addr=site.probe_address, fn_name=return_fn)


def detach_entry(bpf, path: str, sym: str, site: Site | None) -> None:
    """Detach the entry probe attach_pair() attached."""
    if site is None or not site.placement.moved:
        bpf.detach_uprobe(name=path, sym=sym)
    else:
        bpf.detach_uprobe(name=path, addr=site.probe_address)


def detach_return(bpf, path: str, sym: str, site: Site | None) -> None:
    """Detach the return probe attach_pair() attached."""
    if site is None or not site.placement.moved:
        bpf.detach_uretprobe(name=path, sym=sym)
    else:
        bpf.detach_uretprobe(name=path, addr=site.probe_address)


def site_detail(site: Site | None) -> str:
    """The capability row's detail of a probe attached by attach_pair()."""
    return site.placement.describe() if site is not None else ""


def _read(mapped, loads: list[tuple[int, int, int]], vaddr: int, n: int) -> bytes:
    """Up to n bytes of the file at virtual address vaddr (within its PT_LOAD segment)."""
    for off, start, size in loads:
        if start <= vaddr < start + size:
            at = off + vaddr - start
            return bytes(mapped[at:min(at + n, off + size)])
    return b""
