"""Finding the libraries a process maps (CUDA, NCCL, the marker extension) and the symbols they export.

Libraries are recognised by file name here, once, so the loader, the layers and `recorder doctor`
agree on what a file is."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from elftools.common.exceptions import ELFError

from recorder.core.elfsyms import function_names


def cuda_library_kind(path: str) -> str | None:
    """'runtime', 'driver' or None for a mapped file name (handles versioned and hashed copies)."""
    base = path.rsplit("/", 1)[-1]
    if base.startswith("libcudart"):
        return "runtime"
    if base.startswith("libcuda.so") or base.startswith("libcuda-"):
        return "driver"
    return None


def workload_library_kind(path: str) -> str | None:
    """'nccl' for libnccl*, 'markers' for the recorder's marker extension, else None."""
    base = path.rsplit("/", 1)[-1]
    if base.startswith("libnccl"):
        return "nccl"
    if base.startswith("_markers") and base.endswith(".so") and "/recorder/" in path:
        return "markers"
    return None


def mapped_files(pid: int) -> list[str]:
    """Distinct file paths mapped executable by a process, in maps order; [] if it is gone."""
    out: list[str] = []
    seen = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or "x" not in parts[1]:
                    continue
                path = parts[5].strip()
                if path.startswith("/") and path not in seen:
                    seen.add(path)
                    out.append(path)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return out


def resolve(pid: int, path: str) -> str:
    """A path that opens the mapped file from here, also when the target is in another mount ns."""
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    if os.path.exists(path):
        return path
    via_root = f"/proc/{pid}/root{path}"
    return via_root if os.path.exists(via_root) else path


def gpu_libraries(pid: int) -> list[tuple[str, str]]:
    """(path, kind) of CUDA runtime/driver libraries mapped by pid."""
    out = []
    for path in mapped_files(pid):
        kind = cuda_library_kind(path)
        if kind:
            out.append((path, kind))
    return out


@functools.lru_cache(maxsize=256)
def exported_functions(path: str) -> frozenset[str]:
    """Names of the functions a shared object defines in its dynamic symbol table."""
    try:
        names = function_names(path, (".dynsym",))
    except (OSError, ELFError, ValueError):  # ValueError: SymbolTableError, or an empty file (not mapped)
        return frozenset()
    return frozenset(n.split("@", 1)[0] for n in names)


def find_libc(pid: int | None = None) -> str | None:
    """The C library of pid (or of this process), where dlopen lives."""
    for path in mapped_files(pid or os.getpid()):
        base = Path(path).name
        if base.startswith("libc.so") or base.startswith("libc-"):
            return path
    return None
