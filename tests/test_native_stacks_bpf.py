"""Native stacks at recorded CUDA calls, end to end with real BPF: a C program built with frame
pointers calls the stand-in cudaMalloc through a known chain of functions, through a 60-deep
recursion, and from a caller that leaves in %rbp a value that is no frame pointer (as code built
without frame pointers does); each call's stored native stack must be exactly that chain of
symbols, each distinct stack stored once. And against a real native_stacks map: a call whose stack
is no longer in the map, or that has none, is stored without one and counted once, in a capability
row. Skipped with the reason without root.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import needs_bpf, q, run_recorder, workload_output

pytestmark = [needs_bpf, pytest.mark.bpf]
DEPTH = 60

CALLER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

typedef int (*malloc_t)(void **, unsigned long);
static malloc_t cuda_malloc;

__attribute__((noinline)) static int inner(unsigned long size)
{
    void *p;
    int r = cuda_malloc(&p, size);
    __asm__ volatile("" ::: "memory"); /* no tail call: inner stays on the stack */
    return r;
}
__attribute__((noinline)) static int middle(unsigned long size)
{
    int r = inner(size);
    __asm__ volatile("" ::: "memory");
    return r;
}
__attribute__((noinline)) static int outer(unsigned long size)
{
    int r = middle(size);
    __asm__ volatile("" ::: "memory");
    return r;
}
__attribute__((noinline)) static int deep(int n, unsigned long size)
{
    int r;
    if (n > 1)
        r = deep(n - 1, size);
    else {
        void *p;
        r = cuda_malloc(&p, size);
    }
    __asm__ volatile("" ::: "memory");
    return r;
}
/* Calls cudaMalloc with %rbp pointing below the stack pointer: no frame pointer, as a caller built
 * without them may leave it (the walk must stop at the caller, not read on). Built -mno-red-zone:
 * the call below the compiler's view must not overwrite a red zone. */
__attribute__((noinline)) static int junk_rbp(unsigned long size)
{
    void *p, **pp = &p;
    int r;
    __asm__ volatile(
        "mov %%rsp, %%rbx\n\t"
        "and $-16, %%rsp\n\t"
        "mov %%rbp, %%r12\n\t"
        "lea -4096(%%rsp), %%rbp\n\t"
        "call *%[fn]\n\t"
        "mov %%r12, %%rbp\n\t"
        "mov %%rbx, %%rsp\n\t"
        : "=a"(r), "+D"(pp), "+S"(size)
        : [fn] "r"(cuda_malloc)
        : "rbx", "r12", "rcx", "rdx", "r8", "r9", "r10", "r11", "memory", "cc", "xmm0", "xmm1",
          "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
          "xmm13", "xmm14", "xmm15");
    return r;
}

int main(int argc, char **argv)
{
    void *h = dlopen(argv[1], RTLD_NOW);
    cuda_malloc = h ? (malloc_t)dlsym(h, "cudaMalloc") : 0;
    if (!cuda_malloc)
        return 2;
    int bad = 0;
    for (int i = 0; i < 5; i++)
        bad |= outer(1000);
    for (int i = 0; i < 4; i++)
        bad |= deep(DEPTH, 2000);
    for (int i = 0; i < 3; i++)
        bad |= junk_rbp(3000);
    printf("{\"pid\": %d, \"bad\": %d}\n", getpid(), bad);
    fflush(stdout);
    sleep(2); /* live long enough for the recorder to read the process, as a real job does */
    return 0;
}
"""


