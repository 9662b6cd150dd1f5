"""The flight recorder on real probes: the window kept stays bounded while recording, and a live
stall, a hung CUDA call and a kernel-log line each save an incident recording by themselves that
`recorder explain` explains; `recorder dump` and SIGUSR1 save the window while it records."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q, realtime, run_recorder

from store.flight import event_tables

pytestmark = [needs_bpf, pytest.mark.bpf, pytest.mark.slow]

S = 1_000_000_000
TRAIN = str(ROOT / "tests" / "workloads" / "train_steps.py")
SHORT = ("--before", "4s", "--after", "2s")


def _incidents(db: Path) -> list[Path]:
    folder = db.with_name(db.name + ".incidents")
    return sorted(folder.glob("*.db")) if folder.is_dir() else []


def _explain(db: Path) -> dict:
    return json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)


SLEEPER = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    time.sleep(0.002)
"""


def test_the_window_stays_bounded_while_recording(tmp_path):
    db = tmp_path / "w.db"
    res = run_recorder("record", "--db", str(db), "--keep", "12s", "--max-size", "16MB", *SHORT, "--triggers", "", "--",
                       sys.executable, "-c", SLEEPER, "30", timeout=300)
    assert res.returncode == 0, res.stderr
    (started, stopped), = q(db, "SELECT started_ts, stopped_ts FROM session")
    assert stopped - started >= 30 * S
    lo, n = q(db, "SELECT min(ts), count(*) FROM offcpu_interval")[0]
    # rows written more than 12 s (and a tick or two) before the stop are gone; the last 12 s are there
    assert lo >= stopped - 15 * S, (stopped - lo) / S
    assert lo <= stopped - 10 * S, (stopped - lo) / S
    assert n > 1000
    # the workload's identity and the capability rows outlive its first events
    assert q(db, "SELECT count(*) FROM thread WHERE name = 'python3' OR name LIKE 'python%'")[0][0] >= 1
    assert q(db, "SELECT count(*) FROM capability WHERE layer = 'sched' AND status = 'attached'")[0][0] >= 1
    assert _incidents(db) == []


def test_a_live_stall_saves_an_incident_that_explains_it(tmp_path, native):
    db = tmp_path / "s.db"
    res = run_recorder("record", "--db", str(db), "--keep", "30s", *SHORT, "--triggers", "stall", "--cooldown", "0s",
                       "--", sys.executable, TRAIN, "--libdir", str(native["dir"]), "--markers", "--steps", "160",
                       "--slow-step", "120", "--slow-ms", "1200", timeout=300)
    assert res.returncode == 0, res.stderr
    incidents = _incidents(db)
    assert incidents and all(p.name.endswith("-stall.db") for p in incidents), incidents
    # a loaded host may stall a step of its own (the same rule says so): the one of step 120 is there
    ours = [r for r in map(_explain, incidents) if "step 120 took" in r["session"]["incident"]]
    assert len(ours) == 1, [r["session"]["incident"] for r in map(_explain, incidents)]
    report = ours[0]
    assert report["stall"] is True
    assert report["step"]["step"] == 120
    assert report["session"]["incident"].startswith("saved by the flight recorder (stall,")
    assert {t for t, in q(db, "SELECT trigger FROM incident WHERE own = 0")} == {"stall"}


HANG = """
import ctypes, os, sys, time
rt = ctypes.CDLL(os.path.join(sys.argv[1], "libcudart.so.12"))
rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
rt.standin_configure(b"cudaStreamSynchronize", ctypes.c_uint64(0), ctypes.c_uint64(1_000_000), 0)
for _ in range(60):
    rt.cudaStreamSynchronize(ctypes.c_void_p(0x51))
    time.sleep(0.01)
rt.standin_configure(b"cudaStreamSynchronize", ctypes.c_uint64(0), ctypes.c_uint64(9_000_000_000), 0)
rt.cudaStreamSynchronize(ctypes.c_void_p(0x51))
"""


