"""`recorder import`: PyTorch profiler traces and NCCL Flight Recorder dumps read into a recording, and
the answers on them (steps, explain with the device's timeline), checked against the files themselves
(public traces of real GPU jobs and traces made here; tests/fixtures/traces/README.md)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest
from conftest import ROOT, run_recorder

from store.db import open_store
from store.report.build import explain
from store.report.listing import steps
from store.traces import TraceError, import_files, read_file

TRACES = ROOT / "tests" / "fixtures" / "traces"
RANK0 = TRACES / "hta_sampled_rank0.json.gz"
RANK1 = TRACES / "hta_sampled_rank1.json.gz"
ROCM = TRACES / "hta_mi250_rocm.json.gz"
NO_STEPS = TRACES / "hta_simple_add.json.gz"
CPU = TRACES / "cpu_with_stack.pt.trace.json.gz"
DUMPS = sorted(TRACES.glob("nccl_trace_rank_*"))


def raw_events(path: Path) -> list[dict]:
    return json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)["traceEvents"]


def to_ns(v) -> int:
    return int(Decimal(v) * 1000)


def expected_busy(path: Path, step: int) -> tuple[float, list[str]]:
    """The step's device busy share and its kernels by total time, worked out from the JSON directly."""
    ev = raw_events(path)
    st = next(e for e in ev if e.get("cat") == "user_annotation" and e["name"] == f"ProfilerStep#{step}")
    a, b = to_ns(st["ts"]), to_ns(st["ts"]) + to_ns(st["dur"])
    spans, kernels = [], {}
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            x, y = max(a, to_ns(e["ts"])), min(b, to_ns(e["ts"]) + to_ns(e["dur"]))
            if y > x:
                spans.append((x, y))
                if e["cat"] == "kernel":
                    kernels[e["name"]] = kernels.get(e["name"], 0) + y - x
    busy, end = 0, a
    for x, y in sorted(spans):
        x = max(x, end)
        if y > x:
            busy += y - x
            end = y
    return round(100 * busy / (b - a), 1), sorted(kernels, key=lambda k: -kernels[k])


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("import") / "job.db"
    import_files(db, [RANK0, RANK1, ROCM, NO_STEPS, CPU])
    return db


def session_of(db: Path, path: Path) -> int:
    with open_store(db, readonly=True) as store:
        return store.row("SELECT session_id FROM trace_import WHERE path = ?", (str(path),))["session_id"]


