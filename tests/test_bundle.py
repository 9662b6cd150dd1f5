"""The offline bundle (scripts/build_bundle.py, `make bundle`) on a node that has none of what the
recorder needs: a minimal Debian made with debootstrap (another release than the build machine's, so
another glibc and another CPython), without BCC, a compiler or any Python package. In it the bundle
is unpacked and installed, then `doctor`, `record -- python3 ...`, `explain`, `mcp`, `export --parquet`
and `cluster explain` run from it with real BPF.

The bundle is built once per test session from the wheel tests/test_install_wheel.py builds (as
`make bundle` builds it from the project's wheel), with a umask that would leave files writable by the
group, and its tarball is checked for owners and modes. Building needs the Debian packages and the
Python packages once (kept under build/bundle/, so later builds are offline), the chroot the Debian
archive once (kept in build/chroot-SUITE; SUITE: STALL_RECORDER_BUNDLE_SUITE, default trixie).
STALL_RECORDER_TEST_BUNDLE=0 skips the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q
from test_install_wheel import built_dist

VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
NAME = f"stall-recorder-{VERSION}"
# not compressed: the same tar stream `make bundle` compresses, without minutes of gzip and gunzip
TARBALL = ROOT / "build" / f"{NAME}-linux-x86_64.tar"
SUITE = os.environ.get("STALL_RECORDER_BUNDLE_SUITE", "trixie")
CHROOT = ROOT / "build" / f"chroot-{SUITE}"
# what a node's shell has: no venv, no pyenv, no PYTHONPATH of ours
NODE_ENV = {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin", "HOME": "/root", "TERM": "dumb"}

pytestmark = [
    pytest.mark.slow,
    needs_bpf,
    pytest.mark.skipif(os.environ.get("STALL_RECORDER_TEST_BUNDLE") == "0",
                       reason="STALL_RECORDER_TEST_BUNDLE=0: the offline bundle is not built or tested"),
]

WORKLOAD = ("import os, time\n"
            "def checkpoint():\n"
            "    with open('/tmp/bundle-ckpt', 'wb') as f:\n"
            "        f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())\n"
            "for step in range(6):\n"
            "    sum(range(300000)); checkpoint(); time.sleep(0.05)\n"
            "print('workload done')\n")


def in_chroot(*cmd: str, stdin: str | None = None, timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`cmd` inside the chroot, with the host's /proc, /sys (tracefs, BTF, cgroups) and /dev bound in a
    mount namespace of its own (the mounts go away with the command); the host's network."""
    script = ('mount --rbind /proc "$0/proc" && mount --rbind /sys "$0/sys" && mount --rbind /dev "$0/dev" '
              '&& exec chroot "$0" "$@"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(CHROOT), *cmd],
                          input=stdin, capture_output=True, text=True, timeout=timeout, env={**NODE_ENV, **(env or {})})


