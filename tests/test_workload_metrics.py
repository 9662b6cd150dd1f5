"""The workload metrics (recorder/workload_metrics.py) from a recording written through the store,
read by the Prometheus client's own parser; and the /metrics endpoint (recorder/metrics_http.py):
loopback without a token, a token required where one is given, HTTPS and a token off loopback."""

from __future__ import annotations

import shutil
import sqlite3
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_harness import free_port, synthetic_rank

from recorder.core.inflight import CallInFlight
from recorder.core.layer import BaseLayer
from recorder.core.participant import SessionHandle
from recorder.metrics import render
from recorder.metrics_http import ListenOptions, MetricsListener
from recorder.workload_metrics import MAX_COLLECTIVES, WorkloadWatch
from store.db import Store
from store.db.rules import stall_rule
from store.errors import UserError

MS = 1_000_000


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


class _Collectives(BaseLayer):
    """A layer holding one NCCL call in flight, as the workload layer answers it from its map."""

    name = "workload"
    tables = ("nccl_call",)

    def in_flight(self) -> tuple[CallInFlight, ...]:
        return (CallInFlight("nccl_call", "ncclAllReduce", 4242, 4243, 1_000 * MS),)


class _Kernels(BaseLayer):
    """A layer of another table: the NCCL calls' reader never asks it."""

    name = "cuda"
    tables = ("cuda_call",)

    def in_flight(self) -> tuple[CallInFlight, ...]:
        raise AssertionError("the CUDA calls in flight were read for the NCCL ones")


def _watch(rec) -> WorkloadWatch:
    ro = sqlite3.connect(f"file:{rec.db}?mode=ro", uri=True)
    layers = [_Kernels(None), _Collectives(None)]  # type: ignore[arg-type]  # neither uses its context
    handle = SessionHandle(rec.db, rec.session_id, 0, None, layers)  # type: ignore[arg-type]  # writes nothing
    return WorkloadWatch(ro, rec.session_id, stall_rule(Store(rec.db, ro, True)), "node-07", 0,
                         in_flight=lambda: handle.in_flight("nccl_call"))


def test_steps_waits_lost_time_and_the_last_stall(tmp_path):
    rec = synthetic_rank(tmp_path / "r.db", rank=5, world=16, run_id="job-9")
    w = _watch(rec)
    c, sid, th = rec.conn, rec.session_id, rec.thread_id
    ts = 0
    for step in range(31):
        dur = 60 * MS if step == 25 else 10 * MS  # step 25 stalls: 40 ms preempted inside it
        c.execute("INSERT INTO step_mark (session_id, ts, thread_id, step) VALUES (?, ?, ?, ?)", (sid, ts, th, step))
        c.execute("INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, handle, stream, cgroup_id) "
                  "VALUES (?, ?, ?, ?, ?, 0, 77, 9, 0)", (sid, ts + dur - 4 * MS, 2 * MS, th, rec.allreduce))
        c.execute("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, stream, cgroup_id) "
                  "VALUES (?, ?, ?, ?, ?, 0, 9, 0)", (sid, ts + dur - 2 * MS + 1000, 1 * MS, th, rec.sync))
        if step == 25:
            c.execute("INSERT INTO offcpu_interval (session_id, ts, dur, thread_id, cpu, state, cgroup_id) "
                      "VALUES (?, ?, ?, ?, 0, 256, 0)", (sid, ts + 5 * MS, 40 * MS, th))
        ts += dur
    c.execute("INSERT INTO step_mark (session_id, ts, thread_id, step) VALUES (?, ?, ?, 31)", (sid, ts, th))
    c.commit()
    w.tick(ts + 10_000 * MS)  # later than the pairing's wait: every collective counted
    fams = _families(render(w.metrics()))
    identity = {"job_id": "job-9", "rank": "5", "local_rank": "5", "world_size": "16", "node": "node-07", "pod": ""}
    (steps,) = fams["stall_recorder_workload_steps"]
    assert steps.labels == identity and steps.value == 31
    assert fams["stall_recorder_workload_stalled_steps"][0].value == 1
    count = next(s for s in fams["stall_recorder_workload_step_seconds"] if s.name.endswith("_count"))
    assert count.value == 31
    (wait,) = fams["stall_recorder_workload_collective_wait_seconds"]
    assert wait.labels == {**identity, "comm": f"{12345:016x}", "op": "ncclAllReduce"}
    assert wait.value == pytest.approx(31 * 3e-3)  # the call and the synchronisation after it
    lost = {s.labels["cause_kind"]: s.value for s in fams["stall_recorder_workload_lost_seconds"]}
    assert lost == pytest.approx({"cpu_contention": 0.04, "nccl_wait": 31 * 3e-3})
    assert fams["stall_recorder_workload_last_stall_step"][0].value == 25
    assert fams["stall_recorder_workload_last_stall_info"][0].labels["cause_kind"] == "cpu_contention"
    assert fams["stall_recorder_workload_collective_in_flight_oldest_seconds"][0].value == pytest.approx(
        (ts + 10_000 * MS - 1_000 * MS) / 1e9)
    for samples in fams.values():  # no PID, no step number as a label
        assert all(not {"pid", "step", "tid"} & s.labels.keys() for s in samples)


