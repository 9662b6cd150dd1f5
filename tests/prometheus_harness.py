"""A real Prometheus server for the tests and the benchmark, and a simulated job to scrape.

`Prometheus` runs Debian's `prometheus` on a loopback port with a temporary storage folder and the
shipped rules (packaging/prometheus/stall-recorder-rules.yml, their windows scaled to the scrape
interval), and ends it by its pid. `SimulatedJob` serves, at /metrics, the workload metrics of a
job of N ranks as recorder/workload_metrics.py names them, computed from the time: every rank
waits `base_wait` of the time in its collectives; from `onset` on, the late rank waits none and
its peers `lateness` more, and the late rank loses `late_cpu` of its time to cpu_contention.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "packaging" / "prometheus" / "stall-recorder-rules.yml"
DASHBOARD = ROOT / "packaging" / "grafana" / "stall-recorder-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaled_rules(factor: float) -> str:
    """The shipped rules with every window and `for` duration multiplied by factor (they are
    written for a 5 s scrape: a 1 s scrape keeps the same number of samples with factor 0.2-0.4)."""
    def scale(m: re.Match) -> str:
        return f"{m.group(1)}{max(1, round(int(m.group(2)) * factor * 1000))}ms{m.group(3)}"

    text = RULES.read_text()
    text = re.sub(r"(\[)(\d+)s(\])", scale, text)
    text = re.sub(r"(offset )(\d+)s()", scale, text)
    return re.sub(r"(for: )(\d+)s()", scale, text)


@dataclass
class SimulatedJob:
    """The metrics of one job of `ranks` ranks (a node's worth of recorders behind one target)."""

    job_id: str
    ranks: int
    late_rank: int
    onset: float                 # Unix time the rank turns late (inf: never)
    until: float = float("inf")  # and on time again
    base_wait: float = 0.05      # s/s every rank waits in its collectives
    lateness: float = 0.4        # s/s more its peers wait while it is late
    late_cpu: float = 0.3        # s/s it loses to CPU contention while late
    hung_rank: int | None = None  # from onset on, the other ranks wait in a collective that rank never enters
    started: float = field(default_factory=time.time)
    render_s: float = 0.0        # time spent rendering, in all
    scrapes: int = 0

    def _late_s(self, now: float) -> float:
        return max(0.0, min(now, self.until) - self.onset) if now > self.onset else 0.0

    def render(self, now: float | None = None) -> str:
        began = time.perf_counter()
        now = time.time() if now is None else now
        t = now - self.started
        late = self._late_s(now)
        lines = ["# TYPE stall_recorder_workload_collective_wait_seconds_total counter",
                 "# TYPE stall_recorder_workload_lost_seconds_total counter",
                 "# TYPE stall_recorder_workload_collective_in_flight_oldest_seconds gauge"]
        for r in range(self.ranks):
            labels = (f'job_id="{self.job_id}",rank="{r}",local_rank="{r % 8}",world_size="{self.ranks}",'
                      f'node="node-{r // 8:03d}",pod=""')
            if self.hung_rank is not None:
                wait, cpu = self.base_wait * t, 0.01 * t
            elif r == self.late_rank:
                wait = self.base_wait * (t - late)
                cpu = 0.01 * t + self.late_cpu * late
            else:
                wait = self.base_wait * t + self.lateness * late
                cpu = 0.01 * t
            lines.append(f'stall_recorder_workload_collective_wait_seconds_total{{{labels},comm="c0ffee",'
                         f'op="ncclAllReduce"}} {wait:.6f}')
            lost = "stall_recorder_workload_lost_seconds_total"
            lines.append(f'{lost}{{{labels},cause_kind="cpu_contention"}} {cpu:.6f}')
            lines.append(f'{lost}{{{labels},cause_kind="nccl_wait"}} {wait:.6f}')
            in_flight = 0.0
            if self.hung_rank is not None and now > self.onset and r != self.hung_rank:
                in_flight = 60 + now - self.onset  # the collective they entered a minute before the onset
            lines.append(f"stall_recorder_workload_collective_in_flight_oldest_seconds{{{labels}}} {in_flight:.3f}")
        text = "\n".join(lines) + "\n"
        self.render_s += time.perf_counter() - began
        self.scrapes += 1
        return text


class Simulator:
    """One HTTP server, a path per job: /JOB_ID/metrics."""

    def __init__(self, jobs: list[SimulatedJob]) -> None:
        self.jobs = {j.job_id: j for j in jobs}
        sim = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                job = sim.jobs.get(self.path.strip("/").split("/")[0])
                body = job.render().encode() if job else b""
                self.send_response(200 if job else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Prometheus:
    """Debian's prometheus on a loopback port, scraping `targets` (name -> host:port and path)."""

    def __init__(self, folder: Path, targets: dict[str, tuple[str, str]], rules: str, scrape_s: float,
                 extra_scrape: str = "", cpus: str | None = None) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rules.yml").write_text(rules)
        jobs = "".join(f"""
  - job_name: {name}
    metrics_path: {path}
    static_configs:
      - targets: ['{address}']
""" for name, (address, path) in targets.items())
        (folder / "prometheus.yml").write_text(f"""global:
  scrape_interval: {round(scrape_s * 1000)}ms
  evaluation_interval: {round(scrape_s * 1000)}ms
rule_files: [rules.yml]
scrape_configs:{jobs}{extra_scrape}""")
        self.port = free_port()
        self.log = open(folder / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*(["taskset", "-c", cpus] if cpus else []), PROMETHEUS or "prometheus",
             f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], cwd=folder, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())["data"]

    def alerts(self, state: str = "firing") -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if a["state"] == state]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@dataclass
