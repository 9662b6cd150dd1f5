"""Sessions and windows: which session a report is about, its state and end, the window a user
asked for, and the layers it may have observed (the words of its `capability` rows a report lists)."""

from __future__ import annotations

import datetime as dt
import re

from store.db import Store, lock_holder
from store.errors import UserError
from store.units import NS, utc

# What each `capability.layer` word a report lists observes, in the order reports list them. The
# recorder's layers declare their words (recorder/layers/*: `observes`) and the session stores them in
# `layer_vocabulary` (kind 'capability'); these are the words of sessions recorded before, and of
# recordings written without a recorder (the demos). A new layer's word is not added here.
KNOWN_LAYERS = {
    "sched": "scheduler (off-CPU intervals)",
    "cuda": "CUDA runtime/driver calls",
    "python": "Python source lines",
    "nccl": "NCCL collectives",
    "block": "block I/O requests",
    "kmsg": "kernel log (NVMe, I/O errors, IOMMU, AER, Xid, OOM)",
    "mm": "memory pressure (reclaim, dirty throttling, OOM)",
    "net": "TCP retransmits",
    "dma": "DMA mapping, SWIOTLB bounces, IOMMU faults",
    "gpu": "GPU utilisation (NVML)",
    "profile": "on-CPU samples (where the CPU time went)",
}


def layer_words(store: Store, session_id: int) -> dict[str, str]:
    """`capability.layer` word -> what it observes, of the words the session's layers declared; for a
    session that declared none, KNOWN_LAYERS. The words KNOWN_LAYERS has come first in its order, so a
    report lists the layers as it always did; the others follow in the order the session declared them."""
    declared = {r["word"]: r["what"] for r in store.query(
        "SELECT word, what FROM layer_vocabulary WHERE session_id = ? AND kind = 'capability' ORDER BY rowid",
        (session_id,))}
    if not declared:
        return dict(KNOWN_LAYERS)
    known = [word for word in KNOWN_LAYERS if word in declared]
    return {word: declared[word] for word in known + [word for word in declared if word not in KNOWN_LAYERS]}


def session_row(store: Store, session_id: int | None) -> dict:
    if session_id is None:
        row = store.one("SELECT * FROM session ORDER BY id DESC LIMIT 1")
        if row is None:
            raise UserError(f"{store.path} holds no session yet: record one with 'recorder start'")
        return row
    row = store.one("SELECT * FROM session WHERE id = ?", (session_id,))
    if row is None:
        ids = [r["id"] for r in store.query("SELECT id FROM session ORDER BY id")]
        raise UserError(f"no session {session_id} in {store.path}: sessions there are {ids}")
    return row


def session_state(store: Store, session: dict) -> str:
    """'complete', 'recording' (a live recorder holds it) or 'incomplete' (the recorder died)."""
    if session["status"] != "recording":
        return session["status"]
    return "recording" if lock_holder(store.path) else "incomplete"


def session_end(store: Store, session: dict) -> int:
    """Last ts of the session: its stop, or for an incomplete one the last second its recorder
    committed or its last event, whichever is later."""
    if session["stopped_ts"]:
        return session["stopped_ts"]
    row = store.row(
        "SELECT max(e) AS e FROM (SELECT max(ts + dur) AS e FROM cuda_call WHERE session_id = :s"
        " UNION ALL SELECT max(ts + dur) FROM offcpu_interval WHERE session_id = :s)",
        {"s": session["id"]},
    )
    return max(row["e"] or session["started_ts"], session.get("written_ts") or 0, session["started_ts"])


def recording_end(store: Store, session: dict) -> str | None:
    """How a recording ended when nobody stopped it, in words: 'stopped recording at ...: disk full
    (...)' or 'ended without a stop (...): nothing was recorded after ...'; None for one stopped
    on request or still recording."""
    off = session["wall_offset_ns"]
    reason = session.get("stop_reason")
    if reason and session["stopped_ts"]:
        return f"stopped recording at {utc(session['stopped_ts'] + off)}: {reason}; nothing was recorded after"
    if session_state(store, session) == "incomplete":
        why = reason or f"the recorder, pid {session['recorder_pid']}, died"
        return f"ended without a stop ({why}): nothing was recorded after {utc(session_end(store, session) + off)}"
    return None


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def parse_duration(text: str) -> int:
    m = _DURATION.match(text.strip())
    if not m:
        raise UserError(f"cannot read duration {text!r}: write e.g. 30s, 5m, 1h or 500ms")
    scale = {"ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _point(text: str, session: dict) -> int:
    """A window bound: seconds after the session start, or an ISO-8601 time (UTC if no zone)."""
    text = text.strip()
    try:
        return session["started_ts"] + int(float(text) * NS)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(
            f"cannot read {text!r} in --window: use seconds after the session start (5..12.5) "
            "or UTC times (2026-04-28T22:14:40Z..2026-04-28T22:15:10Z)"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return int(t.timestamp() * NS) - session["wall_offset_ns"]


def resolve_window(store: Store, session: dict, window: str | None = None,
                   since: str | None = None) -> tuple[int, int]:
    start, end = session["started_ts"], session_end(store, session)
    if window:
        if ".." not in window:
            raise UserError("--window takes A..B: seconds after the start (5..12.5) or UTC times")
        a, b = window.split("..", 1)
        start, end = _point(a, session), _point(b, session)
        if end <= start:
            raise UserError(f"--window {window} ends before it starts: give A..B with A < B")
    elif since:
        start = max(start, end - parse_duration(since))
    return start, end


def has_steps(store: Store, session_id: int) -> bool:
    return store.one("SELECT 1 AS x FROM step_mark WHERE session_id = ? LIMIT 1", (session_id,)) is not None
