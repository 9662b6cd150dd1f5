"""Recording with real BPF on this machine: real uprobes on the stand-in CUDA libraries, real
sched_switch, a real SQLite file. Skipped with the reason where root or BPF is missing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import RECORDER, ROOT, losses_beyond_skips, needs_bpf, q, run_recorder, workload_output

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "cuda_calls.py")


def record(db, *cmd, extra=()):
    result = run_recorder("record", "--db", str(db), *extra, "--", *cmd, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_known_calls_give_exactly_those_rows(tmp_path, native):
    """3 threads x 40 cudaMalloc (600 us of CPU work each) + frees + syncs, library attached at
    start: every call is a row with its size, pointer, stream and thread, and nothing dropped."""
    db = tmp_path / "r.db"
    lib = str(native["libcudart.so.12"])
    res = record(db, sys.executable, WORKLOAD, "--libdir", str(native["dir"]), "--calls", "40",
                 "--threads", "2", "--size", "3145728", extra=("--cuda-lib", lib))
    truth = workload_output(res.stdout)
    assert len(truth["threads"]) == 3
    rows = q(db, "SELECT t.tid, c.api, count(*), min(c.dur), max(c.dur), min(c.size_bytes),"
                 " max(c.size_bytes) FROM cuda_call_named c JOIN thread t ON t.id = c.thread_id"
                 " GROUP BY t.tid, c.api")
    by = {(tid, api): (n, lo, hi, smin, smax) for tid, api, n, lo, hi, smin, smax in rows}
    for tid, info in truth["threads"].items():
        n, lo, hi, smin, smax = by[(int(tid), "cudaMalloc")]
        assert n == info["mallocs"] == 40
        assert smin == smax == 3145728
        assert lo >= 600_000  # at least the CPU work it was told to do
        assert by[(int(tid), "cudaFree")][0] == 40
        assert by[(int(tid), "cudaStreamSynchronize")][0] == 1
        first = q(db, "SELECT c.pointer FROM cuda_call_named c JOIN thread t ON t.id = c.thread_id"
                      " WHERE t.tid = ? AND c.api = 'cudaMalloc' ORDER BY c.ts LIMIT 1", (int(tid),))
        assert first[0][0] == info["first_pointer"]
        stream = q(db, "SELECT c.stream FROM cuda_call_named c JOIN thread t ON t.id = c.thread_id"
                       " WHERE t.tid = ? AND c.api = 'cudaStreamSynchronize'", (int(tid),))
        assert stream[0][0] == 0x5000 + int(tid) % 1000
    # (runs of other layers' programs the kernel skipped on a busy machine are counted, and lose no call)
    assert losses_beyond_skips(db) == {}, q(db, "SELECT * FROM loss")
    # worker threads (not the main thread) are attributed, with their names
    tids = {r[0] for r in q(db, "SELECT tid FROM thread WHERE traced = 1")}
    assert {int(t) for t in truth["threads"]} <= tids
    main = q(db, "SELECT count(DISTINCT c.thread_id) FROM cuda_call_named c")[0][0]
    assert main == 3
    # durations agree with the workload's own wall clock within tolerance: 40 x 600 us of CPU
    # work per thread cannot take less than 24 ms of cudaMalloc time
    total = q(db, "SELECT sum(dur) FROM cuda_call_named WHERE api = 'cudaMalloc'")[0][0]
    assert total >= 3 * 40 * 600_000
    status = q(db, "SELECT status, stopped_ts IS NOT NULL FROM session")[0]
    assert status == ("complete", 1)
    assert q(db, "PRAGMA integrity_check")[0][0] == "ok"


def test_gil_holding_extension_and_driver_calls(tmp_path, native):
    db = tmp_path / "r.db"
    ext = native_build_ext()
    res = record(db, sys.executable, WORKLOAD, "--libdir", str(native["dir"]), "--calls", "5", "--threads", "0",
                 "--gil", "--extdir", str(ext), "--driver",
                 extra=("--cuda-lib", str(native["libcudart.so.12"]),
                        "--cuda-lib", str(native["libcuda.so.1"])))
    truth = workload_output(res.stdout)
    (tid, info), = truth["threads"].items()
    assert info["mallocs"] == 6  # 5 through ctypes, 1 through the extension holding the GIL
    n = q(db, "SELECT count(*) FROM cuda_call_named WHERE api = 'cudaMalloc'")[0][0]
    assert n == 6
    drv = q(db, "SELECT api, library, size_bytes FROM cuda_call_named WHERE family = 'cuMemAlloc'")
    assert drv == [("cuMemAlloc_v2", "driver", 1 << 20)]


def native_build_ext():
    import native_libs as build

    return build.build_gil_extension(sys.executable)


def test_library_loaded_after_start_is_traced(tmp_path, native):
    """No --cuda-lib: the workload dlopens the runtime a second after recording starts."""
    db = tmp_path / "r.db"
    res = record(db, sys.executable, WORKLOAD, "--libdir", str(native["dir"]), "--calls", "30",
                 "--threads", "0", "--dlopen-delay", "1", "--settle", "0.5")
    workload_output(res.stdout)
    assert q(db, "SELECT count(*) FROM cuda_call_named WHERE api = 'cudaMalloc'")[0][0] == 30
    found = q(db, "SELECT kind, found_by FROM library")
    assert ("runtime", "dlopen") in found


DLOPENER = """
import ctypes, shutil, sys, time
from pathlib import Path
lib, folder = sys.argv[1], Path(sys.argv[2])
for n in (1, 2):
    while not (folder / f"go{n}").exists():
        time.sleep(0.01)
    copy = folder / f"{n}" / "libcudart.so.12"  # a file of its own: each dlopen opens it
    copy.parent.mkdir()
    shutil.copy(lib, copy)
    ctypes.CDLL(str(copy))
    (folder / f"done{n}").write_text("")
