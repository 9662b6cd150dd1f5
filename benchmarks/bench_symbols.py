"""Time to read the function symbols of an ELF object for native stack symbolisation.

    python3 benchmarks/bench_symbols.py [PATH ...] [--repeat 3] [--json]

Without paths: this interpreter's libpython (or executable), the C library, the C++ library and,
where installed, PyTorch's libtorch_cpu.so. For each object, the symbols the session's symboliser
keeps (defined functions of .symtab, then .dynsym) read two ways: pyelftools parsing every symbol
(`iter_symbols`, what the recorder did before recorder/core/elfsyms.py) and recorder/core/elfsyms.py's bulk
unpack. Prints the median seconds of --repeat rounds and the peak memory of the bulk tables. Both
must find the same symbols at the same addresses (checked on every run; the pyelftools side is
skipped above --max-old symbols, where it takes minutes).
"""

from __future__ import annotations

import argparse
import ctypes.util
import glob
import json
import statistics
import sys
import sysconfig
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elftools.elf.elffile import ELFFile  # noqa: E402

from recorder.core.elfsyms import FunctionSymbols  # noqa: E402

FUNCTION_TYPES = ("STT_FUNC", "STT_GNU_IFUNC", "STT_LOOS")  # pyelftools names type 10 STT_LOOS


def per_symbol(path: str) -> dict[int, tuple[str, int]]:
    found: dict[int, tuple[str, int]] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for name in (".symtab", ".dynsym"):
            sec = elf.get_section_by_name(name)
            if sec is None or not hasattr(sec, "iter_symbols"):
                continue
            for sym in sec.iter_symbols():
                if (sym["st_info"]["type"] in FUNCTION_TYPES and sym["st_value"]
                        and sym["st_shndx"] != "SHN_UNDEF" and sym.name):
                    found.setdefault(sym["st_value"], (sym.name, sym["st_size"]))
    return found


def bulk(path: str) -> FunctionSymbols:
    return FunctionSymbols(path)


def as_dict(syms: FunctionSymbols) -> dict[int, tuple[str, int]]:
    return {start: (name, size) for start, size, name in syms.items()}


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def default_objects() -> list[str]:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    out = [p for p in (str(Path(libdir) / ldlib),) if ldlib.endswith(".so") or ".so." in ldlib]
    out = [p for p in out if Path(p).exists()] or [str(Path(sys.executable).resolve())]
    for lib in ("c", "stdc++"):
        name = ctypes.util.find_library(lib)
        hits = glob.glob(f"/usr/lib/x86_64-linux-gnu/{name}") if name else []
        out += hits[:1]
    out += sorted(glob.glob(f"{sysconfig.get_paths()['purelib']}/torch/lib/libtorch_cpu.so"))[:1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-old", type=int, default=200_000,
                    help="skip the pyelftools side for objects with more symbols than this")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    paths = args.paths or default_objects()
    results = []
    if not args.json:
        print(f"{'object':<44} {'MiB':>7} {'symbols':>9} {'pyelftools s':>13} {'bulk s':>8} {'speed-up':>9}"
          f" {'bulk peak MiB':>14}")
    for path in paths:
        t_new, syms = timed(lambda p=path: bulk(p), args.repeat)
        tracemalloc.start()  # a separate round: tracing allocations slows them
        bulk(path)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        if len(syms) <= args.max_old:
            t_old, old = timed(lambda p=path: per_symbol(p), 1 if len(syms) > 20_000 else args.repeat)
            if old != as_dict(syms):
                raise SystemExit(f"{path}: the two readers disagree")
            old_text, ratio = f"{t_old:.3f}", f"{t_old / t_new:.0f}x"
        else:
            old_text, ratio = "skipped", "-"
        size = Path(path).stat().st_size / 2**20
        results.append({"object": path, "size_mib": round(size, 1), "symbols": len(syms),
                        "pyelftools_s": None if old_text == "skipped" else round(float(old_text), 3),
                        "bulk_s": round(t_new, 3), "bulk_peak_mib": round(peak, 1)})
        if not args.json:
            print(f"{Path(path).name:<44} {size:>7.1f} {len(syms):>9,} {old_text:>13} {t_new:>8.3f} {ratio:>9}"
                  f" {peak:>14.1f}")
    if args.json:
        print(json.dumps({"objects": results}))


if __name__ == "__main__":
    main()
