"""Shared fixtures: the stand-in libraries, a reason to skip real-BPF tests, recorder runners."""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "native"))
import native_libs as native_build  # noqa: E402

RECORDER = [sys.executable, "-m", "recorder"]
# The on-CPU profile is on by default, and its programs are compiled once per recording, after its
# start, in a child of the recorder: ~2 CPU-s a recording, which on a machine of 2 CPUs made four
# test files of real recordings 14% slower (docs/benchmarks.md). The tests that are not about it
# record without it; those about it (and how it meets other layers) run recorders with
# `profile_default_env()`.
PROFILE_VARIABLE = "STALL_RECORDER_PROFILE_HZ"
os.environ.setdefault(PROFILE_VARIABLE, "0")


def profile_default_env() -> dict[str, str]:
    """This environment with the on-CPU profile at its default (see PROFILE_VARIABLE)."""
    return {k: v for k, v in os.environ.items() if k != PROFILE_VARIABLE}


def bpf_unavailable() -> str | None:
    """Why real-BPF tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for BPF, tracepoints and uprobes"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "needs the bcc module (apt-get install python3-bpfcc)"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "needs a kernel with BTF"
    return None


NO_BPF = bpf_unavailable()
needs_bpf = pytest.mark.skipif(NO_BPF is not None, reason=NO_BPF or "")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `bpf` every test that runs real probes: those of a *_bpf.py file and those that need BPF
    (`needs_bpf`, or a skip of the same condition). `make test` runs the others first on both CPUs
    (pytest-xdist, a file to a worker), then these one at a time: what they measure (losses, latencies,
    a stand-in job's rate) depends on the machine's load, and their recorders compile on a CPU of their own."""
    for item in items:
        if item.get_closest_marker("bpf"):
            continue
        if item.path.name.endswith("_bpf.py") or any(
                mark == needs_bpf.mark for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.bpf)


@pytest.fixture(scope="session")
def native() -> dict[str, Path]:
    libs = native_build.build_libraries()
    libs["busy_loop"] = native_build.build_busy_loop()
    libs["dir"] = libs["libcudart.so.12"].parent
    return libs


@pytest.fixture
def loop_dev(tmp_path):
    """The name of a fresh 32 MiB loop device backed by a file in the page cache (block requests,
    completed by the loop worker; a request costs microseconds); removed even when a test fails."""
    if not Path("/dev/loop-control").exists():
        pytest.skip("needs loop devices (/dev/loop-control)")
    img = tmp_path / "loop.img"
    subprocess.run(["truncate", "-s", "32M", str(img)], check=True)
    loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        yield Path(loop).name
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


# -- cgroups with limits, on whichever layout the host has -------------------------------------------
# Hosts run cgroup v1 (a hierarchy per controller: blkio, memory) or v2 (one hierarchy, io and memory
# controllers enabled in cgroup.subtree_control: Debian 11+, Ubuntu 22.04+, RHEL 9, Kubernetes), and
# some mount a v2 hierarchy beside v1 with no controller of its own. A test that needs a throttle or a
# memory limit runs once per layout (the `cgroup_layout` fixture) and skips, with the reason, the
# layout this host cannot give it.
CGROUP_LAYOUTS = ("v1", "v2")
_V1_NAMES = {"io": "blkio", "memory": "memory"}


def _cgroup_mounts() -> list[tuple[str, Path, set[str]]]:
    """(type, mount point, options) of each cgroup and cgroup2 mount of this process's namespace."""
    out = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            out.append((fields[2], Path(fields[1].replace("\\040", " ")), set(fields[3].split(","))))
    return out


def cgroup_root(layout: str, controller: str) -> tuple[Path | None, str]:
    """(root of the hierarchy that has `controller` ('io' or 'memory') on `layout`, None) or
    (None, why there is none)."""
    mounts = _cgroup_mounts()
    if layout == "v1":
        for kind, point, options in mounts:
            if kind == "cgroup" and _V1_NAMES[controller] in options:
                return point, ""
        return None, f"no cgroup v1 {_V1_NAMES[controller]} hierarchy is mounted (this host runs cgroup v2 only)"
    v2 = [point for kind, point, _ in mounts if kind == "cgroup2"]
    for point in v2:
        try:
            if controller in (point / "cgroup.controllers").read_text().split():
                return point, ""
        except OSError:
            continue
    if not v2:
        return None, "no cgroup v2 hierarchy is mounted"
    bound = next((point for kind, point, options in mounts if kind == "cgroup" and _V1_NAMES[controller] in options),
                 None)
    where = f": it is bound to the cgroup v1 hierarchy at {bound}" if bound else ""
    return None, (f"the cgroup v2 hierarchy at {v2[0]} has no {controller} controller{where} (a controller "
                  "moves to v2 only once its v1 hierarchy is unmounted and empty, or at boot with "
                  "cgroup_no_v1=)")


