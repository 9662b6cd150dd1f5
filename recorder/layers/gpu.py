"""GPU utilisation through NVML (nvidia-ml-py's `pynvml` over libnvidia-ml.so.1), sampled by a
thread of the recorder process (never the traced one) into `gpu_sample`.

Why every 100 ms by default: NVML's `utilization.gpu` is the share of its own sample period in
which a kernel ran, and that period is between 1/6 s and 1 s depending on the product
(nvmlDeviceGetUtilizationRates in nvml.h). Reading faster than the shortest period sees every value
NVML produces within 100 ms of it; on products with longer periods consecutive samples repeat the
value, which is stored as read. One sample is six NVML calls per GPU. Where the driver keeps its
own utilisation samples (nvmlDeviceGetSamples, NVML_GPU_UTILIZATION_SAMPLES: every 1/6 s or finer
on data-centre GPUs), each poll moves the ones newer than the last read into rows of their own
(util_gpu only, at the driver's time), and the poll's row carries the other metrics with util_gpu
NULL; a driver without the buffer is polled as above (capability 'utilization_samples' says which).

Where NVML cannot be used (no nvidia-ml-py, no libnvidia-ml.so.1, no driver, no GPU) the session
records layer 'gpu' as absent with NVML's reason and records everything else. A metric a GPU does
not support (power on some boards) is NULL in its samples and recorded once as absent.

Settings (recorder/core/settings.py):
    STALL_RECORDER_NVML_LIB=PATH         load this libnvidia-ml.so.1 instead of the loader's
    STALL_RECORDER_GPU_INTERVAL_MS=N     sample every N ms (10-60000; 0 turns sampling off)
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.core.clock import now_ns
from recorder.core.events import Loss
from recorder.core.layer import BaseLayer, Context, Observation, Phase
from recorder.core.settings import DEFAULT_GPU_INTERVAL_MS, Settings
from recorder.errors import UserError
from store.db import Writer

LIBRARY_ENV = Settings.variable("nvml_lib")
INTERVAL_ENV = Settings.variable("gpu_interval_ms")
DEFAULT_INTERVAL_S = DEFAULT_GPU_INTERVAL_MS / 1000
SONAME = "libnvidia-ml.so.1"
COLUMNS = ("session_id", "ts", "gpu_index", "pci_address", "name", "util_gpu", "util_mem", "mem_used_bytes",
           "mem_total_bytes", "sm_clock_mhz", "power_mw", "temperature_c")
CAPABILITY_COLUMNS = ("session_id", "layer", "probe", "target", "status", "detail", "ts")
LOSS_COLUMNS = ("session_id", "ts", "probe", "dropped")
LOSS_PROBE = "nvml_sample"  # `loss.probe` of samples a GPU did not answer


@dataclass(frozen=True)
class GpuSettings:
    """Where libnvidia-ml.so.1 comes from and how often to sample; `interval_s` 0 means off."""

    library: Path | None = None
    interval_s: float = DEFAULT_INTERVAL_S

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> GpuSettings:
        return cls.from_settings(Settings.from_environment(environ, only=("nvml_lib", "gpu_interval_ms")))

    @classmethod
    def from_settings(cls, settings: Settings) -> GpuSettings:
        return cls(settings.nvml_lib, settings.gpu_interval_s)


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message is the one-line reason stored in `capability`."""


@dataclass
class Gpu:
    index: int
    handle: object
    name: str
    pci_address: str | None
    missing: set[str] = field(default_factory=set)  # metrics this GPU does not support
    # the driver's utilisation sample buffer (nvmlDeviceGetSamples): None until tried, then whether
    # it answers; last_us is the newest sample's stamp read (us of CLOCK_REALTIME, as NVML stamps)
    buffer: bool | None = None
    last_us: int = 0


