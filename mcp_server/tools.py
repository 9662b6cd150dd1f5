"""The MCP tools: plain functions over one recording, registered from TOOLS by
mcp_server.server.build_server.

A tool's first parameter is what it reads: a `Store` (opened read-only for the call; every other
parameter is the tool's argument, its docstring the tool's description) or the `Recording` (the
file, for tools that open it their own way). It returns plain values; the server marks the text
recorded from the traced machine as data (mcp_server.untrusted), validates the result as the
tool's model and turns every failure into one line. Adding a tool: docs/architecture.md, "Adding an
MCP tool".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp_server import models, queries, readonly_sql
from mcp_server.cluster_tool import cluster_explain
from mcp_server.recording import Recording
from store.db import Store
from store.errors import UserError
from store.report.build import explain


@dataclass(frozen=True)
class ToolDef:
    """One tool: its function and the model its result is validated as (and published with, unless
    `schema` gives the published output schema)."""

    fn: Callable[..., Any]
    model: type[models.Result]
    schema: Callable[[], dict[str, Any]] | None = field(default=None)
    marks_itself: bool = False  # its result's text is marked already (run_sql: by value, not by key;
    # cluster_explain: every string, exports being other machines' files)


def integer_id(name: str, value: int | str) -> int:
    """An id or step number given as a number or as its decimal string (JavaScript clients cannot
    write integers beyond 2**53 as numbers), within SQLite's 64-bit range."""
    try:
        number = int(value.strip()) if isinstance(value, str) else int(value)
    except ValueError:
        raise UserError(f"{name} {value!r} is not an integer: pass it as a number or a decimal string") from None
    if not -(2**63) <= number < 2**63:
        raise UserError(f"{name} {value} is beyond 64 bits: take it from a tool result (the *_text strings keep "
                        "64-bit values exact)")
    return number


def list_sessions(store: Store) -> dict:
    """Recording sessions in the database: state, target, start (UTC), duration and event counts."""
    return {"sessions": queries.sessions(store)}


def list_processes(store: Store, session_id: int | None = None, limit: int = 100) -> dict:
    """The session's processes (targets first) with pid, command line and their place in the job, read
    from each process's environment and cgroup when the recorder first saw it: rank, local rank, world
    size, rendezvous, torchrun run id, Slurm job and step, Kubernetes pod (uid, namespace, name).
    `environ_status` says when the environment could not be read: then rank and job are not known."""
    return queries.processes(store, session_id, limit)


def capabilities(store: Store, session_id: int | None = None) -> dict:
    """Which layers a session observed (scheduler, CUDA, Python, NCCL, block I/O, kernel log), which it
    did not and why, and the events it lost. Read this before drawing conclusions from an absence."""
    return queries.capabilities(store, session_id)


def list_steps(store: Store, session_id: int | None = None, limit: int = 20) -> dict:
    """Training steps, stalled ones first (worst first), with their duration against their rolling
    baseline and the step_mark_id for evidence(kind='step'). Says so in `note` when steps were not
    recorded (then use top_stalls / explain_stall with a window)."""
    return queries.steps(store, session_id, limit)


def explain_stall(store: Store, session_id: int | None = None, window: str | None = None, since: str | None = None,
                  worst: bool = False, step: int | str | None = None) -> dict:
    """The stall report: for a session with steps, the stalled step (or `step`), its symptom against
    the rolling baseline, the primary cause with its device/queue/request tag, lineage label, Python
    line and kernel path, the breakdown by cause, secondary signals, explicit negatives, observed and
    unobserved layers, next actions, and `on_cpu` when no wait explains the step's excess: where it
    went on the CPU (the on-CPU profile: library, function and Python line); without steps, the slow
    CUDA calls. Same content as
    `recorder explain --json`. At most one of: `window`: 'A..B' in seconds after the session start or
    UTC times; `since`: the last 30s/5m; `worst`: only the worst stall; `step`: that step number."""
    chosen = [name for name, v in (("window", window), ("since", since), ("worst", worst), ("step", step))
              if v not in (None, False, "")]
    if len(chosen) > 1:
        raise UserError(f"{' and '.join(chosen)} do not go together: pass one of window, since, worst or "
                        "step (as `recorder explain`)")
    return explain(store, session_id, window, since, worst, None if step is None else integer_id("step", step))


def top_stalls(store: Store, session_id: int | None = None, window: str | None = None, limit: int = 10) -> dict:
    """The worst stalls, worst first: stalled training steps (by the recording's stall rule, quoted in
    list_steps' `threshold`) with the primary cause the step report gives each, and the slowest CUDA
    calls against their own baseline (same API family and size class), each with its cause in one word and the ids for
    `evidence` (kind='step' with step_mark_id, kind='cuda_call' with cuda_call_id). window: 'A..B' in
    seconds after the session start (5..12.5) or UTC times; default the whole session."""
    return queries.top_stalls(store, session_id, window, limit)


