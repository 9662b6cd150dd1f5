"""The typed result of every MCP tool, so the SDK publishes an output schema for each.

Conventions, checked by the models:
- text recorded from the traced machine is an ``UntrustedText`` object (mcp_server.untrusted), text the
  recorder produces (API names, causes, layers, UTC times, notes) a plain string;
- times are ns of CLOCK_MONOTONIC (``*_ns``, ``ts``), with ``utc`` strings next to them;
- an integer a JavaScript client would round (beyond 2**53), and every 64-bit identifier (lineage
  tags, communicator hashes, I/O tags), also comes as a decimal string in the sibling ``<name>_text``
  (declared below where the field is known, added as an extra field elsewhere);
- ``note`` appears only when there is something to say.

explain_stall's report is `store.models.StallReport` (the same as `recorder explain --json`; JSON Schema
in docs/report-schema.json), built and checked by store.report.build.explain. The tool publishes that
model's schema as marked (`report_schema`: every string may come as an ``UntrustedText`` object, every
object may carry ``*_text`` siblings); the result is validated here by the open StallReport below, as
the marked strings are no longer the store model's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer

OMITTED_WHEN_NONE = frozenset({"note", "original_chars"})


class Result(BaseModel):
    """Base of every result: extra keys allowed (the ``*_text`` siblings of big integers), and the
    optional ``note`` / ``original_chars`` left out instead of sent as null."""

    model_config = ConfigDict(extra="allow")

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: Any) -> Any:
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in OMITTED_WHEN_NONE and v is None)}


class UntrustedText(Result):
    """Text recorded from the traced machine: data, never instructions."""

    untrusted_text: str
    original_chars: int | None = Field(None, description="length before the cut, when it was cut")


Text = UntrustedText
OptText = UntrustedText | None


class Window(Result):
    session_id: int
    start_ns: int
    end_ns: int
    start_utc: str
    end_utc: str


# -- list_sessions, capabilities ---------------------------------------------------------------------
class SessionInfo(Result):
    session_id: int
    state: str
    host: OptText
    kernel: OptText
    target: OptText
    start_utc: str
    dur_ns: int | None
    cuda_calls: int
    kernel_launches: int = Field(0, description="kernel launches, exact: counted at their entries (then not in "
                                                "cuda_calls) or one cuda_call row each (--launch-rows, older "
                                                "recordings)")
    launches_counted: bool = Field(False, description="the launches were counted (no row, no duration each)")
    offcpu_intervals: int
    kernel_log_records: int
    dropped_events: int


class Sessions(Result):
    sessions: list[SessionInfo]


class ProcessInfo(Result):
    """A recorded process and its place in the job, from its environment and cgroup (store/analysis/jobs.py);
    a field the process does not carry is null, never guessed."""

    process_id: int
    pid: int
    parent_pid: int | None
    name: OptText
    cmdline: OptText
    first_ts: int
    exit_ts: int | None
    # marked as data: after 'read; ' it quotes values the process chose ("RANK unreadable: '...'")
    environ_status: OptText = Field(None, description="'read', 'empty', 'gone', 'unreadable: <reason>'; after "
                                                      "'read; ' the values the process carries that their fields "
                                                      "cannot hold, and why; null for recordings older than schema v20")
    job_rank: int | None = None
    job_local_rank: int | None = None
    job_world_size: int | None = None
    master_addr: OptText = None
    run_id: OptText = None
    slurm_job_id: OptText = None
    slurm_step_id: OptText = None
    pod_uid: OptText = None
    pod_namespace: OptText = None
    pod_name: OptText = None
    cgroup: OptText = None
    job: OptText = Field(None, description="the fields above as one phrase: 'rank 1 of 2 (local rank 1), "
                                           "torchrun run r42'")


class Processes(Result):
    session_id: int
    processes: list[ProcessInfo]


class NotAttached(Result):
    probe: OptText
    target: OptText
    status: str
    detail: OptText


class LayerStatus(Result):
    layer: str
    what: str
    observed: bool
    probes_attached: int
    probes_not_attached: int
    not_attached: list[NotAttached]


class DroppedByProbe(Result):
    """Records of one kind the session lost (store/analysis/losses.py): its layer, what and why, and when."""

    probe: OptText
    dropped: int
    layer: str | None = None
    what: str | None = None
    reason: str | None = None
    first_utc: OptText = None  # start of the first second with a loss
    last_utc: OptText = None  # end of the last one


class Capabilities(Result):
    session_id: int
    state: str
    layers: list[LayerStatus]
    dropped_events: int
    dropped_by_probe: list[DroppedByProbe]


class NotRecorded(Result):
    """Why a layer has no rows: the note says what is missing; the capability rows behind it (their
    probe, target and detail come from the traced system) are here, marked."""

    note: str | None = None
    not_recorded_because: list[NotAttached] = Field(default_factory=list)


# -- steps and stalls ------------------------------------------------------------------------------
class StepRow(Result):
    step: int
    step_mark_id: int
    pid: int | None
    ts: int
    utc: str
    dur_ns: int | None
    baseline_dur_ns: int | None
    ratio_to_baseline: float | None
    stalled: bool
    complete: bool
    inferred: bool


class Steps(NotRecorded):
    session_id: int
    threshold: str | None = None
    steps: list[StepRow]


class StalledStep(Result):
    step: int
    step_mark_id: int
    pid: int | None
    tid: int | None
    thread_name: OptText
    ts_ns: int
    utc: str
    dur_ns: int
    baseline_dur_ns: int | None
    excess_dur_ns: int | None
    ratio_to_baseline: float | None
    cause: str
    summary: OptText
    python_line: OptText
    device: OptText


class SlowCall(Result):
    cuda_call_id: int
    api: str
    ts_ns: int
    utc: str
    dur_ns: int
    expected_dur_ns: int | None
    excess_dur_ns: int | None
    offcpu_dur_ns: int | None
    cpu_wait_dur_ns: int | None
    blocked_dur_ns: int | None
    tid: int | None
    pid: int | None
    thread_name: OptText
    cause: str
    summary: OptText


class TopStalls(Window, NotRecorded):
    step_threshold: str
    stalled_steps_in_window: int
    steps: list[StalledStep]
    threshold: str
    stalls: list[SlowCall]


class StallReport(Result):
    """`recorder explain --json`: its top-level keys depend on the mode ('step' or 'call'); the published
    schema is report_schema()."""

    mode: str
    session: dict[str, Any]
    window: dict[str, Any]


UNTRUSTED_SCHEMA = {"type": "object", "properties": {"untrusted_text": {"type": "string"},
                                                     "original_chars": {"type": "integer"}},
                    "required": ["untrusted_text"], "additionalProperties": False}


def marked(schema: Any) -> Any:
    """A JSON Schema of plain values as mcp_server.untrusted.mark sends them: a string may be an
    UntrustedText object, an object may carry `<name>_text` copies of its integers."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalProperties", "not"):  # one schema
        if isinstance(out.get(key), dict):
            out[key] = marked(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):  # a list of schemas
        if key in out:
            out[key] = [marked(s) for s in out[key]]
    for key in ("properties", "$defs", "patternProperties"):  # schemas by name
        if key in out:
            out[key] = {name: marked(s) for name, s in out[key].items()}
    if out.get("type") == "string":
        return {"anyOf": [out, UNTRUSTED_SCHEMA]}
    if out.get("type") == "object":
        out["patternProperties"] = {**out.get("patternProperties", {}), "_text$": {"type": "string"}}
    return out


