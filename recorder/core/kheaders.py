"""Kernel headers for BCC without writing into system folders.

BCC compiles its programs against the running kernel's headers (/lib/modules/$(uname -r)/build).
Where the distribution has no headers package for the running kernel, the recorder points BCC at the
distribution's generic headers through BCC_KERNEL_SOURCE: Debian splits them in a `-common` tree and
an architecture tree, so we join both in a folder of symbolic links under the cache. The BPF programs
never read kernel structs through these headers (their layouts are another kernel's); they use
tracepoint fields, helpers and user memory only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Headers:
    source: str  # 'running-kernel', 'environment', 'generic', 'none'
    path: str | None
    detail: str


def cache_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/cache/stall-recorder")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stall-recorder"


def _generic_pair() -> tuple[Path, Path] | None:
    """The newest Debian-style (common, arch) header tree pair under /usr/src."""
    src = Path("/usr/src")
    if not src.is_dir():
        return None
    pairs = []
    for common in src.glob("linux-headers-*-common"):
        prefix = common.name[: -len("common")]
        arches = [p for p in src.glob(prefix + "*") if p != common and (p / "Makefile").exists()]
        if arches:
            pairs.append((common, sorted(arches)[0]))
    if not pairs:
        # Ubuntu/Fedora-style single tree
        singles = [p for p in src.glob("linux-headers-*") if (p / "include").is_dir()]
        singles += [p for p in Path("/usr/src/kernels").glob("*")] if Path("/usr/src/kernels").is_dir() else []
        return (singles[-1], singles[-1]) if singles else None
    return sorted(pairs)[-1]


def locate(prepare: bool = True) -> Headers:
    """Find headers BCC can use; with `prepare`, build the joined tree and export BCC_KERNEL_SOURCE."""
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env:
        return Headers("environment", env, f"BCC_KERNEL_SOURCE={env}")
    release = os.uname().release
    build = Path(f"/lib/modules/{release}/build")
    if build.exists():
        return Headers("running-kernel", str(build), f"headers for {release}")
    pair = _generic_pair()
    if pair is None:
        return Headers(
            "none", None,
            f"no kernel headers: install linux-headers-{release} (or the distribution's generic "
            "linux-headers package)",
        )
    common, arch = pair
    if common == arch:
        target = common
    else:
        target = cache_dir() / "kernel-headers" / arch.name
        if prepare and not (target / "Makefile").exists():
            _join(common, arch, target)
    if prepare:
        os.environ["BCC_KERNEL_SOURCE"] = str(target)
    return Headers("generic", str(target), f"generic headers {arch.name} (running kernel {release})")


def _join(common: Path, arch: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".join-"))
    try:
        subprocess.run(["cp", "-rs", f"{common}/.", f"{tmp}/"], check=True)
        subprocess.run(["cp", "-rsf", f"{arch}/.", f"{tmp}/"], check=True)
        try:
            tmp.rename(target)
        except OSError:  # another recorder made it first
            shutil.rmtree(tmp, ignore_errors=True)
    except subprocess.CalledProcessError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
