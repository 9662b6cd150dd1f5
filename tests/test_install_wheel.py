"""The project as users install it: the sdist and the wheel built from the checkout (`python -m build`,
the wheel from the sdist), their file lists against the source tree walked on its own, and the wheel
installed into a fresh venv outside the checkout, whose `recorder` runs `demo`, `doctor`, `record` and
`explain` from another folder, with nothing of the checkout on its path.

The fresh venv is made as docs and users make one for the recorder (from /usr/bin/python3 with
--system-site-packages, so the distribution's bcc imports). The project's runtime packages come from
the test environment's own site-packages, seen through a folder of links that leaves out the project
itself: pip resolves the wheel's requirements against them, offline. `built_dist()` is shared with
tests/test_bundle.py, which builds the offline bundle from the same wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q

PACKAGES = ("recorder", "store", "mcp_server", "bpf")
SYSTEM_PYTHON = Path("/usr/bin/python3")


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path
    seconds: float  # how long building both (or finding them built) took


_BUILT: dict[str, Dist] = {}


def built_dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """The sdist and the wheel, built as `python -m build` builds them (the wheel from the unpacked
    sdist), offline (--no-isolation: this environment's setuptools), from a copy of the source tree:
    what the checkout's own build outputs (build/, *.egg-info) hold cannot leak into them. Built once
    per source tree: they are kept in build/test-dist/ under a digest of every source file's path and
    content, the interpreter and setuptools, so `make test`'s two pytest runs (and a rerun of an
    unchanged tree) share one build, and any change to a source file builds them again."""
    if "dist" not in _BUILT:
        pytest.importorskip("build", reason="needs the build frontend (scripts/setup.sh --test installs it)")
        import hashlib
        from importlib.metadata import version

        t0 = time.monotonic()
        files = sorted(source_files())
        digest = hashlib.sha256(f"{sys.version}\0{version('setuptools')}\0".encode())
        for f in files:
            path = ROOT / f
            digest.update(f"{f}\0".encode())
            digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
            digest.update(b"\0")
        kept = ROOT / "build" / "test-dist" / digest.hexdigest()[:20]
        if not (kept / "done").exists():
            src = tmp_path_factory.mktemp("src")
            for f in files:
                (src / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, src / f, follow_symlinks=False)
            out = tmp_path_factory.mktemp("dist")
            r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            (out / "done").write_text("")
            for older in kept.parent.glob("*"):  # the builds of earlier trees
                shutil.rmtree(older, ignore_errors=True)
            staged = kept.with_name(f".{kept.name}.{os.getpid()}")
            shutil.copytree(out, staged)
            try:
                os.replace(staged, kept)
            except OSError:  # another run kept the same build meanwhile
                shutil.rmtree(staged)
        (sdist,) = kept.glob("stall_recorder-*.tar.gz")
        (wheel,) = kept.glob("stall_recorder-*.whl")
        _BUILT["dist"] = Dist(sdist, wheel, time.monotonic() - t0)
    return _BUILT["dist"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Dist:
    return built_dist(tmp_path_factory)


def source_files() -> set[str]:
    """Every file of the checkout that git would take (tracked, or new and not ignored), found by
    walking the folders: the oracle the sdist and the wheel are held to."""
    ignored = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--ignored", "--exclude-standard",
                              "--directory", "-z"], capture_output=True, text=True)
    if ignored.returncode:
        pytest.skip(f"needs a git checkout to tell sources from build outputs: {ignored.stderr.strip()}")
    skip = {p.rstrip("/") for p in ignored.stdout.split("\0") if p}
    files = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if d != ".git" and (rel / d).as_posix() not in skip]
        # (.git is a file in a worktree)
        files |= {(rel / f).as_posix() for f in filenames if f != ".git" and (rel / f).as_posix() not in skip}
    return files


def test_the_wheel_holds_every_package_and_data_file_of_the_tree(dist):
    names = set(zipfile.ZipFile(dist.wheel).namelist())
    package_files = {f for f in source_files() if f.split("/", 1)[0] in PACKAGES}
    # every module, every package's __init__.py, every SQL file, BPF program and header
    assert {f for f in package_files if f.endswith(".py")} > {"recorder/cli.py", "store/analysis/kinds/__init__.py"}
    assert sorted(package_files - names) == []
    # every C extension beside its module's package (bpf/ holds BPF programs, not extensions), built
    extensions = [f[: -len(".c")] for f in package_files
                  if f.endswith(".c") and not f.endswith(".bpf.c") and not f.startswith("bpf/")]
    assert extensions and all(any(n.startswith(e + ".cpython-") and n.endswith(".so") for n in names)
                              for e in extensions), extensions
    # and nothing else: no tests, no build folders, no bytecode
    dist_info = {n for n in names if n.startswith("stall_recorder-") and ".dist-info/" in n}
    built = {n for n in names if n.endswith(".so")}
    assert sorted(names - package_files - dist_info - built) == []
    entry_points = zipfile.ZipFile(dist.wheel).read(next(n for n in dist_info if n.endswith("entry_points.txt")))
    assert b"recorder = recorder.cli:main" in entry_points


def test_the_sdist_holds_the_whole_source_tree(dist):
    with tarfile.open(dist.sdist) as tar:
        top = f"{dist.sdist.name.removesuffix('.tar.gz')}/"
        names = {m.name.removeprefix(top) for m in tar.getmembers() if m.isfile()}
    tree = source_files()
    assert {"pyproject.toml", "setup.py", "MANIFEST.in", "tests/conftest.py", "docs/deploy.md"} <= tree
    assert sorted(tree - names) == []
    # what setuptools adds, and nothing else (no bytecode, no extension built in place, no recording)
    extra = names - tree
    assert all(n in ("PKG-INFO", "setup.cfg") or n.startswith("stall_recorder.egg-info/") for n in extra), extra


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel installed by pip, offline."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip("needs /usr/bin/python3, the interpreter the distribution's bcc is built for")
    base = tmp_path_factory.mktemp("installed")
    venv = base / "venv"
    # without pip of its own (ensurepip takes seconds): this environment's pip installs into it (--python)
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=300)
    # the runtime packages: this environment's, linked one by one, the project itself left out
    deps = base / "deps"
    deps.mkdir()
    for site in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}:
        for entry in Path(site).iterdir():
            if entry.name.startswith(("stall_recorder", "__editable__")) or entry.name.endswith(".pth") \
                    or entry.name in PACKAGES or (deps / entry.name).exists():
                continue
            (deps / entry.name).symlink_to(entry)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    venv_site = Path(subprocess.run([str(venv / "bin/python"), "-c", where], capture_output=True, text=True,
                                    check=True).stdout.strip())
    (venv_site / "zz-runtime-packages.pth").write_text(f"{deps}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--no-index",
                        "--disable-pip-version-check", str(dist.wheel)], capture_output=True, text=True, timeout=300,
                       cwd=base)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Successfully installed stall-recorder" in r.stdout, r.stdout
    return venv


def run_installed(venv: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`recorder ARGS` as a user's shell runs it: the venv's bin on PATH, no PYTHONPATH, another folder."""
    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(cwd),
           "LANG": "C.UTF-8"}
    return subprocess.run(["recorder", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    assert not tmp_path.is_relative_to(ROOT)
    return tmp_path


def test_the_installed_package_is_imported_from_the_venv_with_nothing_of_the_checkout(venv, elsewhere):
    code = ("import sys, recorder, store.analysis.kinds, mcp_server, bpf\n"
            "print(recorder.__file__); print(bpf.BPF_DIR); print('\\n'.join(p for p in sys.path if p))")
    r = subprocess.run([str(venv / "bin/python"), "-c", code], cwd=elsewhere, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    module, bpf_dir, *path = r.stdout.splitlines()
    assert Path(module).is_relative_to(venv) and Path(bpf_dir).is_relative_to(venv), r.stdout
    assert (Path(bpf_dir) / "sched.bpf.c").is_file()
    assert [p for p in path if Path(p).resolve().is_relative_to(ROOT)] == []


def test_demo_and_explain_from_the_installed_package(venv, elsewhere):
    listed = run_installed(venv, elsewhere, "demo", "--no-gpu", "--list")
    assert listed.returncode == 0, listed.stderr
    scenario = listed.stdout.split()[0]
    demo = run_installed(venv, elsewhere, "demo", "--no-gpu", scenario, "--db", "demo.db")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert (elsewhere / "demo.db").is_file()
    explained = run_installed(venv, elsewhere, "explain", "--db", "demo.db")
    assert explained.returncode == 0, explained.stderr
    assert "Primary cause" in explained.stdout, explained.stdout


def test_doctor_from_the_installed_package(venv, elsewhere):
    r = run_installed(venv, elsewhere, "doctor")
    assert "Traceback" not in r.stderr, r.stderr
    checks = dict(line.split(None, 1) for line in r.stdout.splitlines() if line.startswith(("ok ", "warn ", "FAIL ")))
    # the checks that read the package's own files and modules ran (BCC as the distribution installs it)
    assert any(line.startswith("ok   bcc: bcc ") for line in r.stdout.splitlines()), r.stdout
    assert "tracepoint sched:sched_switch: present" in r.stdout or os.geteuid() != 0, r.stdout
    assert r.returncode == (0 if "FAIL" not in checks else 1), r.stdout


@needs_bpf
def test_record_and_explain_from_the_installed_package(venv, elsewhere):
    workload = "import time\nfor _ in range(20):\n    sum(range(200000)); time.sleep(0.01)\nprint('workload done')\n"
    (elsewhere / "work.py").write_text(workload)
    recorded = run_installed(venv, elsewhere, "record", "--db", "run.db", "--", "/usr/bin/python3", "work.py",
                             timeout=300)
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    assert "workload done" in recorded.stdout
    attached = dict(q(elsewhere / "run.db", "SELECT layer, count(*) FROM capability WHERE status = 'attached' "
                                            "GROUP BY layer"))
    assert attached.get("sched", 0) > 0, attached
    explained = run_installed(venv, elsewhere, "explain", "--db", "run.db")
    assert explained.returncode == 0, explained.stderr
    observed = [line for line in explained.stdout.splitlines() if line.startswith("Observed: ")]
    assert observed and "scheduler" in observed[0], explained.stdout
