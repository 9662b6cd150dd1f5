"""Hangs on real BPF: a two-rank job (two processes, the stand-in libnccl with a real rendezvous)
where rank 1's GPU synchronisation never returns before the collective of step 5, so rank 0 waits in
ncclAllReduce for ever (or rank 1 never joins the communicator, and rank 0 waits in its init). The
session is stopped during the hang: the calls in flight must be stored as open calls with their
thread and line, and the report must say who is inside which call since when, and which rank never
entered the collective (or the init)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder
from test_mcp_tools import over_stdio

pytestmark = [needs_bpf, pytest.mark.bpf]

WORKLOAD = ROOT / "tests" / "workloads" / "nccl_ranks.py"
HANG_STEP = 5


def _hung_job(tmp_path, native, kill_hung: bool = False, hang_step: int = HANG_STEP) -> tuple[dict, dict]:
    """Record the job until rank 1 hangs, stop the session during the hang; returns the ranks'
    pids and the hung rank's line. `kill_hung`: rank 1 is killed inside its call before the stop."""
    db = tmp_path / "r.db"
    go = tmp_path / "go"
    metrics = tmp_path / "r.prom"  # the workload metrics: the NCCL calls in flight, as the layers answer them
    job = subprocess.Popen([sys.executable, str(WORKLOAD), "--libdir", str(native["dir"]), "--steps", "20",
                            "--slow-steps", "", "--hang-rank", "1", "--hang-step", str(hang_step),
                            "--wait-file", str(go)],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run_recorder("start", "-p", str(job.pid), "--db", str(db), "--cuda-lib", str(native["dir"] / "libnccl.so.2"),
                     "--cuda-lib", str(native["libcudart.so.12"]), "--metrics-file", str(metrics), check=True)
        go.touch()
        deadline = time.monotonic() + 60
        hung = None
        while hung is None and time.monotonic() < deadline:
            line = job.stdout.readline()
            if line.startswith("{") and "hung" in line:
                hung = json.loads(line)
        assert hung, "rank 1 never reached its hang"
        time.sleep(1.5)  # rank 0 is in the collective by now, rank 1 in its synchronisation
        if kill_hung:
            os.kill(hung["pid"], signal.SIGKILL)
            time.sleep(1.0)  # the launcher reaps it
        stop = json.loads(run_recorder("stop", "--db", str(db), "--json", check=True).stdout)
        assert stop["status"] == "complete"
        assert job.poll() is None, "the job ended: it was meant to hang"
        ranks = {r: pid for r, pid in q(db, "SELECT n.rank, p.pid FROM nccl_comm n JOIN process p"
                                            " ON p.id = n.process_id")}
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    return {"db": db, "ranks": ranks, "stopped": stop, "metrics": metrics}, hung


def test_calls_in_flight_at_stop_are_stored_open_and_the_report_names_the_hang(tmp_path, native):
    rec, hung = _hung_job(tmp_path, native)
    db, ranks = rec["db"], rec["ranks"]
    assert set(ranks) == {0, 1} and ranks[1] == hung["pid"]
    script = WORKLOAD.read_text().splitlines()
    line_of = {what: next(n for n, t in enumerate(script, 1) if what in t)
               for what in ("assert nccl.ncclAllReduce(", "rt.cudaStreamSynchronize(stream)  # the step's kernels")}
    stopped_ts = q(db, "SELECT stopped_ts FROM session")[0][0]
    # exactly one open call per rank: rank 0 in the collective of step 5, rank 1 in the sync before it
    open_calls = []
    for table, apis in (("nccl_call", "nccl_api"), ("cuda_call", "cuda_api")):
        open_calls += q(db, f"SELECT p.pid, a.name, c.ret, c.ts + c.dur <= ?, s.line FROM {table} c"
                            f" JOIN {apis} a ON a.id = c.api_id JOIN thread t ON t.id = c.thread_id"
                            " JOIN process p ON p.id = t.process_id"
                            " LEFT JOIN python_call_site s ON s.stack_id = c.python_stack_id WHERE c.open = 1",
                        (stopped_ts,))
    assert open_calls == [
        (ranks[0], "ncclAllReduce", None, 1, line_of["assert nccl.ncclAllReduce("]),
        (ranks[1], "cudaStreamSynchronize", None, 1, line_of["rt.cudaStreamSynchronize(stream)  # the step's kernels"]),
    ], open_calls
    # every earlier call returned: rank 0 made HANG_STEP collectives before the open one, rank 1 as many
    closed = q(db, "SELECT rank, count(*) FROM nccl_call_detail WHERE api = 'ncclAllReduce' AND open = 0"
                   " GROUP BY rank ORDER BY rank")
    assert closed == [(0, HANG_STEP), (1, HANG_STEP)]
    # the open calls started before the stop by at least the time the test waited
    waited = q(db, "SELECT min(dur) FROM nccl_call WHERE open = 1")[0][0]
    assert waited >= 1_000_000_000
    assert q(db, "SELECT count(*) FROM loss WHERE probe LIKE '%in flight%'")[0][0] == 0
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    hang = report["hang"]
    assert hang is not None, report["summary"]
    inside = {(c["pid"], c["api"]) for c in hang["open_calls"]}
    assert inside == {(ranks[0], "ncclAllReduce"), (ranks[1], "cudaStreamSynchronize")}
    collective = hang["collectives"][0]
    assert collective["api"] == "ncclAllReduce" and collective["nranks"] == 2
    assert collective["inside_ranks"] == [0] and collective["missing_ranks"] == [1]
    (mcp,) = over_stdio(db, [("explain_stall", {})])  # the same through a real MCP client
    assert mcp["hang"]["collectives"][0]["missing_ranks"] == [1]
    assert {c["api"] for c in mcp["hang"]["open_calls"]} == {"ncclAllReduce", "cudaStreamSynchronize"}
    text = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "Hang: 2 calls had not returned when the session stopped" in text, text
    assert f"rank 0 (pid {ranks[0]}" in text and "inside ncclAllReduce since" in text
    assert "ranks not inside it: 1" in text, text
    assert f"nccl_ranks.py:{line_of['assert nccl.ncclAllReduce(']}" in text
    # the live metrics asked the layers what was in flight (SessionHandle.in_flight('nccl_call')): rank 0's
    # collective, read from the NCCL layer's map; rank 1's synchronisation, in the CUDA layer's, is no collective
    oldest = {}
    for line in rec["metrics"].read_text().splitlines():
        if line.startswith("stall_recorder_workload_collective_in_flight_oldest_seconds{"):
            labels, value = line.rsplit(" ", 1)
            oldest[next(int(x.split('"')[1]) for x in labels.split(",") if x.startswith("rank="))] = float(value)
    assert set(oldest) == {0, 1} and oldest[0] > 0 and oldest[1] == 0, oldest


def test_a_call_whose_process_died_inside_it_is_counted_as_lost(tmp_path, native):
    rec, hung = _hung_job(tmp_path, native, kill_hung=True)
    db, ranks = rec["db"], rec["ranks"]
    # rank 1 was killed inside cudaStreamSynchronize: its call can no longer be placed (no thread to
    # read its process from), so it is one loss; rank 0's collective is still stored open
    assert q(db, "SELECT probe, sum(dropped) FROM loss WHERE probe LIKE '%in flight%' GROUP BY probe") == [
        ("cuda call in flight, thread gone", 1)]
    assert q(db, "SELECT count(*) FROM cuda_call WHERE open = 1")[0][0] == 0
    assert q(db, "SELECT p.pid FROM nccl_call c JOIN thread t ON t.id = c.thread_id"
                 " JOIN process p ON p.id = t.process_id WHERE c.open = 1") == [(ranks[0],)]
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    (collective,) = report["hang"]["collectives"]
    assert collective["inside_ranks"] == [0] and collective["missing_ranks"] == [1]
    assert collective["missing"][0]["doing"].startswith("its process exited at "), collective
    assert report["loss"]["by_probe"]["cuda call in flight, thread gone"] == 1


def test_a_rank_that_never_joins_the_communicator_leaves_the_others_in_their_init(tmp_path, native):
    rec, hung = _hung_job(tmp_path, native, hang_step=-2)
    db, ranks = rec["db"], rec["ranks"]
    assert hung["step"] == "init"
    # rank 0 is stored inside ncclCommInitRank, with the communicator it was joining (no handle yet)
    assert ranks == {0: q(db, "SELECT p.pid FROM nccl_call c JOIN thread t ON t.id = c.thread_id"
                              " JOIN process p ON p.id = t.process_id WHERE c.open = 1")[0][0]}
    assert q(db, "SELECT a.name, c.ret, c.handle FROM nccl_call c JOIN nccl_api a ON a.id = c.api_id"
                 " WHERE c.open = 1") == [("ncclCommInitRank", None, None)]
    assert q(db, "SELECT rank, nranks, handle FROM nccl_comm") == [(0, 2, 0)]
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    (call,) = report["hang"]["open_calls"]
    assert (call["api"], call["rank"], call["pid"]) == ("ncclCommInitRank", 0, ranks[0])
    (init,) = report["hang"]["collectives"]
    assert init["api"] == "ncclCommInitRank" and init["nranks"] == 2
    assert init["inside_ranks"] == [0] and init["missing_ranks"] == [1]
    assert init["missing"][0]["recorded"] is False
    text = run_recorder("explain", "--db", str(db), check=True).stdout
    assert f"rank 0 (pid {ranks[0]}" in text and "inside ncclCommInitRank since" in text, text
    assert "ranks not inside it: 1 (no process recorded here entered it as this rank" in text, text
