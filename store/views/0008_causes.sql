-- Views: the causal model. Steps against a rolling baseline, stalls, and for each step the time on
-- the critical path of its thread (the thread that marks the steps) broken down by cause, with the
-- rows that are the evidence: off-CPU intervals (and who held the CPU), slow CUDA calls, NCCL
-- waits (and the straggler rank), block requests (and the device events that hit them), reclaim,
-- dirty-page throttling, and what happened on the machine meanwhile (OOM kills, TCP retransmits,
-- Xid, AER, IOMMU faults, SWIOTLB). causal_link joins them into one drill-down graph.
-- Every per-step view is keyed by step_mark_id and finds its rows through (thread_id, ts) indexes,
-- so `WHERE step_mark_id = ?` is cheap on large sessions. The thresholds and maps are the
-- tables of migration 0010 (stall_rule, device_event_cause...); store/analysis/explain.py reads these views.

-- view: step_baseline
-- Every step with its baseline: the median duration of up to 10 steps before and 10 complete steps
-- after it on the same thread (a rolling median: one slow step, or a slow stretch shorter than the
-- window, does not move it). slow = 1 for a stall: at least stall_rule.ratio (1.5) x the baseline
-- and stall_rule.min_excess_dur (1 ms) more, over a baseline of at least
-- stall_rule.min_baseline_steps (3) steps; the last step of a thread that exited is never a stall
-- (it ends with the program's own shutdown). The thresholds are rows of stall_rule (migration
-- 0010), not numbers here; the window, 10 steps each side, is stall_rule.neighbours.
-- Computed with window functions over the whole session: use it to list steps. To look up a few
-- steps, step_baseline_lookup gives the same rows computed per row.
CREATE VIEW step_baseline AS
SELECT b.*,
       b.dur - b.baseline_dur AS excess_dur,                 -- ns above the baseline
       round(1.0 * b.dur / max(b.baseline_dur, 1), 2) AS ratio, -- dur / baseline
       coalesce(b.baseline_steps >= (SELECT min_baseline_steps FROM stall_rule)
                AND b.dur >= (SELECT ratio FROM stall_rule) * b.baseline_dur
                AND b.dur - b.baseline_dur >= (SELECT min_excess_dur FROM stall_rule)
                AND (b.complete OR b.running), 0) AS slow -- 1 for a stalled step (stall_rule)
FROM (
    SELECT n.*,
           (SELECT value FROM (SELECT value, row_number() OVER (ORDER BY value) AS rn
                               FROM json_each(n.neighbours))
             WHERE rn = (json_array_length(n.neighbours) + 1) / 2) AS baseline_dur, -- ns, rolling median (lower middle)
           json_array_length(n.neighbours) AS baseline_steps  -- steps the median is taken over
    FROM (
        SELECT st.*,
               json_group_array(st.dur) FILTER (WHERE st.complete) OVER (
                   PARTITION BY st.thread_id ORDER BY st.ts
                   ROWS BETWEEN 10 PRECEDING AND 10 FOLLOWING EXCLUDE CURRENT ROW) AS neighbours
        FROM step_all st
    ) n
) b;

-- view: step_baseline_lookup
-- The rows of step_baseline computed one by one through the (thread_id, ts) index: cheap for
-- `WHERE step_mark_id = ?` or `WHERE session_id = ? AND step = ?` on a session of any size.
CREATE VIEW step_baseline_lookup AS
SELECT b.*,
       b.dur - b.baseline_dur AS excess_dur,
       round(1.0 * b.dur / max(b.baseline_dur, 1), 2) AS ratio,
       coalesce(b.baseline_steps >= (SELECT min_baseline_steps FROM stall_rule)
                AND b.dur >= (SELECT ratio FROM stall_rule) * b.baseline_dur
                AND b.dur - b.baseline_dur >= (SELECT min_excess_dur FROM stall_rule)
                AND (b.complete OR b.running), 0) AS slow
FROM (
    SELECT n.step_mark_id, n.session_id, n.process_id, n.thread_id, n.step, n.ts, n.end_ts, n.dur, n.complete,
           n.running, n.inferred, n.neighbours,
           (SELECT value FROM (SELECT value, row_number() OVER (ORDER BY value) AS rn
                               FROM json_each(n.neighbours))
             WHERE rn = (json_array_length(n.neighbours) + 1) / 2) AS baseline_dur,
           json_array_length(n.neighbours) AS baseline_steps
    FROM (
        -- one_row (a window over one row each) keeps SQLite from flattening this subquery into the
        -- ones above, which would evaluate the neighbours once per use (~15x slower); WHERE terms
        -- on the partition columns are still pushed down to the indexes
        SELECT st.*,
               count(*) OVER (PARTITION BY st.step_mark_id, st.session_id, st.step, st.thread_id, st.ts) AS one_row,
               -- the 10 steps before: differences of the 11 marks up to this one; the 10 after:
               -- differences of the 11 marks after it (a last step without a next mark drops out)
               (SELECT json_group_array(d) FROM (
                    SELECT ts - lag(ts) OVER (ORDER BY ts) AS d
                    FROM (SELECT n.ts FROM step_mark n WHERE n.thread_id = st.thread_id AND n.ts <= st.ts
                          ORDER BY n.ts DESC LIMIT (SELECT neighbours + 1 FROM stall_rule))
                    UNION ALL
                    SELECT lead(ts) OVER (ORDER BY ts) - ts
                    FROM (SELECT n.ts FROM step_mark n WHERE n.thread_id = st.thread_id AND n.ts > st.ts
                          ORDER BY n.ts LIMIT (SELECT neighbours + 1 FROM stall_rule)))
                WHERE d IS NOT NULL) AS neighbours
        FROM step st
    ) n
) b;

