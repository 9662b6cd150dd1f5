"""The cluster view on real BPF: a two-rank job whose ranks are recorded by two separate recorders
into two databases, as on two hosts (the stand-in libnccl with a real rendezvous). Rank 1 sleeps
80 ms before its all-reduce in step 10 (the script's stand-in for a slow data loader).
`recorder cluster explain` must name rank 1, its database, the sleep and the script line, and do
so again when one recording's wall-clock offset is shifted by 3 s."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest
from conftest import RECORDER, ROOT, needs_bpf, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = ROOT / "tests" / "workloads" / "nccl_ranks.py"


def test_two_recorders_two_databases_name_the_late_rank(tmp_path, native):
    unique_id = os.urandom(128).hex()
    dbs = [tmp_path / f"host{r}.db" for r in (0, 1)]
    procs = []
    for rank, db in enumerate(dbs):
        argv = [*RECORDER, "record", "--db", str(db), "--cuda-lib", str(native["dir"] / "libnccl.so.2"),
                "--cuda-lib", str(native["libcudart.so.12"]), "--",
                sys.executable, str(WORKLOAD), "--libdir", str(native["dir"]), "--ranks", "2", "--rank", str(rank),
                "--unique-id", unique_id, "--steps", "24", "--slow-rank", "1", "--slow-steps", "10",
                "--slow-ms", "80"]
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    pids = [json.loads(next(line for line in out.splitlines() if line.startswith("{")))["pid"] for out, _ in outs]
    for rank, db in enumerate(dbs):  # each database holds one rank, as a node's recording would
        conn = sqlite3.connect(db)
        assert conn.execute("SELECT rank, nranks FROM nccl_comm").fetchall() == [(rank, 2)]
        conn.close()
    line = next(n for n, t in enumerate(WORKLOAD.read_text().splitlines(), 1) if "time.sleep(args.slow_ms" in t)

    def check(report: dict, late_db) -> None:
        assert report["step"] == 10 and report["verdict"] == "late", report["notes"]
        (late,) = report["late_ranks"]
        assert (late["rank"], late["db"], late["pid"]) == (1, str(late_db), pids[1])
        assert 60e6 <= late["lateness_ns"] <= 200e6
        why = late["explanation"]
        assert why["summary"].startswith("blocked") and "sleep" in why["summary"], why
        assert why["python"].endswith(f"nccl_ranks.py:{line}"), why["python"]
        assert report["clock"]["residual_skew_ns"] < 10e6

    res = run_recorder("cluster", "explain", str(dbs[0]), str(dbs[1]), "--step", "10", "--json", check=True)
    report = json.loads(res.stdout)
    check(report, dbs[1])
    corr = [c["correction_ns"] for c in report["clock"]["corrections"]]
    assert all(abs(c) < 5e6 for c in corr), corr  # one host: the two wall offsets already agree
    text = run_recorder("cluster", "explain", str(dbs[0]), str(dbs[1]), "--step", "10", check=True).stdout
    assert "Late: rank 1 on " in text and str(dbs[1]) in text

    # the second "host" 3 s ahead: realigned on the collectives, same answer
    skewed = tmp_path / "skewed"
    skewed.mkdir()
    shutil.copy(dbs[0], skewed / "host0.db")
    shutil.copy(dbs[1], skewed / "host1.db")
    conn = sqlite3.connect(skewed / "host1.db")
    conn.execute("UPDATE session SET wall_offset_ns = wall_offset_ns + 3000000000")
    conn.commit()
    conn.close()
    report = json.loads(run_recorder("cluster", "explain", str(skewed), "--step", "10", "--json", check=True).stdout)
    check(report, skewed / "host1.db")
    corr = {c["db"]: c["correction_ns"] for c in report["clock"]["corrections"]}
    assert abs(corr[str(skewed / "host1.db")] - corr[str(skewed / "host0.db")] + 3e9) < 5e6, corr
