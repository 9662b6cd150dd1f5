"""The workload layer's records (bpf/nccl.bpf.c, bpf/lineage.bpf.c -> user space), their constants
and the layer's drop counters."""

from __future__ import annotations

from recorder.core.events import Layout, Loss, Records

NCCL = Layout(
    "nccl_event",
    (
        ("ts", "u64"),  # entry, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # entry -> return, ns
        ("cgroup_id", "u64"),
        ("ret", "s64"),  # ncclResult_t
        ("count", "u64"),  # elements
        ("comm", "u64"),  # ncclComm_t handle (written by ncclCommInitRank* at return)
        ("stream", "u64"),
        ("comm_hash", "u64"),  # hash of the ncclUniqueId: the same on every rank (init only)
        ("pid", "u32"),
        ("tid", "u32"),
        ("api", "u32"),  # index into recorder.layers.workload.nccl.APIS
        ("datatype", "s32"),
        ("op", "s32"),  # reduction op, -1 when none
        ("peer", "s32"),  # root or peer rank, -1 when none
        ("nranks", "s32"),  # init only
        ("rank", "s32"),  # init only
    ),
    "one NCCL call, sent at return",
)

MARKER = Layout(
    "marker_event",
    (
        ("ts", "u64"),
        ("value", "u64"),  # step number (MARKER_STEP) or phase 1/2 (MARKER_CHECKPOINT)
        ("tag", "u64"),  # lineage tag, 0 = none
        ("text_addr", "u64"),  # address of the label or path in the process
        ("text_len", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("kind", "u32"),  # MARKER_*
        ("pad", "u32"),
        ("text", "char128"),  # the first 127 bytes of the label or path
    ),
    "one call of a training-script marker (recorder.step / lineage / checkpoint)",
)

RECORDS = Records((NCCL, MARKER), {"MARKER_STEP": 1, "MARKER_LINEAGE": 2, "MARKER_CHECKPOINT": 3}, (
    ("PROBE_NCCL", Loss("nccl ring buffer", "nccl", "NCCL calls", "ring buffer full")),
    ("PROBE_NCCL_MAP", Loss("nccl in-flight map full", "nccl", "NCCL calls", "in-flight map full")),
    # an NCCL call whose API its per-API program noted was overwritten before the body read it
    # (bpf/nccl.bpf.c nccl_dispatch): the call is not recorded
    ("PROBE_NCCL_DISPATCH", Loss("nccl call's API note overwritten", "nccl", "NCCL calls",
                                 "another thread's call on the same CPU overwrote the API its probe noted")),
    ("PROBE_MARKER", Loss("marker ring buffer", "markers", "step and lineage marks", "ring buffer full")),
))