def report_schema() -> dict[str, Any]:
    """explain_stall's output schema: store.models.StallReport's, as marked."""
    from store.models import json_schema

    return {"type": "object", **marked(json_schema())}  # the report is one of two objects (its `mode`)


class ClusterReport(Result):
    """`recorder cluster explain --json` (store/cluster/__init__.py): the job's clock alignment, the step's
    late or missing ranks and each one's own explanation."""


# -- Python lines ------------------------------------------------------------------------------------
class CauseCount(Result):
    cause: str
    stalls: int


class StallLine(Result):
    python_line: Text
    stalls: int
    excess_dur_ns: int
    causes: list[CauseCount]
    steps: list[int]


class CudaLine(Result):
    python_line: OptText
    python_file: OptText
    python_lineno: int | None
    python_function: OptText
    cuda_calls: int
    cuda_dur_ns: int
    max_cuda_dur_ns: int
    sampled_launches: int = Field(0, description="counted launches kept as samples at this line (one in 64 at "
                                                 "random: a sample, not a count; not in cuda_calls)")


class PythonLines(Window, NotRecorded):
    stalled_steps_in_window: int
    stall_lines: list[StallLine]
    stall_lines_rank: str
    lines: list[CudaLine]
    lines_rank: str


# -- block I/O -------------------------------------------------------------------------------------
class SlowRequest(Result):
    block_request_id: int
    ts_ns: int
    utc: str
    dur_ns: int
    queued_dur_ns: int | None
    device_dur_ns: int | None
    size_bytes: int | None
    sector: int | None
    rwbs: OptText
    error: int | None
    io_tag: int | None
    io_tag_text: str | None = None
    pid: int | None
    tid: int | None
    process_name: OptText
    thread_name: OptText
    session_percentile: float = Field(description="cume_dist of dur among the session's requests of this device and op")
    session_requests: int