def test_a_hung_call_saves_an_incident_with_the_call_still_in_flight(tmp_path, native):
    db = tmp_path / "h.db"
    res = run_recorder("record", "--db", str(db), "--keep", "30s", *SHORT, "--hang", "2s", "--triggers",
                       "hung-call", "--", sys.executable, "-c", HANG, str(native["dir"]), timeout=300)
    assert res.returncode == 0, res.stderr
    incidents = _incidents(db)
    assert len(incidents) == 1 and incidents[0].name.endswith("-hung-call.db"), incidents
    inc = incidents[0]
    (dur, ret), = q(inc, "SELECT c.dur, c.ret FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id "
                         "WHERE c.open = 1 AND a.name = 'cudaStreamSynchronize'")
    assert ret is None  # it had not returned
    assert 3.5 * S <= dur <= 8 * S, dur / S  # in flight 2 s at the trigger, saved 2 s later
    report = _explain(inc)
    assert report["stall"] is True
    assert "cudaStreamSynchronize in flight for" in report["session"]["incident"]
    # a step report when steps were inferred from the calls' period, else a slow-call report
    text = run_recorder("explain", "--db", str(inc), check=True).stdout
    cause = next(line for line in text.splitlines() if line.startswith("Primary cause:"))
    assert "cudaStreamSynchronize" in cause, text
    # the finished recording has the real call, 9 s long, and no open row left from the save
    assert q(db, "SELECT max(dur) >= 9e9 FROM cuda_call") == [(1,)]
    assert q(db, "SELECT count(*) FROM cuda_call WHERE open = 1") == [(0,)]


UNMARKED = """
import ctypes, os, sys, time
rt = ctypes.CDLL(os.path.join(sys.argv[1], "libcudart.so.12"))
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
ptr = ctypes.c_void_p()
start = time.monotonic()
slow_done = False
while time.monotonic() - start < 14:
    slow = not slow_done and time.monotonic() - start > 8
    rt.standin_configure(b"cudaMalloc", ctypes.c_uint64(0), ctypes.c_uint64(400_000_000 if slow else 5_000_000), 0)
    rt.cudaMalloc(ctypes.byref(ptr), 1 << 20)
    slow_done = slow_done or slow
    time.sleep(0.005)
"""


def test_a_slow_call_of_a_job_without_markers_saves_a_stall_incident(tmp_path, native):
    """An unmodified loop (no recorder.step): cudaMalloc every 10 ms, once 400 ms. The stall trigger
    takes the report's slow-call rule: the incident holds that call and its report names it."""
    db = tmp_path / "u.db"
    res = run_recorder("record", "--db", str(db), "--keep", "15s", "--before", "5s", "--after", "3s", "--triggers",
                       "stall", "--cooldown", "0s", "--", sys.executable, "-c", UNMARKED, str(native["dir"]),
                       timeout=300)
    assert res.returncode == 0, res.stderr
    assert q(db, "SELECT count(*) FROM step_mark WHERE inferred = 0") == [(0,)]
    # a loaded host stalls some 5 ms calls of its own (the same rule says so): the incident whose
    # trigger is the 400 ms call is there, and holds it
    ours = [p for p in _incidents(db) if "cudaMalloc (1-2 MiB) took 40" in _explain(p)["session"]["incident"]]
    assert len(ours) == 1 and ours[0].name.endswith("-stall.db"), _incidents(db)
    assert q(ours[0], "SELECT count(*) FROM cuda_call WHERE dur >= 400e6") == [(1,)]
    report = _explain(ours[0])
    assert report["stall"] is True
    incident = report["session"]["incident"]
    assert incident.startswith("saved by the flight recorder (stall,") and "the thread marks no steps" in incident
    text = run_recorder("explain", "--db", str(ours[0]), check=True).stdout
    assert "Symptom: cudaMalloc took 40" in text and "Primary cause:" in text, text


def _named(details: list[str]) -> dict[int, set[str]]:
    """thread -> the UTC starts of the inferred steps the incidents' details name on it."""
    out: dict[int, set[str]] = {}
    for when, tid in re.findall(r"inferred step at (\S+) on thread (\d+) took", " ".join(details)):
        out.setdefault(int(tid), set()).add(when)
    return out