class SyntheticRank:
    """A recording made through the store, as a recorder of one rank writes it (for WorkloadWatch):
    its session, process (with its job identity), step thread, communicator and API ids."""

    db: Path
    conn: object
    session_id: int
    process_id: int
    thread_id: int
    allreduce: int
    sync: int


def synthetic_rank(db: Path, rank: int = 3, world: int = 8, run_id: str = "bench") -> SyntheticRank:
    from store.db import open_store

    store = open_store(db, create=True)
    conn = store.conn
    sid = conn.execute(
        "INSERT INTO session (started_ts, wall_offset_ns, status, recorder_pid, hostname, kernel_release, boot_id, "
        "cpu_count, target, command, tool_version) VALUES (0, 0, 'recording', 1, 'node', 'k', 'b', 2, 't', 'c', 'v')"
    ).lastrowid
    conn.execute("INSERT OR IGNORE INTO cuda_api (id, name, family, library, arguments) "
                 "VALUES (900, 'cudaStreamSynchronize', 'cudaStreamSynchronize', 'runtime', '')")
    conn.execute("INSERT OR IGNORE INTO nccl_api (id, name, kind) VALUES (900, 'ncclAllReduce', 'collective')")
    sync = conn.execute("SELECT id FROM cuda_api WHERE name = 'cudaStreamSynchronize'").fetchone()[0]
    allreduce = conn.execute("SELECT id FROM nccl_api WHERE name = 'ncclAllReduce'").fetchone()[0]
    process = conn.execute(
        "INSERT INTO process (session_id, pid, name, environ_status, job_rank, job_local_rank, job_world_size, run_id, "
        "first_ts) "
        "VALUES (?, 4242, 'train', 'read', ?, ?, ?, ?, 0)", (sid, rank, rank % 8, world, run_id)).lastrowid
    thread = conn.execute("INSERT INTO thread (session_id, process_id, tid, name, first_ts) VALUES (?, ?, 4242, "
                          "'train', 0)", (sid, process)).lastrowid
    conn.execute("INSERT INTO nccl_comm (session_id, process_id, handle, comm_hash, rank, nranks, init_ts) "
                 "VALUES (?, ?, 77, 12345, ?, ?, 0)", (sid, process, rank, world))
    conn.commit()
    return SyntheticRank(db, conn, sid, process, thread, allreduce, sync)
