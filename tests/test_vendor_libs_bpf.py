"""The real vendor libraries on real BPF: NVIDIA's libcudart.so.12 and libnccl.so.2 from their
wheels (tests/native/vendor_libs.py; skipped with the reason when they cannot be had offline).
A process dlopens each library after the recording started and calls it at once: every call must
be recorded (none missed while the recorder attaches to a library just loaded), with its arguments
and return code (no driver here: cudart returns 35, insufficient driver; NCCL an error), and the
native stacks through the libraries and the interpreter, built without frame pointers, must be
sane (the probed function, its caller, then only frames inside mapped files)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder
from vendor_libs import vendor_library

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = ROOT / "tests" / "workloads" / "vendor_calls.py"
CALLS = 500


@pytest.fixture(scope="module")
def vendor() -> dict:
    libs = {name: vendor_library(name) for name in ("libcudart.so.12", "libnccl.so.2")}
    missing = [f"{name}: {got}" for name, got in libs.items() if isinstance(got, str)]
    if missing:
        pytest.skip("the vendor libraries are not available: " + "; ".join(missing))
    return libs


def test_every_call_after_dlopen_is_recorded_with_arguments_and_return_codes(tmp_path, vendor):
    db, go = tmp_path / "r.db", tmp_path / "go"
    cudart, nccl = (str(vendor[n]) for n in ("libcudart.so.12", "libnccl.so.2"))
    proc = subprocess.Popen([sys.executable, str(WORKLOAD), "--cudart", cudart, "--nccl", nccl,
                             "--calls", str(CALLS), "--wait-file", str(go)], stdout=subprocess.PIPE, text=True)
    try:
        # no --cuda-lib: the libraries are found when the process loads them
        run_recorder("start", "-p", str(proc.pid), "--db", str(db), check=True)
        go.touch()
        out, _ = proc.communicate(timeout=120)
        time.sleep(0.3)
        run_recorder("stop", "--db", str(db), check=True)
    finally:
        proc.kill()
    ran = json.loads(out.strip().splitlines()[-1])
    assert ran["malloc"] == [35] and ran["sync"] == [35], ran  # cudaErrorInsufficientDriver
    assert len(ran["allreduce"]) == 1 and ran["allreduce"][0] != 0, ran
    # both libraries were found at their dlopen and their probes attached
    found = dict(q(db, "SELECT path, found_by FROM library"))
    assert found.get(cudart) == "dlopen" and found.get(nccl) == "dlopen", found
    attached = {p for p, in q(db, "SELECT probe FROM capability WHERE status = 'attached' AND target IN (?, ?)",
                              (cudart, nccl))}
    assert {"cudaMalloc", "cudaStreamSynchronize", "ncclAllReduce"} <= attached
    # every call, the first ones after each dlopen included, with its arguments and return code
    mallocs = q(db, "SELECT size_bytes, ret FROM cuda_call_named WHERE api = 'cudaMalloc' ORDER BY ts")
    assert mallocs == [(1000 + i, 35) for i in range(CALLS)], (len(mallocs), mallocs[:3])
    syncs = q(db, "SELECT stream, ret FROM cuda_call_named WHERE api = 'cudaStreamSynchronize' ORDER BY ts")
    assert syncs == [(0x1000 + i, 35) for i in range(CALLS)], (len(syncs), syncs[:3])
    reduces = q(db, "SELECT count, datatype, op, stream, ret FROM nccl_call_detail WHERE api = 'ncclAllReduce'"
                    " ORDER BY ts")
    assert reduces == [(1000 + i, 7, 0, 0x2000 + i, ran["allreduce"][0]) for i in range(CALLS)], \
        (len(reduces), reduces[:3])
    # the held process was let go: it ran to its end; nothing was left in flight
    assert proc.returncode == 0
    assert q(db, "SELECT count(*) FROM cuda_call WHERE open = 1") == [(0,)]
    # native stacks through code without frame pointers: the probed function in the vendor library,
    # its caller (ctypes' libffi), and never a frame outside a mapped file (garbage read from %rbp)
    stacks = q(db, "SELECT DISTINCT native_stack_id FROM cuda_call_named WHERE api = 'cudaMalloc'")
    assert stacks and None not in {s for s, in stacks}
    for (stack,) in stacks:
        frames = q(db, "SELECT symbol, object FROM native_stack_frame WHERE stack_id = ? ORDER BY depth", (stack,))
        assert frames[0] == ("cudaMalloc", cudart), frames
        assert "libffi" in (frames[1][1] or ""), frames
        assert all(obj is not None for _, obj in frames), frames
    # and their Python line is the workload's
    script = WORKLOAD.read_text().splitlines()
    line = next(n for n, t in enumerate(script, 1) if "rt.cudaMalloc(ctypes.byref" in t)
    sites = q(db, "SELECT s.line, count(*) FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
                  " JOIN python_call_site s ON s.stack_id = c.python_stack_id WHERE a.name = 'cudaMalloc' GROUP BY 1")
    assert sites == [(line, CALLS)], sites
