"""The on-CPU profile with real BPF (recorder/layers/profile): a Python job whose one step burns CPU
in Python code at a known line, and whose other stalled step spins in the stand-in driver's
cuLaunchKernel (tests/native/cuda.c, CPU time inside the library). `explain` names the line of the
first ("in Python at cpu_steps.py:27") and the library, function and line of the second; the
`step_cpu_profile` view attributes the samples. The recording is made with the default rate (the
profile is on unless --profile-hz 0 turns it off); its programs attach seconds after the recording
began, and the job runs its steps once the recorder's status file counts samples.

The job runs SCHED_FIFO (conftest.realtime): on this shared machine the steps would otherwise also
wait for the CPU behind other work, and that wait would be their cause instead."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import RECORDER, ROOT, needs_bpf, profile_default_env, q, realtime, run_recorder, workload_output
from test_waits_bpf import _mcp_explain, _plain

from recorder.core.settings import DEFAULT_PROFILE_HZ
from recorder.recording_files import status_path

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "cpu_steps.py")
BURN_MS = 300
HZ = DEFAULT_PROFILE_HZ


@pytest.fixture(scope="module")
def recording(tmp_path_factory, native) -> tuple:
    db = tmp_path_factory.mktemp("profile") / "profile.db"
    res = run_recorder("record", "--db", str(db), "--", *realtime(), sys.executable,
                       WORKLOAD, "--steps", "14", "--until-sampled", str(status_path(db)),
                       "--burn-step", "6", "--spin-step", "10", "--burn-ms", str(BURN_MS),
                       "--libdir", str(native["libcuda.so.1"].parent), timeout=300, env=profile_default_env())
    assert res.returncode == 0, res.stderr
    return db, workload_output(res.stdout)


def explain(db, step: int) -> tuple[dict, str]:
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", str(step), "--json", check=True).stdout)
    text = run_recorder("explain", "--db", str(db), "--step", str(step), check=True).stdout
    return report, text


def test_python_code_that_burns_the_cpu_is_named_by_its_line(recording) -> None:
    db, truth = recording
    assert q(db, "SELECT status FROM capability WHERE layer = 'profile' AND probe = 'cpu-clock samples'") == [
        ("attached",)]
    report, text = explain(db, truth["burn_step"])
    assert report["stall"] and report["step"]["thread"]["tid"] == truth["tid"]
    cpu = report["on_cpu"]
    top = cpu["sites"][0]
    line = f"cpu_steps.py:{truth['BURN_LINE']}"
    assert (top["library"], top["python"]) == (None, line), cpu
    # the samples stand for the CPU time burnt there: at least half of it (a sample is skipped while
    # another of the recorder's programs runs on that CPU), never more than the step
    assert BURN_MS * 1e6 / 2 <= top["dur_ns"] <= report["step"]["dur_ns"], cpu
    assert top["usual_dur_ns"] < top["dur_ns"] / 4, cpu
    assert report["primary_cause"] is None, report["primary_cause"]  # no wait explains it
    assert cpu["summary"].startswith("on the CPU for ") and cpu["summary"].endswith(f"in Python at {line}"), cpu
    assert f"Primary cause: {cpu['summary']}" in text, text
    # the MCP explain tool, through a real client, says the same
    assert _plain(_mcp_explain(db, truth["burn_step"])["on_cpu"]) == cpu


def test_a_call_spinning_in_a_library_is_named_with_its_library_function_and_line(recording) -> None:
    db, truth = recording
    report, text = explain(db, truth["spin_step"])
    cpu = report["on_cpu"]
    top = cpu["sites"][0]
    line = f"cpu_steps.py:{truth['LAUNCH_LINE']}"
    assert (top["library"], top["function"], top["python"]) == ("libcuda.so.1", "cuLaunchKernel", line), cpu
    # the stand-in spins reading its thread's CPU clock, a system call every ~0.5 us: the samples that
    # land while the scheduler layer's syscall programs run are skipped by the kernel (docs/losses.md),
    # most of them on a loaded machine
    assert BURN_MS * 1e6 / 6 <= top["dur_ns"] <= report["step"]["dur_ns"], cpu
    assert f"in cuLaunchKernel (libcuda.so.1), from {line}" in text, text
    # the view the report reads: the step's samples there, none of them in another step
    rows = q(db, "SELECT p.samples FROM step_cpu_profile p JOIN step_mark m ON m.id = p.step_mark_id"
                 " WHERE m.step = ? AND p.library = 'libcuda.so.1' AND p.function = 'cuLaunchKernel'",
             (truth["spin_step"],))
    assert rows and rows[0][0] == top["samples"]
    assert q(db, "SELECT count(*) FROM step_cpu_profile p JOIN step_mark m ON m.id = p.step_mark_id"
                 " WHERE m.step != ? AND p.function = 'cuLaunchKernel'", (truth["spin_step"],)) == [(0,)]


def test_the_profile_is_on_by_default_and_each_sample_stands_for_its_period(recording) -> None:
    db, truth = recording
    period = 1_000_000_000 // HZ
    (detail,), = q(db, "SELECT detail FROM capability WHERE layer = 'profile' AND probe = 'cpu-clock samples'")
    assert re.fullmatch(rf"every {period / 1e6:.1f} ms of CPU time \({HZ} a second\) on each CPU, the targets'"
                        r" threads only; \d+\.\d s after the recording began \(its programs are compiled once it"
                        r" records, \d+\.\d CPU-s\): no samples before", detail), detail
    assert q(db, "SELECT DISTINCT dur FROM cpu_sample") == [(period,)]
    # only the traced job's threads are sampled, and each sample has its Python stack
    assert q(db, "SELECT DISTINCT p.pid FROM cpu_sample c JOIN thread t ON t.id = c.thread_id"
                 " JOIN process p ON p.id = t.process_id") == [(truth["pid"],)]
    assert q(db, "SELECT count(*) FROM cpu_sample WHERE python_stack_id IS NULL") == [(0,)]


def test_a_bad_rate_is_one_line_and_records_nothing(tmp_path) -> None:
    db = tmp_path / "bad.db"
    res = run_recorder("record", "--db", str(db), "--profile-hz", "5000", "--", "/bin/true")
    assert res.returncode != 0 and res.stderr.strip().splitlines() == [
        "recorder: --profile-hz 5000: give samples a second from 1 to 1000, or 0 for no on-CPU profile"], res.stderr
    assert not db.exists()


def test_a_default_recording_samples_a_python_loop_at_its_line(recording) -> None:
    """No --profile-hz: the CPU-bound burn step's samples carry their Python line."""
    db, truth = recording
    lines = q(db, "SELECT pf.line, count(*) FROM cpu_sample c JOIN python_stack_frame pf"
                  " ON pf.stack_id = c.python_stack_id AND pf.depth = 0 JOIN python_code pc ON pc.id = pf.code_id"
                  " WHERE pc.filename LIKE '%cpu_steps.py' AND pc.qualname = 'burn' GROUP BY 1")
    assert [line for line, _ in lines] == [truth["BURN_LINE"]], lines