def test_a_stalled_step_of_a_job_without_markers_saves_an_incident_that_names_it(tmp_path, native):
    """Two unmodified training loops (no recorder.step) under one `start -p A,B` flight recorder:
    their steps are inferred live from their cudaStreamSynchronize calls. The step of A slowed by
    1.2 s saves a stall incident whose detail names that inferred step (its start and thread) and
    whose report explains it. B, steady, saves none. The oracle is the script's own: the one step it
    slowed, and the start of each of its steps. Both loops run as real-time tasks (SCHED_FIFO), so
    a machine busy with other work delays no step of theirs by the 48 ms a stall of a 95 ms step
    takes: any other step named is the trigger's error."""
    db, go = tmp_path / "inf.db", tmp_path / "go"
    # the calls take microseconds (sleeps, no CPU work): no load makes one slow by the slow-call rule
    loop = [sys.executable, TRAIN, "--libdir", str(native["dir"]), "--steps", "100000", "--sync-sleep-us", "40000",
            "--step-sleep-us", "50000", "--host-work-us", "2000", "--malloc-work-us", "0", "--launch-work-us", "0"]
    fifo = realtime()
    stalled = subprocess.Popen([*fifo, *loop, "--slow-when", str(go), "--slow-ms", "1200"], stdout=subprocess.PIPE,
                               text=True)
    steady = subprocess.Popen([*fifo, *loop], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not all("libcudart" in Path(f"/proc/{p.pid}/maps").read_text() for p in (stalled, steady)):
            assert time.monotonic() < deadline, "the loops did not start"
            time.sleep(0.1)
        res = run_recorder("start", "--db", str(db), "-p", f"{stalled.pid},{steady.pid}", "--keep", "20s", *SHORT,
                           "--triggers", "stall", "--cooldown", "0s", timeout=300)
        assert res.returncode == 0, res.stderr
        time.sleep(3)  # some 30 steps: the pattern found, 10 steps of baseline
        go.touch()
        time.sleep(5)  # the slow step, the next one that ends it, the incident's after part
        stop = run_recorder("stop", "--db", str(db), timeout=300)
        assert stop.returncode == 0, stop.stderr
    finally:
        for p in (stalled, steady):
            p.send_signal(signal.SIGINT)
    ran = json.loads(stalled.communicate(timeout=30)[0])
    steady.communicate(timeout=30)
    assert q(db, "SELECT count(*) FROM step_mark WHERE inferred = 0") == [(0,)]
    details = [d for d, in q(db, "SELECT detail FROM incident")]
    named = _named(details)
    # one step is named, A's slowed one (checked against the script's step starts below); none of
    # B's, nor a slow call of B
    assert list(named) == [stalled.pid] and len(named[stalled.pid]) == 1, details
    assert f"on thread {steady.pid}," not in " ".join(details)
    ours = [p for p in _incidents(db)
            if re.search(rf"on thread {stalled.pid} took 1\d{{3}} ms", _explain(p)["session"]["incident"])]
    assert len(ours) == 1 and ours[0].name.endswith("-stall.db"), details
    report = _explain(ours[0])
    step = report["step"]
    assert report["stall"] is True and step["inferred"] is True and step["thread"]["tid"] == stalled.pid, step
    # the step stalled: it began inside the script's slowed step, in the incident as in the trigger
    slow = ran["slow_step"]
    (ts,), = q(ours[0], "SELECT ts FROM step_mark WHERE id = ?", (step["step_mark_id"],))
    assert ran["step_start_ns"][slow] < ts < ran["step_start_ns"][slow + 1], slow
    assert step["dur_ns"] >= 1.2e9
    incident = report["session"]["incident"]
    assert f"stall: inferred step at {step['utc']} on thread {stalled.pid} took 1" in incident, incident
    assert named[stalled.pid] == {step["utc"]}, (named, step["utc"])
    assert "one begins at every cudaStreamSynchronize of the thread" in incident


KMSG = """
import os, time
time.sleep(2)
fd = os.open("/dev/kmsg", os.O_WRONLY)
os.write(fd, b"<3>NVRM: Xid (PCI:0000:10:1c): 79, pid=4242, GPU has fallen off the bus.\\n")
os.close(fd)
end = time.monotonic() + 5
while time.monotonic() < end:
    time.sleep(0.002)
"""


def test_a_kernel_log_line_saves_an_incident_that_shows_it(tmp_path):
    db = tmp_path / "k.db"
    res = run_recorder("record", "--db", str(db), "--keep", "30s", *SHORT, "--triggers", "xid", "--",
                       sys.executable, "-c", KMSG, timeout=300)
    assert res.returncode == 0, res.stderr
    ours = [p for p in _incidents(db)
            if q(p, "SELECT count(*) FROM gpu_xid WHERE pid = 4242 AND xid = 79") == [(1,)]]
    assert len(ours) == 1, _incidents(db)
    report = _explain(ours[0])
    assert "NVRM: Xid (PCI:0000:10:1c): 79" in report["session"]["incident"]
    text = run_recorder("explain", "--db", str(ours[0]), check=True).stdout
    assert "Incident: saved by the flight recorder (xid," in text
    (start, end), = q(ours[0], "SELECT start_ts, end_ts FROM incident WHERE own = 1")
    (ts,), = q(ours[0], "SELECT ts FROM gpu_xid WHERE pid = 4242")
    assert start <= ts - 3 * S and end >= ts + 1 * S  # 4 s before, 2 s after (the recording may end first)


DEVICE_LINES = {
    "nvme": "nvme nvme7: I/O tag 489 (d1e9) opcode 0x1 (I/O Cmd) QID 3 timeout, aborting req_op:WRITE(1) "
            "size:524288",
    "io-error": "I/O error, dev nvme7n1, sector 6011360 op 0x1:(WRITE) flags 0x8800 phys_seg 1 prio class 2",
    "aer": "pcieport 0000:77:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, "
           "(Receiver ID)",
    "oom": "Memory cgroup out of memory: Killed process 77123 (python) total-vm:2676kB, anon-rss:84kB, "
           "file-rss:1468kB, shmem-rss:4kB, UID:0 pgtables:40kB oom_score_adj:0",
}
LINES_SPACED = """
import os, sys, time
time.sleep(2)
for line in sys.argv[1:]:
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    os.write(fd, ("<3>" + line + "\\n").encode())
    os.close(fd)
    time.sleep(3.5)  # past the incident's after part: each line its own incident
"""


def test_each_device_trigger_saves_its_incident(tmp_path):
    db = tmp_path / "dev.db"
    res = run_recorder("record", "--db", str(db), "--keep", "30s", *SHORT, "--cooldown", "0s",
                       "--triggers", "nvme,io-error,aer,oom", "--", sys.executable, "-c", LINES_SPACED,
                       *DEVICE_LINES.values(), timeout=300)
    assert res.returncode == 0, res.stderr
    details = {p: q(p, "SELECT trigger, detail FROM incident WHERE own = 1")[0] for p in _incidents(db)}
    for trigger, line in DEVICE_LINES.items():
        # another test's kernel-log line may come first and take ours into its incident: ours is named
        ours = [p for p, (_, detail) in details.items() if line in detail]
        assert len(ours) == 1, (trigger, details)
        assert f"{trigger}: " in details[ours[0]][1]
        report = _explain(ours[0])
        assert line in report["session"]["incident"]


STORM = """
import os, time
def line(n):
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    os.write(fd, b"<3>NVRM: Xid (PCI:0000:10:1c): 48, pid=%d, An uncorrectable double bit error.\\n" % (7700 + n))
    os.close(fd)
time.sleep(2)
for n in range(3):  # a storm: one incident
    line(n)
    time.sleep(0.2)
time.sleep(5)  # that incident saved; the next line is within the cooldown
line(3)
time.sleep(3)
"""


def test_a_trigger_storm_saves_one_incident(tmp_path):
    db = tmp_path / "storm.db"
    res = run_recorder("record", "--db", str(db), "--keep", "30s", *SHORT, "--triggers", "xid", "--",
                       sys.executable, "-c", STORM, timeout=300)
    assert res.returncode == 0, res.stderr
    ours = [p for p in _incidents(db) if q(p, "SELECT count(*) FROM gpu_xid WHERE pid BETWEEN 7700 AND 7703")[0][0]]
    assert len(ours) == 1, _incidents(db)
    (detail,), = q(ours[0], "SELECT detail FROM incident WHERE own = 1")
    assert all(f"pid={7700 + n}" in detail for n in range(3)) and "pid=7703" not in detail, detail
    assert "triggers held back by the rate limit (one incident per trigger per 300 s, 12 an hour): " in res.stdout
    assert "pid=7703" not in "".join(q(p, "SELECT detail FROM incident WHERE own = 1")[0][0] for p in _incidents(db))


def test_dump_and_sigusr1_save_the_window_while_recording(tmp_path):
    db = tmp_path / "d.db"
    work = subprocess.Popen([sys.executable, "-c", SLEEPER, "60"])
    try:
        res = run_recorder("start", "--db", str(db), "-p", str(work.pid), "--keep", "20s", *SHORT, "--json")
        assert res.returncode == 0, res.stderr
        pid = json.loads(res.stdout)["recorder_pid"]
        time.sleep(4)
        status = json.loads(run_recorder("status", "--db", str(db), "--json", check=True).stdout)
        assert status["flight"]["keep_s"] == 20 and status["flight"]["incidents"] == []
        assert 0 < status["flight"]["oldest_event_s"] <= 22
        out = tmp_path / "now.db"
        dump = json.loads(run_recorder("dump", "--db", str(db), "-o", str(out), "--last", "3s", "--json",
                                       check=True).stdout)
        assert 2.9 * S <= dump["end_ts"] - dump["start_ts"] <= 3.1 * S
        report = _explain(out)
        assert report["session"]["state"] == "complete"
        assert report["session"]["incident"] == "saved on request (dump): recorder dump --last 3s"
        assert q(out, "SELECT count(*) FROM offcpu_interval o JOIN thread t ON t.id = o.thread_id "
                      "WHERE t.tid = ?", (work.pid,))[0][0] > 50
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not _incidents(db) and time.monotonic() < deadline:
            time.sleep(0.2)
        saved = _incidents(db)
        assert len(saved) == 1 and saved[0].name.endswith("-signal.db")
        time.sleep(1.5)  # the next status names it
        status = json.loads(run_recorder("status", "--db", str(db), "--json", check=True).stdout)
        assert [i["file"] for i in status["flight"]["incidents"]] == [str(saved[0])]
        text = run_recorder("status", "--db", str(db), check=True).stdout
        assert f"incident {saved[0]}" in text and "flight recorder: keeps the last 20 s" in text
    finally:
        run_recorder("stop", "--db", str(db))
        work.kill()
        work.wait()
    assert q(db, "SELECT trigger, file FROM incident") == [("signal", str(saved[0]))]
    assert _explain(saved[0])["session"]["incident"].startswith("saved on request (signal)")


PIPE_PAIRS = str(ROOT / "tests" / "workloads" / "pipe_pairs.py")  # tens of thousands of switches a second


DIRECT_WRITES = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_DIRECT)
buf, size, off = mmap.mmap(-1, 4096), os.lseek(fd, 0, os.SEEK_END), 0
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    os.pwrite(fd, buf, off)
    off = (off + 4096) % size
