"""A flight recording run as a service tells someone, on real probes: `recorder start --foreground`
says READY=1 to systemd and stops on `recorder stop`; its --metrics-file parses as Prometheus text
with the recording's values while it records and after it stopped, and --on-incident runs for each
incident saved (SIGUSR1, a live stall) with the incident's path and summary."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder
from pyarrow.fs import FileSelector

from recorder.metrics import loss_layer

pytestmark = [needs_bpf, pytest.mark.bpf, pytest.mark.slow]
parser = pytest.importorskip("prometheus_client.parser")

TRAIN = str(ROOT / "tests" / "workloads" / "train_steps.py")
HOOK = """
import json, os, sys, time
out = sys.argv[1]
path, summary = sys.argv[-2], sys.argv[-1]
env = {k: v for k, v in os.environ.items() if k.startswith("STALL_RECORDER_")}
name = os.path.join(out, "%d-%d.json" % (time.monotonic_ns(), os.getpid()))
with open(name, "w") as f:
    json.dump({"argv": sys.argv[1:], "env": env, "exists": os.path.exists(path), "names": sorted(os.environ),
               "team": os.environ.get("HOOK_TEAM")}, f)
"""


def _metrics(path: Path) -> dict[str, list]:
    """name -> samples, read with the Prometheus client's own parser."""
    families = parser.text_string_to_metric_families(path.read_text())
    return {f.name: f.samples for f in families}


def _value(metrics: dict, name: str, **labels: str) -> float | None:
    for samples in metrics.values():
        for s in samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@pytest.fixture(scope="module")
def flight(native, s3, tmp_path_factory):
    """One foreground flight recording (`recorder start --foreground`, as the systemd unit runs it)
    of a stand-in training loop whose step 300 stalls for 1.2 s: the loop starts once systemd's
    notification socket heard READY=1, the metrics file is read then, SIGUSR1 is sent while it
    runs, and `recorder stop` ends the recording. Every incident is shipped (--ship) to the test's
    S3-compatible server."""
    tmp = tmp_path_factory.mktemp("notify")
    db, prom, hooks = tmp / "f.db", tmp / "stall_recorder.prom", tmp / "hooks"
    hooks.mkdir()
    script = tmp / "hook.py"
    script.write_text(HOOK)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify.sock"))
    notify.settimeout(240)
    # the loop waits for a line on its stdin, then becomes the training process (the same pid)
    work = subprocess.Popen(["sh", "-c", 'read go; exec "$@"', "sh", sys.executable, TRAIN, "--libdir",
                             str(native["dir"]), "--markers", "--steps", "400", "--slow-step", "300",
                             "--slow-ms", "1200", "--quiet"], stdin=subprocess.PIPE, text=True)
    rec = subprocess.Popen(
        [*RECORDER, "start", "--foreground", "--db", str(db), "-p", str(work.pid), "--keep", "30s", "--before", "4s",
         "--after", "2s", "--triggers", "stall", "--cooldown", "0s", "--metrics-file", str(prom),
         "--on-incident", f"{sys.executable} {script} {hooks}", "--on-incident-env", "HOOK_TEAM",
         "--ship", "s3://fleet/notify"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "NOTIFY_SOCKET": str(tmp / "notify.sock"), "HOOK_TEAM": "ml"})
    try:
        ready = notify.recv(4096).decode()
        live = _metrics(prom)  # written before READY=1
        work.stdin.write("go\n")
        work.stdin.close()
        time.sleep(1)
        os.kill(rec.pid, signal.SIGUSR1)
        work.wait(timeout=240)
        time.sleep(1)  # the loop's last steps read
        stopped = run_recorder("stop", "--db", str(db), "--json", timeout=240)
        out, err = rec.communicate(timeout=240)
    finally:
        work.kill()
        rec.kill()
        notify.close()
    assert stopped.returncode == 0, stopped.stderr
    assert rec.returncode == 0, err
    runs = [json.loads(p.read_text()) for p in sorted(hooks.glob("*.json"))]
    return {"db": db, "live": live, "final": _metrics(prom), "runs": runs, "out": out, "err": err, "ready": ready,
            "s3": s3}