def _api(rec, name: str) -> int:
    rec.conn.execute("INSERT OR IGNORE INTO cuda_api (name, family, library, arguments) VALUES (?, ?, 'runtime', '')",
                     (name, name))
    return rec.conn.execute("SELECT id FROM cuda_api WHERE name = ?", (name,)).fetchone()[0]


def _cuda(rec, ts: int, dur: int, api: int, stream: int = 9) -> None:
    rec.conn.execute("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, stream, cgroup_id) "
                     "VALUES (?, ?, ?, ?, ?, 0, ?, 0)", (rec.session_id, ts, dur, rec.thread_id, api, stream))


def test_a_rank_that_marks_no_steps_has_them_inferred_and_a_once_only_call_names_its_stall(tmp_path):
    """No recorder.step: the steps come from the period of the synchronising calls (one each 10 ms),
    as the flight recorder infers them; step 30 lasts 70 ms, 60 of them in the session's first
    cudaMalloc, which has no baseline of its own: it is the stall's cause and lost time."""
    rec = synthetic_rank(tmp_path / "r.db", rank=2, world=4, run_id="job-3")
    malloc = _api(rec, "cudaMalloc")
    w = _watch(rec)
    ts = 0
    for step in range(40):
        dur = 70 * MS if step == 30 else 10 * MS
        _cuda(rec, ts, 1 * MS, rec.sync)
        if step == 30:
            _cuda(rec, ts + 2 * MS, 60 * MS, malloc)
        ts += dur
    _cuda(rec, ts, 1 * MS, rec.sync)  # the last step's end
    rec.conn.commit()
    w.tick(ts + 10_000 * MS)
    fams = _families(render(w.metrics()))
    assert fams["stall_recorder_workload_steps"][0].value == 40
    assert fams["stall_recorder_workload_steps_inferred"][0].value == 1
    assert fams["stall_recorder_workload_stalled_steps"][0].value == 1
    count, total = (next(s.value for s in fams["stall_recorder_workload_step_seconds"] if s.name.endswith(end))
                    for end in ("_count", "_sum"))
    assert count == 40 and total == pytest.approx(39 * 0.01 + 0.07)
    lost = {s.labels["cause_kind"]: s.value for s in fams["stall_recorder_workload_lost_seconds"]}
    assert lost == pytest.approx({"slow_cuda_call": 0.06})
    assert fams["stall_recorder_workload_last_stall_info"][0].labels["cause_kind"] == "slow_cuda_call"
    assert fams["stall_recorder_workload_last_stall_timestamp_seconds"][0].value == pytest.approx(
        (30 * 10 + 70) * MS / 1e9)
    assert not fams.get("stall_recorder_workload_last_stall_step")  # an inferred step's number is the report's


def test_calls_slow_against_their_family_are_lost_time_and_a_collectives_sync_is_not(tmp_path):
    rec = synthetic_rank(tmp_path / "r.db")
    malloc = _api(rec, "cudaMalloc")
    w = _watch(rec)
    c, sid, th = rec.conn, rec.session_id, rec.thread_id
    c.execute("INSERT INTO step_mark (session_id, ts, thread_id, step) VALUES (?, 0, ?, 0)", (sid, th))
    for i in range(10):  # the family's baseline: 1 ms
        _cuda(rec, (1 + i) * MS, 1 * MS, malloc)
    c.commit()
    w.tick(1_000 * MS)
    _cuda(rec, 2_000 * MS, 30 * MS, malloc)    # slow: 29 ms past the baseline
    _cuda(rec, 2_100 * MS, 1_500_000, malloc)  # not twice the baseline: not slow
    c.execute("INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, handle, stream, cgroup_id) "
              "VALUES (?, ?, ?, ?, ?, 0, 77, 9, 0)", (sid, 2_200 * MS, 1 * MS, th, rec.allreduce))
    _cuda(rec, 2_202 * MS, 500 * MS, rec.sync)  # the collective's wait: nccl_wait, not a slow call
    c.commit()
    w.tick(10_000 * MS)
    samples = _families(render(w.metrics()))["stall_recorder_workload_lost_seconds"]
    lost = {s.labels["cause_kind"]: s.value for s in samples}
    assert lost == pytest.approx({"slow_cuda_call": 0.029, "nccl_wait": 0.501})


