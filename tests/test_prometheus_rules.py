"""The shipped Prometheus rules (packaging/prometheus/) on a real Prometheus server: promtool
accepts them, and over a simulated job of 1,024 ranks (tests/prometheus_harness.py) the late-rank
alert names the rank made late, with its cause kind, after the onset and not before, while a rank
of another job late once (a few seconds) fires nothing, and the rank a hung job's peers wait for
(in no collective itself) is named by the hung-rank alert; every panel of the shipped Grafana dashboard
is a query the server answers. The server scrapes every second; the rules'
windows, written for a 5 s scrape, are scaled to it (x0.3)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from prometheus_harness import (
    DASHBOARD,
    PROMETHEUS,
    PROMTOOL,
    RULES,
    Prometheus,
    SimulatedJob,
    Simulator,
    scaled_rules,
)

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                      reason="needs Debian's prometheus package (scripts/setup.sh --test)")


@needs_prometheus
def test_promtool_accepts_the_shipped_rules(tmp_path):
    res = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    scaled = tmp_path / "scaled.yml"
    scaled.write_text(scaled_rules(0.4))
    res = subprocess.run([PROMTOOL, "check", "rules", str(scaled)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_prometheus
def test_the_late_rank_of_1024_is_named_and_a_rank_late_once_is_not(tmp_path):
    now = time.time()
    late = SimulatedJob("big-job", 1024, late_rank=517, onset=now + 6)
    once = SimulatedJob("other-job", 64, late_rank=3, onset=now + 5, until=now + 6.2)
    hung = SimulatedJob("hung-job", 32, late_rank=-1, onset=now + 4, hung_rank=21)
    sim = Simulator([late, once, hung])
    prom = Prometheus(tmp_path / "prom", {j.job_id: (f"127.0.0.1:{sim.port}", f"/{j.job_id}/metrics")
                                          for j in (late, once, hung)}, scaled_rules(0.3), scrape_s=1)
    try:
        fired, seen = None, []
        deadline = now + 40
        while time.time() < deadline:
            alerts = [a for a in prom.alerts() if a["labels"]["alertname"] == "StallRecorderLateRank"]
            seen += [(time.time(), a["labels"]) for a in alerts]
            if alerts:
                fired = alerts
                break
            time.sleep(0.5)
        assert fired is not None, prom.query("stall_recorder:late_rank:indicator == 1")
        (alert,) = fired
        labels = alert["labels"]
        assert (labels["job_id"], labels["rank"], labels["node"]) == ("big-job", "517", "node-064")
        assert labels["cause_kind"] == "cpu_contention"
        assert min(t for t, _ in seen) > late.onset  # never before the onset
        assert "recorder cluster explain" in alert["annotations"]["description"]
        assert "rank 517 of job big-job" in alert["annotations"]["summary"]
        # the rank late once stays unnamed while the late rank keeps firing
        for _ in range(6):
            names = {(a["labels"]["job_id"], a["labels"]["rank"]) for a in prom.alerts()
                     if a["labels"]["alertname"] == "StallRecorderLateRank"}
            assert names == {("big-job", "517")}, names
            time.sleep(0.5)
        # every panel of the shipped dashboard is a query this server answers; those the simulated
        # job feeds have series (the late-ranks table: the rank named)
        for panel in json.loads(DASHBOARD.read_text())["panels"]:
            for target in panel["targets"]:
                result = prom.query(target["expr"].replace("$job_id", "big-job"))
                if panel["id"] in (1, 2, 4, 5):
                    assert result, (panel["title"], target["expr"])
                if panel["id"] == 1:
                    assert [r["metric"]["rank"] for r in result] == ["517"]
        # the hung job: the rank its peers wait for, in no collective itself, is named
        hung_alerts = [a["labels"] for a in prom.alerts() if a["labels"]["alertname"] == "StallRecorderHungRank"]
        assert [(a["job_id"], a["rank"]) for a in hung_alerts] == [("hung-job", "21")]
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] == "StallRecorderHungCollective"]
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] == "StallRecorderLateRank"
                    and a["labels"]["job_id"] == "hung-job"]
    finally:
        prom.stop()
        sim.close()
