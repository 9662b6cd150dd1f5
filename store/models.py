"""The stall report as typed models: what store/analysis/explain.py builds, store/report/render.py words and
`recorder explain --json` prints (`StallReport.to_json()`). docs/report-schema.json is
`StallReport.model_json_schema()`, checked by tests/test_report_model.py.

A report is a StepReport (a session whose threads mark steps) or a CallReport (slow CUDA calls
against their own baseline), told apart by `mode`. Fields a report does not carry for its kind
of cause are left out of the JSON rather than written as null: a cause names the facts it has
(an NVMe timeout its controller and queue, CPU contention the tasks that held the CPU).
Durations are in ns (`*_ns`), timestamps in ns of CLOCK_MONOTONIC (`ts`) and as UTC text (`utc`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

Num = int | float  # kept as recorded: an integer stays one in the JSON


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Session(Part):
    id: int
    state: str = Field(description="'complete', 'recording' (a live recorder holds it) or 'incomplete'")
    host: str | None
    kernel: str | None
    target: str | None
    incident: str | None = Field(None, description="an incident recording: what saved it (the flight "
                                                    "recorder's trigger, or a dump), absent otherwise")
    ended: str | None = Field(None, description="a recording nobody stopped: why and from when nothing was "
                                                 "recorded (a full disk, a recorder that died), absent otherwise")
    window_kept: str | None = Field(None, description="a flight recording whose window kept was shorter than "
                                                       "--keep because of --max-size: when and how short, "
                                                       "absent otherwise")
    imported: str | None = Field(None, description="a session read from a file (`recorder import`): which, "
                                                    "absent otherwise")
    joined: list[str] | None = Field(None, description="profiler traces lined up with this recording (`recorder "
                                                        "import --join`): how, or why they could not be; absent "
                                                        "when none")


class Window(Part):
    start_ts: int
    end_ts: int
    start_utc: str
    end_utc: str
    dur_ns: int


class NotObserved(Part):
    layer: str
    what: str
    why: str


class LostData(Part):
    """Records of one kind a layer lost in the report's window (store/analysis/losses.py): that layer was not
    checked there, whatever it recorded."""

    layer: str
    probe: str  # the `loss.probe` name
    what: str  # what was lost: 'requests', 'off-CPU intervals', ...
    reason: str  # 'in-flight map full', 'ring buffer full', ...
    count: int
    first_utc: str  # start of the first second with a loss
    last_utc: str  # end of the last one
    text: str  # 'block I/O requests: 16,680 requests lost after ... (in-flight map full)'


class Loss(Part):
    dropped_events: int  # the whole session's
    by_probe: dict[str, int]
    in_window: list[LostData] = []  # what was lost in the report's window, per layer and reason


class Thread(Part):
    tid: int | None = None
    pid: int | None = None
    name: str | None = None
    process: str | None = None
    # its process's place in the job, from its environment and cgroup: 'rank 1 of 2 (local rank 1),
    # torchrun run r42'; None when the process carries none (store/analysis/jobs.py)
    job: str | None = None


# -- slow CUDA calls ---------------------------------------------------------------------------------
class CallCause(Part):
    """Why one slow CUDA call was slow."""

    kind: Literal["cpu_contention", "blocked", "in_call"]
    summary: str
    contender_pid: int | None = None
    contender_name: str | None = None
    contender_relation: str | None = None
    cpus: str | None = None
    cpu_wait_dur_ns: int | None = None
    cpu_wait_share_of_call: Num | None = None
    reason: str | None = None
    syscall: str | None = None
    blocked_share_of_call: Num | None = None
    oncpu_share_of_call: Num | None = None


class CallContender(Part):
    pid: int | None
    name: str | None
    preemptions: int | None
    delayed_wakeups: int | None
    cpu_wait_dur_ns: int | None
    cpus: str | None


class CallBlocked(Part):
    reason: str | None
    syscall: str | None
    intervals: int
    dur_ns: int | None


class CallFinding(Part):
    """A slow CUDA call (slow_cuda_call) with what it waited for."""

    kind: Literal["slow_cuda_call"]
    cuda_call_id: int
    api: str
    ts: int
    utc: str
    dur_ns: int
    expected_dur_ns: int | None
    excess_dur_ns: int | None
    baseline_calls: int | None
    judged: Literal["baseline", "step"] = Field(
        "baseline", description="'baseline': slow against its own baseline; 'step': no baseline of its own, "
                                "listed for its share of the step's excess (expected_dur_ns is then null)")
    size_bytes: int | None
    ret: int | None
    thread: Thread
    offcpu_dur_ns: int
    cpu_wait_dur_ns: int
    blocked_dur_ns: int
    preemptions: int
    contenders: list[CallContender]
    blocked: list[CallBlocked]
    cause: CallCause
    text: str
    python: str | None
    python_stack: list[str]


class CallPrimaryCause(CallCause):
    """The cause of the slowest call, with the call it is about."""

    cuda_call_id: int
    text: str
    thread: str


class CudaTotals(Part):
    calls: int
    slow_calls: int
    dur_ns: int


class OffCpu(Part):
    reason: str | None
    intervals: int
    dur_ns: int | None


class LongWait(Part):
    """The traced threads' off-CPU waits at one Python line (not preemptions), in a report without steps."""

    python: str | None = Field(description="'qualname() at file:line'; null: waits without a Python stack")
    dur_ns: int = Field(description="ns blocked at that line in the window, all waits")
    longest_dur_ns: int = Field(description="ns of the longest of them")
    intervals: int
    reason: str | None = Field(description="offcpu.reason of one of them: 'sleep', 'io', 'futex', ...")
    syscalls: str | None = Field(description="the syscalls they blocked in, comma-separated")
    threads: str | None = Field(description="the threads that waited there: 'name (tid N)', comma-separated")


