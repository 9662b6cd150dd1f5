"""Text that comes from other processes (names, command lines, environment values, cgroup paths)
made safe to store and to print: one line, bounded, no terminal control.

A process chooses its own name and environment; printed as is, a newline in one forges a line of a
report or of a hook's summary, and an escape sequence rewrites what a terminal shows. Such
characters are written as escapes instead (a newline as \\n, ESC as \\x1b), so the value stays
recognisable and nothing is lost silently.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, the line and paragraph separators and the bidirectional overrides and
# isolates (which reorder what a terminal or an editor shows)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: str, limit: int | None = None) -> str:
    """`text` with its control characters escaped, cut to `limit` characters ('...' ends a cut)."""
    out = _CONTROL.sub(_escape, text) if _CONTROL.search(text) else text
    if limit is not None and len(out) > limit:
        out = out[: max(limit - 3, 0)] + "..."
    return out


def without_controls(text: str) -> str:
    """`text` with its control characters removed (where an escape would still be noise: one line
    handed to a pager or a chat)."""
    return _CONTROL.sub("", text)
