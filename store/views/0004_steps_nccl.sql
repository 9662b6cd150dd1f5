-- Views: steps from markers, NCCL calls with their communicator and step, the wait a collective
-- imposes, and the straggler rank of each collective across ranks merged into one database.
-- Events belong to a step by thread/process and time (the step interval that contains their ts),
-- so no per-event stamping is needed in BPF for same-thread events.

-- view: step
-- One row per step of a marking thread: from its recorder.step(n) call to its next step call. The
-- last step of a thread ends when the thread (or its process) exited, else at the session stop; it
-- is flagged complete = 0, and running = 1 when the thread was still alive at the stop (a step
-- that may still be stalled). Each row
-- finds its end through the (thread_id, ts) index, so filtering on a step is cheap.
CREATE VIEW step AS
SELECT
    m.id AS step_mark_id,               -- step_mark row that began the step
    m.session_id,
    t.process_id,
    m.thread_id,                        -- the thread that called recorder.step
    m.step,                             -- step number
    m.ts,                               -- ns the step began
    coalesce(m.end_ts, m.next_ts, t.exit_ts, p.exit_ts, s.stopped_ts, m.ts) AS end_ts, -- ns the step ended (its
                                        -- own end where the source gives one: an imported ProfilerStep#N)
    coalesce(m.end_ts, m.next_ts, t.exit_ts, p.exit_ts, s.stopped_ts, m.ts) - m.ts AS dur, -- ns
    m.next_ts IS NOT NULL OR m.end_ts IS NOT NULL AS complete, -- 1 when the next step began (or the step's end is
                                        -- known); 0 for a thread's last step
    m.end_ts IS NULL AND m.next_ts IS NULL AND t.exit_ts IS NULL AND p.exit_ts IS NULL AS running, -- 1: last step,
                                        -- thread alive at stop
    m.inferred                          -- 1 when inferred without markers
FROM (SELECT sm.*, (SELECT min(n.ts) FROM step_mark n WHERE n.thread_id = sm.thread_id AND n.ts > sm.ts)
             AS next_ts
      FROM step_mark sm) m
JOIN thread t ON t.id = m.thread_id
LEFT JOIN process p ON p.id = t.process_id
JOIN session s ON s.id = m.session_id;

-- view: step_all
-- The rows of step computed for a whole session at once (the next step through a window function
-- instead of an index lookup per row): the same columns, for listings.
CREATE VIEW step_all AS
SELECT
    m.id AS step_mark_id, m.session_id, t.process_id, m.thread_id, m.step, m.ts,
    coalesce(m.end_ts, m.next_ts, t.exit_ts, p.exit_ts, s.stopped_ts, m.ts) AS end_ts,
    coalesce(m.end_ts, m.next_ts, t.exit_ts, p.exit_ts, s.stopped_ts, m.ts) - m.ts AS dur,
    m.next_ts IS NOT NULL OR m.end_ts IS NOT NULL AS complete,
    m.end_ts IS NULL AND m.next_ts IS NULL AND t.exit_ts IS NULL AND p.exit_ts IS NULL AS running,
    m.inferred
FROM (SELECT sm.*, lead(sm.ts) OVER (PARTITION BY sm.thread_id ORDER BY sm.ts) AS next_ts FROM step_mark sm) m
JOIN thread t ON t.id = m.thread_id
LEFT JOIN process p ON p.id = t.process_id
JOIN session s ON s.id = m.session_id;

-- view: lineage_interval
-- Per thread, the intervals during which a lineage tag was current, with its label.
CREATE VIEW lineage_interval AS
SELECT
    m.session_id, m.thread_id, m.tag,
    l.label,                            -- the label registered for the tag
    m.ts,                               -- ns the tag became current
    coalesce(lead(m.ts) OVER (PARTITION BY m.thread_id ORDER BY m.ts), s.stopped_ts, m.ts) - m.ts AS dur
FROM lineage_mark m
JOIN session s ON s.id = m.session_id
LEFT JOIN lineage_label l ON l.session_id = m.session_id AND l.tag = m.tag;

-- view: nccl_call_detail
-- NCCL calls with API, communicator (hash, rank, world size), and the step of their process.
CREATE VIEW nccl_call_detail AS
SELECT
    c.id, c.session_id, c.ts, c.dur, c.thread_id, c.ret, c.count, c.datatype, c.op, c.peer, c.stream,
    c.open,                             -- 1: had not returned at the stop (a hang)
    a.name AS api, a.kind,
    t.process_id, p.pid,
    k.comm_hash, k.rank, k.nranks,
    -- the process's latest step mark at the call, through the (thread_id, ts) index of each of its
    -- threads (the step view here would scan every mark of the session per call)
    (SELECT m.step FROM step_mark m
      WHERE m.thread_id IN (SELECT x.id FROM thread x WHERE x.process_id = t.process_id) AND m.ts <= c.ts
      ORDER BY m.ts DESC LIMIT 1) AS step
FROM nccl_call c
JOIN nccl_api a ON a.id = c.api_id
JOIN thread t ON t.id = c.thread_id
LEFT JOIN process p ON p.id = t.process_id
LEFT JOIN nccl_comm k ON k.process_id = t.process_id AND k.handle = c.handle;

-- view: nccl_collective
-- Collectives numbered per rank and communicator in call order (seq), which is how NCCL matches
-- them across ranks: the n-th collective of every rank is the same operation.
CREATE VIEW nccl_collective AS
SELECT *,
       row_number() OVER (PARTITION BY session_id, process_id, comm_hash ORDER BY ts) AS seq
FROM nccl_call_detail
WHERE kind = 'collective';

-- view: nccl_straggler
-- For each collective (communicator, seq) seen from more than one rank: the rank that arrived
-- last (the straggler), how late it was, and how long the others waited in the call.
CREATE VIEW nccl_straggler AS
WITH arrivals AS (
    SELECT comm_hash, seq, api, step, rank, pid, ts, dur,
           max(ts) OVER (PARTITION BY comm_hash, seq) AS last_ts,
           min(ts) OVER (PARTITION BY comm_hash, seq) AS first_ts,
           count(*) OVER (PARTITION BY comm_hash, seq) AS ranks_seen,
           row_number() OVER (PARTITION BY comm_hash, seq ORDER BY ts DESC) AS late_order
    FROM nccl_collective
    WHERE comm_hash IS NOT NULL
)
SELECT
    comm_hash,                          -- communicator
    seq,                                -- n-th collective on it
    api,                                -- e.g. 'ncclAllReduce'
    step,                               -- step of the straggler's process at the call
    rank AS straggler_rank,             -- rank that entered the collective last
    pid AS straggler_pid,
    last_ts - first_ts AS lateness_dur, -- ns between the first and the last rank entering
    ranks_seen,                         -- ranks recorded for this collective
    ts AS straggler_ts                  -- ns the straggler entered
FROM arrivals
WHERE late_order = 1 AND ranks_seen > 1;

-- view: nccl_collective_wait
-- The wait a collective imposes on its rank: the collective call itself plus the first
-- cudaStreamSynchronize on the same thread and stream after it (NCCL enqueues asynchronously, so
-- on a real GPU the wait shows up in that synchronisation).
CREATE VIEW nccl_collective_wait AS
SELECT
    n.id AS nccl_call_id, n.api, n.rank, n.pid, n.step, n.ts, n.dur AS call_dur,
    s.id AS sync_call_id,               -- cuda_call of the synchronisation, NULL if none followed
    coalesce(s.dur, 0) AS sync_dur,     -- ns in that synchronisation
    n.dur + coalesce(s.dur, 0) AS wait_dur -- ns the rank waited for the collective
FROM nccl_collective n
LEFT JOIN cuda_call s ON s.id = (
    SELECT c.id FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id
    WHERE c.thread_id = n.thread_id AND c.ts >= n.ts + n.dur AND c.stream = n.stream
      AND a.family IN ('cudaStreamSynchronize', 'cuStreamSynchronize')
    ORDER BY c.ts LIMIT 1);
