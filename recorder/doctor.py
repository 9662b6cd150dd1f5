"""`recorder doctor`: can this machine record, and what is missing? One line per check."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import asdict, dataclass
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
    checks.append(_nvml_check())
    return checks


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
    return {"can_record": can_record(checks), "checks": [asdict(c) for c in checks]}