@pytest.fixture(scope="module")
def chroot_made():
    """debootstrap started where the chroot is not made yet, running while the bundle is built (the
    two take about as long); `node` waits for it."""
    if CHROOT.exists():
        yield None
        return
    if not shutil.which("debootstrap"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "debootstrap"], capture_output=True)
    if not shutil.which("debootstrap"):
        pytest.skip("needs debootstrap (apt-get install debootstrap)")
    partial = CHROOT.with_name(CHROOT.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    log = (partial.parent / f"{partial.name}.log").open("w+")
    # python3-minimal: the interpreter the workload runs on, with no package beyond its standard library
    proc = subprocess.Popen(["debootstrap", "--variant=minbase", "--include=python3-minimal", SUITE, str(partial)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc, partial, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def finish_chroot(started) -> None:
    if started is None:
        return
    proc, partial, log = started
    try:
        rc = proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        pytest.fail(f"debootstrap {SUITE} did not finish in 20 minutes")
    if rc:
        log.seek(0)
        pytest.fail(f"debootstrap {SUITE} failed (it needs the Debian archive once):\n{log.read()[-4000:]}")
    if not CHROOT.exists():
        partial.rename(CHROOT)


@pytest.fixture(scope="module")
def tarball(tmp_path_factory, chroot_made) -> Path:
    """The bundle built from the session's wheel, by a builder whose umask lets the group write."""
    wheel = built_dist(tmp_path_factory).wheel
    t0 = time.monotonic()
    build = [sys.executable, str(ROOT / "scripts" / "build_bundle.py"), "--no-compress", "--wheel", str(wheel)]
    r = subprocess.run(build, capture_output=True, text=True, timeout=3600, umask=0o002)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    print(f"bundle built in {time.monotonic() - t0:.0f} s:\n{r.stdout}")
    return TARBALL


def test_the_tarball_is_roots_and_nothing_in_it_is_writable_by_group_or_others(tarball):
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
    assert {m.name.split("/", 1)[0] for m in members} == {NAME}
    assert {(m.uid, m.gid) for m in members} == {(0, 0)}
    loose = [f"{m.name} {oct(m.mode)}" for m in members if not m.issym() and m.mode & 0o022]
    assert loose == []
    by_name = {m.name: m for m in members}
    assert by_name[f"{NAME}/bin/recorder"].mode == 0o755 and by_name[f"{NAME}/README"].mode == 0o644
    # pyarrow's S3 file system (--ship) and the libraries its Parquet module loads are in it
    assert any(m.name.startswith(f"{NAME}/lib/python3/dist-packages/pyarrow/_s3fs.") for m in members)


@pytest.fixture(scope="module")
def node(tarball, chroot_made) -> Path:
    """The chroot with the bundle freshly unpacked in /opt and installed; the path of the bundle in it."""
    finish_chroot(chroot_made)
    opt = CHROOT / "opt"
    shutil.rmtree(opt / NAME, ignore_errors=True)
    opt.mkdir(exist_ok=True)
    subprocess.run(["tar", "xf", str(TARBALL), "-C", str(opt)], check=True)
    for f in ("bundle.db", "bundle.db-wal", "bundle.db-shm"):
        (CHROOT / "tmp" / f).unlink(missing_ok=True)
    shutil.rmtree(CHROOT / "tmp/bundle-parquet", ignore_errors=True)
    return Path("/opt") / NAME


@pytest.fixture(scope="module")
def installed(node) -> subprocess.CompletedProcess:
    """./install.sh: links /usr/local/bin/recorder and runs `recorder doctor`."""
    return in_chroot(str(node / "install.sh"))


@pytest.fixture(scope="module")
def recorded(installed) -> subprocess.CompletedProcess:
    return in_chroot("recorder", "record", "--db", "/tmp/bundle.db", "--", "python3", "-c", WORKLOAD)


def test_the_chroot_has_no_bcc_compiler_or_python_package_and_another_glibc(node):
    dpkg = in_chroot("dpkg-query", "-W", "-f", "${Package}\n")
    packages = set(dpkg.stdout.split())
    assert "python3-minimal" in packages
    extra = [p for p in packages if p.startswith(("python3-", "linux-headers", "clang", "libllvm", "libbpf", "bpf"))]
    assert extra == ["python3-minimal"], extra
    compilers = in_chroot("sh", "-c", "ls /usr/bin/cc /usr/bin/gcc* /usr/bin/clang* /usr/bin/pip* 2>/dev/null")
    assert compilers.stdout == ""  # gcc-14-base (a dependency of libgcc-s1) holds no compiler
    no_bcc = in_chroot("python3", "-c", "import bcc")
    assert "No module named 'bcc'" in no_bcc.stderr
    node_glibc = in_chroot("ldd", "--version").stdout.splitlines()[0]
    bundle_glibc = in_chroot(str(node / "bin/python3"), "-c", "import os; print(os.confstr('CS_GNU_LIBC_VERSION'))")
    assert bundle_glibc.stdout.strip() == "glibc 2.36", bundle_glibc.stderr
    assert "2.36" not in node_glibc  # the node's C library is another one, and not the one the recorder uses


def test_the_bundle_loads_nothing_from_the_node(node):
    """Every file the bundle's interpreter maps (with BCC and the recorder's extensions loaded) is the bundle's."""
    code = ("import bcc, recorder._ingest, recorder._markers, store.db._insert, pydantic_core, sys\n"
            "maps = {l.split()[-1] for l in open('/proc/self/maps') if '/' in l}\n"
            "print(sys.version_info[:2], sys.prefix, sys.executable); print('\\n'.join(sorted(maps)))")
    r = in_chroot(str(node / "bin/python3"), "-c", code)
    assert r.returncode == 0, r.stderr
    first, *maps = r.stdout.splitlines()
    assert first == f"(3, 11) {node} {node}/bin/python3"  # a child started from sys.executable is the bundle's too
    assert any(m.endswith("libbcc.so.0.26.0") for m in maps)
    assert [m for m in maps if not m.startswith(str(node) + "/")] == []


def test_nothing_of_the_bundle_is_passed_on_to_the_programs_it_starts(node):
    code = "import subprocess; print(subprocess.run(['env'], capture_output=True, text=True).stdout)"
    r = in_chroot(str(node / "bin/python3"), "-c", code)
    names = {line.split("=", 1)[0] for line in r.stdout.splitlines()}
    assert r.returncode == 0 and "PATH" in names, r.stderr
    assert not names & {"LD_LIBRARY_PATH", "LOCPATH", "GCONV_PATH", "PYTHONHOME", "PYTHONPATH",
                        "STALL_RECORDER_BUNDLE_VARS"}, names


def test_install_links_recorder_and_doctor_passes(installed, node):
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert f"/usr/local/bin/recorder -> {node}/bin/recorder" in installed.stdout
    assert f"BCC_KERNEL_SOURCE={node}/share/kernel-headers/" in installed.stdout, installed.stdout


def test_record_a_python_workload(recorded):
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    assert "workload done" in recorded.stdout
    db = CHROOT / "tmp/bundle.db"
    attached = dict(q(db, "SELECT layer, count(*) FROM capability WHERE status = 'attached' GROUP BY layer"))
    assert attached.get("sched", 0) > 0 and attached.get("python", 0) > 0, attached
    [(offcpu,)] = q(db, "SELECT count(*) FROM offcpu_interval")
    assert offcpu > 0


def test_explain_and_mcp_over_stdio(recorded):
    explained = in_chroot("recorder", "explain", "--db", "/tmp/bundle.db")
    assert explained.returncode == 0, explained.stderr
    observed = [line for line in explained.stdout.splitlines() if line.startswith("Observed: ")]
    assert observed and "scheduler" in observed[0] and "Python source lines" in observed[0], explained.stdout
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bundle-test", "version": "1"}}}
    requests = [init, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}]
    mcp = in_chroot("recorder", "mcp", "--db", "/tmp/bundle.db", stdin="".join(json.dumps(r) + "\n" for r in requests),
                    timeout=60)
    replies = {m["id"]: m for m in map(json.loads, mcp.stdout.splitlines()) if "id" in m}
    assert replies[1]["result"]["serverInfo"]["name"], mcp.stderr
    assert 2 in replies, (mcp.stdout, mcp.stderr)  # answered before the server ended with its input
    tools = {t["name"] for t in replies[2]["result"]["tools"]}
    assert {"explain_stall", "run_sql"} <= tools, tools


@pytest.fixture(scope="module")
def job(installed) -> str:
    """Synthetic recordings of a two-node job (rank 3 on node-01 late), written by the bundle."""
    job = "/tmp/bundle-cluster"
    shutil.rmtree(CHROOT / job.lstrip("/"), ignore_errors=True)
    demo = in_chroot("recorder", "cluster", "demo", "--nodes", "2", "--ranks-per-node", "2", "--late-rank", "3", job)
    assert demo.returncode == 0, demo.stderr
    return job


def test_export_parquet_and_cluster_explain_from_the_bundle(recorded, job):
    """Arrow, Parquet and DuckDB from the bundle: the recording and a job's node recordings exported,
    the job explained from the export."""
    assert recorded.returncode == 0, recorded.stderr
    exported = in_chroot("recorder", "export", "--parquet", "/tmp/bundle-parquet", "--db", "/tmp/bundle.db")
    assert exported.returncode == 0, exported.stderr
    assert list((CHROOT / "tmp/bundle-parquet").rglob("*.parquet")), exported.stdout
    for n in ("00", "01"):
        r = in_chroot("recorder", "export", "--parquet", f"{job}/parquet", "--db", f"{job}/node-{n}.db")
        assert r.returncode == 0, r.stderr
    explained = in_chroot("recorder", "cluster", "explain", f"{job}/parquet")
    assert explained.returncode == 0, explained.stderr
    assert "Late: rank 3 on node-01" in explained.stdout, explained.stdout


def test_export_to_an_object_store_and_cluster_explain_from_it_with_the_bundle(job, s3):
    """pyarrow's S3 file system from the bundle, against an S3-compatible server on 127.0.0.1."""
    url = f"s3://fleet/bundle-{uuid.uuid4().hex[:8]}"
    for n in ("00", "01"):
        r = in_chroot("recorder", "export", "--parquet", url, "--db", f"{job}/node-{n}.db", env=s3["env"])
        assert r.returncode == 0, r.stderr
    explained = in_chroot("recorder", "cluster", "explain", url, env=s3["env"])
    assert explained.returncode == 0, explained.stderr
    assert "Late: rank 3 on node-01" in explained.stdout, explained.stdout
