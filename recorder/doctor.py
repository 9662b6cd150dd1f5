"""`recorder doctor`: can this machine record, and what is missing? One line per check."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recorder.core import kheaders
from recorder.core.loader import TRACEFS, ensure_tracefs, tracepoint_exists
from recorder.errors import UserError
from recorder.layers import bpf_sources, gpu
from recorder.layers.cuda import library_kind

CAP_PERFMON = 38
CAP_BPF = 39
CAP_SYS_ADMIN = 21

# Tracepoints later layers use; reported so a user sees up front what a session will observe.
OPTIONAL_TRACEPOINTS = (
    "block:block_bio_queue", "block:block_rq_insert", "block:block_rq_issue",
    "block:block_rq_complete", "block:block_rq_error", "block:block_rq_requeue",
    "nvme:nvme_setup_cmd", "nvme:nvme_complete_rq", "dma:dma_map_phys", "dma:dma_map_page",
    "swiotlb:swiotlb_bounced", "iommu:io_page_fault", "oom:mark_victim",
    "vmscan:mm_vmscan_direct_reclaim_begin", "vmscan:mm_vmscan_direct_reclaim_end",
    "writeback:balance_dirty_pages", "tcp:tcp_retransmit_skb",
    "task:task_newtask",  # a forked Python walks with its parent's recipe from its first call
)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True
    probes: dict = field(default_factory=dict)  # API -> where its uprobe goes (probe trap checks)


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _bpf_syscall_works() -> bool:
    """Create and close a tiny BPF array map through the bpf() syscall."""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 30)()
    attr[0], attr[1], attr[2], attr[3] = 2, 4, 4, 1  # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
    fd = libc.syscall(321, 0, ctypes.byref(attr), ctypes.sizeof(attr))  # __NR_bpf, BPF_MAP_CREATE
    if fd < 0:
        return False
    os.close(fd)
    return True


def _find_gpu_libraries() -> list[str]:
    found = []
    for name in ("cudart", "cuda", "nccl"):
        path = ctypes.util.find_library(name)
        if path:
            found.append(path)
    return found


def _library_path(name: str) -> str | None:
    """The file the dynamic loader would open for a library name ctypes found ('libcuda.so.1')."""
    if name.startswith("/"):
        return name if os.path.exists(name) else None
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        left, _, path = line.partition(" => ")
        if left.strip().split(" ", 1)[0] == name and "x86-64" in left and os.path.exists(path.strip()):
            return path.strip()
    return None


def _traced_functions(path: str) -> tuple[str, tuple[str, ...]] | None:
    """(layer, the functions its uprobes go on) of a CUDA or NCCL library, None for another file."""
    from recorder.core.libraries import cuda_library_kind, workload_library_kind
    from recorder.layers.cuda import APIS
    from recorder.layers.workload import nccl

    kind = cuda_library_kind(path)
    if kind:
        return "cuda", tuple(dict.fromkeys(a.name for a in APIS if a.library == kind))
    if workload_library_kind(path) == "nccl":
        return "nccl", tuple(a.name for a in nccl.APIS)
    return None


def probe_trap_checks(paths: list[str]) -> list[Check]:
    """Per CUDA/NCCL library: where each of its traced functions' uprobe goes and what the kernel
    does there (recorder/core/x86insn.py): emulated (one trap a call), moved past a single-stepped
    entry to an emulated instruction, or single-stepped (two traps, about 3x the cost)."""
    from recorder.core.libraries import exported_functions
    from recorder.core.x86insn import entry_sites, kernel_version

    checks = []
    seen = set()
    for path in paths:
        real = os.path.realpath(path)
        traced = _traced_functions(real)
        if real in seen or traced is None:
            continue
        seen.add(real)
        layer, names = traced
        exported = exported_functions(real)
        sites = entry_sites(real, tuple(n for n in names if n in exported))
        probes = {name: site.placement.as_dict() for name, site in sorted(sites.items()) if site}
        counts: dict[str, int] = {}
        for p in probes.values():
            counts[p["status"]] = counts.get(p["status"], 0) + 1
        if not probes:
            continue
        stepped = [n for n, p in probes.items() if p["status"] == "single-stepped"]
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        v = kernel_version()
        detail = f"{real}: {len(probes)} {layer} probes on kernel {v[0]}.{v[1]}: {summary}"
        if stepped:
            detail += " (" + ", ".join(stepped[:4]) + (", ..." if len(stepped) > 4 else "") + ")"
        checks.append(Check(f"probe traps {Path(real).name}", not stepped, detail,
                            "these entries are single-stepped, two traps a call (about 3x an emulated one), and "
                            "cannot be moved; why, per probe: recorder doctor --json", required=False,
                            probes=probes))
    return checks


def run_checks(pids: tuple[int, ...] = ()) -> list[Check]:
    checks: list[Check] = []
    caps = _effective_caps()
    root = os.geteuid() == 0
    has_caps = bool(caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1) or bool(caps >> CAP_SYS_ADMIN & 1)
    checks.append(Check("privileges", root or has_caps,
                        "root" if root else ("CAP_BPF+CAP_PERFMON" if has_caps else "unprivileged user"),
                        "run as root, or grant CAP_BPF and CAP_PERFMON"))
    bpf_ok = _bpf_syscall_works() if (root or has_caps) else False
    checks.append(Check("bpf syscall", bpf_ok, "BPF maps can be created" if bpf_ok else "bpf() refused",
                        "needs privileges and a kernel with CONFIG_BPF_SYSCALL; check "
                        "kernel.unprivileged_bpf_disabled and seccomp/container policy"))
    btf = Path("/sys/kernel/btf/vmlinux")
    checks.append(Check("kernel BTF", btf.exists(), str(btf) if btf.exists() else "missing",
                        "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (Python frames need it)",
                        required=False))
    tracefs = ensure_tracefs()
    checks.append(Check("tracefs", tracefs, str(TRACEFS) if tracefs else "not mounted",
                        "mount -t tracefs nodev /sys/kernel/tracing"))
    for source in bpf_sources():
        layer = source.layer
        for tp in source.required:
            present = tracefs and tracepoint_exists(tp)
            checks.append(Check(f"tracepoint {tp}", present, "present" if present else "absent",
                                f"the {layer} layer is not recorded without it; use a newer kernel"))
    for tp in OPTIONAL_TRACEPOINTS:
        present = tracefs and tracepoint_exists(tp)
        checks.append(Check(f"tracepoint {tp}", present, "present" if present else "absent",
                            "optional: that layer falls back to the kernel log or is not observed",
                            required=False))
    checks.append(_profile_check(root or has_caps))
    uprobes = Path("/sys/bus/event_source/devices/uprobe").exists()
    checks.append(Check("uprobes", uprobes, "available" if uprobes else "missing",
                        "use a kernel with CONFIG_UPROBE_EVENTS=y"))
    try:
        import bcc  # noqa: F401

        bcc_ok, bcc_detail = True, f"bcc {getattr(bcc, '__version__', '')}".strip()
    except ImportError:
        bcc_ok, bcc_detail = False, "python module bcc missing"
    checks.append(Check("bcc", bcc_ok, bcc_detail,
                        "apt-get install python3-bpfcc (Fedora: dnf install python3-bcc) and use a "
                        "venv made with --system-site-packages"))
    headers = kheaders.locate(prepare=False)
    checks.append(Check("kernel headers", headers.path is not None, headers.detail,
                        f"apt-get install linux-headers-{os.uname().release} or the generic headers"))
    libs = _find_gpu_libraries()
    for pid in pids:
        from recorder.core.libraries import mapped_files

        libs += [p for p in mapped_files(pid) if library_kind(p) or "libnccl" in p]
    checks.append(Check("CUDA/NCCL libraries", bool(libs), ", ".join(sorted(set(libs))) or "none found",
                        "none on the library path: the recorder finds them in each target's "
                        "/proc/PID/maps, or pass --cuda-lib PATH", required=False))
    checks += probe_trap_checks([p for p in (_library_path(lib) for lib in libs) if p])
    checks.append(_nvml_check())
    return checks


def _profile_check(privileged: bool) -> Check:
    """Whether a session's on-CPU profile can sample: its perf events, and the rate it would use."""
    from recorder.core.settings import Settings
    from recorder.layers.profile import perf_events_check

    name = "on-CPU profile"
    try:
        hz = Settings.from_environment().profile_hz
    except UserError as e:
        return Check(name, False, str(e), "give STALL_RECORDER_PROFILE_HZ a rate from 0 to 1000", required=False)
    if not hz:
        return Check(name, True, "turned off (STALL_RECORDER_PROFILE_HZ=0)", required=False)
    ok, detail = perf_events_check() if privileged else (False, "needs privileges")
    return Check(name, ok, f"{detail}; {hz} samples a second on each CPU, attached seconds after a recording "
                 "begins (its programs are compiled once it records)" if ok else detail,
                 "run as root or grant CAP_PERFMON (or set kernel.perf_event_paranoid to 0 or less); without them "
                 "a recording has no on-CPU samples", required=False)


