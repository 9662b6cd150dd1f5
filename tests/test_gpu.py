"""GPU utilisation through NVML, against the stand-in libnvidia-ml.so.1 (tests/native/nvml.c: the
real entry points pynvml calls, its GPUs' utilisation read from a file the test writes): settings,
the sampler thread writing `gpu_sample` rows, metrics a GPU lacks, GPUs that stop answering; and real
sessions (real BPF) that sample in the recorder process, or record 'gpu' absent without NVML and
still record everything else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder

from recorder.errors import UserError
from recorder.layers.gpu import GpuSampler, GpuSettings, pci_address
from store.db import Writer, open_store

pytest.importorskip("pynvml", reason="needs nvidia-ml-py (pip install nvidia-ml-py)")


def test_settings_from_environment(tmp_path):
    lib = tmp_path / "libnvidia-ml.so.1"
    lib.write_bytes(b"")
    assert GpuSettings.from_environment({}) == GpuSettings(None, 0.1)
    assert GpuSettings.from_environment({"STALL_RECORDER_NVML_LIB": str(lib),
                                         "STALL_RECORDER_GPU_INTERVAL_MS": "250"}) == GpuSettings(lib, 0.25)
    assert GpuSettings.from_environment({"STALL_RECORDER_GPU_INTERVAL_MS": "0"}).interval_s == 0
    for bad in ("5", "100ms", "-1", "60001", "0.5"):
        with pytest.raises(UserError, match="STALL_RECORDER_GPU_INTERVAL_MS=.*whole milliseconds"):
            GpuSettings.from_environment({"STALL_RECORDER_GPU_INTERVAL_MS": bad})
    with pytest.raises(UserError, match="no such file"):
        GpuSettings.from_environment({"STALL_RECORDER_NVML_LIB": str(tmp_path / "missing.so")})


def test_pci_address_in_the_kernels_spelling():
    assert pci_address("00000000:1B:00.0") == "0000:1b:00.0"
    assert pci_address("0000:3D:00.1") == "0000:3d:00.1"
    assert pci_address("00010000:01:00.0") == "00010000:01:00.0"  # a domain that needs all 8 digits


def _store(path: Path):
    store = open_store(path, create=True)
    sid = store.db["session"].insert({
        "started_ts": 0, "wall_offset_ns": 0, "status": "recording", "recorder_pid": os.getpid(), "hostname": "h",
        "kernel_release": "r", "boot_id": "b", "cpu_count": 1, "target": "t", "command": "c", "tool_version": "0",
    }).last_pk
    return store, sid


@pytest.fixture
def standin(native, tmp_path, monkeypatch):
    """The stand-in NVML with 2 GPUs whose utilisation the test writes; returns the file to write."""
    util = tmp_path / "util"
    util.write_text("20 10\n")
    monkeypatch.setenv("STANDIN_NVML_GPUS", "2")
    monkeypatch.setenv("STANDIN_NVML_UTIL_FILE", str(util))
    return util


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sampler_follows_utilisation_and_stops(tmp_path, native, standin, monkeypatch):
    monkeypatch.setenv("STANDIN_NVML_NO_POWER", "1")
    store, sid = _store(tmp_path / "g.db")
    writer = Writer(store)
    sampler = GpuSampler(writer, sid, GpuSettings(native["libnvidia-ml.so.1"], 0.05))
    assert sampler.start()
    _wait_for(lambda: sum(r[5] == 20 for r in sampler.samples) >= 4)
    standin.write_text("85 60\n5 1\n")
    _wait_for(lambda: any(r[5] == 5 for r in sampler.samples))
    time.sleep(0.3)
    sampler.stop()
    sampler.flush()
    writer.close()
    import pynvml

    with pytest.raises(pynvml.NVMLError):  # stop() shut NVML down
        pynvml.nvmlDeviceGetCount()
    db = tmp_path / "g.db"
    rows = q(db, "SELECT gpu_index, pci_address, name, util_gpu, util_mem, mem_used_bytes, mem_total_bytes,"
                 " sm_clock_mhz, power_mw, temperature_c FROM gpu_sample ORDER BY gpu_index, ts")
    for index in (0, 1):
        mine = [r for r in rows if r[0] == index]
        assert {r[1:3] for r in mine} == {(f"0000:{0x1b + index:02x}:00.0", f"NVIDIA Stand-in GPU {index}")}
        assert {r[5:] for r in mine} == {((index + 1) << 30, 80 << 30, 1410, None, 40 + index)}
        # 20% until the file changed, then GPU 0 at 85% and GPU 1 at 5%, never back
        utils = [r[3:5] for r in mine]
        after = (85, 60) if index == 0 else (5, 1)
        first_after = utils.index(after)
        assert set(utils[:first_after]) == {(20, 10)} and set(utils[first_after:]) == {after}
        assert len(utils[first_after:]) >= 4
    # every 50 ms: the spacing of one GPU's samples
    ts = [r[0] for r in q(db, "SELECT ts FROM gpu_sample WHERE gpu_index = 0 ORDER BY ts")]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
    assert 40e6 <= gaps[len(gaps) // 2] <= 80e6, gaps
    count = len(ts)
    time.sleep(0.2)
    assert len(sampler.samples) == 0 and count == len(ts)  # nothing after stop
    caps = q(db, "SELECT probe, target, status, detail FROM capability WHERE layer = 'gpu' ORDER BY probe, target")
    assert ("power", "0000:1b:00.0", "absent", "Not Supported") in caps
    assert ("power", "0000:1c:00.0", "absent", "Not Supported") in caps
    assert any(p == "nvml" and s == "attached" and "2 GPU(s), driver 999.99, sampled every 50 ms" in d
               for p, _, s, d in caps)


def test_gpu_that_stops_answering_is_counted_as_loss(tmp_path, native, standin, monkeypatch):
    store, sid = _store(tmp_path / "l.db")
    writer = Writer(store)
    sampler = GpuSampler(writer, sid, GpuSettings(native["libnvidia-ml.so.1"], 0.02))
    assert sampler.start()
    monkeypatch.setenv("STANDIN_NVML_UTIL_ERROR", "15")  # GPU is lost
    time.sleep(0.4)
    sampler.stop()
    sampler.flush()
    writer.close()
    lost = q(tmp_path / "l.db", "SELECT coalesce(sum(dropped), 0) FROM loss WHERE probe = 'nvml_sample'")[0][0]
    assert lost >= 10  # 2 GPUs x ~20 ticks, every one unanswered after the first ticks
    assert q(tmp_path / "l.db", "SELECT count(*) FROM capability WHERE probe = 'utilization'") == [(0,)]


def _gpu_caps(db: Path) -> list[tuple]:
    return q(db, "SELECT probe, status, detail FROM capability WHERE layer = 'gpu' AND probe = 'nvml'")


def test_absent_reasons_are_recorded(tmp_path, native, standin, monkeypatch):
    store, sid = _store(tmp_path / "r.db")
    writer = Writer(store)
    monkeypatch.setenv("STANDIN_NVML_INIT_ERROR", "9")
    broken = GpuSampler(writer, sid, GpuSettings(native["libnvidia-ml.so.1"], 0.1))
    assert not broken.start()
    monkeypatch.delenv("STANDIN_NVML_INIT_ERROR")
    monkeypatch.setenv("STANDIN_NVML_GPUS", "0")
    none = GpuSampler(writer, sid, GpuSettings(native["libnvidia-ml.so.1"], 0.1))
    assert not none.start()
    off = GpuSampler(writer, sid, GpuSettings(None, 0))
    assert not off.start()
    for sampler in (broken, none, off):
        sampler.flush()
    writer.close()
    assert _gpu_caps(tmp_path / "r.db") == [
        ("nvml", "absent", "nvmlInit failed: Driver Not Loaded"),
        ("nvml", "absent", "NVML (driver 999.99) reports no GPU"),
        ("nvml", "absent", "turned off (STALL_RECORDER_GPU_INTERVAL_MS=0)"),
    ]
    assert q(tmp_path / "r.db", "SELECT count(*) FROM gpu_sample") == [(0,)]


def _nvml_on_this_machine() -> bool:
    """Whether the loader finds a real libnvidia-ml.so.1 here (asked in a fresh process: this one may
    hold the stand-in under that name)."""
    probe = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"],
                           capture_output=True, env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    return probe.returncode == 0


def test_doctor_line(native, tmp_path):
    env = {**os.environ, "STALL_RECORDER_NVML_LIB": str(native["libnvidia-ml.so.1"]), "STANDIN_NVML_GPUS": "2"}
    out = subprocess.run([*RECORDER, "doctor", "--json"], capture_output=True, text=True, cwd=ROOT, env=env)
    line = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "NVML (GPU utilisation)")
    assert line["ok"] and line["detail"].startswith("driver 999.99, 2 GPU(s): 0: NVIDIA Stand-in GPU 0 (0000:1b:00.0)")
    env["STALL_RECORDER_NVML_LIB"] = str(tmp_path / "missing.so")
    out = subprocess.run([*RECORDER, "doctor", "--json"], capture_output=True, text=True, cwd=ROOT, env=env)
    line = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "NVML (GPU utilisation)")
    assert not line["ok"] and not line["required"] and "no such file" in line["detail"]


@needs_bpf
@pytest.mark.bpf
def test_session_samples_gpus_in_the_recorder_process(tmp_path, native):
    """`recorder record` with the stand-in: samples from a thread of the recorder (never the traced
    command), every 50 ms, following the utilisation the command itself sets while it runs."""
    util, calls, db = tmp_path / "util", tmp_path / "calls", tmp_path / "s.db"
    util.write_text("15 5\n")
    env = {**os.environ, "STALL_RECORDER_NVML_LIB": str(native["libnvidia-ml.so.1"]),
           "STALL_RECORDER_GPU_INTERVAL_MS": "50", "STANDIN_NVML_GPUS": "2", "STANDIN_NVML_UTIL_FILE": str(util),
           "STANDIN_NVML_CALLS_FILE": str(calls)}
    res = run_recorder("record", "--db", str(db), "--", "sh", "-c",
                       f"sleep 0.6; echo '95 70' > {util}; sleep 0.6; echo traced=$$", env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    traced_pid = int(next(x for x in res.stdout.splitlines() if x.startswith("traced="))[7:])
    recorder_pid, started, stopped = q(db, "SELECT recorder_pid, started_ts, stopped_ts FROM session")[0]
    pids = {tuple(map(int, line.split())) for line in calls.read_text().splitlines()}
    assert {pid for pid, _ in pids} == {recorder_pid} and traced_pid != recorder_pid
    assert all(tid != recorder_pid for _, tid in pids)  # a thread of its own, not the loop's
    for index in (0, 1):
        utils = [r[0] for r in q(db, "SELECT util_gpu FROM gpu_sample WHERE gpu_index = ? ORDER BY ts", (index,))]
        assert utils.count(95) >= 5 and utils.count(15) >= 5, utils
        assert utils == sorted(utils), utils  # 15 until the command changed it, then 95
    assert q(db, "SELECT count(*) FROM gpu_sample WHERE ts < ? OR ts > ?", (started, stopped)) == [(0,)]
    assert ("nvml", "attached", "2 GPU(s), driver 999.99, sampled every 50 ms") in _gpu_caps(db)


@needs_bpf
@pytest.mark.bpf
def test_session_without_nvml_records_gpu_absent_and_everything_else(tmp_path):
    if _nvml_on_this_machine():
        pytest.skip("this machine has a real libnvidia-ml.so.1")
    db = tmp_path / "n.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALL_RECORDER_NVML", "LD_LIBRARY_PATH"))}
    res = run_recorder("record", "--db", str(db), "--", "dd", "if=/dev/zero", f"of={tmp_path}/f.bin", "bs=4k",
                       "count=200", "oflag=direct", env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert _gpu_caps(db) == [("nvml", "absent", "libnvidia-ml.so.1 not found (no NVIDIA driver installed)")]
    assert q(db, "SELECT count(*) FROM gpu_sample") == [(0,)]
    assert q(db, "SELECT status FROM session") == [("complete",)]
    assert q(db, "SELECT count(*) > 0 FROM offcpu_interval") == [(1,)]
    assert q(db, "SELECT count(*) >= 150 FROM block_request WHERE op = 'write'") == [(1,)]  # 200 writes, some merged
    assert q(db, "SELECT count(*) > 0 FROM block_device") == [(1,)]
    assert q(db, "SELECT count(*) FROM capability WHERE layer = 'sched' AND status = 'attached'")[0][0] > 0


def test_driver_sample_buffer_is_read_where_it_is_kept(tmp_path, native, standin, monkeypatch):
    """Where the driver keeps utilisation samples (nvmlDeviceGetSamples) they are the utilisation
    rows, at the driver's finer period and time; the polls carry the other metrics. Without the
    buffer the polls' values are the samples (the test above)."""
    monkeypatch.setenv("STANDIN_NVML_SAMPLE_MS", "10")
    monkeypatch.setenv("STANDIN_NVML_GPUS", "1")
    store, sid = _store(tmp_path / "b.db")
    writer = Writer(store)
    sampler = GpuSampler(writer, sid, GpuSettings(native["libnvidia-ml.so.1"], 0.1))
    started = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    assert sampler.start()
    _wait_for(lambda: sum(r[5] == 20 for r in sampler.samples) >= 30)
    sampler.stop()
    stopped = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    sampler.flush()
    writer.close()
    db = tmp_path / "b.db"
    buffered = [r[0] for r in q(db, "SELECT ts FROM gpu_sample WHERE util_gpu IS NOT NULL ORDER BY ts")]
    polls = q(db, "SELECT util_mem, mem_used_bytes FROM gpu_sample WHERE util_gpu IS NULL")
    assert q(db, "SELECT DISTINCT util_gpu FROM gpu_sample WHERE util_gpu IS NOT NULL") == [(20,)]
    assert polls and set(polls) == {(10, 1 << 30)} and len(buffered) >= 3 * len(polls)
    gaps = sorted(b - a for a, b in zip(buffered, buffered[1:], strict=False))
    assert 9e6 <= gaps[len(gaps) // 2] <= 11e6, gaps  # the driver's 10 ms, not the 100 ms poll
    assert started - 20e6 <= buffered[0] and buffered[-1] <= stopped + 2e6  # on the monotonic clock
    assert ("utilization_samples", "attached") in q(db, "SELECT probe, status FROM capability WHERE layer = 'gpu'")
