"""The I/O layer's records (bpf/block.bpf.c, mm.bpf.c, net.bpf.c, dma.bpf.c -> user space), their
constants and the layer's drop counters."""

from __future__ import annotations

from recorder.core.events import Layout, Loss, Records

BLOCK = Layout(
    "block_event",
    (
        ("ts", "u64"),  # submission: bio queued in the submitter's context, or its I/O intent
        ("bio_queue_ts", "u64"),  # block_bio_queue (after blk-throttle: a kworker's for throttled bios)
        ("insert_ts", "u64"),  # block_rq_insert, 0 when issued directly
        ("issue_ts", "u64"),  # block_rq_issue (last one after a requeue)
        ("complete_ts", "u64"),
        ("sector", "u64"),
        ("cgroup_id", "u64"),  # cgroup v2 id of the submitter
        ("io_tag", "u64"),  # I/O tag from block_rq_complete (patch series), 0 without it
        ("stack_ts", "u64"),  # key (ts) of the submitter's Python stack record, 0: none (kernel thread)
        ("dev", "u32"),  # whole-disk dev_t, kernel encoding (major << 20 | minor)
        ("nr_bytes", "u32"),
        ("pid", "u32"),  # submitter
        ("tid", "u32"),
        ("error", "s32"),  # 0 or negative errno
        ("requeues", "u32"),
        ("merges", "u32"),  # bios front-merged into the request after it was queued
        ("flags", "u32"),  # BLOCK_FLAG_*
        ("rwbs", "char16"),
        ("comm", "char16"),  # submitter
    ),
    "one block request of a traced submitter, sent at completion",
)

