"""The block and memory layers with real BPF on a real loop device: ext4 on a loop device,
throttled through the cgroup's I/O limit, and a cgroup memory limit, each on cgroup v1 and on v2.
Skipped with the reason where root, BPF, loop devices or that layout's controller are missing.
Mounts, loop devices and cgroups are removed even when a test fails."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    io_limits,
    limited_cgroup,
    memory_limit,
    needs_bpf,
    q,
    require_cgroup,
    run_recorder,
    workload_output,
)

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "io_calls.py")
SIZED = str(ROOT / "tests" / "workloads" / "sized_io.py")
RATE = 2 * 1024 * 1024  # bytes/s allowed by the throttle


@pytest.fixture
def ext4_loop(tmp_path):
    """(mount point, 'M:m') of a fresh 256 MiB ext4 file system on a loop device."""
    if not Path("/dev/loop-control").exists():
        pytest.skip("needs loop devices (/dev/loop-control)")
    img = tmp_path / "disk.img"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "256M", str(img)], check=True)
    loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True,
                          check=True).stdout.strip()
    mounted = False
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
        subprocess.run(["mount", loop, str(mnt)], check=True)
        mounted = True
        majmin = Path(f"/sys/block/{Path(loop).name}/dev").read_text().strip()
        yield mnt, majmin, Path(loop).name
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        subprocess.run(["losetup", "-d", loop], check=False)


@pytest.fixture
def throttled(request, cgroup_layout):
    """(mount point, 'M:m', device, cgroup) of ext4_loop with a cgroup whose reads and writes to it are
    throttled to RATE (blkio.throttle.* on cgroup v1, io.max on v2)."""
    require_cgroup(cgroup_layout, "io")
    mnt, majmin, name = request.getfixturevalue("ext4_loop")
    gen = limited_cgroup(cgroup_layout, "io", io_limits(cgroup_layout, majmin, read_bps=RATE, write_bps=RATE))
    cg = next(gen)
    yield mnt, majmin, name, cg
    next(gen, None)


def record(db, *cmd):
    result = run_recorder("record", "--db", str(db), "--", *cmd, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_throttled_io_waits_in_queued_stage_of_the_right_thread(tmp_path, throttled):
    """1 MiB of 64 KiB direct writes, 1 MiB written then fsync'd, and 1 MiB of direct reads, each
    from its own thread, throttled to 2 MiB/s: the wait is in the queued stage of that thread's
    requests, not on the device."""
    mnt, majmin, name, cg = throttled
    db = tmp_path / "io.db"
    res = record(db, sys.executable, WORKLOAD, "--dir", str(mnt), "--cgroup-procs", str(cg / "cgroup.procs"))
    truth = workload_output(res.stdout)
    for part in ("direct_write", "fsync_write", "direct_read"):
        tid = truth[part]["tid"]
        rows = q(db, "SELECT op, count(*), sum(size_bytes), sum(queued_dur), sum(device_dur),"
                     " group_concat(DISTINCT submitter_kind) FROM block_request_named"
                     " WHERE tid = ? AND device = ? GROUP BY op", (tid, name))
        by_op = {r[0]: r[1:] for r in rows}
        op = "read" if part == "direct_read" else "write"
        assert op in by_op, (part, rows)
        n, size, queued, on_device, kinds = by_op[op]
        assert size >= 1024 * 1024 - 4096, (part, size)
        # 1 MiB at 2 MiB/s: the first bios pass, the rest wait; at least 0.25 s of queueing
        assert queued >= 0.25e9, (part, queued / 1e9, kinds)
        assert queued > 5 * on_device, (part, queued, on_device)
        assert truth[part]["seconds"] >= 0.25
    # throttled bios are queued by a kworker: found through the thread's I/O intent
    deferred = q(db, "SELECT count(*) FROM block_request_named WHERE tid = ? AND submitter_kind = 'target_deferred'",
                 (truth["direct_write"]["tid"],))[0][0]
    assert deferred >= 4
    # stage timestamps are ordered and inside the session
    bad = q(db, "SELECT count(*) FROM block_request r JOIN session s ON s.id = r.session_id"
                " WHERE NOT (s.started_ts <= r.ts AND r.ts <= r.bio_queue_ts AND r.bio_queue_ts <= r.issue_ts"
                " AND r.issue_ts <= r.complete_ts AND r.complete_ts <= s.stopped_ts)")[0][0]
    assert bad == 0
    assert q(db, "SELECT count(*) FROM capability WHERE layer = 'block' AND status = 'attached'")[0][0] >= 3


def test_every_byte_a_thread_writes_or_reads_is_in_its_requests(tmp_path, ext4_loop):
    """Buffered 2 MiB and 8 MiB writes (fsync'd), O_DIRECT 1 MiB and 4 MiB writes and an O_DIRECT
    4 MiB read, each from its own thread: the block layer splits bios larger than the device's
    max_sectors_kb (1280 KiB on a loop device) and the rest of a split bio is queued without another
    block_bio_queue. Each thread's requests of its op add up to exactly the bytes it moved (the file
    system's journal and metadata writes are jbd2's, kernel_thread rows)."""
    mnt, majmin, name = ext4_loop
    db = tmp_path / "sized.db"
    res = record(db, sys.executable, SIZED, "--dir", str(mnt))
    truth = workload_output(res.stdout)
    max_bytes = int(Path(f"/sys/block/{name}/queue/max_sectors_kb").read_text()) * 1024
    # a completion the kernel did not run the probe for (another BPF program was running on that CPU)
    # is counted, never silent: then the thread's total may be short by that many requests
    unseen = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe = 'block request completion not seen'")[0][0]
    for part, op in (("buffered_2m", "write"), ("buffered_8m", "write"), ("direct_1m", "write"),
                     ("direct_4m", "write"), ("direct_read_4m", "read")):
        moved = truth[part]["bytes"]
        n, total = q(db, "SELECT count(*), coalesce(sum(size_bytes), 0) FROM block_request_named"
                         " WHERE tid = ? AND device = ? AND op = ?", (truth[part]["tid"], name, op))[0]
        if unseen == 0:
            assert total == moved, (part, n, total, moved)
            if moved > max_bytes:
                assert n >= -(-moved // max_bytes), (part, n, moved, max_bytes)  # split: several requests
        else:
            assert moved - unseen * max_bytes <= total <= moved, (part, n, total, moved, unseen)
    assert q(db, "SELECT count(*) FROM capability WHERE probe = 'block:block_split' AND status = 'attached'")[0][0] == 1


def _percentile(values: list[int], p: float) -> int:
    """Nearest-rank percentile, computed independently of the views."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def test_exact_percentiles_match_python(tmp_path, ext4_loop):
    mnt, majmin, name = ext4_loop
    db = tmp_path / "p.db"
    record(db, "dd", "if=/dev/zero", f"of={mnt}/dd.bin", "bs=4k", "count=3000", "oflag=direct")
    durs = [r[0] for r in q(db, "SELECT dur FROM block_request WHERE device = ? AND op = 'write'", (name,))]
    # a completion the kernel did not run the probe for (another BPF program was running on that CPU)
    # is counted as a loss, never silent: the stored rows and that count add up to the 3000 writes
    unseen = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe = 'block request completion not seen'")[0][0]
    assert len(durs) + unseen >= 3000 and unseen <= 30, (len(durs), unseen)
    row = q(db, "SELECT requests, p50_dur, p99_dur, p999_dur, max_dur FROM block_latency"
                " WHERE device = ? AND op = 'write'", (name,))[0]
    assert row == (len(durs), _percentile(durs, 0.5), _percentile(durs, 0.99), _percentile(durs, 0.999), max(durs))
    behind = q(db, "SELECT dur FROM block_request_percentile WHERE device = ? AND op = 'write'"
                   " AND percentile >= 0.999", (name,))
    p999 = _percentile(durs, 0.999)
    assert sorted(r[0] for r in behind) == sorted(d for d in durs if d >= p999)
    windows = q(db, "SELECT sum(requests) FROM block_latency_window WHERE device = ? AND op = 'write'", (name,))
    assert windows[0][0] == len(durs)


