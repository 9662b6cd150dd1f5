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


MEMORY_V1 = Path("/sys/fs/cgroup/memory")  # the cgroup v1 memory controller


def cgroup_v1(root: Path, settings: dict[str, str]):
    """A generator: yields a new cgroup under the cgroup v1 controller `root` with `settings`
    written, and removes it (its processes moved back to `root`) when resumed. Skips the test
    where that controller is not mounted."""
    if not (root / "cgroup.procs").exists():
        pytest.skip(f"needs the cgroup v1 controller at {root}")
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