def _nvml_check() -> Check:
    """Whether a session will sample GPU utilisation through NVML, and on which GPUs."""
    name = "NVML (GPU utilisation)"
    fix = (f"GPU utilisation is not sampled: install the NVIDIA driver (libnvidia-ml.so.1) and nvidia-ml-py, "
           f"or point {gpu.LIBRARY_ENV} at libnvidia-ml.so.1")
    try:
        settings = gpu.GpuSettings.from_environment()
        nvml, gpus, driver = gpu.open_nvml(settings.library)
    except (UserError, gpu.NvmlUnavailable) as e:
        return Check(name, False, str(e), fix, required=False)
    nvml.nvmlShutdown()
    names = ", ".join(f"{g.index}: {g.name} ({g.pci_address})" for g in gpus)
    return Check(name, True, f"driver {driver}, {len(gpus)} GPU(s): {names}")


def can_record(checks: list[Check]) -> bool:
    return all(c.ok for c in checks if c.required)


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        line = f"{mark} {c.name}: {c.detail}"
        if not c.ok and c.fix:
            line += f" -> {c.fix}"
        lines.append(line)
    verdict = "recording can work" if can_record(checks) else "recording cannot work until the FAIL lines are fixed"
    lines.append(verdict)
    return "\n".join(lines)


def as_json(checks: list[Check]) -> dict:
    """Every check; a probe trap check has `probes`: per traced function, where its uprobe goes
    (`status` emulated / moved / single-stepped / refused, `offset`, the `entry` instruction and
    the `probed` one, the kernel's `handling`, the `reason` it was not moved, `detail`)."""
    out = []
    for c in checks:
        row = asdict(c)
        if not row["probes"]:
            del row["probes"]
        out.append(row)
    return {"can_record": can_record(checks), "checks": out}
