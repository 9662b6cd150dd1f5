"""A GPU job's CUDA traffic at full rate, end to end with real BPF, on the CPU stand-in of its shape
(tests/workloads/standin_gpu_job.py): 50,000 kernel launches a second from 24+ Python frames deep,
the runtime's cudaLaunchKernel calling the driver's exported cuLaunchKernel through a trampoline in
executable anonymous memory, cuLaunchKernelEx straight at the driver, a copy and a synchronisation
per step, CUDA graph capture, instantiation and replays.

Checked, by default (launches counted at their entries, one trap each): every launch counted
exactly, in all and in each step; one in 64 kept as a sample with the line that made it; every other
call one row. With --launch-rows: not one CUDA call dropped; one row per call (the driver call a
runtime call makes is the detail of its row, not a row of its own; the driver's own launches are
rows); the fast launches' stacks are a sample, every slow launch has its stacks, taken at its
return, with the line that made it; graphs are recorded with their handles. Skipped with the reason
without root.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import ROOT, losses_beyond_skips, needs_bpf, q, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf]

JOB = ROOT / "tests" / "workloads" / "standin_gpu_job.py"
RATE = 50_000
SECONDS = 4  # with --launch-rows
WORKER = 20  # launches a second thread makes per step (a backward pass's)
DEPTH = 24


def record_job(tmp_path: Path, native: dict, *extra: str, env: dict | None = None) -> tuple[Path, dict]:
    db, out = tmp_path / "r.db", tmp_path / "job.json"
    res = run_recorder("record", "--db", str(db), "--", sys.executable, str(JOB), "--libdir", str(native["dir"]),
                       "--depth", str(DEPTH), "--out", str(out), *extra, timeout=600,
                       env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]
    return db, json.loads(out.read_text())


def rows_by_api(db: Path) -> dict[str, int]:
    return dict(q(db, "SELECT a.name, count(*) FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id GROUP BY 1"))


def test_every_launch_counted_at_fifty_thousand_launches_a_second(tmp_path: Path, native) -> None:
    """The default: each launch one trap, counted in BPF; each step's count exact; one in 64 a sample
    with its Python line; the other calls rows as before."""
    db, job = record_job(tmp_path, native, "--rate", str(RATE), "--seconds", "6", "--graphs", "50", "--markers",
                         "--worker-launches", str(WORKER))
    calls = job["calls"]
    assert job["launch_rate"] >= 0.8 * RATE, f"the job reached only {job['launch_rate']:,.0f} launches/s"
    assert losses_beyond_skips(db) == {}
    assert q(db, "SELECT layer, probe, detail FROM capability WHERE status = 'failed'") == []
    launches = calls["cudaLaunchKernel"] + calls["cuLaunchKernelEx"]
    # every launch counted once: the driver launch the runtime's makes inside it is that launch's
    counted = dict(q(db, "SELECT a.name, sum(k.launches) FROM cuda_launch_count k JOIN cuda_api a"
                         " ON a.id = k.api_id GROUP BY 1"))
    assert q(db, "SELECT count(*) FROM cuda_launch_count WHERE api_id IS NULL") == [(0,)]  # 6 kernels: all named
    assert sum(counted.values()) == launches, (counted, calls)
    assert counted["cuLaunchKernelEx"] == calls["cuLaunchKernelEx"]
    assert counted["cudaLaunchKernel"] + counted["cuLaunchKernel"] == calls["cudaLaunchKernel"]
    # ... the runtime's launch probes detached once the first runtime launches were all seen at the driver
    switch = q(db, "SELECT detail FROM capability WHERE layer = 'cuda' AND probe = 'launch probes'")
    assert len(switch) == 1 and switch[0][0].startswith("driver only: the first "), switch
    # ... and each kernel by its function pointer
    ops = {f"0x7f000000{i}000": n for i, n in
           q(db, "SELECT (function - 0x7f0000000000) / 0x1000, sum(launches) FROM cuda_launch_count GROUP BY 1")}
    steps = job["steps"]
    assert ops == {**{f"0x7f000000{i}000": calls["cudaLaunchKernel"] // 4 for i in range(1, 5)},
                   "0x7f0000005000": 4 * steps, "0x7f0000006000": WORKER * steps}, ops
    # no launch is a cuda_call row; every other call is one
    rows = rows_by_api(db)
    assert not {api for api in rows if "LaunchKernel" in api}, rows
    for api in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaGraphInstantiate", "cudaGraphLaunch"):
        assert rows.get(api) == calls[api], (api, rows.get(api), calls[api])
    # each step's launches exact: its 500 launches, 4 of cuLaunchKernelEx and the other thread's, whatever
    # the interval the counts were sent at (a step marker ends every thread's)
    per_step = q(db, "SELECT launches, how FROM step_launch")
    # (the first steps' markers come before the probes reach the marker library the job imports)
    assert len(per_step) >= job["steps"] - 10, (len(per_step), job["steps"])
    assert set(per_step) == {(504 + WORKER, "counted")}, set(per_step)
    # samples: about one in 64, each at the line of the op that launched it, under the whole module tree
    samples = q(db, "SELECT python_lineno, python_file, python_status FROM cuda_launch_sample_python")
    share = len(samples) / launches
    assert 0.5 / 64 < share < 2 / 64, f"{len(samples)} samples of {launches} launches"
    lines = set(job["op_lines"].values())
    assert {line for line, f, status in samples if status == "ok" and f == job["file"]} >= lines
    ok = [s for s in samples if s[2] == "ok"]
    assert len(ok) >= 0.95 * len(samples), samples[:5]
    assert q(db, "SELECT min(s.depth) FROM cuda_launch_sample c JOIN python_stack s ON s.id = c.python_stack_id"
                 " WHERE c.api_id IN (SELECT id FROM cuda_api WHERE name = 'cuLaunchKernel')")[0][0] > DEPTH
    # their native stack starts at the probed entry point
    assert {r[0] for r in q(db, "SELECT DISTINCT f.symbol FROM cuda_launch_sample c JOIN native_stack_frame f"
                                " ON f.stack_id = c.native_stack_id AND f.depth = 0")} <= {
        "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"}
    # the report says how many launches the step made
    res = run_recorder("explain", "--db", str(db), "--step", "20", "--json", check=True)
    assert json.loads(res.stdout)["launches"]["launches"] == 504 + WORKER


def test_every_call_kept_at_fifty_thousand_launches_a_second(tmp_path: Path, native) -> None:
    """--launch-rows: a row per launch, with its duration."""
    db, job = record_job(tmp_path, native, "--rate", str(RATE), "--seconds", str(SECONDS), "--graphs", "50",
                         env={"STALL_RECORDER_LAUNCH_ROWS": "1"})
    calls = job["calls"]
    # the job really called at that rate while it was recorded
    assert job["launch_rate"] >= 0.8 * RATE, f"the job reached only {job['launch_rate']:,.0f} launches/s"
    assert calls["cudaLaunchKernel"] >= 0.8 * RATE * SECONDS
    # not one call dropped, and nothing else lost but program runs a busy machine skips
    assert losses_beyond_skips(db) == {}
    # every program loaded (without the dlopen hold's, the launches made before the recorder attached
    # to the libraries the job just opened are missing, with no loss to count)
    assert q(db, "SELECT layer, probe, detail FROM capability WHERE status = 'failed'") == []
    rows = rows_by_api(db)
    # one row per launch: the runtime's (which names the driver API it went through) until the
    # recorder has seen 1,000 of them all go through the driver's launch probes, then the driver's
    assert calls["cuLaunchKernel"] == calls["cudaLaunchKernel"]
    assert calls["cuStreamSynchronize"] == calls["cudaStreamSynchronize"]
    assert rows["cudaLaunchKernel"] + rows["cuLaunchKernel"] == calls["cudaLaunchKernel"]
    assert 1000 <= rows["cudaLaunchKernel"] < calls["cudaLaunchKernel"] // 2, rows
    switch = q(db, "SELECT status, detail FROM capability WHERE layer = 'cuda' AND probe = 'launch probes'")
    assert len(switch) == 1 and switch[0][1].startswith("driver only: the first "), switch
    # no driver row before the switch, but for a runtime launch whose entry program the kernel skipped
    # (a busy machine's, counted): the driver's probe then saw a launch no runtime entry held, its own row
    (early,), = q(db, "SELECT count(*) FROM cuda_call_named WHERE api = 'cuLaunchKernel' AND ts < "
                      "(SELECT max(ts) FROM cuda_call_named WHERE api = 'cudaLaunchKernel')")
    (skipped,), = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe LIKE 'bpf program %skipped (cuda)'")
    assert early <= skipped, (early, skipped)
    # the driver call a runtime call makes inside it is no row of its own
    assert "cuStreamSynchronize" not in rows
    for api in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cuLaunchKernelEx", "cudaStreamBeginCapture",
                "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaGraphLaunch"):
        assert rows.get(api) == calls[api], (api, rows.get(api), calls[api])
    # ... but each runtime row names the driver API it went through
    assert q(db, "SELECT d.name, count(*) FROM cuda_call c JOIN cuda_api d ON d.id = c.driver_api_id"
                 " GROUP BY 1 ORDER BY 1") == [
        ("cuLaunchKernel", rows["cudaLaunchKernel"]), ("cuStreamSynchronize", calls["cudaStreamSynchronize"])]
    # after the switch a launch's native stack still shows the runtime's frame it came through
    assert ("cuLaunchKernel", "cudaLaunchKernel") in {
        tuple(r) for r in q(db, "SELECT f0.symbol, f2.symbol FROM cuda_call_named c"
                                " JOIN native_stack_frame f0 ON f0.stack_id = c.native_stack_id AND f0.depth = 0"
                                " JOIN native_stack_frame f2 ON f2.stack_id = c.native_stack_id AND f2.depth = 2"
                                " WHERE c.api = 'cuLaunchKernel'")}

    # graphs: the instantiation's exec handle is what every replay launched
    exec_handle = job["graph_exec"]
    assert q(db, "SELECT pointer FROM cuda_call_named WHERE api = 'cudaGraphInstantiate'") == [(exec_handle,)]
    assert q(db, "SELECT DISTINCT event_handle FROM cuda_call_named WHERE api = 'cudaGraphLaunch'") == [(exec_handle,)]

    # stacks: every non-launch call has its line; the launches' stacks are a sample (one in 64),
    # each the line of the op that launched, under the whole module tree
    file, lines = job["file"], set(job["op_lines"].values())
    launches = q(db, "SELECT python_lineno, python_file, python_status FROM cuda_call_python p"
                     " JOIN cuda_api a ON a.id = p.api_id WHERE a.name IN ('cudaLaunchKernel', 'cuLaunchKernel')"
                     " AND p.python_stack_id IS NOT NULL")
    share = len(launches) / calls["cudaLaunchKernel"]
    assert 0.5 / 64 < share < 3 / 64, f"{len(launches)} launches of {calls['cudaLaunchKernel']} have stacks"
    assert {(line, f, status) for line, f, status in launches} <= {(line, file, "ok") for line in lines}
    assert {line for line, _, _ in launches} == lines
    assert q(db, "SELECT min(s.depth) FROM cuda_call c JOIN python_stack s ON s.id = c.python_stack_id"
                 " WHERE c.api_id IN (SELECT id FROM cuda_api WHERE name LIKE 'cu%LaunchKernel')")[0][0] > DEPTH
    assert q(db, "SELECT count(*) FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
                 " WHERE a.name IN ('cudaStreamSynchronize', 'cudaMemcpyAsync', 'cudaGraphLaunch')"
                 " AND c.python_stack_id IS NULL") == [(0,)]
    # the native stack of a launch starts at the probed entry point, as an entry's would
    for api in ("cudaLaunchKernel", "cuLaunchKernel"):
        assert {r[0] for r in q(db, "SELECT f.symbol FROM cuda_call c JOIN native_stack_frame f"
                                    " ON f.stack_id = c.native_stack_id AND f.depth = 0 JOIN cuda_api a"
                                    " ON a.id = c.api_id WHERE a.name = ?", (api,))} == {api}
    # launches kept without their stacks by design are not counted as calls without a native stack
    assert q(db, "SELECT count(*) FROM capability WHERE layer = 'cuda' AND probe = 'native stacks'"
                 " AND detail LIKE '%not walked%'") == [(0,)]


def test_slow_launches_and_graph_replays_have_their_lines(tmp_path: Path, native) -> None:
    """--launch-rows. Step 20's launches each take 400 us in the runtime: all of them get their stacks at their
    return (not a sample), with the op's line, and the report finds the step and the calls. The
    runtime's launch probes are kept (STALL_RECORDER_KEEP_RUNTIME_LAUNCHES=1): the time is the
    runtime's own, before it calls the driver, which the driver's probes alone do not cover.
    A graph is replayed in every step: each replay is linked to the graph and its instantiation's
    line (cuda_graph_launch), each step's synchronisation to the replay it waited for
    (cuda_sync_graph), and step 40's slow replay's report names the graph and that line."""
    db, job = record_job(tmp_path, native, "--rate", "20000", "--seconds", "3", "--markers",
                         "--slow-launch-step", "20", "--launches-per-step", "200", "--graph-every-step",
                         "--slow-graph-step", "40",
                         env={"STALL_RECORDER_KEEP_RUNTIME_LAUNCHES": "1", "STALL_RECORDER_LAUNCH_ROWS": "1"})
    assert "cuLaunchKernel" not in rows_by_api(db)
    assert losses_beyond_skips(db) == {}
    slow = q(db, "SELECT c.dur, p.python_lineno, p.python_file FROM cuda_call c"
                 " JOIN cuda_api a ON a.id = c.api_id LEFT JOIN cuda_call_python p ON p.cuda_call_id = c.id"
                 " WHERE a.name = 'cudaLaunchKernel' AND c.dur >= 400000")
    assert len(slow) >= 200, len(slow)
    lines = set(job["op_lines"].values())
    assert all(line in lines and f == job["file"] for _, line, f in slow), slow[:5]
    res = run_recorder("explain", "--db", str(db), "--step", "20", "--json", check=True)
    report = json.loads(res.stdout)
    assert report["step"]["step"] == 20
    text = json.dumps(report)
    assert "cudaLaunchKernel" in text and "standin_gpu_job.py" in text

    exec_handle, line = job["graph_exec"], job["graph_line"]
    where = f"capture_graph() at standin_gpu_job.py:{line}"
    assert q(db, "SELECT graph_exec, replays, instantiated_at FROM cuda_graph") == [
        (exec_handle, job["calls"]["cudaGraphLaunch"], where)]
    assert q(db, "SELECT count(*), count(DISTINCT graph_exec), min(instantiated_at) FROM cuda_graph_launch") == [
        (job["calls"]["cudaGraphLaunch"], 1, where)]
    # every step's synchronisation waited for that step's replay, and only for it
    linked = q(db, "SELECT sync_call_id, count(*) FROM cuda_sync_graph GROUP BY 1")
    assert len(linked) == job["steps"] and {n for _, n in linked} == {1}
    res = run_recorder("explain", "--db", str(db), "--step", "40", check=True)
    assert f"replaying graph {exec_handle:#x} instantiated at {where}" in res.stdout, res.stdout
