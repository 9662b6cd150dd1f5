"""Builds the offline bundle: one relocatable tarball that runs stall-recorder on an x86-64 Linux node
that has only a kernel with BPF (no BCC, no compiler, no Python of the right version, no network).

The bundle carries its own dynamic loader and C library (Debian 12's glibc), CPython 3.11, BCC
(libbcc with its LLVM/clang libraries and bcc's Python module), Debian's generic kernel headers for
BCC, the project's runtime packages and the project, installed from its wheel (C extensions built for
that CPython). `bin/recorder` starts
the interpreter through the bundled loader with `--library-path`, so no library of the node is loaded
into the recorder (and nothing is put in the environment of the processes it starts). docs/deploy.md
says which nodes it runs on and why.

Build on Debian 12 (x86-64) with the project's .venv (`make setup`), as any user, after `apt-get
update`: the Debian packages are fetched with `apt-get download` and the Python packages by pip, both
cached under build/bundle/ so a second build needs no network.

    make bundle                  # or: .venv/bin/python scripts/build_bundle.py
    -> build/stall-recorder-VERSION-linux-x86_64.tar.gz      (--xz: .tar.xz, smaller and slower)
    scripts/build_bundle.py --wheel DIST/stall_recorder-VERSION-cp311-*.whl     # from a wheel built before

Before the tarball is written, the bundle's own interpreter imports every module of the project and
every library its commands load, and uses Arrow, Parquet, DuckDB, matplotlib and the Perfetto protos
once (CHECK below): a library the build left out fails the build, not a command on a node.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYVER = "3.11"  # Debian 12's CPython; the C extensions are built with the same interpreter

# Debian 12 packages the bundle takes files from. The list is what the interpreter, its extension
# modules, libbcc and the wheels' libraries load (checked after assembly: every ELF file of the bundle
# must resolve all its libraries inside the bundle, or the build fails and names the library).
DEBS = [
    # the loader and C library, and the C++ runtime libbcc and several wheels use
    "libc6", "libc-bin", "libgcc-s1", "libstdc++6", "libcrypt1",
    # CPython and the libraries of its extension modules
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "zlib1g", "libbz2-1.0",
    "liblzma5", "libexpat1", "libffi8", "libssl3", "libsqlite3-0", "libuuid1", "libncursesw6",
    "libtinfo6", "libreadline8",
    # BCC, its LLVM 14 / clang libraries and what they load
    "libbpfcc", "python3-bpfcc", "libbpf1", "libllvm14", "libclang-cpp14", "libelf1", "libz3-4",
    "libxml2", "libicu72", "libedit2", "libbsd0", "libmd0", "libzstd1",
]
# Extension modules left out: they need libraries nothing here uses (NIS, Berkeley DB, Tk)
DROP_DYNLOAD = ("nis.", "_dbm.", "_gdbm.", "_tkinter.")
DROP_STDLIB = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data")
# Runtime packages' parts the recorder never loads: tests, C headers and Cython sources, console
# scripts, pip (which sqlite-utils installs for its plugin command), pyarrow's copies of its Python
# bridge under names no library asks for (the loader looks for libarrow_python*.so.NNNN), its Flight RPC
# and the C++ tests module. Its S3 file system (--ship) and every library its Parquet, dataset and
# compute modules load stay: CHECK imports and uses them with the bundle's interpreter.
DROP_SITE = ("bin", "*/tests", "numpy/*/tests", "pip", "pip-*.dist-info", "pyarrow/include", "pyarrow/src",
             "pyarrow/*.pxd", "pyarrow/*.pyx", "pyarrow/libarrow_python*.so", "pyarrow/libarrow_python*.so.*.*",
             "pyarrow/*flight*", "pyarrow/_pyarrow_cpp_tests*")

# Run by the bundle's interpreter (bin/python3, isolated mode, from a temporary folder) before the
# tarball is written: every module of the project imports (a package the wheel lacks fails here), and
# every library a command of the bundle loads imports and works once.
CHECK = """
import importlib, io, os, pkgutil, tempfile

modules = 0
for top in ("recorder", "store", "mcp_server", "bpf"):
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        if not info.name.endswith(".__main__"):  # recorder/__main__.py runs the command line
            importlib.import_module(info.name)
            modules += 1

