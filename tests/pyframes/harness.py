"""Shared by the pystack tests and benchmark: the BPF program the recorder would build around
bpf/pystack.h (a uprobe that emits its own call record, then PYSTACK_CAPTURE), and helpers to run
tests/pyframes/workload.py under a given interpreter."""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BPF_DIR = ROOT / "bpf"
WORKLOAD = Path(__file__).resolve().parent / "workload.py"

# The CPythons the frame walker supports, each run by the walker and marker tests. "3.X" is a CPython
# 3.X built from its release (pyenv's, as a GPU node's venv has) or else the distribution's;
# "debian-3.11" is Debian 12's own build (its python3), whose layout and symbols differ from a
# release build's. scripts/setup.sh --test installs what the distribution packages; a version
# found nowhere is a test case that skips and says how to get it (INTERPRETER_SKIPS).
VERSIONS = ("3.10", "3.11", "3.12", "3.13")
# the releases these tests were written against, preferred where pyenv has several of a version
PREFERRED = {"3.10": "3.10.13", "3.11": "3.11.7", "3.12": "3.12.1", "3.13": "3.13.0"}
DISTRIBUTION = {"debian-3.11": "/usr/bin/python3.11"}


def _pyenv_roots() -> list[Path]:
    """$PYENV_ROOT where set (as pyenv itself reads it), else ~/.pyenv and root's."""
    if os.environ.get("PYENV_ROOT"):
        return [Path(os.environ["PYENV_ROOT"])]
    return list(dict.fromkeys(Path(r) for r in (os.path.expanduser("~/.pyenv"), "/root/.pyenv")))


def _release_key(path: Path) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else -1 for x in path.parents[1].name.split("."))


def find_cpython(version: str) -> str | None:
    """An executable CPython `version` ('3.12'): pyenv's (the preferred release, else the newest),
    else the distribution's /usr/bin/python3.X, else /usr/local/bin's."""
    for root in _pyenv_roots():
        found = sorted((p for p in root.glob(f"versions/{version}.*/bin/python{version}") if os.access(p, os.X_OK)),
                       key=_release_key)
        preferred = [p for p in found if p.parents[1].name == PREFERRED[version]]
        if preferred or found:
            return str((preferred or found)[-1])
    for folder in ("/usr/bin", "/usr/local/bin"):
        if os.access(f"{folder}/python{version}", os.X_OK):
            return f"{folder}/python{version}"
    return None


def find_interpreters() -> tuple[dict[str, str], dict[str, str]]:
    """({key: executable} of every key: the interpreter found, else where pyenv would install it;
    {key: why it is not run} of those not found or found under another key)."""
    paths: dict[str, str] = {}
    skips: dict[str, str] = {}
    for version in VERSIONS:
        path = find_cpython(version)
        paths[version] = path or str(_pyenv_roots()[0] / "versions" / PREFERRED[version] / "bin" / f"python{version}")
        if path is None:
            skips[version] = (f"CPython {version} is not installed: scripts/setup.sh --test installs python{version} "
                              f"where the distribution packages it; elsewhere `pyenv install {PREFERRED[version]}`")
        elif path in DISTRIBUTION.values():
            key = next(k for k, v in DISTRIBUTION.items() if v == path)
            skips[version] = f"CPython {version} here is the distribution's {path}, run as {key}"
    for key, path in DISTRIBUTION.items():
        paths[key] = path
        if not os.access(path, os.X_OK):
            skips[key] = f"{path} is not installed (the distribution's CPython 3.11, Debian 12's python3)"
    return paths, skips


INTERPRETERS, INTERPRETER_SKIPS = find_interpreters()


def interpreter_params(keys: tuple[str, ...] | None = None) -> list[Any]:
    """pytest parameters, one per interpreter key (all of them unless `keys`): those not installed
    are collected and skip with the reason, so no case vanishes from a run."""
    import pytest

    out = []
    for key in keys or (*VERSIONS, *DISTRIBUTION):
        reason = INTERPRETER_SKIPS.get(key)
        out.append(pytest.param(key, id=key, marks=pytest.mark.skip(reason=reason)) if reason else key)
    return out


def version_params() -> list[Any]:
    """pytest parameters, one per supported version, run with whichever build find_cpython finds."""
    import pytest

    return [pytest.param(v, id=v, marks=pytest.mark.skip(reason=INTERPRETER_SKIPS.get(v, "")))
            if find_cpython(v) is None else v for v in VERSIONS]


