"""The uprobe classifier of recorder/core/x86insn.py against the running kernel: an empty uprobe on
each of a set of one-instruction function entries; a process that calls one of them, with nothing
else probed, has a "[uprobes]" mapping (the kernel's out-of-line page) after the call exactly when
that instruction was single-stepped; an attach the kernel refuses fails while the library is mapped.
Another session's probes on the C library would add that mapping too (never take it away), so each
call is made up to three times and one without the mapping counts as emulated."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
from conftest import needs_bpf

from recorder.core import x86insn

pytestmark = [needs_bpf, pytest.mark.bpf]

# function name: its first instruction, then what makes it return
FUNCTIONS = {
    "f_push": ("push %rbp", "pop %rbp; ret"),
    "f_push_r15": ("push %r15", "pop %r15; ret"),
    "f_rip_load": ("mov 0(%rip),%rax", "ret"),
    "f_rip_lea": ("lea 0(%rip),%rax", "ret"),
    "f_endbr64": ("endbr64", "ret"),
    "f_nop": ("nop", "ret"),
    "f_66nop": ("xchg %ax,%ax", "ret"),
    "f_pause": ("pause", "ret"),
    "f_nop5": (".byte 0x0f,0x1f,0x44,0,0", "ret"),
    "f_nopl_other": (".byte 0x0f,0x1f,0x04,0", "ret"),
    "f_jmp": ("jmp 1f", "1: ret"),
    "f_je": ("je 1f", "1: ret"),
    "f_call": ("call 1f", "1: add $8,%rsp; ret"),
    "f_sub_rsp": ("sub $8,%rsp", "add $8,%rsp; ret"),
    "f_vzeroupper": ("vzeroupper", "ret"),
    "f_cs_nop": (".byte 0x2e,0x0f,0x1f,0x84,0,0,0,0,0", "ret"),  # not called: refused
    "f_vmovdqu": ("vmovdqu (%rsp),%ymm0", "ret"),  # not called: refused
}

DRIVER_C = r"""
#include <stdio.h>
#include <string.h>
FUNCTIONS
int main(int argc, char **argv) {
    void (*fn)(void) = 0;
    CHOOSE
    if (!fn) return 2;
    fn();
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[512];
    int xol = 0;
    while (fgets(line, sizeof line, maps))
        xol |= strstr(line, "[uprobes]") != 0;
    printf("%s\n", xol ? "single-stepped" : "emulated");
    return 0;
}
"""


def test_the_running_kernel_does_what_the_classifier_says(tmp_path):
    if not shutil.which("cc"):
        pytest.skip("no C compiler (cc)")
    src = tmp_path / "entries.S"
    src.write_text(".text\n" + "".join(
        f".globl {name}\n.type {name},@function\n{name}: {first}\n{rest}\n.size {name},.-{name}\n"
        for name, (first, rest) in FUNCTIONS.items()) + '.section .note.GNU-stack,"",@progbits\n')
    lib = tmp_path / "libentries.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    driver = tmp_path / "driver"
    # linked to the library, not dlopened: no call into a C library function someone may probe
    (tmp_path / "driver.c").write_text(DRIVER_C.replace(
        "FUNCTIONS", "".join(f"void {n}(void);\n" for n in FUNCTIONS)).replace(
        "CHOOSE", "".join(f'if (!strcmp(argv[1], "{n}")) fn = {n};\n' for n in FUNCTIONS)))
    subprocess.run(["cc", "-O1", "-o", str(driver), str(tmp_path / "driver.c"), f"-L{tmp_path}", "-lentries",
                    f"-Wl,-rpath,{tmp_path}"], check=True)
    sites = x86insn.entry_sites(str(lib), set(FUNCTIONS))
    expected = {name: site.placement.entry_handling.kind for name, site in sites.items() if site}
    assert expected["f_rip_load"] == "single-stepped" and expected["f_push"] == "emulated"

    from bcc import BPF

    from recorder.core import kheaders

    kheaders.locate()
    mapped = ctypes.CDLL(str(lib))  # the kernel analyses an instruction where the file is mapped
    b = BPF(text="int entry(struct pt_regs *ctx) { return 0; }")
    seen = {}
    try:
        for name in FUNCTIONS:
            try:
                b.attach_uprobe(name=str(lib), sym=name, fn_name="entry")
            except Exception:
                seen[name] = "refused"
        for name in FUNCTIONS:
            if name in seen:
                continue
            for _ in range(3):
                run = subprocess.run([str(driver), name], capture_output=True, text=True, timeout=30)
                assert run.returncode == 0, (name, run.returncode)
                seen[name] = run.stdout.strip()
                if seen[name] == "emulated":
                    break
    finally:
        b.cleanup()
        del mapped
    assert seen == expected
