"""The recorder's one clock: CLOCK_MONOTONIC in nanoseconds, the clock bpf_ktime_get_ns() reads, so
user-space timestamps and BPF timestamps compare directly."""

from __future__ import annotations

import time


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)
