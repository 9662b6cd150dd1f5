"""Builds the stand-in CUDA libraries and the GIL-holding extension with gcc.

    python tests/native/native_libs.py [OUTDIR]            # libcudart.so.12, libcuda.so.1, ...
    build_gil_extension(python_exe, outdir)           # _gilcall for one interpreter

Outputs are rebuilt only when a source is newer. Used by the tests, the benchmarks and `make demo`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent.parent / "build" / "native"

LIBRARIES = {
    # output name: (source, soname)
    "libcudart.so.12": ("cudart.c", "libcudart.so.12"),
    "libcuda.so.1": ("cuda.c", "libcuda.so.1"),
    "libnccl.so.2": ("nccl.c", "libnccl.so.2"),
    "libnvidia-ml.so.1": ("nvml.c", "libnvidia-ml.so.1"),
}


def _tmp(target: Path) -> Path:
    """Where `target` is built before its atomic rename: a name of this process's own, as two test
    workers (pytest-xdist) may build the same output at once."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _stale(target: Path, sources: list[Path]) -> bool:
    return not target.exists() or any(s.stat().st_mtime > target.stat().st_mtime for s in sources)


def _gcc(args: list[str]) -> None:
    result = subprocess.run(["gcc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"gcc {' '.join(args)} failed:\n{result.stderr}")


def build_libraries(out: Path = DEFAULT_OUT) -> dict[str, Path]:
    """Build every stand-in library; return {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name, (source, soname) in LIBRARIES.items():
        target = out / name
        sources = [HERE / source, HERE / "standin.h"]
        if _stale(target, sources):
            tmp = _tmp(target)
            _gcc(["-O1", "-g", "-fno-omit-frame-pointer", "-fPIC", "-shared", f"-Wl,-soname,{soname}", "-o", str(tmp),
                  str(HERE / source), "-lrt", "-ldl"])
            tmp.replace(target)  # atomic: a running process keeps its old mapping
        built[name] = target
    return built


def build_trap_library(out: Path = DEFAULT_OUT) -> Path:
    """The stand-in libcuda.so.1 whose launch entry points begin with a RIP-relative load
    (cuda_trap.c), in a folder of its own (`out`/trap) so it does not shadow the other stand-in."""
    folder = out / "trap"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "libcuda.so.1"
    sources = [HERE / "cuda_trap.c", HERE / "standin.h"]
    if _stale(target, sources):
        tmp = target.with_suffix(".tmp")
        _gcc(["-O1", "-g", "-fno-omit-frame-pointer", "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(tmp),
              str(HERE / "cuda_trap.c"), "-lrt", "-ldl"])
        tmp.replace(target)
    return target


def build_busy_loop(out: Path = DEFAULT_OUT) -> Path:
    """The CPU hog used to create contention; its name (comm) is busy_loop."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "busy_loop"
    if _stale(target, [HERE / "busy_loop.c"]):
        tmp = _tmp(target)
        _gcc(["-O1", "-o", str(tmp), str(HERE / "busy_loop.c")])
        tmp.replace(target)
    return target


def build_gil_extension(python: str = sys.executable, out: Path = DEFAULT_OUT) -> Path:
    """Build _gilcall for the given interpreter; return the folder to put on sys.path."""
    info = subprocess.run(
        [python, "-c", "import sysconfig as s; print(s.get_paths()['include']);"
         "print(s.get_config_var('EXT_SUFFIX'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")
    include, suffix = info[0], info[1]
    folder = out / ("ext-" + suffix.strip(".").replace(".so", ""))
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"_gilcall{suffix}"
    if _stale(target, [HERE / "gilcall.c"]):
        tmp = _tmp(target)
        _gcc(["-O1", "-g", "-fPIC", "-shared", f"-I{include}", "-o", str(tmp),
              str(HERE / "gilcall.c"), "-ldl"])
        tmp.replace(target)
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for name, path in build_libraries(out).items():
        print(f"{name}: {path}")
    print(f"busy_loop: {build_busy_loop(out)}")
    print(f"_gilcall: {build_gil_extension(sys.executable, out)}")