def test_steps_are_the_hosts_profiler_steps(job):
    with open_store(job, readonly=True) as store:
        listed = steps(store, session_of(job, RANK0))
    ev = raw_events(RANK0)
    want = {int(e["name"].split("#")[1]): to_ns(e["dur"]) for e in ev
            if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")}
    assert {s["step"]: s["dur_ns"] for s in listed["steps"]} == want == {551: 607312000, 552: 622928000}
    assert all(s["pid"] == 4037 and s["complete"] and not s["inferred"] for s in listed["steps"])


def test_explain_step_gives_busy_share_top_kernels_and_the_host_while_idle(job):
    sid = session_of(job, RANK0)
    with open_store(job, readonly=True) as store:
        report = explain(store, sid, step=551)
    gpu = report["gpu"]
    busy, kernels = expected_busy(RANK0, 551)
    assert gpu["busy_pct"] == busy and 0 < busy < 80
    names = [k["name"] for k in gpu["top_kernels"]]
    assert names == kernels[:len(names)] and names[0].startswith("ncclKernel_SendRecv")
    assert [k["dur_ns"] for k in gpu["top_kernels"]] == sorted((k["dur_ns"] for k in gpu["top_kernels"]), reverse=True)
    assert gpu["bound"] == "host" and gpu["devices"][0]["device"] == 0
    assert gpu["idle_ns"] == report["window"]["dur_ns"] - gpu["devices"][0]["busy_ns"]
    # the host's share: innermost ops of the step's thread; the backward annotation holds the most
    assert gpu["host_idle"][0]["name"] == "## backward ##"
    assert sum(h["dur_ns"] for h in gpu["host_idle"]) <= gpu["idle_ns"]
    assert "device busy" in report["symptom"] and "bound by the host" in report["symptom"]
    assert report["observed_layers"] == ["profiler"]


def test_rocm_trace_reads_hip_calls_and_devices(job):
    sid = session_of(job, ROCM)
    with open_store(job, readonly=True) as store:
        imported = store.row("SELECT runtime, rank FROM trace_import WHERE session_id = ?", (sid,))
        linked = store.row("SELECT count(*) AS n, count(launch_op_id) AS linked FROM device_activity"
                           " WHERE session_id = ? AND kind IN ('kernel', 'memcpy')", (sid,))
        report = explain(store, sid, step=1)
    assert imported == {"runtime": "rocm", "rank": None}
    assert linked["n"] == 16 and linked["linked"] == 16  # every kernel and copy found its hip* launch
    busy, _ = expected_busy(ROCM, 1)
    assert report["gpu"]["busy_pct"] == busy and report["gpu"]["devices"][0]["device"] == 2


def test_cpu_trace_python_functions_and_host_names(job):
    sid = session_of(job, CPU)
    with open_store(job, readonly=True) as store:
        kinds = {r["kind"]: r["n"] for r in store.query(
            "SELECT kind, count(*) AS n FROM host_op WHERE session_id = ? GROUP BY kind", (sid,))}
        listed = steps(store, sid)["steps"]
        report = explain(store, sid, step=3)
    assert kinds["python_function"] > 100 and kinds["cpu_op"] > 100
    assert [s["step"] for s in listed] == [2, 3, 4, 5]
    assert next(s for s in listed if s["step"] == 3)["dur_ns"] > 30_000_000  # its 30 ms sleep
    assert report["session"]["host"] == json.loads(gzip.decompress(CPU.read_bytes()))["host_name"]
    assert report["gpu"] is None  # a CPU-only trace has no device timeline, and says nothing of one


def test_a_trace_without_profiler_steps_imports_without_steps(job):
    sid = session_of(job, NO_STEPS)
    with open_store(job, readonly=True) as store:
        assert steps(store, sid)["steps"] == []
        kinds = {r["kind"] for r in store.query("SELECT DISTINCT kind FROM device_activity WHERE session_id = ?",
                                                 (sid,))}
        report = explain(store, sid)
    assert kinds == {"kernel", "memcpy", "memset", "sync"}
    assert report["mode"] == "call" and report["symptom"].startswith("no ProfilerStep#N to explain step by step")
    total: dict[str, int] = {}
    for e in raw_events(NO_STEPS):
        if e.get("cat") == "kernel":
            total[e["name"]] = total.get(e["name"], 0) + to_ns(e["dur"])
    assert [k["name"] for k in report["gpu"]["top_kernels"]] == sorted(total, key=lambda k: -total[k])[:5]


def test_ns_timestamps_are_kept_exactly(tmp_path):
    trace = {"baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1,
         "ts": 4203669603187.439, "dur": 9288.291},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 4203669603188.001, "dur": 1.5,
         "args": {"device": 0, "stream": 7, "correlation": 5}}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    t = read_file(path).content
    assert t.host[0].ts == 4203669603187439 and t.host[0].dur == 9288291
    assert t.device[0].ts == 4203669603188001 and t.device[0].dur == 1500


def sessions(db: Path) -> int:
    return sqlite3.connect(db).execute("SELECT count(*) FROM session").fetchone()[0]


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(RANK0.read_bytes()[:40000]), ["truncated or damaged gzip"]),
    (lambda p: p.write_text('{"traceEvents": [{"ph": "X", "ts": 1, "dur"'), ["truncated"]),
    (lambda p: p.write_text('{"name": "not a trace"}'), ["not a PyTorch profiler trace"]),
    (lambda p: p.write_text("[1, 2, 3]"), ["not a PyTorch profiler trace"]),
    (lambda p: p.write_bytes(b"\x00\x01binary"), ["not valid JSON"]),
    (lambda p: p.write_text(""), ["empty"]),
    (lambda p: p.write_bytes(pickle.dumps({"entries": "x", "pg_config": {}})), ["not a Flight Recorder dump"]),
])
def test_bad_files_get_one_line_and_leave_the_database_as_it_was(tmp_path, make, words):
    bad = tmp_path / "bad.json"
    make(bad)
    db = tmp_path / "job.db"
    import_files(db, [ROCM])
    before = db.read_bytes()
    with pytest.raises(TraceError) as err:
        import_files(db, [NO_STEPS, bad])
    message = str(err.value)
    assert "\n" not in message and str(bad) in message and all(w in message for w in words), message
    assert sessions(db) == 1 and db.read_bytes() == before  # the good file before it was not written either
    fresh = tmp_path / "fresh.db"
    with pytest.raises(TraceError):
        import_files(fresh, [ROCM, bad])
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "job.db"]


