/* block: one record per block request of a traced submitter, with the time of each stage.
 *
 * Scope (the rule the recorder documents): a request is recorded when its bio was queued
 *   - by a target thread (is_target), or
 *   - by a kernel thread (kworker, jbd2, flush, kswapd: writeback, journal, throttle dispatch) on a
 *     disk a target has submitted to or mapped file blocks on during this session (`target_devs`).
 * blk-throttle holds a throttled bio *before* block_bio_queue and later queues it from a kworker,
 * so a target's throttled I/O would look like a kworker's. To keep the submitter and the wait, the
 * target's I/O intent is captured in its own context where the file system maps the blocks it is
 * about to submit (iomap_iter_dstmap: direct I/O on ext4/xfs; ext4 map/extent lookups: buffered
 * reads and fsync writeback); a kernel-thread bio whose sector lies in the disk's latest intent
 * extent inherits that thread and the intent's time (BLOCK_FLAG_INTENT).
 *
 * Keys are (whole-disk dev_t, absolute sector): block_bio_queue reports a partition's dev_t with
 * the sector already remapped, block_rq_* the disk's; `part_disk` (filled by user space from
 * /sys/class/block) maps a partition to its disk and start sector. Tracepoint fields only.
 *
 * The submitter's Python stack is captured at block_bio_queue in a target thread's context; one
 * capture serves a whole syscall (an fsync's bios and its waits share it: pystack_key in
 * bpf/pystack.h). A bio a kworker queues for a target's I/O intent takes the capture the target
 * made in the syscall that recorded the intent (it queued a bio itself, or blocked waiting for the
 * throttled one), so the intent itself costs no walk: file-system lookups record intents in most
 * syscalls (open, getdents), and few of those ever reach a kworker. Kernel-thread I/O of no
 * target's intent (writeback, journal) has none.
 */
#ifndef BLOCK_RING_PAGES
#define BLOCK_RING_PAGES 256 /* the loader defines the session's setting */
#endif
BPF_RINGBUF_OUTPUT(block_events, BLOCK_RING_PAGES);

/* Waking the consumer for every request (ringbuf_output's default when it waits) cost the
 * completion program ~1.5 us (irq_work) and the request a consumer wakeup competing for the CPUs
 * (docs/benchmarks.md). A completion wakes the consumer only when this CPU has not done so for
 * BLOCK_WAKEUP_NS or has sent BLOCK_WAKEUP_RECORDS since; the wake-up is sent by the CPU's next
 * sched_switch where the scheduler layer sends those (bpf/common.h), at most every 20 ms for a lone
 * request and at once for a burst, so that the ring does not fill and no wake-up is sent inside
 * this program (which would make the kernel skip the wake-up's own tracepoint programs). The rest
 * is read at the session's next poll (<= 50 ms), which reads every ring to the end (Probes.poll). */
#define BLOCK_WAKEUP_NS 50000000ull
#define BLOCK_WAKEUP_RECORDS 256
struct block_wakeup {
    u64 ts;     /* last record sent with a wakeup */
    u64 quiet;  /* records sent without one since */
};
BPF_PERCPU_ARRAY(block_wakeup, struct block_wakeup, 1);

static __always_inline u64 block_rb_flags(u64 now)
{
    u32 zero = 0;
    struct block_wakeup *w = block_wakeup.lookup(&zero);
    if (!w)
        return 0;
    if (now - w->ts < BLOCK_WAKEUP_NS && w->quiet < BLOCK_WAKEUP_RECORDS) {
        w->quiet++;
        return BPF_RB_NO_WAKEUP;
    }
    u64 urgency = w->quiet >= BLOCK_WAKEUP_RECORDS ? 2 : 1;
    w->ts = now;
    w->quiet = 0;
    return ring_wake_deferred_as(BPF_RB_FORCE_WAKEUP, urgency);
}

/* types the ext4 tracepoints' fields are declared with (tracefs format), not in BCC's headers */
typedef u32 ext4_lblk_t;
typedef u64 ext4_fsblk_t;

