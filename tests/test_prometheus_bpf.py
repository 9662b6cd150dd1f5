"""Two real recorders on real BPF, one per local rank of a job on the NCCL stand-in (as
tests/test_cluster_bpf.py runs them), each serving /metrics (--metrics-listen) to a real Prometheus
with the shipped rules (scaled to its 1 s scrape, tests/prometheus_harness.py). Rank 1 is then made
late by CPU contention: a busy process at a higher priority pinned to its CPU (ended by its pid);
rank 0 runs SCHED_FIFO, so that the machine's other work does not make it late too.
The late-rank alert must fire naming rank 1, its job and its cause kind, cpu_contention."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf
from prometheus_harness import PROMETHEUS, Prometheus, free_port, scaled_rules

pytestmark = [needs_bpf, pytest.mark.bpf,
              pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (scripts/setup.sh --test)"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs (a rank on each)")]
WORKLOAD = ROOT / "tests" / "workloads" / "nccl_ranks.py"


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_the_rank_made_late_by_cpu_contention_is_named_with_its_cause(tmp_path, native):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    unique_id = os.urandom(128).hex()
    ports = [free_port(), free_port()]
    recorders = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job-4711"}
        # rank 0 runs SCHED_FIFO, so that nothing else on the machine (the recorders, Prometheus,
        # other work) makes it late too: the only rank contended is rank 1
        policy = ["chrt", "-f", "10"] if rank == 0 else []
        argv = [*RECORDER, "record", "--db", str(tmp_path / f"rank{rank}.db"),
                "--metrics-listen", f"127.0.0.1:{ports[rank]}",
                "--cuda-lib", str(native["dir"] / "libnccl.so.2"), "--cuda-lib", str(native["libcudart.so.12"]),
                "--", *policy, "taskset", "-c", str(cpus[rank]), sys.executable, str(WORKLOAD),
                "--libdir", str(native["dir"]), "--ranks", "2", "--rank", str(rank), "--unique-id", unique_id,
                "--steps", "1000000",
                "--slow-steps", "", "--gpu-ms", "1", "--cpu-ms", "4"]
        recorders.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    prom = Prometheus(tmp_path / "prom", {f"rank{r}": (f"127.0.0.1:{ports[r]}", "/metrics") for r in (0, 1)},
                      scaled_rules(0.4), scrape_s=1)
    hog = None
    try:
        deadline = time.monotonic() + 120  # two recorders compiling their probes on a loaded machine
        while time.monotonic() < deadline:
            if len(prom.query("rate(stall_recorder_workload_collective_wait_seconds_total[4s]) > 0")) == 2:
                break
            assert all(r.poll() is None for r in recorders), [r.communicate()[0][-2000:] for r in recorders]
            time.sleep(0.5)
        else:
            pytest.fail("the ranks' collective waits never reached Prometheus")
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] == "StallRecorderLateRank"]
        hog = subprocess.Popen(["taskset", "-c", str(cpus[1]), "nice", "-n", "-5", str(native["busy_loop"]), "60"])
        began = time.monotonic()
        fired = None
        while time.monotonic() - began < 45 and fired is None:
            late = [a for a in prom.alerts() if a["labels"]["alertname"] == "StallRecorderLateRank"]
            fired = late or None
            time.sleep(0.5)
        assert fired, (prom.query("stall_recorder:collective_wait_ratio:rate10s"),
                       prom.query("stall_recorder:lost_ratio:rate30s"))
        (alert,) = fired
        labels = alert["labels"]
        assert (labels["job_id"], labels["rank"]) == ("job-4711", "1"), labels
        assert labels["cause_kind"] == "cpu_contention", (labels, prom.query("stall_recorder:lost_ratio:rate30s"))
        print(f"onset to firing: {time.monotonic() - began:.1f} s")
    finally:
        if hog is not None:
            os.kill(hog.pid, signal.SIGTERM)
            hog.wait()
        prom.stop()
        for r in recorders:  # the recording is not looked at: the workload, then its recorder, killed
            for child in _children(r.pid):
                os.kill(child, signal.SIGKILL)
            os.kill(r.pid, signal.SIGKILL)
        for r in recorders:
            r.communicate(timeout=60)