class CallReport(Part):
    """The report of a session without steps: its slow CUDA calls."""

    mode: Literal["call"]
    session: Session
    window: Window
    stall: bool
    symptom: str
    primary_cause: CallPrimaryCause | None
    findings: list[CallFinding]
    cuda: CudaTotals
    offcpu: list[OffCpu]
    cpu_wait_dur_ns: int
    waits: list[LongWait] = Field(default=[], description="the longest off-CPU waits by Python line (up to 5)")
    negatives: list[str]
    observed_layers: list[str]
    not_observed: list[NotObserved]
    layer_words: dict[str, str] | None = Field(
        None, description="what an observed layer observes, for the layers this version of the report does not "
                          "word itself (a layer added since); left out when none")
    loss: Loss
    next_actions: list[str]
    hang: Hang | None = Field(None, description="calls in flight at the stop (left out when none)")
    gpu: Gpu | None = Field(None, description="the device's own timeline over the window, where an imported "
                                              "profiler trace brought one (left out otherwise)")


# -- hangs -------------------------------------------------------------------------------------------
class HangCall(Part):
    """A CUDA or NCCL call that had not returned when the session stopped (open = 1)."""

    layer: str = Field(description="'cuda' or 'nccl'")
    api: str
    call_id: int = Field(description="cuda_call.id or nccl_call.id (by layer)")
    pid: int | None
    tid: int
    thread_name: str | None
    process_name: str | None
    rank: int | None = Field(description="the process's NCCL rank, None when it has no communicator")
    comm_hash: int | None
    since_ts: int
    since_utc: str
    open_dur_ns: int = Field(description="ns from its entry to the stop")
    python: str | None
    python_stack: list[str]
    text: str


class HangMissingRank(Part):
    rank: int
    recorded: bool = Field(description="whether the rank's process is in this recording")
    doing: str = Field(description="what it was doing instead: its own call in flight, or why unknown")


class HangCollective(Part):
    """A collective in flight: which ranks of its communicator are inside it and which never entered."""

    api: str
    comm_hash: int
    nranks: int | None
    inside_ranks: list[int]
    missing_ranks: list[int]
    missing: list[HangMissingRank]
    since_utc: str
    text: str


class Hang(Part):
    summary: str
    open_calls: list[HangCall]
    collectives: list[HangCollective]


# -- steps ---------------------------------------------------------------------------------------------
class Step(Part):
    step: int
    step_mark_id: int
    utc: str
    dur_ns: int
    baseline_dur_ns: int | None
    baseline_steps: int
    ratio: Num | None = Field(description="dur / baseline")
    excess_dur_ns: int | None
    complete: bool
    inferred: bool
    thread: Thread