# record, start: BCC and the C extensions of the ingest path and the step markers
import bcc, recorder._ingest, recorder._markers, store.db._insert
# mcp (stdio, HTTPS): the MCP server, its models and its HTTP server; the gpu layer: NVML's binding;
# the store: sqlite-utils; native symbols: pyelftools
import mcp.server, pydantic, pydantic_core, uvicorn, pynvml, sqlite_utils, elftools.elf.elffile
# export --parquet, --ship, cluster explain: Arrow, Parquet, S3, CSV and DuckDB over Arrow tables
import duckdb, pyarrow as pa, pyarrow.csv, pyarrow.fs, pyarrow.parquet as pq
# report --html: matplotlib's SVG output; export --perfetto: the Perfetto protos
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from perfetto.protos.perfetto.trace import perfetto_trace_pb2

with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "steps.parquet")
    pq.write_table(pa.table({"step": [1, 2, 3]}), path)
    steps = pq.read_table(path)
    assert duckdb.connect(":memory:").execute("SELECT sum(step) FROM steps").fetchone()[0] == 6
# the client --ship makes (made only: nothing is sent)
pyarrow.fs.S3FileSystem(endpoint_override="127.0.0.1:9", scheme="http", anonymous=True)
figure = plt.figure()
plt.plot([0, 1], [1, 0])
svg = io.StringIO()
figure.savefig(svg, format="svg")
assert "<svg" in svg.getvalue()
trace = perfetto_trace_pb2.Trace()
trace.packet.add().timestamp = 1
assert trace.SerializeToString()
print(f"{modules} modules of the project and the libraries of its commands import and work")
"""
# Kernel header folders BCC never includes from the BPF programs (sound, graphics, ...)
DROP_HEADERS = ("dt-bindings", "sound", "drm", "media", "xen", "video", "rdma", "soc", "scsi", "target",
                "ras", "kunit", "pcmcia", "math-emu", "misc", "memory")

LAUNCHER_PYTHON = """#!/bin/sh
# CPython {pyver} of this bundle, started through the bundle's own loader and C library: nothing of the
# node but the kernel is used, and nothing of it is passed on to the programs it starts.
here=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
# The C library's locale and character set data are the bundle's too (the node's are another glibc's
# format); sitecustomize.py takes both variables out again, so the programs it starts never see them.
LOCPATH=$here/share/locale GCONV_PATH=$here/lib/gconv STALL_RECORDER_BUNDLE_VARS="LOCPATH GCONV_PATH" \\
  exec "$here/lib/ld-linux-x86-64.so.2" --library-path "$here/lib" --argv0 "$here/bin/python3" \\
  "$here/libexec/python{pyver}" -I "$@"
"""

SITECUSTOMIZE = """\"\"\"Start-up of the bundle's interpreter: the variables bin/python3 set for the bundle's C library
(already read when this runs) are not passed on to the programs the recorder starts.\"\"\"
import os

for _name in os.environ.pop("STALL_RECORDER_BUNDLE_VARS", "").split():
    os.environ.pop(_name, None)
