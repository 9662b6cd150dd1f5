"""What a layer could observe: one row of the `capability` table per probe, tracepoint or file, and
the words of that table a report lists as observed or not (`Observation`)."""

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


@dataclass(frozen=True)
class Observation:
    """A `capability.layer` word that reports list under "Observed:" or "Not observed:", and what it
    observes: a layer declares its own (its `observes`), the session stores them in
    `layer_vocabulary` (kind 'capability'), where the report reads them (store/db/session.py)."""

    layer: str  # the `capability.layer` word ('block')
    what: str  # what the report says was observed ('block I/O requests')


CAPABILITY_COLUMNS = ("session_id", "layer", "probe", "target", "status", "detail", "ts")

DETAIL_MAX = 200  # characters of a capability's detail


def failure(e: BaseException) -> str:
    """The detail of a probe that failed to attach: the error's first line (BCC's go on for pages), at
    most DETAIL_MAX characters; its type when it says nothing."""
    lines = str(e).splitlines()
    return (lines[0] if lines else type(e).__name__)[:DETAIL_MAX]