struct block_key {
    u64 sector;
    u32 dev;
    u32 pad;
};

struct part_info {
    u64 start;  /* sector of the partition on its disk */
    u32 disk;   /* whole-disk dev_t */
    u32 block_shift;  /* log2(file system block size / 512) of a file system on it, 0: 4 KiB */
};

struct io_intent {
    u64 start;  /* absolute sectors [start, end) */
    u64 end;
    u64 ts;
    u64 cgroup_id;
    u64 epoch;  /* entry time of the submitter's syscall (its Python stack capture, pystack_last) */
    u32 pid;
    u32 tid;
    char comm[16];
};

/* Bounded and drained: an entry ends at the request's completion (block_done), at a bio-only device's
 * bio completion (block_bio_complete), when merged away (block_bio_backmerge, block_rq_merge), or
 * when user space ages it out (IoLayer.sweep, counted in `loss`); a full map is counted per bio
 * (PROBE_BLOCK_MAP), and the bio is not followed. */
#ifndef BLOCK_INFLIGHT_ENTRIES
#define BLOCK_INFLIGHT_ENTRIES 16384 /* the loader defines the session's setting */
#endif
BPF_HASH(block_inflight, struct block_key, struct block_event, BLOCK_INFLIGHT_ENTRIES);
BPF_HASH(part_disk, u32, struct part_info, 1024);
BPF_HASH(target_devs, u32, u8, 1024);
BPF_HASH(io_intent, u32, struct io_intent, 1024);

static __always_inline u32 disk_of(u32 dev, u64 *sector)
{
    struct part_info *p = part_disk.lookup(&dev);
    if (!p)
        return dev;
    if (sector)
        *sector += p->start;
    return p->disk;
}

/* Flushes. An empty bio is a cache flush (fsync's REQ_PREFLUSH without data); every one starts at
 * sector 0, so two fsyncs at once would share a key, and the flush request the block layer makes
 * to serve the flushes waiting on a disk is issued at sector 0 ("FF") and, since 6.12, completes
 * at (sector_t)-1; each empty bio's own request then ends at sector 0 with no sectors, with nothing
 * to tell which. So empty bios are keyed apart from data, by their order per disk (FLUSH_KEY + n,
 * every empty bio on the disk numbered, traced or not), and follow the flush requests: an issue
 * covers the flushes queued until then, its completion ends them. A flush request whose program
 * was skipped (counted) is made up by the next one, which then covers those too. A multi-queue
 * disk has a flush request per hardware queue: two concurrent flushes may end at each other's
 * time there, never go uncounted. */
#define FLUSH_KEY 0xFFFFFFFF00000000ull /* above any disk's sectors */
#define FLUSH_SLOTS 1024                /* power of two: flushes in flight per disk */
#define FLUSH_SCAN 64                   /* flushes one flush request's issue or end visits */
struct flush_seq {
    u64 queued;    /* empty bios queued on the disk since the start */
    u64 issued;    /* of them, covered by a flush request issued since */
    u64 done;      /* and ended */
    u64 requests;  /* flush requests seen: a request-based disk (its bio completions are not ends) */
};
BPF_HASH(flush_seq, u32, struct flush_seq, 1024);

static __always_inline struct flush_seq *flush_seq_of(u32 disk)
{
    struct flush_seq *f = flush_seq.lookup(&disk);
    if (f)
        return f;
    struct flush_seq zero = {};
    flush_seq.insert(&disk, &zero);
    return flush_seq.lookup(&disk);
}

/* an empty bio not followed still takes its number (see above) */
static __always_inline int flush_unfollowed(struct flush_seq *f)
{
    if (f)
        __sync_fetch_and_add(&f->queued, 1);
    return 0;
}

static __always_inline u64 flush_key(u64 n)
{
    return FLUSH_KEY + (n & (FLUSH_SLOTS - 1));
}