-- view: stall
-- The stalled steps (slow = 1) of step_baseline. A report finds them faster (store/analysis/causes.py
-- find_stalls): it looks up in step_baseline_lookup only the steps at least stall_rule.ratio x the
-- shortest of their neighbours (the median is never below the minimum), which decides.
CREATE VIEW stall AS
SELECT * FROM step_baseline WHERE slow = 1;

-- view: step_offcpu
-- Causal link: a step -> each off-CPU interval of its thread inside it, clipped to the step, split
-- into the time blocked (sleeping, I/O, futex...) and the time then spent waiting for a CPU, with
-- the task that held the CPU. The thread is running when it marks a step, so every interval that
-- overlaps the step starts inside it.
CREATE VIEW step_offcpu AS
SELECT
    st.step_mark_id, st.session_id, st.step,
    o.id AS offcpu_id,
    o.ts, o.reason, o.syscall_name, o.state_letter,
    min(st.end_ts, o.ts + o.dur) - o.ts AS overlap_dur,      -- ns of the step in this interval
    max(0, min(st.end_ts, o.ts + o.dur) - (o.ts + o.dur - o.runq_dur)) AS runq_dur, -- of which waiting for a CPU
    min(st.end_ts, o.ts + o.dur) - o.ts
      - max(0, min(st.end_ts, o.ts + o.dur) - (o.ts + o.dur - o.runq_dur)) AS blocked_dur, -- of which blocked
    -- process that held the CPU meanwhile: the contender's, else the next task's (of one task)
    CASE WHEN o.contender_tid IS NOT NULL THEN o.contender_pid ELSE o.next_pid END AS contender_pid,
    -- its process's name; a thread of the stalled thread's own process by its own name (a pool's
    -- worker, a loader thread), since the process's name is the stalled thread's too
    CASE WHEN ct.process_id = me.process_id THEN coalesce(ct.name, o.contender_name, o.next_name)
         WHEN o.contender_tid IS NOT NULL THEN o.contender_name
         ELSE coalesce(o.next_process_name, o.next_name) END AS contender_name,
    coalesce(o.contender_tid, o.next_tid) AS contender_tid,
    -- what the task that held the CPU is to the stalled thread: 'recorder' (the recording process
    -- itself), 'same_process' (a sibling thread: more runnable threads than CPUs), 'job' (another
    -- recorded process, e.g. a data-loader worker) or 'other' (a task outside the recording)
    CASE
        WHEN CASE WHEN o.contender_tid IS NOT NULL THEN o.contender_pid ELSE o.next_pid END = ss.recorder_pid
            THEN 'recorder'
        WHEN ct.process_id = me.process_id THEN 'same_process'
        WHEN ct.traced = 1 THEN 'job'
        ELSE 'other'
    END AS contender_relation,
    o.in_cpu AS contended_cpu,                               -- CPU it waited for
    o.waker_pid, o.waker_name,                               -- who woke it
    oi.python_stack_id                                       -- Python stack when it blocked, if captured
FROM step st
JOIN offcpu o ON o.thread_id = st.thread_id AND o.ts >= st.ts AND o.ts < st.end_ts
JOIN offcpu_interval oi ON oi.id = o.id
JOIN session ss ON ss.id = st.session_id
JOIN thread me ON me.id = st.thread_id
LEFT JOIN thread ct ON ct.id = coalesce(oi.contender_thread_id, oi.next_thread_id);