def test_start_in_the_foreground_tells_systemd_it_is_ready_and_stops_on_recorder_stop(flight):
    assert flight["ready"].splitlines()[0] == "READY=1"
    lines = flight["out"].splitlines()
    assert lines[0].startswith("recording session 1 into ") and lines[-1].startswith("session 1 complete: ")
    assert q(flight["db"], "SELECT status FROM session") == [("complete",)]


def test_the_metrics_file_says_the_recording_is_up_while_it_records(flight):
    live = flight["live"]
    assert _value(live, "stall_recorder_up") == 1
    (sid,), = q(flight["db"], "SELECT id FROM session")
    assert _value(live, "stall_recorder_info", session=str(sid), db=str(flight["db"])) == 1
    assert abs(_value(live, "stall_recorder_last_update_timestamp_seconds") - time.time()) < 300
    assert _value(live, "stall_recorder_window_configured_seconds") == 30
    assert _value(live, "stall_recorder_incidents_saved_total", trigger="signal") == 0
    assert _value(live, "stall_recorder_cpu_seconds_total") > 0


def test_the_metrics_file_has_the_recordings_values_after_it_stopped(flight):
    final, db = flight["final"], flight["db"]
    assert _value(final, "stall_recorder_up") == 0
    saved = dict(q(db, "SELECT trigger, count(*) FROM incident GROUP BY trigger"))
    assert saved.get("signal") == 1 and saved.get("stall", 0) >= 1, saved
    for trigger, n in saved.items():
        assert _value(final, "stall_recorder_incidents_saved_total", trigger=trigger) == n
    assert _value(final, "stall_recorder_incidents_saved_total", trigger="oom") is None  # not a chosen trigger
    # events by layer: the off-CPU intervals of the stopped recording were all counted (none pruned in 30 s)
    (offcpu,), = q(db, "SELECT count(*) FROM offcpu_interval")
    assert _value(final, "stall_recorder_events_total", layer="sched", kind="offcpu") >= offcpu > 0
    assert _value(final, "stall_recorder_events_total", layer="cuda", kind="cuda") > 0
    # drops: the metric counts the whole recording; the file keeps the loss rows of its 30 s window,
    # and the stop's own accounting (requests whose completion was not seen), which the metric does not
    lost: dict[str, int] = {}
    for probe, n in q(db, "SELECT probe, dropped FROM loss WHERE probe != 'block request completion not seen'"):
        lost[loss_layer(probe)] = lost.get(loss_layer(probe), 0) + n
    counted = {s.labels["layer"]: s.value for s in final.get("stall_recorder_dropped_events", [])}
    for layer, n in lost.items():
        assert counted.get(layer, 0) >= n, (layer, counted, lost)
    (span_s,), = q(db, "SELECT (stopped_ts - started_ts) / 1e9 FROM session")
    if span_s < 30:  # nothing pruned: every drop counted is in the file
        (in_file,), = q(db, "SELECT coalesce(sum(dropped), 0) FROM loss")
        assert sum(counted.values()) <= in_file, (counted, in_file)
    assert _value(final, "stall_recorder_database_bytes") > 100_000
    assert _value(final, "stall_recorder_window_kept_seconds") == 30
    # the last stall: the step its incident names (300, or a later one a loaded machine made slow),
    # with the primary cause kind its incident's report names
    stalls = [r for r in flight["runs"] if r["env"]["STALL_RECORDER_INCIDENT_TRIGGER"] == "stall"]
    last = max(stalls, key=lambda r: r["argv"][-2])  # incident files are named by their time
    assert _value(final, "stall_recorder_last_stall_step") == int(last["env"]["STALL_RECORDER_INCIDENT_STEP"]) >= 300
    causes = final["stall_recorder_last_stall_cause_info"]
    assert len(causes) == 1 and causes[0].labels["trigger"] == "stall"
    stall_files = [f for t, f in q(db, "SELECT trigger, file FROM incident") if t == "stall"]
    kinds = {k for f in stall_files for k, in q(f, "SELECT DISTINCT kind FROM cause_kind")} | {"none"}
    assert causes[0].labels["cause_kind"] in kinds