static __always_inline int is_kernel_writer(const char *c)
{
    /* kworker, jbd2, flush, kswapd threads: the ones that submit writeback, journal and
     * throttled I/O; user space confirms PF_KTHREAD from /proc when it names the thread */
    if (c[0] == 'k' && c[1] == 'w' && c[2] == 'o' && c[3] == 'r' && c[4] == 'k')
        return 1;
    if (c[0] == 'j' && c[1] == 'b' && c[2] == 'd' && c[3] == '2')
        return 1;
    if (c[0] == 'f' && c[1] == 'l' && c[2] == 'u' && c[3] == 's' && c[4] == 'h')
        return 1;
    if (c[0] == 'k' && c[1] == 's' && c[2] == 'w' && c[3] == 'a' && c[4] == 'p')
        return 1;
    return 0;
}

static __always_inline int intent(u32 fsdev, u64 sector, u64 sectors)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32) || sectors == 0)
        return 0;
    u32 disk = disk_of(fsdev, &sector);
    struct io_intent it = {};
    it.start = sector;
    it.end = sector + sectors;
    it.ts = bpf_ktime_get_ns();
    it.cgroup_id = bpf_get_current_cgroup_id();
    it.pid = id >> 32;
    it.tid = (u32)id;
    it.epoch = syscall_epoch(it.tid);
    bpf_get_current_comm(it.comm, sizeof(it.comm));
    io_intent.update(&disk, &it);
    u8 one = 1;
    target_devs.update(&disk, &one);
    return 0;
}

static __always_inline u32 fs_block_shift(u32 fsdev)
{
    struct part_info *p = part_disk.lookup(&fsdev);
    return p && p->block_shift ? p->block_shift : 3;
}

#ifdef HAVE_TP_iomap_iomap_iter_dstmap
/* direct I/O (and other iomap I/O) on ext4, xfs: the disk extent, in the submitter's context */
TRACEPOINT_PROBE(iomap, iomap_iter_dstmap)
{
    /* IOMAP_MAPPED = 2: only extents with disk blocks are I/O */
    if (args->type != 2)
        return 0;
    return intent(args->bdev, args->addr >> 9, args->length >> 9);
}
#endif

#ifdef HAVE_TP_ext4_ext4_ext_map_blocks_exit
/* ext4 blocks allocated or looked up for writeback (fsync) or read, in the caller's context */
TRACEPOINT_PROBE(ext4, ext4_ext_map_blocks_exit)
{
    if (args->ret <= 0)
        return 0;
    u32 shift = fs_block_shift(args->dev);
    return intent(args->dev, args->pblk << shift, (u64)args->len << shift);
}
#endif

#ifdef HAVE_TP_ext4_ext4_es_lookup_extent_exit
/* ext4 blocks found in the extent cache: most reads and overwrites of mapped blocks */
TRACEPOINT_PROBE(ext4, ext4_es_lookup_extent_exit)
{
    if (!args->found || args->pblk == 0)
        return 0;
    u32 shift = fs_block_shift(args->dev);
    return intent(args->dev, args->pblk << shift, (u64)args->len << shift);
}
#endif