def test_communicators_past_the_bound_are_folded_and_counted(tmp_path):
    rec = synthetic_rank(tmp_path / "r.db")
    w = _watch(rec)
    c, sid, th = rec.conn, rec.session_id, rec.thread_id
    for i in range(MAX_COLLECTIVES + 4):
        c.execute("INSERT INTO nccl_comm (session_id, process_id, handle, comm_hash, rank, nranks, init_ts) "
                  "VALUES (?, ?, ?, ?, 3, 8, 0)", (sid, rec.process_id, 1000 + i, 5000 + i))
        c.execute("INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, handle, stream, cgroup_id) "
                  "VALUES (?, ?, ?, ?, ?, 0, ?, 9, 0)", (sid, i * MS, MS, th, rec.allreduce, 1000 + i))
    c.commit()
    w.tick(100_000 * MS)
    fams = _families(render(w.metrics()))
    waits = fams["stall_recorder_workload_collective_wait_seconds"]
    assert len(waits) == MAX_COLLECTIVES + 1
    assert {s.labels["comm"] for s in waits} >= {"other"}
    assert sum(s.value for s in waits) == pytest.approx((MAX_COLLECTIVES + 4) * 1e-3)
    folded = {s.labels["what"]: s.value for s in fams["stall_recorder_workload_series_folded"]}
    assert folded["collective"] == 4  # the collectives of the 4 pairs past the bound


def _get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_loopback_endpoint_serves_what_was_published(tmp_path):
    listener = MetricsListener(ListenOptions(f"127.0.0.1:{free_port()}"))
    listener.start()
    try:
        listener.publish("stall_recorder_up 1\n")
        status, kind, body = _get(listener.url)
        assert (status, body) == (200, "stall_recorder_up 1\n") and kind.startswith("text/plain; version=0.0.4")
        assert _get(listener.url.replace("/metrics", "/other"))[0] == 404
    finally:
        listener.close()


def test_a_token_is_required_where_given_and_off_loopback_with_tls(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    token.chmod(0o600)
    with pytest.raises(UserError, match="without a bearer token"):
        ListenOptions("0.0.0.0:9400").check()
    with pytest.raises(UserError, match="without TLS"):
        ListenOptions("0.0.0.0:9400", token_file=token).check()
    with pytest.raises(UserError, match="give HOST:PORT"):
        ListenOptions("9400").check()
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    assert ListenOptions("0.0.0.0:9400", token, cert, key).check()[3] is not None
    listener = MetricsListener(ListenOptions(f"127.0.0.1:{free_port()}", token, cert, key))
    listener.start()
    try:
        listener.publish("stall_recorder_up 1\n")
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        assert listener.url.startswith("https://")
        status, _, body = _get(listener.url, context=insecure)
        assert status == 401 and "bearer token required" in body
        assert _get(listener.url, "wrong-token-0123456789", insecure)[0] == 401
        assert _get(listener.url, "s3cret-token-0123456789", insecure)[:3:2] == (200, "stall_recorder_up 1\n")
    finally:
        listener.close()


def test_the_shipped_on_incident_command_posts_to_alertmanager(tmp_path):
    """packaging/alertmanager/stall-incident-to-alertmanager, run as --on-incident runs it, against a
    stand-in of Alertmanager's POST /api/v2/alerts."""
    import json
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from conftest import ROOT

    posted: list = []

    class Alertmanager(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            posted.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = HTTPServer(("127.0.0.1", 0), Alertmanager)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = ROOT / "packaging" / "alertmanager" / "stall-incident-to-alertmanager"
    env = {"PATH": "/usr/bin:/bin", "ALERTMANAGER_URL": f"http://127.0.0.1:{server.server_address[1]}",
           "STALL_RECORDER_INCIDENT_TRIGGER": "stall", "STALL_RECORDER_INCIDENT_CAUSE": "cpu_contention",
           "STALL_RECORDER_INCIDENT_STEP": "812"}
    try:
        res = subprocess.run([sys.executable, str(script), "/x/flight.db.incidents/a.db", "step 812 stalled"],
                             env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        ((path, (alert,)),) = posted
        assert path == "/api/v2/alerts"
        assert alert["labels"]["alertname"] == "StallRecorderIncident"
        assert (alert["labels"]["trigger"], alert["labels"]["cause_kind"]) == ("stall", "cpu_contention")
        assert alert["annotations"]["incident"] == "/x/flight.db.incidents/a.db"
        assert alert["annotations"]["step"] == "812"
    finally:
        server.shutdown()
        server.server_close()
    res = subprocess.run([sys.executable, str(script), "a.db", "s"], env=env, capture_output=True, text=True,
                         timeout=30)  # nobody listens now
    assert res.returncode == 1 and "did not take the alert" in res.stderr