class Lineage(Part):
    tag: int
    tag_hex: str
    label: str | None
    checkpoint: str | None


class Percentile(Part):
    """Where a request's latency falls among the session's requests of its device and op."""

    requests: int | None = None
    rank: int | None = None
    fraction: Num | None = None
    median_dur_ns: int | None = None


class Contender(Part):
    name: str | None
    relation: str | None = Field(None, description="'recorder', 'same_process', 'job' or 'other' "
                                                   "(step_offcpu.contender_relation)")
    pids: str | None
    cpus: str | None
    cpu_wait_dur_ns: int | None
    preemptions: int | None
    delayed_wakeups: int | None


class WaitHop(Part):
    """One wait of a wait chain (the wait_chain view): depth 0 is the stalled thread's wait, depth n
    the wait of the thread that woke hop n-1, before it woke it."""

    depth: int
    offcpu_id: int = Field(description="offcpu_interval id")
    ts: int
    blocked_dur_ns: int = Field(description="ns asleep before it was woken")
    thread: Thread
    reason: str | None
    syscall: str | None
    python: str | None = Field(description="the line it blocked at")
    waker: Thread = Field(description="the task that woke it (the next hop's thread)")
    gil: bool = Field(description="a wait on its process's interpreter lock")
    block_request_id: int | None
    device: str | None
    queued_dur_ns: int | None
    device_dur_ns: int | None
    retransmits: int = Field(description="TCP retransmits on its process's connections during the wait")
    retransmit_peer: str | None
    text: str = Field(description="what it was blocked on, in words")


class GilHolder(Part):
    """The thread that held the GIL while the stalled thread waited for it (gil_holder: the thread of
    the process that woke its waits, or for a wait that timed out the one other thread of the process,
    native threads left out, awake through it)."""

    tid: int | None
    pid: int | None
    name: str | None
    process: str | None
    python: str | None = Field(description="the line it ran while it held the GIL")
    woke_dur_ns: int | None = Field(description="ns of the waits it ended (handed the lock over)")
    held_dur_ns: int | None = Field(None, description="ns of the step's GIL waits it was awake through")
    waits: int | None = Field(None, description="the step's GIL waits it held the lock through")
    timed_out_waits: int | None = Field(None, description="of which waits that timed out while it ran")


class PythonLine(Part):
    """Where part of a cause's time in the step went (step_lost_line)."""

    python: str | None = Field(description="'qualname() at file:line'; null: the intervals' line is not known")
    dur_ns: int = Field(description="ns of the cause's time at that line")
    intervals: int = Field(description="intervals (off-CPU or reclaim) summed")
    how: str | None = Field(description="how their line was found: 'own' (the interval's stack: where it blocked, "
                                        "or where a reclaim began), 'in_wait' (a wait inside a reclaim that has "
                                        "none), 'in_call' (the CUDA or NCCL call in progress), 'before' (the "
                                        "thread's latest stack before it); comma-separated when several")