def python_lines(store: Store, session_id: int | None = None, window: str | None = None, limit: int = 20) -> dict:
    """Python file:line call sites ranked by the time attributed to them: `stall_lines` by the time
    above baseline of the stalled steps whose primary cause is at the line (as `recorder top`),
    `lines` by the time inside the CUDA calls made from the line. Says in `note` when Python lines
    were not recorded."""
    return queries.python_lines(store, session_id, window, limit)


def io_latency(store: Store, session_id: int | None = None, window: str | None = None) -> dict:
    """Block I/O latency per device and op over the requests that started in the window: exact
    p50/p99/p999/max (whole request, queued and device stages), the slowest requests (ids for
    evidence(kind='block_request'), with their rank in the session) and the worst one-second windows;
    block errors from the kernel log. Says in `note` when block requests were not recorded."""
    return queries.io_latency(store, session_id, window)


def nvme_events(store: Store, session_id: int | None = None, window: str | None = None,
                controller: str | None = None, limit: int = 100) -> dict:
    """NVMe timeouts, aborts, controller resets and failures from the kernel log, oldest first, with the
    queue, tag and request they name. window: 'A..B' in seconds after the session
    start (5..12.5) or UTC times; default the whole session."""
    return queries.nvme_events(store, session_id, window, controller, limit)


def kernel_log(store: Store, session_id: int | None = None, window: str | None = None, subsystem: str | None = None,
               max_level: int | None = None, contains: str | None = None, limit: int = 100) -> dict:
    """Kernel log records read during the session, filtered by subsystem (nvme, block, swiotlb,
    intel_iommu, amd_iommu, aer, nvidia, oom), syslog level (0 emerg .. 7 debug, keep <= max_level) and
    a substring; each with the typed event it was parsed into. window: 'A..B' in seconds after the session
    start (5..12.5) or UTC times; default the whole session."""
    return queries.kernel_log(store, session_id, window, subsystem, max_level, contains, limit)


def nccl_collectives(store: Store, session_id: int | None = None, window: str | None = None) -> dict:
    """NCCL collectives: waits and stragglers per rank. Says in `note` when NCCL was not recorded."""
    return queries.nccl_collectives(store, session_id, window)


def device_timeline(store: Store, session_id: int | None = None, step: int | None = None,
                    window: str | None = None) -> dict:
    """The device's own timeline, from an imported PyTorch profiler trace (`recorder import`): over step
    N (or a window), each device's busy share (kernels, copies, memsets), the kernels that took the most
    time (longest first), what the step's thread was doing while the device was idle, and whether the
    step was bound by the device or the host. Says in `note` when no trace brought a device timeline."""
    return queries.device_timeline(store, session_id, window, None if step is None else integer_id("step", step))


def evidence(store: Store, kind: str, id: int | str) -> dict:  # noqa: A002 - the tool's argument name
    """The rows behind a causal link. kind 'step' (a step_mark_id from list_steps/explain_stall): the
    step's breakdown by cause and every row linked to it (causal_link); 'cuda_call' (a call id): the
    call, every off-CPU interval inside it and who held the CPU; 'offcpu': one interval with its
    preemptor, waker and contender; 'block_request': a request and the device events that hit it;
    'kernel_log': a record and the typed event parsed from it."""
    return queries.evidence(store, kind, integer_id("id", id))


async def run_sql(recording: Recording, sql: str, max_rows: int = readonly_sql.DEFAULT_ROWS) -> dict:
    """One read-only SQL statement (SELECT, WITH or EXPLAIN) over the tables and views described in the
    schema://tables resource. Writes, ATTACH, PRAGMA writes, transactions and extensions are refused;
    the query runs in its own process, killed after a time limit or when the request is cancelled; at
    most max_rows rows (<= 5000) and 1,000,000 characters of JSON come back, `truncated` says if there
    were more. Every text value is marked as untrusted data; an integer beyond 2**53 comes back as
    {"integer": n, "text": "n"} (JavaScript rounds larger numbers)."""
    return await readonly_sql.run_sql_async(recording.path, sql, max_rows, recording.sql_time_limit_s)


# Every tool the server publishes, in the order it lists them.
TOOLS: tuple[ToolDef, ...] = (
    ToolDef(list_sessions, models.Sessions),
    ToolDef(list_processes, models.Processes),
    ToolDef(capabilities, models.Capabilities),
    ToolDef(list_steps, models.Steps),
    ToolDef(explain_stall, models.StallReport, schema=models.report_schema),
    ToolDef(top_stalls, models.TopStalls),
    ToolDef(python_lines, models.PythonLines),
    ToolDef(io_latency, models.IoLatency),
    ToolDef(nvme_events, models.NvmeEvents),
    ToolDef(kernel_log, models.KernelLog),
    ToolDef(nccl_collectives, models.NcclCollectives),
    ToolDef(device_timeline, models.DeviceTimeline),
    ToolDef(evidence, models.Evidence),
    ToolDef(run_sql, models.SqlResult, marks_itself=True),
    ToolDef(cluster_explain, models.ClusterReport, marks_itself=True),
)