def test_cli_bad_file_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(RANK0.read_bytes()[:40000])
    result = run_recorder("import", str(bad), "--db", str(tmp_path / "job.db"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"recorder: {bad}: truncated")
    assert not (tmp_path / "job.db").exists()


def test_a_pickle_that_names_a_class_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "nccl_trace_rank_0"
    bad.write_bytes(pickle.dumps({"version": "2.8", "pg_config": {}, "entries": [Evil()]}))
    with pytest.raises(TraceError, match="not a Flight Recorder dump.*nothing was run"):
        read_file(bad)
    assert not marker.exists()


def test_the_same_file_twice_is_refused(tmp_path):
    db = tmp_path / "job.db"
    import_files(db, [ROCM])
    with pytest.raises(Exception, match="already imported into .* as session 1"):
        import_files(db, [ROCM])
    with pytest.raises(Exception, match="same content"):
        import_files(tmp_path / "other.db", [ROCM, ROCM])


def test_cli_import_then_explain_step_json(tmp_path):
    db = tmp_path / "job.db"
    out = run_recorder("import", str(RANK0), "--db", str(db), check=True)
    assert "session 1:" in out.stdout and "steps 551..552" in out.stdout and "rank 0 of 128" in out.stdout
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", "552", "--json", check=True).stdout)
    busy, kernels = expected_busy(RANK0, 552)
    assert report["gpu"]["busy_pct"] == busy
    assert report["gpu"]["top_kernels"][0]["name"] == kernels[0]
    text = run_recorder("explain", "--db", str(db), "--step", "552", check=True).stdout
    assert f"device 0 busy {busy}%" in text and "Top kernels: " in text and "the host was in: " in text
    listed = json.loads(run_recorder("steps", "--db", str(db), "--json", check=True).stdout)
    assert [(s["step"], s["dur_ns"]) for s in listed["steps"]] == [(551, 607312000), (552, 622928000)]


def test_cluster_explain_names_the_rank_whose_collective_kernels_started_last(tmp_path):
    db = tmp_path / "job.db"
    import_files(db, [RANK0, RANK1])
    # the first NCCL kernel of step 551 on each rank, from the files themselves
    first = {}
    for rank, path in ((0, RANK0), (1, RANK1)):
        ev = raw_events(path)
        st = next(e for e in ev if e.get("name") == "ProfilerStep#551" and e.get("cat") == "user_annotation")
        a, b = to_ns(st["ts"]), to_ns(st["ts"]) + to_ns(st["dur"])
        first[rank] = min(to_ns(e["ts"]) for e in ev if e.get("cat") == "kernel" and "nccl" in e["name"].lower()
                          and a <= to_ns(e["ts"]) < b)
    late = max(first, key=first.get)
    result = run_recorder("cluster", "explain", str(db), "--step", "551", "--json", check=True)
    r = json.loads(result.stdout)
    assert r["mode"] == "device" and r["verdict"] == "late_rank" and r["late_rank"]["rank"] == late == 1
    assert r["late_rank"]["first_collective_late_ns"] == first[1] - first[0]
    assert "device busy" in r["explanation"]["symptom"]
    text = run_recorder("cluster", "explain", str(db), "--step", "551", check=True).stdout
    assert "Late rank: 1 " in text
    listed = json.loads(run_recorder("cluster", "steps", str(db), "--json", check=True).stdout)
    per_step = {s["step"]: s["late_rank"] for s in listed["steps"]}
    second = json.loads(run_recorder("cluster", "explain", str(db), "--step", "552", "--json", check=True).stdout)
    assert per_step == {551: 1, 552: second["late_rank"]["rank"]}


def fr_entry(seq: int, state: str, pg: str = "0", name: str = "all_reduce") -> dict:
    t = 1_790_000_000_000_000_000 + seq * 1_000_000
    return {"record_id": seq, "process_group": (pg, "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": f"nccl:{name}", "time_created_ns": t, "state": state,
            "time_discovered_started_ns": t + 10 if state != "scheduled" else None,
            "time_discovered_completed_ns": t + 20 if state == "completed" else None, "timeout_ms": 600000,
            "input_sizes": [[4]], "output_sizes": [[4]], "frames": []}


def test_flight_recorder_explain_names_the_rank_that_never_entered(tmp_path):
    db = tmp_path / "hang.db"
    run_recorder("import", *map(str, DUMPS), "--db", str(db), check=True)
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    hang = report["hang"]
    main = next(c for c in hang["collectives"] if c["api"] == "nccl:all_reduce")
    assert main["inside_ranks"] == [0, 1, 3] and main["missing_ranks"] == [2]
    assert main["missing"][0]["doing"].startswith("never entered it: its last is nccl:all_reduce #6, completed")
    sub = next(c for c in hang["collectives"] if c["api"] == "nccl:broadcast")
    assert sub["inside_ranks"] == [0] and sub["missing_ranks"] == [1] and "never started" in sub["missing"][0]["doing"]
    assert "rank 2 never entered nccl:all_reduce #7 (process group 0), which ranks 0, 1, 3 wait in" in hang["summary"]
    text = run_recorder("explain", "--db", str(db), check=True).stdout
    assert "Hang: Flight Recorder dumps of 4 ranks" in text
    cluster = json.loads(run_recorder("cluster", "explain", str(db), "--json", check=True).stdout)
    assert cluster["mode"] == "flight_recorder" and cluster["summary"] == hang["summary"]


def test_flight_recorder_a_rank_that_never_finished(tmp_path):
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    paths = []
    for rank in range(3):
        entries = [fr_entry(s, "completed") for s in range(1, 7)]
        # ranks 0 and 2 finished all_reduce 7 and wait in 8; rank 1 is still inside 7
        entries += [fr_entry(7, "started")] if rank == 1 else [fr_entry(7, "completed"), fr_entry(8, "started")]
        path = tmp_path / f"nccl_trace_rank_{rank}.json"
        path.write_text(json.dumps({"version": "2.8", "pg_config": config, "entries": entries}))  # the JSON form
        paths.append(path)
    db = tmp_path / "hang.db"
    import_files(db, paths)
    with open_store(db, readonly=True) as store:
        hang = explain(store, 1)["hang"]
    c = hang["collectives"][0]
    assert c["inside_ranks"] == [0, 2] and c["missing_ranks"] == [1]
    assert c["missing"][0]["doing"] == "never finished nccl:all_reduce #7 (started)"


def test_perfetto_export_shows_the_device_rows_and_their_launches(job, tmp_path):
    from test_export_perfetto import read_trace

    sid = session_of(job, RANK0)
    out = tmp_path / "step.pftrace"
    run_recorder("export", "--db", str(job), "--session", str(sid), "--step", "551", "--perfetto", str(out),
                 check=True)
    t = read_trace(out)
    device_tracks = {u for u, d in t["tracks"].items() if d.name.startswith("device 0 stream")}
    on_device = [s for s in t["slices"] if s["track"] in device_tracks]
    with open_store(job, readonly=True) as store:
        st = store.row("SELECT ts, end_ts FROM step WHERE session_id = ? AND step = 551", (sid,))
        want = store.row("SELECT count(*) AS n, count(launch_op_id) AS launched FROM device_activity"
                         " WHERE session_id = ? AND ts < ? AND ts + dur > ?", (sid, st["end_ts"], st["ts"]))
    assert len(on_device) == want["n"] > 500
    launched = [f for f, (src, dst) in t["flows"].items() if dst["track"] in device_tracks]
    assert len(launched) == want["launched"]
    assert {t["flows"][f][0]["name"] for f in launched} <= {"cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync",
                                                           "cudaLaunchKernelExC", "cudaMemcpy", "cudaStreamSynchronize",
                                                           "cudaEventSynchronize", "cudaDeviceSynchronize"}
    assert any(s["name"] == "ProfilerStep#551" or s["name"] == "step 551" for s in t["slices"])


def test_mcp_device_timeline_is_the_reports_device_part(job):
    from test_mcp_server import call_all

    from mcp_server.server import build_server

    sid = session_of(job, RANK0)
    _, results, _, _ = call_all(build_server(job), [("device_timeline", {"session_id": sid, "step": 551})])
    out = results["device_timeline"].structured_content
    with open_store(job, readonly=True) as store:
        gpu = explain(store, sid, step=551)["gpu"]
    assert out["busy_pct"] == gpu["busy_pct"] and out["bound"] == {"untrusted_text": "host"}  # marked as data
    assert [k["dur_ns"] for k in out["top_kernels"]] == [k["dur_ns"] for k in gpu["top_kernels"]]
    assert out["imported_from"][0]["rank"] == 0


def trace_of_recording(db: Path, path: Path, skew_ns: int, pid_shift: int = 0) -> None:
    """A profiler trace of the recorded process as Kineto would write it: each recorded
    cudaLaunchKernel is a runtime call (a few us off, as two probes of one call are) launching a 200 us
    kernel; the trace's realtime clock reads `skew_ns` ahead of the recording's."""
    with open_store(db, readonly=True) as store:
        sess = store.row("SELECT wall_offset_ns FROM session ORDER BY id DESC LIMIT 1")
        calls = store.query("SELECT c.ts, c.dur, a.name, t.tid, p.pid FROM cuda_call c"
                            " JOIN cuda_api a ON a.id = c.api_id JOIN thread t ON t.id = c.thread_id"
                            " JOIN process p ON p.id = t.process_id ORDER BY c.ts")
    events = []
    for i, c in enumerate(calls):
        jitter = (i * 7919) % 7 - 3  # us: -3..3
        ts = c["ts"] + jitter * 1000
        pid, tid = c["pid"] + pid_shift, c["tid"] + pid_shift
        events.append({"ph": "X", "cat": "cuda_runtime", "name": c["name"], "pid": pid, "tid": tid,
                       "ts": f"{ts // 1000}.{ts % 1000:03d}", "dur": c["dur"] / 1000, "args": {"correlation": i}})
        if c["name"] == "cudaLaunchKernel":
            k = c["ts"] + 5000
            events.append({"ph": "X", "cat": "kernel", "name": "sgemm", "pid": 0, "tid": 7,
                           "ts": f"{k // 1000}.{k % 1000:03d}", "dur": 200,
                           "args": {"device": 0, "stream": 7, "correlation": i}})
    text = json.dumps({"baseTimeNanoseconds": sess["wall_offset_ns"] + skew_ns, "traceEvents": events})
    path.write_text(text.replace('"ts": "', '"ts": ').replace('", "dur"', ', "dur"'))  # ts as JSON numbers


def test_join_aligns_the_trace_on_the_recorded_runtime_calls(tmp_path):
    from recorder.demo import write_scenario

    db = tmp_path / "run.db"
    write_scenario("cpu-contention", db)
    trace = tmp_path / "rank0.pt.trace.json"
    trace_of_recording(db, trace, skew_ns=3_700_000)
    out = json.loads(run_recorder("import", str(trace), "--db", str(db), "--join", "--json", check=True).stdout)[0]
    j = out["join"]
    assert j["aligned"] and out["session_id"] == j["session_id"] == 1
    assert abs(j["clock_offset_ns"]) <= 3000 and j["matches"] == j["candidates"] > 1000
    with open_store(db, readonly=True) as store:
        st = store.row("SELECT step, ts, end_ts FROM step WHERE session_id = 1 ORDER BY dur DESC LIMIT 1")
        kernels = store.query("SELECT ts, dur FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
                              " WHERE a.name = 'cudaLaunchKernel' AND c.ts + 5000 < ? AND c.ts + 205000 > ?",
                              (st["end_ts"], st["ts"]))
        report = explain(store, 1, step=st["step"])
    spans = sorted((max(k["ts"] + 5000 + j["clock_offset_ns"], st["ts"]),
                    min(k["ts"] + 205000 + j["clock_offset_ns"], st["end_ts"])) for k in kernels)
    busy, end = 0, st["ts"]
    for x, y in spans:
        x = max(x, end)
        if y > x:
            busy, end = busy + y - x, y
    assert report["gpu"]["busy_pct"] == round(100 * busy / (st["end_ts"] - st["ts"]), 1)
    assert report["gpu"]["top_kernels"][0]["name"] == "sgemm"
    assert "profiler" in report["observed_layers"] and "sched" in report["observed_layers"]
    assert report["session"]["joined"][0].startswith(f"{trace}: aligned on ")
    assert report["primary_cause"]["kind"] == "cpu_contention"  # the recorder's own answer is kept


def test_join_of_another_process_says_no_alignment_was_possible(tmp_path):
    from recorder.demo import write_scenario

    db = tmp_path / "run.db"
    write_scenario("cpu-contention", db)
    trace = tmp_path / "other.pt.trace.json"
    trace_of_recording(db, trace, skew_ns=0, pid_shift=17)
    out = import_files(db, [trace], join=True)[0]
    assert not out["join"]["aligned"] and out["session_id"] == 2
    text = run_recorder("explain", "--db", str(db), "--session", "1", check=True).stdout
    assert f"Joined: {trace}: no alignment was possible" in text
    assert "another process, or pids seen through another pid namespace" in text


def test_html_report_has_the_device_section_and_lanes(job, tmp_path):
    sid = session_of(job, RANK0)
    out = tmp_path / "step.html"
    run_recorder("report", "--db", str(job), "--session", str(sid), "--step", "551", "--html", str(out), check=True)
    page = out.read_text()
    assert "<h2>The device (profiler trace)</h2>" in page and "bound by the host" in page
    assert "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t" in page and "## backward ##" in page
    assert "device 0 kernels" in page  # the timeline's lane for the device


def test_idle_time_goes_to_the_innermost_op_and_python_line(tmp_path):
    """A hand-made 100 us step: a kernel runs 10..30; the thread is in train.py(12): load from 30 to 80
    (in it, aten::copy_ 40..60) and in train.py(20): step 80..95; 0..10 and 95..100 in no op."""
    def op(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 9, "tid": 9, "ts": ts, "dur": dur, "args": args}

    events = [op("user_annotation", "ProfilerStep#3", 0, 100),
              op("cuda_runtime", "cudaLaunchKernel", 5, 3, correlation=1),
              op("python_function", "train.py(12): load", 30, 50), op("cpu_op", "aten::copy_", 40, 20),
              op("python_function", "train.py(20): step", 80, 15),
              {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 20,
               "args": {"device": 0, "stream": 7, "correlation": 1}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    db = tmp_path / "t.db"
    import_files(db, [path])
    with open_store(db, readonly=True) as store:
        gpu = explain(store, 1, step=3)["gpu"]
        launched = store.row("SELECT name, launch_api, queued_dur FROM device_activity_detail")
    assert launched == {"name": "k", "launch_api": "cudaLaunchKernel", "queued_dur": 2_000}  # launch returned at 8
    assert gpu["busy_pct"] == 20.0 and gpu["idle_ns"] == 80_000 and gpu["bound"] == "host"
    assert [(h["name"], h["dur_ns"]) for h in gpu["host_idle"]] == [
        ("train.py(12): load", 30_000), ("aten::copy_", 20_000), ("train.py(20): step", 15_000),
        ("(between ops)", 12_000), ("cudaLaunchKernel", 3_000)]
    assert [(h["name"], h["dur_ns"]) for h in gpu["python_idle"]] == [
        ("train.py(12): load", 50_000), ("train.py(20): step", 15_000), ("(between ops)", 15_000)]
    from store.report.html import build_html

    with open_store(db, readonly=True) as store:
        page, _ = build_html(store, 1, step_number=3)
    assert "<p>By Python line:</p>" in page and "<td>train.py(12): load</td><td>0.05 ms</td>" in page
