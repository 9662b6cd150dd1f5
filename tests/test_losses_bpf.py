"""Losses with real BPF: each way the recorder can lose records is forced and the recording and the
report must say exactly what was recorded and what was lost. Skipped with the reason where root,
BPF, zram or loop devices are missing; devices made here are removed even when a test fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import needs_bpf, q, run_recorder

pytestmark = [needs_bpf, pytest.mark.bpf]
ZRAM_CONTROL = Path("/sys/class/zram-control")


@pytest.fixture
def zram():
    """The name of a fresh 64 MiB zram device (a device that completes bios without requests)."""
    if not (ZRAM_CONTROL / "hot_add").exists():
        pytest.skip("needs zram built in or loaded (/sys/class/zram-control)")
    n = (ZRAM_CONTROL / "hot_add").read_text().strip()
    try:
        Path(f"/sys/block/zram{n}/disksize").write_text("64M")
        yield f"zram{n}"
    finally:
        (ZRAM_CONTROL / "hot_remove").write_text(n)


@pytest.fixture
def loop_dev(tmp_path):
    """The name of a fresh 32 MiB loop device (requests: the completion tracepoints)."""
    if not Path("/dev/loop-control").exists():
        pytest.skip("needs loop devices (/dev/loop-control)")
    img = tmp_path / "loop.img"
    subprocess.run(["truncate", "-s", "32M", str(img)], check=True)
    loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        yield Path(loop).name
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def _record(db: Path, env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess:
    result = run_recorder("record", "--db", str(db), "--", *cmd, timeout=300, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return result


def _lost(db: Path, probe: str) -> int:
    return q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe = ?", (probe,))[0][0]


def test_bio_only_device_does_not_fill_the_in_flight_map(tmp_path, zram, loop_dev):
    """300 direct writes to a zram device, whose bios never become requests, then 8 synchronous
    writes to a loop device, with room for 64 requests in flight: every write is a row of its
    device and nothing is lost (the zram bios used to stay in the map and fill it, after which the
    loop device's writes were dropped)."""
    db = tmp_path / "zram.db"
    script = (f"dd if=/dev/zero of=/dev/{zram} bs=4k count=300 oflag=direct status=none && "
              f"dd if=/dev/zero of=/dev/{loop_dev} bs=4k count=8 oflag=direct,sync status=none")
    _record(db, {"STALL_RECORDER_BLOCK_INFLIGHT": "64"}, "sh", "-c", script)
    rows = dict(q(db, "SELECT device || ' ' || op, count(*) FROM block_request WHERE submitter_kind = 'target'"
                      " AND device IN (?, ?) GROUP BY device, op", (zram, loop_dev)))
    # each O_SYNC write to the loop device is followed by a cache flush, a request of its own
    assert rows == {f"{zram} write": 300, f"{loop_dev} write": 8, f"{loop_dev} flush": 8}, rows
    # the zram rows were ended by their bio completion: queued and completed, never issued
    assert q(db, "SELECT count(*), sum(size_bytes), count(issue_ts), min(dur) > 0 FROM block_request"
                 " WHERE device = ?", (zram,))[0] == (300, 300 * 4096, 0, 1)
    assert q(db, "SELECT count(*) FROM loss WHERE probe LIKE 'block%'")[0][0] == 0
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "Lost in this window" not in report
    assert "Data loss: none" in report


def test_timer_wake_ups_are_not_blamed_on_the_interrupted_task(tmp_path):
    """20 plain 20 ms sleeps of a thread pinned to CPU 0 while a busy loop runs there: the timer
    interrupt that ends each sleep lands on the busy loop, which must not be named the waker; each
    sleep is woken by 'timer', with no waker thread."""
    if 0 not in os.sched_getaffinity(0):
        pytest.skip("needs CPU 0")
    db = tmp_path / "timer.db"
    script = ("taskset -c 0 sh -c 'while :; do :; done' & busy=$!; "
              "taskset -c 0 python3 -c 'import time; [time.sleep(0.02) for _ in range(20)]'; kill $busy")
    _record(db, {}, "sh", "-c", script)
    sleeps = q(db, "SELECT waker_name, waker_tid, waker_pid, waker_context, waker_cpu FROM offcpu"
                   " WHERE syscall_name = 'clock_nanosleep' AND dur >= 15000000")
    assert len(sleeps) == 20, sleeps
    assert {s[:4] for s in sleeps} == {("timer", None, None, "timer")}, sleeps
    assert {s[4] for s in sleeps} == {0}
    assert q(db, "SELECT count(*) FROM capability WHERE probe = 'timer:hrtimer_expire_entry'"
                 " AND status = 'attached'")[0][0] == 1
