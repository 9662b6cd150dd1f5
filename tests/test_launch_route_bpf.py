"""Where kernel launches are probed, and their returns, on real probes (stand-in CUDA libraries),
in one recording of two processes run one after the other: the runtime's launch probes are given up
per library, on the evidence of the processes that map it, so a runtime library found after
another's switch still has its launches probed; and a launch return that is not the recorded
launch's own, nor a driver launch's inside it, is a counted loss. Recorded with --launch-rows (a row
and a return probe per launch); the switch with launches counted is tests/test_standin_gpu_bpf.py's."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf]

WORK = ROOT / "tests" / "workloads" / "launch_route.py"


@pytest.fixture(scope="module")
def recording(native, tmp_path_factory):
    """Process A: 3,000 runtime launches, all through the driver; a driver launch left by longjmp (as
    an exception thrown through the driver leaves it: its return is never seen, its thread's launch
    record stays); 5 cudaMemcpyAsync that launch a copy kernel through the driver; then 3 s idle, in
    which A's runtime's launch probes are detached. Then process B, from another environment's copy of
    the runtime (one that does not launch through a probed driver): 300 launches."""
    tmp = tmp_path_factory.mktemp("route")
    other = tmp / "venv-b"
    other.mkdir()
    shutil.copy2(native["libcudart.so.12"], other / "libcudart.so.12")
    db = tmp / "route.db"
    a = (f"{sys.executable} {WORK} --libdir {native['dir']} --driver {native['libcuda.so.1']} --launches 3000"
         " --abandon --copies 5 --after 3")
    b = f"{sys.executable} {WORK} --libdir {other} --launches 300"
    res = run_recorder("record", "--db", str(db), "--launch-rows", "--", "sh", "-c", f"{a} && {b}", timeout=300)
    assert res.returncode == 0, res.stderr
    runs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["launches"] for r in runs] == [3000, 300], res.stdout
    return {"db": db, "a": runs[0]["pid"], "b": runs[1]["pid"], "first": str(native["libcudart.so.12"].resolve()),
            "second": str((other / "libcudart.so.12").resolve())}


def test_a_runtime_found_after_the_switch_to_the_driver_keeps_its_launch_probes(recording):
    db = recording["db"]
    # B's runtime got its launch probes, and every launch of B is a row
    assert q(db, "SELECT count(*) FROM cuda_call_detail WHERE api = 'cudaLaunchKernel' AND pid = ?",
             (recording["b"],)) == [(300,)]
    assert q(db, "SELECT status FROM capability WHERE layer = 'cuda' AND probe = 'cudaLaunchKernel'"
                 " AND target = ?", (recording["second"],)) == [("attached",)]
    # A's runtime switched, on A's evidence (the decision names the library)
    switched = q(db, "SELECT target, detail FROM capability WHERE layer = 'cuda' AND probe = 'launch probes'")
    assert [t for t, _ in switched] == [recording["first"]] and switched[0][1].startswith("driver only: "), switched
    # A's launches: the runtime's rows, then the driver's
    assert q(db, "SELECT count(*) FROM cuda_call_detail WHERE api IN ('cudaLaunchKernel', 'cuLaunchKernel')"
                 " AND pid = ? AND open = 0", (recording["a"],)) == [(3000,)]


def test_a_launch_return_not_matched_to_its_entry_is_a_counted_loss(recording):
    """The copy kernels return with another stack pointer than the launch record the abandoned launch
    left: each return is counted lost under the CUDA layer's declared word."""
    db = recording["db"]
    assert q(db, "SELECT count(*) FROM cuda_call_detail WHERE api = 'cudaMemcpyAsync'") == [(5,)]
    assert q(db, "SELECT sum(dropped) FROM loss WHERE probe = 'cuda launch return not matched to its entry'") \
        == [(5,)]
    assert q(db, "SELECT layer, what FROM layer_vocabulary WHERE word = 'cuda launch return not matched to its"
                 " entry'") == [("cuda", "CUDA kernel launches")]
    # the abandoned launch never returned: at the stop it is still in flight, of a process gone
    assert q(db, "SELECT sum(dropped) FROM loss WHERE probe = 'cuda call in flight, thread gone'") == [(1,)]
