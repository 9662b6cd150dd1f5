"""What an MCP server serves: one recording database, and the settings its tools read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLUSTER_ENV = "STALL_RECORDER_CLUSTER"


@dataclass(frozen=True)
class Recording:
    """The database, the time limit of run_sql and the recordings cluster_explain joins: the paths in
    $STALL_RECORDER_CLUSTER (separated by ':'; node recordings, folders of them, or Parquet exports)
    when the server starts, else the database itself (several ranks recorded into one file). Which
    recordings are read is the operator's choice, never the client's."""

    path: Path
    sql_time_limit_s: float = 5.0
    cluster: tuple[str, ...] = ()

    @classmethod
    def of(cls, db: str | Path, sql_time_limit_s: float = 5.0) -> Recording:
        configured = tuple(p for p in os.environ.get(CLUSTER_ENV, "").split(os.pathsep) if p)
        return cls(Path(db), sql_time_limit_s, configured or (str(db),))