TRACEPOINT_PROBE(block, block_bio_queue)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u64 sector = args->sector;
    u32 flags = 0;
    struct block_event e = {};
    u64 now = bpf_ktime_get_ns();
    int fresh = 0;
    u64 key = sector;
    struct flush_seq *f = 0;
    if (args->nr_sector == 0) { /* a flush: numbered on its disk, traced or not (see above) */
        f = flush_seq_of(disk_of(args->dev, 0));
        if (!f) {
            count_drop(PROBE_BLOCK_MAP);
            return 0;
        }
    }
    if (is_target(tgid)) {
        u32 disk = disk_of(args->dev, &sector);
        u8 one = 1;
        target_devs.update(&disk, &one);
        e.dev = disk;
        e.ts = now;
        e.pid = tgid;
        e.tid = (u32)id;
        e.cgroup_id = bpf_get_current_cgroup_id();
        e.stack_ts = pystack_key(syscall_epoch(e.tid), now, &fresh);
        bpf_get_current_comm(e.comm, sizeof(e.comm));
    } else {
        char comm[16];
        bpf_get_current_comm(comm, sizeof(comm));
        if (!is_kernel_writer(comm))
            return flush_unfollowed(f);
        u32 disk = disk_of(args->dev, &sector);
        if (!target_devs.lookup(&disk))
            return flush_unfollowed(f);
        e.dev = disk;
        flags = BLOCK_FLAG_KTHREAD;
        struct io_intent *it = io_intent.lookup(&disk);
        if (it && sector >= it->start && sector < it->end) {
            e.ts = it->ts;
            e.pid = it->pid;
            e.tid = it->tid;
            e.cgroup_id = it->cgroup_id;
            /* the submitter's capture in the intent's syscall, if it made one (see above) */
            u32 sub = it->tid;
            struct pystack_last *last = pystack_last.lookup(&sub);
            if (it->epoch && last && last->epoch == it->epoch)
                e.stack_ts = last->key;
            __builtin_memcpy(e.comm, it->comm, sizeof(e.comm));
            flags |= BLOCK_FLAG_INTENT;
        } else {
            e.ts = now;
            e.pid = tgid;
            e.tid = (u32)id;
            e.cgroup_id = bpf_get_current_cgroup_id();
            __builtin_memcpy(e.comm, comm, sizeof(e.comm));
        }
    }
    e.bio_queue_ts = now;
    e.sector = sector;
    e.nr_bytes = args->nr_sector << 9;
    e.flags = flags;
    bpf_probe_read_kernel(e.rwbs, sizeof(args->rwbs), args->rwbs);
    /* A followed flush takes its number just before its entry is made. A flush request issued
     * on another CPU in between covers the numbers queued until then (flush_issued) and may pass
     * this one before its entry is in. Such an issue cannot serve this bio (it has not reached
     * the flush machinery yet), so the entry then takes the next number, for the next issue. The
     * map update is a locked instruction, so the count read after it is the one published before
     * that issue's scan whenever the scan missed the entry. */
    u64 n = 0;
    if (f) {
        n = __sync_fetch_and_add(&f->queued, 1);
        key = flush_key(n);
    }
    struct block_key k = {.sector = key, .dev = e.dev};
    /* an issued request still under this key never reached block_done: its completion program was
     * skipped (see block_done), or another request at this sector is in flight; count it */
    struct block_event *stale = block_inflight.lookup(&k);
    if (stale && stale->issue_ts)
        count_drop(PROBE_BLOCK_UNCOMPLETED);
    if (block_inflight.update(&k, &e))
        count_drop(PROBE_BLOCK_MAP);
    else if (f && f->issued > n) {
        struct block_event *mine = block_inflight.lookup(&k);
        if (mine && !mine->issue_ts) {
            struct block_key next = {.sector = flush_key(__sync_fetch_and_add(&f->queued, 1)), .dev = e.dev};
            if (block_inflight.update(&next, &e))
                count_drop(PROBE_BLOCK_MAP);
            block_inflight.delete(&k);
        }
    }
    if (fresh)
        PYSTACK_CAPTURE_TP(args, now);
    return 0;
}

static __always_inline struct block_event *inflight(u32 dev, u64 sector)
{
    struct block_key k = {.sector = sector, .dev = dev};
    return block_inflight.lookup(&k);
}

#ifdef HAVE_TP_block_block_bio_frontmerge
/* the bio becomes the request's new start: the request's entry (keyed by its old start, the bio's
 * end) moves to the bio's sector, replacing the bio's own entry; the earlier submission is kept */
TRACEPOINT_PROBE(block, block_bio_frontmerge)
{
    u64 sector = args->sector;
    u32 dev = disk_of(args->dev, &sector);
    struct block_key k = {.sector = sector, .dev = dev};
    struct block_key old = {.sector = sector + args->nr_sector, .dev = dev};
    struct block_event *e = block_inflight.lookup(&old);
    if (!e) {
        /* a request of no traced submitter: the bio's entry names it from now on */
        e = block_inflight.lookup(&k);
        if (e) {
            e->flags |= BLOCK_FLAG_FRONT_MERGE;
            e->merges++;
        }
        return 0;
    }
    struct block_event moved = *e;
    moved.sector = sector;
    moved.flags |= BLOCK_FLAG_FRONT_MERGE;
    moved.merges++;
    if (block_inflight.update(&k, &moved))
        count_drop(PROBE_BLOCK_MAP);
    block_inflight.delete(&old);
    return 0;
}
#endif

