"""What a layer could observe: one row of the `capability` table per probe, tracepoint or file."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capability:
    layer: str
    probe: str
    status: str  # 'attached', 'absent', 'failed'
    detail: str = ""
    target: str = ""
    ts: int = 0


CAPABILITY_COLUMNS = ("session_id", "layer", "probe", "target", "status", "detail", "ts")