-- view: step_cuda_call
-- Causal link: a step -> the CUDA calls of its thread inside it that explain its time, judged two
-- ways (judged): 'baseline', slow against their own baseline (slow_cuda_call); 'step', calls with no
-- baseline of their own (fewer than slow_call_rule.min_baseline_calls calls of their family and size
-- class in the session: the first cudaMalloc of a session or after the cache was emptied, a
-- cudaDeviceSynchronize at a checkpoint, a large cudaMemcpy at evaluation) that took at least
-- slow_call_rule.min_excess_dur. The step judges those: the whole call is its excess, set against
-- the same API's time in the neighbouring steps by the breakdown (store/analysis/causes.py).
CREATE VIEW step_cuda_call AS
SELECT
    j.step_mark_id, j.session_id, j.step, j.cuda_call_id, j.api, j.family, j.ts, j.dur,
    j.judged,                           -- 'baseline' or 'step' (above)
    j.baseline_calls,                   -- calls of its family and size class its baseline is taken over
    j.expected_dur,                     -- ns, its baseline; NULL when the step judges it
    j.excess_dur,                       -- ns above its baseline; the whole call when the step judges it
    j.size_bytes, j.offcpu_dur, j.cpu_wait_dur, j.blocked_dur,
    max(0, j.excess_dur - j.offcpu_dur) AS oncpu_excess_dur, -- ns of the excess spent on-CPU in the call
    -- ns of the excess that is the call's own: on the CPU inside the library, or blocked in it
    -- (waiting for the device or the driver); not the time it waited for a CPU, which is the
    -- scheduler's (step_cause 'cpu_wait')
    max(0, j.excess_dur - j.cpu_wait_dur) AS own_excess_dur,
    j.python_stack_id
FROM (
    SELECT
        st.step_mark_id, st.session_id, st.step,
        c.id AS cuda_call_id, c.api, c.family, c.ts, c.dur, c.baseline_calls, c.size_bytes,
        CASE WHEN c.baseline_calls >= r.min_baseline_calls THEN 'baseline' ELSE 'step' END AS judged,
        CASE WHEN c.baseline_calls >= r.min_baseline_calls THEN c.expected_dur END AS expected_dur,
        CASE WHEN c.baseline_calls >= r.min_baseline_calls THEN c.excess_dur ELSE c.dur END AS excess_dur,
        c.offcpu_dur, c.cpu_wait_dur, c.offcpu_dur - c.cpu_wait_dur AS blocked_dur,
        cc.python_stack_id
    -- the step's calls through the (thread_id, ts) index, then each one's baseline by id: CROSS JOIN
    -- keeps that order (joined the other way, a session-wide query scans every call of the thread
    -- per step)
    FROM step st
    CROSS JOIN cuda_call cc ON cc.thread_id = st.thread_id AND cc.ts >= st.ts AND cc.ts < st.end_ts
    CROSS JOIN cuda_call_detail c ON c.id = cc.id
    CROSS JOIN slow_call_rule r
    WHERE (c.baseline_calls >= r.min_baseline_calls AND c.dur >= r.ratio * c.expected_dur
           AND c.excess_dur >= r.min_excess_dur)
       OR (coalesce(c.baseline_calls, 0) < r.min_baseline_calls AND c.dur >= r.min_excess_dur)
) j;

-- view: step_nccl_wait
-- Causal link: a step -> the collectives of its thread inside it, the time it waited in them (the
-- call and the synchronisation after it), and, where other ranks were recorded into the same
-- database, the rank that entered last (the straggler) and how late it was.
CREATE VIEW step_nccl_wait AS
SELECT
    st.step_mark_id, st.session_id, st.step,
    w.nccl_call_id, w.api, w.rank, w.ts, w.wait_dur, w.sync_call_id,
    n.comm_hash, n.seq, n.nranks,
    g.straggler_rank, g.straggler_pid, g.lateness_dur, g.straggler_ts,
    (SELECT c.id FROM nccl_collective c
      WHERE c.comm_hash = n.comm_hash AND c.seq = n.seq AND c.rank = g.straggler_rank) AS straggler_call_id,
    nc.python_stack_id
FROM step st
JOIN nccl_call_detail d ON d.thread_id = st.thread_id AND d.ts >= st.ts AND d.ts < st.end_ts AND d.kind = 'collective'
JOIN nccl_collective_wait w ON w.nccl_call_id = d.id
JOIN nccl_collective n ON n.id = d.id
JOIN nccl_call nc ON nc.id = d.id
LEFT JOIN nccl_straggler g ON g.comm_hash = n.comm_hash AND g.seq = n.seq;

-- view: block_request_device
-- Each block request with the device behind it: disk, NVMe controller and PCI function
-- (block_device, read from sysfs), the keys device events are printed with.
CREATE VIEW block_request_device AS
SELECT r.id AS block_request_id, r.session_id, r.ts, r.dur, r.ts + r.dur AS end_ts, r.sector, r.size_bytes,
       r.device, coalesce(d.disk, r.device) AS disk, d.controller, d.pci_address
FROM block_request r
LEFT JOIN block_device d
       ON d.session_id = r.session_id AND d.dev_major = r.dev_major AND d.dev_minor = r.dev_minor;

