"""recorder export --perfetto: the trace read back with Perfetto's own protos, checked row by row
against the recording it came from (synthetic demo recordings in real SQLite files)."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import q, run_recorder
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from recorder.demo import SCENARIOS, write_scenario

TE = pb.TrackEvent


def read_trace(path: Path) -> dict:
    """Tracks, slices (rebuilt from begin/end pairs), instants, counters and flows of a trace."""
    trace = pb.Trace()
    trace.ParseFromString(path.read_bytes())
    assert trace.packet[0].sequence_flags == pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    tracks: dict[int, pb.TrackDescriptor] = {}
    open_: dict[int, list[dict]] = defaultdict(list)
    slices: list[dict] = []
    counters: dict[int, list[tuple[int, float]]] = defaultdict(list)
    last_ts = 0
    for p in trace.packet:
        assert p.trusted_packet_sequence_id == 1
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
            continue
        e = p.track_event
        assert e.track_uuid in tracks, "an event on a track not described first"
        assert p.timestamp >= last_ts, "packets out of order"
        last_ts = p.timestamp
        if e.type == TE.TYPE_COUNTER:
            counters[e.track_uuid].append((p.timestamp, e.counter_value or e.double_counter_value))
            continue
        args = {}
        for a in e.debug_annotations:
            args[a.name] = a.string_value if a.HasField("string_value") else (
                a.int_value if a.HasField("int_value") else a.bool_value)
        s = {"track": e.track_uuid, "ts": p.timestamp, "name": e.name, "args": args, "dur": 0,
             "flows": list(e.flow_ids), "ends": list(e.terminating_flow_ids), "depth": 0}
        if e.type == TE.TYPE_SLICE_BEGIN:
            s["depth"] = len(open_[e.track_uuid])
            open_[e.track_uuid].append(s)
        elif e.type == TE.TYPE_SLICE_END:
            assert open_[e.track_uuid], "a slice end with no slice open on its track"
            b = open_[e.track_uuid].pop()
            b["dur"] = p.timestamp - b["ts"]
            slices.append(b)
        else:
            assert e.type == TE.TYPE_INSTANT
            slices.append(s)
    assert not any(open_.values()), "slices left open at the end"
    by_row = {s["args"]["row"]: s for s in slices if "row" in s["args"]}
    flow_src = {f: s for s in slices for f in s["flows"]}
    flow_dst = {f: s for s in slices for f in s["ends"]}
    assert set(flow_src) == set(flow_dst), "a flow without both ends"
    return {"tracks": tracks, "slices": slices, "counters": counters, "by_row": by_row,
            "flows": {f: (flow_src[f], flow_dst[f]) for f in flow_src}}


def thread_track(t: dict, tid: int) -> int:
    return next(u for u, d in t["tracks"].items() if d.HasField("thread") and d.thread.tid == tid)


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("demos")
    dbs = {}
    for name in ("cpu-contention", "nccl-straggler", "nvme-timeout-checkpoint", "oom-reclaim"):
        write_scenario(name, folder / f"{name}.db")
        dbs[name] = folder / f"{name}.db"
    return dbs


def export(db: Path, out: Path, *extra: str) -> dict:
    r = run_recorder("export", "--db", str(db), "--perfetto", str(out), "--json", *extra, check=True)
    return json.loads(r.stdout)[0]


def test_whole_session_tracks_slices_counters_flows(demos, tmp_path):
    db = demos["cpu-contention"]
    out = tmp_path / "t.pftrace"
    summary = export(db, out)
    t = read_trace(out)

    # a process track per process, a thread track per thread with events, under the right pid
    procs = {d.process.pid: d.process.process_name for d in t["tracks"].values() if d.HasField("process")}
    assert procs == dict(q(db, "SELECT pid, name FROM process"))
    for tid, pid in q(db, "SELECT tid, pid FROM thread_info WHERE thread_id IN "
                          "(SELECT thread_id FROM cuda_call UNION SELECT thread_id FROM offcpu_interval)"):
        assert t["tracks"][thread_track(t, tid)].thread.pid == pid

    # every CUDA call, off-CPU interval, step and block request is a slice with its time and thread
    checks = {
        "cuda_call": "SELECT c.id, c.ts, c.dur, t.tid, a.name FROM cuda_call c JOIN thread t ON t.id = c.thread_id"
                     " JOIN cuda_api a ON a.id = c.api_id",
        "offcpu_interval": "SELECT o.id, o.ts, o.dur, t.tid, 'off-CPU: ' || v.reason FROM offcpu_interval o"
                           " JOIN thread t ON t.id = o.thread_id JOIN offcpu v ON v.id = o.id",
        "step_mark": "SELECT s.step_mark_id, s.ts, s.dur, t.tid, 'step ' || s.step FROM step_all s"
                     " JOIN thread t ON t.id = s.thread_id",
    }
    for table, sql in checks.items():
        rows = q(db, sql)
        assert rows, table
        for rid, ts, dur, tid, name in rows:
            s = t["by_row"][f"{table} {rid}"]
            assert (s["ts"], s["dur"], s["track"]) == (ts, dur, thread_track(t, tid)), (table, rid)
            assert s["name"].startswith(name)
    # the Python call site of each row captured with a stack
    sites = q(db, "SELECT cuda_call_id, python_line FROM cuda_call_python WHERE python_line NOT LIKE '<%'")
    assert sites and all(t["by_row"][f"cuda_call {i}"]["args"]["python"] == line for i, line in sites)
    blocked = q(db, "SELECT o.id, p.call_site FROM offcpu_interval o JOIN python_stack_text p"
                    " ON p.stack_id = o.python_stack_id WHERE p.call_site IS NOT NULL")
    assert blocked and all(t["by_row"][f"offcpu_interval {i}"]["args"]["python"] == site for i, site in blocked)
    stalls = {r[0] for r in q(db, "SELECT step_mark_id FROM stall")}
    assert stalls and all(t["by_row"][f"step_mark {i}"]["name"].endswith("(stall)") for i in stalls)
    reasons = {s["args"]["reason"] for s in t["slices"] if s["name"].startswith("off-CPU")}
    assert reasons == {r[0] for r in q(db, "SELECT DISTINCT reason FROM offcpu")}

    for rid, ts, dur, issue, device, op in q(db, "SELECT id, ts, dur, issue_ts, device, op FROM block_request"):
        s = t["by_row"][f"block_request {rid}"]
        assert (s["ts"], s["dur"]) == (ts, dur) and s["name"].startswith(op)
        assert t["tracks"][s["track"]].name.split(" (")[0] == device
        stages = [x for x in t["slices"] if x["track"] == s["track"] and x["depth"] == 1
                  and ts <= x["ts"] < ts + dur]
        assert [(x["name"], x["ts"], x["dur"]) for x in stages] == [
            ("queued", ts, issue - ts), ("on device", issue, ts + dur - issue)]

    # queue depth: the counter's peak is the most requests in flight at once, by SQL
    (peak,) = q(db, "SELECT max(n) FROM (SELECT (SELECT count(*) FROM block_request b WHERE b.ts <= a.ts"
                    " AND b.ts + b.dur > a.ts) AS n FROM block_request a)")[0]
    depth_tracks = [u for u, d in t["tracks"].items() if d.name.endswith("queue depth")]
    assert depth_tracks and max(v for u in depth_tracks for _, v in t["counters"][u]) == peak
    assert all(t["counters"][u][-1][1] == 0 for u in depth_tracks)  # every request completed

    # a flow for every causal_link row, from the row's slice to the explaining row's slice
    links = q(db, "SELECT from_table, from_id, relation, to_table, to_id FROM causal_link")
    assert summary["flows"] == len(links) == len(t["flows"]) and summary["links_outside"] == 0
    got = set()
    for src, dst in t["flows"].values():
        if "row" in dst["args"]:
            got.add((src["args"]["row"], dst["args"]["row"]))
        else:  # the task the thread waited behind: a slice on that task's own thread track
            got.add((src["args"]["row"], f"thread {dst['args']['offcpu_interval']}"))
    want = set()
    for ft, fid, _, tt, tid in links:
        want.add((f"{ft} {fid}", f"{tt} {tid}" if tt != "thread" else f"thread {fid}"))
    assert got == want
    # the slice an arrow ends on says which relation of which row it explains
    for ft, fid, rel, tt, tid in links[:200]:
        if tt != "thread":
            assert f"{rel} of {ft} {fid}" in t["by_row"][f"{tt} {tid}"]["args"]["explains"].split("; ")
    contender = {r[0] for r in q(db, "SELECT t.tid FROM offcpu_interval o JOIN thread t"
                                     " ON t.id = o.contender_thread_id")}
    behind = [dst for src, dst in t["flows"].values() if "offcpu_interval" in dst["args"]]
    assert behind
    assert {t["tracks"][d["track"]].parent_uuid for d in behind} == {
        u for u, d in t["tracks"].items() if d.HasField("process") and d.process.pid in contender}


def test_straggler_flow_crosses_ranks(demos, tmp_path):
    db = demos["nccl-straggler"]
    out = tmp_path / "s.pftrace"
    export(db, out)
    t = read_trace(out)
    waits = [(s, d) for s, d in t["flows"].values()
             if s["args"].get("row", "").startswith("nccl_call") and d["args"].get("row", "").startswith("nccl_call")]
    rows = q(db, "SELECT from_id, to_id FROM causal_link WHERE relation = 'waited_for_rank'")
    assert rows and len(waits) == len(rows)
    for s, d in waits:
        # the waiting rank's collective and the straggler's are on different processes' threads
        assert t["tracks"][s["track"]].thread.pid != t["tracks"][d["track"]].thread.pid
        assert s["args"]["rank"] != d["args"]["rank"]


def test_kernel_log_device_events_lineage_checkpoint(demos, tmp_path):
    db = demos["nvme-timeout-checkpoint"]
    out = tmp_path / "n.pftrace"
    export(db, out)
    t = read_trace(out)
    klog = next(u for u, d in t["tracks"].items() if d.name == "kernel log")
    lines = [s for s in t["slices"] if s["track"] == klog]
    assert sorted((s["ts"], s["args"]["text"]) for s in lines) == sorted(q(db, "SELECT ts, text FROM kernel_log"))
    # the request -> NVMe reset link lands on an instant on the controller's track
    hit = [(s, d) for s, d in t["flows"].values() if d["args"].get("row", "").startswith("nvme_event")
           and s["args"]["row"].startswith("block_request")]
    assert len(hit) == q(db, "SELECT count(*) FROM causal_link WHERE relation = 'hit_by'")[0][0] > 0
    assert {t["tracks"][d["track"]].name for _, d in hit} == {r[0] for r in q(db, "SELECT controller FROM nvme_event")}
    assert all(d["dur"] == 0 for _, d in hit)
    names = {d.name for d in t["tracks"].values()}
    assert any(n.endswith(": lineage") for n in names) and any(n.endswith(": checkpoint") for n in names)
    ck = [s for s in t["slices"] if s["name"].startswith("checkpoint ")]
    marks = q(db, "SELECT ts, phase, path FROM checkpoint_mark ORDER BY ts")
    assert [(s["ts"], s["ts"] + s["dur"], s["args"]["path"]) for s in ck] == [
        (marks[0][0], marks[1][0], marks[0][2])]


def test_checkpoint_file_operations(demos, tmp_path):
    db = tmp_path / "ck.db"
    db.write_bytes(demos["nvme-timeout-checkpoint"].read_bytes())
    conn = sqlite3.connect(db)
    (start,) = conn.execute("SELECT ts FROM stall").fetchone()
    conn.execute("INSERT INTO checkpoint_file (id, session_id, ts, dur, thread_id, path, opted_by)"
                 " VALUES (1, 1, ?, 20000, 1, '/ckpt/run42/shard17.pt', 'marker_scope')", (start + 1000,))
    ops = [(start + 1000, 20000, "open"), (start + 5_000_000, 3_400_000_000, "fsync"),
           (start + 3_500_000_000, 10000, "close")]
    conn.executemany("INSERT INTO checkpoint_op (session_id, file_id, ts, dur, thread_id, op, fd, error)"
                     " VALUES (1, 1, ?, ?, 1, ?, 7, 0)", ops)
    conn.commit()
    conn.close()
    export(db, tmp_path / "ck.pftrace")
    t = read_trace(tmp_path / "ck.pftrace")
    (tid,) = q(db, "SELECT tid FROM thread WHERE id = 1")[0]
    got = sorted((s["ts"], s["dur"], s["name"], s["track"]) for r, s in t["by_row"].items()
                 if r.startswith("checkpoint_op "))
    assert [g[:3] for g in got] == [(ts, dur, f"{op} shard17.pt") for ts, dur, op in ops]
    # on the thread's track, or on one of its extra lanes where it overlaps without nesting
    lanes = {u for u, d in t["tracks"].items() if d.name.startswith(f"python3 {tid} (")}
    assert {g[3] for g in got} <= {thread_track(t, tid)} | lanes


def test_step_window_keeps_only_its_rows(demos, tmp_path):
    db = demos["oom-reclaim"]
    (step, a, b) = q(db, "SELECT step, ts, end_ts FROM stall")[0]
    out = tmp_path / "w.pftrace"
    summary = export(db, out, "--step", str(step))
    t = read_trace(out)
    steps = [s for s in t["slices"] if s["name"].startswith("step ")]
    assert [s["args"]["step"] for s in steps] == [step]
    calls = q(db, "SELECT id FROM cuda_call WHERE ts < ? AND ts + dur > ?", (b, a))
    assert calls and {r for r in t["by_row"] if r.startswith("cuda_call ")} == {f"cuda_call {i}" for i, in calls}
    reclaim = q(db, "SELECT id FROM causal_link l JOIN reclaim_interval r ON r.id = l.to_id"
                    " WHERE l.relation = 'reclaim' AND l.from_id = (SELECT step_mark_id FROM stall)")
    assert reclaim and all(f"reclaim_interval {i}" in t["by_row"] for i, in reclaim)
    inside = [r for r in q(db, "SELECT from_table, from_id, to_table, to_id FROM causal_link")
              if f"{r[0]} {r[1]}" in t["by_row"] and (r[2] == "thread" or f"{r[2]} {r[3]}" in t["by_row"])]
    assert summary["flows"] == len(t["flows"]) == len(inside) > 0 and summary["links_outside"] > 0


def test_gpu_counters(demos, tmp_path):
    db = tmp_path / "gpu.db"
    db.write_bytes(demos["cpu-contention"].read_bytes())
    conn = sqlite3.connect(db)
    (start,) = conn.execute("SELECT started_ts FROM session").fetchone()
    samples = [(start + i * 100_000_000, 0 if i % 5 == 0 else 90, i * 1 << 20) for i in range(20)]
    conn.executemany("INSERT INTO gpu_sample (session_id, ts, gpu_index, pci_address, util_gpu, mem_used_bytes)"
                     " VALUES (1, ?, 0, '0000:10:1c.0', ?, ?)", samples)
    conn.commit()
    conn.close()
    out = tmp_path / "g.pftrace"
    export(db, out)
    t = read_trace(out)
    util = next(u for u, d in t["tracks"].items() if d.name == "GPU 0 utilisation %")
    mem = next(u for u, d in t["tracks"].items() if d.name == "GPU 0 memory used")
    assert t["tracks"][mem].counter.unit == pb.CounterDescriptor.UNIT_SIZE_BYTES
    assert t["counters"][util] == [(ts, u) for ts, u, _ in samples]
    assert t["counters"][mem] == [(ts, m) for ts, _, m in samples]


def test_bad_input_says_what_to_do(demos, tmp_path):
    db = demos["oom-reclaim"]
    r = run_recorder("export", "--db", str(db), "--perfetto", str(tmp_path / "x.pftrace"), "--step", "99999")
    assert r.returncode == 2 and "no step 99999 in session 1: its steps run" in r.stderr
    r = run_recorder("export", "--db", str(db))
    assert r.returncode == 2
    assert "recorder export --perfetto FILE, --datasette-metadata FILE or --parquet DIR" in r.stderr
    r = run_recorder("export", "--db", str(db), "--perfetto", str(tmp_path / "x.pftrace"), "--window", "500..600")
    (span,) = q(db, "SELECT (stopped_ts - started_ts) / 1e9 FROM session")[0]
    assert r.returncode == 2 and f"nothing recorded in that window of session 1: it runs 0..{span:.1f} s" in r.stderr
    r = run_recorder("export", "--db", str(db), "--datasette-metadata", str(tmp_path / "m.json"), "--step", "3")
    assert r.returncode == 2 and "add --perfetto FILE" in r.stderr and not (tmp_path / "m.json").exists()
    r = run_recorder("export", "--db", str(db), "--perfetto", str(tmp_path / "no" / "x.pftrace"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_recorder("export", "--db", str(tmp_path / "none.db"), "--perfetto", str(tmp_path / "x.pftrace"))
    assert r.returncode == 2 and r.stderr.startswith("recorder: ")
    assert not (tmp_path / "x.pftrace").exists()


def test_session_choice(demos, tmp_path):
    db = tmp_path / "two.db"
    db.write_bytes(demos["cpu-contention"].read_bytes())
    assert write_scenario("oom-reclaim", db) == 2
    latest = export(db, tmp_path / "latest.pftrace")
    first = export(db, tmp_path / "first.pftrace", "--session", "1")
    assert (latest["session_id"], first["session_id"]) == (2, 1)
    for out, sid in ((tmp_path / "latest.pftrace", 2), (tmp_path / "first.pftrace", 1)):
        rows = {r for r in read_trace(out)["by_row"] if r.startswith("cuda_call ")}
        assert rows == {f"cuda_call {i}" for i, in q(db, "SELECT id FROM cuda_call WHERE session_id = ?", (sid,))}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_demo_scenario(name, tmp_path):
    """Each scenario's rows (its own device events, reclaim, retransmits...) make a well-formed trace
    with a flow for every causal link, and a page with the report."""
    db = tmp_path / "d.db"
    write_scenario(name, db)
    summary = export(db, tmp_path / "d.pftrace")
    t = read_trace(tmp_path / "d.pftrace")
    (links,) = q(db, "SELECT count(*) FROM causal_link")[0]
    assert summary["flows"] == len(t["flows"]) == links and summary["links_outside"] == 0
    for table in ("cuda_call", "offcpu_interval", "block_request", "kernel_log", "reclaim_interval",
                  "nvme_event", "dma_event", "tcp_retransmit", "oom_kill", "iommu_fault", "swiotlb_event"):
        ids = {f"{table} {i}" for i, in q(db, f"SELECT id FROM {table}")}
        assert ids <= set(t["by_row"]), table
    r = run_recorder("report", "--db", str(db), "--html", str(tmp_path / "d.html"), check=True)
    assert "wrote" in r.stdout and "<svg" in (tmp_path / "d.html").read_text()
