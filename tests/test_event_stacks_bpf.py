"""Python lines at more than CUDA calls, with real BPF: the off-CPU wait of a thread blocked at a
known line (a sleep, a pipe read), the block requests of a write+fsync and of direct writes on a
loop device (also when blk-throttle makes a kworker queue them), the NCCL collective and the
step/lineage/checkpoint markers of tests/workloads/event_stacks.py, each read through the
python_call_site view as a report reads it. Skipped with the reason without root, BPF or loop
devices."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output
from test_io_bpf import ext4_loop, throttled  # noqa: F401  (fixtures: a loop device, a blkio throttle)

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = ROOT / "tests" / "workloads" / "event_stacks.py"


def tagged_lines() -> dict[str, int]:
    """'sleep' -> the line of the workload that ends with '# @sleep', and so on."""
    out = {}
    for n, text in enumerate(WORKLOAD.read_text().splitlines(), 1):
        if "  # @" in text:
            out[text.rsplit("# @", 1)[1].strip()] = n
    return out


def record(db: Path, native, *extra: str) -> dict:
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["dir"] / "libnccl.so.2"), "--",
                       sys.executable, str(WORKLOAD), "--libdir", str(native["dir"]), *extra, timeout=300)
    assert res.returncode == 0, res.stderr
    return workload_output(res.stdout)


def call_sites(db: Path, table: str, where: str = "1", params: tuple = ()) -> list[tuple]:
    """(qualname, filename, line) of each row's Python call site, NULLs where the row has none."""
    return q(db, f"SELECT p.qualname, p.filename, p.line FROM {table} x"
                 f" LEFT JOIN python_call_site p ON p.stack_id = x.python_stack_id WHERE {where} ORDER BY x.ts",
             params)


def test_waits_markers_and_collective_carry_their_line(tmp_path: Path, native) -> None:
    db = tmp_path / "r.db"
    truth = record(db, native)
    lines = tagged_lines()
    here = str(WORKLOAD)
    main_tid = "x.thread_id IN (SELECT id FROM thread WHERE tid = ?)"  # before and after its exec

    # the thread blocked at the sleep and at the pipe read: one off-CPU interval each, at that line
    waits = q(db, "SELECT p.qualname, p.line, x.dur, x.state, x.syscall FROM offcpu_interval x"
                  " JOIN python_call_site p ON p.stack_id = x.python_stack_id"
                  f" WHERE {main_tid} AND p.filename = ? AND x.dur > 150000000 ORDER BY x.ts",
              (truth["tid"], here))
    sites = [(fn, line) for fn, line, *_ in waits]
    assert ("main", lines["sleep"]) in sites, waits
    assert ("wait_for_pipe", lines["pipe"]) in sites, waits
    pipe = next(w for w in waits if w[1] == lines["pipe"])
    assert pipe[3] == 1 and pipe[4] == 0  # interruptible sleep, in read(2)
    # every blocked interval of the traced thread of 1 ms or more has a stack (shorter waits in a
    # syscall get one only when another capture covers them); preemptions have none
    assert q(db, f"SELECT count(*) FROM offcpu_interval x WHERE {main_tid} AND x.state NOT IN (0, 256)"
                 " AND x.dur >= 1000000 AND x.python_stack_id IS NULL", (truth["tid"],))[0][0] == 0
    assert q(db, "SELECT count(*) FROM offcpu_interval WHERE state IN (0, 256) AND python_stack_id IS NOT NULL"
             )[0][0] == 0

    # markers: the training script's line, not the marker API's (python_call_site skips it)
    assert call_sites(db, "step_mark") == [("main", here, lines["step"])] * 3
    assert call_sites(db, "lineage_mark")[0] == ("main", here, lines["lineage"])
    assert q(db, "SELECT count(*) FROM lineage_mark WHERE python_stack_id IS NULL")[0][0] == 0
    # the NCCL collective, at its entry
    assert call_sites(db, "nccl_call", "x.api_id = (SELECT id FROM nccl_api WHERE name = 'ncclAllReduce')") == [
        ("collective", here, lines["allreduce"])]
    assert q(db, "SELECT count(*) FROM nccl_call WHERE python_stack_id IS NULL")[0][0] == 0
    # stacks are deduplicated: the three steps share one
    assert q(db, "SELECT count(DISTINCT python_stack_id) FROM step_mark")[0][0] == 1