RECLAIM = Layout(
    "reclaim_event",
    (
        ("ts", "u64"),
        ("dur", "u64"),
        ("gfp_flags", "u64"),
        ("nr_reclaimed", "u64"),  # pages
        ("cgroup_id", "u64"),
        # key (ts) of the thread's Python stack record: captured where the reclaim began (the
        # allocating line), or the capture made earlier in the same syscall
        ("stack_ts", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("order", "s32"),
        ("kind", "u32"),  # RECLAIM_DIRECT (global memory short) or RECLAIM_MEMCG (its memory cgroup's limit)
        ("comm", "char16"),
        # the mm ring tells its records apart by size (MM_RING_LAYOUTS): not oom_event's nor checkpoint_event's
        ("pad", "char16"),
    ),
    "one direct-reclaim interval of a traced thread, sent at its end",
)

DIRTY = Layout(
    "dirty_event",
    (
        ("ts", "u64"),  # when the pause starts (the tracepoint fires just before it)
        ("pause", "s64"),  # ns the task is put to sleep
        ("period", "s64"),  # ns
        ("think", "s64"),  # ns
        ("dirty", "u64"),  # pages dirty globally
        ("limit", "u64"),  # pages: dirty limit
        ("task_ratelimit", "u64"),  # KiB/s the task is throttled to
        ("cgroup_ino", "u64"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("dirtied", "u32"),  # pages this task dirtied since the last pause
        ("pad", "u32"),
        ("bdi", "char32"),
        ("comm", "char16"),
    ),
    "one balance_dirty_pages() pause of a traced thread",
)

OOM = Layout(
    "oom_event",
    (
        ("ts", "u64"),
        ("total_vm", "u64"),  # KiB
        ("anon_rss", "u64"),  # KiB
        ("file_rss", "u64"),  # KiB
        ("shmem_rss", "u64"),  # KiB
        ("pgtables", "u64"),  # KiB
        ("pid", "u32"),  # victim
        ("uid", "u32"),
        ("oom_score_adj", "s32"),
        ("killer_tid", "u32"),  # task running when the victim was marked
        ("comm", "char16"),  # victim
    ),
    "oom:mark_victim, every victim (the kernel chooses it, not us)",
)

TCP = Layout(
    "tcp_event",
    (
        ("ts", "u64"),
        ("cgroup_id", "u64"),
        ("pid", "u32"),  # task running at the retransmit (often a softirq on behalf of others)
        ("tid", "u32"),
        ("state", "s32"),
        ("err", "s32"),
        ("sport", "u16"),
        ("dport", "u16"),
        ("family", "u16"),
        ("pad", "u16"),
        ("saddr", "char16"),  # IPv6 form (IPv4 as ::ffff:a.b.c.d)
        ("daddr", "char16"),
        ("comm", "char16"),
    ),
    "tcp:tcp_retransmit_skb",
)

DMA = Layout(
    "dma_event",
    (
        ("ts", "u64"),  # start: for dma_map_latency ts - latency
        ("dur", "u64"),  # mapping latency (dma_map_latency), else 0
        ("addr", "u64"),  # physical address (map), I/O virtual address (iommu fault), dev_addr (bounce)
        ("dma_addr", "u64"),
        ("size", "u64"),
        ("attrs", "u64"),  # DMA_ATTR_* (map), dma_mask (bounce)
        ("pid", "u32"),
        ("tid", "u32"),
        ("kind", "u32"),  # DMA_KIND_*
        ("dir", "s32"),
        ("nents", "s32"),
        ("flags", "u32"),  # DMA_FLAG_*; fault flags for iommu faults in the upper 16 bits
        ("device", "char32"),
        ("comm", "char16"),
    ),
    "DMA mapping, SWIOTLB bounce or IOMMU fault",
)

NVME_AI = Layout(
    "nvme_ai_event",
    (
        ("ts", "u64"),
        ("sector", "u64"),
        ("io_tag", "u64"),
        ("ctrl_id", "s32"),
        ("qid", "s32"),
        ("rq_tag", "s32"),
        ("nr_bytes", "u32"),
        ("req_pid", "u32"),  # tgid that allocated the request
        ("req_tid", "u32"),
        ("cid", "u16"),
        ("opcode", "u16"),
        ("action", "u16"),  # 0 polled, 1 abort, 2 reset, 3 disable, 4 rearm
        ("pad", "u16"),
        ("disk", "char32"),
    ),
    "nvme:nvme_timeout from the patch series: one NVMe timeout decision",
)

CHECKPOINT = Layout(
    "checkpoint_event",
    (
        ("ts", "u64"),
        ("ino", "u64"),
        ("pos", "s64"),
        ("count", "u64"),
        ("io_tag", "u64"),
        ("dev", "u32"),
        ("pid", "u32"),
        ("tid", "u32"),
        ("pad", "u32"),
        ("name", "char32"),  # last path component, cut at 31 bytes
    ),
    "io_tag:io_tag_write from the patch series: one write extent of a thread with an I/O tag",
)

# the records of bpf/mm.bpf.c's one ring, which user space tells apart by their size
MM_RING_LAYOUTS = (RECLAIM, DIRTY, OOM, CHECKPOINT)

RECORDS = Records((BLOCK, RECLAIM, DIRTY, OOM, TCP, DMA, NVME_AI, CHECKPOINT), {
    "BLOCK_FLAG_KTHREAD": 1,  # queued by a kernel thread (writeback, journal, throttle dispatch)
    "BLOCK_FLAG_INTENT": 2,  # submitter found from its I/O intent (bio queued later by a kworker)
    "BLOCK_FLAG_ERROR": 4,  # block_rq_error fired for it
    "BLOCK_FLAG_FRONT_MERGE": 8,  # its first sector came from a front-merged bio
    "BLOCK_FLAG_AI": 16,  # block_rq_complete had the io_tag field (io_tag valid)
    "BLOCK_FLAG_SPLIT": 32,  # a part of a bio the block layer split (block_split)
    "BLOCK_FLAG_PARTIAL": 64,  # completed in several block_rq_complete calls (summed into one row)
    "BLOCK_FLAG_BIO": 128,  # ended by block_bio_complete: a device that completes bios without requests
    "RECLAIM_DIRECT": 0,
    "RECLAIM_MEMCG": 1,
    "DMA_KIND_MAP": 1,
    "DMA_KIND_BOUNCE": 2,
    "DMA_KIND_IOMMU_FAULT": 3,
    "DMA_KIND_AI_MAP": 4,
    "DMA_FLAG_DIRECT": 1,
    "DMA_FLAG_BOUNCED": 2,
    "DMA_FLAG_FORCE": 4,
}, (
    ("PROBE_BLOCK", Loss("block ring buffer", "block", "requests", "ring buffer full")),
    ("PROBE_BLOCK_MAP", Loss("block in-flight map full", "block", "requests", "in-flight map full")),
    ("PROBE_MM", Loss("mm ring buffer", "mm", "memory events", "ring buffer full")),
    ("PROBE_NET", Loss("net ring buffer", "net", "TCP retransmits", "ring buffer full")),
    ("PROBE_DMA", Loss("dma ring buffer", "dma", "DMA events", "ring buffer full")),
    # issued, and its completion never reached the probe: the kernel skips a tracepoint's BPF program
    # while another one runs on that CPU (completions run in softirq context and interrupt them)
    ("PROBE_BLOCK_UNCOMPLETED", Loss("block request completion not seen", "block", "requests",
                                     "completion not seen")),
    ("PROBE_MM_MAP", Loss("mm reclaim map full", "mm", "reclaim intervals", "open-reclaim map full")),
))
# not a BPF counter: in-flight entries user space removed because nothing ended them in time
# (recorder/layers/io/layer.py, IoLayer.sweep)
AGED_OUT = Loss("block request aged out", "block", "requests", "no end seen, aged out of the in-flight map")
BLOCK_AGED_OUT = AGED_OUT.probe
UNCOMPLETED = dict(RECORDS.drops)["PROBE_BLOCK_UNCOMPLETED"].probe