#ifdef HAVE_TP_block_block_bio_backmerge
/* the bio joins an earlier request; the request's row (its bytes at completion) includes it */
TRACEPOINT_PROBE(block, block_bio_backmerge)
{
    u64 sector = args->sector;
    u32 dev = disk_of(args->dev, &sector);
    struct block_key k = {.sector = sector, .dev = dev};
    block_inflight.delete(&k);
    return 0;
}
#endif

#ifdef HAVE_TP_block_block_rq_merge
/* the I/O scheduler merged this request into the one before it (which ends at its start): that
 * one's row has its bytes; its own entry would never complete */
TRACEPOINT_PROBE(block, block_rq_merge)
{
    struct block_key k = {.sector = args->sector, .dev = args->dev};
    block_inflight.delete(&k);
    return 0;
}
#endif

#ifdef HAVE_TP_block_block_split
/* The block layer splits a bio larger than the device's limits (max_sectors_kb, segments): the
 * front part keeps the bio's sector and entry, the rest continues at new_sector without another
 * block_bio_queue (and may be split again). The rest gets a copy of the entry under its own
 * sector, so each request made from the bio is a row with the bio's submitter and time. */
TRACEPOINT_PROBE(block, block_split)
{
    u64 sector = args->sector;
    u32 dev = disk_of(args->dev, &sector);
    u64 rest_sector = args->new_sector + (sector - args->sector);
    if (rest_sector <= sector)
        return 0;
    struct block_key k = {.sector = sector, .dev = dev};
    struct block_event *e = block_inflight.lookup(&k);
    if (!e)
        return 0;
    u64 front = (rest_sector - sector) << 9;
    if (e->nr_bytes <= front)
        return 0;
    struct block_event rest = *e;
    rest.sector = rest_sector;
    rest.nr_bytes = e->nr_bytes - front;
    rest.flags |= BLOCK_FLAG_SPLIT;
    e->nr_bytes = front;
    e->flags |= BLOCK_FLAG_SPLIT;
    struct block_key rk = {.sector = rest_sector, .dev = dev};
    if (block_inflight.update(&rk, &rest))
        count_drop(PROBE_BLOCK_MAP);
    return 0;
}
#endif

#ifdef HAVE_TP_block_block_rq_insert
TRACEPOINT_PROBE(block, block_rq_insert)
{
    if (args->nr_sector == 0)
        return 0; /* a flush's: not a data request at sector 0 */
    struct block_event *e = inflight(args->dev, args->sector);
    if (e)
        e->insert_ts = bpf_ktime_get_ns();
    return 0;
}
#endif

/* A flush request is issued on disk `dev`: it covers the flushes queued until now. */
static __always_inline void flush_issued(u32 dev, const char *rwbs)
{
    struct flush_seq *f = flush_seq.lookup(&dev);
    if (!f)
        return;
    f->requests++;
    u64 now = bpf_ktime_get_ns();
    u64 n = f->issued, queued = f->queued;
    /* published before the scan, by a locked instruction (a full barrier): a flush whose entry the
     * scan does not find yet then sees the new count once its entry is in, and takes the next
     * number (block_bio_queue). Another flush request of the disk that published first covers
     * these itself. */
    if (n >= queued || __sync_val_compare_and_swap(&f->issued, n, queued) != n)
        return;
#pragma clang loop unroll(disable)
    for (int i = 0; i < FLUSH_SCAN; i++, n++) {
        if (n >= queued)
            break;
        struct block_key k = {.sector = flush_key(n), .dev = dev};
        struct block_event *e = block_inflight.lookup(&k);
        if (e && !e->issue_ts) {
            e->issue_ts = now;
            bpf_probe_read_kernel(e->rwbs, 10, rwbs); /* the tracepoint's char[10] */
        }
    }
}

