"""Marking text that comes from the traced system as data, never as instructions.

Process and thread names, command lines, file and library paths, kernel log messages and anything
else the traced machine wrote can be chosen by whoever runs code there. An assistant reading a tool
result could mistake such text for instructions ("ignore previous instructions and ..."), so every
string in a result is wrapped as ``{"untrusted_text": "..."}`` and cut to MAX_CHARS, unless its key
names a value the recorder itself produces (an API symbol, a reason, a layer, a UTC time).
A cut string also carries ``"original_chars"``.
"""

from __future__ import annotations

from typing import Any

MAX_CHARS = 512
MARKER = "untrusted_text"

# Keys whose string values are produced by the recorder or the store's views, never copied from the
# traced system: enumerations, symbol names from the recorder's own probe list, times it formats.
RECORDER_KEYS = frozenset({
    "api", "family", "library", "reason", "kind", "layer", "status", "state", "state_letter",
    "utc", "start_utc", "end_utc", "syscall", "syscall_name", "subsystem", "event_kind", "what",
    "note", "category", "found_by", "threshold", "link", "table", "cause",
})


def text(value: str, limit: int = MAX_CHARS) -> dict[str, Any]:
    """One string from the trace, wrapped and capped."""
    if len(value) <= limit:
        return {MARKER: value}
    return {MARKER: value[:limit], "original_chars": len(value)}


def mark(value: Any, key: str | None = None) -> Any:
    """`value` with every string not under a RECORDER_KEYS key wrapped by `text()`."""
    if isinstance(value, str):
        return value if key in RECORDER_KEYS else text(value)
    if isinstance(value, dict):
        if MARKER in value:
            return value
        return {k: mark(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark(v, key) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return {"blob_bytes": len(data), "hex": data[:64].hex()}
    return value


def unmark(value: Any) -> Any:
    """The inverse of mark() for strings that were not cut: used to compare with `recorder explain`."""
    if isinstance(value, dict):
        if MARKER in value and set(value) == {MARKER}:
            return value[MARKER]
        return {k: unmark(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unmark(v) for v in value]
    return value