"""


def test_a_flight_recording_that_loses_keeps_the_losses_of_the_rows_it_keeps(tmp_path, loop_dev):
    """4 KiB direct writes to a loop device as fast as they go (thousands of block requests a second)
    into a block ring of one page: records are lost every second. Whatever was lost in a second any
    kept row is of is still said in the recording kept, as a dump taken while recording saw it, and
    the report says so."""
    db = tmp_path / "load.db"
    work = subprocess.Popen([sys.executable, "-c", DIRECT_WRITES, f"/dev/{loop_dev}", "40"])
    one_page = {**os.environ, "STALL_RECORDER_BLOCK_RING_PAGES": "1"}
    try:
        res = run_recorder("start", "--db", str(db), "-p", str(work.pid), "--keep", "10s", "--max-size", "64MB",
                           "--before", "2s", "--after", "2s", "--triggers", "", "--json", env=one_page)
        assert res.returncode == 0, res.stderr
        # the attach's backlog loses on any machine, later seconds only on a busy one: the stop comes
        # 10.5 s after the first second that lost, so the 10 s kept begin inside that second (the
        # rows before are cut, that second's losses are of rows kept), whatever the start took
        deadline, first = time.monotonic() + 60, None
        while first is None and time.monotonic() < deadline:
            time.sleep(0.1)
            first = q(db, "SELECT min(ts) FROM loss WHERE probe = 'block ring buffer'")[0][0]
        assert first is not None, "the load lost nothing in 60 s"
        while time.monotonic_ns() < first + 9 * S + S // 2:  # clock of the recording's ts (CLOCK_MONOTONIC)
            time.sleep(0.05)
        mid = tmp_path / "mid.db"
        run_recorder("dump", "--db", str(db), "-o", str(mid), check=True)
        while time.monotonic_ns() < first + 10 * S + S // 2:
            time.sleep(0.05)
    finally:
        stopped = run_recorder("stop", "--db", str(db), "--json")
        work.kill()
        work.wait()
    assert stopped.returncode == 0, stopped.stderr
    conn = sqlite3.connect(db)
    lo = min(conn.execute(f'SELECT coalesce(min(ts), 1 << 62) FROM "{t}"').fetchone()[0]
             for t in event_tables(conn) if t != "loss")
    conn.close()
    # hundreds of requests kept even in 10 s of a ring that loses most of them
    assert q(db, "SELECT count(*) FROM block_request WHERE device = ?", (loop_dev,))[0][0] > 300
    ring = "block ring buffer"
    seen = {(p, ts): n for p, ts, n in q(mid, "SELECT probe, ts, sum(dropped) FROM loss GROUP BY 1, 2")}
    kept = {(p, ts): n for p, ts, n in q(db, "SELECT probe, ts, sum(dropped) FROM loss GROUP BY 1, 2")}
    # the load lost in the seconds the kept window covers: what follows has something to check
    seen_in_window = {k: n for k, n in seen.items() if k[1] + S > lo}
    assert sum(n for (p, _), n in seen_in_window.items() if p == ring) > 0, (seen, (lo, S))
    for (probe, ts), n in seen_in_window.items():  # a second of a row kept: its loss is said
        assert kept.get((probe, ts), 0) >= n, (probe, (ts - lo) / S, n, kept.get((probe, ts)))
    report = _explain(db)
    assert report["loss"]["dropped_events"] > 0, report["loss"]


def test_max_size_bounds_the_database_and_its_log_under_any_rate(tmp_path):
    """The same load against --keep 2m --max-size 16MB: the database and its log stay within 16 MB
    while recording, from the start (the window is cut to what fits), and
    status and the report say the window kept was shorter than --keep because of the size."""
    db = tmp_path / "sized.db"
    wal = tmp_path / "sized.db-wal"
    work = subprocess.Popen([sys.executable, PIPE_PAIRS, "30", "120"])
    peak, split = 0, (0, 0)
    try:
        res = run_recorder("start", "--db", str(db), "-p", str(work.pid), "--keep", "2m", "--max-size", "16MB",
                           *SHORT, "--triggers", "", "--json")
        assert res.returncode == 0, res.stderr
        # from the start: the rings' backlog of the attach lands within it too
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            sizes = tuple(p.stat().st_size if p.exists() else 0 for p in (db, wal))
            peak, split = max((peak, split), (sum(sizes), sizes))
            time.sleep(0.05)
        status = json.loads(run_recorder("status", "--db", str(db), "--json", check=True).stdout)
        text = run_recorder("status", "--db", str(db), check=True).stdout
    finally:
        stopped = run_recorder("stop", "--db", str(db), "--json")
        work.kill()
        work.wait()
    assert stopped.returncode == 0, stopped.stderr
    assert peak <= 16_000_000, f"database + log {peak:,} bytes (database {split[0]:,}, log {split[1]:,})"
    flight = status["flight"]
    assert flight["short_by_size"] and flight["kept_s"] < 120, flight
    assert "window shorter than --keep: 16 MB holds" in text
    (keep, shortest, first, last), = q(db, "SELECT keep_ns, shortest_ns, first_short_ts, last_short_ts "
                                           "FROM flight_window")
    assert keep == 120 * S and shortest < 120 * S and first <= last
    report = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "Window kept: shorter than --keep 120 s from " in report
    assert "--max-size 16 MB held no more at that event rate" in report
