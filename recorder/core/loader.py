"""Loading the session's BPF programs with BCC: the layers' sources compiled into one object, the
CPython frame walker, target selection, dlopen, and reading the ring buffers and drop counters.

The loader knows no layer: the session hands it every layer's `BpfSource` and generated programs
(recorder/core/layer.py), and a layer attaches its own uprobes through `Probes.bpf` and `cap()`.
Every decision is recorded as a Capability (attached / absent / failed, with the reason), which the
session stores in the `capability` table and `recorder doctor` prints.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bpf
from recorder.core import events, kheaders, ringbuf
from recorder.core.capability import Capability, failure
from recorder.core.clock import now_ns
from recorder.core.libraries import exported_functions, find_libc
from recorder.core.pyframes import PyStackProbe, bpf_source
from recorder.core.settings import Settings
from recorder.core.sources import BpfSource
from recorder.errors import NotPrivileged, ProbeError

TRACEFS = Path("/sys/kernel/tracing")
_TRACEPOINT_PROBE = re.compile(r"TRACEPOINT_PROBE\(\s*(\w+)\s*,\s*(\w+)\s*\)")
_FUNCTION = re.compile(r"^int\s+(\w+)\s*\(", re.M)
_RECURSION_MISSES = re.compile(r"^recursion_misses:\s*(\d+)", re.M)
# programs that only note the CPU's interrupt context for sched_waking: a skipped run loses no record
_NO_RECORD_PROGRAMS = frozenset({
    "tracepoint__irq__irq_handler_entry", "tracepoint__irq__softirq_entry",
    "tracepoint__timer__hrtimer_expire_entry", "tracepoint__timer__hrtimer_expire_exit",
    "tracepoint__timer__timer_expire_entry", "tracepoint__timer__timer_expire_exit",
})


@dataclass(frozen=True)
class TargetSpec:
    """What to record: processes (and the children they fork), process trees (a process and every
    descendant, those running already included), a cgroup v2 subtree, or everything."""

    pids: tuple[int, ...] = ()
    cgroup: str | None = None
    everything: bool = False
    trees: tuple[int, ...] = ()

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
        named = ["pids " + ",".join(str(p) for p in self.pids)] if self.pids else []
        named += ["tree " + ",".join(str(p) for p in self.trees)] if self.trees else []
        return ", ".join(named)


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


def tracepoint_field_offset(name: str, field: str) -> int | None:
    """Byte offset of a field in the tracepoint's record (from its format), None when absent."""
    system, event = name.split(":", 1)
    try:
        text = (TRACEFS / "events" / system / event / "format").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = dict(p.strip().split(":", 1) for p in line.split(";") if ":" in p)
        decl = parts.get("field", "").split()
        if decl and decl[-1].split("[")[0] == field and parts.get("offset", "").strip().isdigit():
            return int(parts["offset"])
    return None