/* Flushes [done, upto) of disk `dev` end: their rows are sent (those traced). */
static __always_inline void flush_done(struct flush_seq *f, u32 dev, u64 upto, s32 error, u32 flags)
{
    u64 n = f->done;
    u64 now = bpf_ktime_get_ns();
#pragma clang loop unroll(disable)
    for (int i = 0; i < FLUSH_SCAN; i++, n++) {
        if (n >= upto)
            break;
        struct block_key k = {.sector = flush_key(n), .dev = dev};
        struct block_event *e = block_inflight.lookup(&k);
        if (!e)
            continue;
        e->complete_ts = now;
        e->flags |= flags;
        if (error) {
            e->flags |= BLOCK_FLAG_ERROR;
            e->error = error;
        }
        if (block_events.ringbuf_output(e, sizeof(*e), block_rb_flags(now)))
            count_drop(PROBE_BLOCK);
        block_inflight.delete(&k);
    }
    f->done = n;
}

TRACEPOINT_PROBE(block, block_rq_issue)
{
    if (args->nr_sector == 0) {
        if (args->rwbs[0] == 'F')
            flush_issued(args->dev, args->rwbs);
        return 0;
    }
    struct block_event *e = inflight(args->dev, args->sector);
    if (e) {
        e->issue_ts = bpf_ktime_get_ns();
        /* after a partial completion and a requeue the request is issued again from a later
         * sector with what is left: its size stays the whole request's */
        e->nr_bytes = ((args->sector - e->sector) << 9) + args->bytes;
        bpf_probe_read_kernel(e->rwbs, sizeof(args->rwbs), args->rwbs);
    }
    return 0;
}

#ifdef HAVE_TP_block_block_rq_requeue
TRACEPOINT_PROBE(block, block_rq_requeue)
{
    struct block_event *e = inflight(args->dev, args->sector);
    if (e)
        e->requeues++;
    return 0;
}
#endif

#ifdef HAVE_TP_block_block_rq_error
TRACEPOINT_PROBE(block, block_rq_error)
{
    struct block_event *e = inflight(args->dev, args->sector);
    if (e) {
        e->flags |= BLOCK_FLAG_ERROR;
        e->error = args->error;
    }
    return 0;
}
#endif

/* A completion of nr_sector sectors from `sector`. A driver may complete a request in several calls
 * (SCSI: blk_update_request with part of it; the request's start moves past the part done): the
 * entry moves to the next sector and the row is sent once, at the call that completes the rest,
 * with the whole request's size.
 *
 * The kernel runs a tracepoint's BPF program only if no other one is running on that CPU
 * (bpf_prog_active), and completions run in softirq context that can interrupt any program, or a
 * task in a BPF map syscall (which holds it even while preempted): then this program is skipped
 * (the program's recursion_misses), the entry stays, and is counted as PROBE_BLOCK_UNCOMPLETED
 * when its key is reused or at stop. */
static __always_inline void block_done(u32 dev, u64 sector, u32 nr_sector, s32 error, u64 io_tag, u32 ai)
{
    struct block_key k = {.sector = sector, .dev = dev};
    struct block_event *e = block_inflight.lookup(&k);
    if (!e)
        return;
    u64 before = (sector - e->sector) << 9;  /* completed by earlier calls */
    u64 now_done = before + ((u64)nr_sector << 9);
    if (error)
        e->error = error;
    if (nr_sector && e->issue_ts && now_done < e->nr_bytes) {
        struct block_event rest = *e;
        rest.flags |= BLOCK_FLAG_PARTIAL;
        struct block_key nk = {.sector = sector + nr_sector, .dev = dev};
        if (block_inflight.update(&nk, &rest))
            count_drop(PROBE_BLOCK_MAP);
        block_inflight.delete(&k);
        return;
    }
    e->complete_ts = bpf_ktime_get_ns();
    if (!e->issue_ts || !e->nr_bytes)
        e->nr_bytes = now_done;  /* issue not seen: what the completions covered */
    e->io_tag = io_tag;
    if (ai)
        e->flags |= BLOCK_FLAG_AI;
    if (block_events.ringbuf_output(e, sizeof(*e), block_rb_flags(e->complete_ts)))
        count_drop(PROBE_BLOCK);
    block_inflight.delete(&k);
}

