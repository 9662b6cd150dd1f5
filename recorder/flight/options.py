"""What a flight recording is asked to do (`recorder start --keep ... --max-size ... --trigger ...`):
the window, the size bound, the incidents' span, the triggers and their rate limits, who is told."""

from __future__ import annotations

from dataclasses import dataclass

from recorder.incident_hook import HookOptions
from store.errors import UserError

NS = 1_000_000_000
TRIGGERS = ("stall", "hung-call", "nvme", "io-error", "xid", "aer", "oom")


@dataclass(frozen=True)
class FlightOptions:
    keep_ns: int                         # the window kept
    max_bytes: int | None = None         # and at most this much on disk (the window shrinks to fit)
    before_ns: int = 60 * NS             # an incident covers its trigger's time - before ...
    after_ns: int = 30 * NS              # ... to + after
    hang_ns: int = 30 * NS               # a CUDA/NCCL call in flight this long is a hang
    triggers: frozenset[str] = frozenset(TRIGGERS)
    cooldown_ns: int = 300 * NS          # one incident per trigger kind per cooldown
    max_per_hour: int = 12               # and at most this many incidents an hour
    hook: HookOptions | None = None      # --on-incident: run for every incident saved
    ship: str | None = None              # --ship: the object store (s3://...) every incident is uploaded to

    def check(self) -> None:
        if self.keep_ns < 10 * NS:
            raise UserError("--keep must be at least 10s: pass e.g. --keep 10m")
        if self.before_ns + self.after_ns + 5 * NS > self.keep_ns:
            raise UserError(f"--keep {self.keep_ns // NS}s is shorter than an incident (--before "
                            f"{self.before_ns // NS}s + --after {self.after_ns // NS}s + 5s): keep more or "
                            "save less")
        if self.max_bytes is not None and self.max_bytes < 16_000_000:
            raise UserError("--max-size must be at least 16MB: pass e.g. --max-size 2GB")
        unknown = self.triggers - set(TRIGGERS)
        if unknown:
            raise UserError(f"no trigger {', '.join(sorted(unknown))}: choose from {', '.join(TRIGGERS)}")
        if self.hook:
            self.hook.check()
        if self.ship:
            from store import objectstore

            objectstore.check_url(self.ship)

    def describe(self) -> dict:
        return {"keep_s": self.keep_ns / NS, "max_bytes": self.max_bytes, "before_s": self.before_ns / NS,
                "after_s": self.after_ns / NS, "hang_s": self.hang_ns / NS, "triggers": sorted(self.triggers),
                "cooldown_s": self.cooldown_ns / NS, "max_per_hour": self.max_per_hour,
                "on_incident": self.hook.command if self.hook else None, "ship": self.ship}


_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'500MB', '2GiB', '1g' -> bytes."""
    t = text.strip().lower()
    digits = t.rstrip("abgikmt")
    unit = t[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1
    if value <= 0 or unit not in _SIZE_UNITS:
        raise UserError(f"cannot read size {text!r}: write e.g. 500MB, 2GB or 1GiB")
    return int(value * _SIZE_UNITS[unit])
