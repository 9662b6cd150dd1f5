/* mm: memory pressure seen by the targets, from tracepoints only.
 *
 * - direct reclaim: one interval per mm_vmscan_direct_reclaim_begin/end (global shortage) or
 *   mm_vmscan_memcg_reclaim_begin/end (memory cgroup limit) pair of a target thread: the time an
 *   allocation of the thread spent reclaiming memory itself. The begin runs in the allocating
 *   thread (a page fault of a loop touching new memory, or a syscall), so it captures the thread's
 *   Python stack there (PYSTACK_CAPTURE_TP): the line that allocated, which no other event of the
 *   thread names when the allocation runs in pure Python. One capture per syscall (pystack_key):
 *   a syscall's reclaims share it with its other events; a page fault's is its own;
 * - balance_dirty_pages: each pause a target thread is put to sleep for dirtying pages faster
 *   than the disk writes them back;
 * - oom:mark_victim: every OOM victim (the kernel's choice, rare: not filtered);
 * - io_tag:io_tag_write (patch series): write extents of targets' threads that set an I/O tag.
 * Each part is compiled only when its tracepoint exists (HAVE_TP_* from recorder/core/loader.py).
 */
BPF_RINGBUF_OUTPUT(mm_events, 64);

static __always_inline void mm_send(void *rec, u32 size)
{
    if (mm_events.ringbuf_output(rec, size, ring_wake_deferred(0)))
        count_drop(PROBE_MM);
}

/* per thread in reclaim: removed at the end of its reclaim; a thread that exits in reclaim (an OOM
 * kill) leaves its entry, overwritten when its tid is reused; a full map is counted (PROBE_MM_MAP) */
BPF_HASH(reclaim_open, u32, struct reclaim_event, 4096);

/* Opens the thread's reclaim; returns the key of the Python stack capture the probe must make now
 * (PYSTACK_CAPTURE_TP), 0 when none: not a target, or the stack of an earlier capture in the same
 * syscall is reused. */
static __always_inline u64 reclaim_begin(u32 kind, int order, u64 gfp_flags)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = id;
    int fresh = 0;
    struct reclaim_event e = {};
    e.ts = bpf_ktime_get_ns();
    e.gfp_flags = gfp_flags;
    e.order = order;
    e.kind = kind;
    e.pid = id >> 32;
    e.tid = tid;
    e.cgroup_id = bpf_get_current_cgroup_id();
    e.stack_ts = pystack_key(syscall_epoch(tid), e.ts, &fresh);
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    if (reclaim_open.update(&tid, &e)) {
        count_drop(PROBE_MM_MAP);
        return 0;
    }
    return fresh ? e.ts : 0;
}

static __always_inline void reclaim_end(u64 nr_reclaimed)
{
    u32 tid = bpf_get_current_pid_tgid();
    struct reclaim_event *e = reclaim_open.lookup(&tid);
    if (!e)
        return;
    e->dur = bpf_ktime_get_ns() - e->ts;
    e->nr_reclaimed = nr_reclaimed;
    struct reclaim_event out = *e;
    reclaim_open.delete(&tid);
    mm_send(&out, sizeof(out));
}

#if defined(HAVE_TP_vmscan_mm_vmscan_direct_reclaim_begin) && defined(HAVE_TP_vmscan_mm_vmscan_direct_reclaim_end)
/* the machine is short of memory: the allocating thread reclaims */
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin)
{
    u64 key = reclaim_begin(RECLAIM_DIRECT, args->order, args->gfp_flags);
    if (key)
        PYSTACK_CAPTURE_TP(args, key);
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end)
{
    reclaim_end(args->nr_reclaimed);
    return 0;
}
#endif

#if defined(HAVE_TP_vmscan_mm_vmscan_memcg_reclaim_begin) && defined(HAVE_TP_vmscan_mm_vmscan_memcg_reclaim_end)
/* the thread's memory cgroup is at its limit: the allocating thread reclaims from it */
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_begin)
{
    u64 key = reclaim_begin(RECLAIM_MEMCG, args->order, args->gfp_flags);
    if (key)
        PYSTACK_CAPTURE_TP(args, key);
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_end)
{
    reclaim_end(args->nr_reclaimed);
    return 0;
}
#endif

#ifdef HAVE_TP_writeback_balance_dirty_pages
TRACEPOINT_PROBE(writeback, balance_dirty_pages)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    struct dirty_event e = {};
    e.ts = bpf_ktime_get_ns();
    /* pause and period are in jiffies * 1000 / HZ, i.e. milliseconds */
    e.pause = args->pause * 1000000;
    e.period = args->period * 1000000;
    e.think = args->think * 1000000;
    e.dirty = args->dirty;
    e.limit = args->limit;
    e.task_ratelimit = args->task_ratelimit;
    e.cgroup_ino = args->cgroup_ino;
    e.pid = id >> 32;
    e.tid = id;
    e.dirtied = args->dirtied;
    bpf_probe_read_kernel_str(e.bdi, sizeof(e.bdi), args->bdi);
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    mm_send(&e, sizeof(e));
    return 0;
}
#endif

#ifdef HAVE_TP_oom_mark_victim
TRACEPOINT_PROBE(oom, mark_victim)
{
    struct oom_event e = {};
    e.ts = bpf_ktime_get_ns();
    e.total_vm = args->total_vm;
    e.anon_rss = args->anon_rss;
    e.file_rss = args->file_rss;
    e.shmem_rss = args->shmem_rss;
    e.pgtables = args->pgtables;
    e.pid = args->pid;
    e.uid = args->uid;
    e.oom_score_adj = args->oom_score_adj;
    e.killer_tid = bpf_get_current_pid_tgid();
    u32 loc = *(u32 *)&args->data_loc_comm;
    bpf_probe_read_kernel_str(e.comm, sizeof(e.comm), (char *)args + (loc & 0xffff));
    mm_send(&e, sizeof(e));
    return 0;
}
#endif

#ifdef HAVE_TP_io_tag_io_tag_write
TRACEPOINT_PROBE(io_tag, io_tag_write)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    struct checkpoint_event e = {};
    e.ts = bpf_ktime_get_ns();
    e.ino = args->ino;
    e.pos = args->pos;
    e.count = args->count;
    e.io_tag = args->io_tag;
    e.dev = args->dev;
    e.pid = id >> 32;
    e.tid = id;
    u32 loc = *(u32 *)&args->data_loc_name;
    bpf_probe_read_kernel_str(e.name, sizeof(e.name), (char *)args + (loc & 0xffff));
    mm_send(&e, sizeof(e));
    return 0;
}
#endif
