"""The real vendor libraries for the tests: NVIDIA's own libcudart.so.12 and libnccl.so.2, from the
wheels the package registry serves (nvidia-cuda-runtime-cu12, nvidia-nccl-cu12).

    python tests/native/vendor_libs.py        # download the wheels into the cache (scripts/setup.sh --test)

The wheels are kept in WHEELS and the library unpacked beside them once, so a test run needs no
network after the first; without the wheel and without a network, `vendor_library()` returns the
reason, which the tests skip with. There is no GPU driver here: the runtime's calls return
cudaErrorInsufficientDriver (35), NCCL's return an error code, which is what the tests record.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("/var/cache/stall-recorder")
WHEELS = CACHE / "wheels"
UNPACKED = CACHE / "vendor"


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    member: str  # the library's path inside the wheel


VENDOR = {
    "libcudart.so.12": Wheel("nvidia-cuda-runtime-cu12", "12.9.79", "nvidia/cuda_runtime/lib/libcudart.so.12"),
    "libnccl.so.2": Wheel("nvidia-nccl-cu12", "2.32.3", "nvidia/nccl/lib/libnccl.so.2"),
}


def _wheel_file(w: Wheel) -> Path | None:
    prefix = f"{w.package.replace('-', '_')}-{w.version}-"
    found = sorted(WHEELS.glob(prefix + "*.whl")) if WHEELS.is_dir() else []
    return found[0] if found else None


def download(w: Wheel) -> Path | str:
    """The wheel in the cache, downloaded when missing; the reason when it cannot be had."""
    have = _wheel_file(w)
    if have:
        return have
    try:
        WHEELS.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {WHEELS} ({e.strerror})"
    spec = f"{w.package}=={w.version}"
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              "--timeout", "20", "-q", "-d", str(WHEELS), spec],
                             capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return f"downloading {spec} took more than 15 minutes"
    have = _wheel_file(w)
    if have:
        return have
    last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{spec} is not in {WHEELS} and could not be downloaded (offline?): {last[:160]}"


def vendor_library(name: str) -> Path | str:
    """The real library `name` (a key of VENDOR) unpacked from its wheel, or why it is not here."""
    w = VENDOR[name]
    wheel = download(w)
    if isinstance(wheel, str):
        return wheel
    target = UNPACKED / wheel.stem / w.member
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        with zipfile.ZipFile(wheel) as z, z.open(w.member) as src, tmp.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.replace(target)  # atomic: another test run may read it at once
    return target


if __name__ == "__main__":
    for lib in VENDOR:
        print(f"{lib}: {vendor_library(lib)}")
    sys.exit(0)  # offline is no failure: the tests that need them skip with the reason
