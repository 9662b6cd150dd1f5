"""The `cluster_explain` MCP tool: the cluster view (store/cluster/__init__.py) for MCP clients.

Which recordings it reads is the operator's choice, never the client's: the paths in
$STALL_RECORDER_CLUSTER (separated by ':'; node recordings, folders of them, or Parquet exports),
else the database the server serves (several ranks recorded into one file).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from mcp_server import untrusted
from store.db import damaged
from store.errors import UserError

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                            open_world_hint=False)
ENV = "STALL_RECORDER_CLUSTER"


def cluster_paths(db: str | Path) -> list[str]:
    configured = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return configured or [str(db)]


def register_cluster_tool(server: Any, db: str | Path) -> None:
    paths = cluster_paths(db)

    @server.tool(annotations=READ_ONLY)
    def cluster_explain(step: int | None = None, worst: bool = False) -> dict[str, Any]:
        """A step across the ranks of a multi-host job (one recording per node): which rank(s) entered the
        step's collective late or never (hang), on which node and in which database, how late (ns), and each
        late rank's own explanation from its recording (primary cause, device, Python line, kernel path).
        Also the clock alignment: per-recording corrections and the residual skew; verdict
        'clock_skew_too_large' means no rank could be named. `step`: that step; default the worst (a hang,
        else the worst stall). Same content as `recorder cluster explain --json`."""
        from store.cluster import explain_paths

        try:
            return untrusted.mark(explain_paths([*paths], step=step, worst=worst))
        except UserError as e:
            raise ToolError(str(e)) from None
        except sqlite3.DatabaseError as e:  # a damaged page of one of the recordings
            if not damaged(e):
                raise
            raise ToolError(f"a recording of the job cannot be read ({e}): check each with 'sqlite3 FILE "
                            "\"PRAGMA integrity_check\"'; 'sqlite3 FILE .recover' saves the rows that are "
                            "intact") from None