-- view: block_request_device_event
-- Causal link: a block request -> the device events that hit it while it was in flight (and up to
-- 100 ms after it completed, for the lines printed as the error is handled). match says how:
-- 'sector' (the event names the request's disk and sector), 'device' (the event names the
-- request's controller or PCI function, in flight at the time).
CREATE VIEW block_request_device_event AS
SELECT r.block_request_id, r.session_id, 'nvme_event' AS event_table, e.id AS event_id, e.ts,
       'nvme_' || e.kind AS kind, e.controller AS device, 'device' AS match,
       CASE e.kind WHEN 'timeout' THEN 'timeout' || coalesce(' on queue ' || e.qid, '')
                                       || coalesce(', request tag ' || e.tag, '') || coalesce(', ' || e.action, '')
                   WHEN 'abort_status' THEN 'abort status ' || iif(e.status IS NULL, 'not printed', printf('0x%x', e.status))
                   WHEN 'controller_down' THEN 'controller down' || iif(e.csts IS NULL, '', printf(', CSTS=0x%x', e.csts))
                   WHEN 'resetting' THEN 'controller reset'
                   WHEN 'not_ready' THEN 'not ready' || coalesce(', ' || e.action, '')
                                         || iif(e.csts IS NULL, '', printf(', CSTS=0x%x', e.csts))
                   WHEN 'reset_failure' THEN 'reset failed' || iif(e.errno IS NULL, '', printf(' (errno %d)', e.errno))
                   ELSE replace(e.kind, '_', ' ') END AS detail
FROM block_request_device r
JOIN nvme_event e ON e.session_id = r.session_id AND e.controller = r.controller
                 AND e.ts >= r.ts AND e.ts <= r.end_ts + 100000000
UNION ALL
SELECT r.block_request_id, r.session_id, 'nvme_timeout_action', e.id, e.ts,
       'nvme_timeout_' || e.action, coalesce(e.disk, e.controller),
       CASE WHEN e.sector = r.sector THEN 'sector' ELSE 'device' END,
       'timeout' || coalesce(' on queue ' || e.qid, '') || coalesce(', request tag ' || e.rq_tag, '')
FROM block_request_device r
JOIN nvme_timeout_action e ON e.session_id = r.session_id AND e.controller = r.controller
                          AND e.ts >= r.ts AND e.ts <= r.end_ts + 100000000
UNION ALL
SELECT r.block_request_id, r.session_id, 'block_error', e.id, e.ts,
       'io_error', e.dev, 'sector', coalesce(e.error, e.kind) || coalesce(' on ' || e.op, '')
FROM block_request_device r
JOIN block_device bd ON bd.session_id = r.session_id AND bd.disk = r.disk
JOIN block_error e ON e.session_id = r.session_id AND e.dev = bd.name
                  AND e.ts >= r.ts AND e.ts <= r.end_ts + 100000000
                  AND e.sector >= r.sector AND e.sector < r.sector + max(r.size_bytes / 512, 1)
UNION ALL
SELECT r.block_request_id, r.session_id, 'dma_event', e.id, e.ts,
       CASE e.kind WHEN 'swiotlb_bounce' THEN 'dma_bounce' ELSE e.kind END, e.device, 'device',
       coalesce(e.size_bytes || ' bytes', '')
FROM block_request_device r
JOIN dma_event e ON e.session_id = r.session_id AND e.device = r.pci_address
                AND e.kind IN ('swiotlb_bounce', 'iommu_fault') AND e.ts >= r.ts AND e.ts <= r.end_ts
UNION ALL
SELECT r.block_request_id, r.session_id, 'dma_event', e.id, e.ts, 'dma_map_slow', e.device, 'device',
       (e.dur / 1000) || ' us to map'
FROM block_request_device r
JOIN dma_event e ON e.session_id = r.session_id AND e.device = r.pci_address
                AND e.kind = 'map_latency' AND e.dur >= 1000000 AND e.ts >= r.ts AND e.ts <= r.end_ts
UNION ALL
SELECT r.block_request_id, r.session_id, 'swiotlb_event', e.id, e.ts, 'swiotlb_full', e.device, 'device',
       e.size_bytes || ' bytes could not be bounced'
FROM block_request_device r
JOIN swiotlb_event e ON e.session_id = r.session_id AND e.device = r.pci_address
                    AND e.ts >= r.ts AND e.ts <= r.end_ts + 100000000
UNION ALL
SELECT r.block_request_id, r.session_id, 'iommu_fault', e.id, e.ts, 'iommu_fault', e.device, 'device',
       coalesce(e.reason_text, e.event_type, e.kind)
FROM block_request_device r
JOIN iommu_fault e ON e.session_id = r.session_id
                  AND e.device IN (r.pci_address, substr(r.pci_address, 6)) -- VT-d prints bus:dev.fn without the segment
                  AND e.ts >= r.ts AND e.ts <= r.end_ts + 100000000
UNION ALL
SELECT r.block_request_id, r.session_id, 'aer_event', e.id, e.ts, 'pcie_aer', coalesce(e.source, e.device),
       'device', coalesce(e.severity, '') || coalesce(' ' || e.error_type, '') || coalesce(' ' || e.bit_name, '')
FROM block_request_device r
JOIN aer_event e ON e.session_id = r.session_id AND (e.device = r.pci_address OR e.source = r.pci_address)
                AND e.ts >= r.ts AND e.ts <= r.end_ts + 100000000;

-- view: step_block_request
-- Causal link: a step -> the block requests of its process that started or completed during it
-- (submitted by any of its threads, or deferred from them by throttling), and the requests kernel
-- threads (writeback, journal) completed while the step's thread was blocked in D state.
-- overlap_dur: ns of the step the request was in flight.
CREATE VIEW step_block_request AS
SELECT st.step_mark_id, st.session_id, st.step, r.id AS block_request_id, r.device, r.op, r.ts, r.dur,
       r.queued_dur, r.device_dur, r.size_bytes, r.submitter_kind, r.error, r.io_tag, r.python_stack_id,
       min(st.end_ts, r.ts + r.dur) - max(st.ts, r.ts) AS overlap_dur
FROM step st
JOIN thread t ON t.process_id = st.process_id
JOIN block_request r ON r.thread_id = t.id AND r.ts >= st.ts AND r.ts < st.end_ts  -- started in the step
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, r.id, r.device, r.op, r.ts, r.dur,
       r.queued_dur, r.device_dur, r.size_bytes, r.submitter_kind, r.error, r.io_tag, r.python_stack_id,
       min(st.end_ts, r.ts + r.dur) - max(st.ts, r.ts)
FROM step st
JOIN thread t ON t.process_id = st.process_id
JOIN block_request r ON r.thread_id = t.id AND r.complete_ts >= st.ts AND r.complete_ts < st.end_ts
                    AND r.ts < st.ts  -- started before the step, completed in it
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, r.id, r.device, r.op, r.ts, r.dur,
       r.queued_dur, r.device_dur, r.size_bytes, r.submitter_kind, r.error, r.io_tag, r.python_stack_id,
       min(st.end_ts, r.ts + r.dur) - max(st.ts, r.ts)
FROM step st
-- the step's D-state waits through the (thread_id, ts) index (CROSS JOIN keeps that order)
CROSS JOIN offcpu_interval o ON o.thread_id = st.thread_id AND o.ts >= st.ts AND o.ts < st.end_ts AND o.state = 2
JOIN block_request r ON r.session_id = st.session_id AND r.complete_ts >= o.ts AND r.complete_ts <= o.ts + o.dur
                    AND r.submitter_kind = 'kernel_thread';

-- view: step_device_event
-- Causal link: a step -> device events that hit its block requests (block_request_device_event).
CREATE VIEW step_device_event AS
SELECT DISTINCT b.step_mark_id, b.session_id, b.step, b.block_request_id, e.event_table, e.event_id,
       e.ts, e.kind, e.device, e.match, e.detail
FROM step_block_request b
JOIN block_request_device_event e ON e.block_request_id = b.block_request_id;

-- view: step_reclaim
-- Causal link: a step -> direct reclaim by its thread inside it (allocation stalls).
CREATE VIEW step_reclaim AS
SELECT st.step_mark_id, st.session_id, st.step, r.id AS reclaim_id, r.kind, r.ts,
       min(st.end_ts, r.ts + r.dur) - max(st.ts, r.ts) AS overlap_dur, r.pages_reclaimed
FROM step st
JOIN reclaim_interval r ON r.thread_id = st.thread_id AND r.ts < st.end_ts AND r.ts + r.dur > st.ts
                       AND r.ts >= st.ts - 60000000000;

-- view: step_dirty_throttle
-- Causal link: a step -> balance_dirty_pages pauses of its thread (it dirtied pages faster than
-- the disk took them).
CREATE VIEW step_dirty_throttle AS
SELECT st.step_mark_id, st.session_id, st.step, d.id AS dirty_throttle_id, d.ts, d.bdi,
       max(0, min(st.end_ts, d.ts + d.dur) - max(st.ts, d.ts)) AS overlap_dur
FROM step st
JOIN dirty_throttle d ON d.thread_id = st.thread_id AND d.ts >= st.ts AND d.ts < st.end_ts AND d.dur > 0;

-- view: step_machine_event
-- Events on the machine during a step that are not tied to its thread: OOM kills, TCP
-- retransmits, GPU Xid errors, PCIe AER, IOMMU faults, SWIOTLB exhaustion and bounces, NVMe
-- controller trouble. They are secondary signals, or a cause when the step's wait matches them.
CREATE VIEW step_machine_event AS
SELECT st.step_mark_id, st.session_id, st.step, 'oom_kill' AS event_table, e.id AS event_id, e.ts,
       'oom_kill' AS kind, e.comm AS device, coalesce(e.scope, '') || ' OOM killed pid ' || e.pid
         || coalesce(' (' || e.comm || ')', '') AS detail
FROM step st JOIN oom_kill e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
                             AND e.kind = 'killed'
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'oom_victim', e.id, e.ts, 'oom_kill', e.comm,
       'OOM killer chose pid ' || e.pid || coalesce(' (' || e.comm || ')', '')
FROM step st JOIN oom_victim e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'tcp_retransmit', e.id, e.ts, 'tcp_retransmit',
       e.daddr || ':' || e.dport, e.saddr || ':' || e.sport || ' -> ' || e.daddr || ':' || e.dport
FROM step st JOIN tcp_retransmit e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'gpu_xid', e.id, e.ts, 'gpu_xid', e.device,
       'Xid ' || e.xid || coalesce(': ' || e.meaning, '')
FROM step st JOIN gpu_xid e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'aer_event', e.id, e.ts, 'pcie_aer', coalesce(e.source, e.device),
       trim(coalesce(e.severity, '') || coalesce(' ' || e.error_type, '') || coalesce(' ' || e.bit_name, ''))
FROM step st JOIN aer_event e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'iommu_fault', e.id, e.ts, 'iommu_fault', e.device,
       coalesce(e.reason_text, e.event_type, e.kind)
FROM step st JOIN iommu_fault e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'dma_event', e.id, e.ts,
       CASE e.kind WHEN 'swiotlb_bounce' THEN 'dma_bounce' ELSE e.kind END, e.device,
       coalesce(e.size_bytes || ' bytes', '')
FROM step st JOIN dma_event e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
                              AND e.kind IN ('swiotlb_bounce', 'iommu_fault')
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'swiotlb_event', e.id, e.ts, 'swiotlb_full', e.device,
       e.size_bytes || ' bytes could not be bounced'
FROM step st JOIN swiotlb_event e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts
UNION ALL
SELECT st.step_mark_id, st.session_id, st.step, 'nvme_event', e.id, e.ts, 'nvme_' || e.kind, e.controller,
       CASE e.kind WHEN 'timeout' THEN 'timeout' || coalesce(' on queue ' || e.qid, '')
                                       || coalesce(', request tag ' || e.tag, '') || coalesce(', ' || e.action, '')
                   WHEN 'abort_status' THEN 'abort status ' || iif(e.status IS NULL, 'not printed', printf('0x%x', e.status))
                   WHEN 'controller_down' THEN 'controller down' || iif(e.csts IS NULL, '', printf(', CSTS=0x%x', e.csts))
                   WHEN 'resetting' THEN 'controller reset'
                   WHEN 'not_ready' THEN 'not ready' || coalesce(', ' || e.action, '')
                                         || iif(e.csts IS NULL, '', printf(', CSTS=0x%x', e.csts))
                   WHEN 'reset_failure' THEN 'reset failed' || iif(e.errno IS NULL, '', printf(' (errno %d)', e.errno))
                   ELSE replace(e.kind, '_', ' ') END
FROM step st JOIN nvme_event e ON e.session_id = st.session_id AND e.ts >= st.ts AND e.ts < st.end_ts;

-- view: step_cause_live
-- The rows of step_cause computed from the recorded rows (step_cause reads a complete session's
-- from step_cause_stored, written at the stop from this view).
CREATE VIEW step_cause_live AS
SELECT step_mark_id, 'cpu_wait' AS cause,
       coalesce(contender_name || ' (pid ' || coalesce(contender_pid, '?') || ')', 'unknown') AS detail,
       sum(runq_dur) AS dur, count(*) AS events
FROM step_offcpu WHERE runq_dur > 0 GROUP BY step_mark_id, contender_pid, contender_name
UNION ALL
SELECT step_mark_id, 'blocked', reason, sum(blocked_dur), count(*)
FROM step_offcpu WHERE blocked_dur > 0 GROUP BY step_mark_id, reason
UNION ALL
SELECT step_mark_id, 'reclaim', kind, sum(overlap_dur), count(*) FROM step_reclaim GROUP BY step_mark_id, kind
UNION ALL
SELECT step_mark_id, 'dirty_throttle', bdi, sum(overlap_dur), count(*)
FROM step_dirty_throttle GROUP BY step_mark_id, bdi
UNION ALL
SELECT step_mark_id, 'cuda_call', api, sum(own_excess_dur), count(*)
FROM step_cuda_call WHERE own_excess_dur > 0 GROUP BY step_mark_id, api
UNION ALL
SELECT step_mark_id, 'nccl_wait',
       api || CASE WHEN straggler_rank != rank THEN ' waiting for rank ' || straggler_rank ELSE '' END,
       sum(wait_dur), count(*)
FROM step_nccl_wait GROUP BY 1, 2, 3;

-- view: step_cause
-- The breakdown: for each step, the time of its thread by cause, from the evidence views above.
-- Causes are not exclusive (a slow CUDA call may contain the preemption that made it slow): each
-- row is the time that cause accounts for on the critical path. cause: 'cpu_wait' (detail: the
-- process that held the CPU), 'blocked' (detail: reason - io, futex, sleep, net, poll,
-- uninterruptible...), 'reclaim', 'dirty_throttle', 'cuda_call' (the own excess of the calls of
-- step_cuda_call: on the CPU or blocked inside the library, not waiting for a CPU; detail: API), 'nccl_wait' (detail: API, and the straggler rank when known).
-- A complete session's rows are stored at the stop (step_cause_stored); a session still recording
-- is computed from its rows (step_cause_live).
CREATE VIEW step_cause AS
SELECT step_mark_id,
       cause,                           -- cpu_wait, blocked, reclaim, dirty_throttle, cuda_call, nccl_wait
       detail,                          -- who or what (the process, the reason, the API)
       dur,                             -- ns of the step's thread
       events                           -- rows behind it
FROM step_cause_stored
UNION ALL
SELECT c.step_mark_id, c.cause, c.detail, c.dur, c.events
-- sessions first (CROSS JOIN keeps the order): with every session stored nothing is computed
FROM session u
CROSS JOIN step_mark m ON m.session_id = u.id
CROSS JOIN step_cause_live c ON c.step_mark_id = m.id
WHERE u.id NOT IN (SELECT session_id FROM causal_link_session);

-- view: wait_hop
-- One hop of a wait chain: an off-CPU interval whose thread was woken by another thread -> the
-- waker's own wait that ended while the first thread waited, the one that overlapped its wait the
-- most (at least wait_chain_rule.min_blocked_dur): what the waker was waiting for before it woke
-- it. waker_offcpu_id is NULL when the waker has no such wait (it ran, or is not traced: a kernel
-- thread, an interrupt). A sleep is never followed (its timer ends it). wait_chain
-- (0009_waits.sql) follows these hops.
CREATE VIEW wait_hop AS
SELECT o.session_id, o.id AS offcpu_id, o.thread_id, o.waker_thread_id, o.wakeup_ts,
       -- a thread's intervals never overlap: the waker's waits that ended during ours are those
       -- that started during it and the one last started before it (two index range scans)
       (SELECT id FROM (
            SELECT x.id, x.ts AS at, x.state, x.ts + x.dur AS end_ts,
                   min(coalesce(x.wakeup_ts, x.ts + x.dur), o.wakeup_ts) - max(x.ts, o.ts) AS overlap
            FROM offcpu_interval x
            WHERE x.thread_id = o.waker_thread_id AND x.ts >= o.ts AND x.ts < o.wakeup_ts
            UNION ALL
            SELECT y.id, y.ts, y.state, y.ts + y.dur,
                   min(coalesce(y.wakeup_ts, y.ts + y.dur), o.wakeup_ts) - max(y.ts, o.ts)
            FROM (SELECT * FROM offcpu_interval x
                  WHERE x.thread_id = o.waker_thread_id AND x.ts < o.ts
                    AND x.ts >= o.ts - (SELECT lookback FROM wait_chain_rule)
                  ORDER BY x.ts DESC LIMIT 1) y)
         WHERE end_ts >= (SELECT ts FROM offcpu_interval WHERE id = o.id) AND end_ts <= o.wakeup_ts
           AND state NOT IN (0, 256) AND overlap >= (SELECT min_blocked_dur FROM wait_chain_rule)
         ORDER BY overlap DESC, at DESC LIMIT 1) AS waker_offcpu_id -- the waker's wait (offcpu_interval.id), NULL if none
FROM offcpu_interval o
WHERE o.waker_thread_id IS NOT NULL AND o.waker_thread_id != o.thread_id AND o.wakeup_ts IS NOT NULL
  AND o.state NOT IN (0, 256)
  -- a sleep ends by its timer: its "waker" is whatever task the interrupt found running
  AND NOT EXISTS (SELECT 1 FROM syscall_name n WHERE n.nr = o.syscall AND n.class = 'sleep');

-- view: causal_link_live
-- The rows of causal_link computed from the recorded rows (causal_link reads a complete session's
-- from causal_link_stored, written at the stop from this view).
CREATE VIEW causal_link_live AS
SELECT session_id, 'step_mark' AS from_table, step_mark_id AS from_id, 'off_cpu' AS relation,
       'offcpu_interval' AS to_table, offcpu_id AS to_id, overlap_dur AS dur
FROM step_offcpu
UNION ALL
SELECT o.session_id, 'offcpu_interval', o.id, 'waited_behind', 'thread', o.contender_thread_id, o.contender_run_dur
FROM offcpu_interval o WHERE o.contender_thread_id IS NOT NULL
UNION ALL
SELECT h.session_id, 'offcpu_interval', h.offcpu_id, 'woken_after', 'offcpu_interval', h.waker_offcpu_id,
       min(coalesce(x.wakeup_ts, x.ts + x.dur), h.wakeup_ts) - max(x.ts, o.ts)
FROM wait_hop h JOIN offcpu_interval o ON o.id = h.offcpu_id JOIN offcpu_interval x ON x.id = h.waker_offcpu_id
UNION ALL
SELECT session_id, 'step_mark', step_mark_id, 'slow_call', 'cuda_call', cuda_call_id, excess_dur FROM step_cuda_call
UNION ALL
SELECT c.session_id, 'cuda_call', l.cuda_call_id, 'off_cpu', 'offcpu_interval', l.offcpu_id, l.overlap_dur
FROM cuda_call_offcpu l JOIN cuda_call c ON c.id = l.cuda_call_id
UNION ALL
SELECT session_id, 'step_mark', step_mark_id, 'collective_wait', 'nccl_call', nccl_call_id, wait_dur FROM step_nccl_wait
UNION ALL
SELECT session_id, 'nccl_call', nccl_call_id, 'waited_for_rank', 'nccl_call', straggler_call_id, lateness_dur
FROM step_nccl_wait WHERE straggler_call_id IS NOT NULL AND straggler_call_id != nccl_call_id
UNION ALL
SELECT session_id, 'step_mark', step_mark_id, 'io', 'block_request', block_request_id, overlap_dur
FROM step_block_request
UNION ALL
SELECT session_id, 'block_request', block_request_id, 'hit_by', event_table, event_id, NULL
FROM block_request_device_event
UNION ALL
SELECT session_id, 'step_mark', step_mark_id, 'reclaim', 'reclaim_interval', reclaim_id, overlap_dur FROM step_reclaim
UNION ALL
SELECT session_id, 'step_mark', step_mark_id, 'dirty_throttle', 'dirty_throttle', dirty_throttle_id, overlap_dur
FROM step_dirty_throttle
UNION ALL
SELECT session_id, 'step_mark', step_mark_id, 'during', event_table, event_id, NULL FROM step_machine_event;

-- view: causal_link
-- One drill-down graph over every causal link above: from a row (table, id) to a row it is
-- explained by, with the relation and the ns it accounts for. Start from a step
-- (from_table = 'step_mark') and follow to_table/to_id. 'woken_after' goes from a wait to the
-- waker's own wait before it woke the thread (wait_hop): followed hop by hop it is wait_chain.
-- A complete session's rows are stored at the stop (causal_link_stored, indexed by from_table,
-- from_id); a session still recording is computed from its rows (causal_link_live), and the
-- live part costs nothing once every session of the database is stored.
CREATE VIEW causal_link AS
SELECT session_id,
       from_table,                      -- table of the row explained
       from_id,                         -- its id
       relation,                        -- how the row explains it
       to_table,                        -- table of the explaining row
       to_id,                           -- its id
       dur                              -- ns it accounts for (NULL: an event without a duration)
