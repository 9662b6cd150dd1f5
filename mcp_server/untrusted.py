"""Marking text that comes from the traced system as data, never as instructions.

Process and thread names, command lines, file and library paths, kernel log messages and anything
else the traced machine wrote can be chosen by whoever runs code there. An assistant reading a tool
result could mistake such text for instructions ("ignore previous instructions and ..."), so every
string in a result is wrapped as ``{"untrusted_text": "..."}`` and cut to MAX_CHARS, unless its key
names a value the recorder itself produces (an API symbol, a reason, a layer, a UTC time).
A cut string also carries ``"original_chars"``.

Integers: JSON numbers are doubles in JavaScript clients, which round integers beyond 2**53. Every
64-bit identifier (ID64_KEYS) and every integer beyond that range also comes as a decimal string in a
sibling key ``<name>_text``; the number stays for clients that read it exactly.
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
    "step_threshold", "percentiles", "stall_lines_rank", "lines_rank", "mode",
})


SAFE_INTEGER = 2**53 - 1
ID64_KEYS = frozenset({"comm_hash", "io_tag", "tag", "lineage_tag"})
TEXT_SUFFIX = "_text"


def _needs_text(key: str, value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and (key in ID64_KEYS or abs(value) > SAFE_INTEGER))


def text(value: str, limit: int = MAX_CHARS) -> dict[str, Any]:
    """One string from the trace, wrapped and capped."""
    if len(value) <= limit:
        return {MARKER: value}
    return {MARKER: value[:limit], "original_chars": len(value)}


def mark(value: Any, key: str | None = None, trusted: frozenset[str] = RECORDER_KEYS) -> Any:
    """`value` with every string not under a `trusted` key (default RECORDER_KEYS) wrapped by `text()`.
    A result built from other machines' files (an export another node wrote) passes the few keys
    its own code computes instead: there a key name proves nothing about where a value came from."""
    if isinstance(value, str):
        return value if key in trusted else text(value)
    if isinstance(value, dict):
        if MARKER in value:
            return value
        out = {}
        for k, v in value.items():
            out[k] = mark(v, k, trusted)
            if _needs_text(k, v) and f"{k}{TEXT_SUFFIX}" not in value:
                out[f"{k}{TEXT_SUFFIX}"] = str(v)
        return out
    if isinstance(value, (list, tuple)):
        return [mark(v, key, trusted) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return {"blob_bytes": len(data), "hex": data[:64].hex()}
    return value


def unmark(value: Any) -> Any:
    """The inverse of mark() for strings that were not cut (and without the ``*_text`` copies of
    integers): used to compare with `recorder explain`."""
    if isinstance(value, dict):
        if MARKER in value and set(value) == {MARKER}:
            return value[MARKER]
        return {k: unmark(v) for k, v in value.items()
                if not (k.endswith(TEXT_SUFFIX) and str(value.get(k[:-len(TEXT_SUFFIX)])) == v)}
    if isinstance(value, list):
        return [unmark(v) for v in value]
    return value
