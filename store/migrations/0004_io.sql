-- 0004_io: the I/O and device layer: block requests by stage, memory pressure, TCP retransmits,
-- DMA/SWIOTLB/IOMMU, and the patch series' NVMe timeout and checkpoint events.
-- Written by recorder/layers/io/layer.py from bpf/block.bpf.c, mm.bpf.c, net.bpf.c, dma.bpf.c.
-- Times are ns CLOCK_MONOTONIC (bpf_ktime_get_ns), sizes bytes. Indexes: store/indexes/0004_io.sql.

-- table: block_request
-- One row per completed block request whose submitter was traced. Recorded: requests a target
-- thread submitted (its own bio, or its throttled bio queued later by a kworker, matched through
-- its I/O intent), and requests kernel threads (writeback, journal) submitted on disks the targets
-- used. Stages: queued = ts -> issue_ts (throttling, I/O scheduler, tag wait), on device =
-- issue_ts -> complete_ts.
-- How bios map to rows (the sum of size_bytes of a thread's rows is the bytes it moved):
--   split: a bio larger than the device's limits (max_sectors_kb, segments) is split by the block
--     layer (block_split) into several requests; each is a row with the bio's submitter, ts and
--     bio_queue_ts, its own sector and size.
--   merged: a bio back- or front-merged into a request, and a request the I/O scheduler merged
--     into another (block_rq_merge), count in the surviving request's row (size_bytes, merges);
--     that row keeps the earliest submission's thread and ts.
--   partial completions: a request completed in several block_rq_complete calls (part of it at a
--     time, possibly requeued in between) is one row with the whole request's size; complete_ts is
--     the last call.
--   not seen at issue: issue_ts NULL and size_bytes what its completions covered.
--   completion not seen: a request issued whose completion never reached the probe (the kernel
--     skips a tracepoint's BPF program while another one runs on that CPU; or still in flight at
--     stop) has no row and is counted in `loss` as 'block request completion not seen'.
CREATE TABLE block_request (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns: submission (bio queued in the submitter's context, or its I/O intent)
  dur INTEGER NOT NULL,                                -- ns: ts -> completion
  thread_id INTEGER REFERENCES thread(id),             -- submitting thread (the target's, or the kernel thread's)
  submitter_kind TEXT NOT NULL,                        -- target (queued by it), target_deferred (its bio queued later by a kworker: blk-throttle), kernel_thread (writeback, journal)
  device TEXT,                                         -- disk name (DEVNAME from /sys/dev/block/M:m/uevent)
  dev_major INTEGER NOT NULL,                          -- disk major number
  dev_minor INTEGER NOT NULL,                          -- disk minor number
  sector INTEGER NOT NULL,                             -- first 512-byte sector on the whole disk
  size_bytes INTEGER NOT NULL,                         -- bytes of the request at issue (the whole request, after partial completions)
  op TEXT NOT NULL,                                    -- read, write, discard, secure_erase, flush, other
  rwbs TEXT NOT NULL,                                  -- the block layer's rwbs string as traced (WS, R, FWFS, ...)
  sync INTEGER NOT NULL,                               -- 1 if REQ_SYNC
  metadata INTEGER NOT NULL,                           -- 1 if REQ_META
  fua INTEGER NOT NULL,                                -- 1 if REQ_FUA
  readahead INTEGER NOT NULL,                          -- 1 if REQ_RAHEAD
  preflush INTEGER NOT NULL,                           -- 1 if REQ_PREFLUSH
  bio_queue_ts INTEGER NOT NULL,                       -- ns: block_bio_queue (after throttling: the kworker's time for throttled bios)
  insert_ts INTEGER,                                   -- ns: block_rq_insert into the scheduler, NULL when issued directly
  issue_ts INTEGER,                                    -- ns: block_rq_issue to the driver (the last one after a requeue), NULL if never seen
  complete_ts INTEGER NOT NULL,                        -- ns: block_rq_complete
  queued_dur INTEGER,                                  -- ns: ts -> issue_ts
  device_dur INTEGER,                                  -- ns: issue_ts -> complete_ts
  error INTEGER NOT NULL,                              -- 0 or negative errno (block_rq_error / completion status)
  requeues INTEGER NOT NULL,                           -- times the request was requeued
  merges INTEGER NOT NULL,                             -- bios front-merged into it
  io_tag INTEGER,                                      -- I/O lineage tag (block_ai_rq_complete, patch series), NULL without it
  cgroup_id INTEGER                                    -- cgroup v2 id of the submitter
);

-- table: reclaim_interval
-- Direct reclaim by a target thread (vmscan:mm_vmscan_direct_reclaim_begin -> _end, machine short
-- of memory; mm_vmscan_memcg_reclaim_begin -> _end, its memory cgroup at its limit): the
-- allocation stalled while the thread freed memory itself.
CREATE TABLE reclaim_interval (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns: reclaim began
  dur INTEGER NOT NULL,                                -- ns in reclaim
  thread_id INTEGER REFERENCES thread(id),             -- the allocating thread
  kind TEXT NOT NULL,                                  -- direct (global shortage) or memcg (cgroup limit)
  alloc_order INTEGER,                                 -- log2 pages of the allocation
  gfp_flags INTEGER,                                   -- GFP flags of the allocation
  pages_reclaimed INTEGER,                             -- pages it reclaimed
  cgroup_id INTEGER                                    -- cgroup v2 id of the thread
);

-- table: dirty_throttle
-- writeback:balance_dirty_pages pauses of a target thread: it dirtied pages faster than writeback.
CREATE TABLE dirty_throttle (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns: the pause starts
  dur INTEGER NOT NULL,                                -- ns the thread is put to sleep (pause; may be <= 0: no sleep)
  thread_id INTEGER REFERENCES thread(id),             -- throttled thread
  bdi TEXT,                                            -- backing device (7:0, 259:0)
  period_dur INTEGER,                                  -- ns: the throttling period
  think_dur INTEGER,                                   -- ns the task ran since its last pause
  dirty_pages INTEGER,                                 -- pages dirty (global)
  limit_pages INTEGER,                                 -- dirty limit in pages
  task_ratelimit_kbps INTEGER,                         -- KiB/s the task is throttled to
  pages_dirtied INTEGER,                               -- pages the task dirtied since its last pause
  cgroup_ino INTEGER                                   -- writeback cgroup inode
);

-- table: oom_victim
-- oom:mark_victim: every task the OOM killer chose during the session (not only targets).
CREATE TABLE oom_victim (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns: marked as victim
  pid INTEGER NOT NULL,                                -- victim process id
  comm TEXT,                                           -- victim name
  uid INTEGER,                                         -- victim user id
  oom_score_adj INTEGER,                               -- victim's oom_score_adj
  total_vm_bytes INTEGER, anon_rss_bytes INTEGER, file_rss_bytes INTEGER, shmem_rss_bytes INTEGER,
  pgtables_bytes INTEGER,                              -- victim's memory (bytes)
  killer_tid INTEGER                                   -- task running when it was marked
);

-- table: tcp_retransmit
-- tcp:tcp_retransmit_skb, every retransmit on the machine (timer context: the running task is rarely the owner).
CREATE TABLE tcp_retransmit (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns
  thread_id INTEGER REFERENCES thread(id),             -- task running at the time
  family INTEGER,                                      -- 2 AF_INET, 10 AF_INET6
  saddr TEXT, sport INTEGER, daddr TEXT, dport INTEGER, -- the connection
  state INTEGER,                                       -- TCP state (1 ESTABLISHED, ...)
  err INTEGER,                                         -- error of the retransmit, 0 if sent
  cgroup_id INTEGER                                    -- cgroup v2 id of the running task
);

-- table: dma_event
-- DMA mappings by target threads (dma:dma_map_phys / dma_map_page; sampled 1/64 when recording
-- everything), every SWIOTLB bounce (swiotlb:swiotlb_bounced), every IOMMU fault
-- (iommu:io_page_fault), and per-mapping latency from the patch series (dma:dma_ai_map_latency).
CREATE TABLE dma_event (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns (mapping start for map_latency)
  dur INTEGER NOT NULL,                                -- ns: mapping latency (map_latency), else 0
  thread_id INTEGER REFERENCES thread(id),             -- task running
  kind TEXT NOT NULL,                                  -- map, swiotlb_bounce, iommu_fault, map_latency
  device TEXT,                                         -- dev_name() of the device (0000:01:00.0), cut at 31 bytes
  addr INTEGER,                                        -- physical address (map), I/O virtual address (fault), device address (bounce)
  dma_addr INTEGER,                                    -- DMA address returned (map), -1 on failure
  size_bytes INTEGER,                                  -- bytes mapped / bounced
  nents INTEGER,                                       -- scatterlist entries
  direction TEXT,                                      -- bidirectional, to_device, from_device, none
  attrs INTEGER,                                       -- DMA_ATTR_* (map), dma_mask (bounce)
  direct INTEGER, bounced INTEGER, forced INTEGER,     -- dma-direct mapping; bounced via SWIOTLB; swiotlb=force
  fault_flags INTEGER                                  -- IOMMU fault flags
);

-- table: nvme_timeout_action
-- nvme:nvme_ai_timeout (patch series, kernel-patches/): every decision of nvme_timeout().
CREATE TABLE nvme_timeout_action (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns
  controller TEXT NOT NULL,                            -- nvme0
  disk TEXT,                                           -- nvme0n1, NULL for admin commands
  qid INTEGER, command_id INTEGER, rq_tag INTEGER, opcode INTEGER, -- the command (rq_tag = kernel log's "I/O %d")
  action TEXT NOT NULL,                                -- polled, abort, reset, disable, rearm
  sector INTEGER, size_bytes INTEGER,                  -- the request
  io_tag INTEGER,                                      -- its lineage tag
  req_pid INTEGER, req_tid INTEGER                     -- task that allocated the request
);

-- table: checkpoint_write
-- writeback:ai_checkpoint_write (patch series): write extents of files with the user.ai.checkpoint xattr.
CREATE TABLE checkpoint_write (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns
  thread_id INTEGER REFERENCES thread(id),             -- writer
  dev_major INTEGER, dev_minor INTEGER, ino INTEGER,   -- the file
  name TEXT,                                           -- last path component, cut at 31 bytes
  pos INTEGER, size_bytes INTEGER,                     -- extent written
  io_tag INTEGER                                       -- writer's lineage tag
);
