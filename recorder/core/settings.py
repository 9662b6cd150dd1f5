"""Every setting of the recorder in one model: the STALL_RECORDER_* environment variables and the
defaults the command line shows. Read here and nowhere else; a bad value is a one-line UserError that
names the variable and says what to give instead.

    STALL_RECORDER_DB=PATH               the recording database when --db is not given (stall.db)
    STALL_RECORDER_MCP_TOKEN=TOKEN       bearer token of `recorder mcp --https` without --token-file
    STALL_RECORDER_NVML_LIB=PATH         load this libnvidia-ml.so.1 instead of the loader's
    STALL_RECORDER_GPU_INTERVAL_MS=N     sample the GPUs every N ms (10-60000; 0 turns sampling off)
    STALL_RECORDER_OFFCPU_STACKS=0       no Python stack at each blocking switch (on unless 0/off/no/false)
    STALL_RECORDER_OFFCPU_STACK_MIN_US=N a wait inside a syscall gets its Python stack when it lasts N us
                                         or more (default 1000; 0: every wait)
    STALL_RECORDER_BCC_RINGS=1           read the ring buffers through BCC's callbacks, not the mapping
    STALL_RECORDER_BLOCK_INFLIGHT=N      block requests followed in flight at once (64-1048576, 16384)
    STALL_RECORDER_BLOCK_RING_PAGES=N    pages of the block requests' ring (a power of two, 1-65536, 256)
    STALL_RECORDER_INFLIGHT_MAX_AGE_S=N  an in-flight block request with no end after N s is dropped and
                                         counted in `loss` (5-86400, 120)
    STALL_RECORDER_LAUNCH_STACK_MIN_US=N with LAUNCH_ROWS=1: a kernel launch that takes N us or more gets
                                         its Python and native stacks, taken at its return (default 100;
                                         0: every launch)
    STALL_RECORDER_LAUNCH_STACK_SAMPLE=N one launch in N (at random) is kept as a sample with its stacks;
                                         with LAUNCH_ROWS=1, of the faster launches one in N gets them (a
                                         power of two, 1-65536, default 64; 1: every launch)
    STALL_RECORDER_KEEP_RUNTIME_LAUNCHES=1 keep probing the runtime's kernel launches even once they are
                                         all seen at the driver (off unless 1/on/yes/true)
    STALL_RECORDER_LAUNCH_ROWS=1         one cuda_call row per kernel launch, with its duration (an entry and a
                                         return probe on each); by default launches are counted per thread at
                                         their entry, one trap each, and sampled (off unless 1/on/yes/true;
                                         `record`/`start` --launch-rows set it)
    STALL_RECORDER_PROFILE_HZ=N          sample the traced threads' on-CPU stacks N times a second on each
                                         CPU (1-1000, default 99; 0 turns the on-CPU profile off;
                                         `record`/`start` --profile-hz sets it)
    STALL_RECORDER_DLOPEN_HOLD=0         do not stop a process at the dlopen of a CUDA/NCCL library until
                                         its probes are attached (on unless 0/off/no/false)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from store.errors import UserError

PREFIX = "STALL_RECORDER_"
DEFAULT_DB = "stall.db"
DEFAULT_GPU_INTERVAL_MS = 100
DEFAULT_BLOCK_INFLIGHT = 16384
DEFAULT_BLOCK_RING_PAGES = 256
DEFAULT_INFLIGHT_MAX_AGE_S = 120
# Kernel launches are a job's most frequent calls (10,000-100,000 a second) and a fast one is never
# a stall: its stacks are taken at its return, only when it was slow or drawn as a sample
# (bpf/cuda.bpf.c). 100 us is below the smallest excess a slow call must have (slow_call_rule).
DEFAULT_LAUNCH_STACK_MIN_US = 100
DEFAULT_LAUNCH_STACK_SAMPLE = 64
# The on-CPU profile's samples a second on each CPU, on by default: 99, not 100, so the samples do not
# keep step with a job's own periodic work (a 10 ms timer, a 100 Hz loop), as sampling profilers of
# whole hosts commonly do; few enough that a traced thread's samples (their stacks, ~11 us each) cost
# ~0.1% of its CPU, enough that a 100 ms excess on the CPU gets ~10 samples (docs/benchmarks.md,
# "On-CPU profile").
DEFAULT_PROFILE_HZ = 99
MAX_PROFILE_HZ = 1000

# Shorter waits inside a syscall get no Python stack: they are a busy job's many small ones
# (thread-pool barriers, queue hand-offs), and no stall under 1 ms is reported.
DEFAULT_OFFCPU_STACK_MIN_US = 1000
MAX_OFFCPU_STACK_MIN_US = 10_000_000

_OFF = ("0", "off", "no", "false")
# field -> (lowest, highest, default, must be a power of two)
_SIZES = {
    "block_inflight": (64, 1 << 20, DEFAULT_BLOCK_INFLIGHT, False),
    "block_ring_pages": (1, 1 << 16, DEFAULT_BLOCK_RING_PAGES, True),
    "inflight_max_age_s": (5, 86400, DEFAULT_INFLIGHT_MAX_AGE_S, False),
    "launch_stack_min_us": (0, MAX_OFFCPU_STACK_MIN_US, DEFAULT_LAUNCH_STACK_MIN_US, False),
    "launch_stack_sample": (1, 1 << 16, DEFAULT_LAUNCH_STACK_SAMPLE, True),
    "profile_hz": (0, MAX_PROFILE_HZ, DEFAULT_PROFILE_HZ, False),
}


class _Invalid(ValueError):
    """A setting's one-line message, carried through pydantic's ValidationError unchanged."""


class Settings(BaseModel):
    """The recorder's settings; field `x` is read from $STALL_RECORDER_<X>."""

    model_config = ConfigDict(frozen=True)

    db: Path = Path(DEFAULT_DB)
    mcp_token: str | None = None
    nvml_lib: Path | None = None
    gpu_interval_ms: int = DEFAULT_GPU_INTERVAL_MS
    offcpu_stacks: bool = True
    offcpu_stack_min_us: int = DEFAULT_OFFCPU_STACK_MIN_US
    bcc_rings: bool = False
    block_inflight: int = DEFAULT_BLOCK_INFLIGHT
    block_ring_pages: int = DEFAULT_BLOCK_RING_PAGES
    inflight_max_age_s: int = DEFAULT_INFLIGHT_MAX_AGE_S
    dlopen_hold: bool = True
    launch_stack_min_us: int = DEFAULT_LAUNCH_STACK_MIN_US
    launch_stack_sample: int = DEFAULT_LAUNCH_STACK_SAMPLE
    keep_runtime_launches: bool = False
    launch_rows: bool = False
    profile_hz: int = DEFAULT_PROFILE_HZ

    @staticmethod
    def variable(name: str) -> str:
        return PREFIX + name.upper()

    @field_validator("db", mode="before")
    @classmethod
    def _db(cls, value: object) -> object:
        return value or DEFAULT_DB

    @field_validator("mcp_token", mode="before")
    @classmethod
    def _token(cls, value: object) -> object:
        return value or None

    @field_validator("nvml_lib", mode="before")
    @classmethod
    def _nvml_lib(cls, value: object) -> object:
        if not value:
            return None
        if not Path(str(value)).is_file():
            raise _Invalid(f"{PREFIX}NVML_LIB={value}: no such file: point it at a libnvidia-ml.so.1 or unset it")
        return value

    @field_validator("gpu_interval_ms", mode="before")
    @classmethod
    def _interval(cls, value: object) -> object:
        if isinstance(value, int):
            text = str(value)
        else:
            text = str(value or "").strip()
            if not text:
                return DEFAULT_GPU_INTERVAL_MS
        if not text.isdigit() or not (int(text) == 0 or 10 <= int(text) <= 60_000):
            raise _Invalid(f"{PREFIX}GPU_INTERVAL_MS={text}: give whole milliseconds from 10 to 60000, or 0 for no "
                           "GPU sampling")
        return int(text)

    @field_validator("offcpu_stacks", mode="before")
    @classmethod
    def _offcpu(cls, value: object) -> object:
        if isinstance(value, str):  # anything but an explicit "off" keeps the stacks
            return value.strip().lower() not in _OFF
        return value

    @field_validator("dlopen_hold", mode="before")
    @classmethod
    def _dlopen_hold(cls, value: object) -> object:
        if isinstance(value, str):  # anything but an explicit "off" keeps holding
            return value.strip().lower() not in _OFF
        return value

    @field_validator("keep_runtime_launches", "launch_rows", mode="before")
    @classmethod
    def _keep_runtime_launches(cls, value: object) -> object:
        if isinstance(value, str):  # only an explicit "on" keeps them
            return value.strip().lower() in ("1", "on", "yes", "true")
        return value

    @field_validator("offcpu_stack_min_us", mode="before")
    @classmethod
    def _offcpu_min(cls, value: object) -> object:
        text = str(value).strip()
        if not text:
            return DEFAULT_OFFCPU_STACK_MIN_US
        if not text.isdigit() or int(text) > MAX_OFFCPU_STACK_MIN_US:
            raise _Invalid(f"{PREFIX}OFFCPU_STACK_MIN_US={text}: give whole microseconds from 0 to "
                           f"{MAX_OFFCPU_STACK_MIN_US} (default {DEFAULT_OFFCPU_STACK_MIN_US}), or unset it")
        return int(text)

    @field_validator("bcc_rings", mode="before")
    @classmethod
    def _bcc_rings(cls, value: object) -> object:
        if isinstance(value, str):  # only "1" switches to BCC's callbacks
            return value == "1"
        return value

    @field_validator("block_inflight", "block_ring_pages", "inflight_max_age_s", "launch_stack_min_us",
                     "launch_stack_sample", "profile_hz", mode="before")
    @classmethod
    def _sizes(cls, value: object, info: ValidationInfo) -> object:
        assert info.field_name is not None  # a field validator is always told its field
        low, high, default, power = _SIZES[info.field_name]
        text = str(value).strip()
        if not text:
            return default
        if not text.isdigit() or not low <= int(text) <= high or (power and int(text) & (int(text) - 1)):
            what = "a power of two" if power else "a whole number"
            raise _Invalid(f"{cls.variable(info.field_name)}={text}: give {what} from {low} to {high}, or unset it "
                           f"for {default}")
        return int(text)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None,
                         only: Iterable[str] | None = None) -> Settings:
        """The settings from the environment (os.environ by default); `only` reads just those fields
        (the others keep their defaults), so a command that does not record is not stopped by a
        malformed recording setting."""
        environ = os.environ if environ is None else environ
        names = tuple(cls.model_fields) if only is None else tuple(only)
        values = {name: environ[cls.variable(name)] for name in names if cls.variable(name) in environ}
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            error = e.errors()[0]
            cause = error.get("ctx", {}).get("error")
            if isinstance(cause, _Invalid):
                raise UserError(str(cause)) from None
            name = str(error["loc"][0]) if error.get("loc") else "?"
            raise UserError(f"{cls.variable(name)}={values.get(name)!r}: {error['msg']}; fix or unset it") from None

    @property
    def gpu_interval_s(self) -> float:
        return self.gpu_interval_ms / 1000