def pci_address(bus_id: str) -> str:
    """NVML's bus id (00000000:1B:00.0) in the kernel's spelling (0000:1b:00.0)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    if len(domain) > 4 and domain.startswith("0" * (len(domain) - 4)):
        domain = domain[-4:]
    return f"{domain}:{rest}"


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def open_nvml(library: Path | None = None):
    """Load NVML (the given library, else the loader's libnvidia-ml.so.1), initialise it and list
    the GPUs; returns (pynvml, [Gpu], driver version). Raises NvmlUnavailable with the reason."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("python module pynvml missing (pip install nvidia-ml-py)") from None
    if library is not None:
        # pynvml opens "libnvidia-ml.so.1" by name; once a library with that soname is loaded, the
        # dynamic loader hands that one back instead of searching.
        try:
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise UserError(f"{LIBRARY_ENV}={library}: cannot load it ({e})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if e.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            raise NvmlUnavailable(f"{SONAME} not found (no NVIDIA driver installed)") from None
        raise NvmlUnavailable(f"nvmlInit failed: {e}") from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        driver = "unknown"
    gpus = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(Gpu(index, handle, _text(pynvml.nvmlDeviceGetName(handle)),
                            pci_address(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))))
    except pynvml.NVMLError as e:
        pynvml.nvmlShutdown()
        raise NvmlUnavailable(f"listing GPUs failed: {e}") from None
    if not gpus:
        pynvml.nvmlShutdown()
        raise NvmlUnavailable(f"NVML (driver {driver}) reports no GPU")
    return pynvml, gpus, driver


class GpuSampler:
    """Samples every GPU from a background thread; the session's loop moves the samples into its
    writer (`flush`), so only the loop's thread ever touches the writer."""

    def __init__(self, writer: Writer, session_id: int, settings: GpuSettings) -> None:
        self.writer = writer
        self.session_id = session_id
        self.settings = settings
        self.gpus: list[Gpu] = []
        self.samples: collections.deque[tuple] = collections.deque()
        self.capability: collections.deque[tuple] = collections.deque()
        self.failures: collections.deque[int] = collections.deque()  # ts of samples that failed
        self.status = ("absent", "not started")  # of the 'nvml' probe, for the start summary
        self._never: set[int] = set()  # NVML answers meaning "this GPU never has that metric"
        self._nvml: Any = None  # the pynvml module once loaded (untyped)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        writer.table("gpu_sample", COLUMNS)
        writer.table("capability", CAPABILITY_COLUMNS)
        writer.table("loss", LOSS_COLUMNS)

    def start(self) -> bool:
        """Open NVML and start sampling; False (and layer 'gpu' absent) when it cannot."""
        target = str(self.settings.library or "")
        if not self.settings.interval_s:
            self._cap("nvml", target, "absent", f"turned off ({INTERVAL_ENV}=0)")
            return False
        try:
            self._nvml, self.gpus, driver = open_nvml(self.settings.library)
        except NvmlUnavailable as e:
            self._cap("nvml", target, "absent", str(e))
            return False
        nvml = self._nvml
        self._never = {nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_NO_PERMISSION,
                       nvml.NVML_ERROR_FUNCTION_NOT_FOUND}
        ms = round(self.settings.interval_s * 1000)
        self._cap("nvml", target, "attached", f"{len(self.gpus)} GPU(s), driver {driver}, sampled every {ms} ms")
        for gpu in self.gpus:
            self._cap("gpu_sample", gpu.pci_address or str(gpu.index), "attached", gpu.name)
        self._thread = threading.Thread(target=self._run, name="stall-gpu-sampler", daemon=True)
        self._thread.start()
        return True

    def _cap(self, probe: str, target: str, status: str, detail: str) -> None:
        if probe == "nvml":
            self.status = (status, detail)
        self.capability.append((self.session_id, "gpu", probe, target, status, detail, now_ns()))

    def _run(self) -> None:
        interval = self.settings.interval_s
        due = time.monotonic()
        while not self._stop.is_set():
            for gpu in self.gpus:
                self.sample(gpu)
            due += interval
            wait = due - time.monotonic()
            if wait < 0:  # NVML was slower than the interval: skip the missed ticks, do not burst
                due, wait = time.monotonic(), 0
            self._stop.wait(wait)

    def sample(self, gpu: Gpu) -> None:
        """Read one GPU now into a pending row."""
        nvml = self._nvml
        ts = now_ns()
        util = self._read(gpu, "utilization", nvml.nvmlDeviceGetUtilizationRates, gpu.handle)
        if util is None and "utilization" not in gpu.missing:
            self.failures.append(ts)  # a GPU that did not answer this time: counted in `loss`
            return
        memory = self._read(gpu, "memory", nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
        # the driver's own samples, finer than this poll where it keeps them: utilisation from
        # there, and this row then carries the other metrics only (one source per series)
        buffered = self._buffered(gpu)
        self.samples.append((
            self.session_id, ts, gpu.index, gpu.pci_address, gpu.name,
            util.gpu if util and not buffered else None, util.memory if util else None,
            memory.used if memory else None, memory.total if memory else None,
            self._read(gpu, "sm_clock", nvml.nvmlDeviceGetClockInfo, gpu.handle, nvml.NVML_CLOCK_SM),
            self._read(gpu, "power", nvml.nvmlDeviceGetPowerUsage, gpu.handle),
            self._read(gpu, "temperature", nvml.nvmlDeviceGetTemperature, gpu.handle, nvml.NVML_TEMPERATURE_GPU),
        ))

    def _buffered(self, gpu: Gpu) -> bool:
        """Move the driver's utilisation samples newer than the last read (nvmlDeviceGetSamples)
        into pending rows, stamped in CLOCK_MONOTONIC; False where the driver keeps none (the
        poll's value is then the sample)."""
        nvml = self._nvml
        if gpu.buffer is False:
            return False
        if gpu.buffer is None:  # from now on: the buffer holds samples from before the session
            gpu.last_us = time.time_ns() // 1000
        try:
            _, samples = nvml.nvmlDeviceGetSamples(gpu.handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, gpu.last_us)
        except nvml.NVMLError as e:
            if e.value == nvml.NVML_ERROR_NOT_FOUND:  # none newer yet
                if gpu.buffer is None:
                    self._cap("utilization_samples", gpu.pci_address or str(gpu.index), "attached",
                              "the driver's utilisation samples (nvmlDeviceGetSamples)")
                gpu.buffer = True
                return True
            if gpu.buffer is None or e.value in self._never:
                gpu.buffer = False
                self._cap("utilization_samples", gpu.pci_address or str(gpu.index), "absent",
                          f"{e}: utilisation polled every {round(self.settings.interval_s * 1000)} ms")
                return False
            return True  # a failed read this time: the poll row keeps the other metrics
        if gpu.buffer is None:
            self._cap("utilization_samples", gpu.pci_address or str(gpu.index), "attached",
                      "the driver's utilisation samples (nvmlDeviceGetSamples)")
        gpu.buffer = True
        to_monotonic = now_ns() - time.time_ns()  # ns to add to a CLOCK_REALTIME stamp
        for sample in samples:
            if sample.timeStamp <= gpu.last_us:
                continue
            gpu.last_us = sample.timeStamp
            self.samples.append((self.session_id, sample.timeStamp * 1000 + to_monotonic, gpu.index,
                                 gpu.pci_address, gpu.name, min(int(sample.sampleValue.uiVal), 100),
                                 None, None, None, None, None, None))
        return True

    def _read(self, gpu: Gpu, metric: str, fn, *args):
        if metric in gpu.missing:
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as e:
            if e.value in self._never:
                gpu.missing.add(metric)
                self._cap(metric, gpu.pci_address or str(gpu.index), "absent", str(e))
            return None

    def flush(self) -> None:
        """Hand the samples and capability rows taken so far to the writer (the loop's thread)."""
        while self.capability:
            self.writer.add("capability", self.capability.popleft())
        rows = self.samples
        while rows:
            self.writer.add("gpu_sample", rows.popleft())
        per_second: collections.Counter[int] = collections.Counter()
        while self.failures:
            ts = self.failures.popleft()
            per_second[ts - ts % 1_000_000_000] += 1
        for second, n in sorted(per_second.items()):
            self.writer.add("loss", (self.session_id, second, LOSS_PROBE, n))

    def stop(self) -> None:
        """Stop sampling and release NVML; pending samples stay for the next `flush`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


class GpuLayer(BaseLayer):
    """The GPU layer: NVML samples from a thread of the recorder, started once the rings are open
    (`start`), moved into the writer at each flush, stopped first at the session stop."""

    name = "gpu"
    tables = ("gpu_sample",)
    losses = (Loss(LOSS_PROBE, "gpu", "GPU samples", "the GPU did not answer"),)
    observes = (Observation("gpu", "GPU utilisation (NVML)"),)
    flush_phase = Phase.DEVICES

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.sampler = GpuSampler(context.writer, context.session_id, GpuSettings.from_settings(context.settings))

    @property
    def status(self) -> tuple[str, str]:
        return self.sampler.status

    def summary(self) -> tuple[tuple[str, str, str, str], ...]:
        return (("gpu", "nvml", *self.status),)

    def start(self) -> None:
        """Sampling starts once the rings are open; the capability rows it made go out now."""
        self.sampler.start()
        self.flush()

    def flush(self) -> None:
        self.sampler.flush()

    def stop(self) -> None:
        """Stop sampling; its last samples go out with the next flush."""
        self.sampler.stop()
