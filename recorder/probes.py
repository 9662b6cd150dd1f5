"""Loading the BPF programs with BCC and attaching them: tracepoints, CUDA uprobes, dlopen.

Every decision is recorded as a Capability (attached / absent / failed, with the reason), which the
session stores in the `capability` table and `recorder doctor` prints.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bpf
from recorder import checkpoints, cuda, events, iolayer, kheaders, ringbuf
from recorder.errors import NotPrivileged, ProbeError
from recorder.libraries import exported_functions, find_libc
from recorder.pyframes import PyStackProbe, bpf_source

TRACEFS = Path("/sys/kernel/tracing")
# "0" turns off the Python stack at each blocking switch of a traced thread (bench_offcpu_stack.py)
OFFCPU_STACKS_ENV = "STALL_RECORDER_OFFCPU_STACKS"

# Tracepoints each BPF source needs; a source whose tracepoints are missing is left out and
# recorded as absent instead of failing the whole compile.
LAYER_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sched": (
        "sched.bpf.c",
        ("sched:sched_switch", "sched:sched_waking", "raw_syscalls:sys_enter", "raw_syscalls:sys_exit"),
    ),
    "task": (
        "task.bpf.c",
        ("sched:sched_process_fork", "sched:sched_process_exec", "sched:sched_process_exit"),
    ),
    "cuda": ("cuda.bpf.c", ()),
}
LAYER_SOURCES.update(iolayer.LAYER_SOURCES)
LAYER_SOURCES.update(checkpoints.LAYER_SOURCES)
OPTIONAL_TRACEPOINTS = {**iolayer.OPTIONAL_TRACEPOINTS, **checkpoints.OPTIONAL_TRACEPOINTS,
                        # a forked Python inherits its parent's stack-walking recipe in the kernel
                        "task": ("task:task_newtask",)}


@dataclass(frozen=True)
class Capability:
    layer: str
    probe: str
    status: str  # 'attached', 'absent', 'failed'
    detail: str = ""
    target: str = ""
    ts: int = 0


@dataclass(frozen=True)
class TargetSpec:
    """What to record: processes (and their descendants), a cgroup v2 subtree, or everything."""

    pids: tuple[int, ...] = ()
    cgroup: str | None = None
    everything: bool = False

    @property
    def mode(self) -> int:
        if self.everything:
            return events.CONSTANTS["MODE_ALL"]
        if self.cgroup:
            return events.CONSTANTS["MODE_CGROUP"]
        return events.CONSTANTS["MODE_PIDS"]

    def describe(self) -> str:
        if self.everything:
            return "all"
        if self.cgroup:
            return f"cgroup {self.cgroup}"
        return "pids " + ",".join(str(p) for p in self.pids)


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def ensure_tracefs() -> bool:
    """Mount tracefs when it is not mounted (as the recorder needs it); True when usable."""
    if _exists(TRACEFS / "events"):
        return True
    if os.geteuid() != 0:
        return False
    subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], capture_output=True)
    return _exists(TRACEFS / "events")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. tracefs readable by root only
        return False


def tracepoint_exists(name: str) -> bool:
    system, event = name.split(":", 1)
    return _exists(TRACEFS / "events" / system / event / "format")


def tracepoint_has_field(name: str, field: str) -> bool:
    """Whether the tracepoint's format has a field of that name (e.g. the patch series' io_tag)."""
    system, event = name.split(":", 1)
    try:
        text = (TRACEFS / "events" / system / event / "format").read_text()
    except OSError:
        return False
    return any(line.strip().startswith("field:") and line.split(";")[0].split()[-1].split("[")[0] == field
               for line in text.splitlines())


def cgroup_identity(path: str) -> tuple[int, int]:
    """(cgroup v2 id, level) of a cgroup v2 folder: the id is the folder's inode number."""
    p = Path(path)
    if not p.is_dir():
        raise ProbeError(f"cgroup {path} does not exist: pass a cgroup v2 folder, e.g. /sys/fs/cgroup/unified/job")
    root = p
    while root.parent != root and (root.parent / "cgroup.procs").exists():
        root = root.parent
    level = len(p.relative_to(root).parts)
    return os.stat(p).st_ino, level