def test_memcg_reclaim_is_recorded(tmp_path, request, cgroup_layout):
    """Reading a 96 MiB file in a memory cgroup limited to 24 MiB makes the reader reclaim."""
    require_cgroup(cgroup_layout, "memory")
    mnt, majmin, name = request.getfixturevalue("ext4_loop")
    subprocess.run(["dd", "if=/dev/zero", f"of={mnt}/big.bin", "bs=1M", "count=96", "conv=fsync"],
                   check=True, capture_output=True)
    Path("/proc/sys/vm/drop_caches").write_text("1")
    gen = limited_cgroup(cgroup_layout, "memory", memory_limit(cgroup_layout, 24 * 1024 * 1024))
    cg = next(gen)
    try:
        db = tmp_path / "m.db"
        res = record(db, sys.executable, WORKLOAD, "--dir", str(mnt), "--mode", "reclaim",
                     "--cgroup-procs", str(cg / "cgroup.procs"))
    finally:
        next(gen, None)
    tid = workload_output(res.stdout)["reader"]["tid"]
    rows = q(db, "SELECT r.kind, count(*), sum(r.dur), sum(r.pages_reclaimed) FROM reclaim_interval r"
                 " JOIN thread t ON t.id = r.thread_id WHERE t.tid = ? GROUP BY r.kind", (tid,))
    assert rows, q(db, "SELECT * FROM capability WHERE layer = 'mm'")
    kind, n, dur, pages = rows[0]
    assert n >= 1 and dur > 0 and pages > 0