"""

LAUNCHER_RECORDER = """#!/bin/sh
# stall-recorder from this bundle (docs/deploy.md). BCC compiles against the kernel headers shipped
# here unless BCC_KERNEL_SOURCE names others.
here=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
if [ -z "${BCC_KERNEL_SOURCE:-}" ]; then
  for h in "$here"/share/kernel-headers/*; do BCC_KERNEL_SOURCE=$h; done
  export BCC_KERNEL_SOURCE
fi
exec "$here/bin/python3" -c 'import sys; sys.argv[0] = "recorder"; from recorder.cli import main; sys.exit(main())' "$@"
"""

INSTALL_SH = """#!/bin/sh
# Links `recorder` into BINDIR (default /usr/local/bin) and checks what this node can record.
# The bundle runs from wherever it was unpacked; this step is optional.
#   ./install.sh [BINDIR]
set -e
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
bindir=${1:-/usr/local/bin}
mkdir -p "$bindir"
ln -sf "$here/bin/recorder" "$bindir/recorder"
echo "install: $bindir/recorder -> $here/bin/recorder"
exec "$here/bin/recorder" doctor
"""

README = """stall-recorder {version}, offline bundle for x86-64 Linux

  tar xf stall-recorder-{version}-linux-x86_64.tar.gz
  cd stall-recorder-{version} && ./install.sh      # or run bin/recorder from here
  recorder doctor

Needs a kernel with BPF, BTF (/sys/kernel/btf/vmlinux), tracefs and uprobes, root, and nothing
else: the loader, C library, Python, BCC and kernel headers it uses are in lib/, libexec/ and share/.
MANIFEST lists the Debian and Python packages it was built from. Details: docs/deploy.md in the
project's repository.
"""


def log(msg: str) -> None:
    print(f"bundle: {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def headers_packages() -> list[str]:
    """Debian's generic amd64 headers: the versioned package the meta package points at, and its common half."""
    out = run(["apt-cache", "depends", "linux-headers-amd64"], capture_output=True, text=True).stdout
    arch = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("Depends:")]
    arch = [p for p in arch if p.startswith("linux-headers-") and p.endswith("-amd64")]
    if not arch:
        sys.exit("bundle: apt-cache knows no linux-headers-amd64: run apt-get update (Debian 12 sources)")
    return [arch[0], arch[0][: -len("amd64")] + "common"]


def fetch_debs(cache: Path, names: list[str]) -> list[Path]:
    cache.mkdir(parents=True, exist_ok=True)
    missing = [n for n in names if not list(cache.glob(f"{n}_*.deb"))]
    if missing:
        log(f"apt-get download {len(missing)} packages")
        r = subprocess.run(["apt-get", "download", *missing], cwd=cache)
        if r.returncode:
            sys.exit("bundle: apt-get download failed: run apt-get update, and build on Debian 12 (x86-64)")
    debs = []
    for n in names:
        found = sorted(cache.glob(f"{n}_*.deb"))
        debs.append(found[-1])
    return debs


def inside(root: Path, path: Path) -> Path:
    """Resolves `path` (which may hold symbolic links, absolute ones meant for the package's system) in `root`."""
    parts = list(path.relative_to(root).parts)
    cur = root
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            cur = cur.parent if cur != root else root
            continue
        cur = cur / part
        if cur.is_symlink():
            hops += 1
            if hops > 40:
                raise RuntimeError(f"symbolic link loop at {cur}")
            target = os.readlink(cur)
            parts = list(Path(target.lstrip("/")).parts) + parts
            cur = root if target.startswith("/") else cur.parent
    return cur


def copy_libs(root: Path, dest: Path) -> None:
    """Shared libraries of the unpacked packages into one folder: in-folder links kept, others copied."""
    dest.mkdir(parents=True, exist_ok=True)
    for d in (root / "lib/x86_64-linux-gnu", root / "usr/lib/x86_64-linux-gnu"):
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if ".so" not in p.name or p.is_dir() or (dest / p.name).exists():
                continue
            real = inside(root, p)
            if p.is_symlink() and real.parent == inside(root, d) and real.exists():
                os.symlink(real.name, dest / p.name)
            elif real.is_file():
                shutil.copy2(real, dest / p.name)


def copy_tree(src: Path, dest: Path, root: Path) -> None:
    """A folder with its links resolved inside `root`; links to what the packages do not hold are left out."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            s = Path(dirpath) / name
            real = inside(root, s) if s.is_symlink() else s
            if real.is_file():
                shutil.copy2(real, dest / rel / name)
            elif real.is_dir():
                copy_tree(real, dest / rel / name, root)


def assemble_headers(root: Path, pkgs: list[str], dest: Path) -> None:
    arch_name, common_name = pkgs
    common, arch = root / "usr/src" / common_name, root / "usr/src" / arch_name
    target = dest / arch_name
    for tree in (common, arch):  # the architecture half overrides the common half, as Kbuild sees them
        for part in ("include", "arch/x86/include"):
            if (tree / part).is_dir():
                copy_tree(tree / part, target / part, root)
    shutil.copy2(arch / "Makefile", target / "Makefile")
    shutil.copy2(arch / ".config", target / ".config")
    for d in DROP_HEADERS:
        shutil.rmtree(target / "include" / d, ignore_errors=True)


def assemble_python(root: Path, out: Path) -> None:
    (out / "libexec").mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / f"usr/bin/python{PYVER}", out / f"libexec/python{PYVER}")
    stdlib = out / f"lib/python{PYVER}"
    shutil.copytree(root / f"usr/lib/python{PYVER}", stdlib, symlinks=True)
    for p in list(stdlib.rglob("*")):
        # Debian links sitecustomize.py and friends to /etc: on a node that is the node's file, not ours
        if p.is_symlink():
            p.unlink()
    for d in DROP_STDLIB:
        shutil.rmtree(stdlib / d, ignore_errors=True)
    for p in (stdlib / "lib-dynload").iterdir():
        if p.name.startswith(DROP_DYNLOAD):
            p.unlink()
    site = out / "lib/python3/dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    shutil.copytree(root / "usr/lib/python3/dist-packages/bcc", site / "bcc")


def assemble_libc_data(root: Path, out: Path) -> None:
    """The C.UTF-8 locale Python runs in, and the character set converters, of the bundle's glibc."""
    shutil.copytree(root / "usr/lib/locale/C.utf8", out / "share/locale/C.utf8")
    # Python asks for "C.UTF-8"; without this name here, glibc finds the node's folder of that name
    os.symlink("C.utf8", out / "share/locale/C.UTF-8")
    shutil.copytree(root / "usr/lib/x86_64-linux-gnu/gconv", out / "lib/gconv")


def pip_env(cache: Path) -> dict[str, str]:
    return dict(os.environ, PIP_CACHE_DIR=str(cache / "pip"), PIP_DISABLE_PIP_VERSION_CHECK="1")


def build_wheel(cache: Path) -> Path:
    """The project's wheel, as pip builds it for anyone who installs the project (C extensions built
    here, for this CPython): the bundle holds what a wheel install holds. Built from a copy of the
    source files git knows of (tracked, or new and not ignored), so that nothing a build left in the
    checkout (build/lib, *.egg-info, extensions built in place) ends up in it."""
    dest, src = cache / "wheel", cache / "src"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode:  # not a git checkout (an unpacked sdist): its files are the sources
        shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns("build", ".venv", "*.egg-info"))
    else:
        for name in filter(None, listed.stdout.split("\0")):
            if (ROOT / name).is_file():  # (a file deleted but not yet committed is listed too)
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, src / name, follow_symlinks=False)
    log("build the project's wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(src)],
                       env=pip_env(cache), capture_output=True, text=True)
    shutil.rmtree(src, ignore_errors=True)
    if r.returncode:
        sys.exit(f"bundle: building the wheel failed:\n{r.stdout}{r.stderr}")
    (wheel,) = dest.glob("stall_recorder-*.whl")
    return wheel


def install_project(out: Path, cache: Path, wheel: Path) -> None:
    """The project's wheel and its runtime packages."""
    site = out / "lib/python3/dist-packages"
    log(f"pip install {wheel.name} and its runtime packages")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--prefer-binary",
                        "--no-warn-script-location", "--target", str(site), str(wheel)],
                       env=pip_env(cache), capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bundle: pip install failed:\n{r.stdout}{r.stderr}")
    for pattern in DROP_SITE:
        for p in site.glob(pattern):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    missing = [m for m in ("recorder/_ingest", "recorder/_markers", "store/db/_insert")
               if not list(site.glob(f"{m}.cpython-*.so"))]
    if missing:
        sys.exit(f"bundle: C extension(s) not in the wheel: {', '.join(missing)} (install gcc and python3-dev)")


def check_imports(out: Path) -> None:
    """CHECK, run by the bundle's own interpreter with nothing of the node's Python on its path."""
    with tempfile.TemporaryDirectory(prefix="stall-recorder-bundle-check-") as cwd:
        r = subprocess.run([str(out / "bin/python3"), "-c", CHECK], cwd=cwd, capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"})
    if r.returncode:
        sys.exit(f"bundle: the bundle's interpreter cannot load what its commands need:\n{r.stdout}{r.stderr}")
    log(r.stdout.strip())


def normalise_modes(out: Path) -> None:
    """Folders 0755, files 0755 where anyone may run them and 0644 otherwise, whatever the builder's
    umask or the packages' own modes were: nothing of the bundle is writable by group or others."""
    for dirpath, _dirnames, filenames in os.walk(out):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.stat(p).st_mode & 0o100 else 0o644)


def check_libraries(out: Path) -> None:
    """Every ELF file of the bundle must find all its libraries in the bundle (the node has none of them)."""
    loader = out / "lib/ld-linux-x86-64.so.2"
    elves = [out / f"libexec/python{PYVER}"]
    for p in out.rglob("*.so*"):
        if p.is_file() and not p.is_symlink() and p.read_bytes()[:4] == b"\x7fELF":
            elves.append(p)
    bad = []
    for p in elves:
        r = subprocess.run([str(loader), "--library-path", str(out / "lib"), "--list", str(p)],
                           capture_output=True, text=True)
        bad += [f"{p.relative_to(out)}: {line.strip()}" for line in r.stdout.splitlines() if "not found" in line]
    if bad:
        sys.exit("bundle: libraries missing from the bundle (add their Debian package to DEBS):\n  " + "\n  ".join(bad))
    log(f"{len(elves)} ELF files resolve every library inside the bundle")


def manifest(out: Path, debs: list[Path]) -> None:
    lines = ["# Debian 12 packages"] + [d.name for d in debs] + ["", "# Python packages"]
    site = out / "lib/python3/dist-packages"
    lines += sorted(p.name.removesuffix(".dist-info") for p in site.glob("*.dist-info"))
    (out / "MANIFEST").write_text("\n".join(lines) + "\n")


def write_launchers(out: Path, version: str) -> None:
    (out / "bin").mkdir(exist_ok=True)
    (out / "lib/python3/dist-packages/sitecustomize.py").write_text(SITECUSTOMIZE)
    for path, text in ((out / "bin/python3", LAUNCHER_PYTHON.format(pyver=PYVER)),
                       (out / "bin/recorder", LAUNCHER_RECORDER), (out / "install.sh", INSTALL_SH),
                       (out / "README", README.format(version=version))):
        path.write_text(text)
        path.chmod(0o755 if path.name != "README" else 0o644)


def build(args: argparse.Namespace) -> Path:
    if sys.version_info[:2] != tuple(int(x) for x in PYVER.split(".")) or not Path("/usr/bin/apt-get").exists():
        sys.exit(f"bundle: build on Debian 12 with its CPython {PYVER} (make bundle uses .venv, made by make setup)")
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    work = ROOT / "build/bundle"
    name = f"stall-recorder-{version}"
    out = work / name
    tarball = ROOT / f"build/{name}-linux-x86_64.tar{'' if args.no_compress else '.xz' if args.xz else '.gz'}"
    t0 = time.monotonic()
    hdr = headers_packages()
    debs = fetch_debs(work / "debs", DEBS + hdr)
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    root.mkdir(parents=True)
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(root)])
    log(f"{len(debs)} Debian packages unpacked")
    copy_libs(root, out / "lib")
    assemble_python(root, out)
    assemble_libc_data(root, out)
    assemble_headers(root, hdr, out / "share/kernel-headers")
    write_launchers(out, version)
    install_project(out, work, args.wheel.resolve() if args.wheel else build_wheel(work))
    check_libraries(out)
    manifest(out, debs)
    shutil.rmtree(root)
    log("compile the Python sources with the bundle's interpreter")
    # unchecked-hash: the bytecode is used as built, whatever the files' times after unpacking
    run([str(out / "bin/python3"), "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
         str(out / f"lib/python{PYVER}"), str(out / "lib/python3/dist-packages")], stdout=subprocess.DEVNULL)
    check_imports(out)
    normalise_modes(out)
    log(f"assembled {out.relative_to(ROOT)} ({du(out)}) in {time.monotonic() - t0:.0f} s")
    if args.no_tar:
        return out
    t1 = time.monotonic()
    epoch = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    # owner and group root, modes as normalise_modes() left them (never writable by group or others)
    tar = ["tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "--mode=go-w", f"--mtime=@{epoch or 0}",
           "-C", str(work), "-cf", "-", name]
    with open(tarball, "wb") as f:
        if args.no_compress:
            run(tar, stdout=f)
            log(f"{tarball.relative_to(ROOT)}: {tarball.stat().st_size / 2**20:.0f} MiB, not compressed")
            return tarball
        p1 = subprocess.Popen(tar, stdout=subprocess.PIPE)
        # gzip: every node unpacks it, in seconds here; xz is a third smaller and takes minutes
        run(["xz", "-T0", "-6"] if args.xz else ["gzip", "-6", "-n"], stdin=p1.stdout, stdout=f)
        if p1.wait():
            sys.exit("bundle: tar failed")
    size = tarball.stat().st_size / 2**20
    log(f"{tarball.relative_to(ROOT)}: {size:.0f} MiB, compressed in {time.monotonic() - t1:.0f} s")
    return tarball


def du(path: Path) -> str:
    return subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True).stdout.split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-tar", action="store_true", help="assemble build/bundle/stall-recorder-VERSION only")
    ap.add_argument("--xz", action="store_true", help="a .tar.xz: about a third smaller, minutes slower to build")
    ap.add_argument("--no-compress", action="store_true",
                    help="a plain .tar, the same files: faster to write and unpack (the tests build this one)")
    ap.add_argument("--wheel", type=Path, help="install this wheel of the project (default: build one with pip)")
    build(ap.parse_args())


if __name__ == "__main__":
    main()
