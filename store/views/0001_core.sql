-- Views v1: names for threads, off-CPU intervals with their reason, CUDA call baselines, and the
-- causal links from a slow CUDA call to the off-CPU time inside it. Plain SQL: usable from the
-- sqlite3 shell. ts and dur are ns of CLOCK_MONOTONIC throughout.

-- view: thread_info
-- Every thread with its process.
CREATE VIEW thread_info AS
SELECT
    t.id AS thread_id,                  -- thread.id
    t.session_id,
    t.tid,                              -- kernel task id
    p.pid,                              -- process id (NULL if unknown)
    coalesce(t.name, p.name) AS thread_name, -- comm of the thread (its process's when it was never read)
    coalesce(p.name, t.name) AS process_name, -- comm of the process's main thread
    p.cmdline,                          -- command line of the process
    t.traced                            -- 1 for threads of the targets
FROM thread t
LEFT JOIN process p ON p.id = t.process_id;

-- view: offcpu
-- Off-CPU intervals with the reason they happened, split into the time the thread was blocked
-- and the time it then waited for a CPU (run-queue wait), and who was involved.
--   reason: 'preempted' (runnable, another task took the CPU), 'futex', 'sleep', 'poll', 'io'
--   (waiting inside a file or block syscall), 'net', 'uninterruptible' (D state elsewhere, e.g.
--   page faults or reclaim), 'blocked' (other sleeps), 'yield', 'stopped'.
CREATE VIEW offcpu AS
SELECT
    o.id, o.session_id, o.ts, o.dur, o.thread_id, o.cpu, o.in_cpu, o.state, o.open,
    s.letter AS state_letter,           -- R+, S, D, ... as ps prints it
    CASE
        WHEN o.state = 0 AND o.syscall = 24 THEN 'yield'
        -- runnable when switched out: involuntary preemption (R+), or rescheduled on the way back
        -- to user space (R), which is a preemption too from the thread's point of view
        WHEN o.state IN (0, 256) THEN 'preempted'
        WHEN o.state IN (4, 8) THEN 'stopped'
        WHEN sc.class = 'futex' THEN 'futex'
        WHEN sc.class = 'sleep' THEN 'sleep'
        WHEN sc.class = 'poll' THEN 'poll'
        WHEN sc.class = 'net' THEN 'net'
        WHEN sc.class = 'io' THEN 'io'
        WHEN o.state = 2 THEN 'uninterruptible'
        ELSE 'blocked'
    END AS reason,
    -- ns runnable but not running: all of a preemption, or from wakeup to switch-in
    CASE WHEN o.state IN (0, 256) THEN o.dur
         WHEN o.wakeup_ts IS NOT NULL THEN o.ts + o.dur - max(o.wakeup_ts, o.ts)
         ELSE 0 END AS runq_dur,
    o.wakeup_ts,                        -- ns it became runnable again, NULL if it never slept
    o.syscall,                          -- syscall number in progress, NULL if none
    sc.name AS syscall_name,            -- its name where known
    n.tid AS next_tid,                  -- task that took the CPU at switch-out
    np.pid AS next_pid,                 -- its process
    n.name AS next_name,                -- its comm
    coalesce(np.name, n.name) AS next_process_name,
    b.tid AS contender_tid,             -- task that ran longest on the CPU while it was runnable
    bp.pid AS contender_pid,
    coalesce(bp.name, b.name) AS contender_name,
    o.contender_run_dur,                -- ns that task ran meanwhile
    w.tid AS waker_tid,                 -- task that woke it
    wp.pid AS waker_pid,
    coalesce(w.name, o.waker_context) AS waker_name, -- its name, or 'timer', 'interrupt', 'softirq'
    o.waker_cpu,
    o.waker_context                     -- 'timer', 'interrupt', 'softirq': no task woke it
FROM offcpu_interval o
LEFT JOIN task_state s ON s.state = o.state
LEFT JOIN syscall_name sc ON sc.nr = o.syscall
-- threads and processes by primary key (through thread_info a LEFT JOIN would be materialised)
LEFT JOIN thread n ON n.id = o.next_thread_id
LEFT JOIN process np ON np.id = n.process_id
LEFT JOIN thread b ON b.id = o.contender_thread_id
LEFT JOIN process bp ON bp.id = b.process_id
LEFT JOIN thread w ON w.id = o.waker_thread_id
LEFT JOIN process wp ON wp.id = w.process_id;

-- view: cuda_call_named
-- cuda_call with the API's name, family and library spelled out.
CREATE VIEW cuda_call_named AS
SELECT c.*, a.name AS api, a.family, a.library
FROM cuda_call c
JOIN cuda_api a ON a.id = c.api_id;

-- view: cuda_baseline
-- The expected duration of a CUDA call: the median of the same API family and size class
-- (power-of-two bucket of size_bytes, -1 for calls without a size) over the session. Stored when
-- a session stops (cuda_baseline_stored); computed here for sessions still recording or killed.
CREATE VIEW cuda_baseline AS
SELECT session_id, family, size_class, calls, median_dur FROM cuda_baseline_stored
UNION ALL
SELECT session_id, family, size_class, max(n) AS calls, CAST(avg(dur) AS INTEGER) AS median_dur
FROM (
    SELECT c.session_id, a.family, coalesce(c.size_class, -1) AS size_class, c.dur,
           row_number() OVER (PARTITION BY c.session_id, a.family, coalesce(c.size_class, -1)
                              ORDER BY c.dur) AS rn,
           count(*) OVER (PARTITION BY c.session_id, a.family, coalesce(c.size_class, -1)) AS n
    FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id
    WHERE c.session_id NOT IN (SELECT session_id FROM cuda_baseline_stored)
      AND c.open = 0                    -- a call in flight at the stop has no duration of its own
)
WHERE rn IN ((n + 1) / 2, (n + 2) / 2)   -- the middle one or two: the median
GROUP BY session_id, family, size_class;

-- view: cuda_call_offcpu
-- Causal link: a CUDA call -> each off-CPU interval of the same thread inside it, with the part of
-- the call spent blocked and the part spent waiting for a CPU. A thread is on the CPU when it
-- enters a call, so every overlapping interval starts inside the call.
CREATE VIEW cuda_call_offcpu AS
SELECT
    c.id AS cuda_call_id,
    o.id AS offcpu_id,
    o.reason,
    min(c.ts + c.dur, o.ts + o.dur) - o.ts AS overlap_dur, -- ns of the call spent in this interval
    -- ns of the call spent runnable, waiting for the CPU (clipped to the call)
    max(0, min(c.ts + c.dur, o.ts + o.dur) - (o.ts + o.dur - o.runq_dur)) AS runq_overlap_dur,
    -- the task the thread waited behind: the one that ran longest on its CPU meanwhile
    -- the contender's pid and name, else (no contender found) the task that took the CPU: both of
    -- one task, never a pid of one and the name of another
    CASE WHEN o.contender_tid IS NOT NULL THEN o.contender_pid ELSE o.next_pid END AS contender_pid,
    CASE WHEN o.contender_tid IS NOT NULL THEN o.contender_name
         ELSE coalesce(o.next_process_name, o.next_name) END AS contender_name,
    o.in_cpu AS contended_cpu
FROM cuda_call c
JOIN offcpu o ON o.thread_id = c.thread_id AND o.ts >= c.ts AND o.ts < c.ts + c.dur;

-- view: cuda_call_detail
-- Every CUDA call with its thread, its baseline and the off-CPU time inside it. The off-CPU
-- columns are computed per row shown (correlated on the (thread_id, ts) index), so filtering
-- first, as slow_cuda_call does, keeps this cheap on large sessions.
CREATE VIEW cuda_call_detail AS
SELECT
    c.id, c.session_id, c.ts, c.dur, c.api, c.family, c.library, c.ret, c.size_bytes, c.stream,
    c.function, c.pointer, c.thread_id,
    c.open,                             -- 1: had not returned at the stop (a hang; the report's own part)
    t.tid, t.pid, t.thread_name, t.process_name,
    c.expected_dur,                     -- ns, baseline of the family and size class
    c.baseline_calls,                   -- calls the baseline is taken over
    c.dur - c.expected_dur AS excess_dur, -- ns above the baseline
    (SELECT coalesce(sum(min(c.ts + c.dur, o.ts + o.dur) - o.ts), 0) FROM offcpu_interval o
      WHERE o.thread_id = c.thread_id AND o.ts >= c.ts AND o.ts < c.ts + c.dur
    ) AS offcpu_dur,                    -- ns of the call spent off-CPU
    (SELECT coalesce(sum(max(0, min(c.ts + c.dur, o.ts + o.dur) - (o.ts + o.dur - (
                CASE WHEN o.state IN (0, 256) THEN o.dur
                     WHEN o.wakeup_ts IS NOT NULL THEN o.ts + o.dur - max(o.wakeup_ts, o.ts)
                     ELSE 0 END)))), 0)
       FROM offcpu_interval o
      WHERE o.thread_id = c.thread_id AND o.ts >= c.ts AND o.ts < c.ts + c.dur
    ) AS cpu_wait_dur,                  -- of which runnable, waiting for a CPU
    (SELECT count(*) FROM offcpu_interval o
      WHERE o.thread_id = c.thread_id AND o.ts >= c.ts AND o.ts < c.ts + c.dur
        AND o.state IN (0, 256) AND coalesce(o.syscall, -1) != 24
    ) AS preemptions                    -- times it was preempted inside the call
FROM (
    -- the baseline looked up per row shown: the stored one by primary key (a complete session),
    -- else the computed one; a filtered query does not compute every baseline of the session
    SELECT n.*,
        coalesce((SELECT x.median_dur FROM cuda_baseline_stored x WHERE x.session_id = n.session_id
                     AND x.family = n.family AND x.size_class = coalesce(n.size_class, -1)),
                 (SELECT b.median_dur FROM cuda_baseline b WHERE b.session_id = n.session_id
                     AND b.family = n.family AND b.size_class = coalesce(n.size_class, -1))) AS expected_dur,
        coalesce((SELECT x.calls FROM cuda_baseline_stored x WHERE x.session_id = n.session_id
                     AND x.family = n.family AND x.size_class = coalesce(n.size_class, -1)),
                 (SELECT b.calls FROM cuda_baseline b WHERE b.session_id = n.session_id
                     AND b.family = n.family AND b.size_class = coalesce(n.size_class, -1))) AS baseline_calls
    FROM cuda_call_named n
) c
JOIN thread_info t ON t.thread_id = c.thread_id;

-- view: slow_cuda_call
-- CUDA calls that took at least slow_call_rule.ratio (2) x their baseline and min_excess_dur
-- (200 us) more, over a baseline of at least min_baseline_calls (3) calls: the thresholds are the
-- row of slow_call_rule (migration 0010), so a report quotes what it applied. A call that had not
-- returned at the stop (open = 1; also reported as a hang, store/analysis/hangs.py) is slow once the time it
-- had been in flight is: its dur is a lower bound.
-- blocked_dur: ns of the call off-CPU but not waiting for a CPU (sleeping, I/O, futex).
CREATE VIEW slow_cuda_call AS
SELECT *, offcpu_dur - cpu_wait_dur AS blocked_dur
FROM cuda_call_detail
WHERE baseline_calls >= (SELECT min_baseline_calls FROM slow_call_rule)
  AND dur >= (SELECT ratio FROM slow_call_rule) * expected_dur
  AND excess_dur >= (SELECT min_excess_dur FROM slow_call_rule);

-- view: cuda_call_contender
-- For each CUDA call, the processes that kept its thread from the CPU while it was runnable
-- (preempting it, or running when it woke up): how often, for how long, on which CPUs.
CREATE VIEW cuda_call_contender AS
SELECT
    cuda_call_id,
    contender_pid,                      -- process that had the CPU
    contender_name,                     -- its name
    sum(reason = 'preempted') AS preemptions, -- times it preempted the thread
    sum(reason != 'preempted') AS delayed_wakeups, -- times the thread woke up and waited behind it
    sum(runq_overlap_dur) AS cpu_wait_dur, -- ns the call waited for the CPU behind it
    group_concat(DISTINCT contended_cpu) AS cpus -- CPUs where it happened
FROM cuda_call_offcpu
WHERE runq_overlap_dur > 0
GROUP BY cuda_call_id, contender_pid, contender_name;