def offcpu_stacks_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether off-CPU intervals get the thread's Python stack: on unless $STALL_RECORDER_OFFCPU_STACKS
    is 0/off/no/false."""
    value = (os.environ if environ is None else environ).get(OFFCPU_STACKS_ENV, "1")
    return value.strip().lower() not in ("0", "off", "no", "false")


def possible_cpus() -> int:
    """CPUs the kernel may bring online (per-CPU BPF state is sized for these): '0-3,8-11' -> 8."""
    try:
        count = 0
        for span in Path("/sys/devices/system/cpu/possible").read_text().strip().split(","):
            first, _, last = span.partition("-")
            count += int(last or first) - int(first) + 1
        return count
    except (OSError, ValueError):
        return os.cpu_count() or 1


def check_privileges() -> None:
    if os.geteuid() != 0:
        raise NotPrivileged(
            "recording needs root (or CAP_BPF and CAP_PERFMON): run with sudo, "
            "or 'recorder doctor' to see what is missing"
        )


class Probes:
    """The session's BPF object and everything attached to it."""

    def __init__(self, target: TargetSpec, extra_source: str = "", offcpu_stacks: bool | None = None) -> None:
        check_privileges()
        if not ensure_tracefs():
            raise ProbeError("tracefs is not mounted and could not be: mount -t tracefs nodev /sys/kernel/tracing")
        headers = kheaders.locate()
        if headers.path is None:
            raise ProbeError(headers.detail)
        try:
            from bcc import BPF
        except ImportError:
            raise ProbeError(
                "the bcc Python module is missing: apt-get install python3-bpfcc (run 'make demo' "
                "or scripts/setup.sh to set everything up)"
            ) from None
        self.BPF = BPF
        self.target = target
        self.capabilities: list[Capability] = []
        self.layers: list[str] = []
        text = self._source(extra_source)
        try:
            self.bpf = BPF(text=text, cflags=["-Wno-macro-redefined", "-Wno-unused-function"])
        except Exception as e:  # BCC raises bare Exception for compile and load failures
            raise ProbeError(f"BPF programs failed to load ({e}): run 'recorder doctor'") from None
        for layer in self.layers:
            for tp in LAYER_SOURCES[layer][1] + getattr(self, "optional", {}).get(layer, ()):
                self._cap(layer, tp, "attached")
        # the CPython stack walker, tail-called by every CUDA, NCCL and marker entry, and its
        # tracepoint copy for blocking switches and block I/O (per-process status: recorder/stacks.py)
        self.pystack = PyStackProbe(self.bpf)
        for probe, install in (("cpython frames walker", self.pystack.install),
                               ("cpython frames walker (tracepoints)", self.pystack.install_tracepoints)):
            try:
                install()
            except Exception as e:  # every record then says "walker not installed"
                self._cap("python", probe, "failed", str(e).splitlines()[0][:200])
        try:  # the CUDA entries' native stack walk (bpf/cuda.bpf.c), one program for every API
            walk = self.bpf.load_func("cuda_native", BPF.KPROBE)
            self.bpf.get_table("cuda_progs")[ctypes.c_int(0)] = ctypes.c_int(walk.fd)
        except Exception as e:  # the calls are recorded without their native stack
            self._cap("cuda", "native stacks", "failed", str(e).splitlines()[0][:200])
        if offcpu_stacks is None:
            offcpu_stacks = offcpu_stacks_enabled()
        self.set_offcpu_stacks(offcpu_stacks)
        if "sched" in self.layers:
            # in the sched layer: the python layer is observed only where a process's frames are read
            self._cap("sched", "python stacks at blocking switches", "attached" if offcpu_stacks else "absent",
                      "at each blocking switch" if offcpu_stacks else f"turned off ({OFFCPU_STACKS_ENV}=0)")
        self.attached_libraries: dict[str, int] = {}  # resolved path -> probes attached
        self.drop_counts = [0] * events.CONSTANTS["PROBE_COUNT"]
        self.rings: ringbuf.RingSet | None = None  # set by open_rings() where the fast reader works
        self._skipped_seen = 0

    def _cap(self, layer: str, probe: str, status: str, detail: str = "", target: str = "") -> None:
        self.capabilities.append(Capability(layer, probe, status, detail, target, now_ns()))

    def _source(self, extra: str) -> str:
        t = self.target
        cg_id, cg_level = cgroup_identity(t.cgroup) if t.cgroup else (0, 0)
        parts = [
            events.c_definitions(),
            f"#define TARGET_MODE {t.mode}",
            f"#define TARGET_CGROUP_ID {cg_id}ull",
            f"#define TARGET_CGROUP_LEVEL {cg_level}",
            f"#define SELF_TGID {os.getpid()}",
            f"#define RING_CPUS {possible_cpus()}",
            bpf.source("common.h"),
            # pasted, not #included (BCC rewrites map syntax in the main text only), before the layers:
            # the CUDA entries end with its capture and task.bpf.c drops a recipe at exec
            # the CUDA calls' in-flight records, where the walker leaves a known stack's digest
            bpf.source("cuda_inflight.h"),
            "#define PYSTACK_RINGBUF_PAGES 2048\n" + bpf_source(),
        ]
        for layer, (filename, tracepoints) in LAYER_SOURCES.items():
            missing = [tp for tp in tracepoints if not tracepoint_exists(tp)]
            if missing:
                for tp in missing:
                    self._cap(layer, tp, "absent", "tracepoint not in this kernel")
                continue
            self.layers.append(layer)
            parts.append(self._optional_tracepoints(layer))
            parts.append(bpf.source(filename))
        parts.append(cuda.bpf_programs())
        parts.append(extra)
        return "\n".join(parts)

    def _optional_tracepoints(self, layer: str) -> str:
        """#defines HAVE_TP_<system>_<event> for the layer's optional tracepoints this kernel has."""
        if not hasattr(self, "optional"):
            self.optional: dict[str, tuple[str, ...]] = {}
        present = tuple(tp for tp in OPTIONAL_TRACEPOINTS.get(layer, ()) if tracepoint_exists(tp))
        self.optional[layer] = present
        for tp in OPTIONAL_TRACEPOINTS.get(layer, ()):
            if tp not in present:
                self._cap(layer, tp, "absent", "tracepoint not in this kernel")
        for tp in iolayer.NOT_RECORDED.get(layer, ()):
            self._cap(layer, tp, "absent", "not recorded by this version" if tracepoint_exists(tp)
                      else "tracepoint not in this kernel")
        fields = tuple(f"{tp.replace(':', '_')}_{field}" for tp, field in iolayer.OPTIONAL_FIELDS.get(layer, ())
                       if tracepoint_has_field(tp, field))
        return "\n".join([f"#define HAVE_TP_{tp.replace(':', '_')} 1" for tp in present]
                         + [f"#define HAVE_TPF_{name} 1" for name in fields])

    def set_offcpu_stacks(self, on: bool) -> None:
        """Capture (or not) the Python stack of a traced thread each time it blocks."""
        if "sched" in self.layers:
            self.bpf["sched_settings"][ctypes.c_int(0)] = ctypes.c_uint32(int(on))

    # -- targets ----------------------------------------------------------------------------------
    def add_pid(self, pid: int) -> None:
        self.bpf["targets"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    # -- uprobes ----------------------------------------------------------------------------------
    def attach_library(self, path: str, kind: str) -> int:
        """Attach entry and return probes to every traced API the library exports."""
        real = os.path.realpath(path)
        if real in self.attached_libraries:
            return 0
        names = exported_functions(real)
        wanted = [api for api in cuda.APIS if api.library == kind and api.name in names]
        if not wanted:
            self._cap("cuda", f"{kind} library", "absent", "exports no traced CUDA API", path)
            self.attached_libraries[real] = 0
            return 0
        count = 0
        for api in wanted:
            i = cuda.API_INDEX[api.name]
            try:
                self.bpf.attach_uprobe(name=real, sym=api.name, fn_name=f"cuda_entry_{i}")
                self.bpf.attach_uretprobe(name=real, sym=api.name, fn_name=f"cuda_return_{i}")
                self._cap("cuda", api.name, "attached", "", path)
                count += 1
            except Exception as e:
                self._cap("cuda", api.name, "failed", str(e).splitlines()[0][:200], path)
        self.attached_libraries[real] = count
        return count

    def attach_dlopen(self) -> None:
        libc = find_libc()
        if libc is None:
            self._cap("task", "dlopen", "absent", "no C library mapped by the recorder")
            return
        names = exported_functions(os.path.realpath(libc))
        for sym in ("dlopen", "dlmopen"):
            if sym not in names:
                continue
            try:
                self.bpf.attach_uretprobe(name=libc, sym=sym, fn_name="task_dlopen_return")
                self._cap("task", sym, "attached", "", libc)
            except Exception as e:
                self._cap("task", sym, "failed", str(e).splitlines()[0][:200], libc)

    # -- consumption ------------------------------------------------------------------------------
    def open_rings(self, sinks: dict[str, Callable[[bytes], None]],
                   blocks: dict[str, int] | None = None) -> None:
        """Register one sink per ring buffer name; each gets every record's raw bytes. A ring named
        in `blocks` (name -> record size) hands its sink blocks of framed records instead
        (recorder/ringbuf.py: an 8-byte header before each record; `events.Layout.iter_framed`).

        On x86-64 the rings are read from their memory mapping (a loop over many records per call,
        no Python callback per record); elsewhere, or with STALL_RECORDER_BCC_RINGS=1, through
        BCC's callback per record.
        """
        blocks = blocks or {}
        fast = ringbuf.supported() and os.environ.get("STALL_RECORDER_BCC_RINGS") != "1"
        self.rings = ringbuf.RingSet() if fast else None
        for name, sink in sinks.items():
            try:
                table = self.bpf[name]
            except KeyError:  # its layer was left out
                continue
            if self.rings is not None:
                self.rings.add(table.map_fd, table.max_entries, sink, blocks.get(name))
                continue

            def callback(ctx, data, size, _sink=sink, _framed=name in blocks):
                record = ctypes.string_at(data, size)
                _sink(ringbuf.frame(record) if _framed else record)
                return 0

            table.open_ring_buffer(callback)

    def poll(self, timeout_ms: int) -> None:
        """Wait up to timeout_ms for a record, then read every ring to the end. BCC's poll reads
        only the rings that woke it, and the block ring wakes the reader at most every 50 ms per
        CPU (bpf/block.bpf.c): without the consume its records would wait for the next wakeup."""
        if self.rings is not None:
            self.rings.poll(timeout_ms)
        else:
            self.bpf.ring_buffer_poll(timeout_ms)
            self.bpf.ring_buffer_consume()

    def consume(self) -> None:
        if self.rings is not None:
            self.rings.consume()
        else:
            self.bpf.ring_buffer_consume()

    def skipped_records(self) -> int:
        """Records of another size found in a ring read in blocks since the last call (skipped;
        none is expected: each such ring carries one struct)."""
        if self.rings is None:
            return 0
        total = sum(ring.malformed for ring in self.rings.rings)
        delta, self._skipped_seen = total - self._skipped_seen, total
        return delta

    def read_drops(self) -> list[int]:
        """Per-probe events lost since the last call."""
        table = self.bpf["drops"]
        deltas = []
        for i in range(events.CONSTANTS["PROBE_COUNT"]):
            total = sum(table[ctypes.c_int(i)])
            deltas.append(total - self.drop_counts[i])
            self.drop_counts[i] = total
        return deltas

    def open_offcpu(self) -> list[tuple[int, object]]:
        """Off-CPU intervals still open (tid, record), to close at stop."""
        if "sched" not in self.layers:
            return []
        return [(k.value, v) for k, v in self.bpf["offcpu_open"].items()]

    def cleanup(self) -> None:
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        self.bpf.cleanup()