def test_block_requests_carry_the_submitting_line(tmp_path: Path, native, ext4_loop) -> None:  # noqa: F811
    mnt, _majmin, name = ext4_loop
    db = tmp_path / "b.db"
    truth = record(db, native, "--dir", str(mnt))
    lines = tagged_lines()
    here = str(WORKLOAD)
    rows = q(db, "SELECT x.op, x.submitter_kind, p.qualname, p.filename, p.line, x.size_bytes FROM block_request x"
                 " JOIN thread t ON t.id = x.thread_id"
                 " LEFT JOIN python_call_site p ON p.stack_id = x.python_stack_id"
                 " WHERE x.device = ? AND t.tid = ?", (name, truth["tid"]))
    by_site: dict[tuple, int] = {}
    for op, _kind, fn, filename, line, size in rows:
        if op == "write":
            by_site[(fn, filename, line)] = by_site.get((fn, filename, line), 0) + size
    # the fsync'd 1 MiB went out from the fsync line, the direct writes from the pwrite line
    assert by_site.get(("checkpoint_write", here, lines["fsync"]), 0) >= (1 << 20) - 4096, by_site
    assert by_site.get(("direct_write", here, lines["direct"]), 0) == 8 * 65536, by_site
    assert all(fn is not None for _op, _k, fn, *_ in rows), rows
    # the checkpoint scope's marker names the with-statement
    assert call_sites(db, "checkpoint_mark")[0] == ("checkpoint_write", here, lines["checkpoint"])
    # kernel-thread writeback (the journal) has no Python stack
    assert q(db, "SELECT count(*) FROM block_request WHERE submitter_kind = 'kernel_thread'"
                 " AND python_stack_id IS NOT NULL")[0][0] == 0


def test_throttled_io_queued_by_a_kworker_keeps_the_line(tmp_path: Path, native, throttled) -> None:  # noqa: F811
    """blk-throttle holds the bios and a kworker queues them later: the requests are still the
    thread's (its I/O intent) and carry the line of the syscall that caused them."""
    mnt, _majmin, name, cg = throttled
    db = tmp_path / "t.db"
    truth = record(db, native, "--dir", str(mnt), "--size", str(512 * 1024), "--cgroup-procs",
                   str(cg / "cgroup.procs"))
    lines = tagged_lines()
    here = str(WORKLOAD)
    rows = q(db, "SELECT p.qualname, p.filename, p.line, count(*) FROM block_request x"
                 " JOIN thread t ON t.id = x.thread_id"
                 " LEFT JOIN python_call_site p ON p.stack_id = x.python_stack_id"
                 " WHERE x.device = ? AND t.tid = ? AND x.submitter_kind = 'target_deferred' AND x.op = 'write'"
                 " GROUP BY 1, 2, 3", (name, truth["tid"]))
    sites = {(fn, filename, line): n for fn, filename, line, n in rows}
    # 8 x 64 KiB at 2 MiB/s: the first bios pass, later ones wait for the kworker
    assert sites.get(("direct_write", here, lines["direct"]), 0) >= 2, rows
    assert sites.get(("checkpoint_write", here, lines["fsync"]), 0) >= 1, rows
    # each names the line whose syscall caused it, none is left without
    assert set(sites) == {("direct_write", here, lines["direct"]), ("checkpoint_write", here, lines["fsync"])}, rows


def test_offcpu_stacks_can_be_turned_off(tmp_path: Path, native) -> None:
    """$STALL_RECORDER_OFFCPU_STACKS=0: off-CPU intervals without stacks, said so in `capability`;
    the markers and the collective still carry theirs."""
    db = tmp_path / "off.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["dir"] / "libnccl.so.2"), "--",
                       sys.executable, str(WORKLOAD), "--libdir", str(native["dir"]), timeout=300,
                       env={**os.environ, "STALL_RECORDER_OFFCPU_STACKS": "0"})
    assert res.returncode == 0, res.stderr
    assert q(db, "SELECT count(*) FROM offcpu_interval WHERE python_stack_id IS NOT NULL")[0][0] == 0
    assert q(db, "SELECT count(*) FROM offcpu_interval WHERE state = 1")[0][0] > 0
    assert q(db, "SELECT status, detail FROM capability WHERE probe = 'python stacks at blocking switches'") == [
        ("absent", "turned off (STALL_RECORDER_OFFCPU_STACKS=0)")]
    assert call_sites(db, "step_mark") == [("main", str(WORKLOAD), tagged_lines()["step"])] * 3


def test_offcpu_stacks_setting() -> None:
    from recorder.core.settings import Settings

    def offcpu_stacks_enabled(environ: dict[str, str]) -> bool:
        return Settings.from_environment(environ).offcpu_stacks

    assert offcpu_stacks_enabled({}) is True
    assert offcpu_stacks_enabled({"STALL_RECORDER_OFFCPU_STACKS": "1"}) is True
    assert all(offcpu_stacks_enabled({"STALL_RECORDER_OFFCPU_STACKS": v}) is False for v in ("0", "off", "No"))