"""


def test_a_dlopen_after_the_stop_is_never_held(tmp_path, native):
    """A process that opens a CUDA library is held at its dlopen's return until the recorder has
    attached to it. After the stop the probes stay attached for seconds (they are detached in the
    background), with nobody reading: a dlopen then must not stop the process for good."""
    db = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-c", DLOPENER, str(native["libcudart.so.12"]), str(tmp_path)])
    try:
        run_recorder("start", "-p", str(proc.pid), "--db", str(db), check=True)
        (tmp_path / "go1").touch()  # while recording: held, attached, let go
        deadline = time.monotonic() + 30
        while not (tmp_path / "done1").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the dlopen while recording never returned"
            time.sleep(0.05)
        run_recorder("stop", "--db", str(db), check=True)
        (tmp_path / "go2").touch()  # right after the stop: the probes are still being detached
        deadline = time.monotonic() + 20
        while not (tmp_path / "done2").exists():
            state = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]
            assert time.monotonic() < deadline, f"the dlopen after the stop never returned (state {state})"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert ("runtime", "dlopen") in q(db, "SELECT kind, found_by FROM library")


def test_fork_and_exec_are_followed(tmp_path, native):
    """The recorded command is a shell that forks and execs python: its calls are recorded."""
    db = tmp_path / "r.db"
    cmd = f"sleep 0.2; {sys.executable} {WORKLOAD} --libdir {native['dir']} --calls 20 --threads 0 --settle 0.5"
    res = record(db, "/bin/sh", "-c", cmd)
    truth = workload_output(res.stdout)
    assert q(db, "SELECT count(*) FROM cuda_call_named WHERE api = 'cudaMalloc'")[0][0] == 20
    pid = truth["pid"]
    procs = q(db, "SELECT cmdline FROM process WHERE pid = ? AND cmdline LIKE '%cuda_calls.py%'", (pid,))
    assert procs, "the exec'd python process is recorded with its command line"


def test_cpu_hog_on_the_workloads_core_is_the_cause(tmp_path, native):
    db = tmp_path / "r.db"
    cpu = max(os.sched_getaffinity(0))
    hog = f"taskset -c {cpu} nice -n -15 {native['busy_loop']} 2"
    hog_cmd = f"(sleep 1; {hog} & {hog} & {hog} & wait) & "
    cmd = (f"{hog_cmd} exec {sys.executable} {ROOT}/tests/workloads/train_steps.py "
           f"--libdir {native['dir']} --steps 250 --cpu {cpu}")
    # the hogs are children of the recorded shell, so they are traced too; the report must still
    # name them as what delayed the training thread
    # the recorder itself runs on the other CPUs, as `make demo` does, so that it is not the contender
    others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != cpu) or str(cpu)
    res = subprocess.run(["taskset", "-c", others, *RECORDER, "record", "--db", str(db), "--cuda-lib",
                          str(native["libcudart.so.12"]), "--", "/bin/sh", "-c", cmd],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    out = run_recorder("explain", "--db", str(db), "--json", check=True)
    report = json.loads(out.stdout)
    assert report["stall"] is True
    cause = report["primary_cause"]
    assert cause["kind"] == "cpu_contention", cause
    # every task that held the CPU is named with its share; the hogs hold a large part of it (on a
    # machine busy with other work, other tasks on that CPU are contention too, and named as well)
    hogs = [c for c in cause["contenders"] if c["name"] == "busy_loop"]
    assert hogs and hogs[0]["cpu_wait_dur_ns"] >= 0.25 * cause["dur_ns"], cause["contenders"]
    if report["mode"] == "call":  # the slowest call is the one the cause was found in
        assert report["findings"][0]["cpu_wait_dur_ns"] > 0, report["findings"][0]
    else:  # steps inferred from the calls' period: the findings are the step's slow calls, any of which
        # may be slow without waiting (the stand-in's own latency); the one that waited most waited behind a hog
        assert report["mode"] == "step" and report["findings"], report["symptom"]
        top = max(report["findings"], key=lambda f: f["cpu_wait_dur_ns"])
        assert top["cpu_wait_dur_ns"] == 0 or "busy_loop" in {c["name"] for c in top["contenders"]}, top
    text = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "busy_loop (" in text and "Primary cause: CPU contention" in text


def test_start_status_stop_and_a_second_start_is_refused(tmp_path, native):
    db = tmp_path / "r.db"
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, WORKLOAD, "--libdir", str(native["dir"]), "--calls", "200",
                             "--threads", "0", "--work-us", "2000", "--wait-file", str(go)], stdout=subprocess.PIPE,
                            text=True)
    try:
        start = run_recorder("start", "-p", str(proc.pid), "--db", str(db), check=True)
        go.touch()
        assert "recording session 1" in start.stdout
        # the scheduler's four tracepoints, and the setting of its stack capture
        assert int(re.search(r"sched (\d+)", start.stdout).group(1)) >= 4, start.stdout
        again = run_recorder("start", "-p", str(proc.pid), "--db", str(db))
        assert again.returncode == 2
        assert "already recording" in again.stderr and len(again.stderr.strip().splitlines()) == 1
        time.sleep(1.5)
        status = json.loads(run_recorder("status", "--db", str(db), "--json", check=True).stdout)
        assert status["session_id"] == 1 and status["recorder_pid"] > 0
        proc.wait(timeout=60)
        time.sleep(0.5)
        stop = run_recorder("stop", "--db", str(db), check=True)
        assert "session 1 complete" in stop.stdout
    finally:
        proc.kill()
    assert q(db, "SELECT count(*) FROM cuda_call_named WHERE api = 'cudaMalloc'")[0][0] == 200
    assert q(db, "SELECT status FROM session")[0][0] == "complete"
    indexes = {r[0] for r in q(db, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "cuda_call_thread_ts" in indexes


def test_sigkill_of_the_recorder_leaves_a_valid_incomplete_session(tmp_path, native):
    db = tmp_path / "r.db"
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, WORKLOAD, "--libdir", str(native["dir"]), "--calls", "400",
                             "--work-us", "3000", "--wait-file", str(go)], stdout=subprocess.PIPE)
    try:
        start = json.loads(run_recorder("start", "-p", str(proc.pid), "--db", str(db), "--json",
                                        check=True).stdout)
        go.touch()
        time.sleep(2.5)
        os.kill(start["recorder_pid"], signal.SIGKILL)
        # the kernel detaches the probes before the process is gone and its lock released
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{start['recorder_pid']}") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
    assert q(db, "PRAGMA integrity_check")[0][0] == "ok"
    recorded = q(db, "SELECT count(*) FROM cuda_call")[0][0]
    assert recorded > 0
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    assert report["session"]["state"] == "incomplete"
    # a new session can start on the same database afterwards; the old rows stay
    status = run_recorder("status", "--db", str(db))
    assert status.returncode == 2 and "no recorder is running" in status.stderr
    assert q(db, "SELECT count(*) FROM cuda_call")[0][0] == recorded


def test_tracepoint_missing_from_the_kernel_is_recorded_as_absent(tmp_path):
    """A layer whose tracepoint this kernel lacks is left out and said so; the rest loads."""
    from recorder.core import loader as probes
    from recorder.core.layer import BpfSource
    from recorder.layers import bpf_sources, cuda, definitions

    sources = (*bpf_sources(), BpfSource("ghost", "sched.bpf.c", ("ghost:no_such_event",)))
    p = probes.Probes(probes.TargetSpec(pids=(os.getpid(),)), sources, [cuda.bpf_programs()],
                     definitions=definitions())
    try:
        # the I/O layer's optional tracepoints (recorder/layers/io/layer.py) are absent or not on their own
        absent = [c for c in p.capabilities if c.status == "absent" and c.layer in ("ghost", "sched", "task")]
        assert [(c.layer, c.probe) for c in absent] == [("ghost", "ghost:no_such_event")]
        assert "sched" in p.layers and "ghost" not in p.layers
        # the stop detaches every probe at once (probes.detach_all), and nothing is left attached
        p.attach_dlopen()
        attached = len(p.bpf.tracepoint_fds) + len(p.bpf.uprobe_fds)
        assert p.bpf.uprobe_fds and len(perf_event_fds()) >= attached > 40
        probes.detach_all(p.bpf)
        assert not p.bpf.tracepoint_fds and not p.bpf.uprobe_fds and not p.bpf.kprobe_fds
        assert perf_event_fds() == []
    finally:
        p.cleanup()


def test_the_stop_hands_its_probes_to_a_helper_whose_exit_detaches_them(tmp_path):
    """The kernel detaches perf events one at a time at their last close (seconds for a session's):
    the stop hands them to a helper process, which holds them and no file of the recording, and
    detaches them in its exit; once it is gone, the programs no longer run."""
    from recorder.core import loader as probes
    from recorder.layers import bpf_sources, cuda, definitions

    stats = "/proc/sys/kernel/bpf_stats_enabled"
    was = open(stats).read().strip()
    open(stats, "w").write("1")  # the programs' run counts in their fdinfo
    p = probes.Probes(probes.TargetSpec(pids=(os.getpid(),)), bpf_sources(), [cuda.bpf_programs()],
                      definitions=definitions())
    try:
        recording = open(tmp_path / "r.db", "wb")  # a file of this process: the helper must not hold it
        held = sorted(p.bpf.tracepoint_fds.values())
        helper = probes._detacher(held)
        assert helper is not None
        fds = {int(fd): os.readlink(f"/proc/{helper.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{helper.pid}/fd")}
        assert sorted(fd for fd in fds if fd > 2) == held, fds
        assert {fds[fd] for fd in held} == {"anon_inode:[perf_event]"}
        assert not any(str(tmp_path) in target for target in fds.values()), fds
        helper.stdin.close()
        helper.wait(timeout=60)
        recording.close()

        # the whole stop's way: this process closes its copies at once, the helper's exit detaches
        switch = p.bpf.funcs[b"tracepoint__sched__sched_switch"].fd

        def runs() -> int:
            return int(re.search(r"^run_cnt:\s*(\d+)", open(f"/proc/self/fdinfo/{switch}").read(), re.M).group(1))

        def switches() -> int:
            before = runs()
            for _ in range(50):
                time.sleep(0.002)  # a context switch each
            return runs() - before

        assert switches() >= 50  # attached, and counted
        probes.detach_all(p.bpf)
        assert perf_event_fds() == [] and not p.bpf.tracepoint_fds and not p.bpf.uprobe_fds
        assert probes._DETACHERS[-1] is not helper
        probes._DETACHERS[-1].wait(timeout=60)
        assert switches() == 0
    finally:
        p.cleanup()
        open(stats, "w").write(was)


def perf_event_fds() -> list[str]:
    """This process's open perf events (each attached tracepoint or uprobe holds one)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]":
                out.append(fd)
        except OSError:  # the listing's own descriptor, closed since
            continue
    return out