def cgroup_identity(path: str) -> tuple[int, int]:
    """(cgroup v2 id, level) of a cgroup v2 folder: the id is the folder's inode number."""
    p = Path(path)
    if not p.is_dir():
        raise ProbeError(f"cgroup {path} does not exist: pass a cgroup v2 folder, e.g. /sys/fs/cgroup/unified/job")
    if not (p / "cgroup.controllers").exists():  # a cgroup v1 folder: its inode is no cgroup v2 id
        raise ProbeError(f"{path} is not a cgroup v2 folder: pass one under the cgroup2 mount (mount -t cgroup2), "
                         "e.g. /sys/fs/cgroup/unified/job")
    root = p
    while root.parent != root and (root.parent / "cgroup.procs").exists():
        root = root.parent
    level = len(p.relative_to(root).parts)
    return os.stat(p).st_ino, level


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

    def __init__(self, target: TargetSpec, sources: Sequence[BpfSource], generated: Sequence[str] = (),
                 settings: Settings | None = None, *, definitions: events.Definitions) -> None:
        """`definitions`: every layer's records (recorder/layers/__init__.py `definitions()`)."""
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
        self.settings = settings or Settings.from_environment()
        self.sources = tuple(sources)
        self.definitions = definitions
        self.capabilities: list[Capability] = []
        self.layers: list[str] = []  # the layers whose BPF sources were compiled
        self.optional: dict[str, tuple[str, ...]] = {}  # layer -> optional tracepoints present
        text = self._source(generated)
        try:
            # -g0: no debug info, so no BTF for the programs (line info in verifier messages and
            # bpftool dumps); no program uses what needs it, and it was a third of the compile
            self.bpf = BPF(text=text, cflags=["-Wno-macro-redefined", "-Wno-unused-function", "-g0"])
        except Exception as e:  # BCC raises bare Exception for compile and load failures
            raise ProbeError(f"BPF programs failed to load ({e}): run 'recorder doctor'") from None
        for source in self.sources:
            if source.layer in self.layers:
                for tp in source.required + self.optional.get(source.layer, ()):
                    self.cap(source.layer, tp, "attached")
        # the CPython stack walker, tail-called by every CUDA, NCCL and marker entry, and its
        # tracepoint copy for blocking switches and block I/O (per-process status: recorder/core/stacks.py)
        self.pystack = PyStackProbe(self.bpf)
        for probe, install in (("cpython frames walker", self.pystack.install),
                               ("cpython frames walker (tracepoints)", self.pystack.install_tracepoints)):
            try:
                install()
            except Exception as e:  # every record then says "walker not installed"
                self.cap("python", probe, "failed", failure(e))
        self.attached_libraries: dict[str, int] = {}  # resolved path -> probes attached
        self.drop_counts = [0] * len(definitions.probe_names)
        self._misses: dict[str, int] = {}  # program -> recursion misses read so far
        self._layers_of_programs: dict[str, str] | None = None
        self.rings: ringbuf.RingSet | None = None  # set by open_rings() where the fast reader works
        self._skipped_seen = 0
        self._callbacks: list[Any] = []  # add_ring()'s callbacks where BCC reads the rings
        self._adopted: list[int] = []

    def cap(self, layer: str, probe: str, status: str, detail: str = "", target: str = "") -> None:
        """Record one attach decision (attached / absent / failed) for the capability table."""
        self.capabilities.append(Capability(layer, probe, status, detail, target, now_ns()))

    def _source(self, generated: Sequence[str]) -> str:
        parts = [
            *self._prelude(),
            bpf.source("common.h"),
            # pasted, not #included (BCC rewrites map syntax in the main text only), before the layers:
            # the CUDA entries end with its capture and task.bpf.c drops a recipe at exec
            # the CUDA calls' in-flight records, where the walker leaves a known stack's digest
            bpf.source("cuda_inflight.h"),
            "#define PYSTACK_RINGBUF_PAGES 2048\n" + bpf_source(),
        ]
        for source in self.sources:
            missing = [tp for tp in source.required if not tracepoint_exists(tp)]
            if missing:
                for tp in missing:
                    self.cap(source.layer, tp, "absent", "tracepoint not in this kernel")
                continue
            self.layers.append(source.layer)
            parts.append(self._optional_tracepoints(source))
            parts.append(bpf.source(source.filename))
        parts.extend(generated)
        return "\n".join(parts)

    def secondary_source(self, text: str, pystack_ring_pages: int, walker_defines: str = "") -> str:
        """The C of a BPF object compiled after the start (recorder/core/secondary.py) that uses this
        session's maps: the same definitions and target, the shared maps declared "extern"
        (bpf/common.h SESSION_TABLE), the CPython walker with a ring, scratch and counts of its own
        (`walker_defines` before it), then `text`."""
        return "\n".join([
            "#define BPF_SECONDARY 1",
            *self._prelude(),
            bpf.source("common.h"),
            walker_defines,
            f"#define PYSTACK_RINGBUF_PAGES {pystack_ring_pages}\n" + bpf_source(),
            text,
        ])

    def _prelude(self) -> list[str]:
        t = self.target
        cg_id, cg_level = cgroup_identity(t.cgroup) if t.cgroup else (0, 0)
        return [
            self.definitions.c_text(),
            f"#define TARGET_MODE {t.mode}",
            f"#define TARGET_CGROUP_ID {cg_id}ull",
            f"#define TARGET_CGROUP_LEVEL {cg_level}",
            f"#define SELF_TGID {os.getpid()}",
            f"#define RING_CPUS {possible_cpus()}",
            f"#define BLOCK_INFLIGHT_ENTRIES {self.settings.block_inflight}",
            f"#define BLOCK_RING_PAGES {self.settings.block_ring_pages}",
            f"#define DLOPEN_HOLD {int(self.settings.dlopen_hold)}",
            f"#define CUDA_LATE_STACK_NS {self.settings.launch_stack_min_us * 1000}ull",
            f"#define CUDA_STACK_SAMPLE_MASK {self.settings.launch_stack_sample - 1}u",
            "#define CUDA_COUNT_FLUSH_NS 1000000000ull",  # a thread's launch counts are sent at least once a second
            "#define CUDA_TALLY_THREADS 65536",
            # the reader's wake-ups owed by programs that run with interrupts on are sent from
            # sched_switch when the scheduler layer is loaded (bpf/common.h)
            "#define RING_WAKE_AT_SWITCH 1" if self._loads("sched") else "",
        ]

    def _loads(self, layer: str) -> bool:
        """Whether the session compiles `layer`'s BPF source (its required tracepoints exist)."""
        return any(source.layer == layer and all(tracepoint_exists(tp) for tp in source.required)
                   for source in self.sources)

    def _optional_tracepoints(self, source: BpfSource) -> str:
        """#defines HAVE_TP_<system>_<event> for the source's optional tracepoints this kernel has."""
        present = tuple(tp for tp in source.optional if tracepoint_exists(tp))
        self.optional[source.layer] = present
        for tp in source.optional:
            if tp not in present:
                self.cap(source.layer, tp, "absent", "tracepoint not in this kernel")
        for tp in source.not_recorded:
            self.cap(source.layer, tp, "absent", "not recorded by this version" if tracepoint_exists(tp)
                     else "tracepoint not in this kernel")
        fields = tuple(f"{tp.replace(':', '_')}_{field}" for tp, field in source.optional_fields
                       if tracepoint_has_field(tp, field))
        return "\n".join([f"#define HAVE_TP_{tp.replace(':', '_')} 1" for tp in present]
                         + [f"#define HAVE_TPF_{name} 1" for name in fields])

    # -- targets ----------------------------------------------------------------------------------
    def add_pid(self, pid: int) -> None:
        self.bpf["targets"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    # -- uprobes ----------------------------------------------------------------------------------
    def attach_dlopen(self) -> None:
        libc = find_libc()
        if libc is None:
            self.cap("task", "dlopen", "absent", "no C library mapped by the recorder")
            return
        names = exported_functions(os.path.realpath(libc))
        for sym in ("dlopen", "dlmopen"):
            if sym not in names:
                continue
            try:
                self.bpf.attach_uretprobe(name=libc, sym=sym, fn_name="task_dlopen_return")
                self.cap("task", sym, "attached", "", libc)
            except Exception as e:
                self.cap("task", sym, "failed", failure(e), libc)

    # -- consumption ------------------------------------------------------------------------------
    def open_rings(self, sinks: dict[str, Callable[[bytes], None]],
                   blocks: dict[str, int] | None = None) -> None:
        """Register one sink per ring buffer name; each gets every record's raw bytes. A ring named
        in `blocks` (name -> record size) hands its sink blocks of framed records instead
        (recorder/core/ringbuf.py: an 8-byte header before each record; `events.Layout.iter_framed`).

        On x86-64 the rings are read from their memory mapping (a loop over many records per call,
        no Python callback per record); elsewhere, or with STALL_RECORDER_BCC_RINGS=1, through
        BCC's callback per record.
        """
        blocks = blocks or {}
        fast = ringbuf.supported() and not self.settings.bcc_rings
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

    def add_ring(self, fd: int, data_size: int, sink: Callable[[bytes], None]) -> None:
        """Read one more ring buffer (of a BPF object compiled after the start, by its fd) from now on."""
        if self.rings is not None:
            self.rings.add(fd, data_size, sink)
            return
        from bcc.libbcc import _RINGBUF_CB_TYPE  # BCC's own callback type

        def callback(ctx, data, size, _sink=sink):
            _sink(ctypes.string_at(data, size))
            return 0

        fn = _RINGBUF_CB_TYPE(callback)
        self._callbacks.append(fn)  # BCC's reader calls it for as long as the session runs
        self.bpf._open_ring_buffer(fd, fn)

    def adopt(self, fds: Sequence[int]) -> None:
        """File descriptors (of maps and programs of a later BPF object) closed with the session's maps."""
        self._adopted.extend(fds)

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

    def read_drops(self) -> list[tuple[str, int]]:
        """(`loss.probe`, events lost since the last call) of every drop counter (`definitions.probe_names`)."""
        table = self.bpf["drops"]
        deltas = []
        for i, name in enumerate(self.definitions.probe_names):
            total = sum(table[ctypes.c_int(i)])
            deltas.append((name, total - self.drop_counts[i]))
            self.drop_counts[i] = total
        return deltas

    def program_layers(self) -> dict[str, str]:
        """BCC function name -> layer of every program a compiled source defines (the CPython stack
        walkers and anything else: 'python')."""
        out: dict[str, str] = {}
        for source in self.sources:
            if source.layer not in self.layers:
                continue
            text = bpf.source(source.filename)
            for system, event in _TRACEPOINT_PROBE.findall(text):
                out[f"tracepoint__{system}__{event}"] = source.layer
            for name in _FUNCTION.findall(text):
                out.setdefault(name, source.layer)
        return out

    def read_recursion_misses(self) -> list[tuple[str, int]]:
        """(`loss.probe`, runs) of the programs the kernel did not run since the last call because
        another BPF program was running on that CPU (each program's recursion_misses, read from its
        fdinfo). Programs whose skipped run loses no record (the interrupt-context notes of
        bpf/sched.bpf.c) are left out."""
        layers = self._layers_of_programs
        if layers is None:
            layers = self._layers_of_programs = self.program_layers()
        out = []
        for key, fn in list(self.bpf.funcs.items()):
            name = key.decode() if isinstance(key, bytes) else str(key)
            if name in _NO_RECORD_PROGRAMS:
                continue
            try:
                found = _RECURSION_MISSES.search(Path(f"/proc/self/fdinfo/{fn.fd}").read_text())
            except (OSError, AttributeError):
                continue
            if not found:
                continue
            total = int(found.group(1))
            delta = total - self._misses.get(name, 0)
            self._misses[name] = total
            if delta > 0:
                out.append((f"bpf program {name} skipped ({layers.get(name, 'python')})", delta))
        return out

    def cleanup(self) -> None:
        """Detach every probe, then free the programs and maps. The kernel detaches a perf event at
        its last close, one at a time and tens of ms each (it waits for a grace period under a
        lock the closes share): closing 80 tracepoints and a few uprobes took 3-4 s whichever
        thread closed them. So the closes are handed to a helper process (`detach_all`): this
        process is done with its probes at once, and the helper's exit detaches them after. A
        process that exits without this closes them in its own exit, one after the other, in the
        D state."""
        try:  # no program of the session does anything from now on (bpf/common.h, session_stopped)
            table = self.bpf["session_stopped"]
            table[table.Key(0)] = table.Leaf(1)
        except (KeyError, OSError):  # a session compiled without it: the programs run until detached
            pass
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        detach_all(self.bpf)
        self.bpf.cleanup()
        for fd in self._adopted:
            os.close(fd)
        self._adopted = []


DETACH_THREADS = 32
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe/type")
_DETACHERS: list[subprocess.Popen] = []  # helpers still detaching (reaped by subprocess, or by init)


def _detacher(fds: list[int]) -> subprocess.Popen | None:
    """A helper process that holds `fds` (perf events) until its input closes, then exits, and
    so detaches them in its exit: the last close of each is its own. None where it cannot start
    (the caller then closes them itself)."""
    import sys

    try:
        helper = subprocess.Popen([sys.executable, "-S", "-E", "-c", "import os\nos.read(0, 1)"],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  pass_fds=fds, start_new_session=True, cwd="/")
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    _DETACHERS[:] = [p for p in _DETACHERS if p.poll() is None]
    _DETACHERS.append(helper)
    return helper


def detach_all(bpf_object: Any, hand_off: bool = True) -> None:
    """Close the perf events of a BCC object's tracepoints, uprobes and kprobes, and forget them
    (its cleanup() then finds nothing of them to detach). With `hand_off` a helper process holds
    them first, so this process's closes are not their last and cost nothing; the helper detaches
    them in its exit (seconds, see `Probes.cleanup`), with no file of the recording open. Without
    one (or where a uprobe was made through tracefs, whose event this process removes after the
    close) they are closed here, from several threads, whose waits overlap where the kernel lets
    them. A close that fails is left to cleanup(), which says why."""
    from concurrent.futures import ThreadPoolExecutor

    from bcc import lib

    def close_tracepoint(tp: bytes) -> None:
        if lib.bpf_close_perf_event_fd(bpf_object.tracepoint_fds[tp]) >= 0:
            del bpf_object.tracepoint_fds[tp]  # bpf_detach_tracepoint() has nothing to do

    def close_uprobe(name: bytes) -> None:
        # the event tracefs held, if it was made there (older kernels): removed as cleanup() does
        if lib.bpf_close_perf_event_fd(bpf_object.uprobe_fds[name]) >= 0 and lib.bpf_detach_uprobe(name) >= 0:
            bpf_object._del_uprobe_fd(name)

    def close_kprobe(name: bytes) -> None:
        if lib.bpf_close_perf_event_fd(bpf_object.kprobe_fds[name]) >= 0 and lib.bpf_detach_kprobe(name) >= 0:
            bpf_object._del_kprobe_fd(name)

    jobs: list[tuple[Callable[[bytes], None], bytes]] = [
        *((close_tracepoint, k) for k in list(bpf_object.tracepoint_fds)),
        *((close_uprobe, k) for k in list(bpf_object.uprobe_fds)),
        *((close_kprobe, k) for k in list(bpf_object.kprobe_fds)),
    ]
    if not jobs:
        return
    if hand_off:
        held = list(bpf_object.tracepoint_fds.values())
        if UPROBE_PMU.exists():  # uprobes made by perf_event_open: nothing in tracefs to remove
            held += [fd for fd in bpf_object.uprobe_fds.values() if isinstance(fd, int)]
        helper = _detacher(held) if held else None
        if helper is not None:
            try:
                for fn, name in jobs:  # not the last close of any held: no wait
                    fn(name)
            finally:
                assert helper.stdin is not None
                helper.stdin.close()  # the helper exits, and its exit detaches them
            return
    with ThreadPoolExecutor(max_workers=min(DETACH_THREADS, len(jobs)), thread_name_prefix="detach") as pool:
        for job in [pool.submit(fn, name) for fn, name in jobs]:
            job.result()
