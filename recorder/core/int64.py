"""64-bit values as SQLite stores them: its integers are signed, so an unsigned 64-bit value from
the kernel or a library (a lineage tag, a communicator hash, a pointer, a size_t of -1) above
2**63 - 1 is stored as its two's complement."""

from __future__ import annotations


def signed64(value: int) -> int:
    """An unsigned 64-bit value as the signed integer SQLite stores."""
    return value - (1 << 64) if value >= 1 << 63 else value