# The probe a recorder layer would write: its own record first, the stack capture last. BCC
# rewrites map syntax (map.lookup(), .call()) only in the main text, so the loader pastes
# pystack.h's text in front rather than #include-ing it; so do we.
PROBE_TEXT = r"""

struct call_event {
    u64 ts;
    u64 seq;     /* cudaMalloc's size argument: the workload's sequence number */
    u32 pid;
    u32 tid;
};
BPF_RINGBUF_OUTPUT(calls, 64);

int on_call(struct pt_regs *ctx)
{
    u64 ts = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    struct call_event *e = calls.ringbuf_reserve(sizeof(*e));
    if (e) {
        e->ts = ts;
        e->seq = PT_REGS_PARM2(ctx);
        e->pid = id >> 32;
        e->tid = (u32)id;
        calls.ringbuf_submit(e, 0);
    }
    PYSTACK_CAPTURE(ctx, ts);
}

int on_call_empty(struct pt_regs *ctx) { return 0; }
int on_return_empty(struct pt_regs *ctx) { return 0; }
"""


class CallEvent(ctypes.Structure):
    _fields_ = [("ts", ctypes.c_uint64), ("seq", ctypes.c_uint64), ("pid", ctypes.c_uint32),
                ("tid", ctypes.c_uint32)]


def ensure_kernel_headers() -> None:
    """BCC needs one header tree; build a symlink farm from Debian's split packages if unset."""
    if os.environ.get("BCC_KERNEL_SOURCE"):
        return
    try:
        from recorder.core import kheaders  # the recorder's own helper, when present

        kheaders.locate(prepare=True)
        if os.environ.get("BCC_KERNEL_SOURCE"):
            return
    except (ImportError, AttributeError, OSError):
        pass
    common = sorted(glob.glob("/usr/src/linux-headers-*-common"))
    if not common:
        return
    arch = [d for d in glob.glob(common[-1].replace("-common", "-*")) if d != common[-1]]
    tree = Path(tempfile.gettempdir()) / "pystack-khdr"
    if not (tree / "include").exists():
        tree.mkdir(exist_ok=True)
        subprocess.run(["cp", "-rs", f"{common[-1]}/.", f"{tree}/"], check=True)
        if arch:
            subprocess.run(["cp", "-rsf", f"{arch[0]}/.", f"{tree}/"], check=True)
    os.environ["BCC_KERNEL_SOURCE"] = str(tree)


def bpf_unavailable() -> str | None:
    """Why real-probe tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for BPF"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc not importable (install python3-bpfcc; use a --system-site-packages venv)"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "kernel has no BTF (/sys/kernel/btf/vmlinux)"
    return None


def load_probe(lib: Path, empty_pair: bool = False) -> Any:
    """Compile PROBE_TEXT with bpf/pystack.h and attach it to lib's cudaMalloc."""
    from bcc import BPF

    ensure_kernel_headers()
    from recorder.core.pyframes import bpf_source

    text = bpf_source() + PROBE_TEXT
    bpf = BPF(text=text, cflags=["-Wno-unused-function"])
    if empty_pair:
        bpf.attach_uprobe(name=str(lib), sym="cudaMalloc", fn_name="on_call_empty")
        bpf.attach_uretprobe(name=str(lib), sym="cudaMalloc", fn_name="on_return_empty")
    else:
        bpf.attach_uprobe(name=str(lib), sym="cudaMalloc", fn_name="on_call")
    return bpf


def build_native(out: Path, python: str) -> tuple[Path, Path]:
    """(libcudart.so.12, folder holding _gilcall for `python`) from tests/native/native_libs.py."""
    sys.path.insert(0, str(ROOT / "tests" / "native"))  # not a package
    try:
        import native_libs as build  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    libs = build.build_libraries(out)
    return libs["libcudart.so.12"], build.build_gil_extension(python, out)


@dataclass
class Workload:
    proc: subprocess.Popen[str]
    truth_path: Path
    truth: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait_line(self, expected: str, timeout: float = 60) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != expected:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"workload said {line!r}, expected {expected!r}: {err}")

    def finish(self) -> None:
        self.go()
        self.proc.wait(timeout=30)


def start_workload(python: str, lib: Path, gildir: Path, out: Path, mode: str) -> Workload:
    truth = out / f"truth-{mode}-{os.getpid()}-{Path(python).name}.json"
    proc = subprocess.Popen(
        [python, str(WORKLOAD), str(lib), str(gildir), str(truth), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    w = Workload(proc, truth)
    w.wait_line("ready")
    return w
