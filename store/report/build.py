"""The stall report: what `recorder explain` prints and the MCP server returns.

The work is split by concern; this module keeps the names other code imports:
- store/db/session.py: which session and window a report is about, and the layers it observed;
- store/analysis/explain.py: the queries of the views and rules that build the report (`analyse` gives the
  typed StallReport of store/models.py, `explain` its JSON);
- store/analysis/actions.py: the recommended next actions, a table per cause kind;
- store/report/render.py: the report as text (`render_text`).
"""

from __future__ import annotations

from store.analysis.explain import (
    OTHER_STALLS,
    SLOW_LIMIT,
    analyse,
    analyse_step,
    explain,
    explain_steps,
    slow_calls,
)
from store.db.session import (
    has_steps,
    layer_words,
    parse_duration,
    recording_end,
    resolve_window,
    session_end,
    session_row,
    session_state,
)
from store.models import StallReport
from store.report.render import render_step_text, render_text
from store.units import NS, ms, utc

__all__ = [
    "NS", "OTHER_STALLS", "SLOW_LIMIT", "StallReport", "analyse", "analyse_step", "explain",
    "explain_steps", "layer_words",
    "has_steps", "ms", "parse_duration", "recording_end", "render_step_text", "render_text", "resolve_window",
    "session_end",
    "session_row", "session_state", "slow_calls", "utc",
]
