"""The architecture's rules hold and are enforced: the import contracts (lint-imports) fail on a
cycle or a forbidden import added on purpose, every layer is under the contracts, and every layer
implements the Layer contract."""

from __future__ import annotations

import inspect
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

import recorder.layers
from recorder.core.layer import BaseLayer, Layer

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
    assert "6 kept, 0 broken" in clean.stdout

    cycle = copy_of_the_tree(tmp_path / "cycle")
    with (cycle / "recorder/core/clock.py").open("a") as f:
        f.write("\nfrom recorder.core import capability  # noqa: E402,F401\n")
    with (cycle / "recorder/core/capability.py").open("a") as f:
        f.write("\nfrom recorder.core import clock  # noqa: E402,F401\n")
    broken = lint_imports(cycle)
    assert broken.returncode != 0
    assert "No cycles are allowed in recorder.core" in broken.stdout, broken.stdout

    reach = copy_of_the_tree(tmp_path / "reach")
    with (reach / "recorder/layers/sched.py").open("a") as f:
        f.write("\nimport recorder.session  # noqa: E402,F401\nfrom recorder.layers import cuda  # noqa: E402,F401\n")
    broken = lint_imports(reach)
    assert broken.returncode != 0
    out = broken.stdout
    assert "Layers never import each other BROKEN" in out
    assert "Layers never import the session or the commands BROKEN" in out
    assert "recorder.layers.sched -> recorder.session" in out and "recorder.layers.sched -> recorder.layers.cuda" in out


def layer_modules() -> list[str]:
    return sorted(f"recorder.layers.{m.name}" for m in pkgutil.iter_modules(recorder.layers.__path__))


def test_every_layer_is_under_the_independence_contract() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    independent = next(c["modules"] for c in contracts if c["type"] == "independence")
    assert sorted(independent) == layer_modules()


def test_every_layer_class_implements_the_contract() -> None:
    import importlib

    found = {}
    for name in layer_modules():
        module = importlib.import_module(name)
        for sub in pkgutil.iter_modules(getattr(module, "__path__", [])):
            importlib.import_module(f"{name}.{sub.name}")
    for cls in BaseLayer.__subclasses__():
        found[cls.__name__] = cls
        members = [m for m in dir(Layer) if not m.startswith("_")]
        for member in members:
            assert hasattr(cls, member), (cls, member)
        assert cls.name, cls
        for source in cls.sources:
            assert (ROOT / "bpf" / source.filename).exists(), source
        assert inspect.signature(cls.flush).parameters.keys() == {"self"}
    # every per-probe drop counter belongs to exactly one layer
    from recorder.core import events

    declared = [name for cls in found.values() for name in cls.losses]
    assert len(declared) == len(set(declared))
    assert set(events.PROBE_NAMES.values()) <= set(declared), set(events.PROBE_NAMES.values()) - set(declared)
    assert set(found) == {"SchedLayer", "TaskLayer", "CudaLayer", "IoLayer", "CheckpointLayer", "WorkloadLayer",
                          "KernelLog", "GpuLayer"}
