"""Where the recorder puts its entry probes, on real uprobes: a stand-in driver whose cuLaunchKernel
begins with a RIP-relative load (single-stepped) and then a jmp (emulated) has its probes moved to
the jmp, and every launch is still a row with its arguments, those on the stack included; one whose
code jumps back into its first instructions keeps its probes at the entry; an emulated entry stays
(tests/native/cuda_trap.c, recorder/core/x86insn.py)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output

import native_libs  # tests/native, put on the path by conftest

pytestmark = [needs_bpf, pytest.mark.bpf]

WORK = ROOT / "tests" / "workloads" / "trap_launches.py"
LAUNCHES = 200


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    driver = native_libs.build_trap_library()
    db = tmp_path_factory.mktemp("placement") / "placement.db"
    # per-launch rows: each launch's arguments and return code are what a moved probe must still read
    res = run_recorder("record", "--db", str(db), "--launch-rows", "--", sys.executable, str(WORK),
                       "--driver", str(driver), "--launches", str(LAUNCHES), timeout=180)
    assert res.returncode == 0, res.stderr
    out = workload_output(res.stdout)
    assert set(out["calls"].values()) == {LAUNCHES}, out
    return db


def _detail(db, probe: str) -> str:
    (status, detail), = q(db, "SELECT status, detail FROM capability WHERE layer = 'cuda' AND probe = ?", (probe,))
    assert status == "attached"
    return detail


def test_a_single_stepped_entry_is_probed_at_the_first_emulated_instruction(recording):
    assert _detail(recording, "cuLaunchKernel").startswith(
        "entry mov "), _detail(recording, "cuLaunchKernel")
    assert "(%rip),%rax is single-stepped; probe moved to +7 (jmp " in _detail(recording, "cuLaunchKernel")
    rows = q(recording, "SELECT function, grid, block, shared_mem_bytes, stream, ret, open FROM cuda_call_named"
                        " WHERE api = 'cuLaunchKernel' ORDER BY ts")
    assert rows == [(0x1000 + i, f"{i},2,3", f"4,5,{i % 7 + 1}", i * 16, i + 100, 0, 0)
                    for i in range(1, LAUNCHES + 1)]


def test_a_function_that_jumps_back_into_its_first_instructions_keeps_its_probe_at_the_entry(recording):
    detail = _detail(recording, "cuLaunchKernel_ptsz")
    assert detail.endswith("not moved: the code at +16 may jump to +1..+7, the bytes skipped or the new place"), \
        detail
    # one row a call: a probe at +7 would have fired twice in each
    assert q(recording, "SELECT count(*), min(ret), max(ret) FROM cuda_call_named"
                        " WHERE api = 'cuLaunchKernel_ptsz'") == [(LAUNCHES, 0, 0)]


def test_an_emulated_entry_stays(recording):
    assert _detail(recording, "cuLaunchKernel_ptds") == "entry push %rbp is emulated (a push): one trap a call"
    assert q(recording, "SELECT count(*) FROM cuda_call_named WHERE api = 'cuLaunchKernel_ptds'") == [(LAUNCHES,)]
