"""The `cluster_explain` MCP tool: the cluster view (store/cluster/__init__.py) for MCP clients, over
the recordings the operator named (mcp_server.recording.Recording.cluster).

Those may be other nodes' exports, written by whoever can write the shared folder or bucket: an
export can put any text under any key the recorder uses (`api`, `kind`, `cause`). So the result is
marked here, every string as untrusted text except CLUSTER_KEYS, the values the cluster view
computes itself from numbers (never copied from a recording or an export)."""

from __future__ import annotations

import sqlite3

from mcp_server import untrusted
from mcp_server.recording import Recording
from store.db import damaged
from store.errors import UserError

# Strings the cluster view makes itself: its verdict word, how the clocks were aligned, the UTC time it
# formats from a timestamp.
CLUSTER_KEYS = frozenset({"verdict", "method", "anchor", "entered_utc"})


def cluster_explain(recording: Recording, step: int | None = None, worst: bool = False) -> dict:
    """A step across the ranks of a multi-host job (one recording per node): which rank(s) entered the
    step's collective late or never (hang), on which node and in which database, how late (ns), and each
    late rank's own explanation from its recording (primary cause, device, Python line, kernel path).
    Also the clock alignment: per-recording corrections and the residual skew; verdict
    'clock_skew_too_large' means no rank could be named. `step`: that step; default the worst (a hang,
    else the worst stall). Same content as `recorder cluster explain --json`."""
    from store.cluster import explain_paths

    try:
        return untrusted.mark(explain_paths(list(recording.cluster), step=step, worst=worst),
                              trusted=CLUSTER_KEYS)
    except sqlite3.DatabaseError as e:  # a damaged page of one of the recordings
        if not damaged(e):
            raise
        raise UserError(f"a recording of the job cannot be read ({e}): check each with 'sqlite3 FILE "
                        "\"PRAGMA integrity_check\"'; 'sqlite3 FILE .recover' saves the rows that are "
                        "intact") from None
