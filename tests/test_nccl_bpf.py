"""NCCL and markers on real BPF: a two-rank job (two processes, the stand-in libnccl with a real
rendezvous), rank 1 late to its collective at steps 10 and 11. The recording must name rank 1 as
the straggler of those collectives, rank 0's wait, and the steps the script marked."""

from __future__ import annotations

import json
import sqlite3
import sys

import pytest
from conftest import ROOT, needs_bpf, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf]


def test_two_ranks_straggler_and_steps(tmp_path, native):
    db = tmp_path / "r.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["dir"] / "libnccl.so.2"),
                       "--cuda-lib", str(native["libcudart.so.12"]), "--",
                       sys.executable, str(ROOT / "tests" / "workloads" / "nccl_ranks.py"),
                       "--libdir", str(native["dir"]), "--steps", "20", "--slow-rank", "1",
                       "--slow-steps", "10,11", "--slow-ms", "80", timeout=300)
    assert res.returncode == 0, res.stderr
    ranks = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            ranks[r["rank"]] = r
    conn = sqlite3.connect(db)
    q = lambda sql, *p: conn.execute(sql, p).fetchall()  # noqa: E731
    comms = q("SELECT n.rank, n.nranks, p.pid FROM nccl_comm n JOIN process p ON p.id = n.process_id ORDER BY rank")
    assert comms == [(0, 2, ranks[0]["pid"]), (1, 2, ranks[1]["pid"])]
    assert len({h for (h,) in q("SELECT comm_hash FROM nccl_comm")}) == 1  # one communicator across ranks
    calls = q("SELECT rank, count(*), min(count), max(count), min(datatype), min(op), min(stream) - 28672"
              " FROM nccl_call_detail WHERE api = 'ncclAllReduce' GROUP BY rank ORDER BY rank")
    assert calls == [(0, 20, 1 << 20, 1 << 20, 7, 0, 0), (1, 20, 1 << 20, 1 << 20, 7, 0, 1)]
    # steps from markers match the script's own count, per rank
    steps = q("SELECT p.pid, count(*), min(s.step), max(s.step) FROM step s JOIN process p ON p.id = s.process_id"
              " GROUP BY p.pid ORDER BY p.pid")
    assert sorted(steps) == sorted([(ranks[r]["pid"], 20, 0, 19) for r in (0, 1)])
    # step 0 is left out: the rank processes start at different times, so its first collective
    # really does wait for the later starter
    late = q("SELECT step, straggler_rank, lateness_dur FROM nccl_straggler WHERE lateness_dur > 40000000"
             " AND step > 0 ORDER BY step")
    assert [(s, r) for s, r, _ in late] == [(10, 1), (11, 1)]
    assert all(d >= 60_000_000 for _, _, d in late)
    waits = q("SELECT step, wait_dur FROM nccl_collective_wait WHERE rank = 0 AND wait_dur > 40000000 AND step > 0"
              " ORDER BY step")
    assert [s for s, _ in waits] == [10, 11]
    # every collective and step mark names the rank's line that made it (its stack at the uprobe)
    script = (ROOT / "tests" / "workloads" / "nccl_ranks.py").read_text().splitlines()
    line_of = {what: next(n for n, t in enumerate(script, 1) if what in t)
               for what in ("nccl.ncclAllReduce(", "recorder.step(")}
    for table, where, what in (("nccl_call", "x.api_id = (SELECT id FROM nccl_api WHERE name = 'ncclAllReduce')",
                                "nccl.ncclAllReduce("), ("step_mark", "1", "recorder.step(")):
        sites = q(f"SELECT p.qualname, p.line, count(*) FROM {table} x"
                  f" LEFT JOIN python_call_site p ON p.stack_id = x.python_stack_id WHERE {where} GROUP BY 1, 2")
        assert sites == [("rank_main", line_of[what], 40)], (table, sites)
    # the wait rank 0 reports itself agrees with the recording within 15 ms
    for step, wait in waits:
        assert abs(wait / 1e9 - ranks[0]["step_s"][step]) < 0.015
    # the report of step 10 names the straggler as the cause of rank 0's wait, and why rank 1 was
    # late: it slept before the collective (the script's stand-in for a slow data loader)
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", "10", "--json", check=True).stdout)
    assert report["stall"] is True
    # every call returned before the stop: no hang is reported
    assert "hang" not in report and q("SELECT count(*) FROM nccl_call WHERE open = 1") == [(0,)]
    cause = report["primary_cause"]
    assert cause["kind"] == "nccl_straggler", cause["summary"]
    assert cause["straggler_rank"] == 1 and cause["straggler_pid"] == ranks[1]["pid"]
    assert report["step"]["thread"]["pid"] == ranks[0]["pid"]
    late = report["straggler"]
    assert late["pid"] == ranks[1]["pid"] and late["summary"].startswith("blocked"), late
    assert "sleep" in late["summary"]
    text = run_recorder("explain", "--db", str(db), "--step", "10", check=True).stdout
    assert "Primary cause: NCCL straggler: rank 1" in text and f"Why rank 1 (pid {ranks[1]['pid']}) was late" in text