TRACEPOINT_PROBE(block, block_rq_complete)
{
    if (args->nr_sector == 0) {
        /* the flush request ("FF", at (sector_t)-1 since 6.12) ends the flushes it covered; the
         * empty bios' own requests that end after it tell nothing more (see above) */
        u32 dev = args->dev;
        struct flush_seq *f = args->rwbs[0] == 'F' ? flush_seq.lookup(&dev) : 0;
        if (f)
            flush_done(f, dev, f->issued, args->error, 0);
        return 0;
    }
#ifdef HAVE_TPF_block_block_rq_complete_io_tag
    /* the patch series appends the request's I/O tag (0: untagged) */
    block_done(args->dev, args->sector, args->nr_sector, args->error, args->io_tag, 1);
#else
    block_done(args->dev, args->sector, args->nr_sector, args->error, 0, 0);
#endif
    return 0;
}

#ifdef HAVE_TP_block_block_bio_complete
/* A bio ends. Devices that complete bios without making requests (zram, brd, device mapper, md)
 * end them here only, and so does a bio failed before it became a request: the entry is sent as a
 * row (no issue time) and removed. On a request-based disk this fires after block_rq_complete sent
 * and removed the request's entry, for each of its bios; an entry found here then belongs to a
 * request seen by the request tracepoints (insert or issue time set) or has another size, and is
 * left to block_done. */
TRACEPOINT_PROBE(block, block_bio_complete)
{
    u64 sector = args->sector;
    u32 dev = disk_of(args->dev, &sector);
    if (args->nr_sector == 0) {
        /* a flush of a bio-only device (device mapper) ends here; on a request-based disk its
         * request's completion ended it already */
        struct flush_seq *f = flush_seq.lookup(&dev);
        if (f && !f->requests)
            flush_done(f, dev, f->done + 1, args->error, BLOCK_FLAG_BIO);
        return 0;
    }
    struct block_key k = {.sector = sector, .dev = dev};
    struct block_event *e = block_inflight.lookup(&k);
    if (!e || e->insert_ts || e->issue_ts || e->nr_bytes != ((u64)args->nr_sector << 9))
        return 0;
    e->complete_ts = bpf_ktime_get_ns();
    e->flags |= BLOCK_FLAG_BIO;
    if (args->error) {
        e->flags |= BLOCK_FLAG_ERROR;
        e->error = args->error;
    }
    if (block_events.ringbuf_output(e, sizeof(*e), block_rb_flags(e->complete_ts)))
        count_drop(PROBE_BLOCK);
    block_inflight.delete(&k);
    return 0;
}
#endif

#ifdef HAVE_TP_nvme_nvme_timeout
BPF_RINGBUF_OUTPUT(nvme_ai_events, 16);

/* the patch series' NVMe timeout decisions: rare, all recorded */
TRACEPOINT_PROBE(nvme, nvme_timeout)
{
    struct nvme_ai_event *e = nvme_ai_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(PROBE_BLOCK);
        return 0;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->sector = args->sector;
    e->io_tag = args->io_tag;
    e->ctrl_id = args->ctrl_id;
    e->qid = args->qid;
    e->rq_tag = args->rq_tag;
    e->nr_bytes = args->nr_bytes;
    /* the request's submitter is not in the event: req_pid/req_tid stay 0 */
    e->cid = args->cid;
    e->opcode = args->opcode;
    e->action = args->action;
    u32 loc = *(u32 *)&args->data_loc_disk;
    bpf_probe_read_kernel_str(e->disk, sizeof(e->disk), (char *)args + (loc & 0xffff));
    nvme_ai_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}
#endif
