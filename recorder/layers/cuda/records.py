"""The CUDA layer's record (bpf/cuda.bpf.c -> user space), its constants and its drop counters."""

from __future__ import annotations

from recorder.core.events import Layout, Loss, Records

CUDA = Layout(
    "cuda_event",
    (
        ("ts", "u64"),  # entry, ns CLOCK_MONOTONIC
        ("dur", "u64"),  # entry -> return, ns
        ("cgroup_id", "u64"),
        ("ret", "s64"),  # return value (cudaError_t / CUresult)
        ("size", "u64"),  # bytes for alloc/memcpy, 0 when not meaningful
        ("stream", "u64"),
        ("function", "u64"),  # kernel function pointer / CUfunction
        ("pointer", "u64"),  # device/host pointer allocated or freed
        ("handle", "u64"),  # event handle for event synchronisation
        # digest of its Python stack when the stack was sent before (no pystacks record this
        # time, bpf/pystack.h), 0 when its record was sent: joined by (ts, pid, tid)
        ("py_digest", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("api", "u32"),  # index into recorder.layers.cuda.APIS
        ("memcpy_kind", "s32"),
        ("grid_x", "u32"),
        ("grid_y", "u32"),
        ("grid_z", "u32"),
        ("block_x", "u32"),
        ("block_y", "u32"),
        ("block_z", "u32"),
        ("shared_mem", "u32"),
        ("flags", "u32"),  # CUDA_FLAG_*
        # a runtime call that went through the driver's exported API: that driver API's index
        # (its own probes saw it inside this call, bpf/cuda.bpf.c), else CUDA_NO_API
        ("driver_api", "u32"),
        ("reserved", "u32"),
        # native stack: its digest in the native_stacks map (bpf/cuda.bpf.c), 0 if none
        ("native_digest", "u64"),
    ),
    "one CUDA runtime or driver call, sent at return",
)

COUNT_KERNELS = 8  # the distinct kernels a thread's counts name one by one (the others: `other`)
COUNT = Layout(
    "cuda_count_event",
    (
        ("ts", "u64"),  # the first of these launches, ns CLOCK_MONOTONIC
        ("last_ts", "u64"),  # the last of them
        ("cgroup_id", "u64"),
        ("launches", "u64"),  # kernel launches of the thread since its counts were last sent
        ("other", "u64"),  # of those, the launches of kernels beyond the first COUNT_KERNELS
        *((f"function_{i}", "u64") for i in range(COUNT_KERNELS)),  # kernel function pointer / CUfunction
        *((f"count_{i}", "u32") for i in range(COUNT_KERNELS)),  # its launches
        *((f"api_{i}", "u32") for i in range(COUNT_KERNELS)),  # the launch API's index (APIS)
        ("pid", "u32"),
        ("tid", "u32"),
        ("kernels", "u32"),  # the function_/count_/api_ slots used
        ("pad", "u32"),
    ),
    "a thread's kernel launches counted at their entries, sent at its next blocking call, step marker, "
    "after CUDA_COUNT_FLUSH_NS, or read at the stop",
)

RECORDS = Records((CUDA, COUNT), {
    "CUDA_FLAG_POINTER_UNREAD": 1,  # the allocated pointer could not be read at return
    # a kernel launch fast enough, and not sampled, to be kept without stacks (bpf/cuda.bpf.c)
    "CUDA_FLAG_NO_STACK": 2,
    "CUDA_FLAG_LATE_STACK": 4,  # its stacks were taken at its return (a launch: slow or sampled)
    "CUDA_NO_API": 0xFFFFFFFF,
    # a launch drawn as a sample by its entry, which has no return probe (dur 0; its stacks are the entry's)
    "CUDA_FLAG_SAMPLE": 8,
    "CUDA_COUNT_KERNELS": COUNT_KERNELS,
}, (
    ("PROBE_CUDA", Loss("cuda ring buffer", "cuda", "CUDA calls", "ring buffer full")),
    ("PROBE_CUDA_COUNTS", Loss("cuda launch counts ring buffer", "cuda", "counts of CUDA kernel launches",
                               "ring buffer full")),
    ("PROBE_CUDA_TALLY", Loss("cuda launch counts map full", "cuda", "CUDA kernel launches",
                              "the per-thread counts map was full")),
    ("PROBE_CUDA_MAP", Loss("cuda in-flight map full", "cuda", "CUDA calls", "in-flight map full")),
    # a CUDA call whose API the per-API program noted was overwritten before its body read it (another
    # thread's call on the same CPU in between; bpf/cuda.bpf.c cuda_dispatch): the call is not recorded
    ("PROBE_CUDA_DISPATCH", Loss("cuda call's API note overwritten", "cuda", "CUDA calls",
                                 "another thread's call on the same CPU overwrote the API its probe noted")),
    # a kernel launch's return whose stack pointer is not its thread's recorded launch's, nor that of a
    # driver launch made inside it (bpf/cuda.bpf.c cuda_launch_end): the recorded launch's return was
    # never seen (it left by longjmp or an exception), or this launch's entry made no record
    ("PROBE_CUDA_LAUNCH_RETURN", Loss("cuda launch return not matched to its entry", "cuda", "CUDA kernel launches",
                                      "a launch returned with another stack pointer than the launch its thread "
                                      "was recorded in")),
))