def io_limits(layout: str, majmin: str, *, read_bps: int | None = None, write_bps: int | None = None,
              write_iops: int | None = None) -> dict[str, str]:
    """The files and values that throttle a cgroup's I/O to device `majmin` ('M:m') on `layout`."""
    if layout == "v1":
        names = {"read_bps": read_bps, "write_bps": write_bps, "write_iops": write_iops}
        return {f"blkio.throttle.{k}_device": f"{majmin} {v}" for k, v in names.items() if v is not None}
    keys = {"rbps": read_bps, "wbps": write_bps, "wiops": write_iops}
    return {"io.max": " ".join([majmin, *(f"{k}={v}" for k, v in keys.items() if v is not None)])}


def memory_limit(layout: str, limit: int) -> dict[str, str]:
    """The file and value that limit a cgroup's memory (its page cache included) to `limit` bytes:
    past it the cgroup's own tasks reclaim (memcg direct reclaim)."""
    return {"memory.limit_in_bytes" if layout == "v1" else "memory.max": str(limit)}


def require_cgroup(layout: str, controller: str) -> Path:
    """The root of the hierarchy with `controller` on `layout`; skips the test, with the reason, where
    there is none (call it before making what the test would limit)."""
    root, why = cgroup_root(layout, controller)
    if root is None:
        pytest.skip(f"needs the {controller} controller on cgroup {layout}: {why}")
    return root


def limited_cgroup(layout: str, controller: str, settings: dict[str, str]):
    """A generator: yields a new cgroup (its folder: processes join it by writing their pid to its
    cgroup.procs) on `layout` with `controller` and `settings` written, and removes it (its processes
    moved back to the root) when resumed. Skips the test, with the reason, where this host has no
    such hierarchy."""
    root = require_cgroup(layout, controller)
    if layout == "v2":  # the root's children get the controller only once it is enabled for them
        enabled = (root / "cgroup.subtree_control").read_text().split()
        if controller not in enabled:
            (root / "cgroup.subtree_control").write_text(f"+{controller}")
    path = root / f"stall-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        for name, value in settings.items():
            (path / name).write_text(value)
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        path.rmdir()


@pytest.fixture(params=CGROUP_LAYOUTS)
def cgroup_layout(request) -> str:
    """'v1' or 'v2': the layout of the cgroups a test limits (limited_cgroup skips the one the host lacks)."""
    return request.param


def realtime() -> list[str]:
    """The command prefix that runs a workload as a real-time task (SCHED_FIFO): it then never waits for
    a CPU behind the machine's other work, so a test can expect the one cause it made. Skips the test,
    with the reason, where the host refuses real-time tasks (a container without CAP_SYS_NICE, a cgroup
    with no real-time runtime)."""
    prefix = ["chrt", "-f", "1"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("needs real-time scheduling (chrt -f 1) to keep the machine's other work off the workload")
    return prefix


def q(db: Path | str, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of one query on a recording, through a fresh connection."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def run_recorder(*args: str, timeout: float = 180, check: bool = False,
                 **kw) -> subprocess.CompletedProcess:
    result = subprocess.run([*RECORDER, *args], capture_output=True, text=True, timeout=timeout,
                            cwd=ROOT, **kw)
    if check and result.returncode != 0:
        raise AssertionError(f"recorder {' '.join(args)} -> {result.returncode}\n{result.stderr}")
    return result


def losses_beyond_skips(db: Path | str) -> dict[str, int]:
    """The recording's losses other than runs of BPF programs the kernel skipped (another program
    was running on the CPU, or an interrupt arrived while one ran: a busy machine's, counted) and
    the block requests such skipped completions left not seen complete."""
    lost = dict(q(db, "SELECT probe, sum(dropped) FROM loss GROUP BY probe"))
    skipped_completions = lost.get("bpf program tracepoint__block__block_rq_complete skipped (block)", 0)
    if lost.get("block request completion not seen", 0) <= skipped_completions:
        lost.pop("block request completion not seen", None)
    return {probe: n for probe, n in lost.items() if not re.fullmatch(r"bpf program \S+ skipped \(\w+\)", probe)}


def damage_pages(db: Path, where: float) -> None:
    """Overwrite three pages of a recording, from `where` (a fraction of the file) on."""
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    first = int(len(data) // page * where)
    for n in range(first, first + 3):
        data[n * page:(n + 1) * page] = b"\x00\xff" * (page // 2)
    db.write_bytes(bytes(data))


def workload_output(stdout: str) -> dict:
    """The JSON line a workload prints at the end."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no workload JSON in output:\n{stdout}")


# -- an S3-compatible object store (moto's server) on 127.0.0.1, for the shipping tests --------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with a bucket `fleet`, and the AWS_* variables that point at it."""
    pytest.importorskip("moto", reason="moto[server] is a test extra: scripts/setup.sh --test installs it")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"moto's server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.1)
        from pyarrow import fs

        fs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                        allow_bucket_creation=True).create_dir("fleet")
        yield {"port": port, "env": env, "fs": fs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                                                               region="us-east-1")}
    finally:
        server.terminate()
        server.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