class PrimaryCause(Part):
    """A step's root cause (a kind of store/analysis/kinds/, a row of cause_kind): what it is, how much of the
    stall it explains, its evidence and next actions, and the facts of its kind."""

    kind: str
    dur_ns: int = Field(description="ns of the step this cause accounts for")
    excess_dur_ns: int = Field(description="ns above its median in the neighbouring steps")
    summary: str
    next_actions: list[str]
    kernel_path: list[str]
    python: str | None = None
    python_stack: list[str] = []
    python_lines: list[PythonLine] = Field(
        default=[], description="where the cause's time in the step went, by Python line, most first (up to 5)")
    lineage: Lineage | None = None
    share_of_stall: Num | None = None
    evidence: dict[str, int | None] = Field(
        default={}, description="the evidence rows: 'request' (block_request id), 'wait' (offcpu_interval id), "
                                "'call' (cuda_call id), 'nccl_call_id' (nccl_call id)")
    utc: str | None = None
    # the facts of each kind (present only for it)
    device: str | None = None
    controller: str | None = None
    queue: int | None = None
    request_tag: int | None = None
    pci_address: str | None = None
    actions: list[str] | None = None
    first_event_ts: int | None = None
    event_device: str | None = None
    events: int | None = None
    percentile: Percentile | None = None
    contender_pid: int | None = None
    contender_name: str | None = None
    contender_relation: str | None = None
    cpus: str | None = None
    preemptions: int | None = None
    contenders: list[Contender] | None = None
    scope: str | None = None
    oom_kills: list[str] | None = None
    syscall: str | None = None
    retransmits: int | None = None
    peer: str | None = None
    api: str | None = None
    rank: int | None = None
    straggler_rank: int | None = None
    straggler_pid: int | None = None
    lateness_dur_ns: int | None = None
    comm_hash: int | None = None
    seq: int | None = None
    expected_dur_ns: int | None = None
    call_dur_ns: int | None = None
    judged: Literal["baseline", "step"] | None = Field(
        None, description="slow_cuda_call, gpu_xid: how the call was judged: 'baseline' (slow against its own "
                          "baseline), 'step' (no baseline of its own: its whole time against its step's neighbours)")
    call_ordinal: int | None = Field(
        None, description="slow_cuda_call judged by its step: its number among the session's calls of its family "
                          "and size class (1: the first)")
    detail: str | None = None
    reason: str | None = None
    waker: str | None = None
    chain: list[WaitHop] | None = Field(None, description="wait_chain: the waits followed, to the one at its end")
    waited_for: str | None = Field(None, description="wait_chain: the thread at the end of the chain")
    gil_waits: int | None = None
    holder: GilHolder | None = None


class BreakdownRow(Part):
    """The time of the step's thread by cause (step_cause) against its neighbours."""

    cause: str
    detail: str | None
    dur_ns: int
    events: int
    usual_dur_ns: int
    excess_dur_ns: int


class Straggler(Part):
    """For an NCCL straggler: the late rank's own step, when its recording is in the database."""

    rank: int | None
    pid: int | None
    step: int
    dur_ns: int
    summary: str
    python: str | None
    kernel_path: list[str] | None


class OtherStall(Part):
    step: int
    dur_ns: int
    baseline_dur_ns: int | None
    ratio: Num | None


class DeviceBusy(Part):
    device: int = Field(description="device index as the profiler numbered it")
    busy_ns: int = Field(description="ns of the window with a kernel, copy or memset running on it (their union)")
    busy_pct: Num = Field(description="busy_ns over the window, %")


class TopKernel(Part):
    name: str
    dur_ns: int = Field(description="ns the kernel ran in the window, all its launches")
    count: int = Field(description="launches in the window")
    share_pct: Num = Field(description="of all kernel time in the window, %")


class HostIdle(Part):
    name: str = Field(description="the innermost host op the launching thread was in, '(between ops)' for none")
    kind: str = Field(description="'cpu_op', 'python_function', 'runtime', 'annotation', 'other', 'none'")
    dur_ns: int = Field(description="ns of the device's idle time spent in it")
    share_pct: Num = Field(description="of the device's idle time, %")


class Gpu(Part):
    """The GPU over the step or window: NVML's utilisation samples (every GPU) where recorded, and the
    device's own timeline (kernels, copies, memsets) where a profiler trace brought it."""

    util_gpu_pct: Num | None = Field(None, description="mean utilisation over the step or window, %; left out "
                                                       "without NVML samples")
    util_gpu_min_pct: Num | None = Field(None, description="its lowest sample, %")
    samples: int = Field(0, description="NVML samples in the window")
    neighbours_util_gpu_pct: Num | None = Field(
        None, description="median of the neighbouring steps' mean utilisation, %; None outside a step")
    neighbour_steps: int = Field(0, description="neighbouring steps with samples the median is taken over")
    busy_pct: Num | None = Field(None, description="share of the window the busiest device of the step's process ran "
                                                   "a kernel, copy or memset, %; left out without a device timeline")
    devices: list[DeviceBusy] | None = Field(None, description="busy share per device")
    top_kernels: list[TopKernel] | None = Field(None, description="the kernels that took the most time, longest first")
    idle_ns: int | None = Field(None, description="ns the busiest device was idle in the window")
    host_idle: list[HostIdle] | None = Field(
        None, description="what the step's thread did while the device was idle, most first")
    python_idle: list[HostIdle] | None = Field(
        None, description="the same for the Python functions only (a trace recorded with_stack=True): the Python "
                          "lines the thread was in while the device was idle, most first; empty without stacks")
    bound: Literal["device", "host"] | None = Field(
        None, description="'device': the device was busy most of the window; 'host': it waited for the host")


