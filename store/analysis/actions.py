"""The recommended next actions of a report, as a table: per cause kind, the steps to take, each a
template filled from the facts the analysis found (store/analysis/explain.py builds the context).

A template is a plain str.format string. An entry given as (template, key) is included only when
the context's `key` is set (the OOM kill to restart after memory reclaim, the call's syscall).
"""

from __future__ import annotations

from collections.abc import Mapping

Action = str | tuple[str, str]

# A step's root cause (store/analysis/causes.py kinds) -> its next actions.
STEP_ACTIONS: dict[str, list[Action]] = {
    "nvme_timeout": [
        "Read the drive's health and error log: nvme smart-log /dev/{controller}; nvme error-log /dev/{controller} "
        "(media errors, critical warnings, entries at the time of the timeout)",
        "Check the PCIe link of {link}: lspci -vvv -s {link_address} (LnkSta, AER status) "
        "and the kernel log for AER lines around it",
        "Compare {device}'s write latency during checkpoints with the rest of the session: "
        "SELECT * FROM block_latency WHERE device = '{device}'",
        "If timeouts recur, update the drive firmware or move checkpoints off {device}",
    ],
    "io_error": [
        "Check the disk: smartctl -a /dev/{device} (or nvme smart-log), and the kernel log around the error",
        "Verify the data read from sector {sector} of {device} (the file system may need a check)",
    ],
    "iommu_fault": [
        "Find the driver and mapping that faulted: dmesg around the fault, lspci -k -s {event_device}",
        "Check the IOMMU mode (iommu=pt / intel_iommu=on) and the device's DMA mask; a recurring fault at "
        "the same address points to a driver or firmware bug",
    ],
    "pcie_aer": [
        "Inspect the link: lspci -vvv -s {event_device} (LnkSta, AER counters)",
        "Reseat or replace the device or riser if correctable errors keep counting",
    ],
    "dma_bounce": [
        "Find why {event_device} bounces: its DMA mask (dmesg | grep -i 'dma mask'), swiotlb=force on the "
        "kernel command line, an IOMMU in passthrough with a device that cannot reach all memory",
        "Enable the IOMMU for the device or give it a 64-bit DMA mask; as a stopgap enlarge the pool "
        "(swiotlb=<slabs>)",
    ],
    "slow_io": [
        "Look at {device}'s latency over the session: SELECT * FROM block_latency_window WHERE device = "
        "'{device}' (queue depth and competing I/O at that second)",
        "Check the drive: nvme smart-log /dev/{device} (or smartctl -a), firmware and temperature",
        "Prefetch or read ahead the training data so one slow read does not stall a step",
    ],
    "io_queued": [
        "Check the I/O scheduler and queue depth of {device} (cat /sys/block/{device}/queue/scheduler)",
        "See who else used {device} then: SELECT * FROM block_request_named WHERE device = '{device}' "
        "AND ts BETWEEN {request_ts} AND {request_end}",
    ],
    "io_throttled": [
        "Check the cgroup's I/O limits (io.max, blkio.throttle.*) of the job",
        "See who else used {device} then: SELECT * FROM block_request_named WHERE device = '{device}' "
        "AND ts BETWEEN {request_ts} AND {request_end}",
    ],
    "blocked_io": [
        "Record with the block layer attached to see the requests behind the wait "
        "(recorder doctor says whether it can)",
    ],
    "cpu_contention": [
        ("See what {contender_name} (pid {contender_pid}) is and why it runs there: "
         "ps -o pid,psr,pcpu,cmd -p {contender_pid}", "contender_pid"),
        ("Keep it off the training threads' CPUs: an exclusive cpuset for the job, "
         "or taskset -cp <other cpus> {contender_pid}", "contender_pid"),
        # a contender whose process was not read (it was gone): only its thread is known
        ("Find the process of {contender_name} (thread {contender_tid_only}) if it still runs: "
         "grep Tgid /proc/{contender_tid_only}/status; then keep it off the training threads' CPUs",
         "contender_tid_only"),
        "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
    ],
    "cpu_contention_same_process": [
        "The training thread waited behind {contender_name}, threads of its own process: more runnable "
        "threads than CPUs ({cpu_count} online). Lower the intra-op threads (torch.set_num_threads, "
        "OMP_NUM_THREADS, MKL_NUM_THREADS) so that they and the data loader's workers fit the CPUs",
        "See the process's threads and where they ran: ps -L -o tid,psr,pcpu,comm -p {contender_pid}",
        "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
    ],
    # a process the job started that is not a copy of the training process (a helper: a compiler,
    # an evaluation script, a shell command)
    "cpu_contention_job": [
        "The training thread waited behind {contender_name} (pid {contender_pid}), a helper process the "
        "recorded job started itself, not a foreign task",
        "Run {contender_name} on CPUs other than the training threads' (taskset -cp <other cpus> "
        "{contender_pid}), at a lower priority (nice -n 10), or outside the training loop",
        "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
    ],
    # a process of the job with the training process's own name or command line (a forked worker) or
    # a DataLoader worker's name (pt_data_worker)
    "cpu_contention_job_worker": [
        "The training thread waited behind {contender_name} (pid {contender_pid}), a worker process of the "
        "recorded job itself (a forked copy of the training process: a data-loader worker), not a foreign task",
        "Give the job's processes fewer CPUs than they compete for: fewer DataLoader workers (num_workers), "
        "or pin the workers to CPUs other than the training threads' (taskset -cp <other cpus> "
        "{contender_pid}; worker_init_fn)",
        "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
    ],
    "cpu_contention_recorder": [
        "The recorder itself (pid {contender_pid}) took the CPU from the training thread: run it on CPUs the "
        "job does not use (taskset -c <other cpus> recorder ...), as its own cost should never be a cause",
        "Measure what it costs on this job: benchmarks/bench_training_job.py; and report the figures",
    ],
    "memory_reclaim": [
        "Compare the job's memory use with its cgroup limit (memory.max, memory.current, memory.events)",
        "Lower the data loader's memory (fewer workers, smaller prefetch) or raise the limit",
        ("Restart the killed worker's work: {oom_kill}", "oom_kill"),
    ],
    "tcp_retransmit": [
        "Check the path to {peer}: ss -ti dst {peer_host} (retrans, rto), "
        "interface errors (ip -s link), switch port counters",
        "Look for packet loss or congestion on that link at the time (NIC ring drops: ethtool -S)",
    ],
    "network_wait": ["Find the peer the thread waited for and its latency (ss -ti)"],
    "nccl_straggler": [
        "Explain rank {straggler_rank}'s step: it is the one that was slow "
        "(below, when its recording is in this database)",
        "If one rank is always last, look at its host (CPU, disk, thermals)",
    ],
    "nccl_wait": ["Record the other ranks into the same database to see which one was late"],
    "gpu_xid": [
        "nvidia-smi -q -i {device} and the driver's documentation of the Xid",
        "Drain the node if the Xid is a hardware or bus error",
    ],
    "slow_cuda_call": [
        "Compare with the driver's own timing of {api} (Nsight Systems) and "
        "check GPU health (nvidia-smi -q) for that period",
    ],
    "dirty_throttle": ["Write checkpoints with O_DIRECT or from another thread, or raise dirty_bytes"],
    "wait_chain": [
        "The training thread waited for {end_who}, which was {end_text}: fix that wait, not the queue or "
        "lock the training thread blocked on",
        ("Check the I/O limits of {end_who}'s cgroup (io.max, blkio.throttle.*) and its reads on {end_device}: "
         "SELECT * FROM block_request_named WHERE pid = {end_pid} AND device = '{end_device}'", "end_device"),
        ("Check the path to {end_peer}: ss -ti dst {end_peer} (retrans, rto), interface errors (ip -s link)",
         "end_peer"),
        "Let the producer run ahead of the training loop: more DataLoader workers or a larger prefetch_factor, "
        "data read ahead or cached closer to the job",
        "Follow the chain yourself: SELECT * FROM wait_chain WHERE root_offcpu_id = {offcpu_id} ORDER BY depth",
    ],
    "gil_wait": [
        "{holder} held the interpreter lock{holder_at}: move that CPU work out of the training process "
        "(a worker process, or native code that releases the GIL), or make it yield more often",
        "Check the switch interval (sys.getswitchinterval(), 5 ms by default): a thread that holds the GIL "
        "delays every other thread of the process by up to that much at each wait",
    ],
    "blocked": ["Find what the thread waited for: the waker above, or the lock or event at the Python line"],
    # a stalled step that no recorded wait explains
    "unexplained": [
        "Nothing recorded explains the step: profile the thread's own code at that time (py-spy dump, or "
        "recorder explain --stack on its CUDA calls)",
    ],
}

# A slow CUDA call's cause (the report of a session without steps) -> its next actions.
CALL_ACTIONS: dict[str, list[Action]] = {
    "cpu_contention": [
        ("See what {contender_name} (pid {contender_pid}) is and why it runs on cpu {cpus}: "
         "ps -o pid,psr,pcpu,cmd -p {contender_pid}", "contender_pid"),
        ("Keep it off the training threads' CPUs: give the job an exclusive cpuset, or move it "
         "with taskset -cp <other cpus> {contender_pid}", "contender_pid"),
        "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
    ],
    "blocked": [
        "The call blocked ({what}): look for lock or I/O contention in the same process at that time "
        "(recorder explain --window around {ts})",
    ],
    "in_call": [
        "{api} spent its time on-CPU in the library: compare with the driver's own timing "
        "(Nsight Systems) and check GPU health (nvidia-smi -q) for that period",
    ],
}


def fill(table: Mapping[str, list[Action]], kind: str, context: Mapping[str, object]) -> list[str]:
    """The actions of `kind` with the context's values in their places."""
    out = []
    for action in table.get(kind, []):
        if isinstance(action, tuple):
            action, needs = action
            if not context.get(needs):
                continue
        out.append(action.format_map(context))
    return out
