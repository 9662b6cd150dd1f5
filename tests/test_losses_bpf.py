"""Losses with real BPF: each way the recorder can lose records is forced and the recording and the
report must say exactly what was recorded and what was lost. Skipped with the reason where root,
BPF, zram or loop devices are missing; devices made here are removed even when a test fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, io_limits, limited_cgroup, needs_bpf, q, require_cgroup, run_recorder, workload_output

pytestmark = [needs_bpf, pytest.mark.bpf]
ZRAM_CONTROL = Path("/sys/class/zram-control")
WRITES_SRC = ROOT / "tests" / "workloads" / "parallel_writes.c"


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
    expected = {f"{zram} write": 300, f"{loop_dev} write": 8, f"{loop_dev} flush": 8}
    # a run of a block program the kernel skipped (another BPF program was running on its CPU: other
    # recorders on a shared machine) may cost a row, and is counted
    skipped = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe LIKE 'bpf program tracepoint__block__%'"
                    " OR probe IN ('block request completion not seen', 'block request aged out')")[0][0]
    assert all(rows.get(k, 0) <= n for k, n in expected.items()), rows
    assert sum(expected.values()) - sum(rows.values()) <= skipped, (rows, skipped)
    if not skipped:
        assert rows == expected
    # the zram rows were ended by their bio completion: queued and completed, never issued
    assert q(db, "SELECT count(*), count(issue_ts), min(dur) > 0 FROM block_request WHERE device = ?",
             (zram,))[0] == (rows[f"{zram} write"], 0, 1)
    assert _lost(db, "block in-flight map full") == 0 and _lost(db, "block ring buffer") == 0
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "in-flight map full" not in report, report


def test_concurrent_flushes_are_each_a_row(tmp_path, loop_dev):
    """4 threads each write and fsync a loop device 20 times at once: each fsync sends an empty
    flush bio at sector 0, whose flush request is issued at sector 0 and completes at
    (sector_t)-1 (6.12+). Every flush is a row of its thread, issued and completed, beside every
    write, unless the kernel skipped its program, which is counted (they used to share one key: about
    a third of them went missing and the rest of the collisions were counted as completions not
    seen)."""
    db = tmp_path / "flush.db"
    res = _record(db, {}, sys.executable, str(ROOT / "tests" / "workloads" / "concurrent_fsync.py"),
                  f"/dev/{loop_dev}")
    job = workload_output(res.stdout)
    rows = q(db, "SELECT t.tid, b.op, b.size_bytes, b.sector, b.issue_ts IS NOT NULL, b.ts <= b.issue_ts,"
                 " b.issue_ts <= b.complete_ts, b.error FROM block_request b JOIN thread t ON t.id = b.thread_id"
                 " WHERE b.device = ? ORDER BY b.ts", (loop_dev,))
    # A block program the kernel skipped (an interrupt arrived while another BPF program or a map
    # syscall held this CPU's BPF slot) costs at most its request's row, and is counted: a skipped
    # completion leaves its request counted as not seen, a skipped submission leaves no trace of it.
    # Skips hit any traced disk (most are the root disk's); with none, every row is there.
    lost = dict(q(db, "SELECT probe, sum(dropped) FROM loss WHERE probe LIKE '%block%' GROUP BY probe"))
    skipped = sum(n for probe, n in lost.items() if probe.startswith("bpf program tracepoint__block__"))
    expected = 2 * job["rounds"] * len(job["writers"])
    assert expected - skipped <= len(rows) <= expected, (len(rows), lost)
    per_thread = {tid: [r for r in rows if r[0] == tid] for tid in job["writers"]}
    for tid, mine in per_thread.items():
        flushes = [r for r in mine if r[1] == "flush"]
        writes = [r for r in mine if r[1] == "write"]
        assert job["rounds"] - skipped <= len(flushes) <= job["rounds"], (tid, mine, lost)
        assert job["rounds"] - skipped <= len(writes) <= job["rounds"], (tid, mine, lost)
        if not skipped:
            assert len(flushes) == len(writes) == job["rounds"], (tid, mine)
        assert {r[2:] for r in flushes} == {(0, 0, 1, 1, 1, 0)}, flushes
        assert {r[2] for r in writes} == {4096}
    # the only block losses are skipped programs and, for each skipped completion, one request
    # not seen complete (they used to share one key: collisions were counted as not seen)
    assert {p for p in lost if not p.startswith("bpf program tracepoint__block__")} \
        <= {"block request completion not seen"}, lost
    assert lost.get("block request completion not seen", 0) <= skipped, lost


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
    # a wake-up whose program the kernel skipped (another BPF program was running on the CPU: other
    # recorders, a map syscall) has no waker, and is counted
    woken = [s for s in sleeps if s[0] is not None]
    skipped = _lost(db, "bpf program tracepoint__sched__sched_waking skipped (sched)")
    assert 20 - len(woken) <= skipped, (sleeps, skipped)
    assert {s[:4] for s in woken} == {("timer", None, None, "timer")}, sleeps
    assert {s[4] for s in woken} == {0}
    assert q(db, "SELECT count(*) FROM capability WHERE probe = 'timer:hrtimer_expire_entry'"
                 " AND status = 'attached'")[0][0] == 1


def test_irq_work_wake_ups_are_not_blamed_on_the_interrupted_task(tmp_path):
    """A thread waits in epoll_wait on a BPF ring buffer 200 times; each record (a socket filter's,
    per loopback datagram another thread sends) wakes it from the CPU's irq_work interrupt, which
    hits the sending thread. Every wait is woken by 'interrupt', with no waker thread: the hardirq
    of an IPI or irq_work is noted like a device interrupt's (it used to name the sender when the
    CPU had taken no device interrupt lately), and none is unexplained."""
    db = tmp_path / "irq_work.db"
    res = _record(db, {}, sys.executable, str(ROOT / "tests" / "workloads" / "irq_work_wakeups.py"))
    job = workload_output(res.stdout)
    assert job["records"] == 200, job
    waits = q(db, "SELECT waker_name, waker_tid, waker_context, dur FROM offcpu o JOIN thread t ON t.id = o.thread_id"
                  " WHERE t.tid = ? AND"
                  " syscall_name IN ('epoll_wait', 'epoll_pwait') AND reason != 'preempted'", (job["poller"],))
    # a poll that waited its whole 200 ms timeout (the last one, after the worker's last record, or
    # one on a stalled machine) was woken by its timer, not by a record
    waits = [w[:3] for w in waits if not (w[2] == "timer" and w[3] >= 190_000_000)]
    # at most one record per wait; a record read before the poller waited again needs no wake-up
    assert 190 <= len(waits) <= 200, len(waits)
    woken = [w for w in waits if w[0] is not None]
    skipped = _lost(db, "bpf program tracepoint__sched__sched_waking skipped (sched)")
    assert len(waits) - len(woken) <= skipped, (waits, skipped)
    assert set(woken) == {("interrupt", None, "interrupt")}, sorted(set(woken))
    assert q(db, "SELECT count(*) FROM capability WHERE probe = 'irq_vectors:irq_work_entry'"
                 " AND status = 'attached'")[0][0] == 1


def test_programs_the_kernel_skipped_are_counted_and_reported(tmp_path):
    """bpftool's map and program listings (BPF syscalls: while one runs, even preempted, the kernel
    runs no tracepoint program on its CPU) on CPU 0 beside a thread there that sleeps 1 ms 3,000
    times: the sched_waking runs the kernel skipped are counted per program in `loss`, and the report
    names them for the scheduler layer instead of calling it checked and clean."""
    if not shutil.which("bpftool"):
        pytest.skip("needs bpftool (to make BPF syscalls on a CPU)")
    db = tmp_path / "skipped.db"
    script = ("taskset -c 0 sh -c 'for i in $(seq 200); do bpftool map show >/dev/null 2>&1; "
              "bpftool prog show >/dev/null 2>&1; done' & "
              "taskset -c 0 python3 -c 'import time; [time.sleep(0.001) for _ in range(3000)]'; wait")
    _record(db, {}, "sh", "-c", script)
    probe = "bpf program tracepoint__sched__sched_waking skipped (sched)"
    skipped = _lost(db, probe)
    assert skipped > 0
    # each skipped run is a sleep of a traced thread without its wake-up: at most that many
    unwoken = q(db, "SELECT count(*) FROM offcpu WHERE syscall_name = 'clock_nanosleep' AND wakeup_ts IS NULL")[0][0]
    assert 0 < unwoken <= skipped, (unwoken, skipped)
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert f"scheduler (off-CPU intervals): {skipped:,} sched_waking runs lost after " in report, report
    assert "(the kernel skipped them: another BPF program was running on the CPU)" in report
    assert "scheduler (off-CPU intervals) (records lost in this window)" in report
    clean = next((line for line in report.splitlines() if line.startswith("Checked and clean")), "")
    assert "for a CPU" not in clean, report
    as_json = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    lost = {x["probe"]: x for x in as_json["loss"]["in_window"]}
    assert lost[probe]["count"] == skipped and lost[probe]["layer"] == "sched", lost


def test_a_full_ring_is_counted_and_reported(tmp_path, zram):
    """A one-page block ring (about 25 records) and 2,000 direct writes to a zram device as fast as
    they go: the ring fills between two reads; every write is a row or counted as lost to the full
    ring, and the report says how many requests the block layer lost and why."""
    db = tmp_path / "ring.db"
    _record(db, {"STALL_RECORDER_BLOCK_RING_PAGES": "1"}, "dd", "if=/dev/zero", f"of=/dev/{zram}", "bs=4k",
            "count=2000", "oflag=direct", "status=none")
    rows = q(db, "SELECT count(*) FROM block_request WHERE device = ? AND op = 'write'", (zram,))[0][0]
    full = _lost(db, "block ring buffer")
    skipped = _lost(db, "bpf program tracepoint__block__block_bio_complete skipped (block)") + _lost(
        db, "bpf program tracepoint__block__block_bio_queue skipped (block)")
    assert full > 0
    assert 2000 - skipped <= rows + full <= 2000, (rows, full, skipped)
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert f"block I/O requests: {full:,} requests lost after " in report, report
    assert "(ring buffer full)" in report
    assert "block I/O requests (records lost in this window)" in report
    assert "no block I/O errors;" not in report and not report.rstrip().endswith("no block I/O errors")


@pytest.fixture
def held_writes(tmp_path, cgroup_layout):
    """(loop device, cgroup.procs, writer binary, throttle): writes to the loop device stay in flight for
    seconds. The loop device (direct I/O) is backed by a file on a second loop device, which the
    cgroup's I/O limit (blkio.throttle.* on cgroup v1, io.max on v2) holds to 10 writes a second for
    the cgroup's I/O (the loop worker writes on behalf of the cgroup of the request). The writer is a
    static binary on tmpfs, so the traced process does no other block I/O."""
    require_cgroup(cgroup_layout, "io")
    if not Path("/dev/loop-control").exists() or not shutil.which("gcc"):
        pytest.skip("needs loop devices and gcc")
    binary = Path("/dev/shm") / f"stall-test-writes-{uuid.uuid4().hex[:8]}"
    subprocess.run(["gcc", "-static", "-pthread", "-O2", "-o", str(binary), str(WRITES_SRC)], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    outer = tmp_path / "outer.img"
    subprocess.run(["truncate", "-s", "64M", str(outer)], check=True)
    lower = inner = ""
    mounted = False
    gen = None
    try:
        lower = subprocess.run(["losetup", "-f", "--show", str(outer)], capture_output=True, text=True,
                               check=True).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", "-F", lower], check=True)
        subprocess.run(["mount", lower, str(mnt)], check=True)
        mounted = True
        subprocess.run(["truncate", "-s", "16M", str(mnt / "inner.img")], check=True)
        inner = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(mnt / "inner.img")],
                               capture_output=True, text=True, check=True).stdout.strip()
        majmin = Path(f"/sys/block/{Path(lower).name}/dev").read_text().strip()
        gen = limited_cgroup(cgroup_layout, "io", io_limits(cgroup_layout, majmin, write_iops=10))
        cg = next(gen)

        def throttle(iops: int) -> None:
            for name, value in io_limits(cgroup_layout, majmin, write_iops=iops).items():
                (cg / name).write_text(value)

        yield Path(inner).name, cg / "cgroup.procs", binary, throttle
    finally:
        if gen is not None:
            next(gen, None)
        if inner:
            subprocess.run(["losetup", "-d", inner], check=False)
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        if lower:
            subprocess.run(["losetup", "-d", lower], check=False)
        binary.unlink(missing_ok=True)


def test_a_full_in_flight_map_is_counted_and_reported(tmp_path, held_writes):
    """100 threads each write 4 KiB at once to a device that holds them in flight for seconds, with
    room for 64 requests in flight: every write is a row or counted as lost to the full map, and the
    report says how many block requests were lost, after when and why, and no longer calls the block
    layer checked and clean."""
    device, procs, binary, _ = held_writes
    db = tmp_path / "map.db"
    res = _record(db, {"STALL_RECORDER_BLOCK_INFLIGHT": "64"}, str(binary), f"/dev/{device}", "100", str(procs))
    assert '"failed": 0' in res.stdout, res.stdout
    rows = q(db, "SELECT count(*) FROM block_request WHERE device = ? AND op = 'write' AND submitter_kind = 'target'",
             (device,))[0][0]
    full = _lost(db, "block in-flight map full")
    skipped = _lost(db, "bpf program tracepoint__block__block_bio_queue skipped (block)") + _lost(
        db, "bpf program tracepoint__block__block_rq_complete skipped (block)")
    # at most 64 in flight (those that finished before the last thread wrote freed their place)
    assert full >= 100 - 64 - 10, (rows, full)
    assert 100 - skipped <= rows + full <= 100, (rows, full, skipped)
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert f"Lost in this window: block I/O requests: {full:,} requests lost after " in report, report
    assert "(in-flight map full)" in report
    clean = next((line for line in report.splitlines() if line.startswith("Checked and clean")), "")
    assert "no block I/O errors" not in clean.replace("no block I/O errors in the kernel log", ""), report


def test_requests_nothing_ends_in_time_are_aged_out_and_counted(tmp_path, held_writes):
    """100 writes held in flight for up to 20 s (5 writes a second) with in-flight entries aged out
    after 5 s: the entries older than that are removed from the map and counted, each write is a
    row or counted as aged out (its completion then finds no entry), and the report says so."""
    device, procs, binary, throttle = held_writes
    throttle(5)
    db = tmp_path / "aged.db"
    res = _record(db, {"STALL_RECORDER_INFLIGHT_MAX_AGE_S": "5"}, str(binary), f"/dev/{device}", "100", str(procs))
    assert '"failed": 0' in res.stdout, res.stdout
    rows = q(db, "SELECT count(*) FROM block_request WHERE device = ? AND op = 'write' AND submitter_kind = 'target'",
             (device,))[0][0]
    aged = _lost(db, "block request aged out")
    skipped = _lost(db, "bpf program tracepoint__block__block_bio_queue skipped (block)")
    assert aged > 0, rows
    assert 100 - skipped <= rows + aged <= 100, (rows, aged, skipped)
    # counted in the second each aged-out bio was queued, inside the session
    assert q(db, "SELECT count(*) FROM loss l JOIN session s ON s.id = l.session_id WHERE l.probe ="
                 " 'block request aged out' AND (l.ts < s.started_ts - 1000000000 OR l.ts > s.stopped_ts)")[0][0] == 0
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert f"block I/O requests: {aged:,} requests lost after " in report, report
    assert "(no end seen, aged out of the in-flight map)" in report


def test_requests_in_flight_when_the_workload_ends_are_rows(tmp_path, held_writes):
    """The traced command starts 2 writes to a device that completes 10 writes a second and exits
    20 ms later, while the second write is still in flight: the recorder waits for requests issued
    in the last second before it counts what it did not see complete, so both writes are rows of
    the writer, with their completion, and nothing is counted as not seen (it used to be)."""
    device, procs, binary, _ = held_writes
    db = tmp_path / "inflight.db"
    _record(db, {}, "sh", "-c", f"{binary} /dev/{device} 2 {procs} > /dev/null & sleep 0.02")
    rows = q(db, "SELECT count(*), count(complete_ts), max(dur) FROM block_request WHERE device = ?"
                 " AND op = 'write' AND submitter_kind = 'target'", (device,))[0]
    skipped = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss"
                    " WHERE probe LIKE 'bpf program tracepoint__block__%'")[0][0]
    not_seen = _lost(db, "block request completion not seen")
    assert rows[0] == rows[1] and 2 - skipped <= rows[0] <= 2, (rows, skipped, not_seen)
    assert not_seen <= skipped, (rows, not_seen, skipped)
    if not skipped:
        # the throttle held the second write behind the first: it completed after the stop began
        assert rows[0] == 2 and rows[2] >= 50_000_000, rows