def test_on_incident_ran_with_each_incidents_path_and_summary(flight):
    db, runs = flight["db"], flight["runs"]
    files = {f: t for t, f in q(db, "SELECT trigger, file FROM incident")}
    assert sorted(r["argv"][-2] for r in runs) == sorted(files)
    for r in runs:
        path, summary = r["argv"][-2], r["argv"][-1]
        assert r["exists"]  # run once the file was complete and renamed
        assert r["env"]["STALL_RECORDER_INCIDENT"] == path
        assert r["env"]["STALL_RECORDER_INCIDENT_SUMMARY"] == summary
        assert r["env"]["STALL_RECORDER_INCIDENT_TRIGGER"] == files[path]
        assert r["env"]["STALL_RECORDER_DB"] == str(db)
        assert "\n" not in summary and f"{files[path]} incident at " in summary
        # the recorder's environment holds the object store's keys (--ship): the command gets none of
        # it, only PATH, LANG, the incident's variables and what --on-incident-env passed
        assert "AWS_SECRET_ACCESS_KEY" in os.environ and r["team"] == "ml"
        assert not {n for n in r["names"] if not n.startswith("STALL_RECORDER_")} - {
            "PATH", "LANG", "HOOK_TEAM", "LC_CTYPE"}, r["names"]  # LC_CTYPE: the hook's Python sets it
    # the stall trigger names the step that stalled, by its number: step 300 slept 1.2 s longer, and
    # no other step of the loop (13 ms each) can take a second, however loaded the machine. Each
    # trigger's own words are kept in the detail of the incident it saved or joined.
    details = " ; ".join(d for d, in q(db, "SELECT detail FROM incident"))
    long_steps = [int(n) for n, ms in re.findall(r"stall: step (\d+) took (\d+) ms", details) if int(ms) >= 1000]
    assert long_steps == [300], details
    # and the hook of each incident whose window holds that step (a later step a loaded machine
    # slowed may save one too) is told its number
    holding = [r for r in runs if r["env"]["STALL_RECORDER_INCIDENT_TRIGGER"] == "stall"
               and q(r["argv"][-2], "SELECT count(*) FROM step WHERE step = 300 AND dur > 1e9") == [(1,)]]
    assert holding, [r["argv"][-1] for r in runs]
    for r in holding:
        assert r["env"]["STALL_RECORDER_INCIDENT_STEP"] == "300", r["argv"][-1]
        assert "step 300 stalled, primary cause " in r["argv"][-1]
    assert _value(flight["final"], "stall_recorder_hook_runs_total") == len(runs)
    assert _value(flight["final"], "stall_recorder_hook_failures_total") == 0


def test_every_incident_is_shipped_to_the_object_store_as_its_recording_and_its_export(flight):
    fs, host = flight["s3"]["fs"], socket.gethostname()
    files = [Path(f) for f, in q(flight["db"], "SELECT file FROM incident")]
    assert files
    for f in files:
        base = f"fleet/notify/incidents/{host}/{f.stem}"
        assert fs.get_file_info(base + ".db").size == f.stat().st_size, flight["err"]
        listed = fs.get_file_info(FileSelector(base, recursive=True))
        exported = {i.path.split("/")[len(base.split("/"))] for i in listed}
        assert {"export_meta", "stall", "step_cause", "session"} <= exported, (exported, flight["err"])
        assert f"incident shipped: {f.name}" in flight["err"] + flight["out"]
    assert not Path(str(flight["db"]) + ".spool").exists()