class CpuSite(Part):
    """One place a step's thread spent CPU time (the on-CPU profile's samples in the step)."""

    library: str | None = Field(description="base name of the library it ran in, outside the interpreter and the "
                                            "C library ('libcuda.so.1'); null: Python code")
    function: str | None = Field(description="the library's function the thread entered it by ('cuLaunchKernel')")
    python: str | None = Field(description="the Python line ('train.py:142'), null without a Python stack")
    python_stack_id: int | None
    samples: int
    dur_ns: int = Field(description="ns of CPU time the samples stand for")
    usual_dur_ns: int = Field(description="its mean ns per step in the thread's neighbouring steps")
    in_kernel_samples: int = Field(description="of the samples, those in kernel code (syscalls, faults)")
    text: str = Field(description="'in cuLaunchKernel (libcuda.so.1), from train.py:142', 'in Python at model.py:88'")


class OnCpu(Part):
    """Where a stalled step's time went on the CPU, when no wait explains its excess (at least half of it)."""

    summary: str = Field(description="'on the CPU for 290 ms in cuLaunchKernel (libcuda.so.1), from train.py:142'")
    dur_ns: int = Field(description="ns of CPU time sampled in the step")
    samples: int
    unexplained_dur_ns: int = Field(description="ns of the step's excess its primary cause does not account for")
    sites: list[CpuSite] = Field(description="the sites, the most above their usual time first")


class StepLaunches(Part):
    """The step's kernel launches, counted at their entries (recordings without --launch-rows)."""

    launches: int = Field(description="kernel launches the step's process made in the step (all its threads): exact")
    sampled: int = Field(description="of those, the launches kept as samples with their stacks (one in 64 at random)")
    kernels: int = Field(description="distinct kernels (function pointers) among them, as counted")


class StepReport(Part):
    """The report of a session whose threads mark steps: the stalled step and why."""

    mode: Literal["step"]
    session: Session
    observed_layers: list[str]
    not_observed: list[NotObserved]
    layer_words: dict[str, str] | None = Field(
        None, description="what an observed layer observes, for the layers this version of the report does not "
                          "word itself (a layer added since); left out when none")
    loss: Loss
    window: Window
    stall: bool
    step: Step | None
    symptom: str
    primary_cause: PrimaryCause | None
    breakdown: list[BreakdownRow] = []
    findings: list[CallFinding]
    secondary: list[str]
    straggler: Straggler | None
    other_stalls: list[OtherStall]
    negatives: list[str]
    gpu: Gpu | None
    next_actions: list[str]
    hang: Hang | None = Field(None, description="calls in flight at the stop (left out when none)")
    on_cpu: OnCpu | None = Field(None, description="where the step's excess went on the CPU, from the on-CPU profile "
                                                  "(left out when a wait explains it or nothing was sampled)")
    launches: StepLaunches | None = Field(None, description="the step's kernel launches, where they were counted "
                                                           "(left out for recordings with a row per launch)")


class StallReport(RootModel[Annotated[StepReport | CallReport, Field(discriminator="mode")]]):
    """What `recorder explain` reports: a StepReport or a CallReport (`mode`)."""

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values, each field as the analysis set it."""
        return self.root.model_dump(exclude_unset=True)

    @property
    def report(self) -> StepReport | CallReport:
        return self.root


def as_report(report: StallReport | StepReport | CallReport | dict) -> StepReport | CallReport:
    """The typed report, from the model or from its JSON (what `explain()` returns)."""
    if isinstance(report, StallReport):
        return report.root
    if isinstance(report, StepReport | CallReport):
        return report
    return StallReport.model_validate(report).root


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the report, as docs/report-schema.json holds it."""
    return StallReport.model_json_schema()


if __name__ == "__main__":  # python -m store.models > docs/report-schema.json
    import json

    print(json.dumps(json_schema(), indent=1, sort_keys=True))
