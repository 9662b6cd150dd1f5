"""The architecture's rules hold and are enforced: the import contracts (lint-imports) fail on a
cycle or a forbidden import added on purpose, every layer is under the contracts, every layer
implements the Layer contract, the session names none, and adding one touches only the files the
checklist of docs/architecture.md names."""

from __future__ import annotations

import hashlib
import inspect
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf, q

import recorder.layers
from recorder.core import events
from recorder.core.layer import BaseLayer, Layer, Phase
from recorder.layers import LAYERS, definitions

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
needs_linter = pytest.mark.skipif(not LINT_IMPORTS.exists(),
                                  reason="import-linter is not installed (pip install -e '.[test]')")


def copy_of_the_tree(tmp_path: Path) -> Path:
    """The Python packages and pyproject.toml in a folder of their own, to break on purpose."""
    for name in ("recorder", "store", "mcp_server", "bpf"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.c",
                                                                                     "*.sql", "*.h"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    # cwd first on the path, so the copy is analysed and not the installed tree
    return subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                           "from importlinter.cli import lint_imports_command; lint_imports_command()", "--no-cache"],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


@needs_linter
def test_the_contracts_hold_and_fail_on_a_cycle_or_a_forbidden_import(tmp_path: Path) -> None:
    clean = lint_imports(copy_of_the_tree(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "7 kept, 0 broken" in clean.stdout

    cycle = copy_of_the_tree(tmp_path / "cycle")
    with (cycle / "recorder/core/clock.py").open("a") as f:
        # type-only on this side: a circle the type checker follows counts too
        f.write("\nfrom typing import TYPE_CHECKING  # noqa: E402\nif TYPE_CHECKING:\n"
                "    from recorder.core import capability  # noqa: F401\n")
    with (cycle / "recorder/core/capability.py").open("a") as f:
        f.write("\nfrom recorder.core import clock  # noqa: E402,F401\n")
    broken = lint_imports(cycle)
    assert broken.returncode != 0
    assert "No cycles are allowed in recorder.core" in broken.stdout, broken.stdout

    reach = copy_of_the_tree(tmp_path / "reach")
    with (reach / "recorder/layers/sched.py").open("a") as f:
        f.write("\nimport recorder.session  # noqa: E402,F401\nfrom recorder.layers import cuda  # noqa: E402,F401\n")
    with (reach / "recorder/flight/triggers.py").open("a") as f:  # the flight recorder reading a layer's table
        f.write("\nfrom recorder.layers.cuda import apis  # noqa: E402,F401\n")
    broken = lint_imports(reach)
    assert broken.returncode != 0
    out = broken.stdout
    assert "Layers never import each other BROKEN" in out
    assert "Layers never import the session or the commands BROKEN" in out
    assert "recorder.layers.sched -> recorder.session" in out and "recorder.layers.sched -> recorder.layers.cuda" in out
    assert "The session's participants know no layer" in out and "recorder.flight.triggers -> recorder.layers" in out

    upward = copy_of_the_tree(tmp_path / "upward")
    with (upward / "store/analysis/hangs.py").open("a") as f:
        f.write("\nfrom store.report import build  # noqa: E402,F401\n")
    broken = lint_imports(upward)
    assert broken.returncode != 0
    assert "The store's roles" in broken.stdout and "BROKEN" in broken.stdout, broken.stdout
    assert "store.analysis.hangs -> store.report.build" in broken.stdout, broken.stdout


def layer_modules() -> list[str]:
    return sorted(f"recorder.layers.{m.name}" for m in pkgutil.iter_modules(recorder.layers.__path__))


def test_every_layer_is_under_the_independence_contract() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    independent = next(c["modules"] for c in contracts if c["type"] == "independence")
    assert independent == ["recorder.layers.*"]  # a new layer is under it without a line of its own
    # and every layer module holds a class of the registry
    homes = {cls.__module__.split(".")[2] for cls in LAYERS}
    assert homes == {m.removeprefix("recorder.layers.") for m in layer_modules()}


def test_every_layer_class_implements_the_contract() -> None:
    members = [m for m in dir(Layer) if not m.startswith("_")]
    for cls in LAYERS:
        assert issubclass(cls, BaseLayer)
        for member in members:
            assert hasattr(cls, member), (cls, member)
        assert cls.name, cls
        assert isinstance(cls.flush_phase, Phase), cls
        for source in cls.sources:
            assert (ROOT / "bpf" / source.filename).exists(), source
        assert inspect.signature(cls.flush).parameters.keys() == {"self"}
    # every per-probe drop counter belongs to exactly one layer, which declares what it means
    declared = [loss.probe for cls in LAYERS for loss in cls.losses]
    assert len(declared) == len(set(declared))
    assert set(definitions().probe_names) <= set(declared), set(definitions().probe_names) - set(declared)
    # and every capability word a report lists to exactly one, which says what it observes
    words = [word.layer for cls in LAYERS for word in cls.observes]
    assert len(words) == len(set(words)) and all(word.what for cls in LAYERS for word in cls.observes)
    # the core's records are the shared constants only; every struct is a layer's
    assert {name for name in events.CONSTANTS} == {"MODE_PIDS", "MODE_CGROUP", "MODE_ALL"}
    assert not [name for name in vars(events) if isinstance(vars(events)[name], events.Layout)]


def test_the_session_names_no_layer() -> None:
    """The session drives the registry through the contract: no layer class, module or attribute by name."""
    text = (ROOT / "recorder" / "session.py").read_text()
    for cls in LAYERS:
        assert cls.__name__ not in text, cls
    names = [cls.name for cls in LAYERS] + ["gpu", "io", "cuda", "workload", "checkpoints", "kernel_log"]
    assert not [n for n in names if f"self.{n}." in text or f"self.{n} " in text]
    assert "recorder.layers." not in text


# -- adding a layer, as docs/architecture.md says: a layer recording the targets' execve calls -----------
NEW_LAYER = '''"""The targets' execve calls (a layer added by tests/test_architecture.py)."""

from __future__ import annotations

from pathlib import Path

from recorder.core.events import Layout, Loss, Records
from recorder.core.layer import BaseLayer, BpfSource, Context, Observation, Phase, Sink

EXECVE = Layout("execve_event", (("ts", "u64"), ("pid", "u32"), ("tid", "u32")), "one execve call of a target")
RECORDS = Records((EXECVE,), {}, (
    ("PROBE_EXECVE", Loss("execve ring buffer", "execve", "execve calls", "ring buffer full")),))


class ExecveLayer(BaseLayer):
    name = "execve"
    sources = (BpfSource("execve", str(Path(__file__).with_name("execve.bpf.c")), ("syscalls:sys_enter_execve",)),)
    records = RECORDS
    tables = ("execve_call",)
    losses = RECORDS.losses()
    observes = (Observation("execve", "execve calls"),)
    flush_phase = Phase.THREADS

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.raw: list[bytes] = []

    def prepare(self) -> None:
        self.context.writer.table("execve_call", ("session_id", "ts", "pid", "tid"))

    def sinks(self) -> dict[str, Sink]:
        return {"execve_events": self.raw.append}

    def flush(self) -> None:
        rows = [(self.context.session_id, *EXECVE.unpack(record)) for record in self.raw]
        self.raw.clear()
        self.context.writer.extend("execve_call", rows)
'''
NEW_BPF = """BPF_RINGBUF_OUTPUT(execve_events, 8);

TRACEPOINT_PROBE(syscalls, sys_enter_execve)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    struct execve_event *e = execve_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(PROBE_EXECVE);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->pid = id >> 32;
    e->tid = (u32)id;
    execve_events.ringbuf_submit(e, 0);
    return 0;
}
"""
NEW_SQL = """-- table: execve_call
-- One execve call of a target.
CREATE TABLE execve_call (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns CLOCK_MONOTONIC at the call's entry
    pid INTEGER NOT NULL,               -- tgid of the caller
    tid INTEGER NOT NULL                -- the calling thread
);
"""


def checklist() -> list[str]:
    """The paths the numbered items of docs/architecture.md's "Adding a layer" start with."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Adding a layer\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.M)


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def added_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, str]]:
    """A copy of the tree with the execve layer added by following the checklist: (copy, digests
    before, digests after)."""
    root = tmp_path_factory.mktemp("tree")
    for name in ("recorder", "store", "mcp_server", "bpf"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    before = tree_digest(root)
    package = root / "recorder" / "layers" / "execve"
    package.mkdir()
    (package / "__init__.py").write_text(NEW_LAYER)
    (package / "execve.bpf.c").write_text(NEW_BPF)
    number = max(int(p.name.split("_", 1)[0]) for p in (root / "store" / "migrations").glob("*.sql")) + 1
    (root / "store" / "migrations" / f"{number:04d}_execve.sql").write_text(NEW_SQL)
    registry = root / "recorder" / "layers" / "__init__.py"
    text = registry.read_text()
    cuda = "from recorder.layers.cuda.layer import CudaLayer\n"
    text = text.replace(cuda, cuda + "from recorder.layers.execve import ExecveLayer\n")
    text = re.sub(r"(LAYERS = .*?\n)(\))", r"\1    ExecveLayer,\n\2", text, count=1, flags=re.S)
    assert "    ExecveLayer,\n)" in text
    registry.write_text(text)
    return root, before, tree_digest(root)


def test_adding_a_layer_touches_only_what_the_checklist_names(added_layer) -> None:
    root, before, after = added_layer
    touched = {path for path in after if before.get(path) != after[path]} | (before.keys() - after.keys())
    named = checklist()
    assert len(named) == 3, named
    patterns = [re.escape(n).replace(re.escape("<name>"), "execve").replace("NNNN", r"\d{4}") for n in named]
    unnamed = [path for path in touched if not any(re.match(p + ("" if p.endswith("/") else "$"), path)
                                                   for p in patterns)]
    assert unnamed == [], unnamed
    assert all(any(re.match(p, path) for path in touched) for p in patterns), (patterns, touched)
    # the import contracts hold for the new layer with no edit to them
    if LINT_IMPORTS.exists():
        linted = lint_imports(root)
        assert linted.returncode == 0 and "0 broken" in linted.stdout, linted.stdout + linted.stderr


@needs_bpf
def test_the_session_runs_an_added_layer(added_layer, tmp_path: Path) -> None:
    """A recording made with the copy: the new layer's BPF is compiled and attached, its rows land,
    and its loss and capability words are in the recording for the report, which lists it observed."""
    root = added_layer[0]
    db = tmp_path / "execve.db"
    env = {**os.environ, "PYTHONPATH": str(root), "STALL_RECORDER_GPU_INTERVAL_MS": "0"}
    run = subprocess.run([sys.executable, "-m", "recorder", "record", "--db", str(db), "--",
                          "/bin/sh", "-c", "/bin/true; /bin/true"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert q(db, "SELECT status FROM capability WHERE layer = 'execve' AND probe = 'syscalls:sys_enter_execve'") == [
        ("attached",)]
    calls = q(db, "SELECT pid FROM execve_call")
    assert len(calls) >= 2, calls  # the command's own exec, then a child's at least
    processes = {pid for (pid,) in q(db, "SELECT pid FROM process")}
    assert {pid for (pid,) in calls} <= processes
    assert q(db, "SELECT layer, what, why FROM layer_vocabulary WHERE word = 'execve ring buffer'") == [
        ("execve", "execve calls", "ring buffer full")]
    assert q(db, "SELECT layer, what FROM layer_vocabulary WHERE kind = 'capability' AND word = 'execve'") == [
        ("execve", "execve calls")]
    explain = subprocess.run([sys.executable, "-m", "recorder", "explain", "--db", str(db)], cwd=root, env=env,
                             capture_output=True, text=True, timeout=60)
    assert explain.returncode == 0, explain.stderr
    text = explain.stdout
    observed = next(line for line in text.splitlines() if line.startswith("Observed: "))
    assert observed.startswith("Observed: scheduler (off-CPU intervals)") and observed.endswith(", execve calls"), text


def test_the_package_layout_names_every_module() -> None:
    """docs/architecture.md's layout is complete: every module of recorder/, store/ and mcp_server/
    is named there (a new module goes into the layout with one line saying what it is for)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Package layout"):]
    layout = layout[:layout.index("\n```\n", layout.index("```") + 3)]
    unnamed = [str(f.relative_to(ROOT)) for pkg in ("recorder", "store", "mcp_server")
               for f in sorted((ROOT / pkg).rglob("*.py")) if f.name != "__init__.py" and f.name not in layout]
    assert not unnamed, f"add these to docs/architecture.md's package layout: {unnamed}"


def test_every_path_the_docs_name_exists() -> None:
    import re

    pattern = re.compile(r"(?<![\w/.-])((?:recorder|store|mcp_server|bpf|tests|benchmarks|scripts|kernel-patches"
                         r"|packaging)/[A-Za-z0-9_./-]*[A-Za-z0-9_])")
    missing = []
    for doc in sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]):
        for path in sorted(set(pattern.findall(doc.read_text()))):
            if "NNNN" in path or (ROOT / path).exists() or list(ROOT.glob(path + ".*")):
                continue
            missing.append(f"{doc.name}: {path}")
    assert not missing, missing