def test_native_stacks_are_the_frame_pointer_chain(tmp_path: Path, native) -> None:
    src, exe = tmp_path / "caller.c", tmp_path / "caller"
    src.write_text(CALLER.replace("DEPTH", str(DEPTH)))
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-mno-red-zone", "-o", str(exe), str(src),
                    "-ldl"], check=True)
    db = tmp_path / "r.db"
    lib = str(native["libcudart.so.12"])
    res = run_recorder("record", "--db", str(db), "--cuda-lib", lib, "--", str(exe), lib, timeout=300)
    assert res.returncode == 0, res.stderr
    out = workload_output(res.stdout)
    assert out["bad"] == 0

    calls = q(db, "SELECT size_bytes, native_stack_id FROM cuda_call ORDER BY ts")
    assert [c[0] for c in calls] == [1000] * 5 + [2000] * 4 + [3000] * 3
    by_size: dict[int, set] = {}
    for size, stack in calls:
        by_size.setdefault(size, set()).add(stack)
    # every call has its stack, and the calls of one site share one stored stack
    assert all(len(ids) == 1 and None not in ids for ids in by_size.values()), by_size
    assert len({next(iter(ids)) for ids in by_size.values()}) == 3
    # stored once each: no other row but the on-CPU profile's samples' stacks
    assert q(db, "SELECT count(*) FROM native_stack WHERE id NOT IN"
                 " (SELECT native_stack_id FROM cpu_sample WHERE native_stack_id IS NOT NULL)")[0][0] == 3

    def frames(size: int) -> list[tuple]:
        return q(db, "SELECT f.symbol, f.object FROM native_stack_frame f"
                     " WHERE f.stack_id = ? ORDER BY f.depth", (next(iter(by_size[size])),))

    chain = frames(1000)
    assert [f[0] for f in chain[:5]] == ["cudaMalloc", "inner", "middle", "outer", "main"], chain
    assert chain[0][1] == str(Path(lib).resolve()) and chain[1][1] == str(exe)
    # past main the walk may go on into the C library's start code, never into garbage
    assert all(obj is not None for _, obj in chain), chain

    recursion = frames(2000)
    assert [f[0] for f in recursion[:DEPTH + 2]] == ["cudaMalloc"] + ["deep"] * DEPTH + ["main"], recursion

    # %rbp held no frame pointer: the probed function and its caller (the return address at the
    # stack pointer), and nothing read from where %rbp pointed
    assert [f[0] for f in frames(3000)] == ["cudaMalloc", "junk_rbp"]

    # every call had its stack: no row says some were stored without one
    assert q(db, "SELECT detail FROM capability WHERE probe = 'native stacks'") == []


def _native_stacks_map():
    """A BPF object with a native_stacks map laid out exactly as bpf/cuda.bpf.c defines it."""
    from bcc import BPF

    import bpf as bpf_sources
    from recorder.core import kheaders

    text = bpf_sources.source("cuda.bpf.c")
    start = text.index("#define NATIVE_MAX_FRAMES")
    end = text.index("\n", text.index("native_stacks, 16384);"))
    kheaders.locate()
    return BPF(text=text[start:end].replace("BPF_PERCPU_ARRAY(native_scratch", "// "))


@pytest.mark.parametrize("packed", [False, True], ids=["python rows", "packed rows"])
def test_calls_without_their_native_stack_are_counted_once(tmp_path: Path, packed: bool) -> None:
    """A call whose stack left the map before the recorder read it (evicted by 16,384 newer ones)
    and a call with no stack at all are stored without one and counted once each, in the packed
    path too (which looks the stack up ahead of the call's row); the capability row says so."""
    import test_ingest_packed as tp

    if packed and not tp.BUILT:
        pytest.skip("the C extensions are not built (no compiler at install)")
    b = _native_stacks_map()
    try:
        table = b["native_stacks"]
        known, evicted = 0x1234_5678_9ABC_DEF, 0x0FED_CBA9_8765_4321
        value = table.Leaf()
        value.frames = 2
        value.ip[0], value.ip[1] = 0x40_1000, 0x40_1234
        table[table.Key(known)] = value
        s = tp.session_over(tmp_path / "r.db", packed)
        s.stacks.probes.bpf = b
        ts, records, stacks = 1_000_000, [], []
        for native in (known, known, evicted, known, evicted, 0):
            ts += 1000
            records.append(tp.cuda_record(ts, tp.PID, "cudaStreamSynchronize", native=native))
            stacks.append(tp.stack_record(ts, tp.PID))
        tp.flush(s, records, stacks)
        s.stacks._final = True
        tp.flush(s, [], [])
        assert dict(s.stacks.native_errors) == {"native stack not in the map": 2, "native stack not walked": 1}
        s.stacks.report_misses()
        caps = [c for c in s.stacks.probes.capabilities if c.probe == "native stacks"]
        assert [(c.layer, c.detail) for c in caps] == [
            ("cuda", "3 calls stored without one (native stack not in the map: 2, native stack not walked: 1)")]
        s.store.close()
        native_column = tp.CUDA_COLUMNS.index("native_stack_id")
        natives = [row[native_column] for row in tp.calls(tmp_path / "r.db")]
        assert natives[2] is natives[4] is natives[5] is None
        assert natives[0] == natives[1] == natives[3] is not None
        frames = q(tmp_path / "r.db", "SELECT depth, address FROM native_stack_frame WHERE stack_id = ?",
                   (natives[0],))
        assert frames == [(0, 0x40_1000), (1, 0x40_1234)]
    finally:
        b.cleanup()