FROM causal_link_stored
UNION ALL
-- sessions first (CROSS JOIN keeps the order): with every session stored there is no row to
-- join, and nothing is computed
SELECT l.session_id, l.from_table, l.from_id, l.relation, l.to_table, l.to_id, l.dur
FROM session u
CROSS JOIN causal_link_live l ON l.session_id = u.id
WHERE u.id NOT IN (SELECT session_id FROM causal_link_session);

-- view: gpu_util_drop
-- Stretches where a GPU's utilisation (gpu_sample, NVML) fell below half its median over the
-- session, for at least two consecutive samples: the GPU starved, whatever the host was doing.
CREATE VIEW gpu_util_drop AS
WITH ranked AS (
    SELECT session_id, gpu_index, util_gpu,
           row_number() OVER (PARTITION BY session_id, gpu_index ORDER BY util_gpu) AS rn,
           count(*) OVER (PARTITION BY session_id, gpu_index) AS n
    FROM gpu_sample WHERE util_gpu IS NOT NULL
), usual AS (
    SELECT session_id, gpu_index, util_gpu AS median_util FROM ranked WHERE rn = (n + 1) / 2
), marked AS (
    SELECT g.session_id, g.gpu_index, g.pci_address, g.ts, g.util_gpu, u.median_util,
           g.util_gpu < 0.5 * u.median_util AS low,
           row_number() OVER (PARTITION BY g.session_id, g.gpu_index ORDER BY g.ts)
             - row_number() OVER (PARTITION BY g.session_id, g.gpu_index, g.util_gpu < 0.5 * u.median_util
                                  ORDER BY g.ts) AS run
    FROM gpu_sample g JOIN usual u ON u.session_id = g.session_id AND u.gpu_index = g.gpu_index
    WHERE g.util_gpu IS NOT NULL
)
SELECT session_id, gpu_index,
       min(pci_address) AS pci_address,     -- the GPU
       min(ts) AS ts,                       -- ns: first low sample
       max(ts) - min(ts) AS dur,            -- ns: first to last low sample
       count(*) AS samples,                 -- low samples in the stretch
       round(avg(util_gpu), 1) AS util_gpu, -- % average over the stretch
       min(median_util) AS usual_util_gpu   -- % the GPU's median over the session
FROM marked WHERE low
GROUP BY session_id, gpu_index, run
HAVING count(*) >= 2;