def test_profile_hz_0_turns_it_off_and_a_recording_that_ends_first_says_it_has_no_samples(tmp_path) -> None:
    """Two recordings at once (each is mostly its start's compile, one CPU each): a CPU-bound loop
    with --profile-hz 0 has no sample and says it was turned off; a default recording of /bin/true
    ends before the profile attached, complete, and says it has no samples."""
    off, short = tmp_path / "off.db", tmp_path / "short.db"
    loop = "import time\nend = time.thread_time() + 0.3\nwhile time.thread_time() < end: pass"
    runs = [subprocess.Popen([*RECORDER, "record", "--db", str(off), "--profile-hz", "0", "--", sys.executable, "-c",
                              loop], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
            subprocess.Popen([*RECORDER, "record", "--db", str(short), "--", "/bin/true"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=profile_default_env())]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    assert q(off, "SELECT status, detail FROM capability WHERE layer = 'profile'") == [
        ("absent", "turned off (--profile-hz 0)")]
    assert q(off, "SELECT count(*) FROM cpu_sample") == [(0,)]
    assert q(short, "SELECT status FROM session") == [("complete",)]
    (status, detail), = q(short, "SELECT status, detail FROM capability WHERE layer = 'profile'")
    assert status == "absent" and re.fullmatch(
        r"the recording ended \d+\.\d s after it began, before the profile's programs were ready \(they are"
        r" compiled once it records\): no samples", detail), detail