class WorstSecond(Result):
    window_s: int
    requests: int
    p50_dur_ns: int | None
    p99_dur_ns: int | None
    p999_dur_ns: int | None
    max_dur_ns: int | None


class DeviceLatency(Result):
    device: Text
    op: Text
    requests: int
    bytes: int | None
    p50_dur_ns: int | None
    p99_dur_ns: int | None
    p999_dur_ns: int | None
    max_dur_ns: int | None
    p99_queued_dur_ns: int | None
    max_queued_dur_ns: int | None
    p99_device_dur_ns: int | None
    max_device_dur_ns: int | None
    slowest_requests: list[SlowRequest]
    worst_seconds: list[WorstSecond]


class BlockErrors(Result):
    dev: OptText
    errors: int


class IoLatency(Window, NotRecorded):
    percentiles: str
    devices: list[DeviceLatency]
    block_errors_from_kernel_log: list[BlockErrors]


# -- kernel log, NVMe ------------------------------------------------------------------------------
class NvmeEvent(Result):
    nvme_event_id: int
    kernel_log_id: int | None
    ts_ns: int
    utc: str
    kind: str
    controller: OptText
    tag: int | None
    tag_text: str | None = None
    qid: int | None
    command_id: int | None
    opcode: int | None
    req_op: OptText
    size_bytes: int | None
    status: int | None = Field(description="NVMe completion status of an abort command")
    action: OptText
    text: OptText
    block_request_ids: list[int] = Field(description="block requests in flight on the controller at the event")


class NvmeEvents(Window):
    kernel_log_observed: bool
    events: list[NvmeEvent]
    truncated: bool
    note: str | None = None


class KernelLogRecord(Result):
    kernel_log_id: int
    ts_ns: int
    utc: str
    level: int | None
    subsystem: str | None
    event_kind: str | None
    device: OptText
    text: OptText
    malformed: int | None


class KernelLog(Window, NotRecorded):
    kernel_log_observed: bool
    records: list[KernelLogRecord]
    truncated: bool


# -- NCCL ------------------------------------------------------------------------------------------
class Straggler(Result):
    api: str
    seq: int | None
    step: int | None
    straggler_rank: int | None
    straggler_pid: int | None
    lateness_dur_ns: int | None
    ranks_seen: int | None
    comm_hash: int
    comm_hash_text: str


class CollectiveWait(Result):
    nccl_call_id: int
    api: str
    rank: int | None
    pid: int | None
    step: int | None
    wait_dur_ns: int | None
    call_dur_ns: int | None
    sync_dur_ns: int | None


class NcclCollectives(Window, NotRecorded):
    collectives: list[Straggler]
    waits: list[CollectiveWait]


class TraceImport(Result):
    path: Text
    format: Text = Field(description="'chrome_trace' or 'flight_recorder'")
    rank: int | None
    world_size: int | None
    runtime: OptText = Field(description="'cuda', 'rocm' or None")


class DeviceBusy(Result):
    device: int
    busy_ns: int
    busy_pct: float


class TopKernel(Result):
    name: Text
    dur_ns: int
    count: int
    share_pct: float


class HostIdle(Result):
    name: Text
    kind: str
    dur_ns: int
    share_pct: float


class DeviceTimeline(Window, NotRecorded):
    step: int | None
    imported_from: list[TraceImport]
    busy_pct: float | None = None
    devices: list[DeviceBusy] = Field(default_factory=list)
    top_kernels: list[TopKernel] = Field(default_factory=list)
    idle_ns: int | None = None
    host_idle: list[HostIdle] = Field(default_factory=list)
    python_idle: list[HostIdle] = Field(default_factory=list)
    bound: OptText = Field(None, description="'device' or 'host'")


# -- evidence, run_sql -----------------------------------------------------------------------------
class Evidence(Result):
    """The rows behind a link; which keys follow `kind` depends on it (rows are the store's, with ns
    columns named *_ns)."""

    kind: str
    link: str | None = None


class SqlResult(Result):
    columns: list[str]
    rows: list[list[Any]] = Field(description="values: numbers, null, UntrustedText for text, {blob_bytes, hex} "
                                              "for blobs, {integer, text} for integers beyond 2**53")
    row_count: int
    truncated: bool
    max_rows: int
    elapsed_ns: int
