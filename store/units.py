"""Units as a report writes them: UTC times from ns, durations in ms."""

from __future__ import annotations

import datetime as dt

NS = 1_000_000_000


def utc(ns_unix: int) -> str:
    t = dt.datetime.fromtimestamp(ns_unix / NS, tz=dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def ms(ns: float | int | None) -> str:
    if ns is None:
        return "?"
    v = ns / 1e6
    if v >= 100:
        return f"{v:.0f} ms"
    if v >= 1:
        return f"{v:.1f} ms"
    return f"{v:.2f} ms"
